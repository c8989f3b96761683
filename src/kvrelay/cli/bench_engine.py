"""``kvrelay bench engine`` (mounted under ``bench`` by the root CLI): kvrelay's engine modes next to llama.cpp."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="kvrelay's engine modes next to llama.cpp.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)
PEERS = ("llama.cpp", "none")


@app.callback()
def _group() -> None:
    """Keep ``engine`` a named sub-command even while it is the only one."""


def _codec_parse(name: str):
    from kvrelay.kv.codecs import parse

    return parse(name)


def _load_modes(model: str, modes: list[str], threads: int | None) -> dict:
    from kvrelay.cli.common import load_for_cli

    return {m: load_for_cli(model, threads, engine=m) for m in modes}


def _gguf_for(model: str, gguf: Path | None) -> Path:
    from kvrelay.models.zoo import ZOO, assemble

    if gguf is not None:
        return gguf
    if model not in ZOO:
        raise typer.BadParameter(f"--gguf is needed for a model outside the zoo ({model!r})")
    return assemble(model)  # the verified GGUF the zoo converted kvrelay's weights from


def print_report(res: dict) -> None:
    from kvrelay.bench.engine_report import mode_label

    load = res["load_average"]
    t = Table(title=f"bench engine — {res['model']}, {res['context_tokens']} context tokens, {res['threads']} "
                    f"threads (medians of {res['repeats']}; machine: {res['machine']['mem_gbs']:.1f} GB/s, "
                    f"{res['machine']['gemm_gflops']:.0f} GFLOP/s fp32 GEMM; {load['status'].upper()}: "
                    f"1-min load up to {load['max']:.1f}, quiet <= {load['limit']:g})")
    for col in ("engine", "mode", "prefill tok/s", "of GEMM peak", "decode tok/s", "of bandwidth limit",
                "text TTFT s", "relay TTFT s", "relay MB", "relay = text"):
        t.add_column(col, justify="left" if col in ("engine", "mode") else "right")
    for r in res["rows"]:
        t.add_row(r["engine"], mode_label(r), f"{r['prefill_tokens_per_s']:.0f}", f"{r['prefill_fraction_of_limit']:.2f}",
                  f"{r['decode_tokens_per_s']:.2f}", f"{r['decode_fraction_of_limit']:.2f}",
                  f"{r['text_ttft_s']:.2f}", f"{r['relay_ttft_s']:.3f}", f"{r['relay_bytes'] / 1e6:.1f}",
                  "yes" if r["relay_identical"] else "no")
    console.print(t)
    if res["pipeline"]:
        p = Table(title=f"{res['pipeline_workload']}: 5 agents, {res['pipeline_tokens']} tokens each, end to end")
        for col in ("engine", "mode", "hand-off", "total s", "each run s"):
            p.add_column(col, justify="left" if col in ("engine", "mode", "hand-off") else "right")
        for r in res["pipeline"]:
            p.add_row(r["engine"], r["mode"], r["handoff"], f"{r['total_s']:.1f}",
                      " ".join(f"{x:.1f}" for x in r["total_s_each"]))
        console.print(p)
    if res["targets"]:
        g = Table(title="targets (kvrelay's default mode, auto, when measured; else its fastest-decoding mode)")
        for col in ("target", "value", "goal", "met", "measured"):
            g.add_column(col, justify="right" if col in ("value", "goal") else "left")
        for x in res["targets"]:
            g.add_row(x["target"], f"{x['value']:.2f}", f"{x['goal']:g}", "yes" if x["met"] else "[red]no[/red]",
                      x["detail"])
        console.print(g)


@app.command("engine")
def engine_cmd(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name (its GGUF is what llama.cpp reads)"),
    context_tokens: int = typer.Option(2048, min=16, help="tokens of prose the sender reads"),
    engines: str = typer.Option("fp32,int8,int4", help="comma-separated kvrelay engine modes to measure "
                                "(fp32 | fp32p | fp16w | bf16 | fp16 | int8 | int4 | bf16+DECODE | auto)"),
    peer: str = typer.Option("llama.cpp", help=f"the peer engine: {' | '.join(PEERS)} (llama.cpp: `make peers`)"),
    gguf: Path | None = typer.Option(None, help="the GGUF for the peer (default: the zoo model's verified GGUF)"),
    vllm: bool = typer.Option(False, "--vllm/--no-vllm", help="also vLLM's CPU build in bf16 with prefix caching "
                              "on the model's folder, same token ids (`make peers-vllm`); no pipeline"),
    repeats: int = typer.Option(3, min=1, help="interleaved repeats; medians are reported"),
    new_tokens: int = typer.Option(64, min=2, help="tokens the receiver writes after the relay (decode rate)"),
    pipeline_tokens: int = typer.Option(64, min=1, help="tokens each pipeline agent writes"),
    pipeline: bool = typer.Option(True, "--pipeline/--no-pipeline", help="also run the 5-agent pipeline"),
    pipeline_engines: str | None = typer.Option(None, help="kvrelay modes that run the pipeline "
                                                "(comma-separated; default: every mode of --engines)"),
    codec: str = typer.Option("fp16", help="kvrelay's payload codec on the wire (llama.cpp's state keeps f16 K/V)"),
    threads: int | None = typer.Option(None, help="threads for both engines (default: one per core)"),
    allow_load: bool = typer.Option(False, "--allow-load", help="keep figures from a busy machine (1-minute load "
                                    "above the threads + 0.5), labelled loaded in the table and JSON; "
                                    "without it such a run stops with an error"),
    json_path: Path | None = typer.Option(None, "--json", help="write the result as JSON"),
):
    """Prefill, decode, relay TTFT, relayed bytes and a 5-agent pipeline: kvrelay next to llama.cpp, same GGUF,
    threads and text, with the machine's bandwidth and GEMM limits measured in the same run."""
    from kvrelay.bench.engine import bench_engine
    from kvrelay.bench.engine_report import report
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import command_line, note, write_json

    v.choice(peer, "--peer", PEERS)
    modes = list(v.names(engines, "--engines", v.ENGINES, "fp32,int8,int4"))
    if len(set(modes)) != len(modes):
        raise v.InvalidInput(f"--engines {engines!r} names a mode twice", "distinct mode names")
    pipe_modes = list(v.names(pipeline_engines, "--pipeline-engines", v.ENGINES, "fp32,int8")) \
        if pipeline_engines else None
    v.parsed_names(codec, "--codec", _codec_parse, "one codec name (docs/codecs.md)")
    if gguf is not None:
        v.existing_file(gguf, "--gguf", "a .gguf file")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.model(model)
    vllm_peer = None
    if vllm:
        from kvrelay.bench.peer_servers import model_folder, vllm_available

        folder = model_folder(model)
        if vllm_available() is not None:
            raise v.InvalidInput("--vllm: vLLM's CPU build is not installed",
                                 "its environment (`make peers-vllm`, or $KVRELAY_VLLM_PYTHON)")
        if folder is None:
            raise v.InvalidInput(f"--vllm: {model} has no model folder",
                                 f"a zoo model pulled with `kvrelay models pull {model}`")
        vllm_peer = (folder, model)
    threads = threads or os.cpu_count() or 1
    lms = _load_modes(model, modes, threads)
    gguf_path = _gguf_for(model, gguf) if peer == "llama.cpp" else None
    raw = bench_engine(lms, context_tokens=context_tokens, repeats=repeats, new_tokens=new_tokens,
                       pipeline_tokens=pipeline_tokens, codec=codec, peer_gguf=gguf_path, pipeline=pipeline,
                       pipeline_modes=pipe_modes, progress=note, allow_load=allow_load, vllm=vllm_peer)
    import torch

    from kvrelay.models.engine_auto import cpu_flags, cpu_model

    res = report(raw, model=model, command=command_line(),
                 extra={"cpu": cpu_model(), "cpu_flags": list(cpu_flags()), "cpus": os.cpu_count(),
                        "platform": platform.platform(), "torch": torch.__version__})
    print_report(res)
    write_json(json_path, res, console=console)
