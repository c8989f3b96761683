"""``kvrelay bench transfer`` (mounted under ``bench`` by the root CLI); also
``python -m kvrelay.cli.transfer transfer ...``."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, command_line, load_for_cli, note, write_json

app = typer.Typer(help="Payload transfer: stores x codecs x sizes, constrained links, break-even bandwidth.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)
DEFAULT_PIPELINE = Path("docs/bench/pipeline_doc5_512.json")


@app.callback()
def _group() -> None:
    """Keep ``transfer`` a named sub-command even while it is the only one."""


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
    c = res["checks"]
    ct = Table(title=f"checks at {c['context_tokens']} context tokens")
    for col in ("check", "value", "passes"):
        ct.add_column(col)
    for store, frac in c["raw_overhead_fraction_by_store"].items():
        ct.add_row(f"raw relay overhead, {store} (share of the prefill saved)", f"{100 * frac:.2f}%",
                   _yes(c["raw_overhead_within_target"]))
    if c["int8_bytes_fraction_of_fp32"] is not None:
        ct.add_row("int8 payload bytes, share of fp32", f"{100 * c['int8_bytes_fraction_of_fp32']:.1f}%",
                   _yes(c["int8_within_30pct"]))
    console.print(ct)


def _yes(x: bool | None) -> str:
    return "—" if x is None else ("yes" if x else "no")


TRANSFER_RESERVE = 96  # the receiver's question around the context


@app.command("transfer")
def transfer(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: str = typer.Option("512,2048", help="comma-separated context sizes"),
    stores: str = typer.Option("memory,disk,redis", help="comma-separated: memory, disk, redis"),
    codecs: str = typer.Option("raw,fp16,int8,int4,evict:0.2", help="comma-separated codec names (docs/codecs.md)"),
    repeats: int = typer.Option(3, help="interleaved repeats; medians are reported"),
    rates: str = typer.Option("10,30,100,1000", help="link rates in Mbit/s for the emulated link"),
    link: bool = typer.Option(True, help="emulate links with network namespaces + tc tbf (needs root)"),
    bracket: str = typer.Option("raw", help="codecs also sent at 0.5x and 2x their closed-form break-even rate "
                                "(a subset of --codecs)"),
    redis_url: str = typer.Option(None, help="Redis to use (default: a private redis-server for the run)"),
    disk_dir: Path = typer.Option(None, help="folder for the disk store (default: a temporary one)"),
    pipeline_json: Path = typer.Option(None, help=f"a `bench pipeline` JSON to re-cost across the link (default: "
                                       f"{DEFAULT_PIPELINE} when it exists, i.e. run from the repository)"),
    threads: int = typer.Option(None, help="torch intra-op threads"),
    json_path: Path = typer.Option(None, "--json", help="write the result here"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
) -> None:
    """Relay overhead per store x codec x size vs the prefill it saves; break-even bandwidth over emulated links."""
    from kvrelay.bench.transfer import STORES
    from kvrelay.kv.codecs import available_codecs, parse

    sizes = v.int_list(context_tokens, "--context-tokens", minimum=16)
    store_names = v.names(stores, "--stores", STORES, "memory,disk")
    codec_names = v.parsed_names(codecs, "--codecs", parse, "codec names such as raw,fp16,int8,int4,evict:0.2 "
                                 f"({', '.join(available_codecs())})", known=("raw", "fp16", "bf16", "int8", "int4"))
    v.positive(repeats, "--repeats")
    rate_list = v.float_list(rates, "--rates", example="10,100,1000")
    bracket_names = v.names(bracket, "--bracket", codec_names, "raw") if bracket.strip() else ()
    if pipeline_json is not None:
        v.existing_file(pipeline_json, "--pipeline-json", "a JSON file written by `kvrelay bench pipeline --json`")
    elif DEFAULT_PIPELINE.is_file():
        pipeline_json = DEFAULT_PIPELINE
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.engine(engine)
    ref = v.model(model)
    for n in sizes:
        v.fits(ref, n, "--context-tokens", reserve=TRANSFER_RESERVE)

    from kvrelay.bench.transfer import bench_transfer, load_pipeline

    lm = load_for_cli(model, threads, engine)
    res = bench_transfer(lm, sizes, stores=list(store_names), codec_names=list(codec_names), repeats=repeats,
                         redis_url=redis_url, disk_dir=disk_dir, rates_mbit=rate_list, link=link,
                         bracket_codecs=list(bracket_names), pipeline=load_pipeline(pipeline_json), progress=note)
    res["engine"] = lm.engine
    res["command"] = command_line()
    print_result(res)
    write_json(json_path, res, console=console)


if __name__ == "__main__":  # pragma: no cover
    app()
