"""From a sharer's payload to the receiver's tokens of the same text, and the cache features of both.

The receiver's tokenization is the base. With one tokenizer (same ``tokenizer_hash``) the receiver
reads exactly the sharer's tokens. With two, the sharer's tokens are decoded (special tokens kept,
so ChatML markers survive), the text is re-encoded by the receiver's fast tokenizer, and each
receiver token is aligned to the sharer tokens covering its character span
(``align.span_alignment``); it reads the features of the *last* of them, the one whose cache has
seen the whole span.

``read`` prefills token ids into a payload with the model's public forward (no ``Agent``: this
layer sits below the agents), used to collect paired caches for fitting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrelay.fuse import align
from kvrelay.kv.cache import from_cache
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.models.generate import forward_last
from kvrelay.models.identity import ModelIdentity


@dataclass(frozen=True)
class TokenBridge:
    """Receiver tokens for a sharer token sequence, and which sharer slot each receiver slot reads."""

    sharer_tokenizer: object | None = None  # None: one tokenizer (receiver reads the sharer's tokens)
    receiver_tokenizer: object | None = None

    @classmethod
    def between(cls, sharer_hash: str, receiver_hash: str, sharer_tokenizer=None, receiver_tokenizer=None,
                what: str = "this pair") -> TokenBridge:
        """The bridge for a model pair, by their tokenizer hashes: none when they are equal, else one over
        both tokenizers (``ValueError`` naming ``what`` when either is missing)."""
        if sharer_hash == receiver_hash:
            return cls()
        if sharer_tokenizer is None or receiver_tokenizer is None:
            raise ValueError(f"{what} crosses tokenizers: pass both models' tokenizers")
        return cls(sharer_tokenizer, receiver_tokenizer)

    @classmethod
    def for_models(cls, sharer_lm, receiver_lm) -> TokenBridge:
        """``between`` two loaded models (``LoadedModel``: ``identity`` and ``tokenizer``)."""
        return cls.between(sharer_lm.identity.tokenizer_hash, receiver_lm.identity.tokenizer_hash,
                           sharer_lm.tokenizer, receiver_lm.tokenizer)

    @property
    def same(self) -> bool:
        return self.sharer_tokenizer is None

    def receiver_reading(self, sharer_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """(receiver token ids, (T_r,) int64 index of the sharer slot each reads)."""
        if self.same:
            return list(sharer_ids), torch.arange(len(sharer_ids), dtype=torch.int64)
        text = self.sharer_tokenizer.decode(sharer_ids, skip_special_tokens=False)
        s_offsets = self._sharer_offsets(sharer_ids, text)
        r_ids, r_offsets = align.token_offsets(self.receiver_tokenizer, text)
        return r_ids, align.last_of_spans(align.span_alignment(r_offsets, s_offsets))

    def _sharer_offsets(self, ids: list[int], text: str) -> list[tuple[int, int]]:
        again, offsets = align.token_offsets(self.sharer_tokenizer, text)
        if again == list(ids):
            return offsets
        out, end = [], 0  # not the canonical tokenization: spans by incremental decoding
        for i in range(len(ids)):
            new_end = len(self.sharer_tokenizer.decode(ids[: i + 1], skip_special_tokens=False))
            out.append((end, max(new_end, end)))
            end = max(new_end, end)
        return out


def read(model, identity: ModelIdentity, ids: list[int], producer: str = "fit") -> KVPayload:
    """Prefill ``ids`` at positions 0.. into a payload of ``model`` (one forward, no generation)."""
    ids_t = torch.tensor([ids], dtype=torch.int64)  # (1, T)
    pos = torch.arange(len(ids), dtype=torch.int64)[None]  # (1, T)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        forward_last(model, ids_t, pos, cache, None)
    return from_cache(cache, ids_t, pos, torch.ones_like(ids_t, dtype=torch.bool),
                      PayloadMeta.from_identity(identity, producer=producer))


def pre_rope_kv(p: KVPayload, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held layer ``layer`` of ``p`` with RoPE stripped from the keys: (B, H, T_l, D) each."""
    spec = p.meta.rope_for(p.meta.layer_types[layer])
    k = p.keys[layer]
    return align.strip_rope(k.float(), align.held_positions(p.positions, k.shape[2]), spec), p.values[layer].float()


def flat_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H·D)."""
    B, H, T, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, T, H * D)


def unflat_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, H·D) -> (B, H, T, D)."""
    B, T, F = x.shape
    return x.reshape(B, T, n_heads, F // n_heads).permute(0, 2, 1, 3)


def sharer_features(p: KVPayload, layer: int) -> torch.Tensor:
    """(B, T, 2·H_s·D_s): pre-RoPE keys and values of one sharer layer, heads flattened, side by side."""
    if p.keys[layer].shape[2] != p.num_tokens:
        raise ValueError(f"sharer layer {p.meta.layer_indices[layer]} holds a sliding window "
                         f"({p.keys[layer].shape[2]} of {p.num_tokens} slots); map full-attention layers only")
    k, v = pre_rope_kv(p, layer)
    return torch.cat((flat_heads(k), flat_heads(v)), dim=-1)
