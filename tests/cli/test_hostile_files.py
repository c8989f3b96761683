"""Crafted payload files given to `kvrelay inspect` and `kvrelay respond`: both refuse exactly what `kr.load`
refuses, with one ``error:`` line and exit 2 — never "internal error", never "ok" for a file the receiver
would refuse. The files are edits of what `kvrelay read --out` writes (fp16, the default), re-sealed with
valid checksums."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import kvrelay as kr
from kvrelay.cli import app
from kvrelay.core.errors import CorruptPayload
from kvrelay.kv import wire

CONTEXT = "the report says the bug is in the code of the file and the fix is in line seven\n"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("hostile") / "p.kv"
    res = CliRunner().invoke(app, ["read", "--model", "tiny:qwen2", "--context-text", CONTEXT, "--out", str(path)])
    assert res.exit_code == 0, res.output
    return path.read_bytes()


def resealed(data: bytes, tensors=None, meta=None) -> bytes:
    t, m = wire.unpack(data)
    t = tensors(dict(t)) if tensors else t
    return wire.pack(t, {**m, **(meta or {})})


EDITS = {
    "zero-tokens": dict(tensors=lambda t: {n: x[:, :, :0] if x.ndim == 4 else x[:, :0] for n, x in t.items()}),
    "round-x": dict(meta={"round": '"x"'}),
    "negative-layer-count": dict(meta={"num_model_layers": "-1"}),
    "duplicate-layer-indices": dict(meta={"layer_indices": json.dumps([0, 0])}),
    "raw-nbytes-abc": dict(meta={"codec_raw_nbytes": "abc"}),
    "codec-unknown": dict(meta={"codec": "int9"}),
    "layer-dropped": dict(tensors=lambda t: {n: x for n, x in t.items() if not n.startswith("layers.1.")}),
    "mask-all-false": dict(tensors=lambda t: {**t, "mask": torch.zeros_like(t["mask"])}),
    "positions-near-int64-max": dict(tensors=lambda t: {**t, "positions": t["positions"] + (2**63 - 2**20)}),
}


def one_error(res, *pieces: str) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.exception)
    assert errors == lines[-1:] and "Traceback" not in res.stderr, res.stderr  # the last line, and only one
    assert "internal error" not in errors[0] and all(p in errors[0] for p in pieces), errors[0]
    return errors[0]


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_inspect_and_respond_refuse_what_load_refuses(genuine, tmp_path, edit):
    path = tmp_path / f"{edit}.kv"
    path.write_bytes(resealed(genuine, **EDITS[edit]))
    with pytest.raises(CorruptPayload) as refused:
        kr.load(path)
    res = CliRunner().invoke(app, ["inspect", str(path), "--json", str(tmp_path / "d.json")])
    one_error(res, str(path))
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["status"] == "corrupt" and d["reason"] == str(refused.value)
    res = CliRunner().invoke(app, ["respond", "--model", "tiny:qwen2", "--payload", str(path), "--question", "what?",
                                   "--max-new-tokens", "2"])
    one_error(res, str(refused.value)[:40])


def test_the_genuine_file_loads_and_inspects_ok(genuine, tmp_path):
    path = tmp_path / "p.kv"
    path.write_bytes(genuine)
    p = kr.load(path)  # the CLI's default (fp16) output: a raw float32 payload back
    assert p.meta.codec == "raw" and p.meta.dtype == "float32" and p.num_tokens > 8
    res = CliRunner().invoke(app, ["inspect", str(path), "--json", "-"])
    assert res.exit_code == 0 and json.loads(res.stdout)["status"] == "ok"


@pytest.mark.parametrize("content", [b"\x00" * 64, b"garbage that is not a payload", b"\xff" * 9])
def test_inspect_of_a_file_that_is_no_payload_has_an_error_line(tmp_path, content):
    path = tmp_path / "junk.kv"
    path.write_bytes(content)
    res = CliRunner().invoke(app, ["inspect", str(path)])
    one_error(res, "junk.kv")


def test_inspect_of_a_truncated_payload_has_an_error_line(genuine, tmp_path):
    path = tmp_path / "cut.kv"
    path.write_bytes(genuine[: len(genuine) // 2])
    one_error(CliRunner().invoke(app, ["inspect", str(path)]), "truncated payload")


def test_token_ids_outside_the_receivers_vocabulary_are_refused_at_receive(genuine, tmp_path):
    from kvrelay.models.tiny import tiny_lm

    vocab = tiny_lm("qwen2").identity.vocab_size
    assert vocab and vocab > 1
    path = tmp_path / "oov.kv"
    path.write_bytes(resealed(genuine, tensors=lambda t: {**t, "token_ids": t["token_ids"] + vocab}))
    assert kr.load(path).num_tokens > 0  # well-formed as a file: the vocabulary is the receiver's to know
    res = CliRunner().invoke(app, ["respond", "--model", "tiny:qwen2", "--payload", str(path), "--question", "what?",
                                   "--max-new-tokens", "2"])
    one_error(res, "outside the receiver's vocabulary", f"of {vocab}")
