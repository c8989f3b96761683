"""Context handles: what a response gives back so that a later request continues from its cache.

A handle is ``kvr1.<body>.<signature>``: ``body`` is base64url(zlib(JSON)) of the conversation's
messages (the answer included), the store key of its cache (content-addressed: the model's
fingerprint and a hash of the tokens, ``transport.keys``), the model that made it, and the time it
expires; ``signature`` is an HMAC-SHA256 of the body under the server's secret. The messages ride
in the handle so that a handle whose cache cannot be used still carries its text: the server then
re-encodes it (the text channel) and says why. A receiver uses the cache only when the signature
holds, it has not expired, the store still has it, its bytes verify, it is compatible with the
receiving model, and its tokens are exactly the handle's messages (``replica``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.core.errors import InvalidInput
from kvrelay.serve.chat import Message

PREFIX = "kvr1"
MAX_HANDLE_CHARS = 8 << 20  # a handle is text; bound what a request may make the server inflate
MAX_BODY_BYTES = 64 << 20


def new_secret() -> bytes:
    return secrets.token_bytes(32)


@dataclass(frozen=True, slots=True)
class Handle:
    key: str  # store key of the cache
    model: str  # served model name that produced it
    fingerprint: str  # that model's fingerprint
    expires: float  # unix time
    messages: tuple[Message, ...]

    def __post_init__(self):
        if not self.messages:
            raise InvalidInput("a context handle without messages", "the conversation it continues")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _sign(secret: bytes, body: str) -> str:
    return _b64(hmac.new(secret, body.encode(), hashlib.sha256).digest())


def encode(h: Handle, secret: bytes) -> str:
    doc = {"k": h.key, "m": h.model, "f": h.fingerprint, "e": h.expires, "msgs": [m.to_json() for m in h.messages]}
    body = _b64(zlib.compress(json.dumps(doc, separators=(",", ":")).encode()))
    return f"{PREFIX}.{body}.{_sign(secret, body)}"


@dataclass(frozen=True, slots=True)
class Opened:
    handle: Handle
    signed: bool  # the signature holds under this server's secret


def decode(text: object, secret: bytes, where: str = "kv_context") -> Opened:
    """Parse a handle; ``InvalidInput`` when it is not one at all (nothing to fall back to).

    A handle whose signature does not hold still parses (``signed=False``): its messages are text a
    client could have sent, but its cache is never used.
    """
    if not isinstance(text, str) or len(text) > MAX_HANDLE_CHARS:
        raise InvalidInput(f"{where} is not a context handle", f"a string {PREFIX}.BODY.SIGNATURE from a response")
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise InvalidInput(f"{where} is not a context handle", f"a string {PREFIX}.BODY.SIGNATURE from a response")
    body, sig = parts[1], parts[2]
    try:
        raw = zlib.decompressobj().decompress(_unb64(body), MAX_BODY_BYTES)
        doc = json.loads(raw)
        msgs = tuple(Message.from_json(m) for m in doc["msgs"])
        h = Handle(str(doc["k"]), str(doc["m"]), str(doc["f"]), float(doc["e"]), msgs)
    except (ValueError, KeyError, TypeError, zlib.error) as err:
        raise InvalidInput(f"{where} does not decode ({type(err).__name__})",
                           "a context handle exactly as a response returned it") from None
    return Opened(h, hmac.compare_digest(sig, _sign(secret, body)))


def context_messages(opened: Sequence[Opened]) -> list[Message]:
    """The text of several handles, in order: what the text channel re-encodes for them."""
    return [m for o in opened for m in o.handle.messages]
