"""``kvrelay bench transfer`` (mounted under ``bench`` by the root CLI); also
``python -m kvrelay.cli.transfer transfer ...``."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP

app = typer.Typer(help="Payload transfer: stores x codecs x sizes, constrained links, break-even bandwidth.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)
DEFAULT_PIPELINE = Path("docs/bench/pipeline_doc5_512.json")


@app.callback()
def _group() -> None:
    """Keep ``transfer`` a named sub-command even while it is the only one."""


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _mbps(x) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.1f}")


def print_result(res: dict) -> None:
    t = Table(title=f"bench transfer — {res['model']} (medians of {res['repeats']}; overhead = encode+put+get+decode)")
    for c in ("store", "codec", "ctx", "path", "payload MB", "ratio", "encode s", "put s", "get s", "decode s",
              "overhead s", "saved prefill s", "overhead %"):
        t.add_column(c, justify="left" if c in ("store", "codec", "path") else "right")
    for r in res["rows"]:
        t.add_row(r["store"], r["codec"], str(r["context_tokens"]), r["path"], f"{r['payload_bytes'] / 1e6:.2f}",
                  f"{r['compression_ratio']:.2f}", f"{r['encode_s']:.3f}", f"{r['put_s']:.3f}", f"{r['get_s']:.3f}",
                  f"{r['decode_s']:.3f}", f"{r['overhead_s']:.3f}", f"{r['saved_prefill_s']:.2f}",
                  f"{100 * r['overhead_fraction']:.1f}")
    console.print(t)
    if res["links"]:
        lt = Table(title="over an emulated link (end to end at the receiver)")
        for c in ("rate Mbit/s", "codec", "ctx", "payload MB", "transfer s", "goodput Mbit/s", "kv s", "text s",
                  "faster"):
            lt.add_column(c, justify="right")
        for r in res["links"]:
            lt.add_row(f"{r['rate_mbit']:g}", r["codec"], str(r["context_tokens"]), f"{r['payload_bytes'] / 1e6:.2f}",
                       f"{r['transfer_s']:.2f}", f"{r['goodput_mbit']:.1f}", f"{r['kv_s']:.2f}", f"{r['text_s']:.2f}",
                       "kv" if r["kv_faster"] else "text")
        console.print(lt)
    console.print(res["link_note"])
    bt = Table(title="break-even bandwidth (Mbit/s): below it text relay is faster")
    for c in ("codec", "ctx", "measured", "closed form"):
        bt.add_column(c, justify="right")
    for b in res["break_even"]:
        m = b["measured"]
        meas = _mbps(b["measured_mbps"]) if m["mbps"] is not None else m["bound"]
        bt.add_row(b["codec"], str(b["context_tokens"]), meas, _mbps(b["closed_form_mbps"]))
    console.print(bt)
    console.print(f"break_even_mbps = {_mbps(res['break_even_mbps'])} ({res['break_even_basis']})")
    if "pipeline_over_link" in res:
        p = res["pipeline_over_link"]
        console.print(f"pipeline {p['workflow']} ({p['context_tokens']} tokens, {p['hand_offs']} kv hand-offs, "
                      f"in-process {p['in_process_speedup']:.2f}x) across the link [{p['method']}]: "
                      + ", ".join(f"{r['rate_mbit']:g} Mbit/s -> {r['speedup']:.2f}x" for r in p["rows"]))
    console.print(f"checks: {res['checks']}")


@app.command("transfer")
def transfer(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: str = typer.Option("512,2048", help="comma-separated context sizes"),
    stores: str = typer.Option("memory,disk,redis", help="comma-separated: memory, disk, redis"),
    codecs: str = typer.Option("raw,fp16,int8,int4,evict:0.2", help="comma-separated codec names (kv.codecs)"),
    repeats: int = typer.Option(3, min=1, help="interleaved repeats; medians are reported"),
    rates: str = typer.Option("10,30,100,1000", help="link rates in Mbit/s for the emulated link"),
    link: bool = typer.Option(True, help="emulate links with network namespaces + tc tbf (needs root)"),
    bracket: str = typer.Option("raw", help="codecs also sent at 0.5x and 2x their closed-form break-even rate"),
    redis_url: str = typer.Option(None, help="Redis to use (default: a private redis-server for the run)"),
    disk_dir: Path = typer.Option(None, help="folder for the disk store (default: a temporary one)"),
    pipeline_json: Path = typer.Option(DEFAULT_PIPELINE, help="a `bench pipeline` JSON to re-cost across the link"),
    threads: int = typer.Option(None, help="torch intra-op threads"),
    json_path: Path = typer.Option(None, "--json", help="write the result here"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
) -> None:
    """Relay overhead per store x codec x size vs the prefill it saves; break-even bandwidth over emulated links."""
    from kvrelay.bench.transfer import bench_transfer, load_pipeline
    from kvrelay.cli.common import load_for_cli

    lm = load_for_cli(model, threads, engine)
    res = bench_transfer(lm, [int(x) for x in _split(context_tokens)], stores=_split(stores), codec_names=_split(codecs),
                         repeats=repeats, redis_url=redis_url, disk_dir=disk_dir,
                         rates_mbit=[float(x) for x in _split(rates)], link=link, bracket_codecs=_split(bracket),
                         pipeline=load_pipeline(pipeline_json), progress=lambda s: console.print(s, style="dim"))
    res["command"] = " ".join(["kvrelay", *(shlex.quote(a) for a in sys.argv[1:])])
    print_result(res)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=2) + "\n")
        console.print(f"wrote {json_path}")


if __name__ == "__main__":  # pragma: no cover
    app()
