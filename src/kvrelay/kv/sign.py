"""Signed payloads: a producer signs a kvrelay/1 file's root digest; a receiver holding keys refuses the rest.

The wire checksums (``kv.wire``) prove that bytes are the bytes that were written, not who wrote
them: anyone who can write to a store can rewrite a payload and its digests together. A signature
closes that. What is signed is the *unsigned root*: the root sha256 the file's header would carry
without its ``signature`` metadata field (``kv.wire_header.root_digest`` over every other metadata
field and the tensor list; the metadata includes every tensor's own sha256). So one signature pins
every tensor byte and every metadata field, the producer's name and round included, and is checked
from the header alone, before any tensor is read. The ``signature`` field itself is ordinary
metadata, covered by the file's own root checksum like the rest.

Two algorithms:

* ``hmac``: HMAC-SHA256 (``hmac``, stdlib) with a secret shared by producers and receivers;
* ``ed25519``: Ed25519 (the ``cryptography`` package) for producers that must not share a secret:
  the producer holds the private key, receivers only the public one.

Keys are lines of text, read from a file or an environment variable (``keyring_from``), never
from a command line::

    hmac:ID:SECRET_HEX                 a shared secret (signs and verifies), >= 16 bytes
    ed25519-private:ID:SEED_HEX        a producer's private key (32 bytes; it verifies too)
    ed25519-public:ID:PUBLIC_HEX       a receiver's copy of a producer's public key (32 bytes)

optionally followed by ``producers=NAME,NAME``: the producers that key may sign for (default: any).
``#`` starts a comment; in an environment variable ``;`` separates lines too.

``signature`` is JSON ``{"alg": "hmac"|"ed25519", "key": ID, "sig": HEX}``. A receiver given a
keyring refuses a payload without one (``UnsignedPayload``) and one whose key it does not hold,
whose key may not sign for that producer, or whose signature does not match
(``BadSignature``), each naming the producer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.errors import BadSignature, InvalidInput, UnsignedPayload
from kvrelay.kv.wire_header import (
    PREFIX_BYTES,
    Header,
    Source,
    TensorEntry,
    framed_header,
    header_length,
    read_header,
    root_digest,
)

SIGNATURE_FIELD = "signature"
ALGS = ("hmac", "ed25519")
KINDS = ("hmac", "ed25519-private", "ed25519-public")
KEYS_ENV = "KVRELAY_KEYS"  # the environment variable ``keyring_from`` reads when given no file
MIN_HMAC_BYTES = 16
_DOMAIN = b"kvrelay/1 signature\0"  # a kvrelay signature can never be replayed as some other protocol's


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a keyring; ``secret`` is the HMAC secret, the Ed25519 seed, or its public key."""

    kind: str  # one of KINDS
    id: str
    secret: bytes = b""
    producers: tuple[str, ...] = ()  # who it may sign for; () = anyone

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"key kind must be one of {KINDS}, got {self.kind!r}")
        if not self.id or any(c.isspace() or c in ":;" for c in self.id):
            raise ValueError(f"key id must be non-empty without spaces, ':' or ';', got {self.id!r}")
        if self.kind == "hmac" and len(self.secret) < MIN_HMAC_BYTES:
            raise ValueError(f"an hmac secret needs at least {MIN_HMAC_BYTES} bytes, got {len(self.secret)}")
        if self.kind != "hmac" and len(self.secret) != 32:
            raise ValueError(f"an {self.kind} key is 32 bytes, got {len(self.secret)}")

    @property
    def alg(self) -> str:
        return "hmac" if self.kind == "hmac" else "ed25519"

    @property
    def can_sign(self) -> bool:
        return self.kind != "ed25519-public"

    def may_sign_for(self, producer: str) -> bool:
        return not self.producers or producer in self.producers

    def sign(self, root: str) -> str:
        """The hex signature of an unsigned root digest."""
        msg = _DOMAIN + root.encode()
        if self.kind == "hmac":
            return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()
        if self.kind != "ed25519-private":
            raise ValueError(f"key {self.id!r} is a public key; it verifies but cannot sign")
        return _ed25519().Ed25519PrivateKey.from_private_bytes(self.secret).sign(msg).hex()

    def verifies(self, root: str, sig: str) -> bool:
        msg = _DOMAIN + root.encode()
        if self.kind == "hmac":
            return hmac.compare_digest(self.sign(root), sig)
        ed = _ed25519()
        pub = (ed.Ed25519PrivateKey.from_private_bytes(self.secret).public_key() if self.kind == "ed25519-private"
               else ed.Ed25519PublicKey.from_public_bytes(self.secret))
        try:
            pub.verify(bytes.fromhex(sig), msg)
        except (ValueError, _invalid_signature()):
            return False
        return True

    def public(self) -> Key:
        """This key as a receiver holds it (an Ed25519 private key's public half; an HMAC key is itself)."""
        if self.kind != "ed25519-private":
            return self
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        pub = _ed25519().Ed25519PrivateKey.from_private_bytes(self.secret).public_key()
        return Key("ed25519-public", self.id, pub.public_bytes(Encoding.Raw, PublicFormat.Raw), self.producers)

    def to_line(self) -> str:
        tail = f" producers={','.join(self.producers)}" if self.producers else ""
        return f"{self.kind}:{self.id}:{self.secret.hex()}{tail}"


def _ed25519():
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519


def _invalid_signature():
    from cryptography.exceptions import InvalidSignature

    return InvalidSignature


def new_key(kind: str, key_id: str, *, producers: Sequence[str] = ()) -> Key:
    """A fresh random key: a 32-byte HMAC secret or an Ed25519 private key."""
    if kind not in ("hmac", "ed25519-private"):
        raise ValueError(f"new keys are hmac or ed25519-private, got {kind!r}")
    return Key(kind, key_id, os.urandom(32), tuple(producers))


@dataclass(frozen=True, slots=True)
class Keyring:
    """The keys a producer signs with and a receiver verifies with; empty = no signatures asked for."""

    keys: tuple[Key, ...] = ()

    def __post_init__(self):
        ids = [k.id for k in self.keys]
        if len(set(ids)) != len(ids):
            raise ValueError(f"key ids must be unique, got {ids}")

    def __bool__(self) -> bool:
        return bool(self.keys)

    def get(self, key_id: str) -> Key | None:
        return next((k for k in self.keys if k.id == key_id), None)

    def signer(self, producer: str) -> Key | None:
        """The first key that can sign for ``producer``; None when this keyring holds none."""
        return next((k for k in self.keys if k.can_sign and k.may_sign_for(producer)), None)

    def public(self) -> Keyring:
        return Keyring(tuple(k.public() for k in self.keys))


def parse_keys(text: str, *, where: str = "keys") -> Keyring:
    """A keyring from key lines (see the module docstring); ``InvalidInput`` naming the bad line."""
    keys = []
    for n, line in enumerate(text.replace(";", "\n").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *opts = line.split()
        parts = spec.split(":")
        try:
            if len(parts) != 3:
                raise ValueError("expected KIND:ID:HEX")
            producers: tuple[str, ...] = ()
            for o in opts:
                name, _, val = o.partition("=")
                if name != "producers" or not val:
                    raise ValueError(f"unknown option {o!r}")
                producers = tuple(p for p in val.split(",") if p)
            keys.append(Key(parts[0], parts[1], bytes.fromhex(parts[2]), producers))
        except ValueError as e:  # never echo the line: it may hold a secret
            raise InvalidInput(f"{where} line {n}: {e}",
                               f"KIND:ID:HEX [producers=A,B] with KIND one of {', '.join(KINDS)}") from None
    try:
        return Keyring(tuple(keys))
    except ValueError as e:
        raise InvalidInput(f"{where}: {e}", "each key id once") from None


def keyring_from(path: str | os.PathLike | None = None, *, env: str = KEYS_ENV,
                 environ: Mapping[str, str] | None = None) -> Keyring:
    """Keys from a file (``path``), else from the environment variable ``env``; empty when neither is set."""
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidInput(f"keys file {str(p)!r} cannot be read ({type(e).__name__})",
                               "a readable UTF-8 file of key lines") from None
        return parse_keys(text, where=f"keys file {str(p)!r}")
    text = (os.environ if environ is None else environ).get(env, "")
    return parse_keys(text, where=f"${env}") if text.strip() else Keyring()


# -- signing and checking kvrelay/1 bytes -------------------------------------------------------
def _unsigned_root(meta: Mapping[str, str], tensors: Mapping[str, TensorEntry]) -> str:
    return root_digest({k: v for k, v in meta.items() if k != SIGNATURE_FIELD}, tensors)


def _header_meta(h: Header) -> dict[str, str]:
    """The metadata the root covers (the plain fields plus the tensor digests, as ``kv.wire`` writes them)."""
    return {**h.meta, "tensor_sha256": json.dumps(h.digests, sort_keys=True)}


def sign_parts(parts: Sequence, key: Key) -> list:
    """kvrelay/1 buffers (``wire.pack_parts`` / ``encode_parts``) -> the same file signed with ``key``.

    Only the header is rewritten (signature added, root checksum recomputed); the tensor buffers
    are passed on untouched, so signing costs a hash of the header, not of the tensors.
    """
    head = bytes(parts[0])
    if len(head) < PREFIX_BYTES or len(head) != PREFIX_BYTES + header_length(head):
        raise ValueError("sign_parts takes pack_parts output: the length prefix and header as its first buffer")
    header = json.loads(head[PREFIX_BYTES:].decode("utf-8"))
    meta = dict(header.pop("__metadata__"))
    if SIGNATURE_FIELD in meta:
        raise ValueError("the payload is signed already")
    entries = {name: TensorEntry(e["dtype"], tuple(e["shape"]), *e["data_offsets"]) for name, e in header.items()}
    producer = meta.get("producer", "")
    if not key.may_sign_for(producer):
        raise ValueError(f"key {key.id!r} may sign for {list(key.producers)}, not for producer {producer!r}")
    body = {k: v for k, v in meta.items() if k != "sha256"}
    sig = {"alg": key.alg, "key": key.id, "sig": key.sign(_unsigned_root(body, entries))}
    body[SIGNATURE_FIELD] = json.dumps(sig, sort_keys=True)
    body["sha256"] = root_digest(body, entries)
    header["__metadata__"] = body
    return [framed_header(json.dumps(header, separators=(",", ":")).encode()), *parts[1:]]


def check_signature(data: Source | Header, keyring: Keyring) -> str:
    """The id of the key that signed these kvrelay/1 bytes (or this validated header), or a typed refusal.

    ``UnsignedPayload`` without a signature; ``BadSignature`` for a malformed one, a key the
    keyring does not hold, a key that may not sign for the payload's producer, or a mismatch.
    """
    h = data if isinstance(data, Header) else read_header(data)
    producer = h.meta.get("producer", "")
    raw = h.meta.get(SIGNATURE_FIELD)
    if raw is None:
        raise UnsignedPayload(producer)
    try:
        sig = json.loads(raw)
        ok = isinstance(sig, dict) and set(sig) == {"alg", "key", "sig"} and all(isinstance(v, str) for v in sig.values())
    except json.JSONDecodeError:
        ok = False
    if not ok:
        raise BadSignature(producer, "", 'the signature field is not {"alg", "key", "sig"} strings')
    key = keyring.get(sig["key"])
    if key is None:
        raise BadSignature(producer, sig["key"], "the receiver holds no key of that id")
    if key.alg != sig["alg"]:
        raise BadSignature(producer, key.id, f"signed as {sig['alg']!r} but the key is {key.alg!r}")
    if not key.may_sign_for(producer):
        raise BadSignature(producer, key.id, f"that key signs only for {list(key.producers)}")
    if not key.verifies(_unsigned_root(_header_meta(h), h.tensors), sig["sig"]):
        raise BadSignature(producer, key.id, "the signature does not match the payload")
    return key.id

