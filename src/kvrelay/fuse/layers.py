"""``layers``: relay a subset of layers — the sharer's cache, ridge-mapped, in the receiver layers that use it most.

KVComm-style selective sharing (Shi et al., https://arxiv.org/abs/2510.03346) across two models:
the receiver reads its prompt after a prefix of the sharer's context, and only the chosen layers
hold that prefix; the other layers hold the receiver's own tokens alone (a cache whose layers hold
different token counts, ``kv.cache.to_layered_cache``, attended with each layer's causal pattern
aligned to its own length, ``models.attention.tail_aligned_attention``). Nothing is recomputed:
the unchosen layers simply do not see the context, and the mapping costs only the chosen layers.

Which layers (``select``)::

    importance_t = mean over calibration problems, heads and prompt tokens of the attention the
                   receiver's prompt pays to the mapped context at layer t (anchor slots excluded),
                   with the mapped context held by every layer
    prior_t      = exp(-(t - mu)^2 / (2 sigma^2)),  mu = (L - 1) / 2,  sigma = L / 4
    score_t      = alpha * minmax(importance)_t + (1 - alpha) * prior_t
    chosen       = the round(fraction * L) layers of highest score

The maps themselves are the pair's ridge artefact's (``fuse.ridge``), copied for the chosen layers
only, so a ``layers`` artefact stands alone; its JSON records the ridge artefact's fingerprint,
the calibration problems, the per-layer importance, prior and score. The adapter declares
``partial = True``: its output holds the chosen layers only, and a receiver uses it that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kvrelay.fuse import artefact
from kvrelay.fuse.bridge import TokenBridge
from kvrelay.fuse.ridge import RidgeAdapter, check_source, load_mapped, map_layers
from kvrelay.kv.payload import KVPayload
from kvrelay.models.identity import ModelIdentity

ALPHA = 0.5  # weight of the measured importance against the depth prior


def n_chosen(fraction: float, n_layers: int) -> int:
    """How many of ``n_layers`` a ``fraction`` relays: at least 1, at most all."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return min(n_layers, max(1, round(fraction * n_layers)))


def gaussian_prior(n_layers: int, mu: float | None = None, sigma: float | None = None) -> torch.Tensor:
    """(L,) a Gaussian bump over depth, 1 at ``mu`` (default: the middle layer), width ``sigma`` (L/4)."""
    if n_layers < 1:
        raise ValueError("gaussian_prior needs at least one layer")
    mu = (n_layers - 1) / 2 if mu is None else mu
    sigma = n_layers / 4 if sigma is None else sigma
    t = torch.arange(n_layers, dtype=torch.float64)
    return torch.exp(-((t - mu) ** 2) / (2 * sigma**2))


def scores(importance: torch.Tensor, alpha: float = ALPHA, prior: torch.Tensor | None = None) -> torch.Tensor:
    """(L,) ``alpha`` · min-max-scaled ``importance`` + (1 − ``alpha``) · ``prior`` (``gaussian_prior``)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    imp = importance.double()
    prior = gaussian_prior(len(imp)) if prior is None else prior.double()
    if prior.shape != imp.shape:
        raise ValueError(f"prior has {tuple(prior.shape)} entries for {tuple(imp.shape)} layers")
    span = float(imp.max() - imp.min())
    scaled = (imp - imp.min()) / span if span > 0 else torch.zeros_like(imp)
    return alpha * scaled + (1 - alpha) * prior


def select(score: torch.Tensor, k: int) -> tuple[int, ...]:
    """The ``k`` layers of highest ``score``, in layer order (ties: the shallower layer)."""
    if not 1 <= k <= len(score):
        raise ValueError(f"k must be in 1..{len(score)}, got {k}")
    order = sorted(range(len(score)), key=lambda t: (-float(score[t]), t))
    return tuple(sorted(order[:k]))


@torch.inference_mode()
def prefix_attention(model, mapped: KVPayload, prompt_ids: Sequence[int], skip: int = 0) -> torch.Tensor:
    """(L,) share of the attention ``prompt_ids`` pay to ``mapped``'s slots ``skip..`` when read after it.

    ``mapped``: a complete receiver-space payload (e.g. the ridge map of a sharer reading). Mean over
    query heads and prompt tokens; eager attention for the one forward that returns weights.
    """
    from kvrelay.kv.cache import to_cache
    from kvrelay.models.attention import eager_attention

    if not mapped.meta.complete or mapped.batch_size != 1:
        raise ValueError("prefix_attention takes one complete payload row")
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64)  # (1, q)
    if ids.shape[1] == 0:
        raise ValueError("prefix_attention needs prompt tokens")
    pos = mapped.next_positions[:, None] + torch.arange(ids.shape[1])[None]  # (1, q)
    T = mapped.num_tokens
    with eager_attention(model):
        out = model(input_ids=ids, position_ids=pos, cache=to_cache(mapped, model.config), use_cache=True,
                    output_attentions=True, logits_to_keep=1)
    if out.attentions is None or len(out.attentions) != len(mapped.keys):
        raise RuntimeError("the model returned no per-layer attention weights for output_attentions=True")
    return torch.stack([a[..., skip:T].float().sum(-1).mean() for a in out.attentions])  # a: (1, H, q, T + q)


def importance(receiver_lm, ridge: RidgeAdapter, pairs: Sequence[tuple[KVPayload, Sequence[int]]],
               progress: Callable | None = None) -> torch.Tensor:
    """(L,) mean ``prefix_attention`` over (sharer payload, receiver prompt ids) calibration pairs."""
    if not pairs:
        raise ValueError("importance needs at least one calibration pair")
    total = torch.zeros(receiver_lm.identity.num_layers, dtype=torch.float64)
    skip = len(ridge.anchor_ids)
    for payload, prompt in progress(pairs) if progress else pairs:
        mapped = ridge.adapt(payload, receiver_lm.identity)
        total += prefix_attention(receiver_lm.model, mapped, prompt, skip).double()
    return total / len(pairs)


@dataclass(frozen=True)
class LayersAdapter:
    """The ridge map of the chosen receiver layers as an ``Adapter`` whose output holds those layers only."""

    config: artefact.ArtefactConfig
    tensors: dict = field(repr=False)
    bridge: TokenBridge = field(default_factory=TokenBridge)
    name: str = "layers"
    partial: ClassVar[bool] = True  # the receive path accepts its output without every layer

    @property
    def fingerprint(self) -> str:
        return artefact.digest(self.config, self.tensors)

    @property
    def chosen(self) -> tuple[int, ...]:
        return tuple(self.config.hyper["chosen"])

    @classmethod
    def load(cls, folder, sharer_tokenizer=None, receiver_tokenizer=None) -> LayersAdapter:
        return cls(*load_mapped(folder, "layers", sharer_tokenizer, receiver_tokenizer))

    def adapt(self, payload: KVPayload, receiver: ModelIdentity) -> KVPayload:
        """The chosen receiver layers of ``payload`` mapped (``meta.layer_indices`` = those layers)."""
        check_source(self.config, f"{self.name}@{self.fingerprint[:16]}", payload, receiver)
        if any(receiver.layer_types[t] != "full_attention" for t in self.chosen) or receiver.sliding_window:
            raise ValueError("the layers adapter relays into full-attention receivers only")
        return map_layers(self.config, self.tensors, self.bridge, payload, receiver, self.chosen, self)


def to_artefact(ridge: RidgeAdapter, chosen: Sequence[int], importance_: torch.Tensor, score: torch.Tensor,
                prior: torch.Tensor, alpha: float, fraction: float, calibration: dict) -> tuple[artefact.ArtefactConfig, dict]:
    """The ``layers`` artefact: ``ridge``'s maps for ``chosen`` layers, and how they were chosen."""
    chosen = tuple(int(t) for t in chosen)
    keep = {f"{w}.{t}" for t in chosen for w in ("w_k", "w_v", "anchor_k", "anchor_v")}
    tensors = {k: v for k, v in ridge.tensors.items() if k in keep}
    rc = ridge.config
    config = replace(
        rc, method="layers",
        alignment={**rc.alignment, "layers": f"{rc.alignment.get('layers', '')}; relayed in the chosen receiver "
                   "layers only (the others never see the context)"},
        training={**rc.training, "ridge_fingerprint": ridge.fingerprint, "calibration": calibration},
        metrics={"importance": [round(float(x), 6) for x in importance_], "prior": [round(float(x), 6) for x in prior],
                 "score": [round(float(x), 6) for x in score], "ridge_r2_k": rc.metrics.get("r2_k"),
                 "ridge_r2_v": rc.metrics.get("r2_v")},
        hyper={**rc.hyper, "chosen": list(chosen), "fraction": fraction, "alpha": alpha,
               "prior": "gaussian, mu = (L - 1) / 2, sigma = L / 4",
               "importance": "attention share of the receiver's prompt on the mapped context (anchor slots excluded)"})
    return config, tensors
