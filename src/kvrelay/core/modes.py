"""Engine mode names: ``PREFILL+DECODE`` (``bf16+int8``), or a bare decode name for fp32 prefill.

The one place a mode's name is put together and taken apart (``models.engine`` builds the modes from
it, ``policy.features`` reads a receiver's decode precision from it).
"""

from __future__ import annotations

PREFILLS = ("fp32", "bf16")  # precisions of multi-token (prefill) GEMMs
DECODES = ("fp32", "fp32p", "fp16w", "bf16", "fp16", "int8", "int4")  # precisions of one-token calls
SEP = "+"


def mode_name(prefill: str, decode: str) -> str:
    """The name of the mode with these phases: ``decode`` alone for fp32 prefill, else ``prefill+decode``."""
    if prefill not in PREFILLS or decode not in DECODES:
        raise ValueError(f"expected a prefill in {PREFILLS} and a decode in {DECODES}, got {prefill!r}, {decode!r}")
    return decode if prefill == "fp32" else f"{prefill}{SEP}{decode}"


def split_mode(name: str) -> tuple[str, str]:
    """(prefill, decode) of mode ``name``; ValueError for a name ``mode_name`` does not make."""
    prefill, sep, decode = name.rpartition(SEP)
    out = (prefill, decode) if sep else ("fp32", decode)
    if out[0] not in PREFILLS or out[1] not in DECODES or mode_name(*out) != name:
        raise ValueError(f"engine mode {name!r}: expected DECODE or PREFILL{SEP}DECODE with PREFILL in "
                         f"{PREFILLS} (not fp32) and DECODE in {DECODES}")
    return out
