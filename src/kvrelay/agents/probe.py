"""The runtime switch's signal (``policy.switch``): how much a relayed cache explains the sender's text.

``relay_gain(agent, payload, text_ids)`` = mean negative log-likelihood per token of ``text_ids`` (the
sender's text, e.g. its answer) read by ``agent``'s model *without* the cache minus *with* it (the text
placed right after the cache's tokens). Two forwards of the text only: cheap next to re-reading the context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from kvrelay.kv.cache import to_cache
from kvrelay.kv.payload import KVPayload
from kvrelay.models.generate import forward_all


def _nll(model, ids: Sequence[int], start: int, cache) -> float:
    x = torch.tensor([list(ids)], dtype=torch.int64)  # (1, q)
    pos = torch.arange(start, start + len(ids), dtype=torch.int64)[None]  # (1, q)
    logits = forward_all(model, x, pos, cache, None)  # (1, q, V)
    logp = torch.log_softmax(logits[0, :-1], dim=-1)  # (q-1, V): token t+1 given up to t
    return float(-logp.gather(1, x[0, 1:, None]).mean())


@torch.inference_mode()
def relay_gain(agent, payload: KVPayload, text_ids: Sequence[int]) -> float:
    """NLL/token of ``text_ids`` without the cache minus with it (nats; > 0: the cache explains the text)."""
    if len(text_ids) < 2:
        raise ValueError(f"need at least 2 tokens of the sender's text to score, got {len(text_ids)}")
    model = agent.lm.model
    with_cache = _nll(model, text_ids, payload.num_tokens, to_cache(payload, model.config))
    without = _nll(model, text_ids, 0, DynamicCache(config=model.config))
    return without - with_cache
