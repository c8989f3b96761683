"""``decide(request, slo, value, cost) -> Decision``: which channel one request should take, and why.

The rules, in order (each one line in ``Decision.reason``):

1. **Compatibility.** ``kv`` (any codec) only when the receiver can prove the sender's cache is its own
   kind (``Request.compatible``: same model fingerprint and engine); an incompatible pair relays a
   cache only through a named adapter it holds (``Request.adapters``: ``adapter:NAME`` /
   ``variant:V:REPAIR`` channels). Text channels and ``none`` are always possible.
2. **Break-even.** A kv codec whose break-even bandwidth (``CostProfile.break_even_mbps``) is above
   the request's link is dropped: over that link ``text_full`` is faster with the same tokens.
3. **Value.** Each remaining channel's P(success) comes from the value model; a channel without
   audit records, or whose fitted range does not cover the request (``extrapolated``), is skipped
   unless nothing else is left.
4. **SLO.** Channels whose predicted latency exceeds ``Slo.latency_s`` are dropped (if none meets it,
   the fastest channel is taken and the reason says so).
5. **Choice.** The best expected success wins — but a gain the audit cannot tell from zero is not
   paid for: among the channels not credibly worse than the best (the upper end of the paired
   bootstrap interval of ``P_c − P_best`` reaches ``-Slo.tolerance``), the fastest is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrelay.core.errors import InvalidInput
from kvrelay.policy.cost import CostProfile, Link
from kvrelay.policy.features import Features, channel_key, check_channel
from kvrelay.policy.value import Prediction, ValueModel

DEFAULT_CODECS = ("raw", "int8")
EQUIVALENCE_MARGIN = 0.028  # the audit's TOST margin (``kvrelay audit`` --margin default), as a share


@dataclass(frozen=True, slots=True)
class Request:
    """What a router knows before relaying (``Features.of`` computes ``features`` from the texts)."""

    features: Features
    prompt_tokens: int = 16
    answer_tokens: int = 0
    compatible: bool = True  # receiver and sender share model fingerprint and engine
    adapters: tuple[str, ...] = ()  # adapter:NAME / variant:V:R channels available for this pair
    codecs: tuple[str, ...] = DEFAULT_CODECS  # the kv codecs the sender may use
    link: Link | None = None  # None: in process (or the profile's link)
    text_message: bool = False  # the sender may write a note instead (costs its decode)

    def __post_init__(self):
        object.__setattr__(self, "adapters", tuple(self.adapters))
        object.__setattr__(self, "codecs", tuple(self.codecs))
        for a in self.adapters:
            if check_channel(a).split(":")[0] not in ("adapter", "variant"):
                raise InvalidInput(f"adapter channel {a!r}", "adapter:NAME or variant:V:REPAIR")
        if self.prompt_tokens < 0 or self.answer_tokens < 0:
            raise InvalidInput("negative token counts", "prompt_tokens and answer_tokens >= 0")


@dataclass(frozen=True, slots=True)
class Slo:
    """``latency_s``: the receiver's budget (None: none); ``tolerance``: a loss in P(success) the caller
    accepts for speed — by default the audit's equivalence margin (±2.8 points, docs/audit.md): a gain
    that small, or one the audit cannot tell from zero, is not paid for with latency."""

    latency_s: float | None = None
    tolerance: float = EQUIVALENCE_MARGIN

    def __post_init__(self):
        if self.latency_s is not None and not self.latency_s > 0:
            raise InvalidInput(f"latency SLO {self.latency_s!r} s", "a budget > 0 seconds, or None")
        if not 0.0 <= self.tolerance <= 1.0:
            raise InvalidInput(f"tolerance {self.tolerance!r}", "a share of success between 0 and 1")


@dataclass(frozen=True, slots=True)
class Option:
    channel: str
    codec: str | None
    success: Prediction
    latency_s: float

    @property
    def key(self) -> str:
        return channel_key(self.channel, self.codec)


@dataclass(frozen=True, slots=True)
class Decision:
    channel: str  # none | text_message | text_full | kv | adapter:NAME | variant:V:R
    codec: str | None  # the kv codec (raw, int8, ...); None for text and none
    reason: str  # one line
    expected_success: float = math.nan
    latency_s: float = math.nan
    considered: tuple[Option, ...] = ()

    def __post_init__(self):
        check_channel(self.channel)
        if "\n" in self.reason or not self.reason:
            raise InvalidInput(f"decision reason {self.reason!r}", "one non-empty line")

    @property
    def relays_cache(self) -> bool:
        return self.channel == "kv" or self.channel.split(":")[0] in ("adapter", "variant")

    def to_dict(self) -> dict:
        return {"channel": self.channel, "codec": self.codec, "reason": self.reason,
                "expected_success": self.expected_success, "latency_s": self.latency_s}


def not_credibly_worse(diff: Prediction, tolerance: float = EQUIVALENCE_MARGIN) -> bool:
    """Rule 5's test, for channels here and for models in the serving scheduler: ``diff`` is P_c − P_best
    with its bootstrap interval; ``c`` stays a candidate when the interval's upper end reaches
    ``-tolerance`` (the audit cannot show it worse by more than the tolerance)."""
    return diff.ci_high >= -tolerance


def candidates(req: Request, cost: CostProfile) -> tuple[list[tuple[str, str | None]], list[str]]:
    """(channel, codec) pairs rules 1–2 allow, and one note per rule that removed something."""
    out: list[tuple[str, str | None]] = [("none", None), ("text_full", None)]
    if req.text_message:
        out.append(("text_message", None))
    notes = []
    link = req.link if req.link is not None else cost.link
    if req.compatible:
        for codec in req.codecs:
            be = cost.break_even_mbps(codec, req.features.context_tokens, req.prompt_tokens)
            if link is not None and link.mbps < be:
                notes.append(f"kv+{codec} off: link {link.mbps:g} Mbit/s < break-even {be:.3g} Mbit/s")
                continue
            out.append(("kv", codec))
    else:
        notes.append("no kv: the pair is not compatible" + (" (adapters only)" if req.adapters else ""))
    for a in req.adapters:
        if link is not None:
            be = cost.break_even_mbps("raw", req.features.context_tokens, req.prompt_tokens)
            if link.mbps < be:
                notes.append(f"{a} off: link {link.mbps:g} Mbit/s < break-even {be:.3g} Mbit/s")
                continue
        out.append((a, "raw"))
    return out, notes


def decide(req: Request, slo: Slo, value: ValueModel, cost: CostProfile) -> Decision:
    """The channel for one request (module docstring for the rules)."""
    pairs, notes = candidates(req, cost)
    link = req.link if req.link is not None else cost.link
    opts, skipped = [], []
    for channel, codec in pairs:
        key = channel_key(channel, codec)
        if key not in value.fits:
            skipped.append(f"{key}: no audit records")
            continue
        pred = value.predict(key, req.features)
        if pred.extrapolated:
            skipped.append(f"{key}: outside its audited range")
            continue
        lat = cost.latency_s(channel, codec, context_tokens=req.features.context_tokens,
                             prompt_tokens=req.prompt_tokens, answer_tokens=req.answer_tokens, link=link)
        opts.append(Option(channel, codec, pred, lat))
    if not opts:
        raise InvalidInput("no channel has audit records covering this request (" + "; ".join(skipped) + ")",
                           "a value model fitted on records that include none or text_full")
    in_slo = [o for o in opts if slo.latency_s is None or o.latency_s <= slo.latency_s]
    slo_note = ""
    if not in_slo:
        fastest = min(opts, key=lambda o: o.latency_s)
        in_slo, slo_note = [fastest], f"; no channel meets the SLO {slo.latency_s:g} s, fastest taken"
    best = max(in_slo, key=lambda o: o.success.mean)
    as_good = [o for o in in_slo if o is best
               or not_credibly_worse(value.difference(o.key, best.key, req.features), slo.tolerance)]
    pick = min(as_good, key=lambda o: (o.latency_s, -o.success.mean))
    why = (f"{pick.key}: P(success) {pick.success.mean:.2f} [{pick.success.ci_low:.2f}, {pick.success.ci_high:.2f}], "
           f"{pick.latency_s:.2f} s")
    if pick is not best:
        d = value.difference(best.key, pick.key, req.features)
        why += f"; {best.key} is {100 * d.mean:+.0f} pts [{100 * d.ci_low:+.0f}, {100 * d.ci_high:+.0f}] but slower"
    why += f" (overlap {req.features.overlap:.2f}, {req.features.context_tokens} tokens"
    why += f", link {link.mbps:g} Mbit/s)" if link is not None else ", in process)"
    if notes or skipped:
        why += "; " + "; ".join(notes + skipped)
    why += slo_note
    return Decision(pick.channel, pick.codec, why, pick.success.mean, pick.latency_s, tuple(opts))
