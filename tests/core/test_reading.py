"""Reading tensors and slices: property tests against safetensors, bit for bit, under many configs."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from vllm_fastload import InvalidRequestError, TensorNotFoundError, TensorRequest
from vllm_fastload.errors import CheckpointError
from vllm_fastload.readers import memory
from vllm_fastload.readers.memory import Prefault
from vllm_fastload.tools.checkpoints import write_checkpoint

from ._util import (
    ALL_DTYPES,
    CONFIGS,
    SAFE_OPEN_CANNOT_LOAD,
    assert_bitexact,
    open_ckpt,
    random_tensor,
    save,
)

PROPERTY_SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies --------------------------------------------------------------------------------

dims = st.sampled_from([0, 1, 1, 2, 3, 4, 5, 7])


@dataclass
class Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: int


@dataclass
class Case:
    specs: list[Spec]
    requests: list[TensorRequest]
    nfiles: int
    seed: int
    dest_kind: list[str]   # per request: "contiguous" | "strided" (read_into destination layout)


@st.composite
def requests_for(draw, spec: Spec, index: int) -> list[TensorRequest]:
    ndim = len(spec.shape)
    out = []
    for j in range(draw(st.integers(0, 3))):
        key = f"{spec.name}#{j}"
        if draw(st.booleans()) and j == 0 and draw(st.booleans()):
            out.append(TensorRequest(spec.name, key=key))
            continue
        dim = draw(st.integers(-ndim, ndim - 1))
        size = spec.shape[dim]
        start = draw(st.integers(0, size))
        length = draw(st.one_of(st.none(), st.integers(0, size - start)))
        out.append(TensorRequest(spec.name, dim, start, length, key=key))
    return out


@st.composite
def cases(draw) -> Case:
    n = draw(st.integers(1, 6))
    nfiles = draw(st.integers(1, min(3, n)))
    specs = []
    for i in range(n):
        ndim = draw(st.integers(1, 4))
        shape = tuple(draw(dims) for _ in range(ndim))
        group = draw(st.sampled_from(["model.embed_tokens", "model.layers.0", "model.layers.1",
                                      "model.layers.10", "model.layers.2", "lm_head", "model.norm"]))
        specs.append(Spec(f"{group}.t{i}", shape, draw(st.sampled_from(ALL_DTYPES)), draw(st.integers(0, nfiles - 1))))
    requests: list[TensorRequest] = []
    for i, spec in enumerate(specs):
        requests += draw(requests_for(spec, i))
    if not requests:
        requests = [TensorRequest(specs[0].name)]
    kinds = [draw(st.sampled_from(["contiguous", "strided"])) for _ in requests]
    return Case(specs, requests, nfiles, draw(st.integers(0, 2**20)), kinds)


# -- oracle ----------------------------------------------------------------------------------------


def write_case(root: Path, case: Case) -> dict[str, torch.Tensor]:
    originals = {s.name: random_tensor(s.shape, s.dtype, case.seed + i) for i, s in enumerate(case.specs)}
    for k in range(case.nfiles):
        part = {s.name: originals[s.name] for s in case.specs if s.file == k}
        if part:
            save(root / f"model-{k:05d}.safetensors", part)
    return originals


def normalize(req: TensorRequest, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    if req.dim is None:
        return None
    dim = req.dim % len(shape)
    length = shape[dim] - req.start if req.length is None else req.length
    return dim, req.start, length


def expected(req: TensorRequest, originals: dict[str, torch.Tensor], path_of: dict[str, str]) -> torch.Tensor:
    full = originals[req.name]
    norm = normalize(req, tuple(full.shape))
    want = full if norm is None else full.narrow(*norm)
    # Cross-check with safetensors' own slicing where it can load the dtype.
    if full.dtype not in SAFE_OPEN_CANNOT_LOAD and want.numel():
        with safe_open(path_of[req.name], "pt") as f:
            if norm is None:
                theirs = f.get_tensor(req.name)
            else:
                dim, start, length = norm
                theirs = f.get_slice(req.name)[(slice(None),) * dim + (slice(start, start + length),)]
        assert_bitexact(want, theirs, f"oracle self-check {req}")
    return want


def make_dest(shape: tuple[int, ...], dtype: torch.dtype, kind: str, device: str = "cpu") -> torch.Tensor:
    if kind == "strided" and shape:
        wide = torch.zeros(shape[:-1] + (shape[-1] * 2 + 1,), dtype=dtype, device=device)
        return wide[..., 1:shape[-1] + 1]
    return torch.zeros(shape, dtype=dtype, device=device)


def check_case(case: Case, config: dict, device: str = "cpu") -> None:
    """Every request through get_slice, iter_tensors and read_into equals the oracle, bit for bit."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        originals = write_case(root, case)
        with open_ckpt(root, config, device) as ckpt:
            path_of = {name: ckpt.info(name).file for name in originals}
            wants = {r.result_key: expected(r, originals, path_of) for r in case.requests}

            # get_slice / get_tensor: owned, contiguous.
            for r in case.requests:
                got = (ckpt.get_tensor(r.name) if r.dim is None
                       else ckpt.get_slice(r.name, r.dim, r.start, r.length))
                assert got.is_contiguous() and got.device.type == torch.device(device).type
                assert_bitexact(got, wants[r.result_key], f"get_slice {r}")

            # iter_tensors: every key once, right values (views compared before any copy).
            seen = []
            stream = ckpt.iter_tensors(case.requests)
            for key, view in stream:
                assert_bitexact(view, wants[key], f"iter_tensors {key}")
                seen.append(key)
            assert sorted(seen) == sorted(wants)
            for strategy in ckpt.plan(case.requests).strategy_counts():
                event(f"strategy {strategy}")
            stats = stream.stats
            event(f"chunks > 1: {stats.chunks > 1}")
            event(f"oversize: {stats.oversize_tensors > 0}")

            # read_into: contiguous destinations (direct reads) and strided ones (copied).
            dests = {}
            for r, kind in zip(case.requests, case.dest_kind):
                want = wants[r.result_key]
                dests[r] = make_dest(tuple(want.shape), want.dtype, kind, device)
            stats = ckpt.read_into(dests)
            assert stats.tensors == len(dests)
            for r, dest in dests.items():
                assert_bitexact(dest, wants[r.result_key], f"read_into {r}")


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@PROPERTY_SETTINGS
@given(case=cases())
def test_reads_match_safetensors(config_name: str, case: Case):
    check_case(case, CONFIGS[config_name])


#: One CPU this process may run on, to pin reader threads to (``cpus``).
ONE_CPU = [min(os.sched_getaffinity(0))]


@PROPERTY_SETTINGS
@given(case=cases(), threads=st.sampled_from([1, 4]), skip=st.sampled_from([0, 64, 4096, 1 << 40]),
       aggregate=st.sampled_from([4096, 12288, 65536]), cpus=st.sampled_from([None, ONE_CPU]))
def test_reads_match_safetensors_mixed_configs(case: Case, threads: int, skip: int, aggregate: int,
                                               cpus: list[int] | None):
    config = {"threads": threads, "strided_min_skip": skip, "read_size": 4096, "aggregate_size": aggregate,
              "memory_budget": 2 * aggregate + 4096, "cpus": cpus}
    check_case(case, config)


# -- targeted cases --------------------------------------------------------------------------------


@pytest.fixture
def fused(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A fused qkv-style weight plus neighbours in the same file."""
    w = random_tensor((96, 40), torch.bfloat16, 7)
    save(tmp_path / "model.safetensors", {
        "model.layers.0.qkv.weight": w,
        "model.layers.0.a": random_tensor((5,), torch.float32, 1),
        "model.layers.0.z": random_tensor((3, 3), torch.int8, 2),
    })
    return tmp_path, w


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_several_slices_of_one_tensor(fused, config_name: str):
    root, w = fused
    name = "model.layers.0.qkv.weight"
    reqs = [TensorRequest(name, 0, 0, 64, key="q"), TensorRequest(name, 0, 64, 16, key="k"),
            TensorRequest(name, 0, 80, 16, key="v"), TensorRequest(name, 1, 20, 20, key="cols"),
            TensorRequest(name, -1, 0, 1, key="first-col"), TensorRequest(name, key="whole")]
    want = {"q": w[:64], "k": w[64:80], "v": w[80:], "cols": w[:, 20:], "first-col": w[:, :1], "whole": w}
    with open_ckpt(root, CONFIGS[config_name]) as ckpt:
        got = {k: t.clone() for k, t in ckpt.iter_tensors(reqs)}
        assert sorted(got) == sorted(want)
        for k in want:
            assert_bitexact(got[k], want[k], k)
        dests = {r: torch.empty_like(want[r.result_key]) for r in reqs}
        ckpt.read_into(dests)
        for r, d in dests.items():
            assert_bitexact(d, want[r.result_key], r.result_key)


def test_same_key_twice_is_rejected(fused):
    root, _ = fused
    name = "model.layers.0.qkv.weight"
    with open_ckpt(root) as ckpt:
        with pytest.raises(InvalidRequestError) as info:
            list(ckpt.iter_tensors([TensorRequest(name, 0, 0, 1), TensorRequest(name, 0, 1, 1)]))
        assert repr(name) in str(info.value)


def test_multi_file_checkpoint_matches_safe_open(tmp_path: Path):
    root = write_checkpoint(tmp_path / "ck", "tiny-mixtral", files=3)
    cfg = {"threads": 4, "read_size": 4096, "aggregate_size": 65536, "memory_budget": 1 << 20}
    with open_ckpt(root, cfg) as ckpt:
        got = {k: t.clone() for k, t in ckpt.iter_tensors()}
        files = {ckpt.info(k).file for k in got}
        assert len(files) == 3
    assert len(got) == len(ckpt.keys())
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                assert_bitexact(got[name], f.get_tensor(name), name)


# -- dtype conversion --------------------------------------------------------------------------------


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {
        "model.layers.0.bf16": torch.randn(12, 10).to(torch.bfloat16),
        "model.layers.0.f16": torch.randn(6, 4).half(),
        "model.layers.0.f32": torch.randn(9),
        "model.layers.0.fp8": torch.randn(8, 8).to(torch.float8_e4m3fn),
        "model.layers.0.i8": torch.randint(-128, 127, (5, 5), dtype=torch.int8),
        "model.layers.0.i32": torch.randint(-1000, 1000, (4,), dtype=torch.int32),
        "model.layers.0.mask": torch.rand(7) > 0.5,
    }
    save(tmp_path / "model.safetensors", tensors)
    return tmp_path, tensors


@pytest.mark.parametrize("target", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_float_conversion(mixed, target: torch.dtype):
    root, tensors = mixed
    floats = [k for k, v in tensors.items() if v.dtype in (torch.bfloat16, torch.float16, torch.float32)]
    with open_ckpt(root, {"aggregate_size": 4096, "read_size": 4096, "memory_budget": 16384}) as ckpt:
        # read_into a destination of another float dtype: whole tensors and slices.
        dests = {name: torch.empty(tensors[name].shape, dtype=target) for name in floats}
        sliced = TensorRequest("model.layers.0.bf16", 1, 3, 4, key="bf16-cols")
        dests[sliced] = torch.empty(12, 4, dtype=target)
        ckpt.read_into(dests)
        for name in floats:
            assert_bitexact(dests[name], tensors[name].to(target), name)
        assert_bitexact(dests[sliced], tensors["model.layers.0.bf16"][:, 3:7].to(target))
        # iter_tensors(dtype=...) and get_tensor(dtype=...)
        got = {k: t.clone() for k, t in ckpt.iter_tensors(dtype=target)}
        for name in floats:
            assert_bitexact(got[name], tensors[name].to(target), name)
            assert_bitexact(ckpt.get_tensor(name, dtype=target), tensors[name].to(target), name)
            assert_bitexact(ckpt.get_slice(name, 0, 1, dtype=target), tensors[name][1:].to(target), name)


def test_quantised_and_integer_tensors_are_never_cast(mixed):
    root, tensors = mixed
    data = ["model.layers.0.fp8", "model.layers.0.i8", "model.layers.0.i32", "model.layers.0.mask"]
    with open_ckpt(root) as ckpt:
        got = {k: t.clone() for k, t in ckpt.iter_tensors(data, dtype=torch.float16)}
        for name in data:
            assert_bitexact(got[name], tensors[name], name)           # dtype kept, bits kept
            assert_bitexact(ckpt.get_tensor(name, dtype=torch.float32), tensors[name], name)


@pytest.mark.parametrize(("name", "dtype"), [
    ("model.layers.0.fp8", torch.float16), ("model.layers.0.fp8", torch.uint8),
    ("model.layers.0.i8", torch.int32), ("model.layers.0.f32", torch.int32),
    ("model.layers.0.mask", torch.uint8), ("model.layers.0.bf16", torch.float8_e4m3fn),
])
def test_read_into_uncastable_dtype(mixed, name: str, dtype: torch.dtype):
    root, tensors = mixed
    with open_ckpt(root) as ckpt:
        with pytest.raises(InvalidRequestError) as info:
            ckpt.read_into({name: torch.empty(tensors[name].shape, dtype=dtype)})
        assert repr(name) in str(info.value) and ckpt.info(name).file in str(info.value)


def test_read_into_shape_mismatch(mixed):
    root, _ = mixed
    with open_ckpt(root) as ckpt:
        for req, shape in [("model.layers.0.bf16", (10, 12)), ("model.layers.0.f32", (9, 1)),
                           (TensorRequest("model.layers.0.bf16", 0, 0, 6, key="half"), (12, 10))]:
            key = req if isinstance(req, str) else req.result_key
            with pytest.raises(InvalidRequestError) as info:
                ckpt.read_into({req: torch.empty(shape, dtype=torch.bfloat16)})
            assert repr(key) in str(info.value) and ckpt.info("model.layers.0.bf16").file in str(info.value)


# -- bad requests --------------------------------------------------------------------------------


BAD_SLICES = [
    (2, 0, 1),      # dim out of range
    (-3, 0, 1),     # negative dim out of range
    (0, 0, 13),     # past the end
    (0, 12, 1),     # starts at the end with a length
    (1, 5, 6),      # past the end along dim 1
    (0, -1, 2),     # negative start
    (0, 2, -1),     # negative length
    (0, 13, None),  # start beyond the size, to the end
]


@pytest.mark.parametrize(("dim", "start", "length"), BAD_SLICES)
def test_bad_slice_requests(mixed, dim: int, start: int, length: int | None):
    root, _ = mixed
    name = "model.layers.0.bf16"  # shape (12, 10)
    req = TensorRequest(name, dim, start, length)
    with open_ckpt(root) as ckpt:
        file = ckpt.info(name).file
        calls = [lambda: ckpt.get_slice(name, dim, start, length), lambda: list(ckpt.iter_tensors([req])),
                 lambda: ckpt.plan([req]), lambda: ckpt.read_into({req: torch.empty(1)})]
        for call in calls:
            with pytest.raises(InvalidRequestError) as info:
                call()
            assert type(info.value) is InvalidRequestError
            assert repr(name) in str(info.value) and repr(file) in str(info.value)
            assert isinstance(info.value, ValueError)
        # The checkpoint still works afterwards.
        assert ckpt.get_slice(name, 0, 0, 1).shape == (1, 10)


def test_unknown_tensor_in_a_batch(mixed):
    root, _ = mixed
    with open_ckpt(root) as ckpt:
        with pytest.raises(TensorNotFoundError) as info:
            list(ckpt.iter_tensors(["model.layers.0.f32", "model.layers.0.nope"]))
        assert "'model.layers.0.nope'" in str(info.value) and str(root) in str(info.value)


def test_scalar_tensor_cannot_be_sliced(tmp_path: Path):
    path = save(tmp_path / "s.safetensors", {"s": torch.tensor(3.5)})
    with open_ckpt(path) as ckpt:
        assert ckpt.get_tensor("s").item() == 3.5
        with pytest.raises(InvalidRequestError):
            ckpt.get_slice("s", 0, 0, 0)


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4_e2m1fn_x2")
def test_f4_slice_along_packed_dim_is_rejected(tmp_path: Path):
    packed = torch.zeros(4, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    path = save(tmp_path / "f4.safetensors", {"w": packed})
    with open_ckpt(path) as ckpt, pytest.raises(InvalidRequestError) as info:
        ckpt.get_slice("w", 1, 1, 3)
    assert "'w'" in str(info.value)


def test_errors_are_checkpoint_errors(mixed):
    root, _ = mixed
    with open_ckpt(root) as ckpt:
        for call in (lambda: ckpt.get_tensor("nope"), lambda: ckpt.get_slice("model.layers.0.f32", 1)):
            with pytest.raises(CheckpointError):
                call()


def test_enclosing_views_are_strided_but_exact(fused):
    root, w = fused
    name = "model.layers.0.qkv.weight"
    with open_ckpt(root, {"strided_min_skip": 1 << 40}) as ckpt:
        plan = ckpt.plan([TensorRequest(name, 1, 8, 16)])
        assert plan.tensors[0].strategy == "enclosing"
        ((_, view),) = [(k, v.clone()) for k, v in ckpt.iter_tensors([TensorRequest(name, 1, 8, 16)])]
        assert_bitexact(view, w[:, 8:24])
        owned = ckpt.get_slice(name, 1, 8, 16)
        assert owned.is_contiguous()
        assert_bitexact(owned, w[:, 8:24])


@pytest.mark.parametrize("ahead", [0, 6 * 4096], ids=["three-chunks", "reader-asks-more"])
def test_reads_into_destinations_queue_as_far_ahead_as_the_reader_asks(tmp_path: Path, monkeypatch, ahead: int):
    """Three chunks in flight, or more where they need no buffer and the reader asks for more
    (the GPU readers: their threads outnumber the pieces of three chunks)."""
    from vllm_fastload.readers import host

    tensors = {f"model.layers.{i}.w": random_tensor((1024,), torch.float32, i) for i in range(12)}
    save(tmp_path / "m.safetensors", tensors)
    monkeypatch.setattr(host.HostReader, "direct_in_flight", property(lambda self: ahead))
    with open_ckpt(tmp_path, {"aggregate_size": 4096, "read_size": 4096, "threads": 2}) as ckpt:
        reader, depth, most = ckpt.reader, [0], [0]
        submit = reader.submit

        def counting(sf, calls):
            pending = submit(sf, calls)
            depth[0] += 1
            most[0] = max(most[0], depth[0])
            wait = pending.wait

            def waited(stall_s=None):
                wait(stall_s)
                depth[0] -= 1

            pending.wait = waited
            return pending

        reader.submit = counting
        dests = {name: torch.empty(1024) for name in tensors}
        ckpt.read_into(dests)
    for name, want in tensors.items():
        assert_bitexact(dests[name], want, name)
    # Each 4 KiB tensor is a chunk: three in flight, or 6 x 4 KiB queued beyond them.
    assert most[0] == (3 if not ahead else 6)


@pytest.mark.parametrize("direct_io", ["never", "always"])
def test_reader_threads_run_on_the_configured_cpus(fused, direct_io: str):
    """``cpus`` moves the reader's threads, and only them: the caller stays where it was."""
    path, w = fused
    before = os.sched_getaffinity(0)
    with open_ckpt(path, {"cpus": ONE_CPU, "threads": 3, "direct_io": direct_io}) as ckpt:
        dest = torch.empty_like(w)
        ckpt.read_into({"model.layers.0.qkv.weight": dest})
        assert_bitexact(dest, w, "read_into with cpus")
        seen = {frozenset(f.result()) for f in [ckpt.reader.threads().submit(os.sched_getaffinity, 0)
                                                 for _ in range(6)]}
        assert seen == {frozenset(ONE_CPU)}
    assert os.sched_getaffinity(0) == before


def test_prefault_thread_runs_on_the_configured_cpus(monkeypatch):
    """The fallback path faults parameters in on a thread of its own: on ``cpus`` too."""
    seen: list[set[int]] = []

    def populate(address: int, length: int) -> int:
        seen.append(os.sched_getaffinity(0))
        return 1

    monkeypatch.setattr(memory, "populate", populate)
    with Prefault([torch.empty(4096, dtype=torch.uint8)], cpus=ONE_CPU) as prefault:
        prefault._thread.join()
    assert seen == [set(ONE_CPU)] and prefault.faulted == 1


def test_a_reader_thread_stuck_in_a_read_is_written_off_and_waited_for_by_no_one():
    """``threads.stalled`` names the read that has made no progress past the limit; the pool's
    shutdown then does not wait for its thread, and the thread is a daemon (the process can exit)."""
    import threading
    import time

    from vllm_fastload.readers import threads

    pool = threads.thread_pool(2, "test-stuck", None)
    release = threading.Event()

    def stuck() -> None:
        threads.reading("/x/model.safetensors", 4096, 1 << 20)
        release.wait(60)

    future = pool.submit(stuck)
    assert pool.submit(lambda a, b=0: a + b, 1, b=2).result(timeout=10) == 3
    time.sleep(0.3)
    activity = threads.stalled(0.2)
    assert activity is not None and (activity.file, activity.offset, activity.length) == (
        "/x/model.safetensors", 4096, 1 << 20)
    assert threads.stalled(30) is None
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-stuck"))
    started = time.monotonic()
    pool.shutdown(wait=True)
    assert time.monotonic() - started < 5 and not future.done()
    release.set()
    assert future.result(timeout=10) is None
