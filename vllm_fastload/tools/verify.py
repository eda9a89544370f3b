"""``vllm-fastload verify [--engine sglang] MODEL --tp N``: is fastload exact on your checkpoint, on every rank?

Loads each checkpoint with the engine's default loader and with fastload, through the engine's own
loader interface, in N rank processes that set up its distributed state the way its workers do,
and compares every parameter and buffer on every rank, byte for byte: right after the weights are
loaded and again after the engine's post-processing. Run it once before switching a model family
over. vLLM's rank processes are below; SGLang's are in ``tools.sglang_ranks``.

One process per rank sets vLLM's distributed state up once (``init_distributed_environment`` and
``ensure_model_parallel_initialized`` under ``set_current_vllm_config``, gloo on CPU, NCCL on
GPUs), then per checkpoint and per load mode: ``EngineArgs(...).create_engine_config()`` ->
``get_model_loader(load_config)`` -> ``loader.load_model(...)``, digesting every parameter and
buffer. The architecture test zoo (tests/vllm/zoo.py) runs through the same code.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllm_fastload.tools.processes import remove_cpu_shm
from vllm_fastload.tools.servers import free_port

#: mode -> (vLLM load format, --model-loader-extra-config). The first mode is the reference.
DEFAULT_MODES: dict[str, tuple[str, dict]] = {
    "default": ("auto", {}),
    "fastload": ("fastload", {"progress": False}),
}


def engine_config(path: str, tp: int, load_format: str, extra: dict, dtype: str = "auto"):
    """The ``VllmConfig`` a ``vllm serve PATH --load-format ... -tp N`` start would build (eager, short context)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=path, model_loader_extra_config=extra, tensor_parallel_size=tp, dtype=dtype,
                      load_format=load_format, enforce_eager=True, max_model_len=128, skip_tokenizer_init=True,
                      seed=0, distributed_executor_backend="mp" if tp > 1 else None).create_engine_config()


def load_and_digest(path: str, tp: int, load_format: str, extra: dict, dtype: str = "auto") -> dict:
    """Load one checkpoint on this rank; digests after ``load_weights`` (``loaded:`` names) and after
    ``load_model`` (post-processed), fastload's report, and the seconds ``load_model`` took."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from vllm_fastload.tools.digests import digests_before_post_processing, fastload_report, parameter_digests

    config = engine_config(path, tp, load_format, extra, dtype)
    loaded: dict[str, str] = {}
    start = time.perf_counter()
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        load_weights = loader.load_weights

        def load_weights_and_digest(model, model_config) -> None:
            # As loaded, before vLLM's post-processing (which may repack weights into kernel
            # handles that are no longer parameters): a module's own parameters right before its
            # post-processing step (fastload runs it per layer during load_weights), the rest
            # right after load_weights.
            before: dict[str, str] = {}
            digests_before_post_processing(model, before)
            # Not the parameters post-processing adds:
            names = {n for n, _ in [*model.named_parameters(), *model.named_buffers()]}
            load_weights(model, model_config)
            after = parameter_digests(model)
            before.update({k: v for k, v in after.items() if k not in before and k in names})
            loaded.update({f"loaded:{k}": v for k, v in before.items()})

        loader.load_weights = load_weights_and_digest
        model = loader.load_model(vllm_config=config, model_config=config.model_config)
    seconds = time.perf_counter() - start
    digests = {**loaded, **parameter_digests(model)}
    report = fastload_report(loader)
    del model
    return {"digests": digests, "report": report, "seconds": round(seconds, 3)}


def rank_main(rank: int, tp: int, port: int, out_dir: str, paths: list[str], modes: dict, dtype: str,
              more: dict | None = None) -> None:
    """One rank: vLLM's distributed state once, then every checkpoint in every mode; results go to
    ``out_dir/rank{rank}.json`` after each checkpoint (a crash keeps what was done)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.plugins import load_general_plugins

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
        # What vLLM's CPU worker does before loading: torch.accelerator calls become no-ops (the
        # loader calls empty_cache), and the shared-memory group is named after the rendezvous port.
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()
        os.environ["VLLM_DIST_IDENT"] = str(port)
    load_general_plugins()  # registers "fastload" through the entry point, as vLLM's workers do
    first = engine_config(paths[0], tp, "auto", {}, dtype)
    first.model_config = None  # so that initialize_model_parallel also creates the expert-parallel group
    with set_current_vllm_config(first):
        init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", rank, "nccl" if cuda else "gloo")
        ensure_model_parallel_initialized(tp, 1)
    try:
        load_every_checkpoint(rank, out_dir, paths, modes, more,
                              lambda path, load_format, extra: _frozen_load(path, tp, load_format, extra, dtype))
    finally:
        # vLLM's groups hold a shared-memory broadcast queue (rank 0 creates it); destroyed here,
        # rank 0 unlinks it. Left to the interpreter's exit, it outlived the rank and Python's
        # resource tracker reported it as leaked.
        gc.unfreeze()  # the groups too were set aside by ``_freeze_heap``: collectable again
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()


def load_every_checkpoint(rank: int, out_dir: str, paths: list[str], modes: dict, more: dict | None,
                          load: Callable[[str, str, dict], dict]) -> None:
    """Every checkpoint in every mode (``more`` adds modes for some paths), each through
    ``load(path, load_format, extra)``; the rank's results go to ``out_dir/rank{rank}.json`` after
    each checkpoint (a crash keeps what was done). An error is recorded per checkpoint: the others
    still run. The rank processes of both engines share it."""
    results: dict = {}
    for path in paths:
        entry: dict = {}
        try:
            for mode, (load_format, extra) in {**modes, **(more or {}).get(path, {})}.items():
                entry[mode] = load(path, load_format, extra)
        except BaseException as exc:  # recorded per checkpoint; the others still run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
        results[path] = entry
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _frozen_load(path: str, tp: int, load_format: str, extra: dict, dtype: str) -> dict:
    _freeze_heap()
    return load_and_digest(path, tp, load_format, extra, dtype)


def _freeze_heap() -> None:
    """Set what this process holds before a load (vLLM's, torch's and transformers' modules, the
    results so far) aside from the garbage collector, as vLLM's engine does once it has started
    (``gc.freeze``). vLLM's ``load_model`` runs two full collections per load, and over that heap
    they took most of a small checkpoint's load; what a load allocates is still collected as before."""
    gc.collect()
    gc.freeze()


def run_ranks(paths: list[str], tp: int, out_dir: str | Path, modes: Mapping[str, tuple[str, dict]] = DEFAULT_MODES,
              dtype: str = "auto", timeout: float = 1800, verbose: bool = True,
              more: Mapping[str, Mapping[str, tuple[str, dict]]] | None = None, engine: str = "vllm") -> list[dict]:
    """Start ``tp`` rank processes over ``paths``; every rank's results (``rank_main``, or SGLang's
    ``sglang_ranks.rank_main`` for ``engine="sglang"``), in rank order. ``more`` adds modes for some
    paths only.

    A rank still running at ``timeout`` (e.g. one waiting in a collective for a rank that died) is
    killed; its checkpoints missing from its results read as errors.
    """
    import multiprocessing as mp

    # The ranks' environment, this process's left as it was (a caller that runs ranks of several
    # sizes, or starts vLLM itself afterwards, must not inherit one run's settings).
    ranks_env = {"HF_HUB_OFFLINE": "1"}
    target = rank_main
    if engine == "sglang":
        from vllm_fastload.tools import sglang_ranks

        target = sglang_ranks.rank_main
    elif not verbose:
        ranks_env["VLLM_LOGGING_LEVEL"] = "ERROR"  # the ranks' start-up chatter
    if engine == "vllm" and tp > 1:
        cpus = os.cpu_count() or 1  # vLLM-CPU binds each rank's threads; share the cores round robin
        ranks_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cpus) for r in range(tp))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, tp, port, str(out_dir), list(paths), dict(modes), dtype,
                                                    {k: dict(v) for k, v in (more or {}).items()}))
             for r in range(tp)]
    with _environment({k: v for k, v in ranks_env.items() if k not in os.environ}):
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if engine == "vllm":  # the ranks' shared-memory files, named after the rendezvous port, which a killed rank leaves
        remove_cpu_shm({str(port)}, ended=time.time())
    results = []
    for r, p in enumerate(procs):
        f = out_dir / f"rank{r}.json"
        done = json.loads(f.read_text()) if f.exists() else {}
        for path in paths:
            done.setdefault(path, {"error": f"rank {r} did not finish it (exit code {p.exitcode})"})
        results.append(done)
    return results


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs (spawned processes copy it)."""
    os.environ.update(values)
    try:
        yield
    finally:
        for key in values:
            os.environ.pop(key, None)


@dataclass
class Verdict:
    """One checkpoint compared in one mode against the reference, on every rank."""

    path: str
    architecture: str
    mode: str
    exact: bool
    #: (rank, parameter or buffer) of the first difference, or the error.
    first_difference: tuple[int, str] | None = None
    error: str | None = None
    differing: list[int] = field(default_factory=list)  # number of differing names per rank
    names: int = 0
    read_share: list[float] = field(default_factory=list)
    planned: list[bool] = field(default_factory=list)
    fallback_reason: str | None = None
    post_processed: list[int] = field(default_factory=list)  # modules post-processed per layer, per rank
    #: The engine's post-processing failed in both loads (same error): only the weights as loaded
    #: were compared (``compare(..., post_errors_allowed=True)``).
    post_error: str | None = None

    def line(self) -> str:
        head = f"{self.architecture} ({self.path}), {self.mode}"
        if self.error:
            return f"{head}: ERROR {self.error}"
        ranks = len(self.differing)
        shares = "/".join(f"{s:.2f}" for s in self.read_share)
        how = ("planned per rank" if all(self.planned) else f"read whole through load_weights: {self.fallback_reason}")
        if any(self.post_processed):
            how += f", post-processed per layer ({'/'.join(map(str, self.post_processed))} modules)"
        if self.exact:
            after = (f"after loading; post-processing failed in both loads: {self.post_error}" if self.post_error
                     else "after loading and after post-processing")
            return (f"{head}: exact on all {ranks} ranks ({self.names} parameters and buffers each, {after}); {how}; "
                    f"share of the checkpoint read per rank {shares}")
        assert self.first_difference is not None  # set wherever a name differs
        rank, name = self.first_difference
        total = sum(self.differing)
        return (f"{head}: DIFFERENT: {name} differs on rank {rank} (first of {total} differing names over "
                f"{sum(1 for d in self.differing if d)} of {ranks} ranks); {how}")


def compare(results: list[dict], path: str, reference: str = "default",
            post_errors_allowed: bool = False) -> list[Verdict]:
    """Each mode of ``path`` against ``reference``, rank by rank. A load whose post-processing
    failed is an error, unless ``post_errors_allowed`` and every load of the checkpoint failed
    there alike: then the weights as loaded are compared (a test machine without the engine's
    kernels)."""
    arch = architecture(path)
    entries = [r[path] for r in results]
    error, post_error = _load_errors(entries, post_errors_allowed)
    if error is not None:
        return [Verdict(path, arch, "all", False, error=error)]
    verdicts = []
    for mode in [m for m in entries[0] if m != reference]:
        v = Verdict(path, arch, mode, True, post_error=post_error)
        for rank, e in enumerate(entries):
            _compare_rank(v, rank, e[reference], e[mode])
        v.exact = not any(v.differing)
        verdicts.append(v)
    return verdicts


def _load_errors(entries: list[dict], post_errors_allowed: bool) -> tuple[str | None, str | None]:
    """The first rank's error that fails the checkpoint (``"rank R: ..."``), and the
    post-processing error every load shared where ``post_errors_allowed`` lets it pass."""
    errors = [(rank, e) for rank, e in enumerate(entries) if "error" in e]
    post = {e[m]["post_error"] for e in entries if "error" not in e for m in e if "post_error" in e[m]}
    loads = [e[m] for e in entries if "error" not in e for m in e]
    post_error = None
    if post and not errors:
        rank, mode = next((r, m) for r, e in enumerate(entries) for m in e if "post_error" in e[m])
        if not post_errors_allowed or len(post) > 1 or any("post_error" not in d for d in loads):
            failed = entries[rank][mode]["post_error"]
            errors = [(rank, {"error": f"post-processing of the {mode} load failed: {failed}"})]
        else:
            post_error = post.pop()
    if errors:
        rank, e = errors[0]
        return f"rank {rank}: {e['error']}", None
    return None, post_error


def _compare_rank(v: Verdict, rank: int, reference: dict, load: dict) -> None:
    """Add one rank's comparison of ``load`` with ``reference`` to ``v``."""
    want, got = reference["digests"], load["digests"]
    v.names = len([n for n in want if not n.startswith("loaded:")]) or len(want)  # as loaded only
    wrong = [n for n in want if got.get(n) != want[n]] + [n for n in got if n not in want]
    v.differing.append(len(wrong))
    if wrong and v.first_difference is None:
        v.first_difference = (rank, wrong[0].removeprefix("loaded:"))
    report = load.get("report") or {}
    if report:
        v.read_share.append(report["bytes_read"] / max(report["bytes_total"], 1))
        v.planned.append(bool(report["planned"]))
        v.fallback_reason = v.fallback_reason or report.get("fallback_reason")
        v.post_processed.append(int(report.get("post_processed", 0)))


def architecture(path: str) -> str:
    try:
        return json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    except (OSError, KeyError, IndexError, ValueError):
        return "unknown architecture"


def main(args) -> int:
    """The ``verify`` command: 0 when every checkpoint is exact on every rank, 1 otherwise."""
    import tempfile

    engine = getattr(args, "engine", "vllm")
    name = "SGLang" if engine == "sglang" else "vLLM"
    extra = json.loads(args.fastload_config) if args.fastload_config else {}
    modes = {"default": DEFAULT_MODES["default"], "fastload": ("fastload", {"progress": False, **extra})}
    # A path that does not exist; a Hugging Face id ("org/name") is left to vLLM's downloader.
    missing = [p for p in args.model if not Path(p).exists() and (p.startswith(("/", ".", "~")) or p.count("/") > 1)]
    if missing:
        print(f"verify: no such checkpoint directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    paths = [str(Path(p).resolve()) if Path(p).exists() else p for p in args.model]
    print(f"verify: {len(paths)} checkpoint(s), TP={args.tp}, {name}'s default loader against fastload "
          f"{json.dumps(modes['fastload'][1])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fastload-verify-") as out:
        results = run_ranks(paths, args.tp, out, modes, dtype=args.dtype, timeout=args.timeout, verbose=args.verbose,
                            engine=engine)
    verdicts = [v for path in paths for v in compare(results, path)]
    for v in verdicts:
        print(v.line())
        if v.error and args.verbose:
            print(next((r[v.path].get("traceback", "") for r in results if "traceback" in r[v.path]), ""))
    bad = [v for v in verdicts if not v.exact]
    print(f"verdict: {len(verdicts) - len(bad)} of {len(verdicts)} exact" +
          ("" if not bad else "; do not switch these to fastload; please report them with this output"))
    return 1 if bad else 0

