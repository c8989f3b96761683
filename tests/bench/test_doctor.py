"""`kvrelay doctor` names the right cause for each planted fault and passes a healthy link (tiny models).

Each fault is planted where it happens in real systems — in the transport between the two agents, or
in the receiver's batched forward — never inside kvrelay's own code, and each is found by the check
that owns it (``Report.cause``: the first failing check in ``doctor.CAUSES`` order).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from kvrelay.bench.doctor import CAUSES, Check, Report
from kvrelay.bench.doctor_link import Link, diagnose_link, next_logits
from kvrelay.bench.doctor_models import diagnose_models, held_out_figures
from kvrelay.bench.doctor_payload import diagnose_payload
from kvrelay.kv import wire
from kvrelay.kv.cache import to_cache
from kvrelay.kv.transforms import to_dtype
from kvrelay.models.generate import forward_last
from kvrelay.models.identity import model_identity
from kvrelay.models.loader import load_model, with_engine

LINK_CHECKS = ["compatible", "layer_map", "position", "precision", "mask", "engine", "echo"]


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny:llama")


def relabel(n: int):
    """A transport that moves the position labels by ``n`` without re-rotating the keys (an off-by-N)."""
    return lambda p: replace(p, positions=p.positions + n)


def fp16_round_trip(p):
    """A transport that silently stores K/V as fp16."""
    return to_dtype(to_dtype(p, torch.float16), torch.float32)


def reversed_layers(p):
    """A transport that writes the layers in the wrong order (a wrong layer map)."""
    return replace(p, keys=p.keys[::-1], values=p.values[::-1])


def maskless_logits(model, payload, rows):
    """A receiver's batched forward that forgets the attention mask (padding slots are attended)."""
    q = max(len(r) for r in rows)
    if payload is None:
        return next_logits(model, payload, rows)
    ids = torch.tensor([[0] * (q - len(r)) + list(r) for r in rows], dtype=torch.int64)  # (B, q)
    pos = payload.next_positions[:, None] + torch.arange(q)[None]  # (B, q)
    return forward_last(model, ids, pos, to_cache(payload, model.config), None)


def test_a_healthy_link_passes_every_check(llama):
    r = diagnose_link(Link(llama, llama))
    assert [c.name for c in r.checks] == LINK_CHECKS
    assert r.passed and r.cause is None, r.to_json()
    assert all(c.passed for c in r.checks)
    assert r.check("precision").value == 0.0  # a raw link is bit-exact
    assert r.check("position").value < 1e-4 and r.check("echo").value == 1.0


def test_a_declared_lossy_codec_passes_with_its_drift(llama):
    r = diagnose_link(Link(llama, llama, codec="int8"))
    assert r.passed, r.to_json()
    assert 0 < r.check("precision").value < 0.05


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_an_off_by_n_position_offset_is_named_with_its_n(arch):
    lm = load_model(f"tiny:{arch}")
    r = diagnose_link(Link(lm, lm, transport=relabel(3)))
    assert r.cause == "position_offset", r.to_json()
    c = r.check("position")
    assert c.passed is False and "off by -3" in c.hint  # keys rotated 3 positions earlier than labelled
    assert r.check("layer_map").passed and r.check("precision").passed  # nothing else is blamed


def test_a_dropped_mask_is_found_by_the_mask_check_only(llama):
    r = diagnose_link(Link(llama, llama, logits=maskless_logits))
    assert r.cause == "mask", r.to_json()
    assert [c.name for c in r.checks if c.passed is False] == ["mask"]


def test_an_fp16_round_trip_on_a_raw_link_is_named(llama):
    r = diagnose_link(Link(llama, llama, transport=fp16_round_trip))
    assert r.cause == "precision", r.to_json()
    c = r.check("precision")
    assert "fp16 round trip" in c.hint and 1e-5 < c.value < 1e-3
    assert r.check("position").passed and r.check("layer_map").passed


def test_a_payload_from_another_model_is_refused_and_named(llama):
    r = diagnose_link(Link(load_model("tiny:llama:1"), llama))
    assert r.cause == "model", r.to_json()
    assert r.check("compatible").value == "model_fingerprint"
    assert all(r.check(n).passed is None for n in ("layer_map", "position", "echo"))  # nothing ran on it


def test_a_wrong_layer_map_is_named(llama):
    r = diagnose_link(Link(llama, llama, transport=reversed_layers))
    assert r.cause == "layer_map", r.to_json()
    assert "layer 0 holds layer 3's" in r.check("layer_map").hint


def test_a_payload_from_another_engine_mode_is_named_with_its_drift(llama):
    r = diagnose_link(Link(with_engine(llama, "bf16"), llama))
    assert r.cause == "engine", r.to_json()
    assert r.check("compatible").value == "engine"
    assert r.check("engine").passed is False and r.check("engine").value > 0  # the drift accepting it costs


def test_causes_follow_the_documented_order():
    checks = [Check("echo", False, 0.0, "", "echo"), Check("mask", False, 1.0, "", "mask")]
    assert Report("link", checks).cause == "mask"
    assert CAUSES.index("model") < CAUSES.index("position_offset") < CAUSES.index("echo")
    with pytest.raises(ValueError, match="cause"):
        Check("x", False, None)


# -- doctor models ------------------------------------------------------------------------------

def _variant(lm, scale: float):
    m = copy.deepcopy(lm.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return replace(lm, name="tiny-llama-ft", model=m, identity=model_identity(m, lm.tokenizer))


def test_doctor_models_names_what_relay_needs(llama):
    from kvrelay.fuse.adapter import mha_from_gqa

    mha = mha_from_gqa(llama.model)
    wide = replace(llama, name="tiny-llama-mha", model=mha, identity=model_identity(mha, llama.tokenizer))
    cases = {"exact": (llama, llama), "head map": (llama, wide), "engine": (llama, with_engine(llama, "int8")),
             "variant": (llama, _variant(llama, 0.01)), "impossible": (llama, load_model("tiny:gemma3"))}
    for need, (a, b) in cases.items():
        r = diagnose_models(a, b)
        assert r.check("relay").value == need, (need, r.check("relay").hint)
        assert r.passed == (need != "impossible")
    far = diagnose_models(llama, _variant(llama, 1.0)).check("relay")  # same geometry, unrelated weights
    assert far.value == "impossible" and "weights" in far.hint
    rows = {row["field"]: row for row in diagnose_models(llama, load_model("tiny:gemma3")).facts["rows"]}
    assert not rows["num_layers"]["same"] and rows["head_dim"]["same"] and not rows["sliding_window"]["same"]


def test_held_out_figures_of_the_committed_artefacts():
    from kvrelay.fuse import artefact

    for folder in sorted(artefact.root().iterdir()):
        cfg = artefact.ArtefactConfig.from_json((folder / artefact.CONFIG).read_text())
        text = held_out_figures(cfg.metrics)
        assert ("R²" in text) if cfg.method in ("ridge", "layers") else ("loss" in text), (folder.name, text)


# -- doctor payload -----------------------------------------------------------------------------

def _bytes(lm, text="the key is blue seven", **meta):
    from kvrelay.agents.agent import Agent

    p = Agent(lm, "sender").read(text)
    return wire.encode(p.with_meta(**meta) if meta else p)


def test_doctor_payload_passes_its_own_models_payload(llama):
    r = diagnose_payload(_bytes(llama), llama)
    assert r.passed and r.check("usable").value == "yes", r.to_json()


@pytest.mark.parametrize(("fault", "cause", "check"), [
    ("model", "model", "model"), ("engine", "engine", "engine"), ("corrupt", "integrity", "integrity"),
    ("partial", "layers", "layers")])
def test_doctor_payload_names_each_mismatch(llama, fault, cause, check):
    from kvrelay.kv import codecs

    if fault == "model":
        data, lm = _bytes(load_model("tiny:qwen2")), llama
    elif fault == "engine":
        data, lm = _bytes(llama), with_engine(llama, "int8")
    elif fault == "corrupt":
        data, lm = bytearray(_bytes(llama)), llama
        data[-3] ^= 0xFF
        data = bytes(data)
    else:
        from kvrelay.agents.agent import Agent

        c = codecs.compress(Agent(llama, "s").read("the key is blue"), "layers:0-1")
        data, lm = b"".join(bytes(x) for x in wire.pack_parts(*c.to_wire())), llama
    r = diagnose_payload(data, lm)
    assert r.cause == cause, r.to_json()
    assert r.check(check).passed is False and r.check(check).hint


# -- the CLI ------------------------------------------------------------------------------------

def test_cli_doctor_link_writes_the_documented_json(tmp_path):
    from kvrelay.cli.app import app

    out = tmp_path / "doctor.json"
    before = torch.get_num_threads()
    threads = 1 if before != 1 else 2  # not torch's current count, so an ignored --threads shows
    try:
        res = CliRunner().invoke(app, ["doctor", "link", "--model", "tiny:llama", "--threads", str(threads),
                                       "--json", str(out)])
    finally:
        torch.set_num_threads(before)
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["passed"] is True and d["cause"] is None and d["command"].startswith("kvrelay doctor link")
    assert d["threads"] == threads
    assert [c["name"] for c in d["checks"]] == LINK_CHECKS
    assert all(set(c) == {"name", "passed", "value", "hint"} for c in d["checks"])


def test_cli_doctor_exits_1_on_a_failed_check_and_2_on_a_mistake(tmp_path):
    from kvrelay.cli.app import app

    out = tmp_path / "models.json"
    before = torch.get_num_threads()
    threads = 1 if before != 1 else 2
    try:
        res = CliRunner().invoke(app, ["doctor", "models", "tiny:llama", "tiny:gemma3", "--threads", str(threads),
                                       "--json", str(out)])
    finally:
        torch.set_num_threads(before)
    assert res.exit_code == 1 and "impossible" in res.output
    assert json.loads(out.read_text())["threads"] == threads
    res = CliRunner().invoke(app, ["doctor", "link", "--model", "tiny:llama", "--codec", "zstd"])
    assert res.exit_code == 2
    res = CliRunner().invoke(app, ["doctor", "link", "--model", "tiny:llama", "--threads", "0"])
    assert res.exit_code == 2 and "--threads" in res.output
