"""The first mistakes a user makes, run as a user runs them, in a fresh folder.

Every one must exit 2 before any model loads (no weight-loading progress on stderr), print exactly one
``error:`` line (no traceback) that names what was wrong, and leave nothing behind in the folder. Each runs
in process through the root command (the same entry the ``kvrelay`` script calls); one mistake per command
also runs as a real ``kvrelay`` subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app

SMOL = "smollm2-135m"
BAD_TOML = 'name = "x"\n[[agents]]\nname = "a"\nrole = "r"\nprompt = "p"\nmax_new_tokens = 0\n'
AUTO_TOML = ('name = "x"\n[[agents]]\nname = "a"\nrole = "r"\nprompt = "p"\n[[agents]]\nname = "b"\nrole = "r"\n'
             'prompt = "p"\n[[edges]]\nsrc = "a"\ndst = "b"\nchannel = "auto"\n')

# (id, argv after `kvrelay`, a piece of the error line)
MISTAKES = [
    ("context-missing-file", ["relay", "--model", SMOL, "--context", "nosuch/context.md", "--question", "Q?"],
     "no such file"),
    ("context-empty-file", ["relay", "--model", SMOL, "--context", "empty.md", "--question", "Q?"], "is empty"),
    ("context-is-folder", ["relay", "--model", SMOL, "--context", "adir", "--question", "Q?"], "is not a file"),
    ("context-text-empty", ["relay", "--model", SMOL, "--context-text", "", "--question", "Q?"],
     "--context-text is empty"),
    ("context-both", ["relay", "--model", SMOL, "--context", "ctx.md", "--context-text", "hi", "--question", "Q?"],
     "either --context FILE or --context-text TEXT"),
    ("context-none", ["relay", "--model", SMOL, "--question", "Q?"], "no context given"),
    ("speculative-min-draft", ["bench", "speculative", "--target", "tiny:qwen2", "--draft", "none", "--min-draft",
                               "9"], "expected at most --num-draft (4) and --lookup-tokens (8)"),
    ("question-empty", ["relay", "--model", SMOL, "--context", "ctx.md", "--question", ""], "--question is empty"),
    ("question-missing", ["relay", "--model", SMOL, "--context", "ctx.md"], "missing option --question"),
    ("relay-model-typo", ["relay", "--model", "smollm-135m", "--context", "ctx.md", "--question", "Q?"],
     "did you mean 'smollm2-135m'?"),
    ("relay-layout-unknown", ["relay", "--model", SMOL, "--context", "ctx.md", "--question", "Q?", "--layout", "swap"],
     "expected one of continue, replace"),
    ("relay-option-typo", ["relay", "--contxt", "ctx.md", "--question", "Q?"], "did you mean --context?"),
    ("bench-relay-sizes-not-int", ["bench", "relay", "--model", SMOL, "--context-tokens", "512,abc"],
     "'abc' is not an integer"),
    ("bench-relay-sizes-empty-item", ["bench", "relay", "--model", SMOL, "--context-tokens", "512,,1024"],
     "has an empty item"),
    ("bench-relay-repeats-zero", ["bench", "relay", "--model", SMOL, "--repeats", "0"], "--repeats 0 is too small"),
    ("bench-relay-too-long", ["bench", "relay", "--model", SMOL, "--context-tokens", "100000"],
     "does not fit smollm2-135m"),
    ("bench-relay-model-folder-missing", ["bench", "relay", "--model", "./no-such-model"], "no such folder"),
    ("bench-relay-json-is-folder", ["bench", "relay", "--model", SMOL, "--json", "adir"], "is a folder"),
    ("bench-policy-no-profile", ["bench", "policy", "--profile", "nosuch.json"], "no such file"),
    ("bench-policy-no-records", ["bench", "policy", "--profile", "ctx.md", "--audits", "adir"],
     "holds no records.jsonl"),
    ("pipeline-workflow-typo", ["bench", "pipeline", "--model", SMOL, "--workflow", "review4"],
     "did you mean 'review3'?"),
    ("pipeline-toml-missing", ["bench", "pipeline", "--model", SMOL, "--workflow", "mine.toml"], "no such file"),
    ("pipeline-toml-invalid", ["bench", "pipeline", "--model", SMOL, "--workflow", "bad.toml"],
     "is not a valid workflow"),
    ("pipeline-toml-auto", ["bench", "pipeline", "--model", SMOL, "--workflow", "auto.toml"],
     'has channel "auto" edges (a->b)'),
    ("pipeline-layout-unknown", ["bench", "pipeline", "--model", SMOL, "--layout", "swap"],
     "expected one of continue, replace"),
    ("pipeline-backend-typo", ["bench", "pipeline", "--model", SMOL, "--backend", "rai"], "did you mean 'ray'?"),
    ("pipeline-too-long", ["bench", "pipeline", "--model", SMOL, "--context-tokens", "8000"], "does not fit"),
    ("replace-quality-workflow-typo", ["bench", "replace-quality", "--model", SMOL, "--workflows", "doc5,dialog"],
     "did you mean 'dialogue'?"),
    ("transfer-codec-unknown", ["bench", "transfer", "--model", SMOL, "--codecs", "raw,int9"],
     "'int9' is not valid"),
    ("transfer-store-typo", ["bench", "transfer", "--model", SMOL, "--stores", "memory,redis2"],
     "did you mean 'redis'?"),
    ("calibrate-no-raw", ["calibrate", "--model", SMOL, "--codecs", "int8"], "expected raw among the codecs"),
    ("calibrate-link-zero", ["calibrate", "--model", SMOL, "--link-mbps", "0"], "a bandwidth > 0"),
    ("audit-dose-limit-1", ["audit", "--preset", "dose", "--model", SMOL, "--limit", "1", "--out", "D"],
     "expected --limit (or NAME:COUNT) >= 2"),
    ("audit-limit-0", ["audit", "--model", SMOL, "--limit", "0", "--out", "D"], "--limit 0 is too small"),
    ("audit-task-typo", ["audit", "--model", SMOL, "--tasks", "gen_eazy", "--out", "D"],
     "did you mean 'gen_easy'?"),
    ("audit-task-count-1", ["audit", "--model", SMOL, "--tasks", "squad:1", "--out", "D"], "has a bad count"),
    ("audit-arm-typo", ["audit", "--model", SMOL, "--arms", "kv,kv_nois:0.5", "--out", "D"],
     "'kv_nois:0.5' is not valid"),
    ("audit-preset-typo", ["audit", "--preset", "quik", "--out", "D"], "did you mean 'quick'?"),
    ("audit-model-typo", ["audit", "--preset", "smoke", "--model", "smollm-135m", "--out", "D"],
     "did you mean 'smollm2-135m'?"),
    ("audit-report-no-folder", ["audit", "report", "D"], "no such file"),
    ("engine-mode-unknown", ["bench", "engine", "--model", SMOL, "--engines", "fp32,int9"], "did you mean 'int8'?"),
    ("repair-case-typo", ["bench", "repair", "--cases", "varient"], "did you mean 'variant'?"),
    ("fuse-eval-task-typo", ["fuse", "eval", "--tasks", "squadd"], "did you mean 'squad'?"),
    ("fuse-fit-method", ["fuse", "fit", "--method", "fuser"], "expected ridge"),
    ("fuse-ttft-method", ["fuse", "ttft", "--method", "fuser"], "expected ridge or layers"),
    ("engine-flag-unknown", ["relay", "--model", SMOL, "--context", "ctx.md", "--question", "Q?", "--engine", "int3"],
     "expected one of fp32, fp32p, fp16w, bf16, fp16, int8, int4, bf16+fp32, bf16+fp32p, bf16+fp16w, bf16+bf16, "
     "bf16+fp16, bf16+int8, bf16+int4, auto"),
    ("models-info-typo", ["models", "info", "smollm-135m"], "did you mean 'smollm2-135m'?"),
    ("models-pull-unknown", ["models", "pull", "llama-70b"], "expected one of smollm2-135m"),
]


def kvrelay_argv() -> list[str]:
    script = Path(sys.executable).with_name("kvrelay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvrelay.cli.app"]


@pytest.fixture()
def user_folder(tmp_path):
    (tmp_path / "ctx.md").write_text("The function parse_header drops the last byte.\n")
    (tmp_path / "empty.md").write_text("  \n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    (tmp_path / "auto.toml").write_text(AUTO_TOML)
    return tmp_path


def test_the_table_is_big_enough():
    assert len(MISTAKES) >= 20 and len({m[0] for m in MISTAKES}) == len(MISTAKES)


def check_one_error(code: int, stderr: str, expect: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr  # no traceback, no loading bars
    assert expect in lines[0] and "; expected " in lines[0], lines[0]


@pytest.mark.parametrize(("argv", "expect"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_mistake_gives_one_error_line_and_exit_2(user_folder, monkeypatch, argv, expect):
    monkeypatch.chdir(user_folder)
    before = sorted(p.name for p in user_folder.iterdir())
    res = CliRunner().invoke(app, argv)
    check_one_error(res.exit_code, res.stderr, expect)
    assert sorted(p.name for p in user_folder.iterdir()) == before  # no output folder, no stray file


AS_SUBPROCESS = ("context-missing-file", "bench-relay-too-long", "pipeline-workflow-typo", "transfer-store-typo",
                 "audit-dose-limit-1", "models-info-typo", "relay-option-typo")


@pytest.mark.parametrize(("argv", "expect"), [m[1:] for m in MISTAKES if m[0] in AS_SUBPROCESS],
                         ids=[m[0] for m in MISTAKES if m[0] in AS_SUBPROCESS])
def test_mistake_in_the_kvrelay_script(user_folder, argv, expect):
    before = sorted(p.name for p in user_folder.iterdir())
    env = {k: val for k, val in os.environ.items() if k != "KVRELAY_DEBUG"}
    proc = subprocess.run([*kvrelay_argv(), *argv], cwd=user_folder, capture_output=True, text=True, env=env,
                          timeout=120)
    check_one_error(proc.returncode, proc.stderr, expect)
    assert sorted(p.name for p in user_folder.iterdir()) == before


def test_vllm_asked_for_without_its_environment_stops_before_any_model_loads(user_folder, monkeypatch):
    monkeypatch.chdir(user_folder)
    monkeypatch.setenv("KVRELAY_VLLM_PYTHON", str(user_folder / "no-vllm" / "bin" / "python"))
    res = CliRunner().invoke(app, ["bench", "engine", "--model", SMOL, "--peer", "none", "--vllm"])
    check_one_error(res.exit_code, res.stderr, "make peers-vllm")


def test_debug_shows_the_traceback(user_folder):
    proc = subprocess.run([*kvrelay_argv(), "--debug", "bench", "relay", "--repeats", "0"], cwd=user_folder,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "InvalidInput" in proc.stderr


def test_a_failed_run_removes_the_folder_it_made(tmp_path):
    """A run that fails after creating its output folder (here: inside the run) leaves no folder."""
    from kvrelay.cli.common import output_dir

    out = tmp_path / "D"
    with pytest.raises(RuntimeError), output_dir(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("model failed")
    assert not out.exists()
    with pytest.raises(RuntimeError), output_dir(out):
        (out / "records.jsonl").write_text('{"task_id": "t"}\n')  # trials done: a re-run resumes from them
        raise RuntimeError("killed mid-run")
    assert (out / "records.jsonl").exists()
