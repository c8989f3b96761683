"""Greedy generation as a ladder of small steps: prefill -> decode_one_token -> decode_n_tokens.

Positions are explicit (``position_ids``, one global counter across agents) and the attention
mask is explicit (B, cached + new) whenever a batch is padded. We drive the model through its
public ``forward(cache=..., position_ids=..., attention_mask=...)``; nothing is patched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass(frozen=True, slots=True)
class Decoded:
    tokens: torch.Tensor  # (B, N) int64, generated tokens (stop token included when hit; pad_id after)
    lengths: torch.Tensor  # (B,) tokens generated per row, stop token excluded
    prefill_s: float  # the prefill forward (= time to first token, the argmax is free)
    decode_s: float
    mask: torch.Tensor | None  # (B, cached + new) after decoding, or None when nothing was padded
    next_positions: torch.Tensor  # (B,) position the next token of each row would take


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


def decode_n_tokens(model, cache: DynamicCache, first_logits: torch.Tensor, next_positions: torch.Tensor,
                    mask: torch.Tensor | None, max_new_tokens: int, stop_ids: set[int], pad_id: int = 0,
                    min_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy decode from ``first_logits`` (B, V); rows that hit a stop token keep emitting ``pad_id``.

    Stop tokens are suppressed (their logits set to -inf) for the first ``min_new_tokens`` steps.
    """
    B = first_logits.shape[0]
    done = torch.zeros(B, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.int64)
    out = []
    logits = first_logits
    pos = next_positions.clone()
    stops = torch.tensor(sorted(i for i in stop_ids if i < first_logits.shape[-1]), dtype=torch.int64)
    for step in range(max_new_tokens):
        if step < min_new_tokens and len(stops):
            logits = logits.index_fill(1, stops, float("-inf"))  # (B, V)
        tok = logits.argmax(dim=-1)  # (B,)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        out.append(tok)
        is_stop = torch.tensor([int(t) in stop_ids for t in tok.tolist()])
        lengths += (~done & ~is_stop).long()
        done |= is_stop
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if mask is not None:
            mask = torch.cat((mask, torch.ones(B, 1, dtype=torch.bool)), dim=1)  # (B, cached + 1)
        logits = forward_last(model, tok[:, None], pos[:, None], cache, mask)
        pos = pos + 1
    tokens = torch.stack(out, dim=1) if out else torch.zeros(B, 0, dtype=torch.int64)
    return tokens, lengths, mask


def generate(model, cache: DynamicCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, max_new_tokens: int, stop_ids: set[int], pad_id: int = 0,
             min_new_tokens: int = 0) -> Decoded:
    """Prefill ``input_ids`` (B, q) at ``position_ids`` (B, q) after ``cache``; then greedy decode."""
    t0 = time.perf_counter()
    logits = forward_last(model, input_ids, position_ids, cache, attention_mask)
    t1 = time.perf_counter()
    tokens, lengths, mask = decode_n_tokens(model, cache, logits, position_ids[:, -1] + 1, attention_mask,
                                            max_new_tokens, stop_ids, pad_id, min_new_tokens)
    t2 = time.perf_counter()
    return Decoded(tokens, lengths, t1 - t0, t2 - t1, mask, position_ids[:, -1] + 1 + tokens.shape[1] - 1)
