"""The receive path: what a receiver does with a payload before it attends to it.

1. A payload compatible with the receiver's model (``kv.compat.check_meta``: same fingerprint,
   tokenizer, format, layer types and window, every layer held) is used as is.
2. Otherwise, when the receiver names an ``adapter`` (``kvrelay.fuse``), the payload passes through
   it; the result must then be compatible (the adapter stamps it with the receiver's identity). It
   must hold every layer, unless the adapter declares ``partial = True`` (``fuse.layers``: a mapped
   prefix for some layers only, which the receiver attends to in those layers alone).
3. Otherwise it is refused with ``IncompatiblePayload`` naming the field that differs.

Then the checks that do not depend on the model: the codec is ``raw`` (decode compressed payloads
first), the K/V geometry matches, every real token id is in the receiver's vocabulary, and the round
book (``RoundBook`` under ``RoundRules``) accepts the round: not older than one already held from that
producer (``StalePayload``), not skipping rounds (``MissingRound``), not expired by rounds or seconds
(``ExpiredPayload``), and not made by a model the producer has since replaced (``ProducerModelChanged``).
Nothing is used silently.

Before all of these, a receiver with a byte budget (``transport.budget.ByteBudget``, policy ``refuse``)
refuses a payload whose bytes would exceed it (``OverBudget``; ``admit``), and counts an adapted form
beside the payload it came from. A receiver keeps no payload between calls (its round book holds a
round number and a model fingerprint per producer), so nothing is held when a call starts and
nothing can be evicted: the budget caps the decoded bytes (``KVPayload.nbytes``) of the payloads one
call holds at once — one, or a batch's together. Through a store the same count is read from the
header (``kv.wire.decoded_nbytes``) and refused before any tensor is decoded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.core.errors import (
    ExpiredPayload,
    IncompatiblePayload,
    InvalidInput,
    MissingRound,
    ProducerModelChanged,
    StalePayload,
)
from kvrelay.fuse.adapter import Adapter
from kvrelay.kv.compat import check_meta, require_raw
from kvrelay.kv.payload import KVPayload
from kvrelay.models.identity import ModelIdentity
from kvrelay.transport.budget import ByteBudget


def receiver_budget(budget: ByteBudget | None) -> ByteBudget | None:
    """``budget`` when a receiver can keep it: ``InvalidInput`` for an evicting policy (a receiver holds no payload
    between calls, so there is nothing to evict: only ``refuse`` means something)."""
    if budget is not None and budget.policy != "refuse":
        raise InvalidInput(f"a receiver's byte budget with policy {budget.policy!r}",
                           "policy 'refuse' (a receiver keeps no payload between calls, so there is nothing to evict)")
    return budget


def admit(sizes: Sequence[int], budget: ByteBudget | None, where: str = "receiver") -> None:
    """``OverBudget`` unless payloads of these decoded sizes, held at once by one call, fit ``budget`` (a
    receiver's: nothing held before the call). A payload larger than the budget is refused (``ByteBudget``)."""
    if budget is None:
        return
    held = ByteBudget(budget.max_bytes)  # one call's payloads, from nothing held
    for i, n in enumerate(sizes):
        held.admit(str(i), n, where)


def compatible(p: KVPayload, ident: ModelIdentity) -> bool:
    try:
        check_meta(p.meta, ident, complete=True)
    except IncompatiblePayload:
        return False
    return True


def adapt_if_needed(p: KVPayload, ident: ModelIdentity, adapter: Adapter | None) -> KVPayload:
    """``p`` when it is compatible with ``ident``; else ``adapter.adapt(p)``; else ``IncompatiblePayload``."""
    try:
        check_meta(p.meta, ident, complete=True)
        return p
    except IncompatiblePayload:
        if adapter is None:
            raise
    out = adapter.adapt(p, ident)
    check_meta(out.meta, ident, complete=not getattr(adapter, "partial", False))
    return out


def check_geometry(p: KVPayload, ident: ModelIdentity) -> None:
    require_raw(p.meta)
    if ident.vocab_size is not None:
        real = p.token_ids[p.mask]
        top = int(real.max()) if real.numel() else -1
        if top >= ident.vocab_size:
            raise IncompatiblePayload("token_ids", f"ids below {ident.vocab_size}", top,
                                      f"token id {top} is outside the receiver's vocabulary of {ident.vocab_size}")
    want = (ident.num_kv_heads, ident.head_dim)
    for k in p.keys:  # every held layer: a crafted payload may be consistent per layer but not across layers
        got = (k.shape[1], k.shape[3])  # (B, H_kv, T_l, D)
        if got != want:
            raise IncompatiblePayload("kv_shape", want, got)


@dataclass(frozen=True, slots=True)
class RoundRules:
    """What a receiver accepts of each producer's rounds (mechanism in ``RoundBook``, policy here).

    ``continuity``: a round more than one past the newest held is a gap (``MissingRound``): the caches
    in between were lost. ``max_rounds``: a payload whose round trails the receiver's own round by more
    than this has expired; ``max_age_s``: one made (``PayloadMeta.created_at``, the producer's clock)
    more than this many seconds ago has expired (``ExpiredPayload``). None: no limit.
    """

    continuity: bool = True
    max_rounds: int | None = None
    max_age_s: float | None = None

    def __post_init__(self):
        if self.max_rounds is not None and (type(self.max_rounds) is not int or self.max_rounds < 0):
            raise ValueError(f"max_rounds must be None or an int >= 0, got {self.max_rounds!r}")
        if self.max_age_s is not None and (isinstance(self.max_age_s, bool) or not isinstance(self.max_age_s, (int, float))
                                           or not math.isfinite(self.max_age_s) or self.max_age_s <= 0):
            raise ValueError(f"max_age_s must be None or a finite number of seconds > 0, got {self.max_age_s!r}")


@dataclass
class RoundBook:
    """Per producer: the newest round received and the model it was made by.

    A payload older than the newest round held is stale (``StalePayload``); one more than a round
    ahead is a gap (``MissingRound``, when ``rules.continuity``); one past ``rules``' age limits has
    expired (``ExpiredPayload``). When a producer's payloads arrive with another model fingerprint,
    its old fingerprint is retired: every payload still carrying it is refused
    (``ProducerModelChanged``) and its rounds count afresh under the new model.
    """

    rules: RoundRules = field(default_factory=RoundRules)
    held: dict[str, int] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)  # producer -> its current model fingerprint
    retired: dict[str, set[str]] = field(default_factory=dict)  # producer -> fingerprints it no longer has

    def observe_model(self, producer: str, fingerprint: str) -> None:
        """Learn the model ``producer`` made a payload with; refuses a retired one."""
        current = self.models.get(producer)
        if fingerprint in self.retired.get(producer, ()):
            raise ProducerModelChanged(producer, fingerprint, current or "")
        if current is not None and current != fingerprint:
            self.retired.setdefault(producer, set()).add(current)
            self.held.pop(producer, None)  # another model: its rounds start over
        self.models[producer] = fingerprint

    def check(self, producer: str, round_: int, *, created_at: float | None = None, now_round: int | None = None,
              now_s: float | None = None) -> None:
        """Raise if a payload of ``producer``'s round ``round_`` is stale, skips rounds, or has expired.

        ``now_round``: the receiver's own round (for ``max_rounds``); ``now_s``: its clock (default
        ``time.time()``, for ``max_age_s`` against ``created_at``)."""
        have = self.held.get(producer)
        if have is not None and round_ < have:
            raise StalePayload(round_, have, producer)
        if self.rules.continuity and have is not None and round_ > have + 1:
            raise MissingRound(producer, tuple(range(have + 1, round_)), have, round_)
        r = self.rules
        if r.max_rounds is not None and now_round is not None and now_round - round_ > r.max_rounds:
            raise ExpiredPayload(producer, now_round - round_, r.max_rounds, "rounds")
        if r.max_age_s is not None and created_at is not None:
            age = (time.time() if now_s is None else now_s) - created_at
            if age > r.max_age_s:
                raise ExpiredPayload(producer, round(age, 3), r.max_age_s, "seconds")

    def record(self, producer: str, round_: int) -> None:
        self.held[producer] = max(self.held.get(producer, round_), round_)


def receive(p: KVPayload, ident: ModelIdentity, book: RoundBook, adapter: Adapter | None = None, *,
            now_round: int | None = None, now_s: float | None = None, budget: ByteBudget | None = None,
            where: str = "receiver") -> KVPayload:
    """The payload a receiver may attend to (``p`` itself or its adapted form); records its round.

    ``now_round`` / ``now_s``: the receiver's round and clock, for the book's expiry rules. ``budget``: the
    receiver's byte budget (``admit``, naming ``where``): ``p`` first, then ``p`` with its adapted form (both held)."""
    admit([p.nbytes], budget, where)
    book.observe_model(p.meta.producer, p.meta.model_fingerprint)
    usable = adapt_if_needed(p, ident, adapter)
    if usable is not p:  # the caller still holds what arrived while the adapted form is used
        admit([p.nbytes, usable.nbytes], budget, where)
    check_geometry(usable, ident)
    m = usable.meta
    book.check(m.producer, m.round, created_at=m.created_at, now_round=now_round, now_s=now_s)
    book.record(m.producer, m.round)
    return usable
