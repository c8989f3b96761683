"""Content-addressed payload keys and the prefix index behind ``PayloadStore.longest_prefix``.

A token sequence is hashed in blocks of ``BLOCK_TOKENS``, each hash chained to the one before
(as nano-vllm's block manager and LMCache's chunk hashes do)::

    h_0 = sha256("kvrelay/1" || model fingerprint)
    h_i = sha256(h_{i-1} || tokens of block i as int64 little-endian)

so ``h_i`` names the whole prefix ``tokens[: i * BLOCK_TOKENS]`` of that model, and a sequence
whose length is not a multiple of the block size ends with one more, shorter, block. A
payload's key is the chain hash of its whole sequence, written ``kvrelay/1:<fp[:16]>:<hash>``.

The prefix index maps a *boundary* hash ``h_i`` to entries ``(key, tail)``: "the stored payload
``key`` covers this prefix plus the tokens ``tail``". Looking a query up walks its own chain, so
it costs one index probe per block of the query.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.kv.layout import any_sliding
from kvrelay.kv.payload import KVPayload

SCHEME = "kvrelay/1"
BLOCK_TOKENS = 16

Tokens = Sequence[int] | torch.Tensor


def _as_ints(token_ids: Tokens) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.ndim != 1:
            raise ValueError(f"token ids must be one sequence (T,) or (1, T), got {tuple(token_ids.shape)}")
        return token_ids.to(torch.int64).numpy().astype("<i8", copy=False)
    return np.asarray(list(token_ids), dtype="<i8")


def _seed(fingerprint: str) -> bytes:
    if not fingerprint:
        raise ValueError("a key needs the model fingerprint")
    return hashlib.sha256(f"{SCHEME}\0{fingerprint}".encode()).digest()


def _step(prev: bytes, block: np.ndarray) -> bytes:
    return hashlib.sha256(prev + block.tobytes()).digest()


@dataclass(frozen=True, slots=True)
class ChainHashes:
    """One pass over a token sequence's chain: what a put needs (its key, its index entries, its hash)."""

    boundaries: tuple[str, ...]  # h_0 .. h_m at every full-block boundary i * block (m = T // block)
    full: str  # the whole sequence's hash (its last, partial, block included); h_m when T is a multiple


def chain_hashes(fingerprint: str, token_ids: Tokens, block: int = BLOCK_TOKENS, *, with_full: bool = True) -> ChainHashes:
    """The chain of ``token_ids``, each block hashed once. ``with_full=False`` skips the partial last block
    (``full`` is then "" when there is one): a lookup needs only the boundaries."""
    ids = _as_ints(token_ids)
    h = _seed(fingerprint)
    out = [h.hex()]
    m = len(ids) // block
    for i in range(m):
        h = _step(h, ids[i * block:(i + 1) * block])
        out.append(h.hex())
    if m * block == len(ids):
        return ChainHashes(tuple(out), out[-1])
    return ChainHashes(tuple(out), _step(h, ids[m * block:]).hex() if with_full else "")


def block_hashes(fingerprint: str, token_ids: Tokens, block: int = BLOCK_TOKENS) -> list[str]:
    """``[h_0, h_1, ..., h_m]`` at every full-block boundary ``i * block`` (``m = T // block``)."""
    return list(chain_hashes(fingerprint, token_ids, block, with_full=False).boundaries)


def sequence_hash(fingerprint: str, token_ids: Tokens, block: int = BLOCK_TOKENS) -> str:
    """The chain hash of the whole sequence (its last, partial, block included)."""
    ids = _as_ints(token_ids)
    if len(ids) == 0:
        raise ValueError("cannot key an empty token sequence")
    return chain_hashes(fingerprint, ids, block).full


@dataclass(frozen=True, slots=True)
class PayloadKey:
    fingerprint_prefix: str  # first 16 hex digits of the model fingerprint (for humans and sharding)
    chain_hash: str  # 64 hex digits

    def __str__(self) -> str:
        return f"{SCHEME}:{self.fingerprint_prefix}:{self.chain_hash}"


def _is_hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdef" for c in s)


def parse_key(key: str) -> PayloadKey:
    """``kvrelay/1:<16 hex>:<64 hex>`` -> ``PayloadKey``; ``ValueError`` saying what was expected otherwise."""
    parts = key.split(":")
    if len(parts) != 3 or parts[0] != SCHEME or not _is_hex(parts[1], 16) or not _is_hex(parts[2], 64):
        raise ValueError(f"not a payload key: {key!r}; expected '{SCHEME}:<16 hex fingerprint>:<64 hex hash>'")
    return PayloadKey(parts[1], parts[2])


def key_for(fingerprint: str, token_ids: Tokens, block: int = BLOCK_TOKENS) -> str:
    return str(PayloadKey(fingerprint[:16], sequence_hash(fingerprint, token_ids, block)))


def single_sequence(p: KVPayload) -> torch.Tensor | None:
    """The payload's tokens (T,) when it is one unpadded sequence, else None (batches have no key)."""
    if p.batch_size != 1 or not bool(p.mask.all()):
        return None
    return p.token_ids[0]


def payload_chain(p: KVPayload, block: int = BLOCK_TOKENS) -> ChainHashes | None:
    """The chain of a single, unpadded payload's tokens (None for a batch or a padded one): computed once per
    put, it gives the key (``payload_key``), the index entries (``prefix_entries``) and the whole hash."""
    ids = single_sequence(p)
    if ids is None:
        return None
    if ids.numel() == 0:
        raise ValueError("cannot key an empty token sequence")
    return chain_hashes(p.meta.model_fingerprint, ids, block)


def payload_key(p: KVPayload, block: int = BLOCK_TOKENS, *, hashes: ChainHashes | None = None) -> str:
    """The content address of a single, unpadded payload: model fingerprint + chain hash of its tokens.
    ``hashes``: its ``payload_chain``, when the caller has it."""
    hashes = payload_chain(p, block) if hashes is None else hashes
    if hashes is None:
        raise ValueError(f"only a single unpadded sequence has a content key (batch {p.batch_size}, "
                         f"{int((~p.mask).sum())} padding slots); pick your own key for batches")
    return str(PayloadKey(p.meta.model_fingerprint[:16], hashes.full))


# -- prefix index ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PrefixEntry:
    """Stored payload ``key`` covers the prefix its boundary hash names, then the tokens ``tail``.

    ``cuttable``: the payload can be cut after any of its tokens (only full-attention layers), so
    a query sharing just the start of ``tail`` still reuses it; otherwise the whole tail must match.
    """

    key: str
    start: int  # tokens before the boundary (a multiple of the block size)
    tail: tuple[int, ...]  # the stored tokens after the boundary (at most one block when cuttable)
    cuttable: bool
    full_hash: str  # the payload's whole-sequence hash: a key reused for other tokens invalidates the entry

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "start": self.start, "tail": list(self.tail), "cut": self.cuttable,
                           "full": self.full_hash})

    @classmethod
    def from_json(cls, s: str | bytes) -> PrefixEntry:
        d = json.loads(s)
        return cls(d["key"], int(d["start"]), tuple(int(t) for t in d["tail"]), bool(d["cut"]), d["full"])


def prefix_entries(key: str, p: KVPayload, block: int = BLOCK_TOKENS, *,
                   hashes: ChainHashes | None = None) -> list[tuple[str, PrefixEntry]]:
    """``(boundary hash, entry)`` pairs to index for payload ``p`` stored under ``key`` (one per boundary).

    A payload of full-attention layers can be cut after any token (``select_tokens``), so each of
    its blocks is indexed under the boundary before it. Sliding-window layers hold only the last
    ``window - 1`` tokens, so nothing shorter can be cut from them: one entry, for the whole
    sequence. Batches and padded payloads are not indexed. ``hashes``: its ``payload_chain``, when the
    caller has it.
    """
    ids_t = single_sequence(p)
    if ids_t is None:
        return []
    ids = _as_ints(ids_t)
    T = len(ids)
    c = payload_chain(p, block) if hashes is None else hashes
    bounds, full = c.boundaries, c.full
    if any_sliding(p.meta.layer_types, p.meta.sliding_window):
        i = (T - 1) // block  # the boundary before the last (possibly partial) block
        return [(bounds[i], PrefixEntry(key, i * block, tuple(int(t) for t in ids[i * block:]), False, full))]
    return [(bounds[i], PrefixEntry(key, i * block, tuple(int(t) for t in ids[i * block:(i + 1) * block]), True, full))
            for i in range(math.ceil(T / block))]


def query_boundaries(fingerprint: str, token_ids: Tokens, block: int = BLOCK_TOKENS) -> list[str]:
    """The boundary hashes to probe for a query: the empty prefix and one per full block of it."""
    return block_hashes(fingerprint, token_ids, block)


def match(token_ids: Tokens, found: Sequence[Iterable[PrefixEntry]],
          block: int = BLOCK_TOKENS) -> list[tuple[PrefixEntry, int]]:
    """``(entry, n)`` for each entry (``found[i]``: those under the query's ``i``-th boundary) whose
    first ``n`` tokens are the query's first ``n``; longest first."""
    ids = _as_ints(token_ids)
    hits = []
    for i, entries in enumerate(found):
        start = i * block
        rest = [int(t) for t in ids[start:start + max((len(e.tail) for e in entries), default=0)]]
        for e in entries:
            if e.start != start:
                continue
            common = 0
            for a, b in zip(e.tail, rest, strict=False):
                if a != b:
                    break
                common += 1
            n = start + common
            if (common == len(e.tail) or e.cuttable) and n > 0:
                hits.append((e, n))
    return sorted(hits, key=lambda h: -h[1])
