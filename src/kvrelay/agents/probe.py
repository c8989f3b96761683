"""The runtime switch's signal (``policy.switch``): how much a relayed cache explains the sender's text.

``relay_gain(agent, payload, text_ids)`` = mean negative log-likelihood per token of ``text_ids`` (the
sender's text, e.g. its answer) read by ``agent``'s model *without* the cache minus *with* it (the text
placed right after the cache's tokens). Two forwards of the text only: cheap next to re-reading the context.
``upto=n`` scores it after the cache's first ``n`` tokens instead — a workflow's whole-turn payload holds the
sender's answer too, so its probe cuts the cache where the answer starts (``payload_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import DynamicCache

from kvrelay.core.errors import InvalidInput
from kvrelay.kv.cache import to_cache
from kvrelay.kv.payload import KVPayload
from kvrelay.models.generate import forward_all


def _nll(model, ids: Sequence[int], start: int, cache) -> float:
    x = torch.tensor([list(ids)], dtype=torch.int64)  # (1, q)
    pos = torch.arange(start, start + len(ids), dtype=torch.int64)[None]  # (1, q)
    logits = forward_all(model, x, pos, cache, None)  # (1, q, V)
    logp = torch.log_softmax(logits[0, :-1], dim=-1)  # (q-1, V): token t+1 given up to t
    return float(-logp.gather(1, x[0, 1:, None]).mean())


def can_cut(p: KVPayload, n: int) -> bool:
    """Whether ``payload_prefix(p, n)`` exists: one row, 1 <= n <= its tokens, and (below its length) every
    sliding-window layer still holding every token."""
    if p.batch_size != 1 or not 1 <= n <= p.num_tokens:
        return False
    return n == p.num_tokens or all(p.held_tokens(i) == p.num_tokens for i in range(len(p.keys)))


def payload_prefix(p: KVPayload, n: int) -> KVPayload:
    """The cache of ``p``'s first ``n`` token slots (one row). A sliding-window layer can be cut only while it
    still holds every token (``num_tokens`` within its window): past that its head is gone."""
    if p.batch_size != 1 or not 1 <= n <= p.num_tokens:
        raise InvalidInput(f"a prefix of {n} tokens of a {p.batch_size}-row, {p.num_tokens}-token payload",
                           "one row and 1 <= n <= its tokens")
    if n == p.num_tokens:
        return p
    if not can_cut(p, n):
        raise InvalidInput(f"a {p.num_tokens}-token payload whose sliding-window layers dropped its head",
                           f"a payload within its {p.meta.sliding_window}-token window, or full-attention layers")
    return replace(p, keys=tuple(k[:, :, :n] for k in p.keys), values=tuple(v[:, :, :n] for v in p.values),
                   token_ids=p.token_ids[:, :n], positions=p.positions[:, :n], mask=p.mask[:, :n])


@torch.inference_mode()
def relay_gain(agent, payload: KVPayload, text_ids: Sequence[int], *, upto: int | None = None) -> float:
    """NLL/token of ``text_ids`` without the cache minus with it (nats; > 0: the cache explains the text).

    ``upto``: use only the cache's first ``upto`` tokens (``payload_prefix``)."""
    if len(text_ids) < 2:
        raise ValueError(f"need at least 2 tokens of the sender's text to score, got {len(text_ids)}")
    if upto is not None:
        payload = payload_prefix(payload, upto)
    model = agent.lm.model
    with_cache = _nll(model, text_ids, int(payload.next_positions[0]), to_cache(payload, model.config))
    without = _nll(model, text_ids, 0, DynamicCache(config=model.config))
    return without - with_cache
