"""``kvrelay bench partial`` (mounted under ``bench`` by the root CLI): accuracy vs bytes of partial relay."""

from __future__ import annotations

import os
from itertools import zip_longest
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP

app = typer.Typer(help="Receiver-driven partial relay: accuracy against bytes.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 170)


def _fmt(x, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def print_rows(rows: list[dict], title: str) -> None:
    t = Table(title=title)
    for c in ("method", "budget", "kept", "KB", "vs full bytes", "accuracy [95% CI]", "Δ vs full [95% CI]",
              "TTFT s", "n"):
        t.add_column(c, justify="left" if c == "method" else "right")
    for r in rows:
        t.add_row(r["method"], f"{r['budget']:g}", f"{r['kept']:.2f}", f"{r['bytes'] / 1e3:.1f}",
                  _fmt(r["bytes_vs_full"], ".3f"),
                  f"{r['accuracy']:.1f} [{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]",
                  f"{_fmt(r['delta_vs_full'], '+.1f')} [{_fmt(r['delta_ci_low'], '+.1f')}, "
                  f"{_fmt(r['delta_ci_high'], '+.1f')}]", f"{r['ttft_s']:.3f}", str(r["n"]))
    console.print(t)


@app.command("partial")
def partial(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    tasks: str = typer.Option("squad,gen_easy", help="comma-separated audit task sets (private regime: squad, "
                              "gen_easy)"),
    limit: int = typer.Option(20, help="tasks per set (the first N of the audit's order)"),
    budgets: str = typer.Option("0.05,0.1,0.25,0.5,1.0", help="comma-separated fractions of positions"),
    encodings: str = typer.Option("raw,int8", help="comma-separated: raw, int8 (the partial payload's coding)"),
    methods: str = typer.Option("full,receiver_driven,evict_agnostic,text_message,text_full,none",
                                help="comma-separated methods"),
    max_new_tokens: int = typer.Option(12, help="tokens the receiver may write"),
    window: int = typer.Option(None, help="score positions by the attention of the receiver's last N prompt "
                               "tokens (0: all of them; default: a partial request's, docs/layouts.md)"),
    pool: int = typer.Option(None, help="max-pool the scores over this many neighbouring positions (odd; 1: none; "
                             "default: a partial request's)"),
    lookahead: int = typer.Option(None, help="score positions by the sender's own first N answer tokens instead "
                                  "of the prompt's (0: by the prompt; default: a partial request's)"),
    verify: bool = typer.Option(None, "--verify/--no-verify", help="the sender tries several selections and sends "
                                "the one that best reproduces its look-ahead answer (default: a partial request's)"),
    first_exact: bool = typer.Option(None, "--first-exact/--all-candidates", help="with verify: send the first "
                                     "candidate that predicts every look-ahead token, without checking the rest "
                                     "(default: a partial request's)"),
    backfill: bool = typer.Option(False, "--backfill/--no-backfill", help="correct the kept values by orthogonal "
                                  "backfill over the scoring rows (both eviction methods)"),
    message_tokens: int = typer.Option(64, help="tokens the sender's text_message note may have"),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    records: Path = typer.Option(None, help="every trial as JSON lines; an existing file is resumed: trials it "
                                 "holds with the same model, tokens and scoring are not rerun, whichever "
                                 "methods, budgets and codings their run had"),
    json_path: Path = typer.Option(None, "--json", help="write rows as JSON (and the frontier PNG next to it)"),
):
    """Accuracy vs bytes: full relay, receiver-driven partial relay, question-agnostic eviction, text, nothing."""
    from kvrelay.bench.partial import ENCODINGS, METHODS
    from kvrelay.cli import validate as v

    task_sets = v.csv(tasks, "--tasks", "squad,gen_easy")
    v.positive(limit, "--limit")
    budget_list = v.float_list(budgets, "--budgets", example="0.1,0.25,1.0")
    for b in budget_list:
        v.fraction(b, "--budgets")
    enc_list = v.names(encodings, "--encodings", ENCODINGS, "raw,int8")
    method_list = v.names(methods, "--methods", METHODS, "full,receiver_driven,none")
    if "full" not in method_list:
        raise v.InvalidInput("--methods lacks full", "full among the methods (differences are paired against it)")
    v.positive(max_new_tokens, "--max-new-tokens")
    v.positive(message_tokens, "--message-tokens")
    if window is not None and window < 0:
        raise v.InvalidInput(f"--window {window}", "--window 0 (every prompt token) or a positive count")
    if pool is not None and (pool < 1 or pool % 2 == 0):
        raise v.InvalidInput(f"--pool {pool}", "--pool an odd number of positions >= 1")
    if lookahead is not None and lookahead < 0:
        raise v.InvalidInput(f"--lookahead {lookahead}", "--lookahead 0 (score by the prompt) or a positive count")
    v.positive(threads, "--threads")
    v.engine(engine)
    v.writable_path(json_path, "--json")
    v.writable_path(records, "--records")
    v.model(model)

    from kvrelay.audit.tasks import available, load_tasks

    for name in task_sets:
        v.choice(name, "--tasks", available())

    from kvrelay.bench.partial import by_set, missing, plot, run, select_trials, summarize, trial_row
    from kvrelay.cli.common import command_line, load_for_cli, state, write_json
    from kvrelay.core.jsonl import append_json_lines, resume_json_lines

    per_set = [[(name, t) for t in load_tasks(name, limit=limit, seed=0)] for name in task_sets]
    task_list = [x for group in zip_longest(*per_set) for x in group if x is not None]  # sets interleaved
    from kvrelay.kv.partial import (
        DEFAULT_FIRST_EXACT,
        DEFAULT_LOOKAHEAD,
        DEFAULT_POOL,
        DEFAULT_VERIFY,
        DEFAULT_WINDOW,
    )

    checked = DEFAULT_VERIFY if verify is None else verify
    scoring = {"window": DEFAULT_WINDOW if window is None else (window or None),
               "pool": DEFAULT_POOL if pool is None else pool,
               "lookahead": DEFAULT_LOOKAHEAD if lookahead is None else lookahead,
               "verify": checked, "backfill": backfill,  # first_exact means nothing unchecked: off, as records say
               "first_exact": checked and (DEFAULT_FIRST_EXACT if first_exact is None else first_exact)}
    lm = None
    if engine == "auto":  # the mode it picks on this machine is what the records must match
        lm = load_for_cli(model, threads, engine)
        engine = lm.engine
    setup = {"model": model, "engine": engine, "budgets": budget_list, "encodings": list(enc_list),
             "methods": list(method_list), "max_new_tokens": max_new_tokens, "message_tokens": message_tokens,
             **scoring}
    try:  # a line cut short by a killed run goes before anything is appended
        done = select_trials(resume_json_lines(records), setup, where=records) if records is not None else []
    except ValueError as err:
        raise v.InvalidInput(str(err), "a --records file written by this command") from None
    sink = None
    if records is not None:
        def sink(trials):
            append_json_lines(records, (trial_row(setup, t) for t in trials))

    load_before = os.getloadavg()[0]
    if lm is None and missing(task_list, done, budget_list, enc_list, method_list):  # else: summarized from
        lm = load_for_cli(model, threads, engine)  # the records without loading the model
    trials = run(lm, task_list, budgets=budget_list, encodings=enc_list, methods=method_list,
                 max_new_tokens=max_new_tokens, message_tokens=message_tokens, done=done, sink=sink,
                 progress=not state.quiet and lm is not None, scoring=scoring)
    rows, sets = summarize(trials), by_set(trials)
    load_after = os.getloadavg()[0]
    n_tasks = len({t.task for t in trials})
    print_rows(rows, f"bench partial — {model}, {n_tasks} tasks ({', '.join(task_sets)}), points 0–100")
    if len(sets) > 1:
        for name, set_rows in sets.items():
            print_rows(set_rows, f"{name} alone — {len({t.task for t in trials if t.task_set == name})} tasks")
    if n_tasks < 200:
        console.print(f"[yellow]note:[/yellow] {n_tasks} tasks; a verdict on ±3 points needs about 200 per set")
    reused = {id(t) for t in done}
    out = {"rows": rows, "by_set": sets, "trials_run": sum(id(t) not in reused for t in trials),
           "trials_reused": sum(id(t) in reused for t in trials), "model": model,
           "tasks": {"sets": list(task_sets), "limit": limit, "n": n_tasks},
           "setup": setup, "records": str(records) if records else None, "threads": threads,
           "load_average": {"load1_before": round(load_before, 2), "load1_after": round(load_after, 2),
                            "status": "loaded" if max(load_before, load_after) > (threads or 2) + 0.5 else "quiet"},
           "command": command_line()}
    if json_path is not None:
        write_json(json_path, out, console=console)
        plot(rows, json_path.with_suffix(".png"))
        console.print(f"wrote {json_path.with_suffix('.png')}")
