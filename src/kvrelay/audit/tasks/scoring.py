"""Scorers: pure functions ``(generation, task) -> float in [0, 1]``, looked up by name.

Which set uses which scorer (``Task.scorer``), and why:

- ``qa_success`` — extractive / short free-form QA (``gen``, ``squad``, ``drop``, ``coqa``). A 0.5B
  model answering in a few greedy tokens rarely reproduces the gold span exactly ("in 1754" for
  "1754", "Asta the fish" for "Asta"), so exact match under-counts real successes. A trial succeeds
  when a normalised gold appears in the normalised answer at word boundaries (``contains``) *or*
  the token F1 with a gold is ≥ 0.5. The runner caps the answer length, which keeps ``contains``
  from rewarding answers that list the whole passage. ``exact_match`` and ``token_f1`` are
  available as secondary outcomes (``score(task, text, scorer="token_f1")``).
- ``choice_letter`` — multiple choice (``arc_*``, ``mmlu``, ``medqa``, ``openbookqa``).
- ``final_number`` — GSM8K: the last number in the text, compared numerically.
- ``yes_no`` — BoolQ: the first yes/no (or true/false) word.

Normalisation is SQuAD's: lowercase, drop punctuation, drop the articles a/an/the, squeeze
whitespace.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.audit.tasks.task import Task

LETTERS = "ABCDEFGHIJ"
_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize(text: str) -> str:
    """SQuAD answer normalisation."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def choice_letters(n: int) -> str:
    if not 0 <= n <= len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} choices are supported, got {n}")
    return LETTERS[:n]


# ---- extractive QA -------------------------------------------------------------------------


def _normalized_golds(golds: Sequence[str]) -> list[str]:
    """Normalised golds, without those that normalise to nothing (a gold of "." matches no answer)."""
    return [n for g in golds if (n := normalize(g))]


def exact_match(generation: str, golds: Sequence[str]) -> float:
    pred = normalize(generation)
    return float(any(pred == g for g in _normalized_golds(golds)))


def _f1(pred: list[str], gold: list[str]) -> float:
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def token_f1(generation: str, golds: Sequence[str]) -> float:
    """SQuAD token F1, maximised over the golds."""
    pred = normalize(generation).split()
    return max((_f1(pred, g.split()) for g in _normalized_golds(golds)), default=0.0)


def contains(generation: str, golds: Sequence[str]) -> float:
    """1 if some normalised gold occurs in the normalised generation on word boundaries ("23" ∉ "1234")."""
    pred = f" {normalize(generation)} "
    return float(any(f" {g} " in pred for g in _normalized_golds(golds)))


def qa_success(generation: str, golds: Sequence[str], f1_threshold: float = 0.5) -> float:
    """The primary success outcome for extractive QA: ``contains`` or token F1 ≥ ``f1_threshold``."""
    return float(contains(generation, golds) == 1.0 or token_f1(generation, golds) >= f1_threshold)


# ---- multiple choice ------------------------------------------------------------------------


def extract_choice(generation: str, choices: Sequence[str]) -> str | None:
    """The choice letter a generation commits to, or None.

    In order: an explicit "answer is (C)" / "Answer: C"; a letter opening the reply ("C", "(C)",
    "C. ..."); the choice whose text appears earliest (longest on ties); the first standalone
    capital letter in range, where "A" followed by a lowercase word is read as the article.
    """
    letters = choice_letters(len(choices))
    text = generation.strip()
    if not text:
        return None
    cls = f"[{letters}]"
    m = re.search(rf"(?i:answer)\s*(?:(?i:is)\s*:?|:)?\s*(?:(?i:option|choice)\s*)?\(?({cls})\)?(?![A-Za-z0-9])", text)
    if m:
        return m.group(1)
    m = re.match(rf"\(?({cls})(?:[).:,]|\s|$)", text)
    if m and not (m.group(1) == "A" and re.match(r"A\s+(?!(?:is|was)\b)[a-z]", text)):
        return m.group(1)
    norm = f" {normalize(text)} "
    hits = []
    for letter, choice in zip(letters, choices, strict=True):
        c = normalize(choice)
        pos = norm.find(f" {c} ") if c else -1
        if pos >= 0:
            hits.append((pos, -len(c), letter))
    if hits:
        return min(hits)[2]
    for m in re.finditer(rf"(?<![A-Za-z0-9])({cls})(?![A-Za-z0-9'])", text):
        if m.group(1) == "A" and re.match(r"\s+(?!(?:is|was)\b)[a-z]", text[m.end():]):
            continue
        return m.group(1)
    return None


def choice_letter(generation: str, golds: Sequence[str], choices: Sequence[str]) -> float:
    return float(extract_choice(generation, choices) in set(golds))


# ---- numbers and booleans -------------------------------------------------------------------


def parse_number(text: str) -> float | None:
    """The number written in ``text`` ("$1,234" → 1234.0), or None."""
    m = _NUMBER.search(text)
    return float(m.group(0).replace(",", "")) if m else None


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def final_number(generation: str, golds: Sequence[str]) -> float:
    """GSM8K: the last number in the generation equals a gold numerically (commas ignored)."""
    pred = last_number(generation)
    if pred is None:
        return 0.0
    for g in golds:
        gold = parse_number(g)
        if gold is not None and abs(pred - gold) <= 1e-6 * max(1.0, abs(gold)):
            return 1.0
    return 0.0


_YES_NO = {"yes": "yes", "true": "yes", "no": "no", "false": "no"}


def yes_no(generation: str, golds: Sequence[str]) -> float:
    """BoolQ: the first yes/no/true/false word of the generation matches the gold."""
    for word in normalize(generation).split():
        if word in _YES_NO:
            return float(_YES_NO[word] in {normalize(g) for g in golds})
    return 0.0


# ---- registry -------------------------------------------------------------------------------

SCORERS: dict[str, Callable[[str, Task], float]] = {
    "exact_match": lambda gen, t: exact_match(gen, t.answers),
    "token_f1": lambda gen, t: token_f1(gen, t.answers),
    "contains": lambda gen, t: contains(gen, t.answers),
    "qa_success": lambda gen, t: qa_success(gen, t.answers),
    "choice_letter": lambda gen, t: choice_letter(gen, t.answers, t.choices),
    "final_number": lambda gen, t: final_number(gen, t.answers),
    "yes_no": lambda gen, t: yes_no(gen, t.answers),
}


def score(task: Task, generation: str, scorer: str | None = None) -> float:
    """Score ``generation`` for ``task`` with its own scorer, or with ``scorer`` (a secondary outcome)."""
    name = scorer or task.scorer
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; available: {sorted(SCORERS)}")
    if name == "choice_letter" and not task.choices:
        raise ValueError(f"scorer 'choice_letter' needs a task with choices; {task.id} has none")
    value = SCORERS[name](generation, task)
    assert 0.0 <= value <= 1.0, (name, value)
    return value
