"""What a request says about itself before anything is relayed, and the channel names policy speaks.

Features (``Features``) are computed from what a router holds when it decides: the sender's context,
the receiver's prompt, their token counts, the engine mode.

* ``overlap`` — the share of the context's distinct words (lower-cased, 3+ letters or digits) that the
  receiver's prompt already contains: ~1 when the receiver sees the whole problem (the *shared*
  regime of ``docs/audit.md``), ~0 when only the sender saw the facts (*private*); ``sees_context``
  is ``overlap >= SEES_CONTEXT``, so the model can take the regimes' step.
* ``context_tokens`` — the sender's context as the receiver would get it.
* ``quantized`` — the receiver runs a compact-weight engine mode (int8/int4).

Channels (``CHANNELS`` and ``channel_of_arm``): ``none``, ``text_message``, ``text_full``, ``kv``
(with a codec: ``raw`` when lossless), ``adapter:NAME`` (another model's cache through a named
adapter artefact), ``variant:V:REPAIR`` (a fine-tuned sibling's cache through a named repair). An
audit arm maps to a channel when it is one; the controls (``kv_mismatched``, ``kv_zeroed``, noise,
layer/token ablations) are not channels and map to ``None``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvrelay.core.errors import InvalidInput
from kvrelay.core.modes import split_mode

BASE_CHANNELS = ("none", "text_message", "text_full", "kv")
PREFIXED = ("adapter", "variant")  # channels with a name after a colon
QUANTIZED_ENGINES = ("int8", "int4")  # decode precisions that count as quantized
SEES_CONTEXT = 0.5  # overlap from which the receiver is taken to see the problem itself
_WORD = re.compile(r"[a-z0-9]{3,}")


def quantized_engine(engine: str) -> bool:
    """The mode decodes with compact integer weights (``bf16+int8`` does, ``bf16`` does not)."""
    return split_mode(engine)[1] in QUANTIZED_ENGINES


def words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def overlap(context: str, prompt: str) -> float:
    """Share of the context's distinct words found in the prompt (0 when the context has none)."""
    c = words(context)
    return len(c & words(prompt)) / len(c) if c else 0.0


def check_channel(channel: str) -> str:
    base = channel.split(":", 1)[0]
    if channel in BASE_CHANNELS or (base in PREFIXED and len(channel) > len(base) + 1):
        return channel
    raise InvalidInput(f"channel {channel!r}", f"one of {BASE_CHANNELS} or adapter:NAME / variant:V:REPAIR")


def channel_key(channel: str, codec: str | None) -> str:
    """The value model's key: ``kv+int8``; ``kv`` alone for the lossless payload; the channel otherwise."""
    check_channel(channel)
    if codec is None or codec in ("raw", "") or channel != "kv":
        return channel
    return f"{channel}+{codec}"


def split_key(key: str) -> tuple[str, str | None]:
    """``kv+int8`` -> (``kv``, ``int8``); ``kv`` -> (``kv``, ``raw``); ``text_full`` -> (``text_full``, None)."""
    channel, _, codec = key.partition("+")
    check_channel(channel)
    if channel in ("kv", *PREFIXED) or channel.split(":")[0] in PREFIXED:
        return channel, codec or "raw"
    return channel, None


def channel_of_arm(arm: str) -> str | None:
    """The channel key an audit arm measured, or None for a control arm (records.jsonl ``arm`` field)."""
    if arm in ("none", "text_message", "text_full", "kv"):
        return arm
    base, _, dial = arm.partition(":")
    if base == "kv_codec":
        codec = dial.split("-g")[0]  # int8-g32 and int8 are one codec family here
        return "kv" if codec in ("raw", "fp32") else f"kv+{codec}"
    if base == "kv_adapter":
        return f"adapter:{dial}"
    if base == "kv_variant":
        return f"variant:{dial}"
    return None


@dataclass(frozen=True, slots=True)
class Features:
    overlap: float
    context_tokens: int
    quantized: bool = False

    def __post_init__(self):
        if not (isinstance(self.overlap, int | float) and 0.0 <= self.overlap <= 1.0):
            raise InvalidInput(f"overlap {self.overlap!r}", "a share between 0 and 1")
        if not (isinstance(self.context_tokens, int) and self.context_tokens >= 1):
            raise InvalidInput(f"context_tokens {self.context_tokens!r}", "an integer >= 1")

    @classmethod
    def of(cls, context: str, prompt: str, context_tokens: int, engine: str = "fp32") -> Features:
        return cls(overlap(context, prompt), context_tokens, quantized_engine(engine))

    @property
    def sees_context(self) -> bool:
        """The receiver's prompt holds most of the context (the shared regime's signature)."""
        return self.overlap >= SEES_CONTEXT

    def vector(self) -> tuple[float, float, float, float]:
        """(overlap, sees_context, log2 context tokens, quantized) — the value model's inputs before scaling."""
        return (float(self.overlap), float(self.sees_context), math.log2(self.context_tokens), float(self.quantized))
