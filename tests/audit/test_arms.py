"""Every audit arm does what it claims, on tiny random models (no download)."""

from __future__ import annotations

import json

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.audit.arms import build_kv, layer_subset, parse_arm
from kvrelay.audit.runner import AuditConfig, AuditRunner, wrapper_ids
from kvrelay.audit.tasks import generate
from kvrelay.kv.transforms import layer_rms, select_layers
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def qwen():
    from kvrelay.models.tiny import tiny_lm

    return tiny_lm("qwen2")


def payloads(lm, n=40):
    a = Agent(lm, "sender")
    return a.prefill(random_ids(n, 1)), a.prefill(random_ids(n, 2))


def test_parse_arm_names_and_errors():
    assert parse_arm("kv_noise:0.5").dial == "0.5"
    assert parse_arm("kv_codec:evict:0.2+int8").base == "kv_codec"
    for bad in ("kv_noise", "kv_tokens:middle:0.5", "kv_tokens:first:1.5", "kv_codec:zip", "telepathy", "kv:1"):
        with pytest.raises(ValueError):
            parse_arm(bad)
    assert layer_subset("first:0.5", 24) == list(range(12))
    assert layer_subset("last:0.25", 24) == list(range(18, 24))
    assert layer_subset("2-4", 24) == [2, 3, 4]


def test_zeroed_random_noise(qwen):
    p, _ = payloads(qwen)
    g = torch.Generator().manual_seed(0)
    z, _ = build_kv(parse_arm("kv_zeroed"), p, None, g)
    assert all(bool((k == 0).all()) and bool((v == 0).all()) for k, v in zip(z.keys, z.values, strict=True))
    assert torch.equal(z.token_ids, p.token_ids)  # same length and tokens: only the content is gone

    r, _ = build_kv(parse_arm("kv_random"), p, None, g)
    for real, fake in zip(p.keys + p.values, r.keys + r.values, strict=True):
        assert not torch.equal(real, fake)
        assert abs(fake.mean().item() - real.mean().item()) < 0.1 * real.std().item() + 1e-3
        assert fake.std().item() == pytest.approx(real.std().item(), rel=0.1)

    for sigma in (0.1, 0.5, 2.0):
        n, _ = build_kv(parse_arm(f"kv_noise:{sigma}"), p, None, torch.Generator().manual_seed(1))
        for real, noisy in zip(p.keys + p.values, n.keys + n.values, strict=True):
            valid = torch.ones(1, 1, real.shape[2], 1, dtype=torch.bool)
            ratio = layer_rms(noisy - real, valid) / layer_rms(real, valid)
            assert ratio == pytest.approx(sigma, rel=0.15)


def test_layers_mix_matched_and_mismatched(qwen):
    p, m = payloads(qwen)
    mixed, nbytes = build_kv(parse_arm("kv_layers:first:0.5"), p, m, torch.Generator())
    half = p.meta.num_model_layers // 2
    for i in range(p.meta.num_model_layers):
        src = p if i < half else m
        assert torch.equal(mixed.keys[i], src.keys[i]) and torch.equal(mixed.values[i], src.values[i])
    assert nbytes < p.nbytes


def test_token_subsets_keep_position_cursor(qwen):
    p, _ = payloads(qwen)
    recv = Agent(qwen, "receiver", max_new_tokens=4)
    for spec, kept in (("first:0.25", 11), ("last:0.25", 10)):
        sub, _ = build_kv(parse_arm(f"kv_tokens:{spec}"), p, None, torch.Generator())
        assert sub.num_tokens == kept
        assert int(sub.next_positions[0]) == int(p.next_positions[0])  # the receiver continues at 40
        assert len(recv.respond("what", sub).token_ids) > 0
    top, _ = build_kv(parse_arm("kv_tokens:topk:0.25"), p, None, torch.Generator(), model=qwen.model)
    assert top.num_tokens < p.num_tokens and int(top.next_positions[0]) == 40


def test_codec_arm_reports_compressed_bytes(qwen):
    p, _ = payloads(qwen)
    q, nbytes = build_kv(parse_arm("kv_codec:int8"), p, None, torch.Generator())
    assert nbytes < 0.4 * p.nbytes
    assert q.meta.codec == "raw" and q.keys[0].shape == p.keys[0].shape
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(q.keys, p.keys, strict=True))
    assert err < 0.02


def test_mismatched_is_another_task_with_equal_length(qwen, tmp_path):
    tasks = generate(4, seed=3, n_distractors=0, doc_tokens=128)
    runner = AuditRunner(AuditConfig(model="tiny", tasks=("gen",), arms=("kv",)), qwen, tmp_path)
    mine = runner.sender.read(tasks[0].context)
    other = runner._mismatched(tasks, 1, mine.num_tokens)
    assert other.num_tokens == mine.num_tokens
    assert not torch.equal(other.token_ids, mine.token_ids)
    head, tail = wrapper_ids(runner.sender)
    body = other.token_ids[0, len(head):len(other.token_ids[0]) - len(tail)].tolist()
    nxt = runner.sender.encode(tasks[1].context)
    assert body[:20] == nxt[:20]  # it is task 1's reading, not noise
    assert other.token_ids[0, -len(tail):].tolist() == tail  # same wrapper as a real reading
    # reusing the partner's own cache (prefix + extension) gives the same cache as prefilling it
    for partner_task in (tasks[1], tasks[2]):
        j = tasks.index(partner_task)
        partner = runner.sender.read(partner_task.context)
        for length in (mine.num_tokens, partner.num_tokens + 9, partner.num_tokens - 9):
            fresh = runner._mismatched(tasks, j, length)
            reused = runner._mismatched(tasks, j, length, partner)
            assert reused.num_tokens == length
            assert reused.token_ids[0, :len(head) + 5].tolist() == fresh.token_ids[0, :len(head) + 5].tolist()
            assert reused.token_ids[0, -len(tail):].tolist() == tail
            ref = runner.sender.prefill(reused.token_ids[0].tolist())
            assert all((a - b).abs().max() < 1e-4 for a, b in zip(reused.keys, ref.keys, strict=True))


def test_runner_records_resume_and_reuse(qwen, tmp_path):
    cfg = AuditConfig(model="tiny", tasks=("gen_easy",), arms=("none", "kv", "kv_mismatched", "kv_random"),
                      seeds=(0, 1), limit=3, batch_size=2)
    AuditRunner(cfg, qwen, tmp_path).run()
    rows = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 4 * 2
    keys = {(r["task_id"], r["arm"], r["seed"]) for r in rows}
    assert len(keys) == len(rows)
    for r in rows:
        for f in ("task_id", "regime", "arm", "seed", "covariates", "answer", "score", "prefill_tokens",
                  "latency_s", "relay_bytes", "sender_s", "relay_s", "ttft_s"):
            assert f in r
    kv = [r for r in rows if r["arm"] == "kv"]
    assert all(r["relay_bytes"] > 0 and r["relayed_tokens"] > 0 for r in kv)
    assert sum(bool(r.get("reused")) for r in kv) == 3  # seed 1 reuses seed 0's greedy answer
    assert sum(bool(r.get("reused")) for r in rows if r["arm"] == "kv_random") == 0  # random arms re-draw
    none = [r for r in rows if r["arm"] == "none"]
    assert all(r["relay_bytes"] == 0 and r["relayed_tokens"] == 0 for r in none)
    AuditRunner(cfg, qwen, tmp_path).run()  # resume: nothing left to do, nothing duplicated
    assert "versions" in json.loads((tmp_path / "config.json").read_text())
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == len(rows)


def test_runner_resume_extends_a_folder_and_refuses_what_would_mix(qwen, tmp_path):
    """A folder can gain task sets (each with its own cap); changing what decides batches, the model or its
    engine mode is refused."""
    from kvrelay.audit.runner import AuditResumeMismatch
    from kvrelay.models.engine import with_engine
    from kvrelay.models.tiny import tiny_lm

    base = dict(model="tiny", arms=("none", "kv"), seeds=(0,), limit=3, batch_size=2)
    AuditRunner(AuditConfig(tasks=("gen_easy",), **base), qwen, tmp_path).run()
    AuditRunner(AuditConfig(tasks=("gen:2",), **base), qwen, tmp_path).run()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["sets"] == {"gen_easy": 3, "gen": 2} and cfg["tasks"] == ["gen_easy", "gen"]
    rows = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sum(r["task"] == "gen" for r in rows) == 2 * 2 and sum(r["task"] == "gen_easy" for r in rows) == 3 * 2
    with pytest.raises(AuditResumeMismatch, match="gen_easy.*3 tasks.*gen_easy:3"):
        AuditRunner(AuditConfig(tasks=("gen_easy:2",), **base), qwen, tmp_path).run()
    with pytest.raises(AuditResumeMismatch, match="batch_size=2"):
        AuditRunner(AuditConfig(tasks=("gen_easy",), **{**base, "batch_size": 3}), qwen, tmp_path).run()
    with pytest.raises(AuditResumeMismatch, match="another model"):
        AuditRunner(AuditConfig(tasks=("gen_easy",), **base), tiny_lm("llama"), tmp_path).run()
    with pytest.raises(AuditResumeMismatch, match="engine mode 'fp32'.*'fp16w'.*--engine fp32"):
        AuditRunner(AuditConfig(tasks=("gen_easy",), **base), with_engine(qwen, "fp16w"), tmp_path).run()
    old = json.loads((tmp_path / "config.json").read_text())  # a folder whose config.json predates the mode:
    del old["versions"]["engine"]  # its run.json (written by the CLI) says which it was
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "run.json").write_text(json.dumps({"engine": "fp32"}))
    with pytest.raises(AuditResumeMismatch, match="engine mode 'fp32'"):
        AuditRunner(AuditConfig(tasks=("gen_easy",), **base), with_engine(qwen, "fp16w"), tmp_path).run()
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == len(rows)  # refused runs wrote nothing
    with pytest.raises(ValueError, match="NAME:COUNT"):
        AuditConfig(tasks=("squad:x",), **base)


def test_runner_resume_drops_an_unfinished_last_record(qwen, tmp_path):
    """A run killed mid-write leaves half a line; the next run cuts it, re-runs that trial, keeps valid JSONL."""
    from kvrelay.audit.runner import AuditResumeMismatch

    cfg = AuditConfig(model="tiny", tasks=("gen_easy",), arms=("none", "kv"), seeds=(0,), limit=2, batch_size=2)
    runner = AuditRunner(cfg, qwen, tmp_path)
    runner.run()
    path = tmp_path / "records.jsonl"
    lines = path.read_text().splitlines()
    assert runner.done_trials() == runner.total_trials() == 4
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])  # the last record half written
    with pytest.warns(UserWarning, match="unfinished last record"):
        AuditRunner(cfg, qwen, tmp_path).run()
    again = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(again) == 4 and {(r["task_id"], r["arm"]) for r in again} == {
        (json.loads(x)["task_id"], json.loads(x)["arm"]) for x in lines}
    path.write_text(lines[0] + "\n{oops\n" + "\n".join(lines[1:]) + "\n")
    with pytest.raises(AuditResumeMismatch, match=r"records.jsonl:2: not valid JSON.*not an audit record"):
        AuditRunner(cfg, qwen, tmp_path).run()


# -- the mismatch control: whose reading is each task's mismatched payload --------------------------------
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_mismatch_partner_is_a_different_task_adjacent_in_length(n):
    from kvrelay.audit.partners import mismatch_partners, run_order
    from kvrelay.audit.tasks import load_tasks

    tasks = load_tasks("gen_easy", limit=n, seed=0)
    order = run_order(tasks)
    size = [len(t.context) + len(t.prompt) for t in tasks]
    assert sorted(order) == list(range(n)) and [size[i] for i in order] == sorted(size)
    partners = mismatch_partners(order)
    assert all(partners[i] != i for i in range(n))  # kv_mismatched must never be the task's own reading
    assert sorted(partners) == list(range(n))  # each task is the partner of exactly one other
    rank = {i: k for k, i in enumerate(order)}
    assert all(rank[partners[i]] == (rank[i] + 1) % n for i in range(n))  # the next in run order: similar length
    with pytest.raises(ValueError, match="at least 2"):
        mismatch_partners(order[:1])


def test_runner_gives_each_task_another_tasks_reading_of_its_own_length(qwen, tmp_path):
    from kvrelay.audit.partners import mismatch_partners, run_order
    from kvrelay.audit.tasks import load_tasks

    runner = AuditRunner(AuditConfig(model="tiny", tasks=("gen_easy",), arms=("kv", "kv_mismatched")), qwen, tmp_path)
    tasks = load_tasks("gen_easy", limit=4, seed=0)
    order = run_order(tasks)
    partners = mismatch_partners(order)
    head, tail = wrapper_ids(runner.sender)
    for batch in (order[:2], order[2:]):
        for st in runner.read_batch(tasks, batch, partners):
            own, other = st.payload, st.mismatched
            assert other is not None and other.num_tokens == own.num_tokens  # length-matched
            assert not torch.equal(other.token_ids, own.token_ids)
            body = other.token_ids[0, len(head):own.num_tokens - len(tail)].tolist()
            assert body[:12] == runner.sender.encode(tasks[partners[st.index]].context)[:12]
            assert body[:12] != runner.sender.encode(st.task.context)[:12]


def test_arm_edges_and_errors(qwen):
    from kvrelay.audit.arms import _token_subset

    assert layer_subset("0,3,5", 24) == [0, 3, 5]
    assert layer_subset("first:0.1", 4) == [0]  # rounds to none: at least one layer
    p, m = payloads(qwen)
    g = torch.Generator
    assert build_kv(parse_arm("kv"), p, m, g())[0] is p
    assert build_kv(parse_arm("kv_mismatched"), p, m, g()) == (m, m.nbytes)
    with pytest.raises(ValueError, match=r"^kv_mismatched needs another task's payload$"):
        build_kv(parse_arm("kv_mismatched"), p, None, g())
    with pytest.raises(ValueError, match=r"^text_full is not a cache arm$"):
        build_kv(parse_arm("text_full"), p, m, g())
    short = Agent(qwen, "sender").prefill(random_ids(20, 3))
    with pytest.raises(ValueError, match=r"^kv_layers needs a length-matched mismatched payload$"):
        build_kv(parse_arm("kv_layers:first:0.5"), p, short, g())
    with pytest.raises(ValueError, match="shorter"):  # a partner holding fewer layers is refused, not truncated
        build_kv(parse_arm("kv_layers:first:0.5"), p, select_layers(m, [0]), g())
    for name in ("kv_random", "kv_noise:0.5"):  # the audit's generator decides the draw: reproducible
        a, _ = build_kv(parse_arm(name), p, None, g().manual_seed(4))
        b, _ = build_kv(parse_arm(name), p, None, g().manual_seed(4))
        assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True)), name
    assert _token_subset(short, "first:0.01", None).num_tokens == 2  # at least one token, plus the last
    with pytest.raises(ValueError, match=r"^kv_tokens:topk needs attention scores$"):
        _token_subset(short, "topk:0.5", None)
