"""``kvrelay audit``: run a preset (or a custom config) and write records, summary and report.

    kvrelay audit --preset quick --model qwen2.5-coder-0.5b --out out/audit
    kvrelay audit report out/audit        # rebuild summary.json / report.* from records.jsonl[.gz]
    kvrelay audit --workflow wf.toml --edge a->b --inputs in.jsonl --score contains --out out/edge
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.audit.config import AuditConfig
from kvrelay.audit.presets import PRESETS, preset
from kvrelay.audit.vocab import arm_help
from kvrelay.cli import validate as v
from kvrelay.cli.common import (
    DEFAULT_ENGINE,
    ENGINE_HELP,
    command_line,
    load_for_cli,
    output_dir,
    progress_bar,
)
from kvrelay.core.records_file import DESCRIBED

app = typer.Typer(help="Causal audit: does the relayed cache carry the right content, and what does it cost?",
                  invoke_without_command=True)
console = Console()


def finalize(out: Path, margin: float | None = None, n_boot: int | None = None) -> dict:
    """Recompute ``summary.json`` and the reports from the records (see ``report.rebuild``)."""
    from kvrelay.audit.report import rebuild

    try:
        paths = rebuild(out, margin=margin, n_boot=n_boot)
    except FileNotFoundError as err:  # no folder or no records: rebuild's message says which
        raise v.InvalidInput(v.one_line(err), f"an audit output folder with {DESCRIBED}") from None
    return {"summary": json.loads(paths["summary.json"].read_text()), "paths": paths}


def _print_headline(summary: dict) -> None:
    t = Table(title=f"audit — {summary.get('model')}: success effects (points, 95% CI)")
    for c in ("regime", "task", "contrast", "estimate", "CI", "p (Holm)", "tasks"):
        t.add_column(c)
    for e in summary["effects"]:
        if e["outcome"] != "success" or e["contrast"] not in ("pairing", "presence", "kv_vs_none", "kv_vs_text_full"):
            continue
        ci = "—" if e["ci_low"] is None else f"[{e['ci_low']:+.1f}, {e['ci_high']:+.1f}]"
        ph = "—" if e.get("p_holm") is None else f"{e['p_holm']:.3g}"
        est = "—" if e["estimate"] is None else f"{e['estimate']:+.1f}"
        t.add_row(e["regime"], e["task"], e["contrast"], est, ci, ph, str(e.get("n_clusters", e["n"])))
    console.print(t)
    console.print(summary["verdict"])


def _preset_help() -> str:
    return "; ".join(f"{name}: {len(c.tasks)} task sets x {len(c.arms)} arms x {len(c.seeds)} seed(s), limit {c.limit}"
                     for name, c in PRESETS.items()) + " (docs/audit.md)"


def check_config(preset_name: str, model: str | None, tasks: str | None, arms: str | None, seeds: str | None,
                 limit: int | None, batch_size: int | None, temperature: float | None = None) -> AuditConfig:
    """The run's ``AuditConfig``, every argument checked (before any model loads or folder is made)."""
    from kvrelay.audit.config import split_task_spec
    from kvrelay.audit.tasks import available
    from kvrelay.audit.vocab import PLAIN_ARMS, parse_arm

    v.choice(preset_name, "--preset", tuple(PRESETS))
    v.positive(limit, "--limit")
    v.positive(batch_size, "--batch-size")
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise v.InvalidInput(f"--temperature {temperature}", "a finite number >= 0 (0 decodes greedily; 0.7 samples)")
    sets = available()
    task_specs = None
    if tasks is not None:
        task_specs = v.csv(tasks, "--tasks", "gen_easy,squad:160")
        for spec in task_specs:
            name, _, count = spec.partition(":")
            if name not in sets:
                raise v.InvalidInput(f"--tasks: {name!r} is not a task set", "one of " + ", ".join(sets),
                                     v.suggest(name, sets))
            try:
                split_task_spec(spec, None)
            except ValueError:
                raise v.InvalidInput(f"--tasks: {spec!r} has a bad count", "NAME or NAME:COUNT with COUNT an "
                                     "integer >= 2") from None
    arm_names = None
    if arms is not None:
        arm_names = v.parsed_names(arms, "--arms", parse_arm, f"arm names from {arm_help()} (docs/audit.md)",
                                   known=PLAIN_ARMS)
    seed_list = tuple(v.int_list(seeds, "--seeds", minimum=0, example="0,1")) if seeds is not None else None
    cfg = preset(preset_name, model=model, tasks=task_specs, arms=arm_names, seeds=seed_list, limit=limit,
                 batch_size=batch_size, temperature=temperature)
    parsed = [parse_arm(a) for a in cfg.arms]
    if any(a.needs_mismatch or a.mismatched_control for a in parsed):
        for name, count in cfg.task_sets():
            if count is not None and count < v.MIN_TASKS_FOR_MISMATCH:
                raise v.InvalidInput(f"{name} would run {count} task(s), but arm kv_mismatched (or kv_layers, "
                                     "kv_adapter_mismatched, kv_variant_mismatched) pairs each task with another task of its set",
                                     f"--limit (or NAME:COUNT) >= {v.MIN_TASKS_FOR_MISMATCH}")
    check_sharers(parsed)
    v.model(cfg.model)
    return cfg


def check_sharers(parsed) -> None:
    """Each adapter arm's artefact and each variant arm's variant exists (before any model loads)."""
    for a in parsed:
        if a.adapter:
            from kvrelay.audit.channels import resolve

            try:
                resolve(a.adapter)
            except ValueError as err:
                raise v.InvalidInput(f"--arms: {a.name}: {v.one_line(err)}",
                                     "kv_adapter:NAME with NAME a folder under artefacts/fuse/ or a path") from None
        if a.variant:
            from kvrelay.core.errors import UnknownModel
            from kvrelay.models.variants import adapter_dir

            try:
                adapter_dir(a.variant)
            except UnknownModel as err:
                raise v.InvalidInput(f"--arms: {a.name}: {v.one_line(err)}",
                                     "kv_variant:NAME:REPAIR with NAME a trained variant (a folder with "
                                     "adapter_config.json)") from None


@app.callback()
def audit(
    ctx: typer.Context,
    preset_name: str = typer.Option("quick", "--preset", help=_preset_help()),
    model: str = typer.Option(None, help="zoo name, folder or transformers id (default: the preset's)"),
    tasks: str = typer.Option(None, help="task sets, comma-separated (gen_easy, squad, arc_challenge, ...: "
                              "docs/audit.md); NAME:COUNT caps one set (squad:160)"),
    arms: str = typer.Option(None, help=f"arms, comma-separated: {arm_help()} (docs/audit.md)"),
    seeds: str = typer.Option(None, help="seeds, comma-separated: each varies the multiple-choice option order, "
                              "the mismatch partner and (with --temperature) the sampling draw"),
    temperature: float = typer.Option(None, help="receiver sampling temperature, seeded per seed, task and arm "
                                      "(default 0: greedy)"),
    limit: int = typer.Option(None, help="cap on tasks per task set"),
    batch_size: int = typer.Option(None, help="tasks per padded batch"),
    out: Path = typer.Option(Path("out/audit"), help="output folder (re-running resumes)"),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's, one per core)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    workflow: Path = typer.Option(None, help="audit one edge of this workflow TOML (docs/workflows.md) instead of "
                                  "task sets: needs --edge, --inputs and --score"),
    edge: str = typer.Option(None, help="with --workflow: the edge SENDER->RECEIVER the arms are applied on"),
    inputs: Path = typer.Option(None, help='with --workflow: JSONL, one {"context": ..., "reference": ...} per line'),
    score: str = typer.Option(None, help="with --workflow: how the final answer is scored against the reference: "
                              "exact, contains, f1 or python:MODULE:FUNC"),
    regime: str = typer.Option("private", help="with --workflow: private (the receiver sees the context only "
                               "through the edge) or shared (its own prompt holds it too): which verdict applies"),
):
    """Run the audit into OUT: records.jsonl, summary.json, report.md, report.html."""
    if ctx.invoked_subcommand is not None:
        return
    if workflow is not None or edge is not None or inputs is not None or score is not None:
        if temperature is not None:
            raise v.InvalidInput("--temperature with --workflow", "--temperature with task sets (--preset/--tasks); "
                                 "a workflow edge decodes greedily")
        _audit_edge(workflow, edge, inputs, score, regime, model, arms, seeds, tasks, out, threads, engine)
        return
    cfg = check_config(preset_name, model, tasks, arms, seeds, limit, batch_size, temperature)
    v.output_folder(out)
    v.positive(threads, "--threads")
    v.engine(engine)
    lm = load_for_cli(cfg.model, threads, engine)
    with output_dir(out):
        elapsed = _run(cfg, lm, out)
    res = finalize(out, margin=cfg.margin, n_boot=cfg.n_boot)
    _print_headline(res["summary"])
    console.print(f"audit took {elapsed / 60:.1f} min; report: {out / 'report.html'}")


def _audit_edge(workflow: Path | None, edge: str | None, inputs: Path | None, score: str | None, regime: str,
                model: str | None, arms: str | None, seeds: str | None, tasks: str | None, out: Path,
                threads: int | None, engine: str) -> None:
    """``--workflow``: the audit of one edge (``kvrelay.audit.edge``), checked before the model loads."""
    from kvrelay.audit.edge import (
        EDGE_ARMS,
        check_arms,
        check_resume,
        load_inputs,
        parse_edge,
        run_edge_audit,
        scorer,
    )
    from kvrelay.audit.vocab import PLAIN_ARMS, REGIMES, parse_arm
    from kvrelay.workflows.spec import Workflow

    for flag, value in (("--workflow", workflow), ("--edge", edge), ("--inputs", inputs), ("--score", score)):
        if value is None:
            raise v.InvalidInput(f"{flag} is missing", "--workflow FILE.toml --edge SENDER->RECEIVER --inputs "
                                 "FILE.jsonl --score exact|contains|f1|python:MODULE:FUNC, all four")
    if tasks is not None:
        raise v.InvalidInput("--tasks with --workflow", "either task sets (--tasks) or a workflow edge (--workflow)")
    v.existing_file(workflow, "--workflow", "a workflow TOML (docs/workflows.md)")
    try:
        wf = Workflow.load(workflow)
    except (ValueError, TypeError) as err:
        raise v.InvalidInput(f"--workflow {workflow}: {v.one_line(err)}", "a workflow TOML (docs/workflows.md)") \
            from None
    v.no_auto_edges(wf, workflow, allowed=parse_edge(wf, edge))  # the audited edge itself is set to each arm
    rows = load_inputs(v.existing_file(inputs, "--inputs", "a JSONL file"))
    scorer(score)
    v.choice(regime, "--regime", REGIMES)
    arm_names = EDGE_ARMS if arms is None else check_arms(
        v.parsed_names(arms, "--arms", parse_arm, f"arm names from {arm_help()} (docs/audit.md)", known=PLAIN_ARMS))
    check_sharers([parse_arm(a) for a in arm_names])
    seed_list = tuple(v.int_list(seeds, "--seeds", minimum=0, example="0,1")) if seeds is not None else (0,)
    name = model or "qwen2.5-coder-0.5b"
    v.model(name)
    v.output_folder(out)
    check_resume(out)
    v.positive(threads, "--threads")
    v.engine(engine)
    lm = load_for_cli(name, threads, engine)
    with output_dir(out), progress_bar(desc=f"audit {edge}", unit="trial",
                                       total=len(rows) * len(arm_names) * len(seed_list)) as bar:
        summary = run_edge_audit(wf, edge, rows, score, out, lm, arms=arm_names, seeds=seed_list, regime=regime,
                                 progress=bar.update, command=command_line(), model=name)
    _print_headline(summary)
    console.print(f"report: {out / 'report.html'}")


def _run(cfg: AuditConfig, lm, out: Path) -> float:
    """Records, similarity probes and ``run.json`` into ``out``; returns the seconds it took."""
    import torch

    from kvrelay.audit.runner import AuditRunner
    from kvrelay.audit.similarity import similarity_rows
    from kvrelay.audit.tasks import load_tasks

    started = time.time()
    runner = AuditRunner(cfg, lm, out)
    runner.check_resume()  # a folder made under other settings is refused before the progress bar starts
    # a resumed run starts its count at what is already on disk
    with progress_bar(desc=f"audit {cfg.preset}", unit="trial", total=runner.total_trials(),
                      initial=runner.done_trials()) as bar:
        runner.progress = bar.update
        runner.run()
    sim_path = out / "similarity.json"
    sim = json.loads(sim_path.read_text()) if sim_path.exists() else []
    have = {r["task"] for r in sim}
    todo = [name for name, _ in cfg.task_sets() if name not in have] if cfg.similarity_sample else []
    with progress_bar(desc="similarity", unit="set", total=len(todo), disable=not todo) as bar:
        for name in todo:
            sim += similarity_rows(runner, load_tasks(name, limit=cfg.similarity_sample, seed=0))
            bar.update(1)
    if todo:
        sim_path.write_text(json.dumps(sim, indent=2) + "\n")
    elapsed = time.time() - started
    prev = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    merged = json.loads((out / "config.json").read_text())  # what every run into OUT covered, together
    meta = {"model": cfg.model, "preset": cfg.preset, "tasks": merged["tasks"], "arms": merged["arms"],
            "seeds": merged["seeds"], "limit": merged["sets"], "elapsed_s": prev.get("elapsed_s", 0.0) + elapsed,
            "threads": torch.get_num_threads(),
            "commands": [*prev.get("commands", [prev["command"]] if "command" in prev else []), command_line()],
            "fingerprint": lm.identity.fingerprint, "engine": lm.engine}
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    return elapsed


@app.command("report")
def report(out: Path = typer.Argument(..., help="an audit output folder")):
    """Rebuild summary.json, report.md and report.html from OUT/records.jsonl (or OUT/records.jsonl.gz)."""
    v.records_of(out, "OUT", f"an audit output folder with {DESCRIBED}")
    res = finalize(out)
    _print_headline(res["summary"])
    console.print(f"report: {out / 'report.html'}")
