"""Plain-language verdict of an audit summary, compared with the paper's findings.

The paper ("When Does Latent Communication Pay? A Causal Audit of Relayed KV Caches", arXiv 2608.04893): in the private-information regime a matched relay
beats irrelevant relays by +61 to +77 points; on natural (shared) benchmarks matched and
mismatched caches are equivalent within ±2.8 points (Holm-corrected TOST). The verdict says,
per regime, what this run found and whether it agrees — including when it is inconclusive.

It knows its power: with fewer than ``MIN_TASKS`` task clusters behind the pooled pairing effect,
when a private-regime CI still reaches the paper's range without being significant, or when the
TOST 90% CI is wider than ``±MAX_TOST_HALF_WIDTH`` points, it says "too few tasks to tell" rather
than agreeing or disagreeing with the paper.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvrelay.audit.vocab import ALPHA

PAPER_PRIVATE = "+61 to +77 points"
PAPER_LOW, PAPER_HIGH = 61.0, 77.0
# Power floors: below them the verdict says "too few tasks to tell" instead of agreeing or disagreeing.
MIN_TASKS = 20  # task clusters behind a pooled pairing effect (greedy seeds repeat answers; tasks are the unit)
MAX_TOST_HALF_WIDTH = 10.0  # points: a 90% CI wider than ±this around its estimate cannot speak to a ±2.8 margin


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1f}"


def _secs(x: float) -> str:
    return f"{x:+.3g}"


def _ci(row: Mapping, lo: str = "ci_low", hi: str = "ci_high", level: str = "95%", fmt=_pts) -> str:
    if row.get(lo) is None or row.get(hi) is None:
        return "no CI: fewer than two tasks"
    return f"{level} CI {fmt(row[lo])} to {fmt(row[hi])}"


def _p(p: float | None) -> str:
    """``=0.032``, ``<0.001`` or ``=n/a``, to follow a ``p``."""
    return "=n/a" if p is None else (f"={p:.2g}" if p >= 0.001 else "<0.001")


def _bytes(b: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def _find(rows: list, **want: object) -> Mapping | None:
    for row in rows:
        if all(row.get(k) == v for k, v in want.items()):
            return row
    return None


def verdict(summary: Mapping) -> str:
    """One paragraph per regime: pairing effect (points, CI, Holm p), equivalence to 0 for the shared
    regime, agreement with the paper, and what relay cost or saved against re-encoding the text."""
    effects = summary.get("effects", [])
    margin = summary.get("settings", {}).get("margin", 2.8)
    regimes = [r for r in ("private", "shared") if any(e["regime"] == r for e in effects)]
    if not regimes:
        return "No contrast could be estimated: the records lack the arms of every contrast (need kv and kv_mismatched, none or text arms)."
    lines = []
    for regime in regimes:
        lines.append(f"{regime} regime: " + _pairing_sentence(summary, regime, margin))
        cost = _cost_sentence(effects, regime)
        if cost:
            lines.append(f"  cost: {cost}")
    return "\n".join(lines)


def _pairing_sentence(summary: Mapping, regime: str, margin: float) -> str:
    effects = summary.get("effects", [])
    row = _find(effects, regime=regime, task="ALL", contrast="pairing", outcome="success")
    if row is None:
        return "pairing effect not measured (kv or kv_mismatched was not run)."
    if row["estimate"] is None:
        return "pairing effect not estimable (no kv trial pairs with a kv_mismatched trial)."
    p_holm = row.get("p_holm")
    significant = p_holm is not None and p_holm < ALPHA
    text = (f"pairing effect (kv − kv_mismatched) {_pts(row['estimate'])} points ({_ci(row)}, "
            f"Holm p{_p(p_holm)}, n={row['n']} pairs)")  # fmt: skip
    if p_holm is not None:
        text += ", significant" if significant else ", not significant"
    per_task = [e for e in effects if e["regime"] == regime and e["task"] != "ALL"
                and e["contrast"] == "pairing" and e["outcome"] == "success"]  # fmt: skip
    if len(per_task) > 1:
        text += " [" + "; ".join(f"{e['task']} {_pts(e['estimate'])}" for e in per_task) + "]"
    n_tasks = row.get("n_clusters") or row["n"]
    if p_holm is None or n_tasks < MIN_TASKS:
        return text + (f" — too few tasks to tell ({n_tasks} tasks; at least {MIN_TASKS} are needed), so no "
                       "comparison with the paper.")
    if regime == "private":
        if not (significant and row["estimate"] > 0):
            if row.get("ci_high") is not None and row["ci_high"] >= PAPER_LOW:
                return text + (f" — too few tasks to tell: the CI still reaches the paper's {PAPER_PRIVATE}.")
            return text + f" — this model disagrees with the paper, which found {PAPER_PRIVATE} in this regime."
        est = row["estimate"]
        size = "within" if PAPER_LOW <= est <= PAPER_HIGH else ("below" if est < PAPER_LOW else "above")
        return text + (f" — agrees with the paper that matched content pays here; the size is {size} the paper's "
                       f"{PAPER_PRIVATE}.")  # fmt: skip
    eq = _find(summary.get("equivalence", []), regime=regime, task="ALL", contrast="pairing")
    if eq is None or eq.get("p_tost") is None:
        return text + "; equivalence to 0 not tested."
    ci90 = _ci(eq, "ci90_low", "ci90_high", "90%")
    if eq["equivalent"]:
        return (text + f"; equivalent to 0 at ±{margin:g} points by TOST ({ci90}, Holm p{_p(eq['p_holm'])})"
                " — agrees with the paper (matched ≈ mismatched on natural benchmarks).")  # fmt: skip
    if significant:
        return (text + f"; not equivalent to 0 at ±{margin:g} points ({ci90}, TOST Holm p{_p(eq['p_holm'])})"
                " — this model disagrees with the paper, which found matched ≈ mismatched here.")  # fmt: skip
    if tost_too_wide(eq):
        return (text + f"; equivalence at ±{margin:g} points not testable ({ci90} is wider than "
                f"±{MAX_TOST_HALF_WIDTH:g} points) — too few tasks to tell.")  # fmt: skip
    return (text + f"; not shown equivalent to 0 at ±{margin:g} points ({ci90}, TOST Holm p{_p(eq['p_holm'])})"
            " — inconclusive at this sample size (the paper found equivalence with 500 tasks × 5 seeds).")  # fmt: skip


def tost_too_wide(eq: Mapping) -> bool:
    """The TOST row's 90% CI is wider than ``±MAX_TOST_HALF_WIDTH`` points: no equivalence claim either way."""
    lo, hi = eq.get("ci90_low"), eq.get("ci90_high")
    return lo is None or hi is None or (hi - lo) / 2 > MAX_TOST_HALF_WIDTH


def _cost_sentence(effects: list, regime: str) -> str:
    for contrast, against in (("kv_vs_text_full", "re-encoding the full text"), ("kv_vs_none", "no relay")):
        lat = _find(effects, regime=regime, task="ALL", contrast=contrast, outcome="latency_s")
        if lat is None:
            continue
        parts = []
        if lat["estimate"] is not None:
            word = "slower" if lat["estimate"] > 0 else "faster"
            parts.append(f"kv was {abs(lat['estimate']):.3g} s {word} per task than {against} ({_ci(lat, fmt=_secs)})")
        byt = _find(effects, regime=regime, task="ALL", contrast=contrast, outcome="relay_bytes")
        if byt is not None and byt["estimate"] is not None:
            word = "more" if byt["estimate"] >= 0 else "fewer"
            parts.append(f"relayed {_bytes(abs(byt['estimate']))} {word} per task")
        pre = _find(effects, regime=regime, task="ALL", contrast=contrast, outcome="prefill_tokens")
        if pre is not None and pre["estimate"] is not None and pre["estimate"] < 0:
            parts.append(f"saved {abs(pre['estimate']):.0f} receiver prefill tokens per task")
        if parts:
            return "; ".join(parts) + "."
    return ""
