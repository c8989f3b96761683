"""`kvrelay models list|info|pull` through typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app

runner = CliRunner()
FIELDS = {"fingerprint", "tokenizer_hash", "layer_types", "sliding_window", "rope", "kv_bytes_per_token_fp32",
          "num_layers", "num_kv_heads", "head_dim", "arch"}


def test_list_shows_every_zoo_model():
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0, res.output
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        assert name in res.output


def test_info_on_a_local_folder_writes_json(tiny_gemma3_dir, tmp_path):
    out = tmp_path / "info.json"
    res = runner.invoke(app, ["models", "info", str(tiny_gemma3_dir), "--json", str(out)])
    assert res.exit_code == 0, res.output
    facts = json.loads(out.read_text())
    assert FIELDS <= facts.keys()
    assert facts["sliding_window"] == 8 and len(facts["rope"]) == 2


def test_pull_and_info_reject_unknown_names():
    res = runner.invoke(app, ["models", "pull", "llama-70b"])
    assert res.exit_code == 2 and "expected one of smollm2-135m" in res.stderr
    res = runner.invoke(app, ["models", "info", "./no-such-folder"])
    assert res.exit_code == 2 and "no such folder" in res.stderr


@pytest.mark.integration
def test_info_on_smollm2_json(tmp_path):
    out = tmp_path / "smol.json"
    res = runner.invoke(app, ["models", "info", "smollm2-135m", "--json", str(out)])
    assert res.exit_code == 0, res.output
    facts = json.loads(out.read_text())
    assert FIELDS <= facts.keys()
    assert facts["num_layers"] == 30 and facts["num_kv_heads"] == 3 and facts["head_dim"] == 64
    assert facts["kv_bytes_per_token_fp32"] == 2 * 30 * 3 * 64 * 4
    assert facts["rope"][0]["theta"] == 100_000.0 and facts["rope"][0]["rotary_dim"] == 64
    assert len(facts["fingerprint"]) == 64 and len(facts["tokenizer_hash"]) == 64
