"""The ``kvrelay`` command: one Typer app over the library (JSON fields: docs/json.md).

Every command that measures prints a table for people and, with ``--json PATH``, writes the
machine-readable result whose field names are a contract.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP

app = typer.Typer(help="Relay KV caches between LLM agents, audit when it pays, decide per request.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Measurements: relay, pipeline, transfer, engine, policy.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()


def _mount(parent: typer.Typer, module: str, name: str | None, help_text: str = "") -> None:
    """Mount the Typer app that lives beside its concept (models/, workflows/, ...).

    With a ``name`` it becomes a command group; without, its commands join ``parent`` directly.
    """
    sub = importlib.import_module(module).app
    if name:
        parent.add_typer(sub, name=name, help=help_text)
    else:
        parent.registered_commands.extend(sub.registered_commands)


def write_json(path: Path | None, obj: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    console.print(f"wrote {path}")


def _read_context(context: str) -> str:
    p = Path(context)
    return p.read_text(encoding="utf-8") if p.is_file() else context


@app.command()
def relay(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context: str = typer.Option(..., help="a file to read, or the context text itself"),
    question: str = typer.Option(..., help="what the receiver is asked about the context"),
    layout: str = typer.Option("continue", help="continue: receiver follows the relayed tokens; "
                               "replace: receiver keeps its own prefix, payload is RoPE-shifted behind it"),
    role: str = typer.Option("", help="receiver role prompt (used as its prefix in the replace layout)"),
    max_new_tokens: int = typer.Option(48, min=1),
    json_path: Path | None = typer.Option(None, "--json", help="write the result as JSON"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
):
    """One sender -> receiver relay: the receiver answers from the relayed cache and from the text; both shown."""
    from kvrelay.agents.agent import Agent
    from kvrelay.cli.common import load_for_cli

    lm = load_for_cli(model, None, engine)
    sender = Agent(lm, "sender", role="You are a careful reader. Read the document.")
    receiver = Agent(lm, "receiver", role=role, max_new_tokens=max_new_tokens)
    payload = sender.read(_read_context(context))
    text = receiver.respond(question, payload.token_ids, layout=layout)  # re-encode the same tokens
    kv = receiver.respond(question, payload, layout=layout)
    result = {"model": model, "engine": lm.engine, "layout": layout, "kv_answer": kv.text, "text_answer": text.text,
              "identical": kv.token_ids == text.token_ids, "kv_ttft_s": kv.ttft_s, "text_ttft_s": text.ttft_s,
              "context_tokens": payload.num_tokens, "payload_bytes": payload.nbytes,
              "ttft_speedup": text.ttft_s / kv.ttft_s}
    t = Table(title=f"relay on {model} ({layout}, {payload.num_tokens} context tokens)")
    for c in ("channel", "TTFT s", "answer"):
        t.add_column(c)
    t.add_row("text (re-encode)", f"{text.ttft_s:.3f}", text.text)
    t.add_row("kv (relayed cache)", f"{kv.ttft_s:.3f}", kv.text)
    console.print(t)
    console.print(f"identical answers: {result['identical']}   TTFT speedup: {result['ttft_speedup']:.1f}x   "
                  f"payload: {payload.nbytes / 1e6:.1f} MB")
    write_json(json_path, result)


@bench_app.command("relay")
def bench_relay_cmd(
    model: str = typer.Option("qwen2.5-coder-0.5b"),
    context_tokens: str = typer.Option("512,2048", help="comma-separated context sizes"),
    repeats: int = typer.Option(3, min=1, help="interleaved repeats per size; medians are reported"),
    max_new_tokens: int = typer.Option(16, min=1),
    threads: int | None = typer.Option(None, help="torch intra-op threads (default: torch's, one per core)"),
    json_path: Path | None = typer.Option(None, "--json"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
):
    """Receiver TTFT with a relayed cache vs re-encoding the same context, side by side."""
    from kvrelay.bench.relay import bench_relay
    from kvrelay.cli.common import load_for_cli

    sizes = [int(x) for x in context_tokens.split(",") if x.strip()]
    lm = load_for_cli(model, threads, engine)
    res = bench_relay(lm, sizes, repeats, max_new_tokens)
    res["engine"] = lm.engine
    t = Table(title=f"bench relay — {model}, engine {lm.engine} (medians of {repeats})")
    for c in ("context", "text TTFT s", "kv TTFT s", "speedup", "ideal", "payload MB", "encode s", "decode s",
              "identical"):
        t.add_column(c, justify="right")
    for r in res["rows"]:
        t.add_row(str(r["context_tokens"]), f"{r['text_ttft_s']:.3f}", f"{r['kv_ttft_s']:.3f}",
                  f"{r['ttft_speedup']:.1f}x", f"{r['ideal_ttft_speedup']:.1f}x", f"{r['payload_bytes'] / 1e6:.1f}",
                  f"{r['encode_s']:.3f}", f"{r['decode_s']:.3f}", str(r["outputs_identical"]))
    console.print(t)
    write_json(json_path, res)


_mount(app, "kvrelay.cli.models", "models", "The model zoo: list, pull, info.")
_mount(app, "kvrelay.cli.audit", "audit", "Causal audit of relayed caches: effects with CIs, report.")
_mount(bench_app, "kvrelay.cli.pipeline", None)
_mount(bench_app, "kvrelay.cli.transfer", None)
_mount(app, "kvrelay.cli.fuse", "fuse", "Cross-model cache relay: fit adapters, evaluate translate / fuse.")
_mount(bench_app, "kvrelay.cli.repair", None)
_mount(bench_app, "kvrelay.cli.bench_engine", None)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
