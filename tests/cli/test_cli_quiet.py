"""--quiet keeps only the results; every JSON records the full command line that made it (tiny model, fast)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app

ARGS = ["bench", "relay", "--model", "tiny:qwen2", "--context-tokens", "32", "--repeats", "1", "--max-new-tokens", "2"]


def test_quiet_silences_progress_but_not_results(tmp_path):
    loud = CliRunner().invoke(app, [*ARGS, "--json", str(tmp_path / "a.json")])
    quiet = CliRunner().invoke(app, ["--quiet", *ARGS, "--json", str(tmp_path / "b.json")])
    assert loud.exit_code == 0 and quiet.exit_code == 0, (loud.output, quiet.output)
    assert "bench relay:" in loud.stderr  # the progress bar
    assert "bench relay:" not in quiet.stderr and "%|" not in quiet.stderr
    assert "(medians of 1;" in quiet.stdout  # the table is still there (its title also names the load)


def test_json_command_is_the_full_argv_and_global_flags_go_anywhere(tmp_path):
    out = tmp_path / "r.json"
    argv = [*ARGS, "--threads", "1", "--json", str(out), "--quiet"]  # --quiet after the command works too
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["command"] == shlex.join(["kvrelay", *argv])


@pytest.mark.integration
def test_quiet_silences_weight_loading_in_the_kvrelay_script(tmp_path):
    from kvrelay.cli.common import QUIET_ENV
    from tests.cli.test_cli_mistakes import kvrelay_argv

    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}  # an in-process --quiet earlier set them
    loud = subprocess.run([*kvrelay_argv(), "models", "info", "smollm2-135m"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600, env=env)
    quiet = subprocess.run([*kvrelay_argv(), "--quiet", "models", "info", "smollm2-135m"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=600, env=env)
    assert loud.returncode == 0 and quiet.returncode == 0
    assert "Loading weights" in loud.stderr  # transformers' progress bar, on by default
    assert quiet.stderr == "" and "fingerprint" in quiet.stdout
