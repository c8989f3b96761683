"""`kvrelay audit --workflow`: the arms act on the audited edge only, and the pairing effect shows where the
scored answer depends on that edge's cache (tiny model, deterministic).

The workflow fans out: ``reader`` reads the context; ``side`` and ``final`` each continue from its whole
turn; ``final``'s answer is the workflow's. The reference of each input is the answer the workflow gives
when every edge re-encodes the text, so an answer is right exactly when the final agent computed from
*this* input's reading. On ``reader->final`` the matched cache reproduces it and another input's cache
does not (a large pairing effect); on ``reader->side`` the arms change only ``side``, whose answer
reaches nothing that is scored (no effect at all). Applying the arms to the wrong edge, or to every
edge, or not at all, fails one of the two.
"""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from kvrelay.audit.edge import EdgeAudit, EdgeInput, load_inputs, parse_edge, run_edge_audit
from kvrelay.audit.seeding import SEED_DESIGN, seed_report
from kvrelay.core.errors import InvalidInput
from kvrelay.models.loader import load_model
from kvrelay.workflows.run import run_workflow
from kvrelay.workflows.spec import AgentSpec, Edge, Workflow

WORDS = "vault blue red green alpha beta gamma delta one two three four five six seven eight nine zero".split()
WF = Workflow("fan", (AgentSpec("reader", "read", "what is the code", max_new_tokens=6),
                      AgentSpec("side", "check", "write the check", max_new_tokens=6),
                      AgentSpec("final", "answer", "what is the key", max_new_tokens=6)),
              (Edge("reader", "side"), Edge("reader", "final")))


def contexts(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:qwen2")


@pytest.fixture(scope="module")
def inputs(lm):
    """Inputs whose reference is the all-text workflow's answer (those whose answer is not blank)."""
    rows = [(c, run_workflow(lm, WF, c, mode="text").final_text) for c in contexts(12)]
    return [EdgeInput(str(i), c, (ref,)) for i, (c, ref) in enumerate(rows) if ref.strip()]


def pairing(summary: dict, edge: str) -> dict:
    return next(e for e in summary["effects"] if e["contrast"] == "pairing" and e["outcome"] == "success"
                and e["task"] == edge)


def test_pairing_where_the_answer_needs_the_edge_and_none_where_it_does_not(lm, inputs, tmp_path):
    needed = run_edge_audit(WF, "reader->final", inputs, "exact", tmp_path / "final", lm, n_boot=500)
    e = pairing(needed, "reader->final")
    assert e["estimate"] >= 40 and e["ci_low"] > 0, e
    kv_vs_text = next(x for x in needed["effects"] if x["contrast"] == "kv_vs_text_full" and x["outcome"] == "success"
                      and x["task"] == "reader->final")
    assert kv_vs_text["estimate"] == 0  # the relayed cache answers exactly as the text does
    records = [json.loads(x) for x in (tmp_path / "final" / "records.jsonl").read_text().splitlines()]
    assert {r["task"] for r in records} == {"reader->final"}
    assert all(r["score"] == 1.0 for r in records if r["arm"] in ("kv", "text_full"))

    unused = run_edge_audit(WF, "reader->side", inputs, "exact", tmp_path / "side", lm, n_boot=500)
    e = pairing(unused, "reader->side")
    assert e["estimate"] == 0 and e["ci_low"] == 0 and e["ci_high"] == 0, e
    assert (tmp_path / "side" / "report.html").is_file()


def test_a_rerun_resumes_and_adds_nothing(lm, inputs, tmp_path):
    run_edge_audit(WF, "reader->final", inputs[:3], "contains", tmp_path, lm, arms=("kv", "kv_mismatched"), n_boot=100)
    before = (tmp_path / "records.jsonl").read_text()
    run_edge_audit(WF, "reader->final", inputs[:3], "contains", tmp_path, lm, arms=("kv", "kv_mismatched"), n_boot=100)
    assert (tmp_path / "records.jsonl").read_text() == before and len(before.splitlines()) == 6


def test_a_compressed_folder_resumes_and_is_unpacked_only_to_add_trials(lm, inputs, tmp_path):
    import subprocess

    run_edge_audit(WF, "reader->final", inputs[:3], "contains", tmp_path, lm, arms=("kv",), n_boot=100)
    before = (tmp_path / "records.jsonl").read_text()
    subprocess.run(["gzip", "-9n", str(tmp_path / "records.jsonl")], check=True)
    run_edge_audit(WF, "reader->final", inputs[:3], "contains", tmp_path, lm, arms=("kv",), n_boot=100)
    assert sorted(p.name for p in tmp_path.glob("records*")) == ["records.jsonl.gz"]  # nothing added
    run_edge_audit(WF, "reader->final", inputs[:3], "contains", tmp_path, lm, arms=("kv", "none"), n_boot=100)
    assert sorted(p.name for p in tmp_path.glob("records*")) == ["records.jsonl"]
    after = (tmp_path / "records.jsonl").read_text()
    assert after.startswith(before) and [json.loads(x)["arm"] for x in after.splitlines()[3:]] == ["none"] * 3


def test_each_seed_pairs_an_input_with_another_partner(lm, inputs, tmp_path):
    """The partner is the input 1 + seed mod (n - 1) places later by context length, and the mismatched
    answer is the one the receiver gives over *that* input's cache (not just a label that moves)."""
    seeds = (0, 1, 2)
    run_edge_audit(WF, "reader->final", inputs, "exact", tmp_path, lm, arms=("kv", "kv_mismatched"), seeds=seeds,
                   n_boot=100)
    rows = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    n = len(inputs)
    assert n >= 4
    order = sorted(range(n), key=lambda i: (len(inputs[i].context), i))
    want = {s: {order[k]: order[(k + 1 + s % (n - 1)) % n] for k in range(n)} for s in seeds}
    by = {(r["task_id"], r["arm"], r["seed"]): r for r in rows}
    audit = EdgeAudit(WF, "reader->final", inputs, "exact", ("kv_mismatched",), seeds, lm, tmp_path / "check")
    arm = audit.arms[0]
    answers_move = False
    for i, x in enumerate(inputs):
        got = [by[(f"reader->final/{x.id}", "kv_mismatched", s)] for s in seeds]
        assert [r["partner"] for r in got] == [f"reader->final/{inputs[want[s][i]].id}" for s in seeds]
        assert not any(r.get("reused") for r in got)
        pre = audit.prefix(x)
        for s, r in zip(seeds, got, strict=True):
            other = audit.mismatched(pre, audit.prefix(inputs[want[s][i]]))
            assert audit.run_arm(arm, x, pre, other, s)["answer"] == r["answer"], (x.id, s)
        answers_move |= len({r["answer"] for r in got}) > 1
        kv = [by[(f"reader->final/{x.id}", "kv", s)] for s in seeds]
        assert [bool(r.get("reused")) for r in kv] == [False, True, True]  # kv's input no seed changes
    assert answers_move  # the partners' caches give other answers, so the seeds vary something
    assert "mismatch_partner" in seed_report(rows)["varies"]
    assert json.loads((tmp_path / "config.json").read_text())["seed_design"] == SEED_DESIGN


def test_a_folder_made_before_partners_varied_is_not_resumed(lm, inputs, tmp_path):
    run_edge_audit(WF, "reader->final", inputs[:3], "contains", tmp_path, lm, arms=("kv",), n_boot=100)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["seed_design"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidInput, match="seed design"):
        run_edge_audit(WF, "reader->final", inputs[:3], "contains", tmp_path, lm, arms=("kv",), n_boot=100)


def test_bad_edges_inputs_and_scores_are_refused(tmp_path):
    with pytest.raises(InvalidInput, match="not an edge"):
        parse_edge(WF, "side->final")
    with pytest.raises(InvalidInput, match="SENDER->RECEIVER"):
        parse_edge(WF, "reader")
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"context": "a b", "reference": "x"}\n{"context": "c d"}\n')
    with pytest.raises(InvalidInput, match=":2"):
        load_inputs(bad)


def test_cli_audit_workflow(lm, inputs, tmp_path):
    from kvrelay.cli.app import app

    wf = tmp_path / "wf.toml"
    wf.write_text(WF.to_toml())
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"context": x.context, "reference": x.references[0]}) + "\n" for x in inputs[:4]))
    out = tmp_path / "out"
    args = ["audit", "--workflow", str(wf), "--edge", "reader->final", "--inputs", str(rows), "--score", "exact",
            "--model", "tiny:qwen2", "--arms", "kv,kv_mismatched,none", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tasks"] and pairing(summary, "reader->final")["n"] == 4
    res = CliRunner().invoke(app, [*args[:-2], "--out", str(tmp_path / "x"), "--score", "bleu"])
    assert res.exit_code == 2 and "--score" in res.output and not (tmp_path / "x").exists()
