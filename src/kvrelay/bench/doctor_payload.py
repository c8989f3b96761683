"""``kvrelay doctor payload FILE|KEY --model M``: one payload against a receiver's model, every mismatch with its fix.

The bytes are verified first (``kv.describe``: header, metadata and every tensor's digest); a damaged
payload stops there. Then each field a receiver depends on is compared with the model — identity,
tokenizer, held layers and their types, K/V shapes, positions, rope, dtype, codec, engine mode — and
listed whether it matches or not (the receive path itself stops at the first difference). The last
check, ``usable``, is the receive path's own verdict (``agents.receive.receive``), so the doctor and
the receiver never disagree.
"""

from __future__ import annotations

from kvrelay.bench.doctor import Check, Report, skipped
from kvrelay.core.errors import IncompatiblePayload, KVRelayError
from kvrelay.kv.layout import held_tokens
from kvrelay.kv.payload import FORMAT, KVPayload, dtype_name


def _identity_checks(p: KVPayload, lm) -> list[Check]:
    m, ident = p.meta, lm.identity
    out = [Check("format", m.format == FORMAT, m.format, "" if m.format == FORMAT else
                 f"expected {FORMAT}: re-encode it with this kvrelay (`kvrelay read`)", "integrity")]
    if m.model_fingerprint == ident.fingerprint:
        out.append(Check("model", True, m.model_fingerprint[:12], f"made by {lm.name} (producer {m.producer!r})"))
    else:
        from kvrelay.bench.doctor_models import adapters_for

        fits = [f"{a['name']} ({a['method']}; {a['held_out']})" for a in adapters_for(m.model_fingerprint,
                                                                                   ident.fingerprint)]
        fix = (f"relay it through adapter {fits[0]}" if fits else
               "a receiver never uses another model's cache directly: pass it through an adapter "
               "(`kvrelay doctor models SENDER RECEIVER` says which) or read the text on this model")
        out.append(Check("model", False, m.model_fingerprint[:12],
                         f"made by another model ({m.arch}, {m.num_model_layers} layers, producer {m.producer!r}), "
                         f"not {lm.name} ({ident.fingerprint[:12]}): {fix}", "model"))
    same_tok = m.tokenizer_hash == ident.tokenizer_hash
    out.append(Check("tokenizer", same_tok, m.tokenizer_hash[:12], "" if same_tok else
                     f"another tokenizer than {lm.name}'s ({ident.tokenizer_hash[:12]}): token ids mean other text; "
                     "only an adapter that re-aligns tokens (ridge, fuser) can map it", "tokenizer"))
    return out


def _layer_checks(p: KVPayload, lm) -> list[Check]:
    m, ident = p.meta, lm.identity
    want_types = tuple(ident.layer_types[i] if i < ident.num_layers else "?" for i in m.layer_indices)
    problems = []
    if m.num_model_layers != ident.num_layers:
        problems.append(f"made for {m.num_model_layers} layers, {lm.name} has {ident.num_layers}")
    if tuple(m.layer_types) != want_types:
        bad = [i for i, (a, b) in enumerate(zip(m.layer_types, want_types, strict=True)) if a != b]
        problems.append(f"held layers {bad[:6]} have types {[m.layer_types[i] for i in bad[:6]]}, the model "
                        f"{[want_types[i] for i in bad[:6]]}")
    if m.sliding_window != ident.sliding_window:
        problems.append(f"sliding window {m.sliding_window}, the model's {ident.sliding_window}")
    if not m.complete:
        missing = sorted(set(range(m.num_model_layers)) - set(m.layer_indices))
        problems.append(f"layers {missing[:8]}{'…' if len(missing) > 8 else ''} are not held: a receiver needs "
                        "every layer (recompute them, `kvrelay bench repair`, or send the full payload)")
    held = f"{len(m.layer_indices)}/{m.num_model_layers}"
    return [Check("layers", not problems, held, "; ".join(problems) or "every layer held, types and window match",
                  "layers")]


def _tensor_checks(p: KVPayload, lm) -> list[Check]:
    ident = lm.identity
    want = (ident.num_kv_heads, ident.head_dim)
    bad = [(j, (k.shape[1], k.shape[3])) for j, k in enumerate(p.keys) if (k.shape[1], k.shape[3]) != want]
    T = p.num_tokens
    short = [j for j, k in enumerate(p.keys)
             if k.shape[2] != held_tokens(p.meta.layer_types[j], p.meta.sliding_window, T)]
    shape_hint = ("(KV heads, head dim) = " + str(want) + " in every layer" if not bad else
                  f"held layer {bad[0][0]} has (KV heads, head dim) {bad[0][1]}, the model {want}: "
                  + ("a head map (kvrelay.fuse.adapter.HeadMapAdapter) repeats KV heads" if
                     bad[0][1][1] == want[1] and want[0] % bad[0][1][0] == 0 else "an adapter must map it"))
    if short:
        shape_hint += f"; held layers {short[:6]} hold another number of tokens than {T} slots allow"
    checks = [Check("kv_shape", not bad and not short, f"{p.batch_size}x{T} tokens", shape_hint, "geometry")]

    rows = []
    for b in range(p.batch_size):
        pos = p.positions[b][p.mask[b]]
        if len(pos) > 1 and not bool((pos[1:] > pos[:-1]).all()):
            rows.append(f"row {b}: positions do not increase")
    pos = p.positions[p.mask]
    span = f"{int(pos.min())}..{int(pos.max())}" if len(pos) else "empty"
    cfg = lm.model.config.get_text_config(decoder=True)
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit and len(pos) and int(pos.max()) >= limit:
        rows.append(f"positions reach {int(pos.max())}, beyond the model's {limit}")
    gaps = len(pos) and p.batch_size == 1 and int(pos.max() - pos.min()) + 1 != len(pos)
    hint = "; ".join(rows) or (f"{len(pos)} tokens at {span}" + (" with gaps (an evicted payload: positions kept)"
                                                               if gaps else "; the receiver continues after them"))
    checks.append(Check("positions", not rows, span, hint + ("; re-read the text, or relabel with "
                                                            "kv.transforms.shift_positions" if rows else ""),
                        "position_offset"))
    mine = {r.layer_type: r.inv_freq for r in ident.rope}
    off = [r.layer_type for r in p.meta.rope if r.layer_type in mine and r.inv_freq != mine[r.layer_type]]
    checks.append(Check("rope", not off, ", ".join(r.layer_type for r in p.meta.rope),
                        f"rope of {off} differs from the model's (another base or scaling): keys are rotated "
                        "differently; only an adapter can map them" if off else "rope frequencies match per layer "
                        "type", "geometry"))
    mdt = dtype_name(lm.dtype)
    checks.append(Check("dtype", True, p.meta.dtype, "the model's dtype" if p.meta.dtype == mdt else
                        f"the model runs {mdt}: the cache is cast on use (fp16/bf16 payloads carry their rounding)"))
    return checks


def diagnose_payload(data, lm) -> Report:
    """Verify ``data`` (kvrelay/1 bytes) and compare it with ``lm``; see the module docstring."""
    from kvrelay.agents.receive import RoundBook, receive
    from kvrelay.kv.describe import describe
    from kvrelay.transport.payloads import decode_bytes

    d = describe(data)
    facts = {"model": lm.name, "codec": d.get("codec"), "bytes": d.get("bytes", {}).get("file")}
    if d["status"] != "ok":
        why = d.get("reason") or f"tensors {', '.join(d['checksum']['bad'])} do not match their digests"
        return Report("payload", (Check("integrity", False, "corrupt", f"{why}: the bytes were damaged or edited; "
                                        "send them again", "integrity"),
                                  skipped("usable", "the bytes are damaged")), facts)
    checks = [Check("integrity", True, "ok", f"header and {d['checksum']['tensors_verified']} tensor digests verified")]
    try:
        p = decode_bytes(data)
    except KVRelayError as err:
        return Report("payload", (*checks, Check("decode", False, "failed", str(err), "codec")), facts)
    codec = d["codec"]
    checks.append(Check("codec", True, codec, "stored as is" if codec == "raw" else
                        f"decoded from {codec} on receipt (docs/codecs.md says what each codec keeps)"))
    checks += _identity_checks(p, lm)
    checks += _layer_checks(p, lm)
    checks += _tensor_checks(p, lm)
    same = p.meta.engine == lm.identity.engine
    checks.append(Check("engine", same, p.meta.engine, f"made in engine mode {p.meta.engine}" if same else
                        f"made in engine mode {p.meta.engine!r}, the receiver runs {lm.identity.engine!r}: load the "
                        f"receiver with --engine {p.meta.engine}, or accept it explicitly as near-compatible "
                        f"(kvrelay.fuse.engine.AcceptEngines; `kvrelay doctor link --engine` measures the drift)",
                        "engine"))
    if p.meta.adapter:
        checks.append(Check("adapter", True, p.meta.adapter, "mapped by this adapter from another model's cache"))
    try:
        receive(p, lm.identity, RoundBook())
        checks.append(Check("usable", True, "yes", f"the receive path accepts it on {lm.name}"))
    except IncompatiblePayload as err:
        checks.append(Check("usable", False, err.field, str(err), _cause_of(err.field)))
    facts.update({"tokens": p.num_tokens, "batch": p.batch_size, "producer": p.meta.producer,
                  "arch": p.meta.arch, "engine": p.meta.engine})
    return Report("payload", tuple(checks), facts)


def _cause_of(field: str) -> str:
    """The ``CAUSES`` entry an ``IncompatiblePayload.field`` points to."""
    return {"model_fingerprint": "model", "tokenizer_hash": "tokenizer", "engine": "engine", "format": "integrity",
            "codec": "codec", "kv_shape": "geometry", "num_model_layers": "layers", "layer_types": "layers",
            "sliding_window": "layers", "layer_indices": "layers"}.get(field, "model")
