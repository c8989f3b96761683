"""A relayed payload as prefix blocks in transformers' continuous batching (CPU, tiny models): the engine
continues without prefilling the context and writes the greedy tokens of plain decoding from the same cache."""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.kv.cache import to_cache
from kvrelay.kv.connector import continue_in_engine
from kvrelay.kv.transforms import zeroed
from kvrelay.models.generate import generate
from tests.conftest import random_ids


def plain(model, p, q, n):
    out = generate(model, to_cache(p, model.config), torch.tensor([q]),
                   torch.arange(p.num_tokens, p.num_tokens + len(q))[None], None, n, set(), pad_id=0)
    return tuple(out.tokens[0, : int(out.lengths[0])].tolist())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_continues_from_injected_blocks(tiny_by_arch, arch):
    lm = tiny_by_arch[arch]
    p = Agent(lm).prefill(random_ids(50, 1))
    q = random_ids(7, 2)
    want = plain(lm.model, p, q, 8)
    got = continue_in_engine(lm.model, p, q, max_new_tokens=8)
    assert got.tokens == want
    assert got.reused_tokens == 48 and got.prefilled_tokens == 2 + 7  # 3 pages of 16 reused; the tail + prompt
    # the engine reads what was injected (zeroed K/V under the same tokens give other tokens): not a prefill
    assert continue_in_engine(lm.model, zeroed(p), q, max_new_tokens=8).tokens != want


def test_a_prefix_filling_most_of_the_cache_is_not_prefilled_again(tiny_by_arch):
    """With the cache sized for the request, a long injected prefix takes most pages; below the scheduler's
    safety margin the engine would evict it and prefill the whole prompt (the same answer, counted at the
    model's forward)."""
    lm = tiny_by_arch["qwen2"]
    p = Agent(lm).prefill(random_ids(800, 3))
    q = random_ids(7, 4)
    got = continue_in_engine(lm.model, p, q, max_new_tokens=4)
    assert got.tokens == plain(lm.model, p, q, 4)
    assert got.reused_tokens == 800 and got.prefilled_tokens == 7  # 50 whole pages of 16 reused


def test_connector_refuses_what_the_engine_cannot_take(tiny_by_arch):
    g = Agent(tiny_by_arch["gemma3"]).prefill(random_ids(20, 1))
    with pytest.raises(ValueError, match="sliding-window"):
        continue_in_engine(tiny_by_arch["gemma3"].model, g, [5], max_new_tokens=2)
    lm = tiny_by_arch["llama"]
    moved = Agent(lm).prefill(random_ids(20, 1), start=5)
    with pytest.raises(ValueError, match="0..T-1"):
        continue_in_engine(lm.model, moved, [5], max_new_tokens=2)
