"""One audit task: what the sender reads, what the receiver is asked, and how the answer is scored.

The two regimes (docs/audit.md):

- ``private`` — ``context`` (passage, records) goes to the sender only; ``prompt`` holds just the
  question, so the receiver can only answer with information relayed to it.
- ``shared`` — ``context`` is the problem itself (question + choices) and ``prompt`` repeats the full
  problem; the relay can only carry the sender's reading of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrelay.audit.tasks.scoring import SCORERS, choice_letters

REGIMES = ("private", "shared")

Covariate = float | int | str


def approx_tokens(text: str) -> int:
    """A tokenizer-free length estimate: 1.3 × whitespace words (the usual English BPE ratio).

    Numbers and code tokenize denser than this, so treat it as a length *rank*, not a count.
    """
    return round(1.3 * len(text.split()))


@dataclass(frozen=True, slots=True)
class Task:
    """An audit item. ``covariates`` are pre-treatment descriptors (length, position, dials) used for CATE.

    ``covariates`` may be given as a mapping; it is stored as a tuple of ``(name, value)`` pairs
    sorted by name so that the task stays hashable. ``choices`` holds the option *texts* of a
    multiple-choice task (their letters are A, B, C, ... in order); ``answers`` then holds the letter.
    """

    id: str
    task: str
    regime: str
    context: str
    prompt: str
    answers: tuple[str, ...]
    scorer: str
    covariates: tuple[tuple[str, Covariate], ...] = ()
    choices: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        covs = self.covariates.items() if isinstance(self.covariates, Mapping) else self.covariates
        object.__setattr__(self, "covariates", tuple(sorted((str(k), v) for k, v in covs)))
        object.__setattr__(self, "answers", tuple(self.answers))
        object.__setattr__(self, "choices", tuple(self.choices))
        for name in ("id", "task", "context", "prompt"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Task.{name} must be a non-empty string, got {value!r}")
        if self.regime not in REGIMES:
            raise ValueError(f"Task.regime must be one of {REGIMES}, got {self.regime!r} (task {self.id})")
        if not self.answers or not all(isinstance(a, str) and a.strip() for a in self.answers):
            raise ValueError(f"Task.answers must be non-empty strings, got {self.answers!r} (task {self.id})")
        if self.scorer not in SCORERS:
            raise ValueError(f"Task.scorer must be one of {sorted(SCORERS)}, got {self.scorer!r} (task {self.id})")
        names = [k for k, _ in self.covariates]
        if len(set(names)) != len(names):
            raise ValueError(f"Task.covariates has duplicate names {names} (task {self.id})")
        for k, v in self.covariates:
            if not isinstance(v, int | float | str):
                raise ValueError(f"covariate {k!r} must be int, float or str, got {type(v).__name__} (task {self.id})")
        if self.scorer == "choice_letter":
            letters = choice_letters(len(self.choices))
            if len(self.choices) < 2 or not all(c.strip() for c in self.choices):
                raise ValueError(f"a choice_letter task needs ≥ 2 non-empty choices, got {self.choices!r} ({self.id})")
            if not set(self.answers) <= set(letters):
                raise ValueError(f"answers {self.answers} are not among the choice letters {letters} ({self.id})")

    def covariate_dict(self) -> dict[str, Covariate]:
        return dict(self.covariates)
