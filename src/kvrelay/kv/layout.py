"""The layout rules of a cached context, written once: which slots a layer holds, what tensors are called.

Attention layers come in two kinds (``ModelIdentity.layer_types``):

* ``full_attention`` layers hold every slot of the sequence: ``T_l = T``;
* ``sliding_attention`` layers (gemma3) hold only the tail, as transformers'
  ``DynamicSlidingWindowLayer`` does: ``T_l = min(T, window - 1)``, covering slots ``T - T_l .. T - 1``.

Tensor names, shared by the wire format, the codecs and every byte store::

    layers.{i}.k, layers.{i}.v          (B, H_kv, T_l, D)   held layer i (index among *held* layers)
    layers.{i}.k.<part>, ...            codec side tensors (e.g. ``codes``, ``scale``, ``zero``)
    token_ids, positions, mask          (B, T)
"""

from __future__ import annotations

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
TOKEN_TENSORS = ("token_ids", "positions", "mask")


def is_sliding(layer_type: str, sliding_window: int | None) -> bool:
    """True when a layer of this type keeps only a window of the latest slots."""
    return layer_type == SLIDING and bool(sliding_window)


def window_slots(sliding_window: int) -> int:
    """The most slots a sliding-window layer holds: ``window - 1`` (the new token is the window's last)."""
    return sliding_window - 1


def held_tokens(layer_type: str, sliding_window: int | None, total: int) -> int:
    """How many of ``total`` slots a layer of ``layer_type`` holds (sliding layers: ``window - 1``)."""
    if is_sliding(layer_type, sliding_window):
        return min(total, window_slots(sliding_window))  # type: ignore[arg-type]
    return total


def any_sliding(layer_types, sliding_window: int | None) -> bool:
    return any(is_sliding(t, sliding_window) for t in layer_types)


def tensor_name(i: int, kv: str, part: str | None = None) -> str:
    """``layers.{i}.k`` / ``layers.{i}.v`` (``kv`` is ``"k"`` or ``"v"``), with an optional codec part."""
    if kv not in ("k", "v"):
        raise ValueError(f"kv must be 'k' or 'v', got {kv!r}")
    return f"layers.{i}.{kv}" + (f".{part}" if part else "")


def kv_tensor_names(n_layers: int) -> list[str]:
    """Names of the K and V tensors of ``n_layers`` held layers, in layer order (k before v)."""
    return [tensor_name(i, kv) for i in range(n_layers) for kv in "kv"]
