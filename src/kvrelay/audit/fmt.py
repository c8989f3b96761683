"""Numbers of the audit as report text: points, p-values, bytes, durations, each with its unit."""

from __future__ import annotations

from collections.abc import Mapping


def pts(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1f}"


def pval(p: float | None) -> str:
    return "n/a" if p is None else ("<0.001" if p < 0.001 else f"{p:.3g}")


def nbytes(b: float | None, signed: bool = True) -> str:
    if b is None:
        return "n/a"
    sign = ("+" if b >= 0 else "-") if signed else ("" if b >= 0 else "-")
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= size:
            return f"{sign}{abs(b) / size:.2f} {unit}"
    return f"{sign}{abs(b):.0f} B"


def value_text(outcome: str, x: float | None) -> str:
    """A value of ``outcome`` with its unit (effects are signed)."""
    if x is None:
        return "n/a"
    if outcome == "success":
        return f"{x:+.1f} pts"
    if outcome == "latency_s":
        return f"{x:+.3g} s"
    if outcome == "relay_bytes":
        return nbytes(x)
    return f"{x:+.0f} tok" if outcome == "prefill_tokens" else f"{x:+.3g}"


def ci_text(outcome: str, lo: float | None, hi: float | None) -> str:
    """``[lo, hi]``; success bounds without the unit (the estimate next to it carries it)."""
    if lo is None or hi is None:
        return "n/a"
    if outcome == "success":
        return f"[{pts(lo)}, {pts(hi)}]"
    return f"[{value_text(outcome, lo)}, {value_text(outcome, hi)}]"


def duration(s: object) -> str:
    if not isinstance(s, int | float):
        return str(s)
    m, sec = divmod(float(s), 60.0)
    return f"{s:.0f} s ({int(m)} min {sec:.0f} s)" if m else f"{s:.1f} s"


def meta_text(v: object) -> str:
    """A meta value as one line: lists comma-joined, dicts as ``k=v``."""
    if isinstance(v, Mapping):
        return ", ".join(f"{k}={meta_text(x)}" for k, x in v.items())
    if isinstance(v, list | tuple):
        return ", ".join(str(x) for x in v)
    return str(v)
