"""Selective recompute of a relayed cache with the receiver's weights: the mechanism behind ``fuse.repair``.

A plan says: recompute layers ``0..F-1`` for every relayed token, then a fraction of the tokens —
those whose K/V moved most at layer ``F-1`` — in the layers after (CacheBlend, arXiv 2405.16444);
the other tokens keep the relayed K/V. It runs in two passes, both through the receiver's own
modules, never patched:

1. **Layers 0..F-1 over the whole row.** When ``F`` is every layer, one call of the decoder's public
   forward: the receiver's own prefill, bit for bit. Otherwise the decoder layers are called in turn
   as that forward calls them — embeddings, the rotary embedding computed once for the row, the
   mask ``transformers.masking_utils.create_causal_mask`` gives a prefill (none under SDPA, so its
   causal kernel runs) — and the pass stops after layer ``F-1``. An exact prefix (the receiver's own
   cache of its first tokens, e.g. its role prompt in the replace layout) rides along as queries so
   that the row is a plain causal prefill; its stored K/V are kept, after a check that they are what
   the receiver computes for those tokens.
2. **The chosen tokens through the decoder's public forward**, at their own positions, over a cache
   holding every slot's K/V (fresh in layers ``< F``, relayed after) and one ``(1, 1, k, T + k)``
   additive mask: a chosen token attends to the unchosen slots before it and to the fresh K/V of the
   chosen ones up to itself; its stale relayed copy is masked out. The public forward starts at layer
   0, so layers ``< F`` are computed again for the chosen tokens (``F·k`` token × layer forwards
   beyond the budget, reported in ``RepairStats.cost``).

``budget`` counts recomputed (relayed token × layer) forwards over all of them; ``cost`` counts what
the two passes really ran (exact prefix and the chosen tokens' second trip through layers ``< F``
included), on the same scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvrelay.core.errors import IncompatiblePayload
from kvrelay.kv.cache import to_cache
from kvrelay.kv.payload import KVPayload

PREFIX_RTOL = 1e-3  # stored vs recomputed K/V of an exact prefix: relative norm of the difference


@dataclass(frozen=True, slots=True)
class RecomputePlan:
    """What to recompute: layers ``0..full_layers-1`` for all relayed tokens, then ``fraction`` of them."""

    full_layers: int
    fraction: float = 0.0

    def __post_init__(self):
        if self.full_layers < 0:
            raise ValueError(f"full_layers must be >= 0, got {self.full_layers}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        if 0.0 < self.fraction < 1.0 and self.full_layers == 0:
            raise ValueError("choosing tokens needs at least one fully recomputed layer to measure deviation on")

    def chosen(self, num_tokens: int) -> int:
        return math.ceil(self.fraction * num_tokens) if self.fraction > 0 else 0

    def budget(self, num_layers: int, num_tokens: int) -> float:
        """Recomputed share of (relayed token × layer) forwards."""
        if self.fraction >= 1.0:
            return 1.0
        full = min(self.full_layers, num_layers)
        return (full * num_tokens + (num_layers - full) * self.chosen(num_tokens)) / max(1, num_layers * num_tokens)


@dataclass(frozen=True, slots=True)
class RepairStats:
    budget: float  # recomputed share of (relayed token × layer) forwards
    full_layers: int
    chosen: tuple[int, ...]  # slots recomputed after the full layers (all relayed slots when every layer is full)
    cost: float = 0.0  # token × layer forwards the passes ran, over (relayed tokens × layers)


def _check_recomputable(model, p: KVPayload, exact_prefix: int) -> None:
    if p.batch_size != 1 or not bool(p.mask.all()):
        raise ValueError("selective recompute takes one unpadded row")
    if not p.meta.complete or p.meta.sliding_window is not None or "sliding_attention" in p.meta.layer_types:
        raise IncompatiblePayload("layer_types", "full attention, every layer held", p.meta.layer_types,
                                  "selective recompute handles full-attention models with every layer held")
    if len(model.get_decoder().layers) != len(p.keys):
        raise IncompatiblePayload("num_model_layers", len(model.get_decoder().layers), len(p.keys))
    if not 0 <= exact_prefix < p.num_tokens:
        raise ValueError(f"exact_prefix must leave relayed tokens: got {exact_prefix} of {p.num_tokens}")
    pos = p.positions[0]
    if not torch.equal(pos, torch.arange(int(pos[0]), int(pos[0]) + p.num_tokens, dtype=pos.dtype)):
        raise ValueError("selective recompute takes a row at consecutive positions")


def _decoder_layers(model, p: KVPayload, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``0..layers-1`` the (keys, values) (1, H_kv, T, D) the receiver's prefill of ``p``'s
    tokens at ``p``'s positions computes."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    dec = model.get_decoder()
    cache = DynamicCache(config=model.config)
    if layers >= len(dec.layers):
        dec(input_ids=p.token_ids, position_ids=p.positions, cache=cache, use_cache=True)
    else:
        h = model.get_input_embeddings()(p.token_ids)  # (1, T, H)
        mask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=None, cache=cache)
        rotary = dec.rotary_emb(h, p.positions)
        for layer in range(layers):
            h = dec.layers[layer](h, attention_mask=mask, position_ids=p.positions, cache=cache, use_cache=True,
                                  position_embeddings=rotary)
            h = h[0] if isinstance(h, tuple) else h
    return [(c.keys, c.values) for c in cache.layers[:layers]]


def _check_prefix(fresh, p: KVPayload, exact_prefix: int) -> None:
    for layer, (k, v) in enumerate(fresh):
        for name, new, old in (("keys", k, p.keys[layer]), ("values", v, p.values[layer])):
            a, b = new[:, :, :exact_prefix], old[:, :, :exact_prefix]  # (1, H_kv, s, D)
            if float((a - b).norm()) > PREFIX_RTOL * float(b.norm()) + 1e-6:
                raise ValueError(f"slots 0..{exact_prefix - 1} are not the receiver's own cache of those tokens "
                                 f"(layer {layer} {name} differ from its prefill); pass exact_prefix=0 to "
                                 "recompute them as relayed tokens")


def _token_mask(positions: torch.Tensor, pick: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, k, T + k) additive mask: chosen token i sees unchosen slots before it and chosen ones up to itself.

    positions (T,) of the row; pick (k,) chosen slots in increasing order.
    """
    q_pos = positions[pick]  # (k,)
    ctx = positions[None, :] < q_pos[:, None]  # (k, T)
    ctx[:, pick] = False  # a chosen slot's relayed K/V is replaced by its fresh copy
    fresh = q_pos[None, :] <= q_pos[:, None]  # (k, k)
    allowed = torch.cat((ctx, fresh), dim=1)  # (k, T + k)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _chosen_pass(model, p: KVPayload, pick: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh (keys, values) (1, H_kv, k, D) per layer of the chosen slots ``pick`` (k,) over ``p``'s cache."""
    cache = to_cache(p, model.config)
    T = p.num_tokens
    dtype = model.get_input_embeddings().weight.dtype
    model.get_decoder()(input_ids=p.token_ids[:, pick], position_ids=p.positions[:, pick], cache=cache,
                        attention_mask=_token_mask(p.positions[0], pick, dtype), use_cache=True)
    return [(c.keys[:, :, T:], c.values[:, :, T:]) for c in cache.layers]


def _deviation(k_new, v_new, k_old, v_old) -> torch.Tensor:
    """Per token squared K/V change, (q,): inputs (1, H_kv, q, D)."""
    return ((k_new - k_old) ** 2).sum(dim=(0, 1, 3)) + ((v_new - v_old) ** 2).sum(dim=(0, 1, 3))


@torch.inference_mode()
def selective_recompute(model, p: KVPayload, plan: RecomputePlan, *,
                        exact_prefix: int = 0) -> tuple[KVPayload, RepairStats]:
    """``p`` with slots ``exact_prefix..T-1`` recomputed by ``model`` as ``plan`` says (meta unchanged).

    Slots ``0..exact_prefix-1`` must be the receiver's own cache of their tokens: they are attended
    to and kept as stored (a stored prefix that differs from the receiver's prefill is a ValueError).
    """
    _check_recomputable(model, p, exact_prefix)
    L, T = len(p.keys), p.num_tokens
    s, n = exact_prefix, T - exact_prefix
    full = L if plan.fraction >= 1.0 else min(plan.full_layers, L)
    if full == 0:
        return p, RepairStats(0.0, 0, ())
    fresh = _decoder_layers(model, p, full)
    if s:
        _check_prefix(fresh, p, s)
    keys, values = list(p.keys), list(p.values)
    for layer, (k, v) in enumerate(fresh):  # relayed slots take the fresh K/V, the prefix keeps its own
        keys[layer] = torch.cat((p.keys[layer][:, :, :s], k[:, :, s:].to(p.keys[layer].dtype)), dim=2)
        values[layer] = torch.cat((p.values[layer][:, :, :s], v[:, :, s:].to(p.values[layer].dtype)), dim=2)
    chosen = tuple(range(s, T)) if full == L else ()
    cost = full * T / (L * n)
    if full < L and plan.fraction > 0.0:
        last = full - 1
        dev = _deviation(keys[last][:, :, s:], values[last][:, :, s:], p.keys[last][:, :, s:], p.values[last][:, :, s:])
        pick = s + dev.topk(plan.chosen(n)).indices.sort().values  # (k,) slots, increasing
        new = _chosen_pass(model, replace(p, keys=tuple(keys), values=tuple(values)), pick)
        for layer in range(full, L):
            keys[layer] = keys[layer].index_copy(2, pick, new[layer][0].to(keys[layer].dtype))  # (1, H_kv, T, D)
            values[layer] = values[layer].index_copy(2, pick, new[layer][1].to(values[layer].dtype))
        chosen = tuple(int(x) for x in pick)
        cost += L * len(chosen) / (L * n)
    stats = RepairStats(plan.budget(L, n), full, chosen, round(cost, 6))
    return replace(p, keys=tuple(keys), values=tuple(values)), stats


# -- the same passes, for a receiver that checks a payload instead of repairing it (agents.verify) --
def check_recomputable(model, p: KVPayload) -> None:
    """ValueError / IncompatiblePayload unless ``p`` is one unpadded full-attention row ``model`` can recompute."""
    _check_recomputable(model, p, 0)


def prefill_kv(model, p: KVPayload, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) (1, H_kv, T, D) per layer ``0..layers-1`` of ``model``'s own prefill of ``p``'s tokens."""
    return _decoder_layers(model, p, layers)


def chosen_kv(model, p: KVPayload, pick: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh (keys, values) (1, H_kv, k, D) per layer of slots ``pick`` (k,), increasing, computed in one
    forward over ``p``'s cache (each chosen token attends to the relayed K/V before it)."""
    return _chosen_pass(model, p, pick)
