"""``kvrelay verify``: a genuine payload file is ok (exit 0), a re-checksummed edit is tampered (exit 1), a
corrupt one refused (exit 1), argument mistakes exit 2 before any model loads; ``read --keys-file`` signs and
``respond --keys-file`` / ``--verify K`` refuse what they cannot trust."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from kvrelay.cli.app import app
from kvrelay.kv import wire
from kvrelay.kv.sign import Key

MODEL = "tiny:qwen2"
TEXT = "the key of the blue vault is four and the bug is in line seven of the code " * 4


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_verify_a_genuine_an_edited_and_a_corrupt_file(tmp_path):
    kv = tmp_path / "doc.kv"
    assert run("read", "--model", MODEL, "--context-text", TEXT, "--out", str(kv), "--codec", "fp16").exit_code == 0
    r = run("verify", str(kv), "--model", MODEL, "--k", "4", "--json", str(tmp_path / "ok.json"))
    assert r.exit_code == 0, r.output
    ok = json.loads((tmp_path / "ok.json").read_text())
    assert ok["verdict"] == "ok" and len(ok["checked_positions"]) == 4 and 0 < ok["cost_fraction"] < 1
    assert set(ok) >= {"verdict", "reason", "checked_positions", "cost_fraction", "command"}
    tensors, meta = wire.unpack(kv.read_bytes())
    name = "layers.1.k"
    tensors[name] = (tensors[name].float() * -1).to(tensors[name].dtype)  # checksums recomputed by pack
    bad = tmp_path / "bad.kv"
    bad.write_bytes(wire.pack(tensors, meta))
    r = run("verify", str(bad), "--model", MODEL, "--k", "4", "--full", "--json", str(tmp_path / "bad.json"))
    assert r.exit_code == 1 and json.loads((tmp_path / "bad.json").read_text())["verdict"] == "tampered"
    corrupt = bytearray(kv.read_bytes())
    corrupt[-2] ^= 1
    bad.write_bytes(bytes(corrupt))
    r = run("verify", str(bad), "--model", MODEL, "--json", str(tmp_path / "c.json"))
    assert r.exit_code == 1 and json.loads((tmp_path / "c.json").read_text())["verdict"] == "refused"


def test_verify_argument_mistakes_exit_2_with_one_error_line(tmp_path):
    for args in (["verify", "--model", MODEL], ["verify", str(tmp_path / "x.kv"), "--corpus"],
                 ["verify", str(tmp_path / "absent.kv"), "--model", MODEL],
                 ["verify", str(tmp_path / "x.kv"), "--k", "1", "--model", MODEL]):
        (tmp_path / "x.kv").write_bytes(b"x")
        r = run(*args)
        assert r.exit_code == 2 and r.output.strip().startswith("error:"), (args, r.output)


def test_signed_read_and_a_receiver_that_requires_signatures_and_verifies(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(Key("hmac", "team", bytes(range(32))).to_line() + "\n")
    signed, unsigned = tmp_path / "s.kv", tmp_path / "u.kv"
    assert run("read", "--model", MODEL, "--context-text", TEXT, "--out", str(signed), "--keys-file",
               str(keys)).exit_code == 0
    assert run("read", "--model", MODEL, "--context-text", TEXT, "--out", str(unsigned)).exit_code == 0
    ask = ["respond", "--model", MODEL, "--question", "where is the bug", "--max-new-tokens", "3", "--keys-file",
           str(keys), "--verify", "4"]
    assert run(*ask, "--payload", str(signed)).exit_code == 0
    r = run(*ask, "--payload", str(unsigned))
    assert r.exit_code == 2 and "unsigned payload from 'sender'" in r.output
    tensors, meta = wire.unpack(signed.read_bytes())
    meta.pop("signature")
    tensors["layers.0.v"] = torch.zeros_like(tensors["layers.0.v"])  # re-signed by nobody: refused
    unsigned.write_bytes(wire.pack(tensors, meta))
    r = run("respond", "--model", MODEL, "--question", "q", "--payload", str(unsigned), "--verify", "4")
    assert r.exit_code == 2 and "failed verification" in r.output
