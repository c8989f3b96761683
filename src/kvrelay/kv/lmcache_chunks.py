"""LMCache's chunks of vLLM's CPU cache, exactly: what its multiprocess server stores for vLLM's CPU build.

vLLM's CPU attention backend keeps one tensor per layer, ``(N_blocks, H_kv, block_size, 2 * D)``
(vLLM 0.32's "LBHNC" layout), and for one (block, KV head) the ``block_size * 2 * D`` values are the
keys *column-major* — ``(D, block_size)``, the layout its vectorised kernel reads in fp32 — followed by
the values row-major, ``(block_size, D)``. LMCache 0.5.6 registers that cache as one fused plane and
stores a chunk of ``chunk_tokens`` tokens (256 by default) as one tensor::

    chunk   (L, chunk_tokens, H_kv * 2 * D)
    chunk[l, b * block_size + t, h * 2D:(h + 1) * 2D] = cache[l][block b of the chunk, h, t, :]

so, per block and head, the ``block_size`` rows of width ``2D`` hold the flat keys-then-values run.
Checked against the real thing (docs/layouts.md): the chunks vLLM stored for a prompt unpack to the K/V
kvrelay computes for the same tokens (fp32, to 4e-5), and chunks packed here give vLLM a cache hit with
the greedy answer of re-reading the text.

Only whole chunks exist in LMCache (a key covers ``0..n * chunk_tokens``); ``to_chunks`` packs the
payload's whole chunks and says how many tokens they hold. The bf16 kernel on CPUs with AMX packs keys
in tiles instead; this module writes the fp32 layout only and refuses other dtypes.
"""

from __future__ import annotations

import torch

from kvrelay.core.errors import InvalidInput
from kvrelay.kv.payload import KVPayload, PayloadMeta

NAME = "lmcache_vllm_cpu"
CHUNK_TOKENS = 256  # LMCache's default chunk
BLOCK_SIZE = 128  # vLLM's CPU block size (its default)


def _check(p: KVPayload, chunk_tokens: int, block_size: int) -> None:
    if chunk_tokens % block_size:
        raise InvalidInput(f"chunks of {chunk_tokens} tokens over blocks of {block_size}",
                           "a chunk size that is a multiple of the block size (LMCache requires it)")
    if p.batch_size != 1 or not bool(p.mask.all()) or not p.meta.complete:
        raise InvalidInput("a padded, batched or layer-subset payload", "one unpadded row holding every layer")
    if not torch.equal(p.positions[0], torch.arange(p.num_tokens)):
        raise InvalidInput("a payload whose positions are not 0..T-1", "positions 0..T-1: LMCache keys a chunk by "
                           "the tokens before it, from the first")
    if any(t != "full_attention" for t in p.meta.layer_types):
        raise InvalidInput("a model with sliding-window layers", "full-attention layers (vLLM's CPU cache here)")
    if p.keys[0].dtype != torch.float32:
        raise InvalidInput(f"a {p.keys[0].dtype} payload", "fp32 K/V (vLLM's CPU kernel packs bf16 keys differently)")


def to_chunks(p: KVPayload, chunk_tokens: int = CHUNK_TOKENS, block_size: int = BLOCK_SIZE) -> list[torch.Tensor]:
    """The payload's whole chunks, each ``(L, chunk_tokens, H_kv * 2 * D)``; ``len(result) * chunk_tokens``
    of its tokens (the rest is no whole chunk: a receiver prefills it)."""
    _check(p, chunk_tokens, block_size)
    K = torch.stack([k[0] for k in p.keys])  # (L, H, T, D)
    V = torch.stack([v[0] for v in p.values])
    L, H, T, D = K.shape
    out = []
    for c in range(T // chunk_tokens):
        nb = chunk_tokens // block_size
        k = K[:, :, c * chunk_tokens:(c + 1) * chunk_tokens].reshape(L, H, nb, block_size, D)
        v = V[:, :, c * chunk_tokens:(c + 1) * chunk_tokens].reshape(L, H, nb, block_size, D)
        run = torch.cat((k.transpose(3, 4).reshape(L, H, nb, -1), v.reshape(L, H, nb, -1)), 3)  # (L, H, nb, 2*D*bs)
        out.append(run.reshape(L, H, nb, block_size, 2 * D).permute(0, 2, 3, 1, 4).reshape(L, chunk_tokens, H * 2 * D))
    return out


def from_chunks(chunks: list[torch.Tensor], token_ids, meta: PayloadMeta, num_kv_heads: int,
                block_size: int = BLOCK_SIZE) -> KVPayload:
    """A payload of the tokens the chunks hold (the first ``sum(chunk tokens)`` of ``token_ids``)."""
    if not chunks:
        raise InvalidInput("no chunks", "at least one LMCache chunk")
    x = torch.cat(chunks, 1)  # (L, n, H * 2 * D)
    L, n, width = x.shape
    H = num_kv_heads
    if width % (2 * H) or n % block_size or len(token_ids) < n or L != len(meta.layer_indices):
        raise InvalidInput(f"chunks of shape {tuple(chunks[0].shape)} for {len(token_ids)} tokens, {len(meta.layer_indices)} "
                           f"layers, {H} KV heads", "(layers, tokens, KV heads * 2 * head dim) over these tokens")
    D = width // (2 * H)
    nb = n // block_size
    run = x.reshape(L, nb, block_size, H, 2 * D).permute(0, 3, 1, 2, 4).reshape(L, H, nb, 2 * D * block_size)
    k = run[..., : D * block_size].reshape(L, H, nb, D, block_size).transpose(3, 4).reshape(L, H, n, D)
    v = run[..., D * block_size:].reshape(L, H, n, D)
    ids = torch.tensor([list(token_ids)[:n]], dtype=torch.int64)  # (1, n)
    return KVPayload(tuple(k[i][None].contiguous() for i in range(L)), tuple(v[i][None].contiguous() for i in range(L)),
                     ids, torch.arange(n)[None], torch.ones_like(ids, dtype=torch.bool), meta)
