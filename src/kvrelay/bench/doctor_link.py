"""``kvrelay doctor link``: a live sender -> receiver link, checked step by step on a probe text.

The sender reads the probe (``sent``); the payload crosses the link's transport (default: the kvrelay/1
wire round trip under the link's codec) and arrives (``arrived``); the receive path checks it, through
the link's adapter if any (``usable``). The receiver's own reading of the same tokens at the same
labelled positions is the reference (``ref``): what a correct cache holds. Checks, in ``CAUSES`` order:

* ``compatible`` — the receive path accepts the payload (else: which field differs, and the fix);
* ``layer_map``  — each arrived layer's values match the reference's *same* layer best (values are
  position-free under a uniform shift, so an offset cannot hide a swapped layer, nor the reverse);
* ``position``   — first-token logits with the relayed cache vs recomputing the text; the offset of
  the cached keys from their labels is estimated by re-rotating the reference keys (``kv.rope``), so
  an off-by-N error is named with its N;
* ``precision``  — what the transport changed: the arrived tensors against the sent ones, classified
  (exact, an fp16 or bf16 round trip, lossy) and judged against the codec the link declares;
* ``mask``       — a padded batch of two readings against each row alone (first-token logits);
* ``engine``     — the drift between the receiver's engine mode and fp32 on the probe (the
  near-compatible payloads that mode makes), measured even when the modes differ on the two sides;
* ``echo``       — the receiver repeats the sender's text from the cache alone; its greedy tokens are
  compared with the same request answered from the text. If even this fails, the cache is broken;
  if it passes but real tasks fail, the problem is semantic (audit the link).

A link's parts are plain functions, so a user can check their own: ``transport`` (payload -> payload,
e.g. their store round trip) and ``logits`` (how the receiver runs a padded batch over a cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.agents.agent import READER_ROLE, Agent
from kvrelay.bench.doctor import Check, Report, skipped
from kvrelay.bench.doctor_models import PROBE, relative_error
from kvrelay.core.errors import EngineMismatch, IncompatiblePayload
from kvrelay.kv import codecs, wire
from kvrelay.kv.cache import to_cache
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.rope import rotate_keys
from kvrelay.kv.transforms import pad_batch, to_dtype
from kvrelay.models.generate import forward_last

ECHO_PROMPT = "Repeat the document above word for word."
QUESTION = "What is the key to the vault?"
ECHO_TOKENS = 24
ECHO_AGREE = 0.75  # share of the text channel's echo tokens the cache's echo must reproduce
LOGIT_TOL = 1e-3  # max |Δlogit| / max |logit| that counts as the same computation (batching, kernels)
MAX_OFFSET = 512  # positions searched either way for a key rotation offset

Logits = Callable[[object, KVPayload | None, list[list[int]]], torch.Tensor]
Transport = Callable[[KVPayload], KVPayload]


def next_logits(model, payload: KVPayload | None, rows: list[list[int]]) -> torch.Tensor:
    """Next-token logits (B, V) after ``rows`` (left-padded to one length), over ``payload``'s cache when given.

    The receiver's padded-batch forward (as ``Agent.respond_batch`` runs it): positions continue each row's
    cache, and an explicit (B, cached + new) mask hides every pad slot of cache and rows.
    """
    q = max(len(r) for r in rows)
    real = torch.tensor([[False] * (q - len(r)) + [True] * len(r) for r in rows])  # (B, q)
    offs = (torch.cumsum(real.long(), dim=1) - 1).clamp_min(0)  # (B, q)
    ids = torch.tensor([[0] * (q - len(r)) + list(r) for r in rows], dtype=torch.int64)  # (B, q)
    if payload is None:
        from transformers import DynamicCache

        cache, pos, mask = DynamicCache(config=model.config), offs, (real if not bool(real.all()) else None)
    else:
        cache = to_cache(payload, model.config)
        pos = payload.next_positions[:, None] + offs  # (B, q)
        mask = torch.cat((payload.mask, real), dim=1)  # (B, T + q)
    return forward_last(model, ids, pos, cache, mask)


def wire_transport(codec: str = "raw", model=None) -> Transport:
    """The kvrelay/1 round trip under ``codec``: encode to bytes (compressing first), decode back."""
    from kvrelay.transport.payloads import decode_bytes

    c = codecs.parse(codec)

    def send(p: KVPayload) -> KVPayload:
        data = wire.encode(p) if c.name == "raw" else \
            b"".join(bytes(x) for x in wire.pack_parts(*codecs.compress(p, c, model=model).to_wire()))
        return decode_bytes(data)

    return send


@dataclass(frozen=True)
class Link:
    """A sender, a receiver, and what stands between them."""

    sender: object  # LoadedModel
    receiver: object  # LoadedModel
    adapter: object | None = None  # fuse adapter for another model's (or mode's) payloads
    codec: str = "raw"  # what the transport is declared to do
    transport: Transport | None = None  # default: wire_transport(codec)
    logits: Logits = next_logits

    def send(self, p: KVPayload) -> KVPayload:
        return (self.transport or wire_transport(self.codec, self.sender.model))(p)


def _rel_logit(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


def _compatible(link: Link, receiver: Agent, arrived: KVPayload) -> tuple[Check, KVPayload | None]:
    try:
        usable = receiver.check(arrived)
    except EngineMismatch as err:
        return Check("compatible", False, "engine",
                     f"the payload was made in engine mode {err.payload_engine!r}, the receiver runs "
                     f"{err.receiver_engine!r}: run both sides with --engine {err.receiver_engine}, or accept it as "
                     f"near-compatible (kvrelay.fuse.engine.AcceptEngines(({err.payload_engine!r},)); the "
                     "engine check measures what that costs)", "engine"), None
    except IncompatiblePayload as err:
        cause = {"model_fingerprint": "model", "tokenizer_hash": "tokenizer", "codec": "codec",
                 "kv_shape": "geometry"}.get(err.field, "layers")
        fix = ("the sender is another model: relay through an adapter (--adapter NAME; `kvrelay doctor models "
               "SENDER RECEIVER` names one) or send the text" if cause == "model" else "")
        return Check("compatible", False, err.field, f"{err}" + (f"; {fix}" if fix else ""), cause), None
    how = f"through adapter {usable.meta.adapter}" if usable.meta.adapter else "as is"
    return Check("compatible", True, "yes", f"the receive path accepts the payload {how}"), usable


def _reference(receiver_lm, usable: KVPayload) -> KVPayload | None:
    """The receiver's own reading of ``usable``'s tokens at its labelled positions (None when gapped)."""
    pos = usable.positions[0]
    if usable.batch_size != 1 or not usable.meta.complete or int(pos[-1] - pos[0]) + 1 != len(pos):
        return None
    return Agent(receiver_lm, "reference").prefill(usable.token_ids[0].tolist(), start=int(pos[0]))


def _layer_map(usable: KVPayload, ref: KVPayload) -> tuple[Check, list[int]]:
    """Which reference layer each arrived layer's values match best (same held length only)."""
    best = []
    for v in usable.values:
        errs = [(float((v.float() - w.float()).norm() / max(float(w.float().norm()), 1e-30)), j)
                for j, w in enumerate(ref.values) if w.shape == v.shape]
        best.append(min(errs)[1])
    wrong = [(i, j) for i, j in enumerate(best) if i != j]
    if not wrong:
        return Check("layer_map", True, 0, f"each of the {len(best)} layers holds its own layer's cache"), best
    shown = ", ".join(f"layer {i} holds layer {j}'s" for i, j in wrong[:4])
    return Check("layer_map", False, len(wrong),
                 f"{shown}{'…' if len(wrong) > 4 else ''}: the layer map is wrong — check the adapter's layer_map or "
                 "the order the transport writes layers in", "layer_map"), best


def key_offset(arrived: torch.Tensor, ref: torch.Tensor, spec) -> int:
    """The rotation ``d`` (positions) with ``arrived ≈ rotate(ref, d)``, searched in ``±MAX_OFFSET``.

    ``arrived``, ``ref``: one layer's keys (1, H, T, D). ``d > 0``: the keys were rotated for positions
    ``d`` later than their labels say.
    """
    cands = torch.arange(-MAX_OFFSET, MAX_OFFSET + 1)
    best, best_err = 0, float("inf")
    for chunk in cands.split(128):
        rot = rotate_keys(ref.float().expand(len(chunk), *ref.shape[1:]), chunk, spec)  # (n, H, T, D)
        err = (rot - arrived.float()).pow(2).flatten(1).sum(1)  # (n,)
        i = int(err.argmin())
        if float(err[i]) < best_err:
            best, best_err = int(chunk[i]), float(err[i])
    return best


def _position(link: Link, receiver: Agent, usable: KVPayload, ref: KVPayload | None, best: list[int]) -> Check:
    model = link.receiver.model
    prompt = receiver.prompt_ids(QUESTION)
    relay = link.logits(model, usable, [prompt])
    text = link.logits(model, None, [usable.token_ids[0].tolist() + prompt])
    rel = _rel_logit(relay, text)
    same_top = bool(relay.argmax() == text.argmax())
    if ref is None:
        return Check("position", rel < LOGIT_TOL, rel, "first-token logits, relay vs recompute (no reference: the "
                     "payload has gaps)", "position_offset")
    layer = next((i for i, j in enumerate(best) if i == j), 0)
    spec = ref.meta.rope_for(ref.meta.layer_types[layer])
    d = key_offset(usable.keys[layer], ref.keys[layer], spec)
    figure = f"first-token logits relay vs recompute: max |Δ| {rel:.2g} of the largest, top-1 " + \
             ("agrees" if same_top else "differs")
    if d == 0:
        return Check("position", True, rel, f"{figure}; keys sit at their labelled positions")
    return Check("position", False, rel,
                 f"{figure}; keys are rotated for positions {abs(d)} {'later' if d > 0 else 'earlier'} than their "
                 f"labels say: off by {d:+d} — the sender and receiver disagree on where the context starts; "
                 f"relabel or re-rotate it (kv.transforms.shift_positions) so both count from the same start",
                 "position_offset")


def _precision(link: Link, sent: KVPayload, arrived: KVPayload) -> Check:
    if [k.shape for k in sent.keys] != [k.shape for k in arrived.keys]:
        return Check("precision", True, "reshaped", f"codec {link.codec} changed the payload's shape (eviction or "
                     "layer subsets): compared through the logits only")
    err = relative_error(arrived, sent)
    if err == 0.0:
        kind = "exact"
    else:
        kind = "lossy"
        for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            if relative_error(arrived, to_dtype(to_dtype(sent, dt), sent.meta.dtype)) < 1e-7:
                kind = f"{name} round trip"
    declared = link.codec
    if declared == "raw":
        ok = kind == "exact"
        hint = ("bit-exact, as a raw link must be" if ok else
                f"K/V arrive changed ({kind}, relative error {err:.2g}) on a link declared raw: the transport "
                "rounds or alters the cache — send raw bytes (kv.wire), or declare the codec it applies")
    else:
        ok = True
        hint = f"{kind} under codec {declared}: relative K/V error {err:.2g} (docs/codecs.md: what it costs in answers)"
    return Check("precision", ok, err, hint, "precision")


def _mask(link: Link, sender: Agent, receiver: Agent, sent: KVPayload, text: str) -> Check:
    words = text.split()
    short = sender.read(" ".join(words[: max(2, len(words) // 3)]))
    if short.num_tokens >= sent.num_tokens:
        return skipped("mask", "the probe is too short to pad a batch")
    model = link.receiver.model
    prompt = receiver.prompt_ids(QUESTION)
    batch = receiver.check(link.send(pad_batch([sent, short])))
    together = link.logits(model, batch, [prompt, prompt])  # (2, V)
    alone = torch.cat([link.logits(model, receiver.check(link.send(p)), [prompt]) for p in (sent, short)])  # (2, V)
    rel = _rel_logit(together, alone)
    if rel < LOGIT_TOL:
        return Check("mask", True, rel, f"a padded batch answers as each row alone (max |Δlogit| {rel:.2g} of the "
                     "largest)")
    return Check("mask", False, rel, f"a padded batch answers differently from each row alone (max |Δlogit| {rel:.2g} "
                 "of the largest): padding slots are attended — pass the (B, cached + new) attention mask that hides "
                 "them (KVPayload.mask, then the new tokens)", "mask")


def _engine(link: Link, ids: list[int]) -> Check:
    from kvrelay.fuse.engine import engine_drift

    s, r = link.sender, link.receiver
    if s.identity.fingerprint != r.identity.fingerprint:
        return skipped("engine", "sender and receiver are different models")
    if s.identity.engine == r.identity.engine == "fp32":
        return Check("engine", True, 0.0, "fp32 on both sides: no engine-mode drift")
    if s.identity.engine != r.identity.engine:
        d = engine_drift(s, r, ids)
        return Check("engine", False, d.max_abs_logit,
                     f"sender mode {s.identity.engine}, receiver mode {r.identity.engine}: accepting costs max "
                     f"|ΔK/V| {d.max_abs_kv:.2g} (relative {d.rel_kv:.2g}), max |Δlogit| {d.max_abs_logit:.2g}",
                     "engine")
    from kvrelay.models.loader import load_model

    base = load_model(r.name)  # the same weights in fp32 (cached)
    if base.identity.fingerprint != r.identity.fingerprint:
        return skipped("engine", f"cannot reload {r.name} in fp32 to compare")
    d = engine_drift(base, r, ids)
    return Check("engine", True, d.max_abs_logit,
                 f"engine mode {r.identity.engine} vs fp32 on the probe: max |ΔK/V| {d.max_abs_kv:.2g}, max |Δlogit| "
                 f"{d.max_abs_logit:.2g} (its payloads are near-compatible with fp32's, refused unless accepted)")


def _echo(link: Link, receiver: Agent, usable: KVPayload, text: str) -> Check:
    from kvrelay.audit.tasks.scoring import token_f1

    kv = receiver.respond(ECHO_PROMPT, usable, max_new_tokens=ECHO_TOKENS)
    same_tok = link.sender.identity.tokenizer_hash == link.receiver.identity.tokenizer_hash
    ids = usable.token_ids[0].tolist() if same_tok else Agent(link.receiver, "r", role=READER_ROLE).reading_ids(text)
    ref = receiver.respond(ECHO_PROMPT, ids, max_new_tokens=ECHO_TOKENS)
    n = max(len(ref.token_ids), 1)
    agree = sum(a == b for a, b in zip(kv.token_ids, ref.token_ids, strict=False)) / n
    f1_kv, f1_text = token_f1(kv.text, [text]), token_f1(ref.text, [text])
    ok = agree >= ECHO_AGREE or (f1_text > 0 and f1_kv >= ECHO_AGREE * f1_text)
    figure = (f"{agree:.0%} of the text channel's echo tokens reproduced; token F1 with the sender's text "
              f"{f1_kv:.2f} (reading the text itself: {f1_text:.2f})")
    if ok:
        return Check("echo", True, agree, f"{figure}; the cache carries the text — if real tasks still fail, the "
                     "problem is semantic: audit the link (`kvrelay audit`, docs/audit.md)")
    return Check("echo", False, agree, f"{figure}: the receiver cannot repeat the text from the cache alone, so the "
                 "cache itself is broken; the checks above say where", "echo")


def diagnose_link(link: Link, text: str = PROBE) -> Report:
    """Run the link's checks on ``text`` (module docstring); later checks are skipped when the payload is refused."""
    sender = Agent(link.sender, "sender", role=READER_ROLE)
    receiver = Agent(link.receiver, "receiver", adapter=link.adapter)
    sent = sender.read(text)
    arrived = link.send(sent)
    facts = {"sender": link.sender.name, "receiver": link.receiver.name, "codec": link.codec,
             "engine": link.receiver.identity.engine, "sender_engine": link.sender.identity.engine,
             "adapter": getattr(link.adapter, "name", None), "tokens": sent.num_tokens,
             "threads": torch.get_num_threads()}
    compatible, usable = _compatible(link, receiver, arrived)
    checks = [compatible]
    ids = sent.token_ids[0].tolist()
    if usable is None:
        rest = ("layer_map", "position", "precision", "mask")
        checks += [skipped(n, "the receive path refuses the payload") for n in rest]
        checks.append(_engine(link, ids))
        checks.append(skipped("echo", "the receive path refuses the payload"))
        return Report("link", tuple(checks), facts)
    ref = _reference(link.receiver, usable)
    if ref is None:
        checks.append(skipped("layer_map", "the payload has gaps (evicted tokens) or misses layers"))
        best = list(range(len(usable.keys)))
    else:
        lm_check, best = _layer_map(usable, ref)
        checks.append(lm_check)
    checks.append(_position(link, receiver, usable, ref, best))
    checks.append(_precision(link, sent, arrived))
    checks.append(_mask(link, sender, receiver, sent, text) if link.adapter is None else
                  skipped("mask", "the adapter maps one row at a time"))
    checks.append(_engine(link, ids))
    checks.append(_echo(link, receiver, usable, text))
    return Report("link", tuple(checks), facts)


def open_link(model: str, sender_model: str | None = None, adapter: str | None = None, engine: str = "fp32",
              codec: str = "raw", sender_engine: str | None = None) -> Link:
    """The link ``kvrelay doctor link`` checks: models loaded by name (the sender defaults to the receiver),
    the adapter artefact ``adapter`` (a folder under ``artefacts/fuse/`` or a path) between them."""
    from kvrelay.models.loader import load_model

    receiver = load_model(model, engine=engine)
    sender = load_model(sender_model or model, engine=sender_engine or engine)
    fitted = None
    if adapter is not None:
        from kvrelay.audit.channels import load_adapter, resolve

        fitted = load_adapter(resolve(adapter), sender, receiver)
    return Link(sender, receiver, fitted, codec)
