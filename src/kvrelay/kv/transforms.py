"""Pure transforms ``KVPayload -> KVPayload``.

Nothing here mutates its input or decides anything: the audit arms, codecs and relay layouts
are all compositions of these functions. Layout (see ``payload.py``): keys/values per held
layer ``(B, H_kv, T_l, D)``; token_ids/positions/mask ``(B, T)``; sliding layers hold the last
``T_l = min(T, window - 1)`` slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kvrelay.kv.layout import held_tokens
from kvrelay.kv.payload import DTYPES, KVPayload, dtype_name
from kvrelay.kv.rope import rotate_keys


def _with(p: KVPayload, keys=None, values=None, **fields) -> KVPayload:
    return replace(p, keys=tuple(keys) if keys is not None else p.keys,
                   values=tuple(values) if values is not None else p.values, **fields)


# -- structure -------------------------------------------------------------------------------
def select_layers(p: KVPayload, layers: Sequence[int]) -> KVPayload:
    """Keep the held layers at the given *model* layer indices (order preserved as given, sorted)."""
    wanted = sorted(set(int(i) for i in layers))
    pos = {li: j for j, li in enumerate(p.meta.layer_indices)}
    missing = [i for i in wanted if i not in pos]
    if missing:
        raise ValueError(f"layers {missing} are not held by this payload (holds {list(p.meta.layer_indices)})")
    idx = [pos[i] for i in wanted]
    meta = replace(p.meta, layer_indices=tuple(wanted), layer_types=tuple(p.meta.layer_types[j] for j in idx))
    return _with(p, [p.keys[j] for j in idx], [p.values[j] for j in idx], meta=meta)


def select_tokens(p: KVPayload, index: torch.Tensor | Sequence[int]) -> KVPayload:
    """Keep the slots ``index`` (sorted, unique, same for every row); positions are kept, so gaps are allowed.

    Sliding-window layers hold only the tail; the slots they must hold after selection are the
    last ``min(T', window - 1)`` kept ones, and those must lie inside the tail they already hold.
    """
    index = torch.as_tensor(index, dtype=torch.int64)
    T = p.num_tokens
    if index.ndim != 1 or index.numel() == 0:
        raise ValueError(f"index must be a non-empty 1-D list of slots, got shape {tuple(index.shape)}")
    if bool((index[1:] <= index[:-1]).any()) or int(index[0]) < 0 or int(index[-1]) >= T:
        raise ValueError(f"index must be strictly increasing slots in [0, {T}), got {index.tolist()[:8]}...")
    keys, values = [], []
    T_new = index.numel()
    for j, (k, v) in enumerate(zip(p.keys, p.values, strict=True)):
        held = p.held_tokens(j)
        if held == T:
            sel = index
        else:
            need = index[-held_tokens(p.meta.layer_types[j], p.meta.sliding_window, T_new):]
            start = T - held
            if int(need[0]) < start:
                raise ValueError(
                    f"layer {p.meta.layer_indices[j]} is a sliding-window layer holding slots {start}..{T - 1}; "
                    f"the selection needs slot {int(need[0])}, which it never cached"
                )
            sel = need - start
        keys.append(k[:, :, sel])  # (B, H, T'_l, D)
        values.append(v[:, :, sel])
    return _with(p, keys, values, token_ids=p.token_ids[:, index], positions=p.positions[:, index],
                 mask=p.mask[:, index])


def shift_positions(p: KVPayload, delta: int | torch.Tensor) -> KVPayload:
    """Move the payload by ``delta`` positions (int or (B,)): keys re-rotated per layer type, positions += delta.

    Exact for a cache moved as a whole: attention between relayed tokens depends only on their
    position differences, which a common shift preserves.
    """
    d = torch.as_tensor(delta, dtype=torch.int64)
    d = d.expand(p.batch_size).clone() if d.ndim == 0 else d
    if d.shape != (p.batch_size,):
        raise ValueError(f"delta must be an int or shape ({p.batch_size},), got {tuple(d.shape)}")
    new_pos = torch.where(p.mask, p.positions + d[:, None], p.positions)
    if bool((new_pos[p.mask] < 0).any()):
        raise ValueError(f"shift by {d.tolist()} would move tokens to negative positions")
    keys = [rotate_keys(k, d, p.meta.rope_for(lt)) for k, lt in zip(p.keys, p.meta.layer_types, strict=True)]
    return _with(p, keys, None, positions=new_pos)


def concat(a: KVPayload, b: KVPayload) -> KVPayload:
    """``b``'s tokens appended after ``a``'s (a growing conversation); ``b`` must have no padding."""
    if a.meta.model_fingerprint != b.meta.model_fingerprint or a.meta.layer_indices != b.meta.layer_indices:
        raise ValueError("concat needs payloads of the same model and layers")
    if a.batch_size != b.batch_size:
        raise ValueError(f"batch sizes differ: {a.batch_size} vs {b.batch_size}")
    if not bool(b.mask.all()):
        raise ValueError("the appended payload must not be padded (padding would land mid-sequence)")
    if bool((b.positions[:, 0] <= a.next_positions - 1).any()):
        raise ValueError("the appended payload's positions must come after the first payload's")
    T = a.num_tokens + b.num_tokens
    keys, values = [], []
    for j in range(len(a.keys)):
        held = held_tokens(a.meta.layer_types[j], a.meta.sliding_window, T)
        keys.append(torch.cat((a.keys[j], b.keys[j]), dim=2)[:, :, -held:])  # (B, H, T_l, D)
        values.append(torch.cat((a.values[j], b.values[j]), dim=2)[:, :, -held:])
    return _with(a, keys, values, token_ids=torch.cat((a.token_ids, b.token_ids), 1),
                 positions=torch.cat((a.positions, b.positions), 1), mask=torch.cat((a.mask, b.mask), 1),
                 meta=replace(a.meta, round=max(a.meta.round, b.meta.round), producer=b.meta.producer or a.meta.producer))


def pad_batch(payloads: Sequence[KVPayload]) -> KVPayload:
    """Stack payloads of different lengths into one batch, left-padded (mask False on padding)."""
    if not payloads:
        raise ValueError("pad_batch needs at least one payload")
    first = payloads[0]
    for q in payloads[1:]:
        for f in ("model_fingerprint", "layer_indices", "dtype", "codec"):
            if getattr(q.meta, f) != getattr(first.meta, f):
                raise ValueError(f"cannot batch payloads whose {f} differ")
    T = max(q.num_tokens for q in payloads)

    def left(t: torch.Tensor, n: int, fill) -> torch.Tensor:  # pad dim -1 (or -2 for 4-D) on the left
        if t.ndim == 4:
            pad = t.new_zeros((*t.shape[:2], n - t.shape[2], t.shape[3]))
            return torch.cat((pad, t), dim=2)
        return torch.cat((torch.full((t.shape[0], n - t.shape[1]), fill, dtype=t.dtype), t), dim=1)

    keys, values = [], []
    for j in range(len(first.keys)):
        held = held_tokens(first.meta.layer_types[j], first.meta.sliding_window, T)
        keys.append(torch.cat([left(q.keys[j], held, 0) for q in payloads], 0))  # (B, H, T_l, D)
        values.append(torch.cat([left(q.values[j], held, 0) for q in payloads], 0))
    return _with(first, keys, values,
                 token_ids=torch.cat([left(q.token_ids, T, 0) for q in payloads], 0),
                 positions=torch.cat([left(q.positions, T, 0) for q in payloads], 0),
                 mask=torch.cat([left(q.mask, T, False) for q in payloads], 0),
                 meta=replace(first.meta, round=max(q.meta.round for q in payloads)))


def unpad_row(p: KVPayload, row: int) -> KVPayload:
    """Row ``row`` of a batch, with its left padding removed."""
    n = int(p.mask[row].sum())
    T = p.num_tokens
    keys, values = [], []
    for j, (k, v) in enumerate(zip(p.keys, p.values, strict=True)):
        held = p.held_tokens(j)
        keep = min(held, n) if held < T else n
        keys.append(k[row:row + 1, :, held - keep:])
        values.append(v[row:row + 1, :, held - keep:])
    return _with(p, keys, values, token_ids=p.token_ids[row:row + 1, T - n:],
                 positions=p.positions[row:row + 1, T - n:], mask=p.mask[row:row + 1, T - n:])


def to_dtype(p: KVPayload, dtype: torch.dtype | str) -> KVPayload:
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return _with(p, [k.to(dt) for k in p.keys], [v.to(dt) for v in p.values],
                 meta=replace(p.meta, dtype=dtype_name(dt)))


# -- interventions (the audit's arms) --------------------------------------------------------
def _valid(p: KVPayload, j: int) -> torch.Tensor:
    """(B, 1, T_l, 1) bool: which cached slots of layer j are real tokens."""
    return p.mask[:, -p.held_tokens(j):][:, None, :, None]


def zeroed(p: KVPayload) -> KVPayload:
    return _with(p, [torch.zeros_like(k) for k in p.keys], [torch.zeros_like(v) for v in p.values])


def _row_moments(t: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std per row over valid slots; t (B, H, T, D), valid (B, 1, T, 1) -> (B, 1, 1, 1) each."""
    w = valid.to(torch.float64).expand_as(t)
    n = w.sum(dim=(1, 2, 3), keepdim=True).clamp_min(1)
    x = t.to(torch.float64)
    mean = (x * w).sum(dim=(1, 2, 3), keepdim=True) / n
    var = (((x - mean) ** 2) * w).sum(dim=(1, 2, 3), keepdim=True) / n
    return mean, var.sqrt()


def moment_matched_random(p: KVPayload, generator: torch.Generator | None = None) -> KVPayload:
    """Gaussian K/V with the mean and std of the real ones, per example, layer and K/V."""
    def draw(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        mean, std = _row_moments(t, valid)
        z = torch.randn(t.shape, generator=generator, dtype=torch.float64)
        return (mean + std * z).to(t.dtype) * valid.to(t.dtype)

    keys = [draw(k, _valid(p, j)) for j, k in enumerate(p.keys)]
    values = [draw(v, _valid(p, j)) for j, v in enumerate(p.values)]
    return _with(p, keys, values)


def layer_rms(t: torch.Tensor, valid: torch.Tensor) -> float:
    w = valid.to(torch.float64).expand_as(t)
    return float(((t.to(torch.float64) ** 2 * w).sum() / w.sum().clamp_min(1)).sqrt())


def with_noise(p: KVPayload, sigma: float, generator: torch.Generator | None = None) -> KVPayload:
    """Add Gaussian noise with std ``sigma × RMS`` of each layer's K (resp. V) over real slots."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")

    def noisy(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        scale = sigma * layer_rms(t, valid)
        z = torch.randn(t.shape, generator=generator, dtype=torch.float64)
        return (t.to(torch.float64) + scale * z * valid).to(t.dtype)

    return _with(p, [noisy(k, _valid(p, j)) for j, k in enumerate(p.keys)],
                 [noisy(v, _valid(p, j)) for j, v in enumerate(p.values)])
