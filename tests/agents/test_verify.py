"""Verification recomputes part of a payload from its own token ids: genuine payloads pass in every codec a
receiver accepts, tampered ones fail (and which check caught them), payloads it cannot recompute are refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.agents.verify import VerifySpec, layer0_kv, tolerance, verify_bytes, verify_payload
from kvrelay.bench.trust import FAULTS, Receiver, _noise, _other_weights, _signed_bytes, faulted
from kvrelay.core.errors import TamperedPayload
from kvrelay.fuse.recompute import prefill_kv
from kvrelay.kv import codecs, wire
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.transforms import pad_batch
from kvrelay.models.tiny import tiny_lm
from tests.conftest import random_ids

CODECS = ("raw", "fp16", "bf16", "int8", "int4")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request):
    return tiny_lm(request.param, seed=0)


@pytest.fixture(scope="module")
def genuine(lm):
    a = Agent(lm, "producer")
    a.round = 5
    return a.prefill(random_ids(48, 3))


def shipped(p: KVPayload, codec: str) -> KVPayload:
    return p if codec == "raw" else codecs.decompress(codecs.compress(p, codec))


def test_layer0_is_the_models_own_layer0_exactly(lm, genuine):
    k0, v0 = layer0_kv(lm.model, genuine)
    (k, v), = prefill_kv(lm.model, genuine, 1)
    assert torch.equal(k0, k) and torch.equal(v0, v)


@pytest.mark.parametrize("codec", CODECS)
def test_genuine_payloads_pass_in_every_codec(lm, genuine, codec):
    for seed in range(3):
        v = verify_payload(lm.model, shipped(genuine, codec), VerifySpec(k=8, seed=seed), codec=codec)
        assert v.verdict == "ok", v.reason
        assert v.max_error < 0.5 * v.tolerance and len(v.checked_positions) == 8
    full = verify_payload(lm.model, shipped(genuine, codec), VerifySpec(full=True), codec=codec)
    assert full.verdict == "ok" and full.cost_fraction == 1.0 and len(full.checked_positions) == genuine.num_tokens


def test_noise_on_layer0_is_caught_everywhere_and_upper_noise_by_the_spot_check(lm, genuine):
    L = len(genuine.keys)
    g = torch.Generator().manual_seed(0)
    one = _noise(genuine, torch.tensor([17]), range(L), g)  # one position of 48, every layer
    v = verify_payload(lm.model, one, VerifySpec(k=2, seed=0))
    assert (v.verdict, v.detected_by, v.layer, v.position) == ("tampered", "layer0", 0, 17)
    upper = _noise(genuine, torch.arange(48), [L - 1], g)  # the last layer only
    v = verify_payload(lm.model, upper, VerifySpec(k=2, seed=0))
    assert (v.verdict, v.detected_by, v.layer) == ("tampered", "spot-check", L - 1)
    assert v.max_error > 10 * v.tolerance


def test_a_genuine_payload_with_a_single_edited_value_is_tampered_and_so_is_nan(lm, genuine):
    keys = list(genuine.keys)
    t = keys[1].clone()
    t[0, 0, 40] *= 3.0  # one position, one head, layer 1
    keys[1] = t
    p = KVPayload(tuple(keys), genuine.values, genuine.token_ids, genuine.positions, genuine.mask, genuine.meta)
    assert verify_payload(lm.model, p, VerifySpec(k=2, seed=0, full=True)).verdict == "tampered"
    t = t.clone()
    t[0, 0, 3, 0] = math.nan
    keys[1] = t
    p = KVPayload(tuple(keys), genuine.values, genuine.token_ids, genuine.positions, genuine.mask, genuine.meta)
    v = verify_payload(lm.model, p)
    assert (v.verdict, v.detected_by) == ("tampered", "invariants")


def test_what_cannot_be_recomputed_is_refused_never_ok(lm, genuine):
    padded = pad_batch([genuine, Agent(lm, "producer").prefill(random_ids(20, 1))])
    v = verify_payload(lm.model, padded)
    assert v.verdict == "refused" and "cannot recompute" in v.reason
    evicted = codecs.decompress(codecs.compress(genuine, "evict:0.5"))
    assert verify_payload(lm.model, evicted, codec="evict:0.5").verdict == "refused"


@pytest.mark.parametrize("fault", [f for f in FAULTS if f not in ("noise_1pct_upper_layers",)])
def test_every_fault_of_the_corpus_is_caught(lm, genuine, fault):
    rx = Receiver(lm, genuine.meta.created_at)
    data = _other_weights(lm, genuine, 0) if fault == "other_weights" else faulted(
        fault, lm, genuine, torch.Generator().manual_seed(1))
    by, reason, _ = rx.defend(data, VerifySpec(k=8, seed=0))
    assert by, f"{fault} was not caught: {reason}"


def test_the_corpus_receiver_passes_the_genuine_payload(lm, genuine):
    assert Receiver(lm, genuine.meta.created_at).defend(_signed_bytes(genuine), VerifySpec(k=8, seed=0))[0] == ""


def test_tolerance_follows_dtype_and_codec_and_refuses_unknowns():
    assert tolerance("fp32", "float32", "raw") < tolerance("fp32", "float32", "fp16") < tolerance(
        "fp32", "float32", "int8") < tolerance("fp32", "float32", "int4")
    assert tolerance("int8", "bfloat16", "raw") == tolerance("fp32", "float32", "bf16")
    assert tolerance("fp32", "float32", "layers:0-1+int8-g64") == tolerance("fp32", "float32", "int8")
    # a bf16 prefill widens an fp32 payload's bound to bf16's; the decode precision does not matter
    assert tolerance("bf16+int4", "float32", "raw") == tolerance("bf16+fp32", "float32") == tolerance(
        "fp32", "float32", "bf16") > tolerance("int4", "float32")
    assert tolerance("bf16+fp32", "float32", "int4") == tolerance("fp32", "float32", "int4")
    for bad in ("fp64", "fp32+int8", "auto"):
        with pytest.raises(ValueError):
            tolerance(bad, "float32")
    with pytest.raises(ValueError):
        VerifySpec(k=1)
    with pytest.raises(ValueError):
        VerifySpec(codec="zip")


def test_a_verifying_agent_refuses_tampered_payloads_and_records_nothing(lm, genuine):
    receiver = Agent(lm, "receiver", max_new_tokens=2, verify=VerifySpec(k=4, seed=0))
    bad = _noise(genuine, torch.arange(48), [len(genuine.keys) - 1], torch.Generator().manual_seed(0))
    with pytest.raises(TamperedPayload, match="'producer'"):
        receiver.respond("what", bad)
    assert receiver._rounds.held == {}  # refused: no round recorded
    receiver.respond("what", genuine)
    assert receiver._rounds.held == {"producer": 5}


def test_verify_bytes_refuses_what_decode_refuses(lm, genuine):
    data = bytearray(wire.encode(genuine))
    assert verify_bytes(lm, bytes(data)).verdict == "ok"
    data[-5] ^= 1
    v = verify_bytes(lm, bytes(data))
    assert (v.verdict, v.detected_by) == ("refused", "CorruptPayload")
    other = tiny_lm("llama", seed=9) if lm.identity.arch != "llama" else tiny_lm("qwen2", seed=9)
    assert verify_bytes(other, wire.encode(genuine)).verdict == "refused"
    assert json.loads(json.dumps(v.to_json()))["verdict"] == "refused"


def test_the_corpus_run_resumes_from_its_records_and_covers_every_engine_mode(tmp_path, monkeypatch):
    from kvrelay.bench import trust
    from kvrelay.models.engine import ENGINES

    lm = tiny_lm("qwen2", seed=0)
    monkeypatch.setattr(trust, "FAULTS", ("nan", "stale_round", "noise_10pct_upper_layers"))
    monkeypatch.setattr(trust, "K_SWEEP", (4,))
    records, partial = tmp_path / "records.jsonl", []
    n = len(ENGINES) + 1  # every mode once, the first twice
    res = trust.run_corpus("tiny:qwen2", k=4, genuine=n, context_tokens=64, trials=2, records=records, lm=lm,
                           progress=partial.append)
    assert res["complete"] and [r["fault"] for r in res["rows"]] == ["nan", "stale_round", "noise_10pct_upper_layers"]
    assert all(r["detected"] for r in res["rows"])
    fp = res["false_positives"]
    assert fp["payloads"] == n and fp["checks"] == 5 * n and fp["flagged"] == 0
    assert fp["payloads_per_engine"] == {m: 2 if i == 0 else 1 for i, m in enumerate(ENGINES)}
    assert len(partial) == 3 + n and not partial[0]["complete"] and partial[-1]["complete"]
    lines = records.read_text().splitlines()
    engines = {json.loads(line)["engine"] for line in lines if '"genuine:' in line}
    assert engines == set(ENGINES)
    # a rerun reads every row back from the records and appends nothing
    again = trust.run_corpus("tiny:qwen2", k=4, genuine=n, context_tokens=64, trials=2, records=records, lm=lm)
    assert again["rows"] == res["rows"] and again["false_positives"] == fp
    assert records.read_text().splitlines() == lines
    # a record made in another mode than its index's (an older rotation) is made again and replaced
    stale = [json.loads(line) for line in lines]
    for r in stale:
        if r["id"] == "genuine:1":
            r["engine"] = ENGINES[0]
    records.write_text("".join(json.dumps(r) + "\n" for r in stale))
    redo = trust.run_corpus("tiny:qwen2", k=4, genuine=n, context_tokens=64, trials=2, records=records, lm=lm)
    assert redo["false_positives"]["payloads_per_engine"] == fp["payloads_per_engine"]
    assert [json.loads(line)["id"] for line in records.read_text().splitlines()[len(lines):]] == ["genuine:1"]
    # a last line cut by a killed run is dropped (with a warning), and the records stay valid JSON lines
    whole = records.read_text()
    records.write_text(whole + '{"id": "genuine:')
    with pytest.warns(UserWarning, match="unfinished last record"):
        trust.run_corpus("tiny:qwen2", k=4, genuine=n, context_tokens=64, trials=2, records=records, lm=lm)
    assert records.read_text() == whole
