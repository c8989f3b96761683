"""``kvrelay bench repair`` and ``kvrelay bench repair-profile`` (mounted under ``bench`` by the root CLI)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Repair of approximate cache reuse by selective recompute.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(";") if x.strip()]


def print_rows(rows: list[dict]) -> None:
    t = Table(title="bench repair — accuracy and paired difference vs re-prefill (points), median TTFT")
    for c in ("case", "method", "budget", "accuracy [95% CI]", "Δ vs re-prefill [95% CI]", "agree", "TTFT s",
              "re-prefill TTFT s", "speedup", "n"):
        t.add_column(c, justify="left" if c in ("case", "method") else "right")
    for r in rows:
        t.add_row(r["case"], r["method"], f"{r['budget']:.3f}",
                  f"{r['accuracy']:.1f} [{r['ci_low']:.1f}, {r['ci_high']:.1f}]",
                  f"{r['delta']:+.1f} [{r['delta_ci_low']:+.1f}, {r['delta_ci_high']:+.1f}]",
                  f"{r['agreement']:.2f}", f"{r['ttft_s']:.2f}", f"{r['reprefill_ttft_s']:.2f}",
                  f"{r['reprefill_ttft_s'] / r['ttft_s']:.1f}x", str(r["n"]))
    console.print(t)


@app.command("repair")
def repair(
    sender: str = typer.Option("qwen2.5-coder-0.5b+summarizer", help="variant case: the sending variant"),
    receiver: str = typer.Option("qwen2.5-coder-0.5b+qa", help="variant case: the receiving variant"),
    model: str = typer.Option("qwen2.5-coder-0.5b", help="replace case: the one model"),
    cases: str = typer.Option("variant,replace", help="comma-separated: variant, replace"),
    methods: str = typer.Option("raw;recompute:tokens=0.05;recompute:tokens=0.12;recompute:layers=0-3;reprefill",
                                help="';'-separated: raw, reprefill, or a repair spec recompute:layers=A-B|auto:K,"
                                     "tokens=F"),
    tasks: str = typer.Option("gen", help="gen: generated records (the receiver answers a number); squad: a SQuAD "
                              "question whose passage sits among other articles' passages (bench.repair.squad_long)"),
    n: int = typer.Option(20, min=2, help="tasks"),
    context_tokens: int = typer.Option(2048, min=64, help="approximate document length"),
    seed: int = typer.Option(0),
    max_new_tokens: int = typer.Option(12, min=1),
    profile: Path | None = typer.Option(None, help="deviation profile JSON (kvrelay bench repair-profile), "
                                        "needed by layers=auto:K"),
    threads: int | None = typer.Option(None, help="torch threads"),
    json_path: Path | None = typer.Option(None, "--json", help="write rows as JSON (and a PNG plot next to it)"),
    records: Path | None = typer.Option(None, help="every trial as JSON lines, a task's lines written once it is "
                                        "done; an existing file is resumed: tasks it holds for the same setup "
                                        "are not rerun, so a larger --n extends an earlier run"),
):
    """Quality vs TTFT over recompute budgets: raw reuse (0) .. repairs .. full re-prefill (1)."""
    from kvrelay.bench.repair import CASES, TASK_SETS, plot, run
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli, write_json
    from kvrelay.core.errors import RecordsError
    from kvrelay.fuse.repair import parse_repair

    case_list = v.names(cases, "--cases", CASES, "variant,replace")
    v.choice(tasks, "--tasks", TASK_SETS)
    method_list = _split(methods)
    for m in method_list:
        if m not in ("raw", "reprefill"):
            v.parsed_names(m, "--methods", parse_repair, "raw, reprefill or recompute:layers=A-B|auto:K,tokens=F, "
                           "';'-separated")
    if profile is not None:
        v.existing_file(profile, "--profile", "a profile JSON from `kvrelay bench repair-profile`")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.writable_path(records, "--records")
    for name in ((sender, receiver) if "variant" in case_list else ()) + ((model,) if "replace" in case_list else ()):
        v.model(name)
    try:
        out = run(lambda name: load_for_cli(name, threads), case_list, method_list, sender=sender,
                  receiver=receiver, model=model, tasks=tasks, n=n, context_tokens=context_tokens, seed=seed,
                  max_new_tokens=max_new_tokens, profile=profile, threads=threads, records=records)
    except RecordsError as err:
        raise typer.BadParameter(str(err), param_hint="--records") from None
    print_rows(out["rows"])
    console.print(f"budget <= 0.2, paired CI within +-2 points, >= 3x lower TTFT: {out['target_met']}")
    if json_path:
        write_json(json_path, out, console=console)
        plot(out["rows"], json_path.with_suffix(".png"))
        console.print(f"wrote {json_path.with_suffix('.png')}")


@app.command("repair-profile")
def repair_profile(
    sender: str = typer.Option("qwen2.5-coder-0.5b+summarizer"),
    receiver: str = typer.Option("qwen2.5-coder-0.5b+qa"),
    sequences: int = typer.Option(4, min=1, help="documents profiled"),
    context_tokens: int = typer.Option(512, min=16),
    out: Path = typer.Option(..., help="where the profile JSON goes"),
    threads: int | None = typer.Option(None),
):
    """Per-layer K/V deviation of SENDER vs RECEIVER (the artefact layers=auto:K chooses its block from)."""
    from kvrelay.bench.repair import profile_variants
    from kvrelay.cli.common import load_for_cli

    prof = profile_variants(load_for_cli(sender, threads), load_for_cli(receiver, threads), sequences,
                            context_tokens)
    prof.save(out)
    t = Table(title=f"K/V deviation per layer, {sender} vs {receiver}")
    t.add_column("layer", justify="right")
    t.add_column("deviation", justify="right")
    for i, x in enumerate(prof.deviation):
        t.add_row(str(i), f"{x:.4f}")
    console.print(t)
    console.print(f"most deviating block of 4 layers: {prof.block(4)}; wrote {out}")
