"""The slicing geometry, proven per shape, rank and reader setting (property-based, hypothesis).

For every write pattern vLLM's weight loaders make (``patterns``), hypothesis draws shapes,
dtypes, a tensor-parallel size of 1-8 and the reader's options; then for every rank of that size
the parameters fastload fills (``rank.load_rank``: the probe, the plan's reads and replays, the
same code the vLLM loader runs) must equal, byte for byte, what the same vLLM layer's own
``weight_loader`` writes from the real tensors on that rank. The layers are vLLM's, built as on a
real rank (``layers.on_rank``); nothing here re-implements a slice.

A failing case prints its minimal reproduction: the pattern, shapes, rank count and reader
options hypothesis shrank it to, and the first parameter and rank that differ.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import vllm_fastload
from vllm_fastload import LoadReport
from vllm_fastload.config import FastloadConfig
from vllm_fastload.model import coverage
from vllm_fastload.model.probe import probe_model
from vllm_fastload.model.rank import load_rank
from vllm_fastload.tensors import dtype_of, shape_of

from . import patterns
from .layers import Case, ThreadCollectives, on_rank, parameter_bytes, vllm_context

#: Examples per pattern in one run (the run's totals are printed at the end of the session).
EXAMPLES = int(os.environ.get("GEOMETRY_EXAMPLES", "300"))
#: Examples run (each over every rank of its size) and ways in taken, per pattern: see ``conftest``.
EXAMPLES_RUN: Counter = Counter()
PATHS_TAKEN: Counter = Counter()

#: The reader's options: row by row or through the gaps (``strided_min_skip``), page cache or
#: O_DIRECT (with the file evicted or not), mapped views, and buffer sizes small enough to split
#: tensors across reads and chunks.
READER = st.fixed_dictionaries({
    "strided_min_skip": st.sampled_from([None, 0, 16, 4096, 1 << 40]),
    "direct_io": st.sampled_from(["auto", "always", "never"]),
    "map_cached": st.booleans(),
    "read_size": st.sampled_from([4096, 16384, 1 << 20]),
    "aggregate_size": st.sampled_from([16384, 65536, 8 << 20]),
    "budget_chunks": st.sampled_from([2, 8]),
    "threads": st.integers(1, 4),
})
LAYOUT = st.fixed_dictionaries({"files": st.integers(1, 2), "evict": st.booleans()})


def _config(reader: dict, **extra) -> FastloadConfig:
    options = dict(reader)
    chunks = options.pop("budget_chunks")
    options["read_size"] = min(options["read_size"], options["aggregate_size"])
    options["memory_budget"] = chunks * options["aggregate_size"] + options["threads"] * (options["read_size"] + 8192)
    if options["strided_min_skip"] is None:
        del options["strided_min_skip"]
    return FastloadConfig.build({**options, "progress": False, **extra})


def _write(case: Case, root: Path, files: int, evict: bool) -> str:
    """The checkpoint as safetensors files (two: with an index), evicted from the page cache if asked."""
    names = list(case.tensors)
    shards = [names[i::files] for i in range(files)] if files > 1 else [names]
    shards = [s for s in shards if s]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: case.tensors[n].contiguous() for n in shard}, root / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        if evict:
            fd = os.open(root / fname, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if len(shards) > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(root)


def _differences(case: Case, rank: int, want: dict[str, bytes], got: dict[str, bytes], report: LoadReport) -> str:
    wrong = [n for n in want if got.get(n) != want[n]]
    if not wrong:
        return ""
    first = wrong[0]
    at = next(i for i, (a, b) in enumerate(zip(want[first], got[first])) if a != b) if len(want[first]) == len(
        got[first]) else "size"
    return (f"rank {rank} of {case.world}: {len(wrong)} parameters differ, first {first} (byte {at}); "
            f"{case!r}; fastload: {report.line()}")


def _check(case: Case, reader: dict, layout: dict, label: str | None = None, **extra) -> None:
    """Every rank of ``case``: fastload's parameters equal the oracle's (the same vLLM layer,
    loaded by its own weight loaders from the real tensors)."""
    config = _config(reader, **extra)
    ranks = []
    for rank in range(case.world):
        pair = []
        for _ in range(2):  # a config of its own per model: vLLM registers each layer by name in it
            with vllm_context(), on_rank(rank, case.world):
                pair.append(case.build())
        ranks.append(tuple(pair))
    for rank, (oracle, _) in enumerate(ranks):
        with on_rank(rank, case.world):  # some loaders ask for their rank while they load
            oracle.load_weights(iter({n: t.clone() for n, t in case.tensors.items()}.items()))
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(case, Path(tmp), layout["files"], layout["evict"])
        _assert_taken_whole(case, path, [fast for _, fast in ranks])
        reports = _load_every_rank(case, path, config, [fast for _, fast in ranks])
    for rank, ((oracle, fast), report) in enumerate(zip(ranks, reports)):
        problem = _differences(case, rank, parameter_bytes(oracle), parameter_bytes(fast), report)
        assert not problem, problem
        PATHS_TAKEN.update({k: v for k, v in report.paths.items() if v})
    EXAMPLES_RUN[label or case.pattern.split("/")[0]] += 1


def _assert_taken_whole(case: Case, path: str, models: list) -> None:
    """Every generated checkpoint is one its layers take whole (vocabulary padding, replicated KV
    heads, fused and quantized parts included): the ranks' uses together pass the check that
    refuses a tensor larger than the model takes (``model.coverage``), whatever the TP."""
    with vllm_fastload.open(path, config={"progress": False}) as ckpt:
        infos = dict(ckpt.tensors)
    shapes = {name: (shape_of(info), dtype_of(info)) for name, info in infos.items()}
    everyone = []
    for rank, model in enumerate(models):
        with on_rank(rank, case.world):
            probe = probe_model(model, shapes)
        if probe.unsupported:
            return  # read whole through load_weights: the engine's own loaders, nothing to judge
        everyone.append(coverage.uses(probe.placements, infos))
    coverage.check_taken_whole(everyone, infos, {}, f"{case.world} ranks")


def _load_every_rank(case: Case, path: str, config: FastloadConfig, models: list) -> list[LoadReport]:
    """One rank after the other; with the row exchange, all ranks at once, as threads that swap
    columns through ``ThreadCollectives``."""
    if config.row_exchange != "always" or case.world == 1:
        reports = []
        for rank, model in enumerate(models):
            with on_rank(rank, case.world):
                reports.append(load_rank(model, path, config, rank=rank, world=case.world))
        return reports
    group = ThreadCollectives(case.world)
    reports: list = [None] * case.world
    errors: list = []

    def run(rank: int) -> None:
        try:
            reports[rank] = load_rank(models[rank], path, config, rank=rank, world=case.world,
                                      collectives=group.for_rank(rank))
        except BaseException as exc:
            errors.append((rank, exc))
            group.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(case.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        rank, exc = min(errors, key=lambda e: e[0])
        raise AssertionError(f"rank {rank} of {case.world} failed: {type(exc).__name__}: {exc}; {case!r}") from exc
    return reports


PROPERTY = settings(max_examples=EXAMPLES, deadline=None, print_blob=True, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("pattern", sorted(patterns.PATTERNS))
def test_every_rank_equals_the_layers_own_loader(pattern):
    @PROPERTY
    @given(case=patterns.PATTERNS[pattern](), reader=READER, layout=LAYOUT)
    def prop(case, reader, layout):
        _check(case, reader, layout)

    prop()


@PROPERTY
@given(case=st.one_of(patterns.linear(), patterns.qkv(), patterns.merged(), patterns.packed_int4()),
       reader=READER, layout=LAYOUT)
def test_row_exchange_delivers_what_each_rank_would_have_read(case, reader, layout):
    """Ranks read blocks of whole rows and swap columns (``row_exchange: always``), as on object
    stores: every rank ends with exactly its own slices."""
    _check(case, reader, layout, "exchange", row_exchange="always")


#: Every way a tensor can take into the parameters, which the runs above must all have taken.
PATHS = {"whole", "sliced", "slab", "slab:whole", "contiguous", "strided", "enclosing", "exchange", "load_weights"}


def test_every_path_was_taken(request):
    """The generators reach every path the planner has (a path no case took is a path not proven)."""
    ran = [item for item in request.session.items if item.module is request.module and item is not request.node]
    if not ran:
        pytest.skip("run with the property tests of this module: it checks what they covered")
    assert set(PATHS_TAKEN) >= PATHS, f"paths no case took: {sorted(PATHS - set(PATHS_TAKEN))}; taken: {PATHS_TAKEN}"
