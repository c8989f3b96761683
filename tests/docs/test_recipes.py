"""docs/recipes.md runs as written, on tiny random models: each Python block with its model names (and the
Redis URL) swapped, and the commands of recipes 1 and 3 through the CLI (recipe 3 on the inputs file it
writes, its workflow's answers cut to 4 tokens). The other commands' options are checked by
tests/cli/test_docs.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app

ROOT = Path(__file__).resolve().parents[2]
MD = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")


def python_block(n: int, swaps: dict[str, str]) -> str:
    """The ``n``-th Python block of the page with each ``old`` line swapped; every swap must apply."""
    code = re.findall(r"```python\n(.*?)```", MD, re.S)[n]
    for old, new in swaps.items():
        assert old in code, f"recipes.md block {n} no longer has {old!r}"
        code = code.replace(old, new)
    return code


def command(recipe_start: str, swaps: dict[str, str]) -> list[str]:
    """The first ``kvrelay`` command of the shell block after ``recipe_start``, swapped, as argv."""
    block = re.search(r"```bash\n(.*?)```", MD[MD.index(recipe_start):], re.S).group(1).replace("\\\n", " ")
    line = next(ln.split(" #")[0] for ln in block.splitlines() if ln.startswith("kvrelay "))
    for old, new in swaps.items():
        assert old in line, f"recipes.md: {line!r} no longer has {old!r}"
        line = line.replace(old, new)
    return line.split()[1:]


def run(code: str, capsys, names: dict | None = None) -> str:
    exec(compile(code, "docs/recipes.md", "exec"), {} if names is None else names)
    return capsys.readouterr().out


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes read docs/demo/...


def test_recipe_1_pipeline_across_processes_through_redis(redis_url, at_root, capsys, tmp_path):
    url = redis_url.rstrip("/") + f"?namespace=kvrelay-recipe-{os.getpid()}"
    out = run(python_block(0, {'"qwen2.5-coder-0.5b", "redis://localhost:6390/0"': f'"tiny:qwen2:3", "{url}"'}),
              capsys)
    assert "'reviewer':" in out or "{" in out  # the answers by agent, then the relayed bytes
    argv = command("## 1.", {"redis://localhost:6390/0": url, "qwen2.5-coder-0.5b": "tiny:qwen2:3",
                             "--context-tokens 512": "--context-tokens 96", "out/review2_redis.json":
                             str(tmp_path / "r.json")})
    res = CliRunner().invoke(app, [*argv, "--max-new-tokens", "4"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["relay_bytes"] > 0 and doc["outputs_identical"] is not None


def test_recipe_2_a_fitted_adapter_on_your_own_question(at_root, capsys, tmp_path):
    from kvrelay.fuse import artefact, ridge
    from kvrelay.models.loader import load_model
    from tests.conftest import random_ids

    sharer, receiver = load_model("tiny:llama:1"), load_model("tiny:llama:0")
    readings = [[2, 6, 8] + random_ids(40, 100 + i) for i in range(12)]
    state = ridge.fit(sharer, receiver, readings, ridge.candidate_layers(4, 4))
    config, tensors = ridge.to_artefact(state, ("tiny:llama:0", receiver.identity), ("tiny:llama:1", sharer.identity),
                                        {"datasets": ["random token ids"], "seed": 0})
    folder = artefact.save(tmp_path / "ridge", config, tensors)
    names: dict = {}
    run(python_block(1, {'"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"': '"tiny:llama:0", "tiny:llama:1"',
                         '"artefacts/fuse/qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__ridge"': repr(str(folder))}),
        capsys, names)
    mapped = names["answerer"].check(names["reading"])  # what the answer was read from: the mapped cache
    assert mapped.meta.adapter.startswith("ridge@") and mapped.meta.model_fingerprint == receiver.identity.fingerprint
    assert names["answer"].relayed_tokens == names["reading"].num_tokens  # the answer continued the mapped cache


def test_recipe_3_audit_one_edge_of_your_workflow(tmp_path):
    """The recipe's inputs file and command, with the workflow's answers cut to 4 tokens: every default arm
    runs on every input and seed, and the summary holds the contrasts the recipe tells one to read."""
    from kvrelay.audit.edge import EDGE_ARMS

    section = MD[MD.index("## 3."):MD.index("## 4.")]
    inputs = tmp_path / "review_inputs.jsonl"
    inputs.write_text(re.search(r"<<'EOF'\n(.*?)EOF\n", section, re.S).group(1), encoding="utf-8")
    wf = tmp_path / "review2.toml"
    wf.write_text((ROOT / "docs/demo/review2.toml").read_text().replace("max_new_tokens = 32", "max_new_tokens = 4"))
    out = tmp_path / "audit-review"
    argv = command("## 3.", {"docs/demo/review2.toml": str(wf), "out/review_inputs.jsonl": str(inputs),
                             "qwen2.5-coder-0.5b": "tiny:qwen2", "out/audit-review": str(out)})
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    seeds = [int(s) for s in argv[argv.index("--seeds") + 1].split(",")]
    assert {(r["task_id"], r["arm"], r["seed"]) for r in records} == {
        (f"reader->fixer/{i}", a, s) for i in ("mean", "last", "is_even") for a in EDGE_ARMS for s in seeds}
    summary = json.loads((out / "summary.json").read_text())
    read = {e["contrast"] for e in summary["effects"] if e["task"] == "reader->fixer" and e["outcome"] == "success"}
    assert {"pairing", "kv_vs_none", "kv_vs_text_full"} <= read and summary["verdict"]
    assert (out / "report.html").is_file()
    assert CliRunner().invoke(app, ["audit", "report", str(out)]).exit_code == 0


def test_recipe_4_variants_with_a_repair(at_root, capsys):
    out = run(python_block(2, {'"qwen2.5-coder-0.5b+summarizer", "qwen2.5-coder-0.5b+qa"':
                               '"tiny:qwen2:1", "tiny:qwen2:0"'}), capsys)
    assert "refused: model_fingerprint" in out  # the sibling's cache is refused without a repair
    assert len(out.strip().splitlines()) >= 2  # and answered from with one
