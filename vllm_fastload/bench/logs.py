"""Why an engine's start failed, read from its log: one reader for vLLM's and SGLang's.

Both engines print the real failure first (a worker's or a rank's exception) and then pages of
tracebacks of the processes that noticed it; a benchmark row should name the first.
"""

from __future__ import annotations

import re

__all__ = ["root_cause"]

#: An exception line as Python prints it, behind a process prefix if any: vLLM's
#: ``(Worker_TP1 pid=77)``, SGLang's ``[2026-01-01 10:00:00 TP1]``.
_ERROR_LINE = re.compile(r"^(?:[(\[][^)\]]*[)\]]\s*)?(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception|Exit)): (.+)$")
#: What an engine raises once a worker has died, or a client polling a server that is gone: a
#: consequence, never the cause.
_CONSEQUENCES = ("EngineDeadError", "EngineCoreError", "EOFError", "BrokenPipeError", "ConnectionRefusedError")
#: A cause longer than this is cut: its head says what it is.
_LONGEST = 300


def root_cause(log: str) -> str:
    """The first exception line of a failed start's log that is not a consequence of another
    (a worker's ``ConfigError``, say); else the first consequence; else the log's last lines."""
    fallback = None
    for line in log.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if not match:
            continue
        found = f"{match.group(1)}: {match.group(2).strip()}"[:_LONGEST]
        if match.group(1) in _CONSEQUENCES or "died unexpectedly" in line or "initialization failed" in line:
            fallback = fallback or found
            continue
        return found
    if fallback:
        return fallback
    tail = [line for line in log.splitlines() if line.strip()][-3:]
    return ("no exception line in the log; it ends with: " + " | ".join(tail))[:_LONGEST]
