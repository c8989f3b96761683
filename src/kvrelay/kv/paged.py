"""The paged block layout, exactly: fixed-size blocks of K/V and a block table per sequence.

This is the layout paged-attention engines keep their caches in (vLLM, LMCache's chunks,
transformers' continuous batching): the cache is a pool of physical *blocks* of ``block_size``
token slots; a sequence owns a list of blocks (its *block table*, logical block i -> physical block
id) and its last block may be partly filled. Layouts in this module::

    BlockPool.keys / .values    (L_pool, N_blocks, block_size, H_kv, D)   the layers of one attention kind
    BlockPool.block_table       (B, max_blocks) int64, -1 = no block       per sequence, logical -> physical
    BlockPool.lengths           (B,) int64                                 token slots the pool holds per sequence
    PagedKV.token_ids/positions (sum(seq_lens),) int64                     each sequence's real tokens, concatenated
    PagedKV.seq_lens            (B,) int64

Token slot ``t`` of sequence ``b`` in a pool lives at ``block_table[b, t // block_size]``, offset
``t % block_size`` (per layer, per KV head: ``keys[l, block, offset, h]``). There is no padding in
this layout: each sequence holds exactly its own tokens, so a left-padded batch payload comes back
left-padded with zeros in the padding slots (which no query attends to; ``pad_batch`` writes zeros
there, so its batches round-trip bit-exactly).

Sliding-window layers (``kv.layout``: they hold the last ``window - 1`` slots) form their own pool,
as in vLLM's hybrid allocator and transformers' ``SlidingAttentionCacheAllocator``: a sequence there
owns blocks for its window tail only, and that pool's slot 0 is the tail's first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kv.layout import FULL, SLIDING, held_tokens, is_sliding
from kvrelay.kv.payload import KVPayload, PayloadMeta

NAME = "paged"


@dataclass(frozen=True, slots=True)
class BlockPool:
    """The blocks of one attention kind (``FULL`` or ``SLIDING``) for the held layers ``layers``."""

    kind: str
    layers: tuple[int, ...]  # indices among the payload's *held* layers
    keys: torch.Tensor  # (L_pool, N_blocks, block_size, H_kv, D)
    values: torch.Tensor  # (L_pool, N_blocks, block_size, H_kv, D)
    block_table: torch.Tensor  # (B, max_blocks) int64, -1 = unused
    lengths: torch.Tensor  # (B,) int64

    def __post_init__(self):
        if self.kind not in (FULL, SLIDING):
            raise ValueError(f"pool kind must be {FULL!r} or {SLIDING!r}, got {self.kind!r}")
        if self.keys.ndim != 5 or self.keys.shape != self.values.shape or self.keys.shape[0] != len(self.layers):
            raise ValueError(f"pool {self.kind}: keys {tuple(self.keys.shape)} / values {tuple(self.values.shape)} "
                             f"must be equal (L_pool={len(self.layers)}, N_blocks, block_size, H_kv, D)")
        if self.block_table.ndim != 2 or self.block_table.dtype != torch.int64:
            raise ValueError(f"pool {self.kind}: block_table must be (B, max_blocks) int64, got "
                             f"{tuple(self.block_table.shape)} {self.block_table.dtype}")
        if self.lengths.shape != (self.block_table.shape[0],):
            raise ValueError(f"pool {self.kind}: lengths {tuple(self.lengths.shape)} must be (B,) = "
                             f"({self.block_table.shape[0]},)")
        used = self.block_table[self.block_table >= 0]
        if bool((self.block_table < -1).any()) or (used.numel() and int(used.max()) >= self.num_blocks):
            raise ValueError(f"pool {self.kind}: block ids must be -1 or in [0, {self.num_blocks})")
        if used.numel() != used.unique().numel():
            raise ValueError(f"pool {self.kind}: a physical block is owned twice")
        need = (self.lengths + self.block_size - 1) // self.block_size  # (B,)
        have = (self.block_table >= 0).sum(dim=1)
        if bool((need > have).any()) or bool((self.lengths < 0).any()):
            raise ValueError(f"pool {self.kind}: sequences of {self.lengths.tolist()} tokens need {need.tolist()} "
                             f"blocks of {self.block_size}, their tables hold {have.tolist()}")

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    def gather(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s slots in this pool, (L_pool, H_kv, n, D) keys and values."""
        n = int(self.lengths[b])
        blocks = self.block_table[b, : -(-n // self.block_size)]  # (nb,) physical ids
        L, _, bs, H, D = self.keys.shape

        def pick(t: torch.Tensor) -> torch.Tensor:
            x = t[:, blocks].reshape(L, -1, H, D)[:, :n]  # (L, nb * bs, H, D) -> (L, n, H, D)
            return x.transpose(1, 2)  # (L, H, n, D)

        return pick(self.keys), pick(self.values)


@dataclass(frozen=True, slots=True)
class PagedKV:
    """A payload in the paged layout: one ``BlockPool`` per attention kind held, plus each sequence's tokens."""

    pools: tuple[BlockPool, ...]
    token_ids: torch.Tensor  # (sum(seq_lens),) int64
    positions: torch.Tensor  # (sum(seq_lens),) int64
    seq_lens: torch.Tensor  # (B,) int64
    meta: PayloadMeta

    def __post_init__(self):
        n = int(self.seq_lens.sum())
        if self.token_ids.shape != (n,) or self.positions.shape != (n,):
            raise ValueError(f"token_ids {tuple(self.token_ids.shape)} and positions {tuple(self.positions.shape)} "
                             f"must be (sum(seq_lens),) = ({n},)")
        held = sorted(j for pool in self.pools for j in pool.layers)
        if held != list(range(len(self.meta.layer_indices))):
            raise ValueError(f"pools hold layers {held}, meta lists {len(self.meta.layer_indices)} held layers")
        for pool in self.pools:
            if pool.block_table.shape[0] != self.seq_lens.shape[0]:
                raise ValueError(f"pool {pool.kind} has tables for {pool.block_table.shape[0]} sequences, "
                                 f"seq_lens for {self.seq_lens.shape[0]}")
            if bool((pool.lengths > self.seq_lens).any()):
                raise ValueError(f"pool {pool.kind} holds more slots than its sequences have tokens")

    @property
    def block_size(self) -> int:
        return self.pools[0].block_size

    def pool(self, kind: str) -> BlockPool:
        for p in self.pools:
            if p.kind == kind:
                return p
        raise KeyError(f"no {kind} pool (pools: {[p.kind for p in self.pools]})")


def _pool_kind(meta: PayloadMeta, j: int) -> str:
    return SLIDING if is_sliding(meta.layer_types[j], meta.sliding_window) else FULL


def _build_pool(p: KVPayload, kind: str, layers: list[int], lens: list[int], block_size: int,
                order: torch.Tensor | None) -> BlockPool:
    """Blocks for ``layers`` (all of one kind); row b holds the last ``lens[b]`` slots of each layer."""
    need = [-(-n // block_size) for n in lens]
    total = sum(need)
    ids = torch.arange(total, dtype=torch.int64) if order is None else order[:total]
    table = torch.full((p.batch_size, max(need, default=0)), -1, dtype=torch.int64)
    k0 = p.keys[layers[0]]
    H, D = k0.shape[1], k0.shape[3]
    n_blocks = int(ids.max()) + 1 if total else 0  # the pool's physical size: up to the highest id handed out
    keys = k0.new_zeros((len(layers), n_blocks, block_size, H, D))  # (L_pool, N, bs, H, D)
    values = keys.clone()
    at = 0
    for b, (n, nb) in enumerate(zip(lens, need, strict=True)):
        table[b, :nb] = ids[at:at + nb]
        at += nb
        for i, j in enumerate(layers):
            T_l = p.keys[j].shape[2]
            for src, dst in ((p.keys[j], keys), (p.values[j], values)):
                x = src[b, :, T_l - n:].transpose(0, 1)  # (H, n, D) -> (n, H, D)
                flat = x.new_zeros((nb * block_size, H, D))
                flat[:n] = x
                dst[i, table[b, :nb]] = flat.reshape(nb, block_size, H, D)
    return BlockPool(kind, tuple(layers), keys, values, table, torch.tensor(lens, dtype=torch.int64))


def to_paged(p: KVPayload, block_size: int = 16, *, order: torch.Tensor | None = None) -> PagedKV:
    """``p`` as paged blocks of ``block_size`` slots (left padding dropped; see the module docstring).

    ``order``: the physical block ids to hand out, in allocation order (a permutation of at least as
    many ids as blocks needed); default 0, 1, 2, ... An engine hands out whatever blocks are free, so
    readers must follow the block table, never assume contiguity.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    meta = p.meta
    seq = p.lengths.tolist()  # real tokens per row
    groups: dict[str, list[int]] = {}
    for j in range(len(p.keys)):
        groups.setdefault(_pool_kind(meta, j), []).append(j)
    pools = []
    for kind, layers in groups.items():
        T_l = p.keys[layers[0]].shape[2]
        lens = [min(n, T_l) for n in seq]  # a sliding layer holds the row's last min(n, window - 1) tokens
        if order is not None:
            need = sum(-(-n // block_size) for n in lens)
            if order.ndim != 1 or order.numel() < need or order.unique().numel() != order.numel():
                raise ValueError(f"order must list at least {need} distinct block ids, got {tuple(order.shape)}")
        pools.append(_build_pool(p, kind, layers, lens, block_size, order))
    real = p.mask
    return PagedKV(tuple(pools), p.token_ids[real], p.positions[real], p.lengths.to(torch.int64), meta)


def from_paged(pg: PagedKV) -> KVPayload:
    """The (left-padded) payload of a paged cache; ``KVPayload`` re-checks every shape and the positions."""
    meta = pg.meta
    seq = pg.seq_lens.tolist()
    B, T = len(seq), max(seq, default=0)
    n_layers = len(meta.layer_indices)
    keys: list[torch.Tensor | None] = [None] * n_layers
    values: list[torch.Tensor | None] = [None] * n_layers
    for pool in pg.pools:
        _, _, _, H, D = pool.keys.shape
        for j in pool.layers:
            T_l = held_tokens(meta.layer_types[j], meta.sliding_window, T)
            keys[j] = pool.keys.new_zeros((B, H, T_l, D))  # (B, H, T_l, D)
            values[j] = pool.keys.new_zeros((B, H, T_l, D))
        for b in range(B):
            k, v = pool.gather(b)  # (L_pool, H, n, D)
            n = k.shape[2]
            for i, j in enumerate(pool.layers):
                T_l = keys[j].shape[2]
                keys[j][b, :, T_l - n:] = k[i]
                values[j][b, :, T_l - n:] = v[i]
    token_ids = torch.zeros((B, T), dtype=torch.int64)
    positions = torch.zeros((B, T), dtype=torch.int64)
    mask = torch.zeros((B, T), dtype=torch.bool)
    at = 0
    for b, n in enumerate(seq):
        token_ids[b, T - n:] = pg.token_ids[at:at + n]
        positions[b, T - n:] = pg.positions[at:at + n]
        mask[b, T - n:] = True
        at += n
    return KVPayload(tuple(keys), tuple(values), token_ids, positions, mask, meta)  # type: ignore[arg-type]
