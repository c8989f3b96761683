"""Seeds that vary something: option order (answer slot balanced), mismatch partner, seeded sampling.

Pure checks on the seeding functions, then the runner on a tiny random model (no download) over
real ARC-Challenge problems: two seeds show each task with another option order, pair it with
another partner, and — at a temperature — sample reproducibly per seed.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from kvrelay.audit.partners import mismatch_partners, run_order
from kvrelay.audit.runner import AuditConfig, AuditResumeMismatch, AuditRunner
from kvrelay.audit.seeding import SEED_DESIGN, option_order, partner_shift, seed_report, seeded
from kvrelay.audit.tasks import load_tasks, score
from kvrelay.audit.tasks.datasets import MultipleChoice, choice_task
from kvrelay.models.sampling import Sampler


def _mc(i: int, k: int = 4):
    return choice_task("toy", MultipleChoice(str(i), f"Which option is number {i}?",
                                             tuple(f"option {c} of task {i}" for c in range(k)), gold=i % k))


def test_option_order_moves_the_answer_through_every_slot_across_seeds():
    for i in range(30):
        task = _mc(i)
        gold_text = task.choices["ABCD".index(task.answers[0])]
        slots = []
        for seed in range(4):
            shown, order = seeded(task, seed)
            assert sorted(order) == [0, 1, 2, 3] and shown.choices == tuple(task.choices[j] for j in order)
            letter = shown.answers[0]
            assert shown.choices["ABCD".index(letter)] == gold_text  # the gold letter follows its option
            assert f"{letter}. {gold_text}" in shown.context and shown.prompt.startswith(shown.context)
            assert score(shown, letter) == 1.0 and shown.covariate_dict()["answer_slot"] == "ABCD".index(letter)
            slots.append("ABCD".index(letter))
        assert sorted(slots) == [0, 1, 2, 3]  # over k seeds the answer sits in each slot exactly once
        assert seeded(task, 0)[1] != seeded(task, 1)[1]
        assert seeded(task, 2) == seeded(task, 2)  # deterministic


def test_answer_letter_is_balanced_across_tasks_for_one_seed():
    tasks = load_tasks("arc_challenge", limit=400, seed=0)
    for seed in (0, 1):
        letters = Counter(seeded(t, seed)[0].answers[0] for t in tasks if len(t.choices) == 4)
        n = sum(letters.values())
        assert set(letters) == set("ABCD") and all(abs(c / n - 0.25) < 0.06 for c in letters.values()), letters


def test_tasks_without_options_are_not_changed_and_bad_input_is_refused():
    t = load_tasks("gen_easy", limit=1)[0]
    assert seeded(t, 3) == (t, None)
    with pytest.raises(ValueError, match="gold index"):
        option_order("x", 4, 4, 0)
    with pytest.raises(ValueError, match="at least 2"):
        partner_shift(0, 1)


@pytest.mark.parametrize("n", [2, 3, 8, 20])
def test_each_seed_picks_another_partner_never_the_task_itself(n):
    order = run_order(load_tasks("gen_easy", limit=n, seed=0))
    rank = {i: k for k, i in enumerate(order)}
    by_seed = [mismatch_partners(order, s) for s in range(5)]
    for s, partners in enumerate(by_seed):
        assert all(partners[i] != i for i in range(n)) and sorted(partners) == list(range(n))
        assert all((rank[partners[i]] - rank[i]) % n == partner_shift(s, n) for i in range(n))
    assert by_seed[0] == mismatch_partners(order)  # seed 0 keeps the paper's next-in-order partner
    if n >= 3:
        assert by_seed[0] != by_seed[1]


def test_sampler_is_reproducible_per_row_whatever_its_batch_mates():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    together = Sampler(1.0, [11, 22, 33])(logits)
    alone = Sampler(1.0, [22])(logits[1:2])
    assert int(together[1]) == int(alone[0])
    draws = {int(Sampler(1.0, [s])(logits[:1])[0]) for s in range(20)}
    assert len(draws) > 1  # different seeds, different draws
    with pytest.raises(ValueError, match="temperature"):
        Sampler(0.0, [1])


@pytest.fixture(scope="module")
def qwen():
    from kvrelay.models.tiny import tiny_lm

    return tiny_lm("qwen2")


def _records(path):
    return [json.loads(x) for x in (path / "records.jsonl").read_text().splitlines()]


def test_two_seeds_show_other_option_orders_and_other_partners(qwen, tmp_path):
    cfg = AuditConfig(model="tiny", tasks=("arc_challenge",), arms=("kv", "kv_mismatched"), seeds=(0, 1), limit=6,
                      batch_size=3)
    AuditRunner(cfg, qwen, tmp_path).run()
    rows = _records(tmp_path)
    assert len(rows) == 6 * 2 * 2 and not any(r.get("reused") for r in rows)  # no seed repeats another's trial
    tasks = {t.id: t for t in load_tasks("arc_challenge", limit=6, seed=0)}
    by = {(r["task_id"], r["arm"], r["seed"]): r for r in rows}
    for tid, task in tasks.items():
        o0, o1 = by[(tid, "kv", 0)]["option_order"], by[(tid, "kv", 1)]["option_order"]
        assert o0 != o1
        for seed, order in ((0, o0), (1, o1)):
            gold = by[(tid, "kv", seed)]["gold"][0]
            assert task.choices[order["ABCDE".index(gold)]] == task.choices["ABCDE".index(task.answers[0])]
        p0, p1 = by[(tid, "kv_mismatched", 0)]["partner"], by[(tid, "kv_mismatched", 1)]["partner"]
        assert p0 != p1 and tid not in (p0, p1)
    report = seed_report(rows)
    assert report["varies"] == ["option_order", "mismatch_partner"] and report["temperature"] == 0.0
    assert json.loads((tmp_path / "config.json").read_text())["seed_design"] == SEED_DESIGN


def test_private_tasks_reuse_what_no_seed_changes(qwen, tmp_path):
    cfg = AuditConfig(model="tiny", tasks=("gen_easy",), arms=("kv", "kv_mismatched"), seeds=(0, 1), limit=4,
                      batch_size=4)
    AuditRunner(cfg, qwen, tmp_path).run()
    rows = _records(tmp_path)
    reused = {(r["arm"], r["seed"]) for r in rows if r.get("reused")}
    assert reused == {("kv", 1)}  # kv's input is the same under both seeds; the mismatched partner is not
    assert "option_order" not in rows[0]


def test_temperature_sampling_is_reproducible_per_seed(qwen, tmp_path):
    cfg = AuditConfig(model="tiny", tasks=("gen_easy",), arms=("none", "kv"), seeds=(0, 1), limit=4, batch_size=2,
                      temperature=1.0)
    runs = []
    for name in ("a", "b"):
        AuditRunner(cfg, qwen, tmp_path / name).run()
        runs.append({(r["task_id"], r["arm"], r["seed"]): r["answer"] for r in _records(tmp_path / name)})
    assert runs[0] == runs[1]  # same seeds, same samples
    by_seed = [[a for (_, _, s), a in sorted(runs[0].items()) if s == seed] for seed in (0, 1)]
    assert by_seed[0] != by_seed[1]  # another seed, other draws
    rows = _records(tmp_path / "a")
    assert all(r["temperature"] == 1.0 and not r.get("reused") for r in rows)
    assert seed_report(rows)["varies"] == ["sampling"]
    with pytest.raises(AuditResumeMismatch, match="temperature"):
        AuditRunner(AuditConfig(model="tiny", tasks=("gen_easy",), arms=("none", "kv"), seeds=(0, 1), limit=4,
                                batch_size=2), qwen, tmp_path / "a").run()


def test_a_folder_from_before_seeds_varied_is_not_resumed(qwen, tmp_path):
    cfg = AuditConfig(model="tiny", tasks=("gen_easy",), arms=("kv",), seeds=(0,), limit=2, batch_size=2)
    AuditRunner(cfg, qwen, tmp_path).run()
    config = json.loads((tmp_path / "config.json").read_text())
    del config["seed_design"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(AuditResumeMismatch, match="seed design"):
        AuditRunner(cfg, qwen, tmp_path).run()


@pytest.mark.parametrize("extra, says", [(["--temperature", "-1"], "--temperature -1"),
                                         (["--temperature", "nan"], "--temperature nan"),
                                         (["--temperature", "0.7", "--workflow", "wf.toml"], "--temperature with --workflow")])
def test_cli_refuses_a_bad_temperature_before_loading_a_model(tmp_path, extra, says):
    from typer.testing import CliRunner

    from kvrelay.cli import app

    res = CliRunner().invoke(app, ["audit", "--preset", "smoke", "--out", str(tmp_path / "o"), *extra])
    assert res.exit_code == 2 and says in res.stderr and "expected" in res.stderr, res.output
    assert not (tmp_path / "o").exists()
