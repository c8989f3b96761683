"""Alignment between two models' caches, as pure functions: layers, KV heads, head dim, RoPE, tokens.

Every cross-model adapter composes these. Shapes (as in ``kv.payload``)::

    keys, values          (B, H, T, D)   one layer's cache
    positions             (B, T)         int64 RoPE positions of those slots
    offsets               [(start, end)] character span of each token in the text it was read from

* **Layers** — a layer map is a tuple ``m`` with ``m[t]`` = the sharer layer receiver layer ``t``
  reads. ``last_aligned`` (C2C's rule: the last layers line up), ``depth_proportional`` (same
  relative depth) and ``learned_layer_map`` (the most similar sharer layer on paired data, by
  linear CKA) make one.
* **KV heads** — ``map_kv_heads`` replicates heads (fewer → a multiple more: GQA → MHA, the
  order transformers' ``repeat_kv`` uses) or averages groups (more → a divisor fewer).
* **Head dim** — ``project_head_dim`` applies a (D_s, D_r) matrix per head; ``pad_head_dim``
  is the parameter-free fallback (truncate, or zero-pad).
* **RoPE** — cached keys are post-RoPE at their own positions. ``strip_rope`` rotates them back
  to pre-RoPE (the rotation by ``-position``), ``apply_rope`` rotates pre-RoPE keys to any
  positions under any rope spec. A map between two models' keys is only meaningful pre-RoPE:
  the two models rotate with different frequencies (and head dims).
* **Tokens** — the receiver's tokenization is the base: ``span_alignment`` maps each receiver
  token to the sharer tokens whose character spans overlap its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.models.identity import RopeSpec

# ---- layers ---------------------------------------------------------------------------------


def _check_counts(n_receiver: int, n_sharer: int) -> None:
    if n_receiver < 1 or n_sharer < 1:
        raise ValueError(f"layer counts must be >= 1, got receiver {n_receiver}, sharer {n_sharer}")


def last_aligned(n_receiver: int, n_sharer: int) -> tuple[int, ...]:
    """Receiver layer ``t`` reads sharer layer ``S - T + t``, clamped to ``0..S-1`` (last layers line up)."""
    _check_counts(n_receiver, n_sharer)
    return tuple(min(max(n_sharer - n_receiver + t, 0), n_sharer - 1) for t in range(n_receiver))


def depth_proportional(n_receiver: int, n_sharer: int) -> tuple[int, ...]:
    """Receiver layer ``t`` reads the sharer layer at the same relative depth: ``round(t (S-1) / (T-1))``."""
    _check_counts(n_receiver, n_sharer)
    if n_receiver == 1:
        return (n_sharer - 1,)
    return tuple(round(t * (n_sharer - 1) / (n_receiver - 1)) for t in range(n_receiver))


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear centred kernel alignment of two feature sets over the same N samples: x (N, Dx), y (N, Dy)."""
    if x.shape[0] != y.shape[0] or x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"need (N, Dx) and (N, Dy) with the same N, got {tuple(x.shape)} and {tuple(y.shape)}")
    x = (x - x.mean(0)).double()
    y = (y - y.mean(0)).double()
    num = (x.T @ y).pow(2).sum()
    den = (x.T @ x).pow(2).sum().sqrt() * (y.T @ y).pow(2).sum().sqrt()
    return float(num / den) if float(den) > 0 else 0.0


def similarity_matrix(receiver_feats: Sequence[torch.Tensor], sharer_feats: Sequence[torch.Tensor]) -> torch.Tensor:
    """(T, S) linear CKA between every receiver layer's features and every sharer layer's (paired rows)."""
    return torch.tensor([[linear_cka(r, s) for s in sharer_feats] for r in receiver_feats], dtype=torch.float64)


def learned_layer_map(similarity: torch.Tensor, *, monotone: bool = True) -> tuple[int, ...]:
    """Sharer layer per receiver layer from a (T, S) similarity: the argmax, or the best monotone path.

    ``monotone`` (default) finds the non-decreasing map with the largest total similarity by dynamic
    programming, so deeper receiver layers never read shallower sharer layers than earlier ones.
    """
    if similarity.ndim != 2 or 0 in similarity.shape:
        raise ValueError(f"similarity must be a non-empty (T, S) matrix, got {tuple(similarity.shape)}")
    if not monotone:
        return tuple(int(i) for i in similarity.argmax(dim=1))
    T, S = similarity.shape
    best = similarity[0].clone().double()  # (S,) best total ending at sharer layer s
    back = torch.zeros(T, S, dtype=torch.long)
    for t in range(1, T):
        run_max, run_arg = best.clone(), torch.arange(S)
        for s in range(1, S):  # prefix maximum: best path of t-1 layers ending at <= s
            if run_max[s - 1] >= run_max[s]:
                run_max[s], run_arg[s] = run_max[s - 1], run_arg[s - 1]
        back[t] = run_arg
        best = run_max + similarity[t].double()
    path = [int(best.argmax())]
    for t in range(T - 1, 0, -1):
        path.append(int(back[t, path[-1]]))
    return tuple(reversed(path))


# ---- KV heads and head dim ------------------------------------------------------------------


def map_kv_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, H_s, T, D) -> (B, n_heads, T, D): replicate each head (n_heads = r·H_s) or average groups (H_s = g·n_heads).

    Replication gives receiver heads ``h·r .. h·r + r - 1`` source head ``h`` (exact for a receiver
    whose ``k_proj``/``v_proj`` rows are repeated the same way). Grouping averages source heads
    ``j·g .. j·g + g - 1`` into receiver head ``j`` (the mean-pooling used to convert MHA to GQA).
    """
    if x.ndim != 4:
        raise ValueError(f"expected (B, H, T, D), got {tuple(x.shape)}")
    h = x.shape[1]
    if n_heads == h:
        return x
    if n_heads > h and n_heads % h == 0:
        return x.repeat_interleave(n_heads // h, dim=1)
    if n_heads < h and h % n_heads == 0:
        B, _, T, D = x.shape
        return x.reshape(B, n_heads, h // n_heads, T, D).mean(dim=2)
    raise ValueError(f"cannot map {h} KV heads to {n_heads}: one count must be a multiple of the other "
                     "(use a fitted map such as the ridge adapter for other ratios)")


def project_head_dim(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, T, D_s) @ weight -> (B, H, T, D_r); ``weight`` (D_s, D_r) shared or (H, D_s, D_r) per head."""
    if x.ndim != 4:
        raise ValueError(f"expected (B, H, T, D), got {tuple(x.shape)}")
    if weight.shape[-2] != x.shape[-1] or weight.ndim not in (2, 3) or (weight.ndim == 3 and weight.shape[0] != x.shape[1]):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit input {tuple(x.shape)}: "
                         "expected (D_s, D_r) or (H, D_s, D_r)")
    w = weight.to(x.dtype)
    out = torch.einsum("bhtd,de->bhte", x, w) if w.ndim == 2 else torch.einsum("bhtd,hde->bhte", x, w)
    if bias is not None:
        out = out + (bias.to(x.dtype)[None, :, None, :] if bias.ndim == 2 else bias.to(x.dtype))
    return out


def pad_head_dim(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, H, T, D_s) -> (B, H, T, head_dim): keep the first dims, or zero-pad (no parameters)."""
    d = x.shape[-1]
    if head_dim <= d:
        return x[..., :head_dim]
    return torch.cat((x, x.new_zeros(*x.shape[:-1], head_dim - d)), dim=-1)


# ---- RoPE -----------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate ``keys`` (B, H, T, D) by ``positions`` (B, T) under ``spec`` (float64 inside, dtype kept).

    On pre-RoPE keys this is what the model's attention does; with negated positions it undoes it.
    The rotary dims are the first ``spec.rotary_dim``, paired as ``(x_i, x_{i + r/2})`` (transformers).
    """
    B, _, T, D = keys.shape
    r = spec.rotary_dim
    if r > D:
        raise ValueError(f"rotary dim {r} exceeds head dim {D}")
    if tuple(positions.shape) != (B, T):
        raise ValueError(f"positions must be (B, T) = ({B}, {T}), got {tuple(positions.shape)}")
    angle = positions.to(torch.float64)[..., None] * spec.inv_freq_tensor()  # (B, T, r/2)
    angle = torch.cat((angle, angle), dim=-1)[:, None]  # (B, 1, T, r)
    k = keys[..., :r].to(torch.float64)
    k = k * angle.cos() + _rotate_half(k) * angle.sin()
    return torch.cat((k.to(keys.dtype), keys[..., r:]), dim=-1)


def strip_rope(keys: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Post-RoPE ``keys`` cached at ``positions`` -> pre-RoPE keys (the inverse rotation)."""
    return apply_rope(keys, -positions, spec)


def held_positions(positions: torch.Tensor, held: int) -> torch.Tensor:
    """Positions (B, held) of a layer that holds the last ``held`` of T slots (sliding layers hold a tail)."""
    return positions[:, positions.shape[1] - held:]


# ---- tokens across vocabularies -------------------------------------------------------------


def token_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` (no special tokens added) and each token's character span, from a fast tokenizer."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("token alignment needs a fast tokenizer (character offsets)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def span_alignment(receiver_offsets: Sequence[tuple[int, int]],
                   sharer_offsets: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """For each receiver token, the indices of the sharer tokens covering its character span, in order.

    A sharer token covers a receiver token when their spans overlap. A receiver token no sharer
    token overlaps (an empty span) takes the nearest earlier sharer token, so every receiver token
    maps to at least one sharer token; causally the last of them has read the whole span.
    """
    if not sharer_offsets:
        raise ValueError("the sharer read no tokens: nothing to align to")
    r = torch.tensor(list(receiver_offsets), dtype=torch.int64).reshape(-1, 2)  # (T_r, 2)
    s = torch.tensor(list(sharer_offsets), dtype=torch.int64).reshape(-1, 2)  # (T_s, 2)
    overlap = (s[None, :, 1] > r[:, None, 0]) & (s[None, :, 0] < r[:, None, 1])  # (T_r, T_s)
    started = s[None, :, 0] <= r[:, None, 0]  # (T_r, T_s) sharer token starts at or before
    out = []
    for i in range(r.shape[0]):
        hits = overlap[i].nonzero().flatten().tolist()
        if not hits:
            earlier = started[i].nonzero().flatten().tolist()
            hits = [earlier[-1] if earlier else 0]
        out.append(tuple(hits))
    return tuple(out)


def last_of_spans(alignment: Sequence[Sequence[int]]) -> torch.Tensor:
    """(T_r,) int64: the last sharer token of each receiver token's span (the one that has read all of it)."""
    return torch.tensor([span[-1] for span in alignment], dtype=torch.int64)
