"""Engine modes: relay stays exact within a mode; payloads of another mode are refused unless accepted."""

from __future__ import annotations

import json

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import EngineMismatch, IncompatiblePayload
from kvrelay.fuse.engine import AcceptEngines, engine_drift
from kvrelay.kv.payload import PayloadMeta
from kvrelay.models.engine import ENGINES, PhaseLinear, apply_engine, decode_weight_bytes, strip_engine
from kvrelay.models.generate import forward_all, forward_last
from kvrelay.models.identity import weights_digest
from kvrelay.models.loader import with_engine
from tests.conftest import random_ids

COMPACT = tuple(e for e in ENGINES if e != "fp32")
FP32_PREFILL = tuple(e for e in COMPACT if "+" not in e and e != "fp32p")  # fewer bytes per weight than fp32
TOL = 1e-4
CONTEXT = "the vault is blue and the key is seven what is the code of the red file"


def _prefill(lm, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    forward_last(lm.model, torch.tensor([ids]), torch.arange(len(ids))[None], cache, None)
    return cache


@pytest.mark.parametrize("engine", ENGINES)
def test_relay_equals_text_in_every_mode(tiny, engine):
    lm = with_engine(tiny, engine)
    sender, receiver = Agent(lm, "sender"), Agent(lm, "receiver", max_new_tokens=12)
    payload = sender.read(CONTEXT)
    kv = receiver.respond("what is the key", payload, min_new_tokens=12)
    text = Agent(lm, "reader", max_new_tokens=12).respond("what is the key", payload.token_ids, min_new_tokens=12)
    assert len(kv.token_ids) == 12 and kv.token_ids == text.token_ids


@pytest.mark.parametrize("engine", ENGINES)
def test_whole_turn_payload_holds_what_a_reader_of_the_text_computes(tiny, engine):
    """A turn's answer was decoded with compact weights; its relayed K/V must be the prefill's."""
    lm = with_engine(tiny, engine)
    turn = Agent(lm, "writer").respond("which vault", Agent(lm, "s").read(CONTEXT), return_payload=True,
                                       min_new_tokens=8, max_new_tokens=8)
    p = turn.payload
    reread = _prefill(lm, p.token_ids[0].tolist())
    for layer, k, v in zip(reread.layers, p.keys, p.values, strict=True):
        assert (layer.keys - k).abs().max().item() <= TOL
        assert (layer.values - v).abs().max().item() <= TOL
    kv = Agent(lm, "next", max_new_tokens=10).respond("what is the code", p, min_new_tokens=10)
    text = Agent(lm, "next2", max_new_tokens=10).respond("what is the code", p.token_ids, min_new_tokens=10)
    assert kv.token_ids == text.token_ids


@pytest.mark.parametrize("engine", FP32_PREFILL)
def test_compact_weights_serve_one_token_calls_only(tiny, engine):
    lm = with_engine(tiny, engine)
    ids = random_ids(9, 1)
    pos = torch.arange(9)[None]
    from transformers import DynamicCache

    many = [forward_all(m.model, torch.tensor([ids]), pos, DynamicCache(config=m.model.config), None) for m in (tiny, lm)]
    assert torch.equal(many[0], many[1])  # prefill: the fp32 weights, bit for bit
    one = [forward_last(m.model, torch.tensor([ids[:1]]), pos[:, :1], DynamicCache(config=m.model.config), None)
           for m in (tiny, lm)]
    assert 0 < (one[0] - one[1]).abs().max().item() < 0.5  # decode: the compact weights, close to fp32
    assert decode_weight_bytes(lm.model) < decode_weight_bytes(tiny.model)


@pytest.mark.parametrize(("engine", "tol", "byte_ratio"), [("fp32p", 1e-4, 1.0), ("fp16w", 2e-3, 0.5)])
def test_packed_decodes_keep_fp32_prefill_and_survive_copies(tiny, engine, tol, byte_ratio):
    """``fp32p`` (fp32 weights in oneDNN's layout) and ``fp16w`` (fp16 weights packed for fbgemm, fp32
    activations): prefill bit for bit fp32's, one-token calls fp32's up to summation order (and, for
    fp16w, the weights' rounding to fp16), the bytes that precision reads, and a model in that mode
    survives ``copy.deepcopy`` (its opaque packed weights are packed again)."""
    import copy

    from transformers import DynamicCache

    lm = with_engine(tiny, engine)
    ids = random_ids(9, 2)
    pos = torch.arange(9)[None]
    many = [forward_all(m.model, torch.tensor([ids]), pos, DynamicCache(config=m.model.config), None) for m in (tiny, lm)]
    assert torch.equal(many[0], many[1])
    twin = copy.deepcopy(lm.model)
    one = [forward_last(m, torch.tensor([ids[:1]]), pos[:, :1], DynamicCache(config=m.config), None)
           for m in (tiny.model, lm.model, twin)]
    drift = (one[0] - one[1]).abs().max().item()
    assert drift < tol and (drift > 0 or engine == "fp32p")  # fp16 weights always move the logits
    assert torch.equal(one[1], one[2])
    layers = [m for m in lm.model.modules() if isinstance(m, PhaseLinear)]
    fp32_bytes = sum(m.weight.numel() * 4 for m in {id(m.weight): m for m in layers}.values())
    assert decode_weight_bytes(tiny.model) - decode_weight_bytes(lm.model) == fp32_bytes * (1 - byte_ratio)
    layer = next(m for m in twin.modules() if isinstance(m, PhaseLinear))
    assert layer.kind == engine and "w_c" not in dict(layer.named_buffers())


def test_fp16w_refuses_weights_fp16_cannot_hold():
    big = torch.nn.Linear(32, 16)
    with torch.no_grad():
        big.weight[3, 5] = 7e4  # past fp16's largest finite value: it would become inf
    with pytest.raises(ValueError, match="does not fit fp16"):
        PhaseLinear(big, "fp16w")


def test_modes_share_the_fp32_weights_and_identity(tiny):
    lm = with_engine(tiny, "int8")
    assert lm.identity.engine == "int8" and tiny.identity.engine == "fp32"
    assert lm.identity.fingerprint == tiny.identity.fingerprint
    assert weights_digest(lm.model) == weights_digest(tiny.model)  # compact copies are not state
    assert {id(p) for p in lm.model.parameters()} == {id(p) for p in tiny.model.parameters()}
    assert not any(isinstance(m, PhaseLinear) for m in tiny.model.modules())  # the fp32 model is untouched


def test_tied_head_keeps_sharing_the_embedding():
    from transformers import AutoModelForCausalLM

    from kvrelay.models.tiny import tiny_config

    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    apply_engine(model, "int8")
    assert isinstance(model.lm_head, PhaseLinear)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    strip_engine(model)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("payload_engine,receiver_engine", [("int8", "fp32"), ("fp32", "int8"), ("bf16", "int4")])
def test_payload_of_another_mode_is_refused_naming_both(tiny, payload_engine, receiver_engine):
    p = Agent(with_engine(tiny, payload_engine), "s").read(CONTEXT)
    receiver = Agent(with_engine(tiny, receiver_engine), "r", max_new_tokens=4)
    with pytest.raises(EngineMismatch) as err:
        receiver.respond("what is the key", p)
    assert isinstance(err.value, IncompatiblePayload)
    assert (err.value.payload_engine, err.value.receiver_engine) == (payload_engine, receiver_engine)
    assert repr(payload_engine) in str(err.value) and repr(receiver_engine) in str(err.value)


def test_accepting_another_mode_is_explicit_and_stamped(tiny):
    p = Agent(with_engine(tiny, "int8"), "s").read(CONTEXT)
    fp32 = with_engine(tiny, "fp32")
    with pytest.raises(EngineMismatch):  # accepting bf16 does not accept int8
        Agent(fp32, "r", adapter=AcceptEngines(("bf16",))).check(p)
    got = Agent(fp32, "r", adapter=AcceptEngines(("int8",))).check(p)
    assert got.meta.engine == "fp32" and got.meta.adapter.startswith("engine:int8@")
    assert all(a is b for a, b in zip(got.keys, p.keys, strict=True))  # tensors untouched
    other = Agent(tiny, "s").read(CONTEXT).with_meta(model_fingerprint="0" * 64, engine="int8")
    with pytest.raises(IncompatiblePayload, match="model_fingerprint"):  # only the receiver's own weights
        AcceptEngines(("int8",)).adapt(other, fp32.identity)
    for typo in ("int3", "fp32+int8", "auto"):  # not a mode: refused when written, not silently unmatched
        with pytest.raises(ValueError, match="PREFILL"):
            AcceptEngines((typo,))


def test_engine_drift_measures_the_one_token_step(tiny):
    d = engine_drift(tiny, with_engine(tiny, "int8"), random_ids(12, 3))
    assert d.engine_a == "fp32" and d.engine_b == "int8" and d.tokens == 12
    assert 0 < d.max_abs_kv and 0 < d.rel_kv < 0.1 and 0 < d.max_abs_logit
    same = engine_drift(tiny, tiny, random_ids(12, 3))
    assert same.max_abs_kv == 0 and same.max_abs_logit == 0


def test_engine_travels_on_the_wire_and_defaults_to_fp32():
    from kvrelay.models.tiny import tiny_lm

    meta = PayloadMeta.from_identity(with_engine(tiny_lm("llama"), "int4").identity)
    d = meta.to_strings()
    assert PayloadMeta.from_strings(d).engine == "int4"
    legacy = {k: v for k, v in d.items() if k != "engine"}  # written before the field existed
    assert PayloadMeta.from_strings(legacy).engine == "fp32"


@pytest.mark.parametrize("engine", [e for e in COMPACT if e.startswith("bf16+")])
def test_bf16_prefill_runs_multi_token_calls_in_bf16_and_one_token_calls_in_the_decode_precision(tiny, engine):
    from transformers import DynamicCache

    from kvrelay.models.engine import precisions

    lm = with_engine(tiny, engine)
    assert precisions(engine) == ("bf16", engine.split("+")[1])
    decode_twin = with_engine(tiny, engine.split("+")[1])  # the same decode precision, fp32 prefill
    ids, pos = torch.tensor([random_ids(9, 1)]), torch.arange(9)[None]
    many = [forward_all(m.model, ids, pos, DynamicCache(config=m.model.config), None) for m in (tiny, lm)]
    assert 0 < (many[0] - many[1]).abs().max().item() < 0.5  # prefill: bf16 GEMMs, close to fp32
    one = [forward_last(m.model, ids[:, :1], pos[:, :1], DynamicCache(config=m.model.config), None)
           for m in (decode_twin, lm)]
    assert torch.equal(one[0], one[1])  # decode: the decode precision's kernel, whatever the prefill


def test_auto_choice_follows_the_measurements():
    from kvrelay.models.engine_auto import PREFILL_MARGIN, choose

    c = choose({"fp32": 1.0, "bf16": 0.25}, {"fp32": 0.1, "bf16": 0.06, "int8": 0.04})
    assert (c.engine, c.prefill, c.decode) == ("bf16+int8", "bf16", "int8")
    assert "4.00x" in c.why and "int8 40.0" in c.why
    slow = choose({"fp32": 1.0, "bf16": 5.0}, {"fp32": 0.1, "bf16": 0.06, "int8": 0.07})  # an AVX2-only host
    assert (slow.engine, slow.prefill) == ("bf16", "fp32") and "under" in slow.why
    edge = choose({"fp32": PREFILL_MARGIN * 0.99, "bf16": 1.0}, {"fp32": 0.1})  # a gain inside the margin
    assert edge.engine == "fp32"
    assert choose({"fp32": PREFILL_MARGIN, "bf16": 1.0}, {"fp32": 0.1}).engine == "bf16+fp32"
    with pytest.raises(ValueError, match="positive timings"):
        choose({"bf16": 1.0}, {"fp32": 0.1})


def test_auto_measures_both_phases_records_why_and_is_reproducible_from_its_record(tiny, tmp_path, monkeypatch):
    from kvrelay.models import engine_auto

    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path))
    picked = engine_auto.pick_engine(tiny, ("fp32", "int8"))
    cache = json.loads((tmp_path / "engine_auto.json").read_text())
    (entry,) = cache.values()
    assert set(entry["decode_s"]) == {"fp32", "int8"} and set(entry["prefill_s"]) == {"fp32", "bf16"}
    assert all(t > 0 for t in (*entry["decode_s"].values(), *entry["prefill_s"].values()))
    again = engine_auto.choose(entry["prefill_s"], entry["decode_s"], entry["prefill_margin"])
    assert entry["engine"] == picked == again.engine and entry["why"] == again.why
    assert (entry["prefill"], entry["decode"]) == (again.prefill, again.decode)
    assert entry["cpu_flags"] == list(engine_auto.cpu_flags()) and entry["threads"] == torch.get_num_threads()
    assert engine_auto.cached_entry(tiny) == entry
    entry["engine"] = "int8" if picked == "fp32" else "fp32"  # a later load reads the pick, not the clock
    (tmp_path / "engine_auto.json").write_text(json.dumps(cache))
    assert engine_auto.pick_engine(tiny, ("fp32", "int8")) == entry["engine"]
    entry["version"] = 1  # an entry of an older layout (decode only) is measured again
    (tmp_path / "engine_auto.json").write_text(json.dumps(cache))
    engine_auto.pick_engine(tiny, ("fp32", "int8"))
    (fresh,) = json.loads((tmp_path / "engine_auto.json").read_text()).values()
    assert fresh["version"] == engine_auto.VERSION and fresh["measured_at"] > entry["measured_at"]


def test_a_payload_records_both_precisions_and_another_prefill_is_refused(tiny):
    p = Agent(with_engine(tiny, "bf16+int8"), "s").read(CONTEXT)
    assert p.meta.engine == "bf16+int8"
    assert PayloadMeta.from_strings(p.meta.to_strings()).engine == "bf16+int8"
    with pytest.raises(EngineMismatch):  # same decode precision, other prefill
        Agent(with_engine(tiny, "int8"), "r", max_new_tokens=4).respond("what is the key", p)
    got = Agent(with_engine(tiny, "int8"), "r", adapter=AcceptEngines(("bf16+int8",))).check(p)
    assert got.meta.adapter.startswith("engine:bf16+int8@")


def test_unknown_engine_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="engine must be one of"):
        with_engine(tiny, "int3")


def test_padded_batch_decodes_each_row_as_alone_in_int8(tiny):
    """Batched one-token steps (B, 1, in) take the compact kernel too; padding changes no row."""
    lm = with_engine(tiny, "int8")
    sender, receiver = Agent(lm, "sender"), Agent(lm, "receiver", max_new_tokens=6)
    payloads = [sender.prefill(random_ids(n, 20 + n)) for n in (4, 13)]
    prompts = ["what is the code", "which vault is blue and what is the key"]
    batched = receiver.respond_batch(prompts, payloads)
    for p, prompt, got in zip(payloads, prompts, batched, strict=True):
        assert got.token_ids == receiver.respond(prompt, p, max_new_tokens=6).token_ids


def test_mode_names_split_in_one_place():
    from kvrelay.core.modes import mode_name, split_mode
    from kvrelay.policy.features import Features

    for name, m in ENGINES_MODES().items():
        assert split_mode(name) == (m.prefill, m.decode) and mode_name(m.prefill, m.decode) == name
    assert Features.of("a b c", "x", 1, "bf16+int8").quantized and not Features.of("a", "x", 1, "bf16").quantized
    for bad in ("fp32+int8", "int8+bf16", "bf16+", "+int8", "bf16+int8+int4", "auto"):
        with pytest.raises(ValueError):
            split_mode(bad)


def ENGINES_MODES():
    from kvrelay.models.engine import ENGINE_MODES
    return ENGINE_MODES
