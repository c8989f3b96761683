"""``kvrelay doctor models | payload | link``: what a link needs and what is wrong with one (docs/doctor.md).

Each prints its checks as a table (passed / FAILED / skipped, the measured figure, the hint) and, with
``--json P``, writes ``{"kind", "passed", "cause", "checks": [{"name", "passed", "value", "hint"}], ...}``
(docs/json.md). The exit status is 1 when a check failed, so a script can stop on it.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, load_for_cli, note, use_threads, write_json

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
JSON_HELP = "write the checks as JSON (docs/json.md)"


def _status(passed: bool | None) -> str:
    return "[green]pass[/green]" if passed else "[dim]skipped[/dim]" if passed is None else "[red]FAILED[/red]"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def _finish(report, title: str, json_path: Path | None) -> None:
    t = Table(title=title)
    for c in ("check", "status", "value", "hint"):
        t.add_column(c, overflow="fold")
    for c in report.checks:
        t.add_row(c.name, _status(c.passed), _fmt(c.value), c.hint)
    console.print(t)
    console.print("all checks passed" if report.passed else f"[red]cause: {report.cause}[/red]")
    write_json(json_path, report.to_json())
    if not report.passed:
        raise typer.Exit(1)


@app.command("models")
def models_cmd(
    sender: str = typer.Argument(..., help="the sending model (zoo name, folder, transformers id or tiny:ARCH)"),
    receiver: str = typer.Argument(..., help="the receiving model"),
    engine: str = typer.Option(DEFAULT_ENGINE, help="the receiver's " + ENGINE_HELP),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's, one per core)"),
    json_path: Path = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Two configs side by side, and what relay from SENDER to RECEIVER needs (exact, head map, adapter, ...)."""
    v.model(sender, "SENDER")
    v.model(receiver, "RECEIVER")
    v.engine(engine)
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    from kvrelay.bench.doctor_models import diagnose_models

    a = load_for_cli(sender, threads)
    b = load_for_cli(receiver, threads, engine)
    report = diagnose_models(a, b)
    t = Table(title=f"{sender} -> {receiver}")
    for c in ("field", sender, receiver, ""):
        t.add_column(c, overflow="fold")
    for r in report.facts["rows"]:
        t.add_row(r["field"], _fmt(r["sender"]), _fmt(r["receiver"]), "" if r["same"] else "[yellow]differs[/yellow]")
    console.print(t)
    _finish(report, "what relay needs", json_path)


@app.command("payload")
def payload_cmd(
    target: str = typer.Argument(..., help="a kvrelay/1 file, or a key with --store"),
    model: str = typer.Option(..., help="the receiver's model the payload is checked against"),
    store: str = typer.Option(None, help="read TARGET as a key from this store (file:///DIR, DIR, redis://...)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    json_path: Path = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """A payload against a model: shapes, layer types, positions, dtype, codec and engine mode, each mismatch
    with its fix."""
    from kvrelay.cli.payload import _map, _store

    v.model(model)
    v.engine(engine)
    v.writable_path(json_path, "--json")
    st = _store(store)  # opened and checked before the model loads
    data = st.get_bytes(target) if st is not None else _map(Path(target), "TARGET")
    from kvrelay.bench.doctor_payload import diagnose_payload

    lm = load_for_cli(model, None, engine)
    _finish(diagnose_payload(data, lm), f"payload {target} on {model}", json_path)


@app.command("link")
def link_cmd(
    model: str = typer.Option(..., help="the receiver's model"),
    sender_model: str = typer.Option(None, help="the sender's model (default: the receiver's)"),
    adapter: str = typer.Option(None, help="adapter artefact between them: a folder under artefacts/fuse/ or a path"),
    engine: str = typer.Option(DEFAULT_ENGINE, help="both sides' " + ENGINE_HELP),
    sender_engine: str = typer.Option(None, help="the sender's engine mode, when it differs from --engine"),
    codec: str = typer.Option("raw", help="the codec the link applies on the wire (kv.codecs: raw, fp16, int8, ...)"),
    context: Path = typer.Option(None, help="a text file to use as the probe (default: a built-in sentence)"),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's, one per core)"),
    json_path: Path = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Check a live link: echo, position, mask, layer map, precision and engine-mode drift, each measured."""
    from kvrelay.cli.payload import _codec

    v.positive(threads, "--threads")
    v.model(model)
    if sender_model is not None:
        v.model(sender_model, "--sender-model")
    v.engine(engine)
    if sender_engine is not None:
        v.engine(sender_engine, "--sender-engine")
    v.writable_path(json_path, "--json")
    text = v.text_file(context, "--context") if context is not None else None
    c = _codec(codec).name
    if adapter is not None:
        from kvrelay.audit.channels import resolve

        try:
            resolve(adapter)
        except ValueError as err:
            raise v.InvalidInput(f"--adapter {adapter!r}", str(err)) from None
    from kvrelay.bench.doctor_link import PROBE, diagnose_link, open_link

    note(f"loading {model}" + (f" and {sender_model}" if sender_model else ""))
    use_threads(threads)
    link = open_link(model, sender_model, adapter, engine, c, sender_engine)
    report = diagnose_link(link, text or PROBE)
    _finish(report, f"link {link.sender.name} -> {link.receiver.name} (codec {c}, engine {engine})", json_path)
