"""RoPE re-rotation of cached keys.

transformers' rotary convention (llama, qwen2, gemma3): the first ``rotary_dim`` dims of a head
are split in two halves and rotated as pairs ``(x_i, x_{i + r/2})`` by the angle
``position * inv_freq[i]``. Rotations compose, so a key cached at position ``p`` becomes the key
at ``p + Δ`` by one more rotation through ``Δ * inv_freq`` — exact up to float rounding, with no
need to recover the pre-RoPE key. (Any attention scaling factor was applied at production time
and is preserved by a pure rotation.)
"""

from __future__ import annotations

import torch

from kvrelay.models.identity import RopeSpec


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate post-RoPE ``keys`` (B, H, T, D) by ``delta`` positions; ``delta`` is (B,) int64.

    Computed in float64 and cast back, so a shift adds no more error than the cache's own dtype.
    """
    B, _, _, D = keys.shape
    r = spec.rotary_dim
    if r > D:
        raise ValueError(f"rotary dim {r} exceeds head dim {D}")
    if delta.shape != (B,):
        raise ValueError(f"delta must be (B,) = ({B},), got {tuple(delta.shape)}")
    angle = delta.to(torch.float64)[:, None] * spec.inv_freq_tensor()[None, :]  # (B, r/2)
    angle = torch.cat((angle, angle), dim=-1)[:, None, None, :]  # (B, 1, 1, r)
    cos, sin = angle.cos(), angle.sin()
    k_rot = keys[..., :r].to(torch.float64)  # (B, H, T, r)
    k_rot = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat((k_rot.to(keys.dtype), keys[..., r:]), dim=-1)
