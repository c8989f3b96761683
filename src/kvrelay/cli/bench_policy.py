"""``kvrelay bench policy`` (mounted under ``bench``): fixed strategies vs the learned policy, replayed from
held-out audit records over a fast and a slow link (``bench.policy``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli import validate as v
from kvrelay.cli.common import command_line, write_json

app = typer.Typer(pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)


def print_result(res: dict) -> None:
    t = Table(title=f"bench policy — held out {', '.join(res['held_out_tasks'])}: {res['n_tasks']} tasks x "
                    f"{len(res['links'])} links = {res['requests']} requests (fitted on {', '.join(res['fit_task_sets'])})")
    for c in ("strategy", "accuracy [95% CI]", "latency s", "channels"):
        t.add_column(c, justify="left" if c in ("strategy", "channels") else "right")
    for s in res["strategies"]:
        mix = ", ".join(f"{k} {n}" for k, n in sorted(s["channels"].items()))
        t.add_row(s["name"], f"{s['accuracy']:.1f} [{s['ci_low']:.1f}, {s['ci_high']:.1f}]", f"{s['latency_s']:.3f}",
                  mix)
    console.print(t)
    ct = Table(title="value model, held-out calibration (Brier: lower is better)")
    for c in ("channel", "n", "predicted", "observed", "Brier", "Brier base rate"):
        ct.add_column(c, justify="left" if c == "channel" else "right")
    for r in res["calibration"]["per_channel"]:
        ct.add_row(r["channel"], str(r["n"]), f"{r['mean_predicted']:.2f}", f"{r['mean_observed']:.2f}",
                   f"{r['brier']:.3f}", f"{r['brier_base_rate']:.3f}")
    console.print(ct)
    dom = f"yes, by {', '.join(res['dominated_by'])}" if res["policy_dominated"] else "no"
    console.print(f"learned policy dominated (another strategy both faster and more accurate): {dom}")


@app.command("policy")
def policy_cmd(
    profile: Path = typer.Option(..., help="a cost profile: the JSON of `kvrelay calibrate --json` (or its "
                                 "saved profile file)"),
    audits: str = typer.Option("docs/audit", help="comma-separated audit folders (each with records.jsonl or "
                               "records.jsonl.gz), or one folder holding several"),
    held_out: str = typer.Option("gen_easy,arc_challenge", help="task sets kept out of the value model's fit and "
                                 "replayed"),
    per_set: int = typer.Option(48, help="held-out tasks replayed per task set (a seeded sample)"),
    slo: float = typer.Option(None, help="the receiver's latency budget in seconds (default: none)"),
    seed: int = typer.Option(0, help="seed of the random strategy and the bootstraps"),
    plot: Path = typer.Option(None, help="write the latency-accuracy frontier as a PNG here"),
    json_path: Path = typer.Option(None, "--json", help="write the result here"),
) -> None:
    """Always-text, always-kv, always-kv-int8, random, static checklist and the learned policy on a held-out workload."""
    prof_path = v.existing_file(profile, "--profile", "a JSON written by `kvrelay calibrate --json`")
    folders = v.records_folders(audits, "--audits", "docs/audit")
    sets = v.csv(held_out, "--held-out", "gen_easy,arc_challenge")
    v.positive(per_set, "--per-set")
    if slo is not None and not slo > 0:
        raise v.InvalidInput(f"--slo {slo}", "a latency budget > 0 seconds")
    v.writable_path(plot, "--plot")
    v.writable_path(json_path, "--json")

    from kvrelay.bench.policy import bench_policy, plot_frontier
    from kvrelay.policy.cost import CostProfile

    res = bench_policy(CostProfile.load(prof_path), folders=folders, held_out=sets, slo_s=slo, seed=seed,
                       per_set=per_set)
    res["command"] = command_line()
    print_result(res)
    if plot is not None:
        console.print(f"wrote {plot_frontier(res, plot)}")
    write_json(json_path, res, console=console)
