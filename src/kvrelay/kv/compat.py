"""The one compatibility rule: may a payload with this metadata be used by a model with this identity?

A payload is compatible with a receiver when it was produced by the same weights under the same
tokenizer and format, in the same engine mode (``models.engine``: the same weights in another mode
compute slightly different K/V), and its held layers have the receiver's layer types and window. Anything
else raises ``IncompatiblePayload`` naming the first field that differs. Payloads from another
model are never used directly; they pass through an adapter first (``kvrelay.agents.receive``).
"""

from __future__ import annotations

from kvrelay.core.errors import EngineMismatch, IncompatiblePayload
from kvrelay.kv.payload import FORMAT, RAW, PayloadMeta
from kvrelay.models.identity import ModelIdentity


def check_meta(m: PayloadMeta, ident: ModelIdentity, *, complete: bool = False) -> None:
    """Raise ``IncompatiblePayload`` unless ``m`` describes a cache ``ident``'s model could have made.

    ``complete``: also require every model layer to be held (what a receiver needs to use it as is).
    """
    held_types = tuple(ident.layer_types[i] if i < ident.num_layers else "?" for i in m.layer_indices)
    for field, mine, theirs in (("format", FORMAT, m.format),
                                ("model_fingerprint", ident.fingerprint, m.model_fingerprint),
                                ("tokenizer_hash", ident.tokenizer_hash, m.tokenizer_hash),
                                ("num_model_layers", ident.num_layers, m.num_model_layers),
                                ("layer_types", held_types, tuple(m.layer_types)),
                                ("sliding_window", ident.sliding_window, m.sliding_window)):
        if mine != theirs:
            raise IncompatiblePayload(field, mine, theirs)
    if m.engine != ident.engine:
        raise EngineMismatch(ident.engine, m.engine)
    if complete:
        require_complete(m)


def require_complete(m: PayloadMeta) -> None:
    """Raise ``IncompatiblePayload`` (field ``layer_indices``) unless ``m`` holds every model layer."""
    if not m.complete:
        raise IncompatiblePayload("layer_indices", tuple(range(m.num_model_layers)), m.layer_indices,
                                  "a receiver needs every layer")


def require_raw(m: PayloadMeta, *, complete: bool = False) -> None:
    """The precondition of code that reads a payload's K/V tensors as they are: decoded by its codec (codec
    ``raw``) and, with ``complete``, holding every model layer. ``IncompatiblePayload`` naming the field."""
    if complete:
        require_complete(m)
    if m.codec != RAW:
        raise IncompatiblePayload("codec", RAW, m.codec, "decode the payload with its codec first")
