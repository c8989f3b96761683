"""The audit's vocabulary, defined once: arm names, contrasts, outcomes, regimes, significance level.

Arms (what the receiver gets in place of the relayed cache; docs/audit.md has the table):

* plain arms, no dial — ``PLAIN_ARMS``, in report order;
* dial arms ``BASE:DIAL`` — ``kv_noise:σ``, ``kv_layers:SPEC``, ``kv_tokens:first|last|topk:F``,
  ``kv_codec:NAME``;
* adapter arms ``kv_adapter:NAME`` and its control ``kv_adapter_mismatched:NAME`` — another model
  (the sharer of adapter artefact NAME) reads the context and its cache reaches the receiver
  through that adapter; the control sends the sharer's length-matched cache of another task;
* variant arms ``kv_variant:NAME:REPAIR`` and ``kv_variant_mismatched:NAME:REPAIR`` — the sender is
  ``BASE+NAME``, a fine-tuned variant of the audited model's base (``models.variants``), and its
  cache reaches the receiver through the repair the arm names: ``raw`` (accepted unchanged) or a
  recompute spec (``tokens=0.1``, ``layers=0-3``, ``recompute:layers=0-1,tokens=0.05``; ``fuse.repair``).
  A variant arm without a repair is refused: a sibling's cache is never used silently.

A contrast is a paired difference ``arm A − arm B``; success effects are in points (score × 100).
Adapter arms add their own contrasts per NAME (``adapter_contrasts``): ``adapter_pairing:NAME``
(matched − mismatched sharer cache) and ``adapter_vs_none:NAME``; variant arms per ``NAME:REPAIR``:
``variant_pairing:NAME:REPAIR`` (matched − mismatched variant cache) and ``variant_vs_kv:NAME:REPAIR``
(the variant's repaired cache − the audited model's own, ``kv``: what the fine-tune's divergence
costs after that repair; with ``raw``, what it costs unrepaired).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

ALPHA = 0.05  # every test's level; TOST reports the 1 - 2*ALPHA = 90% interval
REGIMES = ("private", "shared")
OUTCOMES = ("success", "latency_s", "relay_bytes", "prefill_tokens")

PLAIN_ARMS = ("none", "text_message", "text_full", "kv", "kv_mismatched", "kv_zeroed", "kv_random")
DIAL_ARMS = ("kv_noise", "kv_layers", "kv_tokens", "kv_codec", "kv_partial", "kv_partial_mismatched")
#: receiver-driven partial relay (``kv.partial``) of the matched payload / of the length-matched mismatched one,
#: the positions chosen by the receiver's own prompt in both; dial: the fraction of positions
PARTIAL_ARMS = ("kv_partial", "kv_partial_mismatched")
#: arms whose cache another model made, through adapter artefact NAME (their dial)
ADAPTER_ARMS = ("kv_adapter", "kv_adapter_mismatched")
#: arms whose cache a fine-tuned sibling made, through a named repair (dial ``NAME:REPAIR``)
VARIANT_ARMS = ("kv_variant", "kv_variant_mismatched")
RAW_REPAIR = "raw"  # a variant arm's repair that accepts the sibling's cache unchanged
#: arms whose payload is another task's reading (length-matched partner)
MISMATCH_ARMS = ("kv_mismatched", "kv_layers", "kv_partial_mismatched")
#: adapter contrast family -> (arm A base, arm B): B None means the plain arm ``none``
ADAPTER_CONTRASTS = {"adapter_pairing": ("kv_adapter", "kv_adapter_mismatched"), "adapter_vs_none": ("kv_adapter", None)}
#: variant contrast family -> (arm A base, arm B): B a plain arm, or a base that takes A's dial
VARIANT_CONTRASTS = {"variant_pairing": ("kv_variant", "kv_variant_mismatched"), "variant_vs_kv": ("kv_variant", "kv")}
#: partial-relay contrast family -> (arm A base, arm B)
PARTIAL_CONTRASTS = {"partial_pairing": ("kv_partial", "kv_partial_mismatched"), "partial_vs_kv": ("kv_partial", "kv")}
#: every dialed contrast family -> (arm A base, arm B)
CHANNEL_CONTRASTS = {**ADAPTER_CONTRASTS, **VARIANT_CONTRASTS, **PARTIAL_CONTRASTS}
#: arms whose input depends on the seed (random draws); the others give one answer per task
STOCHASTIC_ARMS = ("kv_random", "kv_noise")

#: contrast name -> (arm A, arm B); the effect is A - B, in this (report) order.
CONTRASTS: dict[str, tuple[str, str]] = {
    "pairing": ("kv", "kv_mismatched"),
    "presence": ("kv_mismatched", "none"),
    "kv_vs_text_message": ("kv", "text_message"),
    "kv_vs_text_full": ("kv", "text_full"),
    "kv_vs_none": ("kv", "none"),
}

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
TOKEN_MODES = ("first", "last", "topk")


@dataclass(frozen=True, slots=True)
class ArmName:
    """A parsed arm name: ``kv_tokens:last:0.2`` -> base ``kv_tokens``, dial ``last:0.2``."""

    name: str
    base: str
    dial: str | None = None

    @property
    def needs_mismatch(self) -> bool:
        return self.base in MISMATCH_ARMS

    @property
    def stochastic(self) -> bool:
        return self.base in STOCHASTIC_ARMS

    @property
    def adapter(self) -> str | None:
        """The adapter artefact an adapter arm goes through (its dial); None for every other arm."""
        return self.dial if self.base in ADAPTER_ARMS else None

    @property
    def variant(self) -> str | None:
        """The fine-tuned variant (adapter name or folder) whose cache a variant arm relays; None otherwise."""
        return self.dial.partition(":")[0] if self.base in VARIANT_ARMS else None

    @property
    def repair(self) -> str | None:
        """A variant arm's repair: ``raw`` or a recompute spec; None for every other arm."""
        return self.dial.partition(":")[2] if self.base in VARIANT_ARMS else None

    @property
    def channel(self) -> str | None:
        """The sharer a cross-model arm reads through: its adapter artefact, or ``variant:NAME``."""
        if self.base in ADAPTER_ARMS:
            return self.dial
        return f"variant:{self.variant}" if self.base in VARIANT_ARMS else None

    @property
    def mismatched_control(self) -> bool:
        """A cross-model arm's control: the sharer's length-matched reading of another task."""
        return self.base in ("kv_adapter_mismatched", "kv_variant_mismatched")


def arm_help() -> str:
    return (f"{', '.join(PLAIN_ARMS)}, kv_noise:SIGMA, kv_layers:SPEC, kv_tokens:{'|'.join(TOKEN_MODES)}:FRACTION, "
            "kv_codec:NAME, kv_partial:FRACTION, kv_partial_mismatched:FRACTION, kv_adapter:ARTEFACT, kv_adapter_mismatched:ARTEFACT, kv_variant:NAME:REPAIR, "
            "kv_variant_mismatched:NAME:REPAIR (REPAIR: raw or tokens=F / layers=A-B)")


def parse_arm(name: str, *, strict: bool = True) -> ArmName:
    """Parse and validate an arm name; ``ValueError`` saying what was expected otherwise.

    ``strict`` (building arms to run): the base must be a known arm and its dial valid.
    Not strict (reading records): any well-formed ``base[:dial]`` passes, so records of arms added
    later still load; known bases are still checked.
    """
    if not isinstance(name, str):
        raise ValueError(f"arm must be a string, got {type(name).__name__}")
    text = name.strip()
    base, sep, dial = text.partition(":")
    if not _NAME.match(base):
        raise ValueError(f"malformed arm name {name!r}: expected one of {arm_help()}")
    if sep and (not dial or any(not part for part in dial.split(":"))):
        raise ValueError(f"arm {name!r} has an empty dial after ':'")
    if base in PLAIN_ARMS and sep:
        raise ValueError(f"arm {base!r} takes no dial, got {name!r}")
    if base in DIAL_ARMS + ADAPTER_ARMS + VARIANT_ARMS and not sep:
        raise ValueError(f"arm {name!r} needs a dial; expected one of {arm_help()}")
    if base not in PLAIN_ARMS and base not in DIAL_ARMS + ADAPTER_ARMS + VARIANT_ARMS and strict:
        raise ValueError(f"unknown arm {name!r}; expected one of {arm_help()}")
    if base in DIAL_ARMS:
        _check_dial(text, base, dial)
    if base in VARIANT_ARMS:
        _check_repair(text, base, dial)
    return ArmName(text, base, dial if sep else None)


def _check_dial(name: str, base: str, dial: str) -> None:
    if base == "kv_noise":
        sigma = as_float(dial)
        if sigma is None or sigma < 0:
            raise ValueError(f"{name}: kv_noise needs a non-negative σ")
    elif base == "kv_tokens":
        how, _, frac = dial.partition(":")
        f = as_float(frac)
        if how not in TOKEN_MODES or f is None or not 0 < f <= 1:
            raise ValueError(f"{name}: expected kv_tokens:{'|'.join(TOKEN_MODES)}:FRACTION in (0, 1]")
    elif base in PARTIAL_ARMS:
        f = as_float(dial)
        if f is None or not 0 < f <= 1:
            raise ValueError(f"{name}: expected {base}:FRACTION with FRACTION in (0, 1] (the share of positions)")
    elif base == "kv_codec":
        from kvrelay.kv.codecs import parse

        try:
            parse(dial)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def _check_repair(name: str, base: str, dial: str) -> None:
    variant, _, repair = dial.partition(":")
    want = (f"{base}:{variant or 'NAME'}:REPAIR with REPAIR {RAW_REPAIR} (the sibling's cache unchanged) or a "
            "recompute spec (tokens=0.1, layers=0-3, layers=0-1,tokens=0.05)")
    if not repair:
        raise ValueError(f"{name}: a fine-tuned variant's cache is used only through a named repair; expected {want}")
    if repair == RAW_REPAIR:
        return
    from kvrelay.fuse.repair import parse_repair

    try:
        spec = parse_repair(repair)
    except ValueError as e:
        raise ValueError(f"{name}: {e}; expected {want}") from None
    if spec.auto_layers is not None:
        raise ValueError(f"{name}: layers=auto:K needs a deviation profile, which audit arms do not take; name "
                         f"the block (layers=A-B); expected {want}")


def dial_family(arm: str) -> tuple[str, str, float | None] | None:
    """``(family, dose label, numeric dose or None)`` for a dial arm, None for a plain arm.

    The family keeps every dial segment but the last: ``kv_tokens:last:0.2`` is family
    ``kv_tokens:last`` at dose ``0.2``; ``kv_codec:int8`` is family ``kv_codec`` at dose ``int8``.
    """
    a = parse_arm(arm, strict=False)
    if a.dial is None or a.base in ADAPTER_ARMS + VARIANT_ARMS:  # an adapter's or variant's name is not a dose
        return None
    head, _, last = a.dial.rpartition(":")
    family = f"{a.base}:{head}" if head else a.base
    return family, last, as_float(last)


def as_float(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def arm_order(arms) -> list[str]:
    """Plain arms in ``PLAIN_ARMS`` order, then the others sorted."""
    arms = set(arms)
    return [a for a in PLAIN_ARMS if a in arms] + sorted(arms - set(PLAIN_ARMS))


def arm_rank(arm: str) -> tuple[int, str]:
    return (PLAIN_ARMS.index(arm) if arm in PLAIN_ARMS else len(PLAIN_ARMS), arm)


def _partner(other: str | None, dial: str) -> str:
    """Arm B of a dialed contrast: ``none`` for None, a plain arm as is, else ``other:dial``."""
    if other is None:
        return "none"
    return other if other in PLAIN_ARMS else f"{other}:{dial}"


def adapter_contrasts(arms) -> dict[str, tuple[str, str]]:
    """Contrasts of the cross-model arms among ``arms``: ``adapter_pairing:NAME`` and ``adapter_vs_none:NAME``
    per adapter arm, ``variant_pairing:NAME:REPAIR`` and ``variant_vs_kv:NAME:REPAIR`` per variant arm."""
    out = {}
    for arm in sorted(set(arms)):
        a = parse_arm(arm, strict=False)
        for family, (base, other) in CHANNEL_CONTRASTS.items():
            if a.base == base:
                out[f"{family}:{a.dial}"] = (arm, _partner(other, a.dial))
    return out


def contrasts_for(arms) -> dict[str, tuple[str, str]]:
    """Every contrast that can be formed among ``arms``' names: ``CONTRASTS`` then the adapter ones."""
    return {**CONTRASTS, **adapter_contrasts(arms)}


def contrast_arms(contrast: str) -> tuple[str, str] | None:
    """(arm A, arm B) of a contrast name, fixed or adapter (``adapter_pairing:NAME``); None if unknown."""
    if contrast in CONTRASTS:
        return CONTRASTS[contrast]
    family, sep, name = contrast.partition(":")
    if not sep or family not in CHANNEL_CONTRASTS:
        return None
    a, b = CHANNEL_CONTRASTS[family]
    return f"{a}:{name}", _partner(b, name)


def contrast_rank(contrast: str) -> int:
    order = tuple(CONTRASTS)
    if contrast in order:
        return order.index(contrast)
    family = contrast.partition(":")[0]
    families = tuple(CHANNEL_CONTRASTS)
    return len(order) + (families.index(family) if family in families else len(families))
