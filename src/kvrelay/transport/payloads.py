"""Payloads on byte stores: ``put_payload`` / ``get_payload`` of a ``KVPayload`` under any codec.

What a store holds is one kvrelay/1 file (``kv.wire``):

* codec ``raw``: the payload itself (``wire.encode_parts``, zero-copy parts), indexed by prefix so
  ``longest_prefix`` can find it (``keys.prefix_entries``);
* any other codec (``fp16``, ``int8``, ``int4``, ``evict:F``, chains, see ``kv.codecs``): the codec's
  output (``Compressed.to_wire`` -> ``wire.pack_parts``). Lossy payloads are not prefix-indexed: a
  receiver reusing a prefix gets exactly what the sender cached, or nothing.

``get_payload`` reads either back as a float ``KVPayload`` with codec ``raw`` (a compressed one is
decompressed to the producer's dtype; lossy stages are not undone), checked against ``expect``
(a receiver's ``ModelIdentity``) when given. A missing or expired key is ``PayloadNotFound``.
Either side may sign (``signer=``) or require a signature (``keys=``): ``kv.sign``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv import codecs, wire
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.sign import Key, Keyring, check_signature, sign_parts
from kvrelay.models.identity import ModelIdentity
from kvrelay.transport.bytestore import ByteStore
from kvrelay.transport.keys import (
    key_for,
    parse_key,
    payload_chain,
    payload_key,
    prefix_entries,
    single_sequence,
)


def compressed_key(c: codecs.Compressed) -> str:
    """The content key of a codec's output: its model, its tokens and the codec's canonical name."""
    ids = c.tensors["token_ids"]
    if ids.shape[0] != 1 or not bool(c.tensors["mask"].all()):
        raise ValueError("only a single unpadded sequence has a content key; pass key= for batches")
    return f"{key_for(c.meta.model_fingerprint, ids[0])}+{c.name}"


def _compressed(payload: KVPayload | codecs.Compressed, codec: str, codec_ctx) -> codecs.Compressed | None:
    if isinstance(payload, codecs.Compressed):
        return payload
    return None if codecs.parse(codec).lossless else codecs.compress(payload, codec, **codec_ctx)


def _signed(parts: list, signer: Key | None) -> list:
    return parts if signer is None else sign_parts(parts, signer)


def put_payload(store: ByteStore, payload: KVPayload | codecs.Compressed, codec: str = "raw",
                ttl_s: float | None = None, *, key: str | None = None, signer: Key | None = None,
                **codec_ctx) -> str:
    """Store ``payload`` encoded with ``codec`` and return its key (default: its content key, with
    ``+CODEC`` appended for a codec other than raw). A ``Compressed`` is stored as it is (``codec`` is
    then its own). ``signer``: sign it (``kv.sign``). ``codec_ctx`` goes to ``codecs.compress``
    (``model=``, ``probe_ids=``, ... for eviction)."""
    c = _compressed(payload, codec, codec_ctx)
    if c is None:
        hashes = payload_chain(payload)  # the tokens hashed once: key, index entries and whole hash
        key = payload_key(payload, hashes=hashes) if key is None else key
        store.put_bytes(key, _signed(wire.encode_parts(payload), signer), ttl_s,
                        index=prefix_entries(key, payload, hashes=hashes) if hashes is not None else [],
                        full_hash=hashes.full if hashes is not None else "")
        return key
    if key is None:
        key = payload_key(payload) + f"+{c.name}" if isinstance(payload, KVPayload) else compressed_key(c)
    store.put_bytes(key, _signed(wire.pack_parts(*c.to_wire()), signer), ttl_s)
    return key


def save_payload(path, payload: KVPayload | codecs.Compressed, codec: str = "raw", *, signer: Key | None = None,
                 **codec_ctx) -> None:
    """Write ``payload`` encoded with ``codec`` (and signed by ``signer``) to a kvrelay/1 file, atomically."""
    c = _compressed(payload, codec, codec_ctx)
    parts = wire.encode_parts(payload) if c is None else wire.pack_parts(*c.to_wire())
    wire.atomic_write(path, _signed(parts, signer))


def decode_bytes(data, *, expect: ModelIdentity | None = None, keys: Keyring | None = None,
                 admit: Callable[[int], None] | None = None) -> KVPayload:
    """kvrelay/1 bytes of a raw payload or of any codec's output -> a raw float ``KVPayload`` (``wire.decode``).

    ``keys``: a non-empty keyring requires a signature by one of its keys (``kv.sign.check_signature``:
    ``UnsignedPayload`` / ``BadSignature`` naming the producer), checked from the header before any
    tensor is read. ``admit``: a receiver's byte budget (``agents.agent.Agent.admit``), called with the
    bytes the payload decodes to (``wire.decoded_nbytes``, from the header) after the signature and
    before any tensor is read; it raises to refuse (``OverBudget``)."""
    if keys:
        check_signature(data, keys)
    if admit is not None:
        admit(wire.decoded_nbytes(data))
    return wire.decode(data, expect=expect)  # any codec's output (kv.wire_decode)


def compressed_from_bytes(data) -> codecs.Compressed:
    """kvrelay/1 bytes -> ``Compressed`` (layout and every tensor digest verified), without decompressing."""
    return wire.decode_compressed(data)


def check_content_key(key: str, p: KVPayload, codec: str) -> None:
    """Bytes found under a content key (``keys.payload_key``, ``+CODEC`` for a codec's output) must be what
    that key names: the codec, the model and — when the codec keeps every token — the tokens themselves.
    Eviction drops tokens, so under an ``evict…`` codec only the codec and the model are checked. Any
    other key (one a caller chose) is not a claim about the content and is not checked."""
    base, _, suffix = key.partition("+")
    try:
        k = parse_key(base)
    except ValueError:
        return
    if suffix != ("" if codec == "raw" else codec):
        raise CorruptPayload(f"bytes under key {key!r} are the output of codec {codec!r}; the key names "
                             f"codec {suffix or 'raw'!r}")
    if not p.meta.model_fingerprint.startswith(k.fingerprint_prefix):
        raise CorruptPayload(f"bytes under key {key!r} were made by model {p.meta.model_fingerprint[:16]}…; the key "
                             f"names model {k.fingerprint_prefix}…")
    ids = single_sequence(p)
    if codecs.parse(codec).keeps_tokens and (ids is None or key_for(p.meta.model_fingerprint, ids) != base):
        raise CorruptPayload(f"bytes under key {key!r} encode other tokens than the key names (another payload's "
                             "bytes were written under it)")


def get_payload(store: ByteStore, key: str, *, expect: ModelIdentity | None = None,
                keys: Keyring | None = None, admit: Callable[[int], None] | None = None) -> KVPayload:
    """The payload under ``key`` as a raw float ``KVPayload`` (decompressed if a codec made it), checked to
    be what a content key names (``check_content_key``); ``keys`` and ``admit`` as in ``decode_bytes``."""
    return get_payload_sized(store, key, expect=expect, keys=keys, admit=admit)[0]


def get_payload_sized(store: ByteStore, key: str, *, expect: ModelIdentity | None = None,
                      keys: Keyring | None = None, admit: Callable[[int], None] | None = None
                      ) -> tuple[KVPayload, int]:
    """``get_payload`` and the number of bytes it read: what the put wrote, the bytes that crossed the wire
    (an fp16 or int8 payload's own size, not its decoded fp32 size)."""
    data = store.get_bytes(key)
    p = decode_bytes(data, expect=expect, keys=keys, admit=admit)
    check_content_key(key, p, wire.read_meta(data).get("codec", "raw"))
    return p, memoryview(data).nbytes


def get_compressed(store: ByteStore, key: str) -> codecs.Compressed:
    """The codec output under ``key``, not decompressed (``codecs.decompress`` it, or measure that)."""
    return compressed_from_bytes(store.get_bytes(key))


class PayloadMethods:
    """``put`` / ``get`` of a raw ``KVPayload`` on a byte store: the two functions above, as methods of the
    stores (``MemoryStore``, ``DiskStore``, ``RedisStore`` inherit them)."""

    def check(self, *, write: bool = False) -> None:
        """Nothing to reach (a store in this process); stores with a server or a folder override it."""

    def put(self, key: str, payload, ttl_s: float | None = None) -> None:
        put_payload(self, payload, ttl_s=ttl_s, key=key)

    def get(self, key: str):
        return get_payload(self, key)
