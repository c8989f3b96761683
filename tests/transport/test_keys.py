"""Content keys and the prefix index, checked against the chain-hash scheme written out independently
(``kvrelay/transport/keys.py`` documents it), and the lookup rules on hand-made entries. No store, no model."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.models.identity import RopeSpec
from kvrelay.transport.keys import (
    BLOCK_TOKENS,
    PrefixEntry,
    block_hashes,
    key_for,
    match,
    parse_key,
    payload_key,
    prefix_entries,
    query_boundaries,
    sequence_hash,
    single_sequence,
)

FP = "0123456789abcdef" * 4


def chain(fp: str, ids: list[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """h_0 = sha256("kvrelay/1" \\0 fp); h_i = sha256(h_{i-1} || block i as int64 little-endian)."""
    h = [hashlib.sha256(f"kvrelay/1\0{fp}".encode()).digest()]
    for i in range(len(ids) // block):
        h.append(hashlib.sha256(h[-1] + np.asarray(ids[i * block:(i + 1) * block], dtype="<i8").tobytes()).digest())
    return h


def test_block_hashes_follow_the_documented_chain():
    ids = list(range(100, 140))  # 2 full blocks + 8
    assert block_hashes(FP, ids) == [h.hex() for h in chain(FP, ids)]
    assert len(block_hashes(FP, ids)) == 3 and block_hashes(FP, []) == [chain(FP, [])[0].hex()]
    assert block_hashes(FP, torch.tensor([ids])) == block_hashes(FP, ids)  # (1, T) tensors too
    assert block_hashes(FP, ids, block=8) == [h.hex() for h in chain(FP, ids, 8)]
    with pytest.raises(ValueError, match="one sequence"):
        block_hashes(FP, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="fingerprint"):
        block_hashes("", ids)


def test_sequence_hash_ends_with_the_partial_block():
    ids = list(range(100, 140))
    h = chain(FP, ids)
    tail = hashlib.sha256(h[2] + np.asarray(ids[32:], dtype="<i8").tobytes()).hexdigest()
    assert sequence_hash(FP, ids) == tail
    assert sequence_hash(FP, ids[:32]) == h[2].hex()  # a whole number of blocks: the last boundary
    assert sequence_hash(FP, ids[:1]) == hashlib.sha256(h[0] + np.asarray(ids[:1], dtype="<i8").tobytes()).hexdigest()
    with pytest.raises(ValueError, match="empty"):
        sequence_hash(FP, [])


def test_key_format_and_parsing():
    ids = list(range(100, 140))
    key = key_for(FP, ids)
    assert key == f"kvrelay/1:{FP[:16]}:{sequence_hash(FP, ids)}"
    k = parse_key(key)
    assert (k.fingerprint_prefix, k.chain_hash, str(k)) == (FP[:16], sequence_hash(FP, ids), key)
    good_fp, good_hash = FP[:16], "a" * 64
    for bad in (f"kvrelay/2:{good_fp}:{good_hash}", f"kvrelay/1:{good_fp[:-1]}:{good_hash}",
                f"kvrelay/1:{good_fp}:{good_hash[:-1]}", f"kvrelay/1:{good_fp.upper()}:{good_hash}",
                f"kvrelay/1:{good_fp}:{'g' * 64}", f"kvrelay/1:{good_fp}:{good_hash}:x", f"{good_fp}:{good_hash}"):
        with pytest.raises(ValueError, match="not a payload key"):
            parse_key(bad)


def payload(T: int, *, sliding: bool = False, B: int = 1, pad: int = 0) -> KVPayload:
    types = ("sliding_attention",) if sliding else ("full_attention",)
    meta = PayloadMeta(model_fingerprint=FP, tokenizer_hash="t", arch="x", num_model_layers=1, layer_indices=(0,),
                       layer_types=types, sliding_window=8 if sliding else None, rope=(RopeSpec(types[0], (1.0,)),))
    held = min(T, 7) if sliding else T
    kv = torch.zeros(B, 1, held, 2)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :pad] = False
    return KVPayload((kv,), (kv.clone(),), (100 + torch.arange(T)).expand(B, T).clone(),
                     torch.arange(T).expand(B, T).clone(), mask, meta)


def test_payload_key_only_for_one_unpadded_sequence():
    p = payload(20)
    assert single_sequence(p).tolist() == list(range(100, 120))
    assert payload_key(p) == key_for(FP, list(range(100, 120)))
    for q in (payload(20, B=2), payload(20, pad=3)):
        assert single_sequence(q) is None and prefix_entries("k", q) == []
        with pytest.raises(ValueError, match="single unpadded sequence"):
            payload_key(q)


def test_prefix_entries_full_attention_one_per_block():
    ids = list(range(100, 140))
    entries = prefix_entries("K", payload(40))
    bounds = block_hashes(FP, ids)
    assert [b for b, _ in entries] == bounds  # h_0, h_1, h_2: each block under the boundary before it
    for i, (_, e) in enumerate(entries):
        assert (e.key, e.start, e.cuttable, e.full_hash) == ("K", 16 * i, True, sequence_hash(FP, ids))
        assert e.tail == tuple(ids[16 * i:16 * (i + 1)])
    assert len(prefix_entries("K", payload(32))) == 2  # exact blocks: no empty trailing entry


def test_prefix_entries_sliding_one_entry_for_the_whole_tail():
    for T, start in ((40, 32), (32, 16), (16, 0), (5, 0)):
        (b, e), = prefix_entries("K", payload(T, sliding=True))
        ids = list(range(100, 100 + T))
        assert b == block_hashes(FP, ids)[start // 16] and e.start == start and not e.cuttable
        assert e.tail == tuple(ids[start:])


def test_entry_json_round_trip():
    e = PrefixEntry("K", 16, (1, 2, 3), True, "f" * 64)
    assert PrefixEntry.from_json(e.to_json()) == e
    assert PrefixEntry.from_json(e.to_json().encode()) == e
    assert query_boundaries(FP, list(range(40))) == block_hashes(FP, list(range(40)))


def test_match_rules():
    q = list(range(100, 140))
    cut = PrefixEntry("A", 16, tuple(q[16:32]), True, "a")
    whole = PrefixEntry("B", 16, tuple(q[16:28]) + (0, 0), False, "b")  # differs after 12 tokens
    exact = PrefixEntry("C", 0, tuple(q[:10]), False, "c")
    wrong_start = PrefixEntry("D", 0, tuple(q[16:32]), True, "d")
    hits = match(q, [[exact], [cut, whole, wrong_start]])
    assert hits == [(cut, 32), (exact, 10)]  # longest first; a partial uncuttable tail is no hit
    partial = PrefixEntry("E", 16, tuple(q[16:20]) + (7,) * 12, True, "e")
    assert match(q, [[], [partial]]) == [(partial, 20)]  # a cuttable entry is reused up to the mismatch
    none_shared = PrefixEntry("F", 0, (1, 2, 3), True, "f")
    assert match(q, [[none_shared]]) == []  # zero shared tokens is no hit
    short_query = q[:18]
    assert match(short_query, [[], [cut]]) == [(cut, 18)]
    assert match(q, [[], []]) == [] and match(q, []) == []


def test_every_function_honours_a_custom_block_size():
    ids = list(range(100, 120))  # 2 blocks of 8 + 4
    h = chain(FP, ids, 8)
    tail = hashlib.sha256(h[2] + np.asarray(ids[16:], dtype="<i8").tobytes()).hexdigest()
    assert sequence_hash(FP, ids, 8) == tail and sequence_hash(FP, ids[:16], 8) == h[2].hex()
    assert key_for(FP, ids, 8) == f"kvrelay/1:{FP[:16]}:{tail}" != key_for(FP, ids)
    assert payload_key(payload(20), 8) == key_for(FP, ids, 8)
    assert query_boundaries(FP, ids, 8) == [x.hex() for x in h]
    entries = prefix_entries("K", payload(20), 8)
    assert [b for b, _ in entries] == [x.hex() for x in h] and all(e.full_hash == tail for _, e in entries)
    (b, e), = prefix_entries("K", payload(20, sliding=True), 8)
    assert (b, e) == (h[2].hex(), PrefixEntry("K", 16, tuple(ids[16:]), False, tail))


def test_sliding_entry_exactly():
    for T, start in ((17, 16), (16, 0), (33, 32), (40, 32)):
        ids = list(range(100, 100 + T))
        (b, e), = prefix_entries("K", payload(T, sliding=True))
        assert b == block_hashes(FP, ids)[start // 16]
        assert e == PrefixEntry("K", start, tuple(ids[start:]), False, sequence_hash(FP, ids))


def test_key_digits_and_padding_message():
    with pytest.raises(ValueError, match="not a payload key"):
        parse_key(f"kvrelay/1:{'X' * 16}:{'a' * 64}")
    with pytest.raises(ValueError, match=r"\(batch 1, 3 padding slots\)"):
        payload_key(payload(20, pad=3))


def test_match_skips_foreign_entries_and_counts_single_tokens():
    q = list(range(100, 140))
    wrong_start = PrefixEntry("D", 0, tuple(q[16:32]), True, "d")  # filed under boundary 1 but says start 0
    cut = PrefixEntry("A", 16, tuple(q[16:32]), True, "a")
    assert match(q, [[], [wrong_start, cut]]) == [(cut, 32)]  # a stray entry does not hide the next one
    one = PrefixEntry("O", 0, (q[0], 7, 7), True, "o")
    assert match(q, [[one]]) == [(one, 1)]  # a single shared token is a (short) hit
