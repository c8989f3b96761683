"""``kvrelay bench speculative`` (mounted under ``bench`` by the root CLI): speculative decoding from relayed caches."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Speculative decoding from relayed caches.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)


@app.callback()
def _group() -> None:
    """Keep ``speculative`` a named sub-command even while it is the only one."""


def print_report(res: dict) -> None:
    load = res["load_average"]
    t = Table(title=f"bench speculative — target {res['target']}, draft {res['draft']}, {res['context_tokens']} "
                    f"relayed tokens, {res['new_tokens']} new tokens, {res['threads']} threads (medians of "
                    f"{res['repeats']}; {load['status'].upper()}: 1-min load up to {load['max']:.1f}, "
                    f"quiet <= {load['limit']:g})")
    for col in ("workload", "mode", "total s", "TTFT s", "decode tok/s", "vs relay", "acceptance", "= text"):
        t.add_column(col, justify="left" if col in ("workload", "mode") else "right")
    for r in res["rows"]:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        t.add_row(r["workload"], r["mode"], f"{r['total_s']:.2f}", f"{r['ttft_s']:.3f}",
                  f"{r['decode_tokens_per_s']:.2f}", f"{r.get('decode_speedup_vs_relay', float('nan')):.2f}x", acc,
                  "yes" if r["outputs_identical"] else "[red]no[/red]")
    console.print(t)


@app.command("speculative")
def speculative_cmd(
    target: str = typer.Option("qwen2.5-coder-1.5b", help="the receiver's model (zoo name, folder or tiny:ARCH)"),
    draft: str = typer.Option("qwen2.5-coder-0.5b", help="the draft model, same tokenizer as --target; "
                              "'none' skips the relay_draft mode"),
    context_tokens: int = typer.Option(2048, min=16, help="tokens the sender reads and relays"),
    new_tokens: int = typer.Option(64, min=2, help="tokens the receiver writes per answer"),
    repeats: int = typer.Option(3, min=1, help="interleaved repeats; medians are reported"),
    workloads: str = typer.Option("quote,answer", help="comma-separated: quote (the receiver quotes the relayed "
                                  "document) | answer (it answers in its own words)"),
    engine: str = typer.Option("fp32", help="engine mode of both models (docs/engine.md)"),
    codec: str = typer.Option("raw", help="payload codec on the wire (raw keeps relay exact)"),
    num_draft: int = typer.Option(4, min=1, help="most tokens the draft model writes per verify forward"),
    lookup_tokens: int = typer.Option(8, min=1, help="most tokens prompt lookup proposes per verify forward"),
    min_draft: int = typer.Option(1, min=1, help="fewest tokens either drafter proposes per verify forward; on a "
                                  "CPU where a 2- or 3-token forward costs 2 or 3 one-token steps, 4 "
                                  "(benchmarks/verify_cost.py measures it; docs/engine.md)"),
    threads: int | None = typer.Option(None, help="threads (default: one per core)"),
    allow_load: bool = typer.Option(False, "--allow-load", help="keep figures from a busy machine (1-minute load "
                                    "above the threads + 0.5), labelled loaded; without it such a run stops"),
    json_path: Path | None = typer.Option(None, "--json", help="write the result as JSON"),
):
    """Decode from a relayed cache plainly, with prompt lookup over the relayed tokens, and with a draft model
    continuing from its own relayed cache; every mode's tokens are checked against re-reading the text."""
    from kvrelay.bench.speculative import MODES, WORKLOADS, Setup, bench_speculative, report
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import command_line, load_for_cli, note, write_json
    from kvrelay.models.speculative import PromptLookup

    loads = tuple(v.names(workloads, "--workloads", tuple(WORKLOADS), "quote,answer"))
    v.engine(engine)
    v.parsed_names(codec, "--codec", _codec_parse, "one codec name (docs/codecs.md)")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    ref = v.model(target, "--target")
    v.fits(ref, context_tokens, "--context-tokens", reserve=new_tokens + 64)
    use_draft = draft != "none"
    if use_draft:
        v.model(draft, "--draft")
    if min_draft > min(num_draft, lookup_tokens):
        raise v.InvalidInput(f"--min-draft {min_draft}", f"at most --num-draft ({num_draft}) and --lookup-tokens "
                             f"({lookup_tokens})")
    setup = Setup(context_tokens, new_tokens, repeats, loads, codec,
                  PromptLookup(num_draft=lookup_tokens, min_draft=min_draft), num_draft, min_draft)
    threads = threads or os.cpu_count() or 1
    target_lm = load_for_cli(target, threads, engine=engine)
    draft_lm = load_for_cli(draft, threads, engine=engine) if use_draft else None
    modes = MODES if use_draft else tuple(m for m in MODES if m != "relay_draft")
    raw = bench_speculative(target_lm, draft_lm, setup, modes=modes, allow_load=allow_load, progress=note)
    import torch

    from kvrelay.models.engine_auto import cpu_flags, cpu_model

    res = report(raw, target=target, draft=draft if use_draft else None, command=command_line(),
                 extra={"cpu": cpu_model(), "cpu_flags": list(cpu_flags()), "cpus": os.cpu_count(),
                        "platform": platform.platform(), "torch": torch.__version__, "engine": engine,
                        "resolved_engine": target_lm.identity.engine})
    print_report(res)
    write_json(json_path, res, console=console)


def _codec_parse(name: str):
    from kvrelay.kv.codecs import parse

    return parse(name)


