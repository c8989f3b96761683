"""``bench policy`` on synthetic audit folders whose answer is known: relay pays only where the receiver lacks
the context, kv and text_full answer alike, int8 keeps kv's answers. The learned policy must be on the frontier."""

from __future__ import annotations

import json

import pytest

from kvrelay.bench.policy import STRATEGIES, bench_policy, plot_frontier
from kvrelay.core.errors import InvalidInput
from tests.policy.conftest import synthetic_profile


def _audit(folder, sets: dict[str, str], n: int = 20, with_text: bool = True):
    """Per task: private sets -> none fails, every relay channel succeeds on 3 tasks of 4; shared sets -> every
    channel gives the same answer (right on half the tasks)."""
    folder.mkdir(parents=True)
    rows, texts = [], {}
    for name, regime in sets.items():
        for i in range(n):
            tid = f"{name}/{i}"
            ctx = f"document {i} of {name}: the access code for chest {i} is {1000 + i} and the colour is blue"
            texts[tid] = (ctx, ("question about the chest" if regime == "private" else ctx))
            hit = float(i % 4 != 0) if regime == "private" else float(i % 2 == 0)
            arms = ["none", "kv", "kv_codec:int8"] + (["text_full"] if with_text else [])
            for arm in arms:
                score = 0.0 if (arm == "none" and regime == "private") else hit
                rows.append({"task_id": tid, "task": name, "regime": regime, "arm": arm, "seed": 0, "covariates": {},
                             "answer": str(score), "score": score, "prefill_tokens": 30,
                             "relayed_tokens": 0 if arm == "none" else 100 + 40 * i})  # short and long
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps({"tasks": list(sets)}))
    return texts


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("audits")
    texts = _audit(root / "fit", {"privA": "private", "shareA": "shared"})
    texts |= _audit(root / "held", {"privB": "private", "shareB": "shared"}, with_text=False)
    return bench_policy(synthetic_profile(), folders=[root / "fit", root / "held"], held_out=("privB", "shareB"),
                        n_boot=50, texts=texts.get)


def test_the_json_has_the_documented_shape(result):
    assert [s["name"] for s in result["strategies"]] == list(STRATEGIES)
    for s in result["strategies"]:
        assert {"name", "accuracy", "ci_low", "ci_high", "latency_s"} <= set(s)
        assert s["ci_low"] <= s["accuracy"] <= s["ci_high"] and s["requests"] == 80
    assert result["held_out_tasks"] == ["privB", "shareB"] and result["fit_task_sets"] == ["privA", "shareA"]
    check = result["identity_check"]
    assert check["text_full=kv"] == {"trials_with_both": 40, "identical_answers": 40, "imputed": 40}
    assert check["imputed"] == 40  # held-out tasks ran kv only: text_full taken from it
    assert result["regimes"] == {"private_short": 4, "private_long": 16, "shared_short": 4, "shared_long": 16}


def test_the_learned_policy_is_not_dominated(result):
    by = {s["name"]: s for s in result["strategies"]}
    learned = by["learned"]
    assert result["policy_dominated"] is False and result["dominated_by"] == []
    assert learned["accuracy"] == pytest.approx(by["always_kv"]["accuracy"])  # it relays where relay pays ...
    assert learned["latency_s"] < by["always_kv_int8"]["latency_s"]  # ... and skips it where it does not
    assert learned["latency_s"] < by["checklist"]["latency_s"] or learned["accuracy"] >= by["checklist"]["accuracy"]
    shared = [d for d in result["decisions"] if d["task_id"].startswith("shareB")]
    assert {d["channel"] for d in shared} == {"none"}
    slow = [d for d in result["decisions"] if d["task_id"].startswith("privB") and d["link"] == "slow"]
    assert {(d["channel"], d["codec"]) for d in slow} <= {("kv", "int8"), ("text_full", None)}


def test_the_frontier_plot_is_written(result, tmp_path):
    assert plot_frontier(result, tmp_path / "f.png").stat().st_size > 1000


def test_held_out_sets_without_records_are_refused(tmp_path):
    texts = _audit(tmp_path / "a", {"privA": "private"})
    with pytest.raises(InvalidInput, match="no records of the held-out task sets"):
        bench_policy(synthetic_profile(), folders=[tmp_path / "a"], held_out=("nosuch",), n_boot=5, texts=texts.get)
