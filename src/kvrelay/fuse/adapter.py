"""The adapter protocol and its first, exact implementations.

A receiver uses a payload directly only when it is compatible with its own model
(``kv.compat.check_meta``). Anything else must pass through an adapter first::

    adapter.adapt(payload, receiver_identity) -> payload

The result is *stamped*: its metadata carries the receiver's identity (fingerprint, tokenizer,
layer geometry, rope) and ``meta.adapter = "NAME@FINGERPRINT"`` of the adapter, so a later reader
can tell a mapped cache from one the receiver made itself. An adapter refuses (``IncompatiblePayload``)
payloads whose source model it was not made for: nothing is mapped silently.

Exact adapters here:

* ``IdentityAdapter`` — the receiver declares another fingerprint equivalent (same weights loaded
  another way, or an explicitly accepted near-compatible variant); tensors are untouched.
* ``HeadMapAdapter`` — GQA → MHA (or any KV-head count that is a multiple): each source KV head
  is repeated for the receiver's heads of its group. Exact when the receiver's ``k_proj``/``v_proj``
  rows are the source's repeated the same way (``mha_from_gqa``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from kvrelay.core.errors import IncompatiblePayload
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.models.identity import ModelIdentity


@runtime_checkable
class Adapter(Protocol):
    """Maps payloads of one model into another model's cache space."""

    name: str

    @property
    def fingerprint(self) -> str:
        """sha256 of what defines the adapter (its kind, source and target, and any weights)."""
        ...

    def adapt(self, payload: KVPayload, receiver: ModelIdentity) -> KVPayload:
        """``payload`` as ``receiver``'s model would hold it, stamped (see ``stamp``)."""
        ...


def stamp(meta: PayloadMeta, receiver: ModelIdentity, adapter: Adapter, *,
          layer_indices: tuple[int, ...] | None = None) -> PayloadMeta:
    """``meta`` re-labelled for ``receiver`` as the output of ``adapter`` (producer, round, dtype kept)."""
    idx = tuple(range(receiver.num_layers)) if layer_indices is None else layer_indices
    return replace(meta, model_fingerprint=receiver.fingerprint, tokenizer_hash=receiver.tokenizer_hash,
                   arch=receiver.arch, num_model_layers=receiver.num_layers, layer_indices=idx,
                   layer_types=tuple(receiver.layer_types[i] for i in idx), sliding_window=receiver.sliding_window,
                   rope=receiver.rope, adapter=f"{adapter.name}@{adapter.fingerprint[:16]}")


def _digest(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _require_source(adapter_name: str, payload: KVPayload, source: str) -> None:
    if payload.meta.model_fingerprint != source:
        raise IncompatiblePayload("model_fingerprint", source, payload.meta.model_fingerprint,
                                  f"adapter {adapter_name!r} maps payloads of that model only")


@dataclass(frozen=True, slots=True)
class IdentityAdapter:
    """Accept payloads of ``source`` (a fingerprint) as if ``target``'s model had made them, unchanged."""

    source: str
    target: str
    name: str = "identity"

    @property
    def fingerprint(self) -> str:
        return _digest(kind="identity", source=self.source, target=self.target)

    def adapt(self, payload: KVPayload, receiver: ModelIdentity) -> KVPayload:
        _require_source(self.name, payload, self.source)
        if receiver.fingerprint != self.target:
            raise IncompatiblePayload("model_fingerprint", self.target, receiver.fingerprint,
                                      f"adapter {self.name!r} was made for another receiver")
        return replace(payload, meta=stamp(payload.meta, receiver, self, layer_indices=payload.meta.layer_indices))


def repeat_kv_heads(payload: KVPayload, n_rep: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Keys and values with each KV head repeated ``n_rep`` times: (B, H, T_l, D) -> (B, H·n_rep, T_l, D).

    Head ``h`` of the source becomes heads ``h·n_rep .. h·n_rep + n_rep - 1``, the order transformers'
    ``repeat_kv`` uses to share one KV head among the query heads of its group.
    """
    if n_rep < 1:
        raise ValueError(f"n_rep must be >= 1, got {n_rep}")
    keys = tuple(k.repeat_interleave(n_rep, dim=1) for k in payload.keys)
    values = tuple(v.repeat_interleave(n_rep, dim=1) for v in payload.values)
    return keys, values


@dataclass(frozen=True, slots=True)
class HeadMapAdapter:
    """GQA → more KV heads: source KV head ``h`` feeds receiver heads ``h·r .. h·r + r - 1``."""

    source: ModelIdentity
    target: ModelIdentity
    name: str = "heads"

    def __post_init__(self):
        s, t = self.source, self.target
        if t.num_kv_heads % s.num_kv_heads:
            raise ValueError(f"receiver KV heads ({t.num_kv_heads}) must be a multiple of the source's ({s.num_kv_heads})")
        for field in ("num_layers", "head_dim", "layer_types", "sliding_window", "tokenizer_hash"):
            if getattr(s, field) != getattr(t, field):
                raise ValueError(f"head mapping needs the same {field} (source {getattr(s, field)!r}, "
                                 f"receiver {getattr(t, field)!r})")
        if tuple(r.inv_freq for r in s.rope) != tuple(r.inv_freq for r in t.rope):
            raise ValueError("head mapping needs the same rope parameters")

    @property
    def fingerprint(self) -> str:
        return _digest(kind="heads", source=self.source.fingerprint, target=self.target.fingerprint)

    def adapt(self, payload: KVPayload, receiver: ModelIdentity) -> KVPayload:
        _require_source(self.name, payload, self.source.fingerprint)
        if receiver.fingerprint != self.target.fingerprint:
            raise IncompatiblePayload("model_fingerprint", self.target.fingerprint, receiver.fingerprint,
                                      f"adapter {self.name!r} was made for another receiver")
        keys, values = repeat_kv_heads(payload, self.target.num_kv_heads // self.source.num_kv_heads)
        meta = stamp(payload.meta, receiver, self, layer_indices=payload.meta.layer_indices)
        return replace(payload, keys=keys, values=values, meta=meta)


def mha_from_gqa(model):
    """A copy of a GQA causal LM with one KV head per query head, exactly equivalent.

    ``k_proj``/``v_proj`` rows (and biases) of each KV head are repeated for every query head of its
    group, the same repetition attention applies at run time, so logits are unchanged. A test
    fixture and a known right answer for cross-model head mapping.
    """
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    text = cfg.get_text_config(decoder=True)
    n_q, n_kv = text.num_attention_heads, text.num_key_value_heads
    rep = n_q // n_kv
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_q
    text.num_key_value_heads = n_q
    new = AutoModelForCausalLM.from_config(cfg, dtype=next(model.parameters()).dtype).eval()
    sd = {}
    for name, t in model.state_dict().items():
        if any(f"{p}." in name for p in ("k_proj", "v_proj")):
            shape = t.shape
            t = t.reshape(n_kv, head_dim, *shape[1:]).repeat_interleave(rep, dim=0).reshape(n_q * head_dim, *shape[1:])
        sd[name] = t
    new.load_state_dict(sd)
    return new
