"""What a benchmark run is judged on, one way for every benchmark: ``--targets`` read by one
parser, and every verdict kept and printed by one judge as an ok/MISSED line.

A verdict is a JSON object (``target``, ``tp`` where it is judged per TP, ``value``, ``limit``,
``at_least`` where the value must reach the limit, ``ok``, ``detail``), as the benchmarks' JSON
documents hold it, so that a saved run prints as a fresh one does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["Target", "all_met", "by_name", "limit_text", "line", "mark", "parse_targets", "print_verdicts", "verdict"]


@dataclass(frozen=True)
class Target:
    """A named target: its default limit and what it compares."""

    name: str
    limit: float
    what: str
    #: The value must reach the limit (a rate), rather than stay at or below it (a ratio of times).
    at_least: bool = False


def by_name(*targets: Target) -> Mapping[str, Target]:
    """Targets by name, in the order given."""
    return MappingProxyType({t.name: t for t in targets})


def parse_targets(spec: str | None, targets: Mapping[str, Target], every: Iterable[str] | None = None,
                  where: str = "") -> dict[str, float]:
    """``--targets``: ``all`` (the names in ``every``, by default every target), or names from
    ``targets`` each with an optional ``=limit``; each named target's limit. An unknown name or a
    limit that is no number ends the command, ``where`` saying for which."""
    if not spec:
        return {}
    out: dict[str, float] = {}
    for item in spec.split(","):
        name, _, value = item.strip().partition("=")
        if name == "all":
            out.update({n: targets[n].limit for n in (targets if every is None else every)})
            continue
        if name not in targets:
            raise SystemExit(f"unknown target {name!r}{where}; known: all, {', '.join(targets)}")
        try:
            out[name] = float(value) if value else targets[name].limit
        except ValueError:
            raise SystemExit(f"target {name}: {value!r} is not a number") from None
    return out


def verdict(target: str, value: float | None, limit: float, detail: str = "", *, tp: str = "",
            at_least: bool = False, required: bool = True) -> dict[str, Any]:
    """One target judged. ``value`` None: not measured, which misses a ``required`` target (one the
    run was asked to meet) and leaves another undecided (``ok`` None)."""
    ok = (None if not required else False) if value is None else value >= limit if at_least else value <= limit
    out: dict[str, Any] = {"target": target, "value": value, "limit": limit, "ok": ok, "detail": detail}
    if tp:
        out["tp"] = tp
    if at_least:
        out["at_least"] = True
    return out


def mark(v: Mapping[str, Any]) -> str:
    """``ok``, ``MISSED``, or ``n/a`` (not measured, and not required)."""
    return "n/a" if v["ok"] is None else "ok" if v["ok"] else "MISSED"


def limit_text(v: Mapping[str, Any]) -> str:
    """The limit with its direction: ``<= 0.75``, ``>= 0.9``."""
    return f"{'>=' if v.get('at_least') else '<='} {v['limit']:.4g}"


def line(v: Mapping[str, Any]) -> str:
    """A verdict as the benchmarks print it: ``[ok] cold-tp1 tp1: 0.750 (limit <= 0.75; ...)``."""
    where = f" {v['tp']}" if v.get("tp") else ""
    value = "not measured" if v["value"] is None else f"{v['value']:.3f}"
    detail = f"; {v['detail']}" if v.get("detail") else ""
    return f"  [{mark(v)}] {v['target']}{where}: {value} (limit {limit_text(v)}{detail})"


def print_verdicts(verdicts: Sequence[Mapping[str, Any]], say: Callable[..., None] = print) -> None:
    """The verdicts under a ``targets:`` heading; nothing if there are none."""
    if not verdicts:
        return
    say("\ntargets:")
    for v in verdicts:
        say(line(v))


def all_met(verdicts: Iterable[Mapping[str, Any]]) -> bool:
    """Whether no verdict missed its target (undecided ones do not count against it)."""
    return all(v["ok"] is not False for v in verdicts)
