"""``kvrelay read`` / ``respond`` / ``inspect``: a relay split across processes, through a file or a store.

    KEY=$(kvrelay read --model M --context doc.md --store redis://127.0.0.1:6379/0)   # prints the key
    kvrelay respond --model M --key "$KEY" --store redis://127.0.0.1:6379/0 --question "..."
    kvrelay read --model M --context doc.md --out doc.kv --codec int8                 # prints the path
    kvrelay respond --model M --payload doc.kv --question "..."
    kvrelay inspect doc.kv --json -

The sender and receiver are those of ``kvrelay relay`` (same roles, layout and token budget), so the
answer equals its ``kv_answer``. Only stdout's last line is the key, path or answer; progress goes to
stderr. Arguments are checked before any model loads (``cli.validate``); a payload the receiver
cannot prove compatible is refused like any typed error: one ``error:`` line, exit 2 (``cli.app``).
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import typer
from rich.console import Console

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, command_line, note, write_json

app = typer.Typer(pretty_exceptions_enable=False)
CODEC_FORMS = "a codec name: raw, fp16, bf16, int8, int4, int8-gG, evict:F, layers:SPEC or STAGE+STAGE"


def _map(path: Path, flag: str = "--payload") -> memoryview:
    """The file's bytes, mapped read-only (checked to exist and be non-empty first)."""
    p = v.existing_file(path, flag, "a kvrelay/1 file from `kvrelay read --out`")
    with open(p, "rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _codec(name: str):
    from kvrelay.kv import codecs

    v.parsed_names(name, "--codec", codecs.parse, CODEC_FORMS)
    return codecs.parse(name)


def _store(url: str | None, *, write: bool = False, flag: str = "--store"):
    """The store ``url`` names, opened and checked (reachable; writable with ``write``) before any model loads:
    no server, a bad database, a read-only folder or a path under a file is one ``error:`` line."""
    if url is None:
        return None
    from kvrelay.transport.stores import STORE_URLS, open_store

    if not url.strip():
        raise v.InvalidInput(f"{flag} is empty", f"a store URL: {', '.join(STORE_URLS)}")
    store = open_store(url)
    store.check(write=write)
    return store


MAX_NEW_TOKENS = 1 << 20  # an answer longer than any model's context: the position limit refuses sooner


def _write_json(path: Path | None, obj: dict) -> None:
    if path is not None and str(path) == "-":
        print(json.dumps({**obj, "command": command_line()}, indent=2))
    else:
        write_json(path, obj)


@app.command("read")
def read_cmd(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder, transformers id or tiny:ARCH"),
    context: Path = typer.Option(None, help="a text file the sender reads (must exist and not be empty)"),
    context_text: str = typer.Option(None, help="the context as literal text, instead of --context FILE"),
    out: Path = typer.Option(None, help="write the payload to this kvrelay/1 file (prints the path)"),
    store: str = typer.Option(None, help="put the payload in this store (file:///DIR, DIR, redis://HOST:PORT/DB); "
                              "prints its key"),
    codec: str = typer.Option("fp16", help="encode the payload first (kv.codecs: raw, fp16, int8, int4, evict:F, "
                              "...); fp16 halves the bytes with the same greedy answers as raw in our "
                              "measurements (docs/codecs.md), raw is bit-exact"),
    ttl: float = typer.Option(None, help="seconds the store keeps it (default: until deleted)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    keys_file: Path = typer.Option(None, help="sign the payload with the key for producer 'sender' from this file "
                                   "(kvrelay.kv.sign key lines; default $KVRELAY_KEYS when set)"),
) -> None:
    """The sender's half of `kvrelay relay`: read the context into a payload, to a file or a store."""
    from kvrelay.cli.app import context_input

    text_in = context_input(context, context_text)
    if (out is None) == (store is None):
        raise v.InvalidInput("give the destination once" if out is not None else "no destination given",
                             "either --out FILE or --store URL")
    v.writable_path(out, "--out")
    v.engine(engine)
    ref = v.model(model)
    v.seconds(ttl, "--ttl")
    c = _codec(codec)
    v.codec_layers(c, v.num_layers(ref))
    from kvrelay.kv.sign import keyring_from

    keys = keyring_from(keys_file)
    signer = keys.signer("sender")
    if keys and signer is None:
        raise v.InvalidInput("the keys hold no key that may sign for producer 'sender'",
                             "an hmac or ed25519-private key line (producers= unset or naming sender)")
    st = _store(store, write=True)

    from kvrelay.agents.agent import READER_ROLE, Agent
    from kvrelay.cli.common import load_for_cli
    from kvrelay.transport.payloads import save_payload
    from kvrelay.transport.stores import put_payload

    lm = load_for_cli(model, None, engine)
    v.codec_layers(c, lm.identity.num_layers)
    payload = Agent(lm, "sender", role=READER_ROLE).read(text_in)
    note(f"read {payload.num_tokens} tokens on {model} ({payload.nbytes / 1e6:.1f} MB as {payload.meta.dtype})")
    if st is not None:
        print(put_payload(st, payload, c.name, ttl_s=ttl, model=lm.model, signer=signer))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    save_payload(out, payload, c.name, signer=signer, model=lm.model)
    print(out)


@app.command("respond")
def respond_cmd(
    question: str = typer.Option(..., help="what the receiver is asked about the relayed context"),
    model: str = typer.Option("qwen2.5-coder-0.5b", help="the receiver's model (must be the sender's)"),
    payload: Path = typer.Option(None, help="a kvrelay/1 file from `kvrelay read --out`"),
    key: str = typer.Option(None, help="a key from `kvrelay read --store` (with --store)"),
    store: str = typer.Option(None, help="the store holding --key"),
    layout: str = typer.Option("continue", help="continue | replace (as in `kvrelay relay`)"),
    role: str = typer.Option("", help="receiver role prompt"),
    max_new_tokens: int = typer.Option(48, help="tokens the receiver may write (it stops earlier at its end token)"),
    json_path: Path = typer.Option(None, "--json", help="write the result as JSON ('-': stdout)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    verify: int = typer.Option(None, "--verify", help="recompute K positions of the payload (and layer 0 of all) "
                               "from its own token ids first; refuse it if they differ (docs/trust.md)"),
    keys_file: Path = typer.Option(None, help="require a signature by one of these keys (kvrelay.kv.sign key lines; "
                                   "default $KVRELAY_KEYS when set)"),
    max_bytes: int = typer.Option(None, "--max-bytes", help="the receiver's byte budget: refuse a payload that decodes "
                                  "to more bytes, from its header, before decoding it (docs/trust.md)"),
) -> None:
    """The receiver's half of `kvrelay relay`: answer from a relayed payload (file or store key)."""
    from kvrelay.workflows.spec import LAYOUTS

    if (payload is None) == (key is None) or (key is None) != (store is None):
        raise v.InvalidInput("no payload named" if payload is None and key is None else "conflicting payload options",
                             "--payload FILE, or --key KEY with --store URL")
    v.nonempty_text(question, "--question")
    v.choice(layout, "--layout", LAYOUTS)
    v.positive(max_new_tokens, "--max-new-tokens", maximum=MAX_NEW_TOKENS)
    v.engine(engine)
    ref = v.model(model)
    v.fits(ref, max_new_tokens, "--max-new-tokens")
    v.positive(verify, "--verify", 2)
    v.positive(max_bytes, "--max-bytes")
    from kvrelay.kv.sign import keyring_from

    keys = keyring_from(keys_file)
    st = _store(store)
    data = _map(payload) if payload is not None else None

    from kvrelay.agents.agent import Agent
    from kvrelay.agents.verify import VerifySpec
    from kvrelay.cli.common import load_for_cli
    from kvrelay.kv.wire import read_meta
    from kvrelay.transport.budget import ByteBudget
    from kvrelay.transport.payloads import check_content_key, decode_bytes

    lm = load_for_cli(model, None, engine)
    if data is None:
        data = st.get_bytes(key)
    budget = ByteBudget(max_bytes) if max_bytes is not None else None
    receiver = Agent(lm, "receiver", role=role, max_new_tokens=max_new_tokens, budget=budget)
    p = decode_bytes(data, expect=lm.identity, keys=keys, admit=receiver.admit)  # over budget: refused undecoded
    codec = read_meta(data).get("codec", "raw")
    if key is not None:
        check_content_key(key, p, codec)
    v.fits(ref, max_new_tokens, "--max-new-tokens", reserve=int(p.next_positions.max()))
    receiver.verify = VerifySpec(k=verify, codec=codec) if verify is not None else None  # at the codec's tolerance
    r = receiver.respond(question, p, layout=layout)
    note(f"{p.num_tokens} relayed tokens, TTFT {r.ttft_s:.3f}s")
    print(r.text)
    _write_json(json_path, {"model": model, "engine": lm.engine, "layout": layout, "answer": r.text,
                            "token_ids": list(r.token_ids), "context_tokens": p.num_tokens, "ttft_s": r.ttft_s,
                            "source": str(payload) if payload is not None else {"store": store, "key": key}})


@app.command("inspect")
def inspect_cmd(
    target: str = typer.Argument(..., help="a kvrelay/1 file, or a key with --store"),
    store: str = typer.Option(None, help="read TARGET as a key from this store"),
    json_path: Path = typer.Option(None, "--json", help="write the description as JSON ('-': stdout)"),
) -> None:
    """Header, metadata, layers, tokens, bytes, codec and checksums of a payload, verified tensor by tensor.

    A payload that `kvrelay respond` would refuse is reported (JSON included) and then refused: one
    `error:` line, exit status 2."""
    from kvrelay.core.errors import CorruptPayload
    from kvrelay.kv.describe import describe

    data = _store(store).get_bytes(target) if store is not None else _map(Path(target), "TARGET")
    d = describe(data)
    if "header" in d:
        _print_description(target, d, Console(stderr=str(json_path) == "-"))
    _write_json(json_path, d)
    if d["status"] != "ok":
        raise CorruptPayload(f"{target}: {d['reason']}")


def _short(value: object, n: int = 64) -> str:
    """A metadata value as printed: the file is untrusted, so long values are cut."""
    text = v.one_line(value)
    return text if len(text) <= n else text[:n - 1] + "…"


def _print_description(target: str, d: dict, console: Console) -> None:
    m, b, ck = d["meta"], d["bytes"], d["checksum"]
    lines = [f"{target}: {d['header']['format']}, codec {_short(d['codec'])}, {d['header']['tensors']} tensors, "
             f"header {d['header']['header_bytes']} B",
             f"model {_short(m.get('model_fingerprint', '?'), 16)} ({_short(m.get('arch'))}, "
             f"{_short(m.get('num_model_layers'))} layers), producer {_short(repr(m.get('producer')))} round "
             f"{_short(m.get('round'))}, dtype {_short(m.get('dtype'))}, engine {_short(m.get('engine', 'fp32'))}",
             f"tokens: batch {d['tokens']['batch']} x {d['tokens']['slots']} slots" if d["tokens"] else "tokens: none",
             f"layers held: {len(d['layers'])} ({_short(', '.join(sorted({str(r['type']) for r in d['layers']})))})",
             f"bytes: file {b['file']:,}, K/V {b['kv']:,}, tokens {b['tokens']:,}"
             + (f", fp32 before the codec {b['raw_fp32']:,}" if b["raw_fp32"] else ""),
             f"checksum: root {ck['root']}, {ck['tensors_verified']} tensors verified"
             + (f", {len(ck['bad'])} damaged: {_short(', '.join(ck['bad']), 200)}" if ck["bad"] else "")]
    for line in lines:  # plain text: metadata may hold rich markup
        console.print(line, markup=False, highlight=False, style="red" if ck["bad"] and line is lines[-1] else None)
