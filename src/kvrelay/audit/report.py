"""The audit report: ``report.md`` and a self-contained ``report.html`` from records + summary.

:func:`write_report` lays the report out once as a list of :class:`Section` objects (paragraphs,
tables, figures) and renders that list twice: Markdown (figures as PNG files under ``figures/``)
and HTML (the same PNGs embedded as base64 ``data:`` URIs, inline CSS, a Content-Security-Policy
that forbids every non-inline resource, so the page loads with no network). Sections whose data
is absent (no dose arms, no covariates…) become a one-line note; the verdict is always last.
:func:`rebuild` backs ``kvrelay audit report DIR``: records.jsonl or records.jsonl.gz (+ run.json) →
summary.json + report.

Units as in :mod:`kvrelay.audit.stats`: success effects in points (score × 100), ``A − B``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvrelay.audit import plots
from kvrelay.audit.document import Fig, Para, Section, Table, render_html, render_markdown
from kvrelay.audit.fmt import ci_text, duration, meta_text, nbytes, pval, value_text
from kvrelay.audit.stats import ALL, summarize
from kvrelay.audit.verdict import MAX_TOST_HALF_WIDTH, tost_too_wide
from kvrelay.audit.vocab import ALPHA, arm_order, arm_rank, contrast_arms, contrast_rank, contrasts_for
from kvrelay.core.jsonl import read_json_lines
from kvrelay.core.records_file import DESCRIBED, records_file

#: summary keys that summarize() does not compute from records; rebuild() reads them from KEY.json or
#: carries them over from the summary.json it replaces.
CARRIED_KEYS = ("similarity",)
#: meta keys shown first, in this order, with these labels; other keys follow as they come.
META_LABELS = {"model": "model", "preset": "preset", "tasks": "task sets", "arms": "arms", "seeds": "seeds",
               "limit": "tasks per set (limit)", "elapsed_s": "elapsed", "command": "command line",
               "commands": "command lines (in order; re-runs resume)",
               "versions": "versions"}  # fmt: skip


# ---------------------------------------------------------------- layout blocks


# ---------------------------------------------------------------- number formatting


def _task(task: str) -> str:
    return "pooled (ALL)" if task == ALL else task


def _sorted_effects(rows: Sequence[Mapping]) -> list[Mapping]:
    regimes = ("private", "shared")

    def key(e: Mapping) -> tuple:
        c = e["contrast"]
        return (regimes.index(e["regime"]) if e["regime"] in regimes else 9, e["task"] == ALL, e["task"],
                contrast_rank(c), c)  # fmt: skip

    return sorted(rows, key=key)


SEED_FACTORS = {"option_order": "the multiple-choice option order (answer slot balanced across seeds)",
                "mismatch_partner": "the mismatch partner (another task of similar length per seed)",
                "sampling": "the receiver's sampling draw (temperature {t:g})",
                "random_draws": "the random draws of kv_random / kv_noise"}


def seeds_vary_text(design: Mapping) -> str:
    """One line: what the seeds varied, and the share of tasks whose success moved with them."""
    varies = design.get("varies") or []
    if not varies:
        return "nothing: every seed repeated the same trial (greedy decoding, same input), so tasks are the evidence"
    text = "; ".join(SEED_FACTORS[v].format(t=design.get("temperature") or 0) for v in varies if v in SEED_FACTORS)
    moved = [r for r in design.get("by_arm") or [] if r.get("tasks")]
    if moved:
        text += " — tasks whose success differs between seeds: " + ", ".join(
            f"{r['arm']} {100 * r['varying']:.0f}%" for r in _pooled_by_arm(moved))
    return text


def _pooled_by_arm(rows: Sequence[Mapping]) -> list[dict]:
    """``seed_report``'s per-cell shares pooled per arm (weighted by tasks), in report arm order."""
    tasks: dict[str, int] = {}
    varying: dict[str, float] = {}
    for r in rows:
        tasks[r["arm"]] = tasks.get(r["arm"], 0) + r["tasks"]
        varying[r["arm"]] = varying.get(r["arm"], 0.0) + r["varying"] * r["tasks"]
    return [{"arm": a, "varying": varying[a] / tasks[a]} for a in sorted(tasks, key=arm_rank)]


# ---------------------------------------------------------------- sections


def _facts(records: Sequence[Mapping], summary: Mapping, meta: Mapping) -> Section:
    sec = Section("run", "Run")
    rows: list[tuple[str, str]] = []
    for key, label in META_LABELS.items():
        if key in meta and meta[key] not in (None, "", [], {}):
            v = meta[key]
            if key == "elapsed_s":
                text = duration(v)
            elif key == "command" and isinstance(v, list | tuple):
                text = " ".join(str(x) for x in v)
            elif key == "commands" and isinstance(v, list | tuple):
                text = " ; ".join(str(x) for x in v)
            else:
                text = meta_text(v)
            rows.append((label, text))
    rows += [(str(k), meta_text(v)) for k, v in meta.items() if k not in META_LABELS and v not in (None, "", [], {})]
    tasks = summary.get("tasks") or {}
    rows.append(("tasks", f"{summary.get('n_tasks', 'n/a')} ("
                 + ", ".join(f"{k}: {v}" for k, v in tasks.items()) + ")"))  # fmt: skip
    rows.append(("trials", str(len(records))))
    if "seeds" in summary and meta_text(summary["seeds"]) != meta_text(meta.get("seeds", "")):
        rows.append(("seeds in records", meta_text(summary["seeds"])))
    if summary.get("seed_design"):
        rows.append(("seeds vary", seeds_vary_text(summary["seed_design"])))
    s = summary.get("settings") or {}
    if s:
        rows.append(("statistics", f"{_conf(s)} BCa bootstrap ({s.get('n_boot', '?')} resamples, cluster over tasks),"
                     f" Holm per outcome family, TOST margin ±{s.get('margin', 2.8):g} points at"
                     f" α={s.get('tost_alpha', ALPHA):g}"))  # fmt: skip
    sec.blocks.append(Table(("", ""), rows))
    sec.blocks.append(Para("Success is the task's score in points (score × 100). Every effect is paired, "
                           "A − B, matched on task and seed; contrasts: " + "; ".join(
                               f"{c} = {a} − {b}" for c, (a, b) in contrasts_for({r["arm"] for r in records}).items())
                           + ".", "note"))  # fmt: skip
    unmatched = summary.get("unmatched") or []
    if unmatched:
        parts = [f"{u['regime']}/{_task(u['task'])} {u['contrast']}: {u.get('only_a', 0)} {u.get('arm_a', 'A')}"
                 f" trials and {u.get('only_b', 0)} {u.get('arm_b', 'B')} trials without a partner" for u in unmatched]
        sec.blocks.append(Para("Unmatched trials (left out of the paired effects): " + "; ".join(parts) + ".", "warn"))
    return sec


def _conf(settings: Mapping) -> str:
    c = settings.get("confidence")
    return f"{100 * c:g}%" if isinstance(c, int | float) else "95%"


def _success_by_arm(records: Sequence[Mapping]) -> Section:
    """Mean success per arm (rows) and cell (columns); the pooled cell only for regimes with several task sets."""
    sec = Section("success", "Success by arm")
    means = _arm_means(records)
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        for task in (r["task"], ALL):
            counts[(r["regime"], task)][r["arm"]] += 1
    regimes = ("private", "shared")
    cells = []
    for regime, task in sorted(means, key=lambda k: (regimes.index(k[0]) if k[0] in regimes else 9, k[1] == ALL, k[1])):
        n_sets = len({t for (g, t) in means if g == regime and t != ALL})
        if not (task == ALL and n_sets == 1):  # the pooled cell of a one-task-set regime repeats its task set
            cells.append((regime, task))
    rows, keys = [], []
    for arm in arm_order({r["arm"] for r in records}):
        rows.append((arm, *(f"{means[c][arm]:.1f} (n={counts[c][arm]})" if arm in means[c] else "—" for c in cells)))
        keys.append(arm)
    sec.blocks.append(Para("Mean success (points) per arm and cell; n = trials (tasks × seeds).", "note"))
    sec.blocks.append(Table(("arm", *(f"{g} · {_task(t)}" for g, t in cells)), rows, keys))
    return sec


def _n(e: Mapping) -> str:
    """Pairs, and the tasks they cluster in when seeds repeat tasks (the bootstrap resamples tasks)."""
    n, k = e.get("n", "n/a"), e.get("n_clusters")
    return f"{n} ({k})" if k is not None and k != n else str(n)


def _effects_table(rows: Sequence[Mapping], level: str, collapsed: bool = False) -> Table:
    out, keys = [], []
    for e in _sorted_effects(rows):
        o = e["outcome"]
        a, b = contrast_arms(e["contrast"]) or ("A", "B")
        star = " *" if e.get("p_holm") is not None and e["p_holm"] < ALPHA else ""
        out.append((e["regime"], _task(e["task"]), e["contrast"], f"{a} − {b}", o, value_text(o, e.get("estimate")) + star,
                    ci_text(o, e.get("ci_low"), e.get("ci_high")), pval(e.get("p_value")), pval(e.get("p_holm")),
                    _n(e)))  # fmt: skip
        keys.append(f"{e['regime']}/{e['task']}/{e['contrast']}/{o}")
    return Table(("regime", "task set", "contrast", "A − B", "outcome", "estimate", f"{level} CI", "p", "Holm p",
                  "n pairs (tasks)"), out, keys, collapsed)  # fmt: skip


def _effects(summary: Mapping) -> list[Section]:
    effects = summary.get("effects") or []
    level = _conf(summary.get("settings") or {})
    head = Section("effects", "Effects on success")
    success = [e for e in effects if e["outcome"] == "success"]
    if not success:
        head.blocks.append(Para("No contrast could be estimated: the run lacks the arms of every contrast.", "note"))
        return [head]
    head.blocks.append(Para(f"Paired risk differences in points with {level} BCa bootstrap CIs; p from exact McNemar "
                            "(one seed) or Wilcoxon on per-task means; Holm across all success effects. "
                            "* = Holm p < 0.05.", "note"))  # fmt: skip
    png = plots.forest_plot(success)
    if png:
        head.blocks.append(Fig("forest", png, "Forest plot: success contrasts per regime and task set (95% CI); "
                                              "filled = Holm p < 0.05."))  # fmt: skip
    head.blocks.append(_effects_table(success, level))
    costs = Section("costs", "Effects on cost")
    other = [e for e in effects if e["outcome"] != "success"]
    if other:
        costs.blocks.append(Para("The same contrasts on latency (s), relay bytes and receiver prefill tokens "
                                 "(negative = the first arm is cheaper); Holm within each outcome.", "note"))  # fmt: skip
        costs.blocks.append(_effects_table(other, level, collapsed=True))
    else:
        costs.blocks.append(Para("No cost outcomes were recorded.", "note"))
    return [head, costs]


def _equivalence(summary: Mapping) -> Section:
    sec = Section("equivalence", "Equivalence (TOST)")
    rows = summary.get("equivalence") or []
    if not rows:
        sec.blocks.append(Para("No equivalence test: the contrasts it tests were not run.", "note"))
        return sec
    margin = rows[0].get("margin", 2.8)
    sec.blocks.append(Para(f"Two one-sided tests that the effect lies within ±{margin:g} points (the paper's margin); "
                           "90% CI from a paired t with cluster-robust SE; Holm across all equivalence tests. A 90% CI wider "
                           f"than ±{MAX_TOST_HALF_WIDTH:g} points is too wide to tell either way.", "note"))  # fmt: skip
    out, keys = [], []
    for e in _sorted_effects(rows):
        eq = ("yes" if e.get("equivalent") else "n/a" if e.get("p_tost") is None
              else "too few tasks to tell" if tost_too_wide(e) else "no")
        out.append((e["regime"], _task(e["task"]), e["contrast"], value_text("success", e.get("estimate")),
                    ci_text("success", e.get("ci90_low"), e.get("ci90_high")), f"±{e.get('margin', margin):g}",
                    pval(e.get("p_tost")), pval(e.get("p_holm")), eq, _n(e)))  # fmt: skip
        keys.append(f"{e['regime']}/{e['task']}/{e['contrast']}")
    sec.blocks.append(Table(("regime", "task set", "contrast", "estimate", "90% CI", "margin", "p TOST", "Holm p",
                             "equivalent", "n pairs (tasks)"), out, keys))  # fmt: skip
    return sec


def _dose(summary: Mapping, records: Sequence[Mapping]) -> Section:
    sec = Section("dose", "Dose-response")
    rows = summary.get("dose_response") or []
    if not rows:
        sec.blocks.append(Para("No dose arms (kv_noise, kv_layers, kv_tokens, kv_codec) were run: no dose-response.",
                               "note"))  # fmt: skip
        return sec
    png = plots.dose_response_plot(rows, _arm_means(records))
    if png:
        sec.blocks.append(Fig("dose_response", png, "Success against the dose (95% CI); kv is the reference "
                                                    "(σ 0, fraction 1); dashed: kv_mismatched, dotted: none."))  # fmt: skip
    out, keys = [], []
    for r in sorted(rows, key=lambda r: (r["regime"], r["task"] == ALL, r["task"], r["family"], not r.get("reference"),
                                         r.get("dose_value") or 0.0, r["dose"])):  # fmt: skip
        out.append((r["regime"], _task(r["task"]), r["family"], r["dose"], r["arm"], f"{r['mean']:.1f}"
                    if r.get("mean") is not None else "n/a", ci_text("success", r.get("ci_low"), r.get("ci_high")),
                    value_text("success", r.get("effect_vs_kv")) if not r.get("reference") else "reference",
                    ci_text("success", r.get("effect_ci_low"), r.get("effect_ci_high")), pval(r.get("p_value")),
                    str(r.get("n", "n/a"))))  # fmt: skip
        keys.append(f"{r['regime']}/{r['task']}/{r['arm']}")
    sec.blocks.append(Table(("regime", "task set", "family", "dose", "arm", "success", "CI", "effect vs kv",
                             "effect CI", "p", "n"), out, keys, collapsed=True))  # fmt: skip
    return sec


def _arm_means(records: Sequence[Mapping]) -> dict[tuple[str, str], dict[str, float]]:
    acc: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for task in (r["task"], ALL):
            acc[(r["regime"], task)][r["arm"]].append(100.0 * float(r["score"]))
    return {cell: {a: sum(v) / len(v) for a, v in arms.items()} for cell, arms in acc.items()}


def _cate(summary: Mapping) -> Section:
    sec = Section("cate", "Conditional effects (CATE)")
    rows = summary.get("cate") or []
    contrasts = {r["contrast"] for r in rows}
    contrast = min(contrasts, key=contrast_rank, default=None)
    if contrast is None:
        sec.blocks.append(Para("No covariates were recorded (or no contrast was run): no subgroup effects.", "note"))
        return sec
    picked = [r for r in rows if r["contrast"] == contrast]
    if not any(r["covariate"] == "doc_tokens" for r in picked):
        sec.blocks.append(Para("doc_tokens was not recorded: no effect by document length.", "note"))
    sec.blocks.append(Para(f"Subgroup effects of the {contrast} contrast on success (points, CI), by covariate "
                           "(numeric covariates in quantile bins per task set); p_fdr is Benjamini–Hochberg across "
                           "the subgroups of a cell and contrast. All contrasts are in summary.json.", "note"))  # fmt: skip
    png = plots.cate_plot(rows, contrast)
    if png:
        sec.blocks.append(Fig("cate", png, f"{contrast} effect by subgroup (95% CI), one line per task set."))
    out, keys = [], []
    for r in sorted(picked, key=lambda r: (r["regime"], r["task"] == ALL, r["task"], r["covariate"] != "doc_tokens",
                                           r["covariate"], r.get("lo") if r.get("lo") is not None else 0.0,
                                           r["subgroup"])):  # fmt: skip
        out.append((r["regime"], _task(r["task"]), r["covariate"], r["subgroup"], value_text("success", r.get("estimate")),
                    ci_text("success", r.get("ci_low"), r.get("ci_high")), pval(r.get("p_value")), pval(r.get("p_fdr")),
                    str(r.get("n", "n/a"))))  # fmt: skip
        keys.append(f"{r['regime']}/{r['task']}/{r['covariate']}/{r['subgroup']}")
    sec.blocks.append(Table(("regime", "task set", "covariate", "subgroup", "effect", "CI", "p", "p_fdr", "n pairs"),
                            out, keys, collapsed=True))  # fmt: skip
    reg = [r for r in summary.get("cate_regression") or [] if r["contrast"] == contrast]
    if reg:
        sec.blocks.append(Para(f"Regression of the paired {contrast} difference (points) on the covariates "
                               "(OLS; cluster-robust SE by task with several seeds, HC1 otherwise).", "note"))  # fmt: skip
        out = [(r["regime"], _task(r["task"]), r["term"], "n/a" if r.get("coef") is None else f"{r['coef']:+.4g}",
                "n/a" if r.get("se") is None else f"{r['se']:.3g}", pval(r.get("p_value")), str(r.get("n", "n/a")),
                str(r.get("cov_type", ""))) for r in reg]  # fmt: skip
        sec.blocks.append(Table(("regime", "task set", "term", "coef", "SE", "p", "n", "SE type"), out, collapsed=True))
    return sec


def _cost_benefit(summary: Mapping) -> Section:
    sec = Section("cost_benefit", "Cost-benefit")
    rows = summary.get("cost_benefit") or []
    if not rows:
        sec.blocks.append(Para("Neither none nor text_full was run: no baseline to measure gains against.", "note"))
        return sec
    png = plots.cost_benefit_plot(rows)
    if png:
        sec.blocks.append(Fig("cost_benefit", png, "Accuracy gained per arm against extra latency and extra relay "
                                                   "bytes, pooled per regime (95% CI)."))  # fmt: skip
    pooled = [r for r in rows if r["task"] == ALL]
    sec.blocks.append(Para("Per arm against each baseline, pooled per regime (per task set in summary.json): "
                           "accuracy gained, paired extra costs, and cost per point gained.", "note"))  # fmt: skip
    out, keys = [], []
    for r in sorted(pooled, key=lambda r: (r["regime"], r["reference"], arm_rank(r["arm"]))):
        out.append((r["regime"], r["arm"], r["reference"], value_text("success", r.get("gain_points")),
                    ci_text("success", r.get("gain_ci_low"), r.get("gain_ci_high")), value_text("latency_s", r.get("extra_latency_s")),
                    nbytes(r.get("extra_relay_bytes")), value_text("prefill_tokens", r.get("extra_prefill_tokens")),
                    "n/a" if r.get("latency_s_per_point") is None else f"{1e3 * r['latency_s_per_point']:.3g} ms",
                    nbytes(r.get("bytes_per_point"), signed=False), r.get("note") or ""))  # fmt: skip
        keys.append(f"{r['regime']}/{r['arm']}/{r['reference']}")
    sec.blocks.append(Table(("regime", "arm", "vs", "gain", "gain CI", "extra latency", "extra bytes",
                             "extra prefill", "latency/point", "bytes/point", "note"), out, keys))  # fmt: skip
    return sec


def _similarity(summary: Mapping) -> Section | None:
    rows = summary.get("similarity")
    if not rows:
        return None
    sec = Section("similarity", "Similarity analysis")
    sec.blocks.append(Para("On a sample of tasks: the receiver's attention mass on relayed positions and the cosine "
                           "similarity of its last-layer hidden states between arms (95% CI).", "note"))  # fmt: skip
    png = plots.similarity_plot(rows)
    if png:
        sec.blocks.append(Fig("similarity", png, "Similarity by regime, task set and comparison (95% CI)."))
    out = [(r.get("regime", ""), _task(r.get("task", "")), r.get("comparison", ""), r.get("metric", ""),
            "n/a" if r.get("mean") is None else f"{r['mean']:.3f}",
            "n/a" if r.get("ci_low") is None or r.get("ci_high") is None else f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
            str(r.get("n", "n/a"))) for r in rows]  # fmt: skip
    sec.blocks.append(Table(("regime", "task set", "comparison", "metric", "mean", "95% CI", "n"), out))
    return sec


def _verdict(summary: Mapping) -> Section:
    sec = Section("verdict", "Verdict")
    text = summary.get("verdict") or "No verdict: the summary has none."
    for line in text.splitlines():
        if line.strip():
            sec.blocks.append(Para(line.strip(), "p" if not line.startswith(" ") else "cost"))
    return sec


def build_sections(records: Sequence[Mapping], summary: Mapping, meta: Mapping) -> list[Section]:
    """The report as data, in reading order; the verdict is last."""
    sections = [_facts(records, summary, meta), _success_by_arm(records), *_effects(summary), _equivalence(summary),
                _dose(summary, records), _cate(summary), _cost_benefit(summary), _similarity(summary),
                _verdict(summary)]  # fmt: skip
    return [s for s in sections if s is not None]


# ---------------------------------------------------------------- rendering


def _title(meta: Mapping, summary: Mapping) -> str:
    model = meta.get("model") or summary.get("model")
    return f"kvrelay causal audit — {model}" if model else "kvrelay causal audit"


# ---------------------------------------------------------------- public API


def write_report(out_dir: Path | str, records: Sequence[Mapping], summary: Mapping, meta: Mapping) -> dict[str, Path]:
    """Write ``report.md``, ``report.html`` and ``figures/*.png`` into ``out_dir``.

    ``records``: the trials (records.jsonl rows); ``summary``: :func:`~kvrelay.audit.stats.summarize`'s
    dict (plus an optional ``similarity`` list); ``meta``: run facts (model, preset, arms, seeds,
    tasks, elapsed_s, versions, command — any keys, all shown). Returns ``{relative path: Path}``.
    """
    if not isinstance(summary, Mapping) or "effects" not in summary:
        raise ValueError("summary must be the dict kvrelay.audit.stats.summarize returns (no 'effects' key)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = build_sections(records, summary, meta or {})
    title = _title(meta or {}, summary)
    written: dict[str, Path] = {}
    figs = [b for s in sections for b in s.blocks if isinstance(b, Fig)]
    if figs:
        (out_dir / "figures").mkdir(exist_ok=True)
    for f in figs:
        rel = f"figures/{f.name}.png"
        (out_dir / rel).write_bytes(f.png)
        written[rel] = out_dir / rel
    for rel, text in (("report.md", render_markdown(title, sections)), ("report.html", render_html(title, sections))):
        (out_dir / rel).write_text(text, encoding="utf-8")
        written[rel] = out_dir / rel
    return written


def read_records(path: Path | str) -> list[dict]:
    """Trials of a ``records.jsonl`` or ``records.jsonl.gz`` (blank lines skipped), or of the one an audit
    folder holds (``core.records_file``); errors name the file and line."""
    path = Path(path)
    if path.is_dir():
        path = records_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {DESCRIBED} here — `kvrelay audit report DIR` rebuilds the "
                                f"report from the records an audit run wrote into DIR")  # fmt: skip
    records = read_json_lines(path)
    if not records:
        raise ValueError(f"{path}: no trial records (the file is empty)")
    return records


def rebuild(out_dir: Path | str, *, margin: float | None = None, n_boot: int | None = None,
            seed: int | None = None) -> dict[str, Path]:  # fmt: skip
    """Recompute ``summary.json`` and the report of ``out_dir`` from its records (``records.jsonl`` or
    ``records.jsonl.gz``, read as they are: a rebuild never unpacks them) (+ ``run.json``).

    Statistics settings (margin, n_boot, seed, confidence) default to those of an existing
    summary.json, so a rebuild reproduces the run's numbers; keys summarize() cannot recompute
    (``similarity``) come from ``similarity.json`` if the run wrote one, else from the old
    summary.json. ``model`` comes from run.json. Returns
    ``{relative path: Path}`` for summary.json, report.md, report.html and the figures.
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"{out_dir}: not a directory (expected an audit output directory)")
    records_path = records_file(out_dir)
    records = read_records(records_path)
    meta: dict = {}
    if (out_dir / "run.json").is_file():
        meta = json.loads((out_dir / "run.json").read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"{out_dir / 'run.json'}: expected a JSON object")
    old: dict = {}
    if (out_dir / "summary.json").is_file():
        try:
            old = json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            old = {}  # a damaged summary is what a rebuild replaces
    prev = old.get("settings") or {} if isinstance(old, dict) else {}
    kwargs = {"margin": margin if margin is not None else prev.get("margin", 2.8),
              "n_boot": n_boot if n_boot is not None else prev.get("n_boot", 2000),
              "seed": seed if seed is not None else prev.get("seed", 0),
              "confidence": prev.get("confidence", 0.95)}  # fmt: skip
    try:
        body = summarize(records, **kwargs)
    except ValueError as err:
        raise ValueError(f"{records_path}: {err}") from None
    summary = {"model": meta.get("model", old.get("model") if isinstance(old, dict) else None), **body}
    for key in CARRIED_KEYS:  # KEY.json written by the run wins over the replaced summary's copy
        if (out_dir / f"{key}.json").is_file():
            summary[key] = json.loads((out_dir / f"{key}.json").read_text(encoding="utf-8"))
        elif isinstance(old, dict) and old.get(key) is not None:
            summary[key] = old[key]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return {"summary.json": out_dir / "summary.json", **write_report(out_dir, records, summary, meta)}
