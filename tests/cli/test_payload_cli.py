"""`kvrelay read` in one process and `kvrelay respond` in another give `kvrelay relay`'s answer;
`kvrelay inspect` verifies every tensor of raw and int8 payloads and names damaged ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvrelay.cli.app import app

CONTEXT = "the report says the bug is in the code of the file and the fix is in line seven\n"
QUESTION = "what is the bug and where is the fix"
CLI = [sys.executable, "-c", "from kvrelay.cli import main; main()"]


def kvrelay(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The CLI in a process of its own."""
    r = subprocess.run([*CLI, *args], capture_output=True, text=True)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def relay_answer(model: str, ctx, tmp_path, *extra: str) -> dict:
    out = tmp_path / "relay.json"
    r = CliRunner().invoke(app, ["relay", "--model", model, "--context", str(ctx), "--question", QUESTION,
                                 "--json", str(out), *extra])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def split_relay(model: str, ctx, tmp_path, *extra: str) -> tuple[str, str]:
    """(answer through a store key, answer through a payload file), each read and answered in separate processes."""
    store = tmp_path / "store"
    key = kvrelay("read", "--model", model, "--context", str(ctx), "--store", str(store), "--codec", "raw").stdout.strip()
    assert key.startswith("kvrelay/1:")
    by_key = kvrelay("respond", "--model", model, "--key", key, "--store", str(store), "--question", QUESTION,
                     *extra).stdout.strip()
    path = kvrelay("read", "--model", model, "--context", str(ctx), "--out", str(tmp_path / "p.kv"),
                   "--codec", "raw").stdout.strip()
    by_file = kvrelay("respond", "--model", model, "--payload", path, "--question", QUESTION, *extra).stdout.strip()
    return by_key, by_file


def test_read_then_respond_in_other_processes_equals_relay(tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(CONTEXT)
    want = relay_answer("tiny:qwen2", ctx, tmp_path, "--max-new-tokens", "8")
    assert want["identical"]
    assert split_relay("tiny:qwen2", ctx, tmp_path, "--max-new-tokens", "8") == (want["kv_answer"].strip(),) * 2


def test_respond_refuses_another_models_payload_with_one_error_line(tmp_path):
    path = kvrelay("read", "--model", "tiny:qwen2", "--context-text", CONTEXT, "--out", str(tmp_path / "p.kv")).stdout
    r = kvrelay("respond", "--model", "tiny:llama", "--payload", path.strip(), "--question", QUESTION, check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [r.stderr.strip().splitlines()[-1]]
    assert "model_fingerprint" in r.stderr
    r = kvrelay("respond", "--model", "tiny:qwen2", "--payload", str(tmp_path / "none.kv"), "--question", "x",
                check=False)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_read_sends_fp16_unless_told_and_the_answer_survives(tmp_path):
    path = kvrelay("read", "--model", "tiny:qwen2", "--context-text", CONTEXT, "--out", str(tmp_path / "p.kv")).stdout
    d = json.loads(kvrelay("inspect", path.strip(), "--json", "-").stdout)
    assert d["codec"] == "fp16" and d["status"] == "ok"
    raw = kvrelay("read", "--model", "tiny:qwen2", "--context-text", CONTEXT, "--out", str(tmp_path / "r.kv"),
                  "--codec", "raw").stdout
    r = json.loads(kvrelay("inspect", raw.strip(), "--json", "-").stdout)
    assert r["codec"] == "raw" and r["bytes"]["kv"] == 2 * d["bytes"]["kv"]  # half the K/V bytes
    answers = {kvrelay("respond", "--model", "tiny:qwen2", "--payload", p.strip(), "--question", QUESTION,
                       "--max-new-tokens", "8").stdout for p in (path, raw)}
    assert len(answers) == 1  # the receiver casts fp16 back to its dtype and answers the same


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_inspect_verifies_each_tensor(tmp_path, codec):
    path = tmp_path / f"{codec}.kv"
    r = CliRunner().invoke(app, ["read", "--model", "tiny:gemma3", "--context-text", CONTEXT, "--out", str(path),
                                 "--codec", codec])
    assert r.exit_code == 0, r.output
    d = json.loads(kvrelay("inspect", str(path), "--json", "-").stdout)
    assert d["status"] == "ok" and d["codec"] == ("raw" if codec == "raw" else "int8-g32")
    assert len(d["layers"]) == 6 and {r["type"] for r in d["layers"]} == {"full_attention", "sliding_attention"}
    assert d["tokens"]["batch"] == 1 and d["tokens"]["slots"] > 8  # more tokens than the sliding window holds
    assert d["checksum"]["bad"] == [] and d["checksum"]["tensors_verified"] == d["header"]["tensors"]
    assert d["bytes"]["file"] == path.stat().st_size
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor of the data section
    path.write_bytes(bytes(data))
    r = kvrelay("inspect", str(path), "--json", "-", check=False)
    bad = json.loads(r.stdout)
    assert r.returncode == 2 and bad["status"] == "corrupt" and len(bad["checksum"]["bad"]) == 1
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [r.stderr.strip().splitlines()[-1]]
    assert "sha256 mismatch" in r.stderr
    data[20] ^= 0x01  # inside the header: the root checksum no longer matches
    path.write_bytes(bytes(data))
    r = kvrelay("inspect", str(path), "--json", "-", check=False)
    assert r.returncode == 2 and json.loads(r.stdout)["status"] == "corrupt" and "reason" in json.loads(r.stdout)
    assert r.stderr.strip().splitlines()[-1].startswith("error:")


@pytest.mark.integration
def test_read_respond_equals_relay_on_a_real_model(tmp_path):
    ctx = tmp_path / "ctx.md"
    ctx.write_text("Incident report: the nightly export job failed. The function export_orders divides the total "
                   "by the number of orders, which is zero on holidays.\n")
    want = relay_answer("smollm2-135m", ctx, tmp_path, "--max-new-tokens", "24")
    assert split_relay("smollm2-135m", ctx, tmp_path, "--max-new-tokens", "24") == (want["kv_answer"].strip(),) * 2


def test_respond_max_bytes_refuses_a_payload_that_decodes_to_more_before_decoding_it(tmp_path):
    """The budget counts the decoded payload (fp32 here), not the fp16 file; over it: one error line, exit 2."""
    from kvrelay.kv import wire

    path = kvrelay("read", "--model", "tiny:qwen2", "--context-text", CONTEXT, "--out", str(tmp_path / "p.kv")).stdout
    data = (tmp_path / "p.kv").read_bytes()
    n = wire.decoded_nbytes(data)
    assert len(data) < n
    ask = ("respond", "--model", "tiny:qwen2", "--payload", path.strip(), "--question", QUESTION, "--max-new-tokens", "4")
    r = kvrelay(*ask, "--max-bytes", str(n - 1), check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [r.stderr.strip().splitlines()[-1]]
    assert f"a payload of {n} bytes does not fit the byte budget of {n - 1}" in r.stderr
    assert kvrelay(*ask, "--max-bytes", str(n)).stdout == kvrelay(*ask).stdout
    r = kvrelay(*ask, "--max-bytes", "0", check=False)
    assert r.returncode == 2 and "--max-bytes 0 is too small" in r.stderr
