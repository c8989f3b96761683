"""Flash [B, T, H_kv, D] and paged-block layouts: bit-exact round trips on real tiny-model caches.

Block size 3 with 10 context tokens: the full-attention pool's last block holds one token (10 = 3·3 + 1),
and on gemma3 (window 8, sliding layers hold 7 slots = 2·3 + 1) the sliding pool's last block too.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.kv.flash import from_flash, to_flash
from kvrelay.kv.layout import FULL, SLIDING
from kvrelay.kv.paged import BlockPool, from_paged, to_paged
from kvrelay.kv.transforms import pad_batch
from tests.conftest import random_ids


def same(a, b) -> None:
    assert a.meta == b.meta
    for x, y in ((a.token_ids, b.token_ids), (a.positions, b.positions), (a.mask, b.mask),
                 *zip(a.keys, b.keys, strict=True), *zip(a.values, b.values, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)  # bit-exact


@pytest.fixture(scope="module")
def payloads(tiny_by_arch):
    out = {}
    for arch, lm in tiny_by_arch.items():
        a = Agent(lm)
        out[arch] = (a.prefill(random_ids(10, 1)), a.prefill(random_ids(5, 2), start=3))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_flash_round_trip_is_bit_exact(payloads, arch):
    p, _ = payloads[arch]
    f = to_flash(p)
    for k, kf in zip(p.keys, f.keys, strict=True):
        B, H, T_l, D = k.shape
        assert kf.shape == (B, T_l, H, D) and kf.is_contiguous()
        assert torch.equal(kf[:, 2, 1], k[:, 1, 2])  # token 2, head 1: the axes are swapped, not reshaped
    same(from_flash(f), p)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_paged_round_trip_last_block_one_token(payloads, arch):
    p, _ = payloads[arch]
    pg = to_paged(p, block_size=3)
    full = pg.pool(FULL)
    assert int(full.lengths[0]) == 10 and (full.block_table[0] >= 0).sum() == 4  # 3 full blocks + 1 token
    assert torch.equal(full.keys[0, full.block_table[0, 3], 0], p.keys[full.layers[0]][0, :, 9])  # the lone token
    assert not full.keys[:, full.block_table[0, 3], 1:].any()  # the rest of that block is empty
    if arch == "gemma3":
        sl = pg.pool(SLIDING)
        assert sl.layers == (0, 1, 3, 4) and full.layers == (2, 5)
        assert int(sl.lengths[0]) == 7 and (sl.block_table[0] >= 0).sum() == 3  # the window tail: 2 blocks + 1
    else:
        assert [q.kind for q in pg.pools] == [FULL]
    same(from_paged(pg), p)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_paged_follows_the_block_table(payloads, arch):
    """Blocks handed out in a shuffled order: the table, not the storage order, says where a token is."""
    p, _ = payloads[arch]
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    pg = to_paged(p, block_size=4, order=order)
    assert pg.pools[0].block_table[0, 0] == order[0]
    same(from_paged(pg), p)
    swapped = pg.pools[0].block_table.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    bad = BlockPool(pg.pools[0].kind, pg.pools[0].layers, pg.pools[0].keys, pg.pools[0].values, swapped,
                    pg.pools[0].lengths)
    wrong = from_paged(type(pg)((bad, *pg.pools[1:]), pg.token_ids, pg.positions, pg.seq_lens, pg.meta))
    assert not torch.equal(wrong.keys[bad.layers[0]], p.keys[bad.layers[0]])


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_paged_padded_batch_round_trip(payloads, arch):
    long, short = payloads[arch]
    batch = pad_batch([long, short])  # left-padded with zeros
    pg = to_paged(batch, block_size=3)
    assert pg.seq_lens.tolist() == [10, 5] and pg.token_ids.shape == (15,)
    same(from_paged(pg), batch)
    same(from_flash(to_flash(batch)), batch)


def test_paged_refuses_inconsistent_tables(payloads):
    p, _ = payloads["llama"]
    pool = to_paged(p, block_size=4).pools[0]
    table = pool.block_table.clone()
    table[0, 1] = table[0, 0]
    with pytest.raises(ValueError, match="owned twice"):
        BlockPool(pool.kind, pool.layers, pool.keys, pool.values, table, pool.lengths)
    with pytest.raises(ValueError, match="need"):
        BlockPool(pool.kind, pool.layers, pool.keys, pool.values, pool.block_table[:, :2], pool.lengths)
    with pytest.raises(ValueError, match="block_size must be"):
        to_paged(p, block_size=0)
