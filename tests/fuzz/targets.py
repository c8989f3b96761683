"""What a hostile file may do to kvrelay's readers, as one function per reader, shared by the property tests
(``tests/fuzz/test_properties.py``, in ``make test``) and the coverage-guided fuzzer (``tests/fuzz/fuzz_wire.py``,
atheris, a documented longer run: docs/payloads.md, "Hostile files").

``check_resealed`` recomputes the checksums of whatever header a mutation produced (as a forger
would), so the fuzzer gets past the root checksum. Each target takes arbitrary bytes and must end in one of two ways: it returns, or it raises a typed
``KVRelayError``. Anything else — ValueError, IndexError, RuntimeError, MemoryError, RecursionError — is a
bug the target lets escape (the caller reports it). Memory stays bounded because every reader validates
sizes against the bytes it was given before it allocates.
"""

from __future__ import annotations

import json

import torch

from kvrelay.core.errors import CorruptPayload, KVRelayError
from kvrelay.kv import codecs, wire
from kvrelay.kv.describe import describe
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.models.identity import RopeSpec
from kvrelay.transport.redis_store import RedisStore
from tests.kv.test_wire_hostile import forge

FULL, SLIDING = "full_attention", "sliding_attention"
SEED_CODECS = ("raw", "fp16", "bf16", "int8", "int4-g4", "evict:0.5+fp16", "layers:1+int8")
_MANIFESTS = RedisStore("redis://127.0.0.1:1/0")  # parses manifests; never connects


def seed_payload(T: int = 6, window: int | None = 4) -> KVPayload:
    """A small two-layer payload without a model: layer 0 full attention, layer 1 sliding."""
    g = torch.Generator().manual_seed(T)
    types = (FULL, SLIDING) if window else (FULL, FULL)
    meta = PayloadMeta(model_fingerprint="ab" * 32, tokenizer_hash="tok", arch="gemma3", num_model_layers=2,
                       layer_indices=(0, 1), layer_types=types, sliding_window=window,
                       rope=tuple(RopeSpec(t, (1.0, 0.25)) for t in dict.fromkeys(types)), producer="p", round=2,
                       created_at=5.0)
    held = [T, min(T, window - 1) if window else T]
    k = tuple(torch.randn(1, 2, h, 4, generator=g) for h in held)  # (B, H, T_l, D)
    v = tuple(torch.randn(1, 2, h, 4, generator=g) for h in held)
    ids = torch.randint(9, 60, (1, T), generator=g)
    return KVPayload(k, v, ids, torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool), meta)


def seed_corpus() -> list[bytes]:
    """Genuine files of every codec family: what mutations start from."""
    p = seed_payload()
    return [wire.pack(*codecs.compress(p, c).to_wire()) if c != "raw" else wire.encode(p) for c in SEED_CODECS]


def check_decode(data: bytes) -> None:
    """``decode`` (every codec) and ``describe`` agree: describe says ok exactly when decode accepts."""
    try:
        wire.decode(data)
        accepted = True
    except KVRelayError:
        accepted = False
    d = describe(data)
    if (d["status"] == "ok") != accepted:
        raise AssertionError(f"describe says {d['status']!r} but decode {'accepts' if accepted else 'refuses'}")


def check_compressed(data: bytes) -> None:
    try:
        wire.decode_compressed(data)
    except KVRelayError:
        pass


def check_manifest(data: bytes) -> None:
    """A Redis manifest: refused, or its declared chunks and size are within the bounds."""
    try:
        m = _MANIFESTS._parse_manifest("k", data)
    except CorruptPayload:
        return
    assert 1 <= m["chunks"] <= 65_536 and 0 <= m["size"], m


def check_resealed(data: bytes) -> None:
    """The bytes with their checksums recomputed (what a forger does, ``forge``), so mutations of the header
    reach the structural validation behind the root checksum instead of stopping at it."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= n <= len(data) - 8:
        return
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError):
        return
    if isinstance(header, dict):
        sealed = forge(header, data[8 + n:])
        check_decode(sealed)
        check_compressed(sealed)


TARGETS = (check_decode, check_compressed, check_manifest, check_resealed)


def check_all(data: bytes) -> None:
    for target in TARGETS:
        target(data)
