"""Offline profile of how far a sender's K/V drift from a receiver's, layer by layer, for one model pair.

``profile_pair`` prefills the same token sequences on both models and records, per layer, the
relative deviation ``||K_s - K_r|| / ||K_r||`` (and the same for V), averaged over the sequences.
The profile is an artefact (JSON) keyed by both fingerprints; ``block(k)`` picks the contiguous
``k``-layer block where the deviation *grows* most (DroidSpeak's "critical layers",
arXiv 2411.02820), which ``recompute:layers=auto:K`` recomputes (``fuse.repair``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvrelay.core.errors import IncompatiblePayload


@dataclass(frozen=True, slots=True)
class DeviationProfile:
    sender: str  # fingerprint
    receiver: str  # fingerprint
    k_dev: tuple[float, ...]  # (L,) mean relative key deviation per layer
    v_dev: tuple[float, ...]  # (L,) mean relative value deviation per layer
    sequences: int
    tokens: int  # total tokens profiled

    def __post_init__(self):
        if len(self.k_dev) != len(self.v_dev) or not self.k_dev:
            raise ValueError("k_dev and v_dev must be non-empty and of equal length")

    @property
    def num_layers(self) -> int:
        return len(self.k_dev)

    @property
    def deviation(self) -> tuple[float, ...]:
        return tuple((k + v) / 2 for k, v in zip(self.k_dev, self.v_dev, strict=True))

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def block(self, k: int) -> tuple[int, int]:
        """Inclusive ``(a, b)``, ``b - a + 1 == k``: the block over which deviation rises most."""
        if not 1 <= k <= self.num_layers:
            raise ValueError(f"block size must be in 1..{self.num_layers}, got {k}")
        d = (0.0, *self.deviation)
        best = max(range(self.num_layers - k + 1), key=lambda a: (d[a + k] - d[a], -a))
        return best, best + k - 1

    def require_pair(self, sender: str, receiver: str) -> None:
        for field, mine, theirs in (("model_fingerprint", self.sender, sender), ("receiver", self.receiver, receiver)):
            if mine != theirs:
                raise IncompatiblePayload(field, mine, theirs, "the deviation profile was made for another model pair")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path


def load_profile(path: str | Path) -> DeviationProfile:
    try:
        d = json.loads(Path(path).read_text())
        return DeviationProfile(d["sender"], d["receiver"], tuple(d["k_dev"]), tuple(d["v_dev"]),
                                int(d["sequences"]), int(d["tokens"]))
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a deviation profile (expected JSON with sender, receiver, k_dev, v_dev, "
                         f"sequences, tokens): {err}") from err


def _kv(model, ids: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = torch.arange(ids.shape[1])[None]  # (1, T)
    model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]  # per layer (1, H_kv, T, D)


@torch.inference_mode()
def profile_pair(sender, receiver, sequences: Sequence[Sequence[int]]) -> DeviationProfile:
    """Per-layer relative K/V deviation of ``sender`` vs ``receiver`` (loaded models) over ``sequences``."""
    if not sequences:
        raise ValueError("need at least one token sequence to profile")
    k_sum = v_sum = None
    tokens = 0
    for seq in sequences:
        ids = torch.tensor([list(seq)], dtype=torch.int64)  # (1, T)
        s_kv, r_kv = _kv(sender.model, ids), _kv(receiver.model, ids)
        k = torch.tensor([float((ks - kr).norm() / kr.norm()) for (ks, _), (kr, _) in zip(s_kv, r_kv, strict=True)])
        v = torch.tensor([float((vs - vr).norm() / vr.norm()) for (_, vs), (_, vr) in zip(s_kv, r_kv, strict=True)])
        k_sum = k if k_sum is None else k_sum + k
        v_sum = v if v_sum is None else v_sum + v
        tokens += ids.shape[1]
    n = len(sequences)
    return DeviationProfile(sender.identity.fingerprint, receiver.identity.fingerprint,
                            tuple(round(float(x) / n, 6) for x in k_sum), tuple(round(float(x) / n, 6) for x in v_sum),
                            n, tokens)
