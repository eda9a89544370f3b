"""The row exchange between real processes over gloo: every rank's slices equal safetensors' own.

Each case starts ``world`` processes (spawned, a loopback gloo group), each asks for its column
slices of the same tensors, reads whole rows through ``exchange.agree`` / ``read_into`` and swaps
columns; the parent compares every rank's result with ``safe_open``'s slice, byte for byte.
"""

from __future__ import annotations

import itertools
import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

import vllm_fastload
from vllm_fastload.errors import CheckpointError
from vllm_fastload.format import TensorInfo
from vllm_fastload.model import exchange
from vllm_fastload.plan import TensorRequest

from ._util import random_tensor

# The ranks' gloo group runs on loopback (inherited by the spawned ranks).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

#: name -> (shape, dtype, sliced dim); the parent picks each rank's columns.
TENSORS = {
    # Sorted first in its layer, with odd byte counts per piece: the pieces after it (bf16, fp16)
    # must still land on addresses their dtype can be viewed at.
    "model.layers.0.a_odd.weight": ((7, 13), torch.int8, 1),
    "model.layers.0.mlp.down_proj.weight": ((37, 96), torch.bfloat16, 1),
    "model.layers.0.self_attn.o_proj.weight": ((64, 64), torch.float16, 1),
    "model.layers.1.mlp.down_proj.weight": ((5, 7, 33), torch.float32, 2),  # 3-D, last dim
    "model.layers.1.experts.w2": ((9, 40, 24), torch.int8, 1),              # a middle dim
    "model.layers.2.self_attn.o_proj.weight": ((3, 50), torch.bfloat16, 1),  # as few rows as ranks
    "model.norm.weight": ((64,), torch.bfloat16, None),                      # whole, on every rank
}


def _columns(size: int, world: int, uneven: bool) -> list[tuple[int, int]]:
    if not uneven:
        return [(size * q // world, size * (q + 1) // world - size * q // world) for q in range(world)]
    cuts = sorted({0, size, *[max(1, size * q // (world + 1)) for q in range(1, world)]})
    return [(a, b - a) for a, b in itertools.pairwise(cuts)]


def _worker(rank: int, world: int, port: int, path: str, uneven: bool, cast: bool, config: dict,
            out: str, fail: tuple[int, str] | None = None) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        with vllm_fastload.open(path, config=config) as ckpt:
            infos = {n: ckpt.info(n) for n in ckpt.keys()}
            targets = {}
            for name, (shape, dtype, dim) in TENSORS.items():
                if dim is None:
                    targets[TensorRequest(name)] = torch.empty(shape, dtype=dtype)
                    continue
                start, length = _columns(shape[dim], world, uneven)[rank]
                dest_shape = list(shape)
                dest_shape[dim] = length
                want = torch.float32 if cast and dtype == torch.bfloat16 else dtype
                targets[TensorRequest(name, dim=dim, start=start, length=length)] = torch.full(
                    dest_shape, 7, dtype=want)
            swap = exchange.agree(exchange.Collectives(dist.group.WORLD, rank, world), targets, infos)
            read = {r: d for r, d in targets.items() if not swap.owns(r)}
            seen = []

            class Hooks(vllm_fastload.ReadHooks):
                def on_tensor(self, request: TensorRequest, tensor: torch.Tensor) -> None:
                    if fail is not None and fail[0] == rank and request.result_key.startswith(fail[1]):
                        raise CheckpointError("injected failure", file=path, tensor=request.result_key)
                    seen.append(swap.take(request, tensor))

                def on_layer_end(self, group) -> None:
                    swap.layer_done(group)

            try:
                ckpt.read_into(read, extra=swap.row_requests(), hooks=Hooks())
            except BaseException as exc:
                swap.abort(exc)  # as the vLLM loader does
                raise
            swap.finish()
            result = {"tensors": {r.name: d for r, d in targets.items()}, "shared": sorted(swap.shared),
                      "taken": seen, "stats": vars(swap.stats)}
        torch.save(result, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, world: int, uneven: bool = False, cast: bool = False, config: dict | None = None,
           fail: tuple[int, str] | None = None) -> tuple[str, list[dict]]:
    """Run the ranks; the checkpoint's path and each rank's result (or its error)."""
    originals = {name: random_tensor(shape, dtype, seed=i)
                 for i, (name, (shape, dtype, _)) in enumerate(TENSORS.items())}
    path = tmp_path / "model.safetensors"
    save_file(originals, str(path))
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(world)]
    config = {"progress": False, **(config or {})}
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(path), uneven, cast, config, outs[r], fail))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            pytest.fail("a rank did not finish within 120 s")
    return str(path), [torch.load(o) for o in outs]


def _run(tmp_path, world: int, uneven: bool = False, cast: bool = False, config: dict | None = None) -> list[dict]:
    path, results = _start(tmp_path, world, uneven, cast, config)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    with safe_open(str(path), "pt") as f:
        for rank, r in enumerate(results):
            for name, (shape, _, dim) in TENSORS.items():
                want = f.get_tensor(name)
                if dim is not None:
                    start, length = _columns(shape[dim], world, uneven)[rank]
                    want = want.narrow(dim, start, length)
                got = r["tensors"][name]
                if got.dtype != want.dtype:  # a bf16 slice read into a float32 parameter
                    want = want.to(got.dtype)
                assert got.shape == want.shape, (rank, name)
                assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                    f"rank {rank}: {name} differs"
    return results


@pytest.mark.parametrize("world,uneven", [(2, False), (3, True)])
def test_ranks_swap_columns_of_whole_rows_exactly(tmp_path, world, uneven) -> None:
    results = _run(tmp_path, world, uneven)
    sliced = sorted(n for n, (_, _, dim) in TENSORS.items() if dim is not None)
    for r in results:
        assert r["shared"] == sliced  # every column-sliced tensor went through the exchange
        assert sum(r["taken"]) == len(sliced)
        # one collective per layer that has a shared tensor (layers 0, 1 and 2)
        assert r["stats"]["layers"] == 3 and r["stats"]["tensors"] == len(sliced)
        assert r["stats"]["bytes_sent"] > 0


def test_exchange_casts_into_wider_destinations_and_survives_tiny_buffers(tmp_path) -> None:
    # bf16 slices into float32 parameters; 4 KiB buffers: rows split over many chunks and reads.
    _run(tmp_path, 2, cast=True, config={"threads": 2, "read_size": 4096, "aggregate_size": 4096,
                                          "memory_budget": 8192, "map_cached": False})


def test_a_rank_failing_mid_read_stops_every_rank_with_its_reason(tmp_path) -> None:
    # Rank 1 fails on a layer-1 tensor: rank 0, waiting for layer 1's swap, is told instead of hanging.
    _, results = _start(tmp_path, 3, fail=(1, "model.layers.1."))
    assert "injected failure" in results[1]["error"]
    for rank in (0, 2):
        error = results[rank]["error"]
        assert "CheckpointError: rank 1 of the tensor-parallel group stopped loading" in error, error
        assert "injected failure" in error and "model.layers.1." in error


def test_candidates_count_f4_in_torch_units() -> None:
    # Two F4 values per torch element: the rows, columns and byte counts the ranks swap are in
    # the packed units the requests use, also for a slice along a middle dim.
    info = TensorInfo("experts.w13", "m.safetensors", "F4", (3, 8, 16), 0, 3 * 8 * 16 // 2)
    got = exchange.candidates({TensorRequest("experts.w13", dim=1, start=4, length=4): None},
                               {"experts.w13": info})
    assert got == {"experts.w13": exchange.Candidate((3, 8, 8), "F4", 1, 4, 4)}


def test_no_exchange_when_a_rank_reads_nothing_by_plan(tmp_path) -> None:
    # One rank falls back (targets None): nobody exchanges, and agree() still returns on both.
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(path))
    outs = [str(tmp_path / f"r{r}.pt") for r in range(2)]
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_agree_only, args=(r, port, str(path), outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [torch.load(o) for o in outs] == [None, None]


def _agree_only(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    with vllm_fastload.open(path, config={"progress": False}) as ckpt:
        infos = {"w": ckpt.info("w")}
        targets = None if rank == 1 else {TensorRequest("w", dim=1, start=0, length=2): torch.empty(4, 2)}
        swap = exchange.agree(exchange.Collectives(dist.group.WORLD, rank, 2), targets, infos)
    torch.save(swap, out)
    dist.destroy_process_group()

