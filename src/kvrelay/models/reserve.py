"""A decode cache with its room reserved: one-token steps write in place instead of re-concatenating.

transformers' ``DynamicLayer.update`` appends with ``torch.cat``, so every decoded token copies the
whole cache of every layer: at 2,048 cached tokens on qwen2.5-coder-0.5b that is 48 MB per token, a
sixth of a decode step on a 2-core CPU (``benchmarks/decode_profile.py`` measures it).
``reserved(cache, room)`` copies each full-attention layer once into a buffer with ``room`` free slots
and swaps in a ``ReservedLayer`` that writes new keys and values into them; the layer's ``keys`` /
``values`` stay (B, H, T, D) views of the filled part, so attention and every reader see the same
tensors as before. On leaving, the cache gets back plain ``DynamicLayer`` objects holding contiguous
tensors of exactly the filled part; later updates concatenate into new tensors again, as before.

Nothing written in place is ever visible through a tensor handed out earlier: a view covers only the
slots filled when it was taken, and a write only touches slots after them. Anything that would move
the filled boundary back (``crop``, batch re-indexing, ``reset``) first gives up the reservation, so
the layer falls back to concatenation. Sliding-window layers are left as they are.

``reserved(cache, room, rollback=True)`` is for a caller that rolls its cache back and holds no view
across a rollback (speculative decoding, ``models.speculative``): there ``crop`` moves the filled
boundary back and keeps the reservation, and later writes reuse the freed slots — so a view taken
before such a crop may change afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views into a buffer with free slots after them."""

    def __init__(self, layer: DynamicLayer, room: int, rollback: bool = False):
        super().__init__()
        self.rollback = rollback  # crop keeps the reservation (module docstring)
        k, v = layer.keys, layer.values  # (B, H, T, D)
        B, H, T, D = k.shape
        self._k = k.new_empty(B, H, T + room, D)  # (B, H, T + room, D)
        self._v = v.new_empty(B, v.shape[1], T + room, v.shape[3])
        self._k[:, :, :T].copy_(k)
        self._v[:, :, :T].copy_(v)
        self._n = T
        self.device, self.is_initialized = layer.device, True
        self.keys, self.values = self._k[:, :, :T], self._v[:, :, :T]

    @property
    def reserving(self) -> bool:
        return self._k is not None

    def _release(self) -> None:
        """Stop writing in place: from now on ``update`` concatenates (plain ``DynamicLayer``)."""
        self._k = self._v = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if (self._k is None or self._n + q > self._k.shape[2] or key_states.shape[0] != self._k.shape[0]
                or key_states.dtype != self._k.dtype):
            self._release()
            return super().update(key_states, value_states, *args, **kwargs)
        self._k[:, :, self._n: self._n + q].copy_(key_states)
        self._v[:, :, self._n: self._n + q].copy_(value_states)
        self._n += q
        self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if self.rollback and self._k is not None and tokens_to_remove <= 0:
            self._n -= min(-tokens_to_remove, self._n)
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
            return
        self._release()
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._release()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._release()
        super().batch_select_indices(indices)

    def reset(self) -> None:
        self._release()
        super().reset()

    def plain(self) -> DynamicLayer:
        """A ``DynamicLayer`` holding contiguous copies of the filled part (no copy when the buffer is full)."""
        out = DynamicLayer()
        out.device, out.is_initialized = self.device, self.is_initialized
        out.keys, out.values = self.keys.contiguous(), self.values.contiguous()
        return out


def _reservable(layer) -> bool:
    return (type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None
            and layer.keys.ndim == 4 and layer.keys.numel() > 0)


@contextmanager
def reserved(cache: DynamicCache, room: int, rollback: bool = False) -> Iterator[DynamicCache]:
    """Within the block, ``cache``'s full-attention layers take up to ``room`` more tokens in place
    (``rollback``: and ``crop`` keeps the reservation, module docstring)."""
    if room <= 0:
        yield cache
        return
    swapped = [i for i, layer in enumerate(cache.layers) if _reservable(layer)]
    for i in swapped:
        cache.layers[i] = ReservedLayer(cache.layers[i], room, rollback)
    try:
        yield cache
    finally:
        for i in swapped:
            layer = cache.layers[i]
            if isinstance(layer, ReservedLayer):
                cache.layers[i] = layer.plain()
