"""Which CPUs a rank's reader threads run on under vLLM-CPU.

vLLM-CPU binds each OpenMP thread of a rank to one of the rank's cores, the main thread included,
and a thread starts on the CPUs of the thread that creates it, so the reader's threads would all
share one core. They run instead on the rank's cores (every CPU one of its threads is bound to)
and on the CPUs of its NUMA nodes that vLLM leaves to its engine and front-end processes (its
automatic binding keeps one core per rank for them; they wait while the ranks load), never on a
CPU that ``VLLM_CPU_OMP_THREADS_BIND`` gives a rank. Where the engine runs in the rank's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as vLLM's start-up benchmark does) its unbound threads
already run everywhere, and so do the reader's. The pools end with the load. Where vLLM binds
nothing (GPUs, ``nobind``) the threads stay where they are.
"""

from __future__ import annotations

import os
from pathlib import Path


def reader_cpus() -> tuple[int, ...] | None:
    """CPUs for this rank's reader threads; None: where the main thread may run will do."""
    try:
        main = os.sched_getaffinity(0)
        engine = os.sched_getaffinity(os.getppid())  # the process that started this rank
    except (AttributeError, OSError):
        return None
    own = set(main).union(*(_affinity(tid) for tid in _threads()))
    cpus = set(own)
    if not own >= engine:  # a worker process of its own: add the free CPUs beside it
        nodes = {_node(c) for c in own}
        cpus |= {c for c in engine if _node(c) in nodes} - own - _bound_by_user()
    return tuple(sorted(cpus)) if cpus != main else None


def _bound_by_user() -> set[int]:
    """Every CPU ``VLLM_CPU_OMP_THREADS_BIND`` lists for a rank (e.g. ``0-3|4-7``)."""
    setting = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if setting in ("", "auto", "nobind"):
        return set()
    cpus: set[int] = set()
    for part in setting.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        try:
            cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            return set(range(os.cpu_count() or 1))  # cannot tell which are free: none are
    return cpus


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _affinity(tid: int) -> set[int]:
    try:
        return set(os.sched_getaffinity(tid))
    except OSError:  # the thread ended meanwhile
        return set()


def _node(cpu: int) -> int | None:
    """The NUMA node of ``cpu`` (None where sysfs does not say: all such CPUs count as one node)."""
    try:
        return next(int(p.name[4:]) for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    except (StopIteration, OSError, ValueError):
        return None
