"""The ``kvrelay`` command: one Typer app over the library.

Every command checks its arguments first (``kvrelay.cli.validate``: before any model loads or any
folder is created), prints a table for people and, with ``--json PATH``, writes the
machine-readable result (fields in ``docs/json.md``) through ``kvrelay.cli.common.write_json``.

Errors are turned into one line in ONE place, ``KVRelayGroup.main`` below: a user error (a typed
``KVRelayError`` from the library or the checks, or a command-line usage error) prints
``error: <what was wrong>; expected <...>[; did you mean ...?]`` on stderr and exits 2; anything
else is a bug and prints one line too (exit 1). ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from typer import exceptions as typer_exits
from typer._click import exceptions as click  # typer 0.29 raises its own copy of click's errors
from typer.core import TyperGroup

from kvrelay.cli import common
from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, write_json  # noqa: F401 (write_json: one for all)
from kvrelay.core.errors import KVRelayError

USAGE_EXIT = 2  # a user error: fix the command and run it again
BUG_EXIT = 1  # anything else


def _usage_message(err: click.ClickException) -> str:
    """Click's own usage errors, reworded into the ``what; expected ...`` shape."""
    ctx = getattr(err, "ctx", None)
    where = f"`{ctx.command_path} --help`" if ctx is not None else "`kvrelay --help`"
    if isinstance(err, click.NoSuchOption):
        hint = f"; did you mean {err.possibilities[0]}?" if err.possibilities else ""
        return f"no such option {err.option_name}; expected one of the options in {where}{hint}"
    if isinstance(err, click.MissingParameter):
        name = err.param.opts[0] if err.param is not None and err.param.opts else (err.param_hint or "argument")
        return f"missing {err.param_type or 'option'} {name}; expected it (see {where})"
    if isinstance(err, click.BadParameter):
        kind = getattr(getattr(err.param, "type", None), "name", "") or "valid value"
        kind = {"integer": "an integer", "float": "a number", "boolean": "true or false"}.get(kind, f"a {kind}")
        return f"{v.one_line(err.format_message()).rstrip('.')}; expected {kind} (see {where})"
    msg = v.one_line(err.format_message()).rstrip(".")
    if msg.lower().startswith("no such command"):
        return f"{msg}; expected one of the commands in {where}"
    return f"{msg}; see {where}"


def report_error(err: BaseException) -> int:
    """Print ``err`` as one ``error:`` line on stderr; return the exit status."""
    if isinstance(err, click.ClickException):
        msg, code = _usage_message(err), USAGE_EXIT
    elif isinstance(err, KVRelayError):
        msg, code = v.one_line(str(err)), USAGE_EXIT
    else:
        msg = (f"internal error: {type(err).__name__}: {v.one_line(str(err))}; expected this command to work — "
               "rerun with --debug for the traceback and report it")
        code = BUG_EXIT
    print(f"error: {msg}", file=sys.stderr)
    return code


class KVRelayGroup(TyperGroup):
    """The root group: strips the global flags, then maps every failure to one line and an exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        rest = common.begin(list(sys.argv[1:] if args is None else args))
        try:
            rv = super().main(args=rest, prog_name=prog_name or "kvrelay", complete_var=complete_var,
                              standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.NoArgsIsHelpError as err:  # a bare group: its help is the answer
            print(err.format_message())
            code = 0
        except typer_exits.Abort:
            print("error: aborted", file=sys.stderr)
            code = 130
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            code = 130
        except Exception as err:
            if common.state.debug:
                raise
            code = report_error(err)
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(cls=KVRelayGroup, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Relay KV caches between LLM agents and audit when that pays.")
bench_app = typer.Typer(no_args_is_help=True)  # its help lists its commands: set after they are mounted
app.add_typer(bench_app, name="bench")
console = Console()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="show the traceback of an error instead of one line "
                               "(also KVRELAY_DEBUG=1); accepted anywhere on the line"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bars, weight-loading messages or progress "
                               "notes, only results; accepted anywhere on the line"),
) -> None:
    """Relay KV caches between LLM agents and audit when that pays."""


def _mount(parent: typer.Typer, module: str, name: str | None, help_text: str = "") -> None:
    """Mount the Typer app that lives beside its concept (models/, workflows/, ...).

    With a ``name`` it becomes a command group; without, its commands join ``parent`` directly.
    """
    sub = importlib.import_module(module).app
    if name:
        parent.add_typer(sub, name=name, help=help_text)
    else:
        parent.registered_commands.extend(sub.registered_commands)


def context_input(context: Path | None, context_text: str | None) -> str:
    """Exactly one of ``--context FILE`` (an existing, non-empty file) and ``--context-text TEXT``."""
    if (context is None) == (context_text is None):
        raise v.InvalidInput("give the context once" if context is not None else "no context given",
                             "either --context FILE or --context-text TEXT")
    if context is not None:
        return v.text_file(context, "--context")
    return v.nonempty_text(context_text, "--context-text")


PARTIAL_ENCODINGS = ("raw", "fp16", "bf16", "int8", "int4")
RELAY_RESERVE = 128  # tokens kept for the receiver's role and question around the relayed context


@app.command()
def relay(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context: Path = typer.Option(None, help="a text file the sender reads (must exist and not be empty)"),
    context_text: str = typer.Option(None, help="the context as literal text, instead of --context FILE"),
    question: str = typer.Option(..., help="what the receiver is asked about the context"),
    layout: str = typer.Option("continue", help="continue: receiver follows the relayed tokens; "
                               "replace: receiver keeps its own prefix, payload is RoPE-shifted behind it"),
    role: str = typer.Option("", help="receiver role prompt (used as its prefix in the replace layout)"),
    max_new_tokens: int = typer.Option(48, help="tokens the receiver may write (it stops earlier at its end token)"),
    partial: float = typer.Option(None, help="also relay only this fraction of the positions, chosen by the "
                                  "receiver's question (receiver-driven partial relay, docs/layouts.md); the "
                                  "request hop is measured and counted in its TTFT"),
    partial_encoding: str = typer.Option("raw", help="the partial payload's representation: raw, fp16, int8, int4"),
    json_path: Path = typer.Option(None, "--json", help="write the result as JSON"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
):
    """One sender -> receiver relay: the receiver answers from the relayed cache and from the text; both shown."""
    from kvrelay.workflows.spec import LAYOUTS

    text_in = context_input(context, context_text)
    v.nonempty_text(question, "--question")
    v.choice(layout, "--layout", LAYOUTS)
    v.fraction(partial, "--partial")
    v.choice(partial_encoding, "--partial-encoding", PARTIAL_ENCODINGS)
    if partial is not None and layout != "continue":
        raise v.InvalidInput("--partial with --layout replace", "--layout continue (a partial payload is read "
                             "at its original positions)")
    v.positive(max_new_tokens, "--max-new-tokens")
    v.writable_path(json_path, "--json")
    v.engine(engine)
    ref = v.model(model)

    from kvrelay.agents.agent import READER_ROLE, Agent

    lm = common.load_for_cli(model, None, engine)
    sender = Agent(lm, "sender", role=READER_ROLE)
    receiver = Agent(lm, "receiver", role=role, max_new_tokens=max_new_tokens)
    n_ids = len(sender.reading_ids(text_in))
    v.fits(ref, n_ids, "the context's token count", reserve=RELAY_RESERVE + max_new_tokens)
    payload = sender.read(text_in)
    text = receiver.respond(question, payload.token_ids, layout=layout)  # re-encode the same tokens
    kv = receiver.respond(question, payload, layout=layout)
    result = {"model": model, "engine": lm.engine, "layout": layout, "kv_answer": kv.text, "text_answer": text.text,
              "identical": kv.token_ids == text.token_ids, "kv_ttft_s": kv.ttft_s, "text_ttft_s": text.ttft_s,
              "context_tokens": payload.num_tokens, "payload_bytes": payload.nbytes,
              "ttft_speedup": text.ttft_s / kv.ttft_s}
    if partial is not None:
        from kvrelay.agents.partial import partial_relay
        from kvrelay.kv.partial import Budget

        part = partial_relay(sender, payload, receiver, question, Budget(fraction=partial), encoding=partial_encoding)
        result["partial"] = {"fraction": partial, "encoding": partial_encoding, "answer": part.response.text,
                             "identical_to_kv": part.response.token_ids == kv.token_ids,
                             "positions_kept": part.selection.positions_kept,
                             "positions_total": part.selection.positions_total,
                             "pool": part.selection.pool, "mode": part.selection.mode,
                             "candidates_checked": part.selection.checked,
                             "bytes": part.hop.reply_bytes, "ttft_s": part.ttft_s,
                             "receiver_ttft_s": part.response.ttft_s, **part.hop.to_json()}
    t = Table(title=f"relay on {model} ({layout}, {payload.num_tokens} context tokens)")
    for c in ("channel", "TTFT s", "answer"):
        t.add_column(c)
    t.add_row("text (re-encode)", f"{text.ttft_s:.3f}", text.text)
    t.add_row("kv (relayed cache)", f"{kv.ttft_s:.3f}", kv.text)
    if partial is not None:
        pr = result["partial"]
        t.add_row(f"kv partial {partial:g} ({pr['positions_kept']}/{pr['positions_total']} positions)",
                  f"{pr['ttft_s']:.3f}", pr["answer"])
    console.print(t)
    console.print(f"identical answers: {result['identical']}   TTFT speedup: {result['ttft_speedup']:.1f}x   "
                  f"payload: {payload.nbytes / 1e6:.1f} MB")
    common.write_json(json_path, result)


BENCH_RELAY_RESERVE = 96  # the receiver's question around the context


@bench_app.command("relay")
def bench_relay_cmd(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: str = typer.Option("512,2048", help="comma-separated context sizes in tokens"),
    repeats: int = typer.Option(3, help="interleaved repeats per size; medians are reported"),
    max_new_tokens: int = typer.Option(16, help="tokens the receiver writes per answer"),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's, one per core)"),
    json_path: Path = typer.Option(None, "--json", help="write the result as JSON"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
):
    """Receiver TTFT with a relayed cache vs re-encoding the same context, side by side."""
    sizes = v.int_list(context_tokens, "--context-tokens", minimum=16)
    v.positive(repeats, "--repeats")
    v.positive(max_new_tokens, "--max-new-tokens")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.engine(engine)
    ref = v.model(model)
    for n in sizes:
        v.fits(ref, n, "--context-tokens", reserve=BENCH_RELAY_RESERVE + max_new_tokens)

    from kvrelay.bench.relay import bench_relay

    lm = common.load_for_cli(model, threads, engine)
    res = bench_relay(lm, sizes, repeats, max_new_tokens, show_progress=not common.state.quiet)
    res["engine"] = lm.engine
    res["command"] = common.command_line()
    load = res["load_average"]
    t = Table(title=f"bench relay — {model}, engine {lm.engine} (medians of {repeats}; {load['status'].upper()}: "
                    f"1-min load up to {load['max']:.1f}, quiet <= {load['limit']:g})")
    for c in ("context", "text TTFT s", "kv TTFT s", "speedup", "ideal", "payload MB", "encode s", "decode s",
              "identical"):
        t.add_column(c, justify="right")
    for r in res["rows"]:
        t.add_row(str(r["context_tokens"]), f"{r['text_ttft_s']:.3f}", f"{r['kv_ttft_s']:.3f}",
                  f"{r['ttft_speedup']:.1f}x", f"{r['ideal_ttft_speedup']:.1f}x", f"{r['payload_bytes'] / 1e6:.1f}",
                  f"{r['encode_s']:.3f}", f"{r['decode_s']:.3f}", str(r["outputs_identical"]))
    console.print(t)
    for r in res["rows"]:
        if r["noise"]:
            console.print(f"[yellow]note:[/yellow] {r['context_tokens']} tokens: {r['noise']}")
    common.write_json(json_path, res)


_mount(app, "kvrelay.cli.models", "models", "The model zoo: list, pull, info.")
_mount(app, "kvrelay.cli.audit", "audit", "Causal audit of relayed caches: effects with CIs, report.")
_mount(app, "kvrelay.cli.payload", None)
_mount(app, "kvrelay.cli.verify", None)
_mount(app, "kvrelay.cli.serve", None)
_mount(app, "kvrelay.cli.doctor", "doctor", "Diagnose a link: two models' configs, a payload, a live link's checks.")
_mount(bench_app, "kvrelay.cli.pipeline", None)
_mount(bench_app, "kvrelay.cli.transfer", None)
_mount(bench_app, "kvrelay.cli.soak", None)
_mount(app, "kvrelay.cli.fuse", "fuse", "Cross-model cache relay: fit adapters, evaluate translate / fuse.")
_mount(bench_app, "kvrelay.cli.repair", None)
_mount(bench_app, "kvrelay.cli.bench_engine", None)
_mount(bench_app, "kvrelay.cli.bench_serve", None)
_mount(bench_app, "kvrelay.cli.bench_partial", None)
_mount(bench_app, "kvrelay.cli.bench_connector", None)
_mount(app, "kvrelay.cli.calibrate", None)
_mount(bench_app, "kvrelay.cli.bench_speculative", None)
_mount(bench_app, "kvrelay.cli.bench_policy", None)
bench_app.info.help = "Measurements: " + ", ".join(c.name for c in bench_app.registered_commands) + "."


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
