"""LMCache's chunks of vLLM's CPU cache: the element rule, bit-exact round trips on tiny-model caches,
and refusals. (That the rule is vLLM's own was checked against a running vLLM + LMCache: docs/layouts.md.)"""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import InvalidInput
from kvrelay.kv.lmcache_chunks import from_chunks, to_chunks
from kvrelay.kv.transforms import select_tokens
from tests.conftest import random_ids


def test_each_element_lands_where_vllms_cpu_cache_keeps_it(tiny_by_arch):
    """Written from the layout's definition, loop by loop: per layer, block and KV head, the block's slab of
    ``block_size`` rows x ``2D`` is the keys as (D, block_size) then the values as (block_size, D)."""
    p = Agent(tiny_by_arch["qwen2"]).prefill(random_ids(19, 3))
    chunk, block = 8, 4
    chunks = to_chunks(p, chunk, block)
    assert len(chunks) == 2  # 19 tokens: two whole chunks of 8, three tokens left over
    L, H, D = len(p.keys), p.keys[0].shape[1], p.keys[0].shape[3]
    for c, x in enumerate(chunks):
        assert x.shape == (L, chunk, H * 2 * D)
        for layer in range(L):
            for b in range(chunk // block):
                for h in range(H):
                    slab = x[layer, b * block:(b + 1) * block, h * 2 * D:(h + 1) * 2 * D].reshape(-1)
                    s = c * chunk + b * block
                    k = p.keys[layer][0, h, s:s + block]  # (block, D)
                    v = p.values[layer][0, h, s:s + block]
                    assert torch.equal(slab[: D * block], k.T.reshape(-1))  # keys column-major
                    assert torch.equal(slab[D * block:], v.reshape(-1))  # values row-major


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip_is_bit_exact_for_the_whole_chunks(tiny_by_arch, arch):
    lm = tiny_by_arch[arch]
    p = Agent(lm).prefill(random_ids(37, 1))
    chunks = to_chunks(p, 16, 8)
    back = from_chunks(chunks, p.token_ids[0].tolist(), p.meta, p.keys[0].shape[1], 8)
    want = select_tokens(p, range(32))
    assert back.meta == want.meta and torch.equal(back.token_ids, want.token_ids)
    assert torch.equal(back.positions, want.positions) and torch.equal(back.mask, want.mask)
    for a, b in zip(back.keys + back.values, want.keys + want.values, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_refuses_what_vllms_cpu_cache_cannot_hold(tiny_by_arch):
    qwen = Agent(tiny_by_arch["qwen2"])
    with pytest.raises(InvalidInput, match="sliding-window"):
        to_chunks(Agent(tiny_by_arch["gemma3"]).prefill(random_ids(20, 1)), 8, 4)
    with pytest.raises(InvalidInput, match="0..T-1"):
        to_chunks(qwen.prefill(random_ids(20, 1), start=4), 8, 4)
    with pytest.raises(InvalidInput, match="multiple of the block size"):
        to_chunks(qwen.prefill(random_ids(20, 1)), 10, 4)
    p = qwen.prefill(random_ids(20, 1))
    from dataclasses import replace

    half = type(p)(tuple(k.bfloat16() for k in p.keys), tuple(v.bfloat16() for v in p.values), p.token_ids,
                   p.positions, p.mask, replace(p.meta, dtype="bfloat16"))
    with pytest.raises(InvalidInput, match="fp32"):
        to_chunks(half, 8, 4)
    with pytest.raises(InvalidInput, match="tokens"):
        from_chunks(to_chunks(p, 8, 4), p.token_ids[0].tolist()[:5], p.meta, p.keys[0].shape[1], 4)
