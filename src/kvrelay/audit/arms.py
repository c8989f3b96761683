"""Audit arms (docs/audit.md): what the receiver gets in place of the relayed cache.

Every arm is built only from the public payload transforms and codecs — the audit is a client of
the library. An ``Arm`` is parsed from its name once; ``build`` turns the sender's matched
payload (and, for the controls, a length-matched payload of another task) into the receiver's
context: a ``KVPayload`` for cache arms, token ids / text for text arms, ``None`` for ``none``.

=================  ===============================================================
``none``           the receiver's prompt only
``text_message``   a note the sender writes for the receiver (costs sender decode)
``text_full``      the sender's whole context re-encoded (identical tokens to ``kv``)
``kv``             the sender's payload
``kv_mismatched``  another task's payload, length-matched (fixed shift within the set)
``kv_zeroed``      K and V zeroed
``kv_random``      Gaussian K/V moment-matched per example, layer and K/V
``kv_noise:σ``     payload + noise of σ × per-layer RMS
``kv_layers:SPEC`` matched content only in layers SPEC (``first:0.5``, ``last:0.25``, ``0-11``);
                   the mismatched payload elsewhere, so length and presence stay equal
``kv_tokens:SPEC`` only a fraction of tokens: ``first:0.5``, ``last:0.2``, ``topk:0.2``
``kv_codec:NAME``  after a codec (``fp16``, ``int8``, ``int4``, ``evict:0.2``, ...)
``kv_partial:F``   receiver-driven partial relay (``kv.partial``): the share F of positions the
                   receiver's own prompt attends to most, per layer and KV head
``kv_partial_mismatched:F``  the same selection, by the same prompt, over another task's length-matched payload
``kv_adapter:A``   another model's cache of the context, through adapter artefact ``A``
                   (``audit.channels``; the runner builds it, not ``build_kv``)
``kv_adapter_mismatched:A``  that model's length-matched cache of another task, through ``A``
=================  ===============================================================
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvrelay.audit.vocab import ArmName as Arm
from kvrelay.audit.vocab import parse_arm as parse_arm_name
from kvrelay.kv import transforms as T
from kvrelay.kv.payload import KVPayload


def parse_arm(name: str) -> Arm:
    """The arm called ``name``, validated (``audit.vocab.parse_arm``); ``ValueError`` otherwise."""
    return parse_arm_name(name)


def layer_subset(spec: str, n_layers: int) -> list[int]:
    """``first:0.5`` / ``last:0.25`` / ``0-11`` / ``0,3,5`` -> model layer indices."""
    how, _, frac = spec.partition(":")
    if how in ("first", "last"):
        k = max(1, round(float(frac) * n_layers))
        return list(range(k)) if how == "first" else list(range(n_layers - k, n_layers))
    if "-" in spec:
        a, b = (int(x) for x in spec.split("-"))
        return list(range(a, b + 1))
    return [int(x) for x in spec.split(",")]


def _mix_layers(matched: KVPayload, other: KVPayload, keep: list[int]) -> KVPayload:
    """Layers in ``keep`` from ``matched``, the rest from ``other`` (same length); token ids stay the matched ones."""
    if other.num_tokens != matched.num_tokens:
        raise ValueError("kv_layers needs a length-matched mismatched payload")
    keys = [m if i in keep else o for i, (m, o) in enumerate(zip(matched.keys, other.keys, strict=True))]
    values = [m if i in keep else o for i, (m, o) in enumerate(zip(matched.values, other.values, strict=True))]
    return replace(matched, keys=tuple(keys), values=tuple(values))


def _token_subset(p: KVPayload, spec: str, scores: torch.Tensor | None) -> KVPayload:
    how, _, frac = spec.partition(":")
    n = p.num_tokens
    k = max(1, round(float(frac) * n))
    if how == "first":
        # keep the first k tokens and the last one, so the receiver's position cursor continues correctly
        idx = sorted(set(range(k)) | {n - 1})
        return T.select_tokens(p, idx)
    if how == "last":
        return T.select_tokens(p, list(range(n - k, n)))
    from kvrelay.kv.evict import evict

    if scores is None:
        raise ValueError("kv_tokens:topk needs attention scores")
    return evict(p, scores, keep=float(frac))


def build_kv(arm: Arm, matched: KVPayload, mismatched: KVPayload | None, generator: torch.Generator,
             model=None, question_ids=None) -> tuple[KVPayload, int]:
    """The payload a cache arm relays, and its size in bytes on the wire. ``question_ids``: the tokens the
    receiver appends (its prompt), which the partial arms' selection is driven by."""
    if arm.base == "kv":
        return matched, matched.nbytes
    if arm.base == "kv_mismatched":
        if mismatched is None:
            raise ValueError("kv_mismatched needs another task's payload")
        return mismatched, mismatched.nbytes
    if arm.base == "kv_zeroed":
        return T.zeroed(matched), matched.nbytes
    if arm.base == "kv_random":
        return T.moment_matched_random(matched, generator), matched.nbytes
    if arm.base == "kv_noise":
        return T.with_noise(matched, float(arm.dial), generator), matched.nbytes
    if arm.base == "kv_layers":
        keep = layer_subset(arm.dial, matched.meta.num_model_layers)
        mixed = _mix_layers(matched, mismatched, keep)
        return mixed, T.select_layers(matched, keep).nbytes
    if arm.base == "kv_tokens":
        scores = None
        if arm.dial.startswith("topk"):
            from kvrelay.kv.evict import attention_scores

            scores = attention_scores(model, matched)
        out = _token_subset(matched, arm.dial, scores)
        return out, out.nbytes
    if arm.base in ("kv_partial", "kv_partial_mismatched"):
        from kvrelay.kv.partial import Budget, PartialRequest, select

        src = matched if arm.base == "kv_partial" else mismatched
        if src is None or question_ids is None or model is None:
            raise ValueError(f"{arm.name} needs the model, the receiver's prompt ids and (control) a mismatched payload")
        sel = select(src, PartialRequest(tuple(int(i) for i in question_ids), Budget(fraction=float(arm.dial))),
                     model=model)
        return sel.compressed.decompress(), sel.compressed.nbytes
    if arm.base == "kv_codec":
        from kvrelay.kv.codecs import compress

        c = compress(matched, arm.dial, model=model)
        return c.decompress(), c.nbytes
    raise ValueError(f"{arm.name} is not a cache arm")
