"""Greedy generation as a ladder of small steps: prefill -> decode_one_token -> decode_n_tokens.

``choose`` (optional) replaces the argmax with another token chooser, e.g. ``models.sampling.Sampler``.

Positions are explicit (``position_ids``, one global counter across agents) and the attention
mask is explicit (B, cached + new) whenever a batch is padded. We drive the model through its
public ``forward(cache=..., position_ids=..., attention_mask=...)``; nothing is patched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrelay.models.reserve import reserved


@dataclass(frozen=True, slots=True)
class Decoded:
    tokens: torch.Tensor  # (B, N) int64, generated tokens (stop token included when hit; pad_id after)
    lengths: torch.Tensor  # (B,) tokens generated per row, stop token excluded
    prefill_s: float  # the prefill forward (= time to first token, the argmax is free)
    decode_s: float
    mask: torch.Tensor | None  # (B, cached + new) after decoding, or None when nothing was padded
    next_positions: torch.Tensor  # (B,) position the next token of each row would take
    # per layer (keys, values) right after the prefill (B, H, T_l, D), when asked for (``keep_prefill``)
    prefill_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    speculation: object | None = None  # ``models.speculative.SpecStats`` when decoded speculatively


@torch.inference_mode()
def forward_last(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache,
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
    """One forward over ``input_ids`` (B, q) that appends to ``cache``; returns last-position logits (B, V)."""
    out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, attention_mask=attention_mask,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float()


@torch.inference_mode()
def forward_all(model, input_ids, position_ids, cache, attention_mask) -> torch.Tensor:
    """Like ``forward_last`` but returns logits for every new position (B, q, V) (tests, scoring)."""
    out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, attention_mask=attention_mask,
                use_cache=True)
    return out.logits.float()


@torch.inference_mode()
def decode_n_tokens(model, cache: DynamicCache, first_logits: torch.Tensor, next_positions: torch.Tensor,
                    mask: torch.Tensor | None, max_new_tokens: int, stop_ids: set[int], pad_id: int = 0,
                    min_new_tokens: int = 0, on_token: Callable[[torch.Tensor], None] | None = None,
                    choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    forward: Callable[..., torch.Tensor] = forward_last,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy decode from ``first_logits`` (B, V); rows that hit a stop token keep emitting ``pad_id``.

    Stop tokens are suppressed (their logits set to -inf) for the first ``min_new_tokens`` steps.
    ``choose`` maps (B, V) logits to (B,) tokens in place of the argmax (seeded sampling).
    ``on_token`` sees each step's tokens (B,) as soon as they are chosen (streaming servers).
    ``forward``: each step's forward, ``forward_last``'s signature (one that also keeps each step's
    attention weights: ``kv.evict.answer_probe``). The last token chosen is not run through it.
    Tokens and the padded mask are preallocated; the stop check stays on tensors (no Python lists); the
    cache's room for the decoded tokens is reserved up front (``models.reserve``), so a step writes in place.
    """
    B = first_logits.shape[0]
    done = torch.zeros(B, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.int64)
    out = torch.full((B, max(max_new_tokens, 0)), pad_id, dtype=torch.int64)  # (B, N)
    pad = torch.full((B,), pad_id, dtype=torch.int64)
    logits = first_logits
    pos = next_positions.clone()[:, None]  # (B, 1)
    stops = torch.tensor(sorted(i for i in stop_ids if i < first_logits.shape[-1]), dtype=torch.int64)
    cached = 0 if mask is None else mask.shape[1]
    full_mask = None
    if mask is not None:  # (B, cached + N): the slots decoding will add are real tokens
        full_mask = torch.cat((mask, torch.ones(B, max(max_new_tokens - 1, 0), dtype=torch.bool)), dim=1)
    n = 0
    with reserved(cache, max_new_tokens - 1 if max_new_tokens > 2 else 0):  # room for every token decode appends
        for step in range(max_new_tokens):
            if step < min_new_tokens and len(stops):
                logits = logits.index_fill(1, stops, float("-inf"))  # (B, V)
            tok = torch.where(done, pad, logits.argmax(dim=-1) if choose is None else choose(logits))  # (B,)
            out[:, step] = tok
            if on_token is not None:
                on_token(tok)
            n = step + 1
            is_stop = torch.isin(tok, stops) & ~done
            lengths += (~done & ~is_stop).long()
            done |= is_stop
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            step_mask = None if full_mask is None else full_mask[:, : cached + step + 1]  # (B, cached + step + 1)
            logits = forward(model, tok[:, None], pos, cache, step_mask)
            pos = pos + 1
    mask = None if full_mask is None else full_mask[:, : cached + max(n - 1, 0)]
    return out[:, :n], lengths, mask


def generate(model, cache: DynamicCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, max_new_tokens: int, stop_ids: set[int], pad_id: int = 0,
             min_new_tokens: int = 0, keep_prefill: bool = False,
             on_token: Callable[[torch.Tensor], None] | None = None, drafter=None,
             history: list[int] | None = None, choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
             ) -> Decoded:
    """Prefill ``input_ids`` (B, q) at ``position_ids`` (B, q) after ``cache``; then greedy decode.

    ``keep_prefill``: also return the cache's tensors as they were after the prefill (no copy: a
    cache layer's update concatenates into new tensors and never writes into the old ones).
    ``drafter`` (one unpadded row): decode speculatively (``models.speculative``) with drafts checked
    against ``history``, every token the cache holds after the prefill; the tokens are the same.
    ``choose``: a token chooser in place of the argmax (``decode_n_tokens``); not with ``drafter``.
    """
    t0 = time.perf_counter()
    logits = forward_last(model, input_ids, position_ids, cache, attention_mask)
    kept = tuple((layer.keys, layer.values) for layer in cache.layers) if keep_prefill else None
    t1 = time.perf_counter()
    stats = None
    if drafter is not None and choose is not None:
        raise ValueError("speculative decoding checks drafts against the argmax; it does not sample")
    if drafter is not None:
        from kvrelay.models.speculative import speculative_decode

        if input_ids.shape[0] != 1 or attention_mask is not None or history is None:
            raise ValueError("speculative decoding takes one unpadded row and the history its cache holds")
        spec = speculative_decode(model, cache, history, logits, int(position_ids[0, -1]) + 1, drafter,
                                  max_new_tokens, stop_ids, min_new_tokens, on_token)
        tokens = torch.tensor([spec.tokens], dtype=torch.int64).reshape(1, -1)  # (1, N)
        lengths, mask, stats = torch.tensor([spec.length]), None, spec.stats
    else:
        tokens, lengths, mask = decode_n_tokens(model, cache, logits, position_ids[:, -1] + 1, attention_mask,
                                                max_new_tokens, stop_ids, pad_id, min_new_tokens, on_token, choose)
    t2 = time.perf_counter()
    return Decoded(tokens, lengths, t1 - t0, t2 - t1, mask, position_ids[:, -1] + 1 + tokens.shape[1] - 1, kept,
                   stats)
