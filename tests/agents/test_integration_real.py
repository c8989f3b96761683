"""Relay on a real zoo model (smollm2-135m, downloaded on first use): kv == text, CLI contracts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvrelay.agents.agent import Agent
from kvrelay.cli import app
from kvrelay.models.loader import load_model

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
CONTEXT = ("Ticket 4471: the nightly export job fails because the function export_orders stops one batch early. "
           "The range call uses len(rows) - batch_size as its end. The fix is to iterate to len(rows).")


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


def test_continue_layout_relay_equals_text_reencode(lm):
    sender = Agent(lm, "sender", role="You are a careful reader.")
    receiver = Agent(lm, "receiver", max_new_tokens=24)
    payload = sender.read(CONTEXT)
    kv = receiver.respond("Which function has the bug?", payload)
    text = receiver.respond("Which function has the bug?", payload.token_ids)
    assert kv.token_ids == text.token_ids and len(kv.token_ids) > 0
    assert kv.prefill_tokens < text.prefill_tokens


def test_replace_layout_runs_and_keeps_positions(lm):
    sender = Agent(lm, "sender")
    receiver = Agent(lm, "receiver", role="You are a terse reviewer.", max_new_tokens=12)
    payload = sender.read(CONTEXT)
    res = receiver.respond("Which function has the bug?", payload, layout="replace", return_payload=True)
    assert res.text.strip()
    prefix = len(receiver.encode(receiver.fmt.system(receiver.role)))
    assert int(res.payload.positions[0, prefix]) == prefix  # payload moved right behind the receiver's prefix


def test_cli_relay_json_contract(tmp_path):
    out = tmp_path / "relay.json"
    r = CliRunner().invoke(app, ["relay", "--model", MODEL, "--context-text", CONTEXT, "--question",
                                 "Which function has the bug?", "--max-new-tokens", "12", "--json", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    for f in ("model", "layout", "kv_answer", "text_answer", "identical", "kv_ttft_s", "text_ttft_s"):
        assert f in res
    assert res["identical"] is True and res["layout"] == "continue"


def test_cli_bench_relay_json_contract(tmp_path):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "relay", "--model", MODEL, "--context-tokens", "64,160", "--repeats", "1",
                                 "--max-new-tokens", "4", "--json", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["model"] == MODEL and [row["context_tokens"] for row in res["rows"]] == [64, 160]
    for row in res["rows"]:
        for f in ("context_tokens", "text_ttft_s", "kv_ttft_s", "ttft_speedup", "ideal_ttft_speedup",
                  "payload_bytes", "encode_s", "decode_s", "outputs_identical"):
            assert f in row
        assert row["outputs_identical"] is True and row["payload_bytes"] > 0
    load = res["load_average"]  # one reading before each of the 2 sizes' repeat, one after; printed in the title
    assert set(load) == {"load1_before_repeat", "load1_after", "status", "limit", "max"}
    assert len(load["load1_before_repeat"]) == 2 and load["status"] in ("quiet", "loaded")
    assert f"{load['status'].upper()}: 1-min load up to" in " ".join(r.output.split())


def test_cli_rejects_unknown_model():
    r = CliRunner().invoke(app, ["relay", "--model", "./no-such-model-xyz", "--context-text", CONTEXT, "--question", "y"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --model './no-such-model-xyz': no such folder")
