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

How it runs (``fuse.recompute``): through the receiver's own modules, never patched — the layers
``0..B`` pass calls its decoder layers over the whole row with the mask and causal kernel of a
prefill (the decoder's public forward when every layer is recomputed: the receiver's own prefill),
and the chosen tokens go through the decoder's public forward with one explicit (1, 1, k, T + k)
mask. Full-attention models only (sliding-window layers hold a tail that a scatter would have to
respect).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvrelay.core.errors import IncompatiblePayload
from kvrelay.fuse.recompute import RecomputePlan, RepairStats, selective_recompute
from kvrelay.kv.compat import require_raw
from kvrelay.kv.payload import KVPayload

__all__ = ["RecomputeAdapter", "RecomputePlan", "RepairSpec", "RepairStats", "parse_repair", "repair_adapter",
           "selective_recompute"]

DEFAULT_CHECK = 2  # layers recomputed in full before choosing tokens (layer-0 K/V do not depend on context)


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
        require_raw(m)

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
