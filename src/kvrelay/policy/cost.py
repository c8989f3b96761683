"""The cost model: what each channel costs on this machine, from a measured profile (plain numbers).

A ``CostProfile`` holds per-token and per-byte rates (``kvrelay calibrate`` measures them,
``bench.calibrate``): the receiver's prefill as ``fixed + per_token × tokens`` (one forward has a
fixed cost on a CPU), its decode per token, each codec's compression ratio and its encode/decode
seconds per raw (fp32) cache byte, each store's put/get seconds per payload byte, the text bytes per
token, and optionally a link (bandwidth, one-way latency).

Receiver latency of one request (context of ``n`` tokens, receiver prompt of ``q``, answer of ``a``):

* ``none``         — ``prefill(q) + a·decode``
* ``text_full``    — ``link(text bytes of n) + prefill(n + q) + a·decode``
* ``text_message`` — ``sender decode of m + link(m) + prefill(m + q) + a·decode``
* ``kv`` + codec   — ``encode + link(payload bytes) | store put+get + decode + prefill(q) + a·decode``

The break-even bandwidth of a codec is where kv and text_full cross (``break_even_mbps``): below
it, text is faster. The same closed form is what ``bench transfer`` reports next to its measured
crossing (``bench.links``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvrelay.core.errors import InvalidInput

PROFILE_VERSION = 1


def closed_form_break_even_mbps(payload_bytes: float, text_bytes: float, text_fixed_s: float,
                                kv_fixed_s: float) -> float:
    """Bandwidth (Mbit/s) where ``kv_fixed + payload/bw == text_fixed + text/bw``; inf when kv never pays.

    ``text_fixed_s``: the text receiver's compute (prefill of context + prompt); ``kv_fixed_s``:
    every kv cost but the transfer (codec, wire, cache build, prompt prefill)."""
    gain = text_fixed_s - kv_fixed_s
    extra_bits = 8.0 * (payload_bytes - text_bytes)
    if extra_bits <= 0:
        return 0.0 if gain >= 0 else float("inf")
    if gain <= 0:
        return float("inf")
    return extra_bits / gain / 1e6


def _nonneg(owner: str, **values: float) -> None:
    for k, v in values.items():
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise InvalidInput(f"{owner}.{k} is {v!r}", "a finite number >= 0")


@dataclass(frozen=True, slots=True)
class CodecCost:
    """One codec: payload bytes = raw bytes / ``ratio``; seconds per raw (fp32) cache byte each way.

    ``encode_s_per_byte``: compress + pack to wire bytes; ``decode_s_per_byte``: unpack + decompress +
    the receiver's cache build."""

    name: str
    ratio: float
    encode_s_per_byte: float
    decode_s_per_byte: float
    lossless: bool = False

    def __post_init__(self):
        if not self.name:
            raise InvalidInput("a codec cost without a name", "a codec name such as raw or int8")
        _nonneg(f"codec {self.name}", encode_s_per_byte=self.encode_s_per_byte,
                decode_s_per_byte=self.decode_s_per_byte)
        if not self.ratio > 0:
            raise InvalidInput(f"codec {self.name}: ratio {self.ratio!r}", "a compression ratio > 0")


@dataclass(frozen=True, slots=True)
class StoreCost:
    """One store's put and get, seconds per payload byte (a fixed per-call part folded in at the size measured)."""

    name: str
    put_s_per_byte: float
    get_s_per_byte: float

    def __post_init__(self):
        _nonneg(f"store {self.name}", put_s_per_byte=self.put_s_per_byte, get_s_per_byte=self.get_s_per_byte)


@dataclass(frozen=True, slots=True)
class Link:
    """A network path between sender and receiver: bandwidth in Mbit/s, one-way latency in seconds."""

    mbps: float
    latency_s: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.mbps, int | float) and self.mbps > 0):
            raise InvalidInput(f"link bandwidth {self.mbps!r} Mbit/s", "a bandwidth > 0 Mbit/s")
        _nonneg("link", latency_s=self.latency_s)

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + 8.0 * nbytes / (self.mbps * 1e6)


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Measured rates of one model on one machine (``kvrelay calibrate``); see the module docstring."""

    model: str
    prefill_fixed_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    raw_bytes_per_token: float  # the fp32 cache of one context token, all layers, K and V
    text_bytes_per_token: float  # utf-8 bytes of the context per token
    codecs: tuple[CodecCost, ...]
    stores: tuple[StoreCost, ...] = ()
    link: Link | None = None
    fingerprint: str = ""
    engine: str = ""
    threads: int = 0
    load_average: tuple[float, ...] = ()
    measured: dict = field(default_factory=dict, compare=False)  # the raw timings behind the rates

    def __post_init__(self):
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "stores", tuple(self.stores))
        object.__setattr__(self, "load_average", tuple(self.load_average))
        _nonneg("profile", prefill_fixed_s=self.prefill_fixed_s, prefill_s_per_token=self.prefill_s_per_token,
                decode_s_per_token=self.decode_s_per_token, raw_bytes_per_token=self.raw_bytes_per_token,
                text_bytes_per_token=self.text_bytes_per_token)
        if not self.codecs:
            raise InvalidInput(f"profile for {self.model} has no codec", "at least one codec cost (raw)")
        names = [c.name for c in self.codecs]
        if len(set(names)) != len(names):
            raise InvalidInput(f"profile codecs {names} repeat a name", "each codec once")

    # -- rates ---------------------------------------------------------------------------------
    def codec(self, name: str) -> CodecCost:
        for c in self.codecs:
            if c.name == name or c.name.split("-g")[0] == name:  # int8 also names int8-g32
                return c
        raise InvalidInput(f"codec {name!r} is not in the profile of {self.model}",
                           f"one of {[c.name for c in self.codecs]} (calibrate with --codecs)")

    def store(self, name: str) -> StoreCost:
        for s in self.stores:
            if s.name == name:
                return s
        raise InvalidInput(f"store {name!r} is not in the profile of {self.model}",
                           f"one of {[s.name for s in self.stores]} (calibrate with --stores)")

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_fixed_s + self.prefill_s_per_token * tokens if tokens > 0 else 0.0

    def payload_bytes(self, codec: str, context_tokens: int) -> float:
        return self.raw_bytes_per_token * context_tokens / self.codec(codec).ratio

    def text_bytes(self, tokens: int) -> float:
        return self.text_bytes_per_token * tokens

    # -- channels ------------------------------------------------------------------------------
    def kv_fixed_s(self, codec: str, context_tokens: int, prompt_tokens: int) -> float:
        """Every kv cost at the receiver but moving the bytes: codec both ways, cache build, prompt prefill."""
        c = self.codec(codec)
        raw = self.raw_bytes_per_token * context_tokens
        return raw * (c.encode_s_per_byte + c.decode_s_per_byte) + self.prefill_s(prompt_tokens)

    def text_fixed_s(self, context_tokens: int, prompt_tokens: int) -> float:
        return self.prefill_s(context_tokens + prompt_tokens)

    def break_even_mbps(self, codec: str, context_tokens: int, prompt_tokens: int = 16) -> float:
        """Below this bandwidth ``text_full`` reaches the receiver's first token before ``kv`` with ``codec``."""
        return closed_form_break_even_mbps(self.payload_bytes(codec, context_tokens), self.text_bytes(context_tokens),
                                           self.text_fixed_s(context_tokens, prompt_tokens),
                                           self.kv_fixed_s(codec, context_tokens, prompt_tokens))

    def latency_s(self, channel: str, codec: str | None, *, context_tokens: int, prompt_tokens: int,
                  answer_tokens: int = 0, link: Link | None = None, store: str | None = None,
                  message_tokens: int = 48) -> float:
        """Predicted receiver latency of one request on ``channel`` (module docstring).

        ``link`` (default: the profile's) carries what crosses; without one and without ``store`` the
        hand-over is free (in process). A kv channel through ``store`` pays its put and get instead."""
        link = link if link is not None else self.link
        move = (lambda nb: link.seconds(nb)) if link is not None else (lambda nb: 0.0)
        tail = self.decode_s_per_token * answer_tokens
        base = channel.split(":")[0]
        if base == "none":
            return self.prefill_s(prompt_tokens) + tail
        if base == "text_full":
            return move(self.text_bytes(context_tokens)) + self.text_fixed_s(context_tokens, prompt_tokens) + tail
        if base == "text_message":
            m = min(message_tokens, context_tokens)
            return (self.decode_s_per_token * m + move(self.text_bytes(m)) + self.prefill_s(m + prompt_tokens)
                    + tail)
        if base in ("kv", "adapter", "variant"):
            codec = codec or "raw"
            nbytes = self.payload_bytes(codec, context_tokens)
            if store is not None:
                s = self.store(store)
                carry = nbytes * (s.put_s_per_byte + s.get_s_per_byte)
            else:
                carry = move(nbytes)
            return self.kv_fixed_s(codec, context_tokens, prompt_tokens) + carry + tail
        raise InvalidInput(f"channel {channel!r}", "none, text_full, text_message, kv, adapter:NAME or variant:V:R")

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["version"] = PROFILE_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostProfile:
        if d.get("version") != PROFILE_VERSION:
            raise InvalidInput(f"cost profile version {d.get('version')!r}",
                               f"version {PROFILE_VERSION} (re-run kvrelay calibrate)")
        try:
            d = {k: v for k, v in d.items() if k != "version"}
            d["codecs"] = tuple(CodecCost(**c) for c in d["codecs"])
            d["stores"] = tuple(StoreCost(**s) for s in d.get("stores", ()))
            d["link"] = Link(**d["link"]) if d.get("link") else None
            return cls(**d)
        except (KeyError, TypeError) as err:
            raise InvalidInput(f"cost profile fields are wrong ({err})",
                               "a JSON object written by kvrelay calibrate") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        p = Path(path)
        if not p.is_file():
            raise InvalidInput(f"no cost profile at {p}", "a file written by kvrelay calibrate --json")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise InvalidInput(f"{p} is not JSON ({err.msg})", "a file written by kvrelay calibrate --json") from None
        return cls.from_dict(d.get("profile", d))
