"""``vllm-fastload bench --source``: argument parsing, loader selection and the network targets."""

from __future__ import annotations

import pytest

from vllm_fastload.bench import vllm as bench
from vllm_fastload.bench.loaders import LOADERS
from vllm_fastload.cli import build_parser


def test_source_arguments_parse() -> None:
    args = build_parser().parse_args(["bench", "--source", "sshfs", "--sshfs-options", "max_conns=4", "--tp", "1,2"])
    assert (args.source, args.sshfs_options, args.cache, args.tp) == ("sshfs", "max_conns=4", None, "1,2")
    assert build_parser().parse_args(["bench"]).source == "local"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--source", "nfs"])


def test_sshfs_measures_fastload_against_default_and_prefetch() -> None:
    names, _ = bench.select_loaders("sshfs", None)
    assert names == ["fastload", "safetensors", "safetensors-prefetch"]
    assert LOADERS["safetensors-prefetch"].vllm_args == {"safetensors_load_strategy": "prefetch"}
    assert bench.SOURCE_CACHE["sshfs"] == "cold"
    assert bench.select_loaders("sshfs", "fastload,zerofill")[0] == ["fastload", "zerofill"]
    with pytest.raises(SystemExit, match="unknown loader"):
        bench.select_loaders("sshfs", "fastload,prefetch")
    with pytest.raises(SystemExit, match="needs --source s3"):
        bench.select_loaders("sshfs", "safetensors+download")
    local, _ = bench.select_loaders("local", None)  # the local benchmark measures what it always did
    assert "safetensors" in local and "safetensors+download" not in local and "safetensors-prefetch" not in local


def test_vllm_knows_the_prefetch_strategy() -> None:
    """The spelling the benchmark passes is one vLLM accepts (a rename would fail every prefetch row)."""
    load = pytest.importorskip("vllm.config.load", reason="vLLM is not installed")
    assert load.LoadConfig(safetensors_load_strategy="prefetch").safetensors_load_strategy == "prefetch"


def _row(tp: str, loader: str, median: float, disk: int = 0) -> dict:
    return {"tp": tp, "cache": "cold", "loader": loader, "runs": 3, "seconds_median": median,
            "seconds_min": median, "seconds_max": median, "rchar_per_rank": 0, "disk_read_per_rank": disk,
            "peak_rss_mb": 1.0, "checkpoint_bytes": 1000}


def test_network_targets() -> None:
    targets = bench.parse_targets("all", "sshfs")
    assert targets == {"netfs-default": 0.7, "netfs-prefetch": 1.0}
    targets["disk-tp2"] = 0.56
    assert "netfs-default" not in bench.parse_targets("all")  # a local run is not judged on them
    rows = [_row("tp1", "fastload", 2.0), _row("tp1", "safetensors", 4.0), _row("tp1", "safetensors-prefetch", 1.9),
            _row("tp2", "fastload", 1.0, disk=500), _row("tp2", "safetensors", 1.2),
            _row("tp2", "safetensors-prefetch", 3.0)]
    got = {(v["target"], v["tp"]): v for v in bench.check_targets(rows, targets)}
    assert got[("netfs-default", "tp1")]["ok"] and got[("netfs-default", "tp1")]["value"] == pytest.approx(0.5)
    assert not got[("netfs-prefetch", "tp1")]["ok"]  # 2.0 s vs 1.9 s: slower than prefetch
    assert not got[("netfs-default", "tp2")]["ok"] and got[("netfs-prefetch", "tp2")]["ok"]
    assert got[("disk-tp2", "tp2")]["ok"]
    missing = bench.check_targets(rows[:1], {"netfs-prefetch": 1.0})
    assert missing == [{"target": "netfs-prefetch", "tp": "tp1", "value": None, "limit": 1.0, "ok": False,
                        "detail": "rows not measured"}]


def test_two_node_arguments_and_targets() -> None:
    """``bench --nodes 2``: the layouts and loaders it runs, and its targets judged from its rows."""
    from vllm_fastload.bench import multinode

    args = build_parser().parse_args(["bench", "--nodes", "2", "--source", "sshfs", "--layout", "tp"])
    assert (args.nodes, args.layout) == (2, "tp")
    assert build_parser().parse_args(["bench"]).nodes == 1
    assert multinode.SOURCE_LOADERS["sshfs"] == ["fastload", "fastload-early", "safetensors", "safetensors-prefetch"]
    assert multinode._cli_flags({"pipeline_parallel_size": 2, "enforce_eager": False, "x": {"a": 1}, "flag": True}) \
        == ["--pipeline-parallel-size", "2", "--x", '{"a": 1}', "--flag"]
    run = {"ranks": [{"rank": 0, "seconds": 1.0, "own_cached": 0.95}, {"rank": 1, "seconds": 2.0}],
           "ready_s": 30.0, "pulled": [500, 520], "early_layers": [0.5, None]}
    base = {**run, "ranks": [{"rank": 0, "seconds": 4.0}, {"rank": 1, "seconds": 4.0}], "pulled": [1000, 1000],
            "early_layers": [None, None]}
    rows = multinode.summarize({"fastload": [run], "safetensors": [base], "safetensors-prefetch": [{"error": "x"}]},
                               1000)
    assert rows[0]["pulled_median"] == pytest.approx(1.02) and rows[0]["seconds_median"] == 2.0
    assert rows[2] == {"loader": "safetensors-prefetch", "error": "x"}
    got = {v["target"]: v for v in multinode.check(rows, multinode.parse_targets("all"), "pp")}
    assert got["nodes-bytes"]["ok"] and "safetensors: 2.00x" in got["nodes-bytes"]["detail"]
    assert got["nodes-default"]["ok"] and got["nodes-default"]["value"] == pytest.approx(0.5)
    assert not got["nodes-prefetch"]["ok"] and got["nodes-prefetch"]["value"] is None  # its row failed
    assert got["nodes-early"]["ok"] and got["nodes-cached"]["value"] == pytest.approx(-0.95)
    with pytest.raises(SystemExit, match="unknown target"):
        multinode.parse_targets("nodes-bytez")


def test_two_node_data_parallel_layout() -> None:
    """``--layout dp-ep``: a replica of an MoE per node with expert parallelism, node 0 vLLM's
    OpenAI server (``LLM(...)`` refuses data parallelism), node 1 headless; fastload without the
    replicas' exchange measured beside, and judged against."""
    from vllm_fastload.bench import multinode

    args = build_parser().parse_args(["bench", "--nodes", "2", "--source", "s3", "--layout", "dp-ep"])
    assert args.layout == "dp-ep"
    layout = multinode.LAYOUTS["dp-ep"]
    assert layout.ranks == 2 and multinode.LAYOUT_MODELS["dp-ep"] == "netfs-mixtral"
    kwargs = {"nnodes": 2, **layout.kwargs()}
    head = multinode._serve_command("/m", "fastload-no-dp-exchange", 1, {**kwargs, "port": 8123}, node_rank=0)
    node1 = multinode._serve_command("/m", "fastload", 1, kwargs, node_rank=1)
    assert head[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--headless" not in head
    assert node1[1:4] == ["-m", "vllm_fastload.bench.start_vllm", "--headless"]
    for cmd in (head, node1):
        flags = " ".join(cmd)
        assert "--data-parallel-size 2 --data-parallel-size-local 1 --enable-expert-parallel" in flags, flags
    assert '"dp_exchange": "never"' in " ".join(head) and "--port 8123" in " ".join(head)
    assert "--node-rank 0" in " ".join(head) and "--node-rank 1" in " ".join(node1)
    fast = {"ranks": [{"rank": 0, "seconds": 2.0}, {"rank": 1, "seconds": 3.0}], "ready_s": 40.0,
            "pulled": [600, 600], "early_layers": [None, None]}
    alone = {**fast, "ranks": [{"rank": 0, "seconds": 5.0}, {"rank": 1, "seconds": 6.0}], "pulled": [900, 900]}
    rows = multinode.summarize({"fastload": [fast], "fastload-no-dp-exchange": [alone]}, 1200)
    got = {v["target"]: v for v in multinode.check(rows, multinode.parse_targets("nodes-dp-exchange,nodes-bytes"),
                                                   "dp-ep")}
    assert got["nodes-dp-exchange"]["ok"] and got["nodes-dp-exchange"]["value"] == pytest.approx(0.5)
    assert got["nodes-bytes"]["value"] == pytest.approx(1.0)


def test_bytes_an_sshfs_server_sent_are_counted_per_mount(local_checkpoint) -> None:
    """``netfs.served_bytes``: each mount's own server, counted on the server side (the benchmark's
    bytes per node); a file read through one mount counts there and not at the other."""
    from tests.netfs.conftest import require_sshfs
    from vllm_fastload.bench import netfs

    require_sshfs()
    shard = sorted(local_checkpoint.glob("*.safetensors"))[0]
    with netfs.sshfs_mount(local_checkpoint) as one, netfs.sshfs_mount(local_checkpoint) as two:
        before = netfs.served_bytes(one), netfs.served_bytes(two)
        data = (one / shard.name).read_bytes()
        after = netfs.served_bytes(one), netfs.served_bytes(two)
    assert len(data) == shard.stat().st_size
    assert len(data) <= after[0] - before[0] < 1.2 * len(data) + (1 << 20)  # the data, SFTP headers, read-ahead
    assert after[1] - before[1] < 64 << 10
