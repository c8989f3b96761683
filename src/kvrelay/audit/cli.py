"""``kvrelay audit``: run a preset (or a custom config) and write records, summary and report.

    kvrelay audit --preset quick --model qwen2.5-coder-0.5b --out out/audit
    kvrelay audit report out/audit        # rebuild summary.json / report.* from records.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Causal audit: does the relayed cache carry the right content, and what does it cost?",
                  invoke_without_command=True)
console = Console()


def _csv(value: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in value.split(",") if x.strip()) if value else None


def finalize(out: Path, lm_name: str | None = None) -> dict:
    """Recompute ``summary.json`` and the reports from ``records.jsonl`` (+ ``run.json``, ``similarity.json``)."""
    from kvrelay.audit.report import write_report
    from kvrelay.audit.runner import read_records
    from kvrelay.audit.stats import summarize, verdict

    records_path = out / "records.jsonl"
    if not records_path.exists():
        raise typer.BadParameter(f"{records_path} does not exist: run `kvrelay audit --out {out}` first")
    records = read_records(records_path)
    meta = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    cfg = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    summary = {"model": lm_name or meta.get("model") or cfg.get("model")}
    summary.update(summarize(records, margin=cfg.get("margin", 2.8), n_boot=cfg.get("n_boot", 2000)))
    sim_path = out / "similarity.json"
    if sim_path.exists():
        summary["similarity"] = json.loads(sim_path.read_text())
    summary["verdict"] = verdict(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    paths = write_report(out, records, summary, meta)
    return {"summary": summary, "paths": paths}


def _print_headline(summary: dict) -> None:
    t = Table(title=f"audit — {summary.get('model')}: success effects (points, 95% CI)")
    for c in ("regime", "task", "contrast", "estimate", "CI", "p (Holm)", "n"):
        t.add_column(c)
    for e in summary["effects"]:
        if e["outcome"] != "success" or e["contrast"] not in ("pairing", "presence", "kv_vs_none", "kv_vs_text_full"):
            continue
        ci = "—" if e["ci_low"] is None else f"[{e['ci_low']:+.1f}, {e['ci_high']:+.1f}]"
        ph = "—" if e.get("p_holm") is None else f"{e['p_holm']:.3g}"
        est = "—" if e["estimate"] is None else f"{e['estimate']:+.1f}"
        t.add_row(e["regime"], e["task"], e["contrast"], est, ci, ph, str(e["n"]))
    console.print(t)
    console.print(summary["verdict"])


@app.callback()
def audit(
    ctx: typer.Context,
    preset_name: str = typer.Option("quick", "--preset", help="quick | full | smoke"),
    model: str | None = typer.Option(None, help="zoo name, folder or transformers id (default: the preset's)"),
    tasks: str | None = typer.Option(None, help="task sets, comma-separated (gen, squad, arc_challenge, ...)"),
    arms: str | None = typer.Option(None, help="arms, comma-separated (none, kv, kv_mismatched, kv_noise:0.5, ...)"),
    seeds: str | None = typer.Option(None, help="seeds, comma-separated"),
    limit: int | None = typer.Option(None, help="cap on tasks per task set"),
    batch_size: int | None = typer.Option(None, help="tasks per padded batch"),
    out: Path = typer.Option(Path("out/audit"), help="output folder (re-running resumes)"),
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
    from kvrelay.models.loader import load_model

    torch.set_num_threads(2)
    cfg = preset(preset_name, model=model, tasks=_csv(tasks), arms=_csv(arms),
                 seeds=tuple(int(s) for s in _csv(seeds)) if seeds else None, limit=limit, batch_size=batch_size)
    lm = load_model(cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tqdm(desc=f"audit {cfg.preset}", unit="trial") as bar:
        runner = AuditRunner(cfg, lm, out, progress=bar.update)
        bar.total = runner.total_trials()
        runner.run()
    sim_path = out / "similarity.json"
    if cfg.similarity_sample and not sim_path.exists():
        rows = []
        for name in tqdm(cfg.tasks, desc="similarity", unit="set"):
            rows += similarity_rows(runner, load_tasks(name, limit=cfg.similarity_sample, seed=0))
        sim_path.write_text(json.dumps(rows, indent=2) + "\n")
    elapsed = time.time() - started
    prev = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    meta = {"model": cfg.model, "preset": cfg.preset, "tasks": list(cfg.tasks), "arms": list(cfg.arms),
            "seeds": list(cfg.seeds), "limit": cfg.limit, "elapsed_s": prev.get("elapsed_s", 0.0) + elapsed,
            "threads": torch.get_num_threads(), "command": " ".join(["kvrelay", *sys.argv[1:]]),
            "fingerprint": lm.identity.fingerprint}
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    res = finalize(out, cfg.model)
    _print_headline(res["summary"])
    console.print(f"audit took {elapsed / 60:.1f} min; report: {out / 'report.html'}")


@app.command("report")
def report(out: Path = typer.Argument(..., help="an audit output folder")):
    """Rebuild summary.json, report.md and report.html from OUT/records.jsonl."""
    res = finalize(out)
    _print_headline(res["summary"])
    console.print(f"report: {out / 'report.html'}")
