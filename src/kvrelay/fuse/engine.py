"""Accepting caches made by another engine mode of the same weights, explicitly.

The same weights under two engine modes (``kvrelay.models.engine``: e.g. fp32 and int8 decode)
compute K/V that differ by rounding, so ``kv.compat.check_meta`` refuses a payload from another mode
(``EngineMismatch``). A receiver that accepts that drift says so with ``AcceptEngines``: payloads of
the listed modes are relabelled as the receiver's mode, tensors untouched, and stamped
``meta.adapter = "engine:<mode>@..."`` so any later reader sees it is a near-compatible cache.
``engine_drift`` measures what accepting costs on a given text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

import torch

from kvrelay.core.errors import EngineMismatch, IncompatiblePayload
from kvrelay.core.modes import split_mode
from kvrelay.kv.payload import KVPayload
from kvrelay.models.identity import ModelIdentity


@dataclass(frozen=True, slots=True)
class AcceptEngines:
    """Use payloads of ``engines`` (modes of the receiver's own weights) as the receiver's mode."""

    engines: tuple[str, ...]
    name: str = "engine"

    def __post_init__(self):
        if not self.engines or not all(isinstance(e, str) and e for e in self.engines):
            raise ValueError(f"engines must be a non-empty tuple of engine names, got {self.engines!r}")
        for e in self.engines:
            split_mode(e)  # ValueError naming the expected form: a typo never matches silently

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps({"kind": "engine", "engines": sorted(self.engines)}).encode()).hexdigest()

    def adapt(self, payload: KVPayload, receiver: ModelIdentity) -> KVPayload:
        m = payload.meta
        if m.model_fingerprint != receiver.fingerprint:
            raise IncompatiblePayload("model_fingerprint", receiver.fingerprint, m.model_fingerprint,
                                      "AcceptEngines accepts other modes of the receiver's own weights only")
        if m.engine != receiver.engine and m.engine not in self.engines:
            raise EngineMismatch(receiver.engine, m.engine)
        if m.engine == receiver.engine:
            return payload
        stamp = f"{self.name}:{m.engine}@{self.fingerprint[:16]}"
        return replace(payload, meta=replace(m, engine=receiver.engine, adapter=stamp))


@dataclass(frozen=True, slots=True)
class EngineDrift:
    engine_a: str
    engine_b: str
    tokens: int
    max_abs_kv: float  # largest |K_a - K_b| or |V_a - V_b| over every layer
    rel_kv: float  # ||KV_a - KV_b|| / ||KV_a||
    max_abs_logit: float  # largest difference of the next-token logits after the text


def engine_drift(a, b, ids: list[int]) -> EngineDrift:
    """Read ``ids`` on two loaded models (same weights, modes a and b) and compare caches and logits.

    All but the last token are prefilled; the last goes through a one-token step, as a decoded
    token does, so the drift covers both phases' kernels.
    """
    from transformers import DynamicCache

    from kvrelay.models.generate import forward_last

    if a.identity.fingerprint != b.identity.fingerprint:
        raise ValueError("engine_drift compares two modes of the same weights")
    if len(ids) < 2:
        raise ValueError("engine_drift needs at least 2 tokens (a prefill and a one-token step)")
    ids_t = torch.tensor([ids], dtype=torch.int64)  # (1, T)
    pos = torch.arange(len(ids))[None]  # (1, T)
    caches, logits = [], []
    for lm in (a, b):
        cache = DynamicCache(config=lm.model.config)
        forward_last(lm.model, ids_t[:, :-1], pos[:, :-1], cache, None)
        logits.append(forward_last(lm.model, ids_t[:, -1:], pos[:, -1:], cache, None))  # (1, V)
        caches.append(cache)
    num = den = 0.0
    worst = 0.0
    for la, lb in zip(caches[0].layers, caches[1].layers, strict=True):
        for ta, tb in ((la.keys, lb.keys), (la.values, lb.values)):
            d = (ta - tb).float()
            worst = max(worst, float(d.abs().max()))
            num += float(d.pow(2).sum())
            den += float(ta.float().pow(2).sum())
    return EngineDrift(a.identity.engine, b.identity.engine, len(ids), worst, (num / max(den, 1e-30)) ** 0.5,
                       float((logits[0] - logits[1]).abs().max()))
