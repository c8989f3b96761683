"""``kvrelay calibrate``: this machine's cost profile for one model (``bench.calibrate``), saved for reuse.

    kvrelay calibrate --model qwen2.5-coder-0.5b --context-tokens 512,2048 --json out/calibrate.json
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, command_line, load_for_cli, note, write_json

app = typer.Typer(pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)
CALIBRATE_RESERVE = 96  # the receiver's question around the context


def _mbps(x) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.1f}")


def print_result(res: dict) -> None:
    p = res["profile"]
    console.print(f"cost profile — {p['model']} (engine {p['engine']}, {p['threads']} threads, load "
                  f"{res['load_average_before'][0]:.1f} -> {res['load_average_after'][0]:.1f})")
    t = Table(title="rates")
    for c in ("what", "value"):
        t.add_column(c)
    t.add_row("prefill", f"{p['prefill_fixed_s'] * 1e3:.1f} ms + {p['prefill_s_per_token'] * 1e3:.3f} ms/token")
    t.add_row("decode", f"{p['decode_s_per_token'] * 1e3:.1f} ms/token")
    t.add_row("cache (fp32)", f"{p['raw_bytes_per_token'] / 1e3:.1f} kB/token; text {p['text_bytes_per_token']:.2f} B/token")
    for c in p["codecs"]:
        t.add_row(f"codec {c['name']}", f"ratio {c['ratio']:.2f}; encode {c['encode_s_per_byte'] * 1e9:.3f} ns/B, "
                  f"decode {c['decode_s_per_byte'] * 1e9:.3f} ns/B (per fp32 byte)")
    for s in p["stores"]:
        t.add_row(f"store {s['name']}", f"put {s['put_s_per_byte'] * 1e9:.3f} ns/B, get {s['get_s_per_byte'] * 1e9:.3f} ns/B")
    if p["link"]:
        t.add_row("link", f"{p['link']['mbps']:g} Mbit/s, {p['link']['latency_s'] * 1e3:g} ms")
    console.print(t)
    bt = Table(title="break-even bandwidth (Mbit/s): below it text is faster")
    cols = ["codec", "ctx", "profile"] + (["transfer measured", "closed form", "profile/measured"]
                                          if "agreement" in res else [])
    for c in cols:
        bt.add_column(c, justify="right")
    if "agreement" in res:
        for a in res["agreement"]:
            meas = _mbps(a["transfer_measured_mbps"]) if a["transfer_measured_mbps"] else a["transfer_measured_bound"]
            ratio = f"{a['profile_over_measured']:.2f}" if a["profile_over_measured"] else "-"
            bt.add_row(a["codec"], str(a["context_tokens"]), _mbps(a["profile_mbps"]), meas,
                       _mbps(a["transfer_closed_form_mbps"]), ratio)
    else:
        for b in res["break_even"]:
            bt.add_row(b["codec"], str(b["context_tokens"]), _mbps(b["mbps"]))
    console.print(bt)
    console.print(res["link_note"])


@app.command("calibrate")
def calibrate_cmd(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: str = typer.Option("512,2048", help="comma-separated context sizes the rates are fitted on"),
    codecs: str = typer.Option("raw,fp16,int8,int4", help="comma-separated codec names (docs/codecs.md)"),
    stores: str = typer.Option("memory,disk", help="comma-separated: memory, disk, redis"),
    repeats: int = typer.Option(3, help="interleaved repeats; medians are used"),
    link_mbps: float = typer.Option(None, help="the link between sender and receiver, Mbit/s (saved in the profile)"),
    link_latency_ms: float = typer.Option(0.0, help="its one-way latency in ms"),
    compare: bool = typer.Option(True, help="also measure the break-even over emulated links in the same run "
                                 "(needs root and iproute2; skipped and said so otherwise)"),
    rates: str = typer.Option("10,30,100,1000", help="emulated link rates in Mbit/s for --compare"),
    redis_url: str = typer.Option(None, help="Redis for the redis store (default: a private redis-server)"),
    profile: Path = typer.Option(None, help="where to save the profile (default: $KVRELAY_HOME/profiles/"
                                 "MODEL__ENGINE.json, which decide and bench policy reuse)"),
    threads: int = typer.Option(None, help="torch intra-op threads"),
    json_path: Path = typer.Option(None, "--json", help="write the result here"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
) -> None:
    """Measure prefill/decode per token, codec and store costs per byte; save the cost profile; break-even per codec."""
    from kvrelay.bench.transfer import STORES
    from kvrelay.kv.codecs import available_codecs, parse
    from kvrelay.policy.cost import Link

    sizes = v.int_list(context_tokens, "--context-tokens", minimum=16)
    codec_names = v.parsed_names(codecs, "--codecs", parse, "codec names such as raw,fp16,int8,int4 "
                                 f"({', '.join(available_codecs())})", known=("raw", "fp16", "bf16", "int8", "int4"))
    if "raw" not in codec_names:
        raise v.InvalidInput(f"--codecs {codecs!r} has no raw", "raw among the codecs (the lossless reference)")
    store_names = v.names(stores, "--stores", STORES, "memory,disk")
    v.positive(repeats, "--repeats")
    link = None
    if link_mbps is not None:
        if not link_mbps > 0 or link_latency_ms < 0:
            raise v.InvalidInput(f"--link-mbps {link_mbps} / --link-latency-ms {link_latency_ms}",
                                 "a bandwidth > 0 and a latency >= 0")
        link = Link(link_mbps, link_latency_ms / 1e3)
    rate_list = v.float_list(rates, "--rates", example="10,100,1000")
    v.writable_path(profile, "--profile")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.engine(engine)
    ref = v.model(model)
    for n in sizes:
        v.fits(ref, n, "--context-tokens", reserve=CALIBRATE_RESERVE)

    from kvrelay.bench.calibrate import calibrate, profile_path
    from kvrelay.policy.cost import CostProfile

    lm = load_for_cli(model, threads, engine)
    res = calibrate(lm, sizes, codec_names=list(codec_names), stores=list(store_names), repeats=repeats, link=link,
                    compare=compare, rates_mbit=rate_list, redis_url=redis_url, progress=note)
    res["command"] = command_line()
    saved = CostProfile.from_dict(res["profile"]).save(profile or profile_path(model, lm.engine))
    res["profile_path"] = str(saved)
    print_result(res)
    console.print(f"profile saved: {saved}")
    write_json(json_path, res, console=console)
