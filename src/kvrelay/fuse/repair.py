"""Repair a transplanted cache by recomputing part of it with the receiver's own weights.

Two dials, one mechanism (``selective_recompute``):

* **layers** — layers ``0 .. b-1`` are recomputed for every relayed token (DroidSpeak,
  arXiv 2411.02820, recomputes a contiguous block of "critical" layers). A block ``a..b-1`` needs
  the hidden states entering layer ``a``; kvrelay payloads carry K/V only, so the receiver makes
  them itself by running layers ``0 .. a-1`` — and then uses the exact K/V those layers give. A block
  therefore costs ``b`` layers, not ``b - a`` (DroidSpeak ships the sender's hidden states at the
  block start instead; that is not built here).
* **tokens** — the first ``check`` layers are recomputed for every relayed token, the tokens whose
  K/V deviate most at the last of them are chosen (CacheBlend, arXiv 2405.16444), and only those
  are recomputed in the layers after; the others keep the relayed K/V. A chosen token attends to
  the relayed K/V of the tokens before it and to the fresh K/V of the chosen ones.

Combined (``layers=A-B,tokens=F``): layers ``0..B`` for all relayed tokens, then a fraction ``F``
chosen at layer ``B``. ``budget`` is the recomputed share of (relayed token × layer) forwards.

The receiver's decoder layers are *called*, never patched: ``model.get_decoder().layers[l]`` with
the model's rotary embedding, a per-layer ``DynamicCache`` holding the context K/V, and an explicit
(1, 1, q, kv) attention mask over the original positions. Recomputing every token at every layer
gives the receiver's own prefill (to float rounding: an explicit mask instead of the causal kernel).
Full-attention models only (sliding-window layers hold a tail that a scatter would have to respect).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from kvrelay.core.errors import IncompatiblePayload
from kvrelay.kv.payload import KVPayload

DEFAULT_CHECK = 2  # layers recomputed in full before choosing tokens (layer-0 K/V do not depend on context)


@dataclass(frozen=True, slots=True)
class RecomputePlan:
    """What to recompute: layers ``0..full_layers-1`` for all relayed tokens, then ``fraction`` of them."""

    full_layers: int
    fraction: float = 0.0

    def __post_init__(self):
        if self.full_layers < 0:
            raise ValueError(f"full_layers must be >= 0, got {self.full_layers}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        if 0.0 < self.fraction < 1.0 and self.full_layers == 0:
            raise ValueError("choosing tokens needs at least one fully recomputed layer to measure deviation on")

    def budget(self, num_layers: int, num_tokens: int) -> float:
        """Recomputed share of (relayed token × layer) forwards."""
        if self.fraction >= 1.0:
            return 1.0
        full = min(self.full_layers, num_layers)
        chosen = math.ceil(self.fraction * num_tokens) if self.fraction > 0 else 0
        return (full * num_tokens + (num_layers - full) * chosen) / max(1, num_layers * num_tokens)


@dataclass(frozen=True, slots=True)
class RepairSpec:
    """A parsed ``recompute:layers=A-B|auto:K,tokens=F,check=N`` (any non-empty subset)."""

    block: tuple[int, int] | None = None  # inclusive layer block A..B
    auto_layers: int | None = None  # K: the profiled K-layer block
    tokens: float | None = None
    check: int = DEFAULT_CHECK

    @property
    def text(self) -> str:
        parts = []
        if self.block is not None:
            parts.append(f"layers={self.block[0]}-{self.block[1]}")
        if self.auto_layers is not None:
            parts.append(f"layers=auto:{self.auto_layers}")
        if self.tokens is not None:
            parts.append(f"tokens={self.tokens:g}")
        if self.tokens is not None and self.block is None and self.auto_layers is None and self.check != DEFAULT_CHECK:
            parts.append(f"check={self.check}")
        return "recompute:" + ",".join(parts)

    def plan(self, num_layers: int, block: tuple[int, int] | None = None) -> RecomputePlan:
        """The plan for a model of ``num_layers`` layers (``block`` = the profile's choice for ``auto``)."""
        blk = self.block if self.block is not None else block
        if self.auto_layers is not None and blk is None:
            raise ValueError(f"{self.text} needs a deviation profile to choose its block (fuse.profile)")
        if blk is not None and not 0 <= blk[0] <= blk[1] < num_layers:
            raise ValueError(f"layer block {blk} out of range for {num_layers} layers")
        frac = 0.0 if self.tokens is None else self.tokens
        if blk is not None:
            return RecomputePlan(blk[1] + 1, frac)
        return RecomputePlan(min(self.check, num_layers) if 0 < frac < 1 else (num_layers if frac >= 1 else 0), frac)


_SPEC = re.compile(r"^(?:recompute:)?(.+)$")


def parse_repair(text: str) -> RepairSpec:
    """``"recompute:tokens=0.15"``, ``"recompute:layers=0-5"``, ``"recompute:layers=auto:4,tokens=0.1"``."""
    m = _SPEC.match(text.strip())
    want = "recompute:layers=A-B|auto:K and/or tokens=F (0..1), optionally check=N"
    if not m:
        raise ValueError(f"repair spec {text!r}: expected {want}")
    kw: dict = {}
    for part in m.group(1).split(","):
        key, _, val = part.strip().partition("=")
        try:
            if key == "tokens":
                kw["tokens"] = float(val)
            elif key == "check":
                kw["check"] = int(val)
            elif key == "layers" and val.startswith("auto:"):
                kw["auto_layers"] = int(val[5:])
            elif key == "layers":
                a, _, b = val.partition("-")
                kw["block"] = (int(a), int(b or a))
            else:
                raise ValueError(key)
        except ValueError:
            raise ValueError(f"repair spec {text!r}: cannot read {part!r}; expected {want}") from None
    if not kw.keys() & {"tokens", "block", "auto_layers"}:
        raise ValueError(f"repair spec {text!r}: expected {want}")
    spec = RepairSpec(**kw)
    if spec.tokens is not None and not 0 <= spec.tokens <= 1:
        raise ValueError(f"repair spec {text!r}: tokens must be a fraction in [0, 1]")
    if spec.check < 1:
        raise ValueError(f"repair spec {text!r}: check must be >= 1 layer")
    return spec


@dataclass(frozen=True, slots=True)
class RepairStats:
    budget: float  # recomputed share of (relayed token × layer) forwards
    full_layers: int
    chosen: tuple[int, ...]  # slots recomputed after the full layers (all relayed slots when fraction is 1)


def _layer_mask(allowed: torch.Tensor, model, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, q, kv) mask in the form the model's attention expects: bool (sdpa) or additive (eager)."""
    if model.config._attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _run_layer(model, layer: int, h: torch.Tensor, q_slots: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, positions: torch.Tensor):
    """Layer ``layer`` for the tokens at ``q_slots`` over the held K/V of every other slot.

    h (1, q, H) hidden states entering the layer; keys/values (1, H_kv, T, D); positions (1, T).
    Returns (hidden out (1, q, H), fresh keys (1, H_kv, q, D), fresh values (1, H_kv, q, D)).
    """
    from transformers import DynamicCache

    dec = model.get_decoder()
    T = keys.shape[2]
    is_ctx = torch.ones(T, dtype=torch.bool)
    is_ctx[q_slots] = False
    ctx = is_ctx.nonzero().flatten()  # (c,)
    cache = DynamicCache(config=model.config)
    if ctx.numel():
        slot = cache.layers[layer]
        slot.lazy_initialization(keys, values)
        slot.keys, slot.values = keys[:, :, ctx], values[:, :, ctx]  # (1, H_kv, c, D)
    q_pos = positions[:, q_slots]  # (1, q)
    before = positions[0, ctx][None, :] < q_pos[0][:, None]  # (q, c): context strictly before the query
    causal = q_pos[0][None, :] <= q_pos[0][:, None]  # (q, q): fresh tokens up to the query itself
    mask = _layer_mask(torch.cat((before, causal), dim=1)[None, None], model, h.dtype)  # (1, 1, q, c + q)
    out = dec.layers[layer](h, attention_mask=mask, position_ids=q_pos, cache=cache, use_cache=True,
                            position_embeddings=dec.rotary_emb(h, q_pos))
    out = out[0] if isinstance(out, tuple) else out
    c = ctx.numel()
    return out, cache.layers[layer].keys[:, :, c:], cache.layers[layer].values[:, :, c:]


def _deviation(k_new, v_new, k_old, v_old) -> torch.Tensor:
    """Per token squared K/V change, (q,): inputs (1, H_kv, q, D)."""
    return ((k_new - k_old) ** 2).sum(dim=(0, 1, 3)) + ((v_new - v_old) ** 2).sum(dim=(0, 1, 3))


def _check_recomputable(model, p: KVPayload, exact_prefix: int) -> None:
    if p.batch_size != 1 or not bool(p.mask.all()):
        raise ValueError("selective recompute takes one unpadded row")
    if not p.meta.complete or p.meta.sliding_window is not None or "sliding_attention" in p.meta.layer_types:
        raise IncompatiblePayload("layer_types", "full attention, every layer held", p.meta.layer_types,
                                  "selective recompute handles full-attention models with every layer held")
    if len(model.get_decoder().layers) != len(p.keys):
        raise IncompatiblePayload("num_model_layers", len(model.get_decoder().layers), len(p.keys))
    if not 0 <= exact_prefix < p.num_tokens:
        raise ValueError(f"exact_prefix must leave relayed tokens: got {exact_prefix} of {p.num_tokens}")


@torch.inference_mode()
def selective_recompute(model, p: KVPayload, plan: RecomputePlan, *,
                        exact_prefix: int = 0) -> tuple[KVPayload, RepairStats]:
    """``p`` with slots ``exact_prefix..T-1`` recomputed by ``model`` as ``plan`` says (meta unchanged).

    Slots ``0..exact_prefix-1`` are the receiver's own exact K/V (attended to, never recomputed).
    """
    _check_recomputable(model, p, exact_prefix)
    L, T = len(p.keys), p.num_tokens
    relayed = torch.arange(exact_prefix, T)  # (n,)
    n = relayed.numel()
    full = L if plan.fraction >= 1.0 else min(plan.full_layers, L)
    if full == 0:
        return p, RepairStats(0.0, 0, ())
    keys, values = list(p.keys), list(p.values)
    q_slots = relayed
    h = model.get_input_embeddings()(p.token_ids[:, relayed])  # (1, n, H)
    for layer in range(L):
        if layer == full:
            if plan.fraction <= 0.0:
                break
            dev = _deviation(keys[layer - 1][:, :, relayed], values[layer - 1][:, :, relayed],
                             p.keys[layer - 1][:, :, relayed], p.values[layer - 1][:, :, relayed])  # (n,)
            pick = dev.topk(math.ceil(plan.fraction * n)).indices.sort().values  # (k,)
            h, q_slots = h[:, pick], relayed[pick]
        h, k_new, v_new = _run_layer(model, layer, h, q_slots, keys[layer], values[layer], p.positions)
        keys[layer] = keys[layer].index_copy(2, q_slots, k_new.to(keys[layer].dtype))  # (1, H_kv, T, D)
        values[layer] = values[layer].index_copy(2, q_slots, v_new.to(values[layer].dtype))
    chosen = tuple(int(s) for s in q_slots)
    return replace(p, keys=tuple(keys), values=tuple(values)), RepairStats(plan.budget(L, n), full, chosen)


@dataclass(frozen=True, eq=False)
class RecomputeAdapter:
    """Accept a sibling's payload (same base: tokenizer, geometry, rope) after recomputing part of it.

    ``lm`` is the receiver (its weights do the recompute). ``sources``: the sender fingerprints this
    receiver accepts (empty: any sibling with the receiver's tokenizer and geometry — naming the repair
    is the receiver's explicit consent). ``profile`` chooses the block of ``layers=auto:K``.
    """

    lm: object
    spec: RepairSpec
    sources: tuple[str, ...] = ()
    profile: object | None = None  # fuse.profile.DeviationProfile
    name: str = "recompute"

    @property
    def fingerprint(self) -> str:
        from kvrelay.fuse.adapter import _digest

        return _digest(kind="recompute", spec=self.spec.text, receiver=self.lm.identity.fingerprint,
                       sources=sorted(self.sources), profile=getattr(self.profile, "digest", None))

    def _check(self, p: KVPayload, receiver) -> None:
        if receiver.fingerprint != self.lm.identity.fingerprint:
            raise IncompatiblePayload("model_fingerprint", self.lm.identity.fingerprint, receiver.fingerprint,
                                      f"adapter {self.name!r} recomputes with another receiver's weights")
        if self.sources and p.meta.model_fingerprint not in self.sources:
            raise IncompatiblePayload("model_fingerprint", self.sources, p.meta.model_fingerprint,
                                      f"adapter {self.name!r} accepts payloads of its named senders only")
        m = p.meta
        for field, mine, theirs in (("tokenizer_hash", receiver.tokenizer_hash, m.tokenizer_hash),
                                    ("arch", receiver.arch, m.arch),
                                    ("num_model_layers", receiver.num_layers, m.num_model_layers),
                                    ("layer_types", receiver.layer_types, m.layer_types),
                                    ("rope", receiver.rope, m.rope),
                                    ("kv_shape", (receiver.num_kv_heads, receiver.head_dim),
                                     (p.keys[0].shape[1], p.keys[0].shape[3]))):
            if mine != theirs:
                raise IncompatiblePayload(field, mine, theirs, "recompute repairs siblings of one base model only")
        if m.codec != "raw":
            raise IncompatiblePayload("codec", "raw", m.codec, "decode the payload with its codec first")

    def plan(self, p: KVPayload) -> RecomputePlan:
        block = None
        if self.spec.auto_layers is not None:
            if self.profile is None:
                raise ValueError(f"{self.spec.text} needs a deviation profile (fuse.profile.load_profile)")
            self.profile.require_pair(p.meta.model_fingerprint, self.lm.identity.fingerprint)
            block = self.profile.block(self.spec.auto_layers)
        return self.spec.plan(p.meta.num_model_layers, block)

    def adapt(self, payload: KVPayload, receiver) -> KVPayload:
        from kvrelay.fuse.adapter import stamp

        self._check(payload, receiver)
        repaired, _ = selective_recompute(self.lm.model, payload, self.plan(payload))
        return replace(repaired, meta=stamp(payload.meta, receiver, self))


def repair_adapter(lm, spec: str | RepairSpec, *, sources: tuple[str, ...] = (), profile=None) -> RecomputeAdapter:
    """The receive-path adapter for ``spec`` (e.g. ``"recompute:tokens=0.15"``) on receiver ``lm``."""
    return RecomputeAdapter(lm, parse_repair(spec) if isinstance(spec, str) else spec, tuple(sources), profile)
