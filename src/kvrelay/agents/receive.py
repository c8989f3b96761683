"""The receive path: what a receiver does with a payload before it attends to it.

1. A payload compatible with the receiver's model (``kv.compat.check_meta``: same fingerprint,
   tokenizer, format, layer types and window, every layer held) is used as is.
2. Otherwise, when the receiver names an ``adapter`` (``kvrelay.fuse``), the payload passes through
   it; the result must then be compatible (the adapter stamps it with the receiver's identity). It
   must hold every layer, unless the adapter declares ``partial = True`` (``fuse.layers``: a mapped
   prefix for some layers only, which the receiver attends to in those layers alone).
3. Otherwise it is refused with ``IncompatiblePayload`` naming the field that differs.

Then the checks that do not depend on the model: the codec is ``raw`` (decode compressed payloads
first), the K/V geometry matches, and the round is not older than one already held from that
producer (``StalePayload``). Nothing is used silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.core.errors import IncompatiblePayload, StalePayload
from kvrelay.fuse.adapter import Adapter
from kvrelay.kv.compat import check_meta
from kvrelay.kv.payload import KVPayload
from kvrelay.models.identity import ModelIdentity


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
    if p.meta.codec != "raw":
        raise IncompatiblePayload("codec", "raw", p.meta.codec, "decode the payload with its codec first")
    want = (ident.num_kv_heads, ident.head_dim)
    for k in p.keys:  # every held layer: a crafted payload may be consistent per layer but not across layers
        got = (k.shape[1], k.shape[3])  # (B, H_kv, T_l, D)
        if got != want:
            raise IncompatiblePayload("kv_shape", want, got)


@dataclass
class RoundBook:
    """The newest round received from each producer: a payload older than that is stale."""

    held: dict[str, int] = field(default_factory=dict)

    def check(self, producer: str, round_: int) -> None:
        have = self.held.get(producer)
        if have is not None and round_ < have:
            raise StalePayload(round_, have, producer)

    def record(self, producer: str, round_: int) -> None:
        self.held[producer] = max(self.held.get(producer, round_), round_)


def receive(p: KVPayload, ident: ModelIdentity, book: RoundBook, adapter: Adapter | None = None) -> KVPayload:
    """The payload a receiver may attend to (``p`` itself or its adapted form); records its round."""
    usable = adapt_if_needed(p, ident, adapter)
    check_geometry(usable, ident)
    book.check(usable.meta.producer, usable.meta.round)
    book.record(usable.meta.producer, usable.meta.round)
    return usable
