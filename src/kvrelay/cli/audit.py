"""``kvrelay audit``: run a preset (or a custom config) and write records, summary and report.

    kvrelay audit --preset quick --model qwen2.5-coder-0.5b --out out/audit
    kvrelay audit report out/audit        # rebuild summary.json / report.* from records.jsonl
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP

app = typer.Typer(help="Causal audit: does the relayed cache carry the right content, and what does it cost?",
                  invoke_without_command=True)
console = Console()


def _csv(value: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in value.split(",") if x.strip()) if value else None


def finalize(out: Path, margin: float | None = None, n_boot: int | None = None) -> dict:
    """Recompute ``summary.json`` and the reports from ``records.jsonl`` (see ``report.rebuild``)."""
    from kvrelay.audit.report import rebuild

    try:
        paths = rebuild(out, margin=margin, n_boot=n_boot)
    except FileNotFoundError as err:  # no folder or no records.jsonl: rebuild's message says which
        raise typer.BadParameter(str(err)) from None
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


@app.callback()
def audit(
    ctx: typer.Context,
    preset_name: str = typer.Option("quick", "--preset", help="quick | full | smoke"),
    model: str | None = typer.Option(None, help="zoo name, folder or transformers id (default: the preset's)"),
    tasks: str | None = typer.Option(None, help="task sets, comma-separated (gen, squad, arc_challenge, ...); "
                                     "NAME:COUNT caps one set (squad:160)"),
    arms: str | None = typer.Option(None, help="arms, comma-separated (none, kv, kv_mismatched, kv_noise:0.5, ...)"),
    seeds: str | None = typer.Option(None, help="seeds, comma-separated"),
    limit: int | None = typer.Option(None, help="cap on tasks per task set"),
    batch_size: int | None = typer.Option(None, help="tasks per padded batch"),
    out: Path = typer.Option(Path("out/audit"), help="output folder (re-running resumes)"),
    threads: int | None = typer.Option(None, help="torch intra-op threads (default: torch's, one per core)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
):
    """Run the audit into OUT: records.jsonl, summary.json, report.md, report.html."""
    if ctx.invoked_subcommand is not None:
        return
    import torch
    from tqdm import tqdm

    from kvrelay.audit.presets import preset
    from kvrelay.audit.runner import AuditRunner
    from kvrelay.audit.similarity import similarity_rows
    from kvrelay.audit.tasks import load_tasks
    from kvrelay.cli.common import load_for_cli

    cfg = preset(preset_name, model=model, tasks=_csv(tasks), arms=_csv(arms),
                 seeds=tuple(int(s) for s in _csv(seeds)) if seeds else None, limit=limit, batch_size=batch_size)
    lm = load_for_cli(cfg.model, threads, engine)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runner = AuditRunner(cfg, lm, out)
    # a resumed run starts its count at what is already on disk
    with tqdm(desc=f"audit {cfg.preset}", unit="trial", total=runner.total_trials(),
              initial=runner.done_trials()) as bar:
        runner.progress = bar.update
        runner.run()
    sim_path = out / "similarity.json"
    sim = json.loads(sim_path.read_text()) if sim_path.exists() else []
    have = {r["task"] for r in sim}
    todo = [name for name, _ in cfg.task_sets() if name not in have] if cfg.similarity_sample else []
    for name in tqdm(todo, desc="similarity", unit="set", disable=not todo):
        sim += similarity_rows(runner, load_tasks(name, limit=cfg.similarity_sample, seed=0))
    if todo:
        sim_path.write_text(json.dumps(sim, indent=2) + "\n")
    elapsed = time.time() - started
    prev = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    merged = json.loads((out / "config.json").read_text())  # what every run into OUT covered, together
    given = {"--preset": preset_name, "--model": model, "--tasks": tasks, "--arms": arms, "--seeds": seeds,
             "--limit": limit, "--batch-size": batch_size, "--out": out,
             "--engine": engine}
    command = " ".join(["kvrelay audit", *(f"{k} {shlex.quote(str(v))}" for k, v in given.items() if v is not None)])
    meta = {"model": cfg.model, "preset": cfg.preset, "tasks": merged["tasks"], "arms": merged["arms"],
            "seeds": merged["seeds"], "limit": merged["sets"], "elapsed_s": prev.get("elapsed_s", 0.0) + elapsed,
            "threads": torch.get_num_threads(),
            "commands": [*prev.get("commands", [prev["command"]] if "command" in prev else []), command],
            "fingerprint": lm.identity.fingerprint, "engine": lm.engine}
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    res = finalize(out, margin=cfg.margin, n_boot=cfg.n_boot)
    _print_headline(res["summary"])
    console.print(f"audit took {elapsed / 60:.1f} min; report: {out / 'report.html'}")


@app.command("report")
def report(out: Path = typer.Argument(..., help="an audit output folder")):
    """Rebuild summary.json, report.md and report.html from OUT/records.jsonl."""
    res = finalize(out)
    _print_headline(res["summary"])
    console.print(f"report: {out / 'report.html'}")
