"""``kvrelay doctor``: what a link needs and what is wrong with one, as named checks with measured figures.

Three diagnoses, one shape of result (``Report``): a list of ``Check`` (name, passed, value, hint)
and, when something failed, its ``cause`` — one word from ``CAUSES`` naming the first failing check in
the order below, so that a fault which also upsets later checks is named once, where it starts.

* ``doctor_models.diagnose_models`` — two models side by side and what relay between them needs;
* ``doctor_payload.diagnose_payload`` — one payload (file or store key) against a receiver's model;
* ``doctor_link.diagnose_link`` — a live link: compatibility, layer map, positions, precision,
  masks, engine-mode drift and the echo test, each measured on a probe text.

Docs: docs/doctor.md; JSON fields: docs/json.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Causes in the order a link's faults are looked for: the first failing check names the cause.
CAUSES = ("integrity", "model", "tokenizer", "geometry", "engine", "codec", "layers", "layer_map",
          "position_offset", "precision", "mask", "echo")


@dataclass(frozen=True, slots=True)
class Check:
    """One diagnostic: ``passed`` is None when it could not run (``hint`` says why)."""

    name: str
    passed: bool | None
    value: float | int | str | None  # the measured figure (or the differing value), JSON-ready
    hint: str = ""  # what the figure means and, when failed, the fix
    cause: str = ""  # the ``CAUSES`` entry a failure of this check points to

    def __post_init__(self):
        if not self.name:
            raise ValueError("a check needs a name")
        if self.cause and self.cause not in CAUSES:
            raise ValueError(f"cause {self.cause!r} is not one of {CAUSES}")
        if self.passed is False and not self.cause:
            raise ValueError(f"check {self.name!r} failed without naming a cause")

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "value": self.value, "hint": self.hint}


@dataclass(frozen=True, slots=True)
class Report:
    """The checks of one diagnosis, and facts beside them (``facts``: config rows, payload fields, ...)."""

    kind: str  # "models" | "payload" | "link"
    checks: tuple[Check, ...]
    facts: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "checks", tuple(self.checks))

    @property
    def passed(self) -> bool:
        """Every check that ran passed."""
        return all(c.passed is not False for c in self.checks)

    @property
    def cause(self) -> str | None:
        """The first failing check's cause in ``CAUSES`` order, or None when nothing failed."""
        return first_cause(self.checks)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check {name!r}; checks: {[c.name for c in self.checks]}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "passed": self.passed, "cause": self.cause,
                "checks": [c.to_json() for c in self.checks], **self.facts}


def first_cause(checks: Sequence[Check]) -> str | None:
    failed = {c.cause for c in checks if c.passed is False}
    return next((c for c in CAUSES if c in failed), None)


def skipped(name: str, why: str) -> Check:
    """A check that could not run because an earlier one failed."""
    return Check(name, None, None, f"not run: {why}")
