"""What ``vllm-fastload bench --engine sglang`` and the SGLang server tests read from a server's log
and make of it (no SGLang needed: the lines are as SGLang 0.5.23 and fastload write them), and the
process-session helpers that stop a server with everything it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vllm_fastload.bench import sglang as bench
from vllm_fastload.bench.targets import line, parse_targets
from vllm_fastload.tools.processes import session_processes, stop_session
from vllm_fastload.tools.sglang_server import StartLog, omp_binding

TP2_LOG = """\
[2026-11-28 00:11:57] fastload: early reads: 4 checkpoint files (1.67 GB) into the page cache while SGLang starts
[2026-11-28 00:12:52 TP0] Load weight begin. avail mem=19.27 GB
[2026-11-28 00:12:52] fastload: early reads: stopped after 54.71 s, when the load began; 1.46 of 1.67 GB read early
[2026-11-28 00:12:54 TP1] fastload rank 1/2: read 835.9 MB of 1671.6 MB checkpoint (0.500, 1.000x the 835.9 MB it keeps)
[2026-11-28 00:12:54 TP1] Load weight end. elapsed=1.32 s, type=LlamaForCausalLM, avail mem=17.62 GB, mem usage=1.59 GB.
[2026-11-28 00:12:54 TP0] fastload rank 0/2: read 835.9 MB of 1671.6 MB checkpoint (0.500, 1.000x the 835.9 MB it keeps)
[2026-11-28 00:12:54 TP0] Load weight end. elapsed=2.53 s, type=LlamaForCausalLM, avail mem=17.59 GB, mem usage=1.68 GB.
"""
TP1_LOG = """\
[2026-11-28 00:07:45] fastload: early reads: 4 checkpoint files (1.67 GB) into the page cache while SGLang starts
[2026-11-28 00:07:50] fastload: early reads: 4 of 4 files in the page cache after 4.49 s
[2026-11-28 00:08:26] Load weight begin. avail mem=19.35 GB
[2026-11-28 00:08:27] fastload rank 0/1: read 1671.6 MB of 1671.6 MB checkpoint (1.000, 1.000x the 1671.6 MB it keeps)
[2026-11-28 00:08:27] Load weight end. elapsed=1.17 s, type=LlamaForCausalLM, avail mem=17.7 GB, mem usage=1.6 GB.
"""
DEFAULT_LOG = "[2026-11-28 00:15:57] Load weight end. elapsed=3.78 s, type=LlamaForCausalLM, avail mem=1 GB\n"
#: SGLang's default loader at TP=2: rank 0's progress bar, without a line break, then rank 1's line.
DEFAULT_TP2_LOG = """\
Multi-thread loading shards:  75% Completed | 3/4 [00:01<00:00,  1.70it/s][2026-11-28 03:08:36 TP1] Load weight end. \
elapsed=2.52 s, type=LlamaForCausalLM, avail mem=19.54 GB
Multi-thread loading shards: 100% Completed | 4/4 [00:02<00:00,  1.70it/s]
[2026-11-28 03:08:36 TP0] Load weight end. elapsed=2.58 s, type=LlamaForCausalLM, avail mem=19.50 GB
"""


def test_each_ranks_numbers_and_the_early_reads_are_read_from_the_log():
    tp2 = StartLog.parse(TP2_LOG)
    assert tp2.load_s == {0: 2.53, 1: 1.32} and tp2.read_share == {0: 0.5, 1: 0.5}
    assert (tp2.early_starts, tp2.early_gb, tp2.early_total_gb) == (1, 1.46, 1.67)
    tp1 = StartLog.parse(TP1_LOG)
    assert tp1.load_s == {0: 1.17} and tp1.early_gb == 1.67  # finished before the load: all of it
    default = StartLog.parse(DEFAULT_LOG)
    assert default.load_s == {0: 3.78} and default.read_share == {} and default.early_gb is None
    assert StartLog.parse(DEFAULT_TP2_LOG).load_s == {0: 2.58, 1: 2.52}  # a line after a progress bar too


def _row(tp: int, cache: str, loader: str, load: float, ready: float, share: tuple = ()) -> dict:
    return {"tp": tp, "cache": cache, "loader": loader, "runs": 1, "load_s": [load], "load_median": load,
            "ready_s": [ready], "ready_median": ready, "read_share": list(share), "early_gb_median": None}


def test_the_targets_are_judged_from_the_medians_and_a_loader_that_did_not_start_is_named():
    rows = [_row(2, "warm", "fastload", 0.5, 20.0, (0.5, 0.5)), _row(2, "warm", "safetensors", 0.9, 20.0),
            _row(2, "cold", "fastload", 0.55, 21.0, (0.5, 0.5)), _row(2, "cold", "safetensors", 1.5, 22.0),
            {"tp": 2, "cache": "cold", "loader": "safetensors-overlap", "runs": 0,
             "error": "ValueError: --startup-weight-load-mode=overlap is not supported: CUDA only"}]
    verdicts = [line(v) for v in bench.verdicts(rows, [2])]
    assert ("  [ok] weights-cold-warm tp2: 1.100 (limit <= 1.15; weight load 0.55 s (cold fastload) / 0.50 s "
            "(warm fastload))") in verdicts
    assert ("  [ok] weights-cold tp2: 0.367 (limit <= 0.5; weight load 0.55 s (cold fastload) / 1.50 s "
            "(cold safetensors))") in verdicts
    assert any(v.startswith("  [n/a] weights-cold-overlap tp2: not measured (limit <= 0.9; cold safetensors-overlap: "
                            "ValueError: --startup-weight-load-mode=overlap is not supported")
               for v in verdicts)
    assert ("  [ok] weights-warm tp2: 0.556 (limit <= 1; weight load 0.50 s (warm fastload) / 0.90 s "
            "(warm safetensors))") in verdicts
    assert ("  [ok] ready-cold tp2: 0.955 (limit <= 1; ready 21.00 s (cold fastload) / 22.00 s (cold safetensors), "
            "1.00 s saved)") in verdicts
    assert "  [ok] share-tp2 tp2: 0.500 (limit <= 0.56; the largest share of the checkpoint a fastload rank read)" \
        in verdicts
    table = bench.table(rows)
    assert "| 2 | cold | fastload | 0.55 (0.55-0.55) | 0.37x | 21.0 (21.0-21.0) | 0.95x | 0.500 / 0.500 | - |" in table
    assert "| 2 | cold | safetensors-overlap | did not start: ValueError" in table


def test_a_missed_target_says_so():
    rows = [_row(1, "warm", "fastload", 0.5, 20.0), _row(1, "cold", "fastload", 0.8, 20.0)]
    assert ("  [MISSED] weights-cold-warm tp1: 1.600 (limit <= 1.15; weight load 0.80 s (cold fastload) / 0.50 s "
            "(warm fastload))") in [line(v) for v in bench.verdicts(rows, [1])]


def test_each_rank_gets_cpus_of_its_own():
    cpus = sorted(os.sched_getaffinity(0))
    groups = [group.split(",") for group in omp_binding(2).split("|")]
    assert len(groups) == 2 and all(groups)
    if len(cpus) >= 2:
        assert not set(groups[0]) & set(groups[1])
    assert omp_binding(1) == ",".join(str(c) for c in cpus)


def test_stopping_a_session_ends_what_its_leader_left_behind():
    """A server's launcher that ended leaves its children in its session: they are found, and ended."""
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, "
                               "'-c', 'import time; time.sleep(600)']); print('started', flush=True)"],
                              stdout=subprocess.PIPE, start_new_session=True)
    assert leader.stdout is not None and leader.stdout.readline().strip() == b"started"
    leader.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not session_processes(leader.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = session_processes(leader.pid)
    assert len(left) == 1 and "time.sleep(600)" in left[0]
    stop_session(leader.pid, timeout=10)
    assert session_processes(leader.pid) == []


def test_targets_asked_for_are_missed_where_not_measured():
    wanted = parse_targets("weights-cold-overlap,share-tp2=0.6", bench.TARGETS, where=" for --engine sglang")
    assert wanted == {"weights-cold-overlap": 0.9, "share-tp2": 0.6}
    got = bench.verdicts([_row(1, "cold", "fastload", 0.5, 20.0)], [1], wanted)
    assert [(v["target"], v["ok"]) for v in got] == [("weights-cold-overlap", False), ("share-tp2", False)]
    with pytest.raises(SystemExit, match="unknown target 'weights' for --engine sglang"):
        parse_targets("weights", bench.TARGETS, where=" for --engine sglang")
