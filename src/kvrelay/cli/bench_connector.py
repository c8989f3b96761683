"""``kvrelay bench connector`` (mounted under ``bench`` by the root CLI): one relayed cache, each receiver."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="A relayed cache continued by each receiver it connects to.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)


def print_report(res: dict) -> None:
    load = res["load_average"]
    t = Table(title=f"bench connector — {res['model']}, {res['context_tokens']} relayed tokens, up to "
                    f"{res['new_tokens']} new tokens, {res['threads']} threads (medians of {res['repeats']}; "
                    f"{load['status'].upper()}: 1-min load up to {load['max']:.1f}, quiet <= {load['limit']:g})")
    for col in ("receiver", "TTFT s", "vs text", "reused", "prefilled", "= text", "answer"):
        t.add_column(col, justify="left" if col in ("receiver", "answer") else "right")
    for r in res["rows"]:
        t.add_row(r["mode"], f"{r['ttft_s']:.3f}", f"{r['ttft_speedup_vs_text']:.1f}x", str(r["reused_tokens"]),
                  str(r["prefilled_tokens"]), "yes" if r["answer_equal_to_text"] else "[red]no[/red]",
                  repr(r["answer"]))
    console.print(t)
    for name, why in res["unavailable"].items():
        console.print(f"[yellow]not connected:[/yellow] {name}: {why}")
    imp = res.get("lmcache_import")
    if imp:
        console.print(f"chunks vLLM stored, read back: {imp['tokens']} tokens, largest difference from the sender's "
                      f"K/V {imp.get('max_abs_diff', float('nan')):.2g}, kvrelay's answer from them equal to re-reading: "
                      f"{imp.get('answer_equal_to_text')}")


@app.command("connector")
def connector_cmd(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or tiny:ARCH"),
    context_tokens: int = typer.Option(2048, help="tokens the sender reads and relays"),
    new_tokens: int = typer.Option(16, help="most tokens the receiver writes per answer"),
    repeats: int = typer.Option(3, help="interleaved repeats; medians are reported"),
    page_size: int = typer.Option(16, help="tokens per page of the continuous-batching cache"),
    max_batch_tokens: int = typer.Option(256, help="most tokens continuous batching runs in one forward"),
    threads: int | None = typer.Option(None, help="threads (default: one per core)"),
    allow_load: bool = typer.Option(False, "--allow-load", help="keep figures from a busy machine (1-minute load "
                                    "above the threads + 0.5), labelled loaded; without it such a run stops"),
    json_path: Path | None = typer.Option(None, "--json", help="write the result as JSON"),
    lmcache: bool = typer.Option(False, "--lmcache", help="also the payload stored as LMCache chunks and vLLM's "
                                 "CPU build answering from them, beside vLLM re-reading (needs make peers-vllm and "
                                 "a zoo model's folder; starts LMCache's server and vLLM, minutes)"),
):
    """Receiver TTFT and greedy answer from re-reading the text, the payload through DynamicCache, the payload
    as prefix blocks of transformers' continuous batching, and that engine re-reading; every answer is
    compared with re-reading, and receivers that cannot be connected are named with the reason."""
    import platform

    from kvrelay.cli import validate as v
    from kvrelay.cli.common import command_line, load_for_cli, note, write_json

    v.positive(context_tokens, "--context-tokens", minimum=16)
    for value, flag in ((new_tokens, "--new-tokens"), (repeats, "--repeats"),
                        (page_size, "--page-size"), (max_batch_tokens, "--max-batch-tokens")):
        v.positive(value, flag)
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    ref = v.model(model)
    v.fits(ref, context_tokens, "--context-tokens", reserve=new_tokens + 64)

    from contextlib import nullcontext

    from kvrelay.bench.connector import Setup, bench_connector, report

    folder = None
    if lmcache:
        from kvrelay.bench.peer_servers import lmcache_available, model_folder

        missing = lmcache_available()
        folder = model_folder(model)
        if missing or folder is None:
            raise v.InvalidInput(f"--lmcache with {model}", missing or "a zoo model pulled into the cache "
                                 "(kvrelay models pull NAME): vLLM loads its folder")
    threads = threads or os.cpu_count() or 1
    lm = load_for_cli(model, threads)
    if lmcache:
        from kvrelay.bench.peers.lmcache_vllm import LmcacheVllm

        note("starting LMCache's cache server and vLLM with its connector (minutes)")
        peer = LmcacheVllm(folder, model, threads, lm.identity)
    with peer if lmcache else nullcontext() as running:
        raw = bench_connector(lm, Setup(context_tokens, new_tokens, repeats, page_size, max_batch_tokens),
                              allow_load=allow_load, progress=note, lmcache=running)
    import torch

    res = report(raw, model=model, command=command_line(), decode=lm.tokenizer.decode,
                 extra={"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__})
    print_report(res)
    write_json(json_path, res, console=console)
