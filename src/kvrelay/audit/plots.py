"""Figures of an audit report as PNG bytes: forest plot, dose-response, CATE, cost-benefit, similarity.

Each function takes rows of ``summary.json`` (docs/json.md; success in points, effects ``A − B``)
and returns PNG bytes, or None when the rows hold nothing to plot. Figures use matplotlib's
object API on an Agg canvas — no pyplot, no backend switch — so drawing a report never changes
the caller's matplotlib state and needs no display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from io import BytesIO

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvrelay.audit.vocab import ALPHA, contrast_rank

ALL = "ALL"
REGIMES = ("private", "shared")
CONTRAST_COLORS = {"pairing": "#1b9e77", "presence": "#d95f02", "kv_vs_text_message": "#7570b3",
                   "kv_vs_text_full": "#e7298a", "kv_vs_none": "#66a61e"}  # fmt: skip
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")  # fmt: skip
REGIME_MARKERS = {"private": "o", "shared": "s"}
DPI = 100


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white")
    return buf.getvalue()


def _regimes(rows: Sequence[Mapping]) -> list[str]:
    present = {r["regime"] for r in rows}
    return [r for r in REGIMES if r in present] + sorted(present - set(REGIMES))


def _contrast_key(c: str) -> int:
    return contrast_rank(c)


def _task_cells(rows: Sequence[Mapping], regime: str) -> list[str]:
    """Task sets of a regime, sorted, with the pooled ``ALL`` last — only when it pools several."""
    tasks = sorted({r["task"] for r in rows if r["regime"] == regime and r["task"] != ALL})
    has_all = any(r["regime"] == regime and r["task"] == ALL for r in rows)
    return tasks + ([ALL] if has_all and (len(tasks) != 1) else [])


def _task_label(task: str) -> str:
    return "pooled" if task == ALL else task


def _colors(keys: Sequence[str]) -> dict[str, str]:
    return {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(keys)}


def _yerr(mean: float, lo: float | None, hi: float | None) -> list[list[float]]:
    """Asymmetric error-bar lengths for ``errorbar`` (zero when the CI is undefined)."""
    return [[mean - lo if lo is not None else 0.0], [hi - mean if hi is not None else 0.0]]


# ---------------------------------------------------------------- forest plot


def forest_plot(effects: Sequence[Mapping]) -> bytes | None:
    """Success contrasts per regime (one panel each) and task set: estimate, 95% CI, zero line.

    Filled markers: Holm-adjusted p < 0.05; hollow: not significant.
    """
    rows = [e for e in effects if e.get("outcome") == "success" and e.get("estimate") is not None]
    if not rows:
        return None
    panels = []
    for regime in _regimes(rows):
        items = []
        for task in _task_cells(rows, regime):
            cell = [e for e in rows if e["regime"] == regime and e["task"] == task]
            items.append(sorted(cell, key=lambda e: _contrast_key(e["contrast"])))
        panels.append((regime, items))
    heights = [sum(len(g) for g in items) + 0.5 * (len(items) - 1) + 1.0 for _, items in panels]
    fig = Figure(figsize=(9.5, 0.3 * sum(heights) + 1.4), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (regime, groups) in zip(axes, panels, strict=True):
        y, ticks, labels, seps = 0.0, [], [], []
        for g, group in enumerate(reversed(groups)):  # top to bottom in reading order
            if g:
                seps.append(y - 0.75)
                y += 0.5
            for e in reversed(group):
                color = CONTRAST_COLORS.get(e["contrast"], "#555555")
                sig = e.get("p_holm") is not None and e["p_holm"] < ALPHA
                ax.errorbar(e["estimate"], y, xerr=_yerr(e["estimate"], e.get("ci_low"), e.get("ci_high")),
                            fmt="o", color=color, mfc=color if sig else "white", mew=1.5, ms=6, capsize=3, lw=1.6)  # fmt: skip
                ticks.append(y)
                labels.append(f"{_task_label(e['task'])} · {e['contrast']}")
                y += 1.0
        for s in seps:
            ax.axhline(s, color="#cccccc", lw=0.8)
        ax.axvline(0.0, color="black", lw=0.9)
        ax.set_yticks(ticks, labels, fontsize=8.5)
        ax.set_ylim(-0.8, y - 0.2)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{regime} regime", loc="left", fontsize=10, fontweight="bold")
    axes[-1].set_xlabel("effect on success, A − B (points), with 95% CI")
    present = sorted({e["contrast"] for e in rows}, key=_contrast_key)
    handles = [Line2D([], [], marker="o", ls="", color=CONTRAST_COLORS.get(c, "#555555"), label=c) for c in present]
    handles += [Line2D([], [], marker="o", ls="", color="black", label="Holm p < 0.05"),
                Line2D([], [], marker="o", ls="", color="black", mfc="white", label="not significant")]  # fmt: skip
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    return _png(fig)


# ---------------------------------------------------------------- dose-response


def dose_response_plot(dose_rows: Sequence[Mapping],
                       baselines: Mapping[tuple[str, str], Mapping[str, float]] | None = None) -> bytes | None:  # fmt: skip
    """Success (points, 95% CI) against the dose, one panel per regime × dial family.

    Numeric families (noise σ, layer/token fractions) are curves over the dose, ``kv`` being the
    reference point (σ 0, fraction 1); ``kv_codec`` is categorical. One line per task set, the
    pooled cell bold. ``baselines[(regime, task)]`` (arm → mean success) adds dashed reference
    lines for ``none`` and ``kv_mismatched`` of the pooled (or only) cell.
    """
    rows = [r for r in dose_rows if r.get("mean") is not None]
    if not rows:
        return None
    regimes = _regimes(rows)
    families = sorted({r["family"] for r in rows}, key=lambda f: (f == "kv_codec", f))
    fig = Figure(figsize=(4.3 * len(families) + 1.5, 3.4 * len(regimes) + 0.6), layout="constrained")
    axes = fig.subplots(len(regimes), len(families), squeeze=False)
    tasks_all = sorted({r["task"] for r in rows if r["task"] != ALL})
    colors = _colors(tasks_all) | {ALL: "black"}
    for i, regime in enumerate(regimes):
        cells = _task_cells(rows, regime)
        for j, family in enumerate(families):
            ax = axes[i][j]
            fam = [r for r in rows if r["regime"] == regime and r["family"] == family]
            if not fam:
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{family}: not run in {regime}", ha="center", va="center", fontsize=8)
                continue
            numeric = all(r.get("dose_value") is not None for r in fam)
            order = _dose_order(fam, numeric)
            for k, task in enumerate(cells):
                pts = sorted((r for r in fam if r["task"] == task), key=lambda r: order[r["dose"]])
                if not pts:
                    continue
                shift = 0.0 if numeric else (k - (len(cells) - 1) / 2) * 0.08
                xs = [r["dose_value"] if numeric else order[r["dose"]] + shift for r in pts]
                means = [r["mean"] for r in pts]
                lo = [m - r["ci_low"] if r.get("ci_low") is not None else 0.0 for m, r in zip(means, pts, strict=True)]
                hi = [r["ci_high"] - m if r.get("ci_high") is not None else 0.0 for m, r in zip(means, pts, strict=True)]
                bold = task == ALL or len(cells) == 1
                ax.errorbar(xs, means, yerr=[lo, hi], fmt="o-" if numeric else "o", color=colors[task], capsize=3,
                            lw=2.2 if bold else 1.1, ms=5 if bold else 4, alpha=1.0 if bold else 0.75,
                            label=_task_label(task))  # fmt: skip
            ref_cell = (regime, ALL if ALL in cells else cells[0])
            for arm, style in (("none", ":"), ("kv_mismatched", "--")):
                level = (baselines or {}).get(ref_cell, {}).get(arm)
                if level is not None:
                    ax.axhline(level, color="#777777", ls=style, lw=1.0, label=f"{arm} ({_task_label(ref_cell[1])})")
            if numeric:
                _dose_axis(ax, [r["dose_value"] for r in fam], family)
            else:
                ax.set_xticks(list(order.values()), [("kv (ref.)" if d == "reference" else d) for d in order],
                              fontsize=8)  # fmt: skip
                ax.set_xlim(-0.6, len(order) - 0.4)
                ax.set_xlabel(family.replace("kv_", "") + " (categorical)")
            ax.set_ylim(-5, 105)
            ax.set_ylabel("success (points)")
            ax.grid(alpha=0.3)
            ax.set_title(f"{regime} · {family}", fontsize=10)
            ax.legend(fontsize=7, loc="best")
    return _png(fig)


def _dose_order(rows: Sequence[Mapping], numeric: bool) -> dict[str, int]:
    """Dose label → position; numeric doses by value, categorical with the reference first."""
    if numeric:
        labels = [r["dose"] for r in sorted(rows, key=lambda r: r["dose_value"])]
    else:
        labels = ["reference"] * any(r["dose"] == "reference" for r in rows)
        labels += sorted({r["dose"] for r in rows} - {"reference"})
    return {d: i for i, d in enumerate(dict.fromkeys(labels))}


def _dose_axis(ax, values: Sequence[float], family: str) -> None:
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) >= 20:
        ax.set_xscale("symlog", linthresh=min(positive))
    names = {"kv_noise": "noise σ (× per-layer RMS)", "kv_layers": "fraction of layers kept"}
    ax.set_xlabel(names.get(family, f"{family.replace('kv_', '')} (fraction of tokens kept)"))


# ---------------------------------------------------------------- CATE


def cate_plot(cate_rows: Sequence[Mapping], contrast: str, max_covariates: int = 4) -> bytes | None:
    """Subgroup effects of ``contrast`` on success (points, 95% CI), one panel per covariate × regime.

    ``doc_tokens`` comes first; numeric subgroups sit at the middle of their range (quantile bins
    differ per task set), categorical ones at one position per level. One line per task set.
    """
    rows = [r for r in cate_rows if r.get("contrast") == contrast and r.get("task") != ALL
            and r.get("estimate") is not None]  # fmt: skip
    if not rows:
        return None
    covariates = sorted({r["covariate"] for r in rows}, key=lambda c: (c != "doc_tokens", c))[:max_covariates]
    regimes = _regimes(rows)
    panels = [(cov, g) for cov in covariates for g in regimes if any(r["covariate"] == cov and r["regime"] == g
                                                                     for r in rows)]  # fmt: skip
    ncols = min(len(regimes), len(panels)) if len(regimes) > 1 else min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    colors = _colors(sorted({r["task"] for r in rows}))
    fig = Figure(figsize=(5.4 * ncols + 0.6, 3.3 * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    for ax, (cov, regime) in zip(axes, panels, strict=False):
        sub = [r for r in rows if r["covariate"] == cov and r["regime"] == regime]
        numeric = all(r.get("lo") is not None for r in sub)
        levels = {} if numeric else {s: k for k, s in enumerate(sorted({r["subgroup"] for r in sub}))}
        tasks = sorted({r["task"] for r in sub})
        span = max(r["hi"] for r in sub) - min(r["lo"] for r in sub) if numeric else 0.0
        for k, task in enumerate(tasks):
            pts = sorted((r for r in sub if r["task"] == task),
                         key=lambda r: r["lo"] if numeric else levels[r["subgroup"]])  # fmt: skip
            shift = (k - (len(tasks) - 1) / 2) * (0.012 * span if numeric else 0.1)
            xs = [((r["lo"] + r["hi"]) / 2 if numeric else levels[r["subgroup"]]) + shift for r in pts]
            ests = [r["estimate"] for r in pts]
            lo = [e - r["ci_low"] if r.get("ci_low") is not None else 0.0 for e, r in zip(ests, pts, strict=True)]
            hi = [r["ci_high"] - e if r.get("ci_high") is not None else 0.0 for e, r in zip(ests, pts, strict=True)]
            ax.errorbar(xs, ests, yerr=[lo, hi], fmt="o-" if numeric else "o", color=colors[task], capsize=3,
                        lw=1.4, ms=5, label=task)  # fmt: skip
        ax.axhline(0.0, color="black", lw=0.9)
        if not numeric:
            ax.set_xticks(list(levels.values()), list(levels), fontsize=8)
            ax.set_xlim(-0.6, len(levels) - 0.4)
        ax.set_xlabel(f"{cov} (subgroup{' midpoint' if numeric else ''})")
        ax.set_ylabel(f"{contrast} effect (points)")
        ax.grid(alpha=0.3)
        ax.set_title(f"{regime} · by {cov}", fontsize=10)
        ax.legend(fontsize=7, loc="best")
    return _png(fig)


# ---------------------------------------------------------------- cost-benefit


def cost_benefit_plot(cost_rows: Sequence[Mapping]) -> bytes | None:
    """Accuracy gained (points, 95% CI) against extra latency (left) and extra relay bytes (right).

    Pooled cell of each regime, every arm against ``none`` (or ``text_full`` where ``none`` was
    not run); colour = arm, marker = regime.
    """
    rows = []
    for regime in _regimes(cost_rows):
        pooled = [r for r in cost_rows if r["regime"] == regime and r["task"] == ALL]
        refs = [r["reference"] for r in pooled]
        ref = "none" if "none" in refs else ("text_full" if "text_full" in refs else None)
        rows += [r for r in pooled if r["reference"] == ref and r.get("gain_points") is not None]
    if not rows:
        return None
    arms = sorted({r["arm"] for r in rows}, key=lambda a: (not a.startswith("text"), a))
    colors = _colors(arms)
    fig = Figure(figsize=(12.0, 4.6), layout="constrained")
    ax_lat, ax_bytes = fig.subplots(1, 2, sharey=True)
    for r in rows:
        err = _yerr(r["gain_points"], r.get("gain_ci_low"), r.get("gain_ci_high"))
        style = {"fmt": REGIME_MARKERS.get(r["regime"], "D"), "color": colors[r["arm"]], "capsize": 3, "ms": 7,
                 "mec": "black", "mew": 0.5, "alpha": 0.9}  # fmt: skip
        if r.get("extra_latency_s") is not None:
            ax_lat.errorbar(r["extra_latency_s"], r["gain_points"], yerr=err, **style)
        if r.get("extra_relay_bytes") is not None:
            ax_bytes.errorbar(r["extra_relay_bytes"] / 1e6, r["gain_points"], yerr=err, **style)
    refs = sorted({r["reference"] for r in rows})
    for ax in (ax_lat, ax_bytes):
        ax.axhline(0.0, color="black", lw=0.9)
        ax.axvline(0.0, color="#999999", lw=0.7)
        ax.grid(alpha=0.3)
    ax_lat.set_xlabel(f"extra latency per task vs {' / '.join(refs)} (s)")
    ax_bytes.set_xlabel(f"extra relay bytes per task vs {' / '.join(refs)} (MB)")
    ax_lat.set_ylabel(f"accuracy gained vs {' / '.join(refs)} (points)")
    ax_lat.set_title("latency vs accuracy gained (pooled per regime)", fontsize=10)
    ax_bytes.set_title("relay bytes vs accuracy gained", fontsize=10)
    handles = [Line2D([], [], marker="o", ls="", color=colors[a], mec="black", mew=0.5, label=a) for a in arms]
    handles += [Line2D([], [], marker=REGIME_MARKERS.get(g, "D"), ls="", color="white", mec="black", label=f"{g} regime")
                for g in _regimes(rows)]  # fmt: skip
    fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    return _png(fig)


# ---------------------------------------------------------------- similarity


def similarity_plot(sim_rows: Sequence[Mapping]) -> bytes | None:
    """Mean similarity (95% CI) per regime · task · comparison, one panel per metric."""
    rows = [r for r in sim_rows if r.get("mean") is not None]
    if not rows:
        return None
    metrics = sorted({r["metric"] for r in rows})
    n_max = max(sum(r["metric"] == m for r in rows) for m in metrics)
    fig = Figure(figsize=(5.0 * len(metrics) + 2.0, 0.35 * n_max + 1.6), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    colors = {"kv_vs_text_full": CONTRAST_COLORS["kv_vs_text_full"], "kv_vs_mismatched": CONTRAST_COLORS["pairing"]}
    for ax, metric in zip(axes, metrics, strict=True):
        sub = sorted((r for r in rows if r["metric"] == metric),
                     key=lambda r: (_regimes(rows).index(r["regime"]), r["task"], r["comparison"]))  # fmt: skip
        for y, r in enumerate(reversed(sub)):
            ax.errorbar(r["mean"], y, xerr=_yerr(r["mean"], r.get("ci_low"), r.get("ci_high")), fmt="o",
                        color=colors.get(r["comparison"], "#555555"), capsize=3)  # fmt: skip
        ax.set_yticks(range(len(sub)), [f"{r['regime']} · {_task_label(r['task'])} · {r['comparison']}"
                                        for r in reversed(sub)], fontsize=8)  # fmt: skip
        ax.set_xlabel(metric.replace("_", " "))
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(metric, fontsize=10)
    return _png(fig)
