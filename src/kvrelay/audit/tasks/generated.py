"""Procedurally generated private tasks whose difficulty is a set of dials (the audit's covariates).

A document is a facility log: *facts* ("The access code for the blue vault is 4817."), *distractors*
(other numbers about the same or other holders: "The serial number of the blue vault is 2231."),
*hop links* ("The access code for the blue vault is the same as the access code for the red
locker.") and neutral filler sentences drawn from a small grammar that never uses a digit, a
colour, a holder or an attribute word. The receiver is asked "What is the access code for the blue
vault?", so the answer — a random four-digit number, distinct from every other number in the
document — cannot be guessed and does not occur in the prompt.

Dials (all recorded as covariates, plus the measured ``doc_words`` and ``answer_position_actual``):

- ``n_facts`` — access-code records in the document, the one that carries the answer included.
- ``n_distractors`` — other-attribute records; the first ones are about the queried holder itself.
- ``hops`` — links to follow from the queried holder to the holder whose code is written out.
- ``doc_tokens`` — target length (≈ 1.3 × words, see ``approx_tokens``); filler makes up the rest.
- ``answer_position`` — where the answer number sits, as a fraction of the document's characters;
  ``None`` draws it uniformly per task.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kvrelay.audit.tasks.task import Task, approx_tokens

TASK_SET = "gen"
_WORDS_PER_TOKEN = 1 / 1.3

COLORS = ("red", "blue", "green", "yellow", "orange", "purple", "silver", "golden", "black", "white",
          "gray", "brown", "crimson", "amber", "violet", "teal", "ivory", "scarlet", "copper", "bronze")
HOLDERS = ("vault", "locker", "safe", "cabinet", "strongbox", "chest", "crate", "drawer", "depot", "kiosk")
ENTITIES = tuple(f"{c} {h}" for c, h in itertools.product(COLORS, HOLDERS))
QUERIED = "access code"
OTHER_ATTRIBUTES = ("serial number", "room number", "shelf number", "inventory number",
                    "insurance number", "badge number")

_SUBJECTS = ("The maintenance crew", "A visiting inspector", "The night shift", "The facilities team",
             "A courier", "The new receptionist", "The site manager", "Two volunteers", "The cleaning staff",
             "An auditor from head office", "The security guard", "A contractor")
_VERBS = ("checked", "cleaned", "repainted", "reorganized", "inspected", "photographed", "swept",
          "measured", "tidied", "relabelled", "examined", "mopped")
_OBJECTS = ("the loading dock", "the stairwell lights", "the ventilation ducts", "the reception desk",
            "the filing shelves", "the east corridor", "the supply room", "the break room", "the west entrance",
            "the rooftop railings", "the meeting room chairs", "the parking area")
_TAILS = ("before the weekly meeting", "during a quiet afternoon", "after the delivery arrived",
          "as part of the routine schedule", "without any interruption", "while the rain continued outside",
          "on the request of the manager", "earlier than planned", "with some help from a colleague",
          "and reported nothing unusual")


@dataclass(frozen=True, slots=True)
class Dials:
    n_facts: int = 4
    n_distractors: int = 2
    hops: int = 0
    doc_tokens: int = 256
    answer_position: float | None = None

    def __post_init__(self) -> None:
        if self.n_facts < 1:
            raise ValueError(f"n_facts must be ≥ 1 (the answer is a fact), got {self.n_facts}")
        if self.n_distractors < 0 or self.hops < 0:
            raise ValueError(f"n_distractors and hops must be ≥ 0, got {self.n_distractors}, {self.hops}")
        if self.n_facts + self.hops > len(ENTITIES):
            raise ValueError(f"n_facts + hops must be ≤ {len(ENTITIES)} holders, got {self.n_facts + self.hops}")
        if self.n_distractors > len(ENTITIES) * len(OTHER_ATTRIBUTES) // 2:
            raise ValueError(f"n_distractors must be ≤ {len(ENTITIES) * len(OTHER_ATTRIBUTES) // 2}")
        if self.n_facts + self.n_distractors > 9000:
            raise ValueError("n_facts + n_distractors must be ≤ 9000 (distinct four-digit numbers)")
        if self.doc_tokens <= 0:
            raise ValueError(f"doc_tokens must be > 0, got {self.doc_tokens}")
        if self.answer_position is not None and not 0.0 <= self.answer_position <= 1.0:
            raise ValueError(f"answer_position must be in [0, 1] or None, got {self.answer_position}")

    @property
    def key(self) -> str:
        pos = "rand" if self.answer_position is None else f"{self.answer_position:g}"
        return f"f{self.n_facts}-d{self.n_distractors}-h{self.hops}-t{self.doc_tokens}-p{pos}"


def generate(n: int, seed: int = 0, *, name: str = TASK_SET, **dials) -> list[Task]:
    """``n`` tasks with the given dials (see ``Dials`` for names and defaults); deterministic in ``seed``.

    ``name`` is the task-set name the tasks carry (and prefix their ids with).
    """
    if n < 0:
        raise ValueError(f"n must be ≥ 0, got {n}")
    d = Dials(**dials)
    return [_make_task(d, seed, i, name) for i in range(n)]


def grid(n_per_cell: int, seed: int = 0, *, name: str = TASK_SET, **dial_values) -> list[Task]:
    """A full factorial design: ``n_per_cell`` tasks for every combination of the given dial values.

    Each dial takes a scalar or an iterable of values, e.g. ``grid(20, n_facts=[2, 8], hops=[0, 1, 2])``.
    """
    names = list(dial_values)
    levels = [_as_levels(dial_values[k]) for k in names]
    tasks: list[Task] = []
    for combo in itertools.product(*levels):
        tasks += generate(n_per_cell, seed, name=name, **dict(zip(names, combo, strict=True)))
    return tasks


def _as_levels(value) -> list:
    if isinstance(value, str) or not isinstance(value, Iterable):
        return [value]
    return list(value)


def _filler(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


def _make_task(d: Dials, seed: int, index: int, name: str = TASK_SET) -> Task:
    # A string seed is hashed with SHA-512 by ``random``: stable across runs and PYTHONHASHSEED.
    rng = random.Random(f"kvrelay-gen|{seed}|{d.key}|{index}")
    holders = rng.sample(ENTITIES, d.n_facts + d.hops)
    chain, others = holders[: d.hops + 1], holders[d.hops + 1:]  # chain[0] is asked, chain[-1] holds the code
    numbers = rng.sample(range(1000, 10000), d.n_facts + d.n_distractors)
    answer = str(numbers[0])

    answer_sentence = f"The {QUERIED} for the {chain[-1]} is {answer}."
    records = [f"The {QUERIED} for the {a} is the same as the {QUERIED} for the {b}."
               for a, b in itertools.pairwise(chain)]
    records += [f"The {QUERIED} for the {h} is {num}." for h, num in zip(others, numbers[1:d.n_facts], strict=True)]
    records += [f"The {attr} of the {h} is {num}."
                for (h, attr), num in zip(_distractor_slots(rng, chain[0], d.n_distractors),
                                          numbers[d.n_facts:], strict=True)]

    target_words = d.doc_tokens * _WORDS_PER_TOKEN
    words = sum(len(s.split()) for s in records) + len(answer_sentence.split())
    if words > 1.15 * target_words:
        raise ValueError(f"doc_tokens={d.doc_tokens} is too small for {d.key}: the records alone need "
                         f"≈ {approx_tokens(' '.join(records + [answer_sentence]))} tokens")
    sentences = list(records)
    while words < target_words:
        sentences.append(_filler(rng))
        words += len(sentences[-1].split())
    rng.shuffle(sentences)

    position = rng.random() if d.answer_position is None else d.answer_position
    k = _insertion_index(sentences, answer_sentence, answer, position)
    sentences.insert(k, answer_sentence)
    context = " ".join(sentences)
    actual = context.index(answer) / len(context)

    covariates = asdict(d) | {"answer_position": round(position, 4), "answer_position_actual": round(actual, 4),
                              "doc_words": len(context.split())}
    return Task(
        id=f"{name}/{seed}/{d.key}/{index}",
        task=name,
        regime="private",
        context=context,
        prompt=f"Question: What is the {QUERIED} for the {chain[0]}?\nAnswer with the number only.",
        answers=(answer,),
        scorer="qa_success",
        covariates=covariates,
    )


def _distractor_slots(rng: random.Random, target: str, n: int) -> list[tuple[str, str]]:
    """``n`` distinct (holder, attribute) pairs: the queried holder's own other attributes first."""
    own = [(target, a) for a in OTHER_ATTRIBUTES]
    rng.shuffle(own)
    if n <= len(own):
        return own[:n]
    pool = [(h, a) for h in ENTITIES if h != target for a in OTHER_ATTRIBUTES]
    return own + rng.sample(pool, n - len(own))


def _insertion_index(sentences: list[str], answer_sentence: str, answer: str, position: float) -> int:
    """The index at which inserting ``answer_sentence`` puts ``answer`` closest to ``position`` (chars)."""
    total = sum(len(s) for s in sentences) + len(answer_sentence) + len(sentences)  # + joining spaces
    within = answer_sentence.index(answer)
    best, best_err, prefix = 0, float("inf"), 0
    for k in range(len(sentences) + 1):
        err = abs((prefix + within) / total - position)
        if err < best_err:
            best, best_err = k, err
        if k < len(sentences):
            prefix += len(sentences[k]) + 1
    return best
