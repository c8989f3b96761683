"""`kvrelay relay --partial F`: the receiver-driven partial relay beside the full one, with its hop measured."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvrelay.cli.app import app

CONTEXT = ("the report says the bug is in the code of the file and the fix is in line seven and the key is "
           "blue and the vault code is four five six and the answer is in the red file\n")


def relay(tmp_path, *extra: str):
    out = tmp_path / "relay.json"
    r = CliRunner().invoke(app, ["relay", "--model", "tiny:llama", "--context-text", CONTEXT, "--question",
                                 "what is the key", "--max-new-tokens", "6", "--json", str(out), *extra])
    return r, (json.loads(out.read_text()) if r.exit_code == 0 else None)


def test_relay_partial_all_positions_equals_full_relay(tmp_path):
    r, d = relay(tmp_path, "--partial", "1.0")
    assert r.exit_code == 0, r.output
    p = d["partial"]
    assert p["identical_to_kv"] and p["answer"] == d["kv_answer"]
    assert p["positions_kept"] == p["positions_total"] == d["context_tokens"]
    assert p["candidates_checked"] == 0  # everything travels: nothing to choose between
    assert p["request_bytes"] > 0 and p["hop_s"] > 0 and p["ttft_s"] >= p["receiver_ttft_s"]


def test_relay_partial_quarter_int8_moves_fewer_bytes(tmp_path):
    r, d = relay(tmp_path, "--partial", "0.25", "--partial-encoding", "int8")
    assert r.exit_code == 0, r.output
    p = d["partial"]
    assert p["positions_kept"] < p["positions_total"] and p["bytes"] < d["payload_bytes"] / 4
    assert 1 <= p["candidates_checked"] <= 6 and p["mode"] in ("headwise", "layerwise") and p["pool"] in (1, 3, 5)


def test_relay_partial_mistakes_are_one_line(tmp_path):
    r, _ = relay(tmp_path, "--partial", "1.5")
    assert r.exit_code == 2 and "expected a number in (0, 1]" in r.output
    r, _ = relay(tmp_path, "--partial", "0.5", "--layout", "replace")
    assert r.exit_code == 2 and "expected --layout continue" in r.output
