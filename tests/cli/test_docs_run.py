"""Every command README.md and docs/ show, run scaled down on smollm2-135m, its output checked against the text.

``RUNS`` are the scaled-down runs; ``test_every_documented_option_is_run`` (fast) fails when a
documented command or option has no run here. The runs go through the root command in process (the
same entry the ``kvrelay`` script calls), so the model loads once for all of them.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app
from tests.cli.test_docs import ROOT, documented_commands, resolve

SMOL = "smollm2-135m"
QUESTION = "Which function in the report has the bug, and what is the fix? Answer in one sentence."

# (id, argv with {tmp} for the test's folder, pieces the output must contain)
RUNS = [
    ("relay", ["relay", "--model", SMOL, "--context", "docs/demo/context.md", "--question", QUESTION,
               "--layout", "continue", "--max-new-tokens", "8", "--json", "{tmp}/relay.json"],
     ["identical answers: True", "kv (relayed cache)"]),
    ("relay-partial", ["relay", "--model", SMOL, "--context", "docs/demo/context.md", "--question", QUESTION,
                       "--partial", "0.25", "--partial-encoding", "int8", "--max-new-tokens", "6"],
     ["kv partial 0.25"]),
    ("bench-partial", ["bench", "partial", "--model", SMOL, "--tasks", "gen_easy", "--limit", "2", "--budgets",
                       "0.25", "--encodings", "raw,int8", "--methods", "full,receiver_driven,none",
                       "--max-new-tokens", "4", "--message-tokens", "8", "--threads", "2",
                       "--records", "{tmp}/partial.jsonl", "--json", "{tmp}/partial.json"], ["bench partial"]),
    ("bench-connector", ["bench", "connector", "--model", "tiny:llama", "--context-tokens", "80", "--new-tokens", "4",
                         "--repeats", "1", "--page-size", "16", "--max-batch-tokens", "256", "--threads", "1",
                         "--allow-load", "--json", "{tmp}/connector.json"],
     ["bench connector", "continuous_batching", "not connected: lmcache_vllm"]),
    ("relay-text", ["relay", "--model", SMOL, "--context-text", "The parser drops the last line.", "--question",
                    "What does the parser drop?", "--max-new-tokens", "6"], ["text (re-encode)"]),
    ("bench-relay", ["bench", "relay", "--model", SMOL, "--context-tokens", "64,96", "--repeats", "1",
                     "--max-new-tokens", "4", "--json", "{tmp}/bench_relay.json"], ["bench relay", "speedup"]),
    ("pipeline", ["bench", "pipeline", "--workflow", "review3", "--model", SMOL, "--context-tokens", "128",
                  "--repeats", "1", "--max-new-tokens", "4", "--min-new-tokens", "4", "--threads", "1", "--no-plot",
                  "--json", "{tmp}/pipeline.json"], ["outputs identical: True", "speedup"]),
    ("pipeline-toml-store", ["bench", "pipeline", "--workflow", "docs/demo/review2.toml", "--model", SMOL,
                             "--context-tokens", "128", "--repeats", "1", "--source", "code", "--max-new-tokens", "4",
                             "--backend", "inprocess", "--store", "memory://docs-test", "--codec", "int8",
                             "--json", "{tmp}/review2.json"], ["review2", "speedup"]),
    ("pipeline-auto", ["bench", "pipeline", "--workflow", "docs/demo/review2_auto.toml", "--model", SMOL,
                       "--context-tokens", "128", "--repeats", "1", "--source", "code", "--max-new-tokens", "4",
                       "--min-new-tokens", "4", "--threads", "1", "--no-plot",
                       "--profile", "artefacts/profiles/qwen2.5-coder-0.5b__fp32.json",
                       "--value", "docs/audit/full-qwen2.5-coder-0.5b", "--slo", "120", "--json", "{tmp}/auto.json"],
     ["review2_auto", "auto edge reader->fixer: kv (raw) in kv repeat(s) 1"]),
    ("replace-quality", ["bench", "replace-quality", "--workflows", "review3", "--model", SMOL, "--context-tokens",
                         "128", "--seeds", "0", "--json", "{tmp}/rq.json"], ["replace layout vs text", "fact kv"]),
    ("transfer", ["bench", "transfer", "--model", SMOL, "--context-tokens", "64", "--stores", "memory,disk",
                  "--codecs", "raw,fp16,int8,int4,evict:0.2", "--repeats", "1", "--no-link",
                  "--json", "{tmp}/transfer.json"], ["bench transfer", "break-even", "checks at 64"]),
    ("audit", ["audit", "--preset", "smoke", "--model", SMOL, "--tasks", "gen_easy:2", "--limit", "2",
               "--arms", "none,kv,kv_mismatched", "--engine", "fp32", "--threads", "2", "--seeds", "0",
               "--out", "{tmp}/audit"],
     ["too few tasks to tell (2 tasks; at least 20 are needed)", "report.html"]),
    ("audit-report", ["audit", "report", "{tmp}/audit"], ["too few tasks to tell", "report.html"]),
    ("read", ["read", "--model", SMOL, "--context", "docs/demo/context.md", "--out", "{tmp}/report.kv",
              "--codec", "int8"], ["report.kv"]),
    ("read-store", ["read", "--model", SMOL, "--context", "docs/demo/context.md", "--store", "file://{tmp}/store"],
     []),  # prints the store key (a content address)
    ("respond", ["respond", "--model", SMOL, "--payload", "{tmp}/report.kv", "--question", QUESTION,
                 "--max-new-tokens", "8", "--json", "{tmp}/respond.json"], []),
    ("inspect", ["inspect", "{tmp}/report.kv", "--json", "{tmp}/inspect.json"], ["int8"]),
    ("repair", ["bench", "repair", "--cases", "replace", "--model", SMOL, "--n", "2", "--context-tokens", "64",
                "--methods", "raw;reprefill", "--json", "{tmp}/repair.json"], ["bench repair"]),
    ("repair-variant", ["bench", "repair", "--cases", "variant", "--sender", "tiny:qwen2:1", "--receiver",
                        "tiny:qwen2:0", "--n", "2", "--context-tokens", "64", "--methods", "raw;reprefill",
                        "--threads", "1", "--records", "{tmp}/repair.jsonl", "--json", "{tmp}/repair_variant.json"],
     ["bench repair"]),
    ("fuse-fit", ["fuse", "fit", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--method", "ridge",
                  "--texts", "5", "--max-tokens", "16", "--out", "{tmp}/fuse"], ["wrote", "layer map"]),
    ("fuse-fit-layers", ["fuse", "fit", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--method", "layers",
                         "--texts", "5", "--max-tokens", "400", "--fraction", "0.5", "--alpha", "0.5", "--ridge",
                         "{tmp}/fuse", "--out", "{tmp}/layers"], ["wrote", "layers [", "of 4"]),
    ("fuse-eval-layers", ["fuse", "eval", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--tasks",
                          "arc_challenge", "--limit", "2", "--methods", "receiver,layers", "--layers", "{tmp}/layers",
                          "--max-new-tokens", "2", "--json", "{tmp}/fuse_eval_layers.json"], ["pairing shared layers"]),
    ("fuse-ttft-layers", ["fuse", "ttft", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--tokens", "64",
                          "--repeats", "1", "--method", "layers", "--artefact", "{tmp}/layers"],
     ["re-prefill", "layers"]),
    ("fuse-eval", ["fuse", "eval", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--tasks", "gen_easy",
                   "--limit", "2", "--methods", "receiver,ridge", "--artefact", "{tmp}/fuse", "--max-new-tokens", "2",
                   "--json", "{tmp}/fuse_eval.json", "--records", "{tmp}/fuse_eval.jsonl"], ["pairing private ridge"]),
    ("fuse-report", ["fuse", "report", "{tmp}/fuse_eval.jsonl", "--json", "{tmp}/fuse_report.json"],
     ["pairing private ridge"]),
    ("fuse-train", ["fuse", "train", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--method", "fuser",
                    "--steps", "2", "--examples", "4", "--held-out", "1", "--max-tokens", "400", "--rank", "4",
                    "--eval-every", "2", "--keep", "best", "--threads", "1", "--work", "{tmp}/fuser-work", "--out",
                    "{tmp}/fuser"], ["wrote", "kept the best at step 2", "gates open"]),
    ("fuse-eval-fuser", ["fuse", "eval", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--tasks",
                         "arc_challenge", "--limit", "2", "--methods", "receiver,fuser", "--fuser", "{tmp}/fuser",
                         "--max-new-tokens", "2", "--json", "{tmp}/fuse_eval_fuser.json"], ["pairing shared fuser"]),
    ("fuse-ttft", ["fuse", "ttft", "--receiver", "tiny:qwen2", "--sharer", "tiny:llama", "--tokens", "64",
                   "--repeats", "1", "--threads", "1", "--artefact", "{tmp}/fuse", "--json", "{tmp}/fuse_ttft.json"],
     ["re-prefill", "ridge"]),
    ("models-pull-gguf", ["models", "pull", SMOL, "--keep-gguf"], ["model.gguf"]),
    ("bench-engine", ["bench", "engine", "--model", SMOL, "--context-tokens", "32", "--engines", "fp32,int8",
                      "--peer", "none", "--repeats", "1", "--new-tokens", "2", "--pipeline-tokens", "2",
                      "--allow-load", "--json", "{tmp}/engine.json"], ["measuring the machine's limits", "kvrelay:fp32"]),
    ("bench-speculative", ["bench", "speculative", "--target", "tiny:qwen2", "--draft", "tiny:qwen2:1",
                           "--context-tokens", "32", "--new-tokens", "4", "--repeats", "1", "--allow-load",
                           "--min-draft", "2", "--engine", "fp32p", "--threads", "1", "--json", "{tmp}/speculative.json"],
     ["relay_lookup", "relay_draft"]),
    ("calibrate", ["calibrate", "--model", SMOL, "--context-tokens", "64,96", "--codecs", "raw,int8", "--stores",
                   "memory", "--repeats", "1", "--no-compare", "--link-mbps", "100", "--link-latency-ms", "1",
                   "--threads", "1", "--profile", "{tmp}/profile.json", "--json", "{tmp}/calibrate.json"],
     ["break-even bandwidth", "profile saved", "codec int8-g32"]),
    ("bench-policy", ["bench", "policy", "--profile", "{tmp}/calibrate.json", "--audits", "docs/audit", "--held-out",
                      "gen_easy,arc_challenge", "--per-set", "8", "--slo", "30", "--seed", "0",
                      "--plot", "{tmp}/frontier.png", "--json", "{tmp}/policy.json"],
     ["bench policy", "learned policy dominated", "held-out calibration"]),
    ("models-list", ["models", "list"], [SMOL, "qwen2.5-coder-0.5b"]),
    ("models-pull", ["models", "pull", SMOL], [f"{SMOL}: ready in"]),
    ("models-info", ["models", "info", SMOL, "--json", "{tmp}/info.json"], ["fingerprint", "KV bytes / token"]),
    ("models-info-stdout", ["models", "info", SMOL, "--json", "-"], ['"kv_bytes_per_token_fp32"']),
]
# documented options no scaled run can use here, and why
NOT_RUN = {
    ("bench", "pipeline", "--backend"): "ray: tests/transport/test_ray.py; process: tests/cli/test_pipeline_backends.py",
    ("bench", "pipeline", "--ray-address"): "needs an existing Ray cluster",
    ("bench", "connector", "--lmcache"): "needs vLLM's environment (make peers-vllm) and minutes to start it; "
                                         "refusal and peer commands: tests/bench/test_bench_connector.py",
    ("bench", "partial", "--no-verify"): "with --records, resumed and summarized: tests/bench/test_partial_bench.py",
    ("respond", "--key"): "the key is printed by `read --store` at run time: tests/cli/test_payload_cli.py",
    ("respond", "--store"): "with --key: tests/cli/test_payload_cli.py",
    ("respond", "--max-bytes"): "a receiver byte budget, refused and admitted: tests/cli/test_payload_cli.py",
    ("inspect", "--store"): "with a key: tests/cli/test_payload_cli.py",
    ("bench", "repair-profile"): "needs trained variant adapters (docs/repair.md): tests/fuse/test_repair.py",
    ("bench", "repair", "--profile"): "needs a deviation profile of two trained variants (layers=auto:K): "
                                      "tests/fuse/test_repair.py",
    ("verify",): "tiny-model runs of PAYLOAD --model --k --full --json and its argument mistakes: "
                 "tests/cli/test_verify_cli.py; --corpus builds every fault on a real model (minutes), its "
                 "mechanism runs in tests/agents/test_verify.py",
    ("read", "--keys-file"): "signs what it writes: tests/cli/test_verify_cli.py",
    ("respond", "--keys-file"): "refuses unsigned payloads: tests/cli/test_verify_cli.py",
    ("respond", "--verify"): "spot-checks before answering: tests/cli/test_verify_cli.py",
    ("bench", "soak"): "producer and consumer processes through a real Redis: tests/bench/test_soak.py",
    ("doctor",): "the group; its commands below",
    ("doctor", "models"): "tiny models through the CLI: tests/bench/test_doctor.py",
    ("doctor", "link"): "tiny models through the CLI: tests/bench/test_doctor.py",
    ("doctor", "payload"): "the library call on planted payloads: tests/bench/test_doctor.py",
    ("serve",): "a real `kvrelay serve` subprocess on a tiny model, answered and stopped by SIGTERM: "
                "tests/serve/test_cli.py; --ray replicas through the library: tests/serve/",
    ("bench", "serve"): "HTTP workflows against a gateway on tiny models: tests/bench/test_bench_serve.py",
    ("fuse",): "the group; its commands are run above",
    **{("audit", opt): "the audit of a workflow edge runs on a tiny model with every one of these options: "
                       "tests/audit/test_edge.py::test_cli_audit_workflow"
       for opt in ("--workflow", "--edge", "--inputs", "--score")},
    ("bench", "repair", "--tasks"): "squad hides a SQuAD passage among others up to the context size, more than "
                                    "a scaled run holds: tests/bench/test_repair_bench.py",
}
# which --json section of docs/json.md each run's JSON answers
JSON_SECTIONS = {"relay": "kvrelay relay --json", "bench-relay": "kvrelay bench relay --json",
                 "pipeline": "kvrelay bench pipeline --json", "pipeline-auto": "kvrelay bench pipeline --json",
                 "replace-quality": "kvrelay bench replace-quality --json",
                 "transfer": "kvrelay bench transfer --json", "respond": "kvrelay respond --json",
                 "inspect": "kvrelay inspect PAYLOAD --json", "repair": "kvrelay bench repair --json",
                 "repair-variant": "kvrelay bench repair --json",
                 "bench-engine": "kvrelay bench engine --json", "bench-partial": "kvrelay bench partial --json",
                 "bench-connector": "kvrelay bench connector --json",
                 "calibrate": "kvrelay calibrate --json", "bench-speculative": "kvrelay bench speculative --json",
                 "bench-policy": "kvrelay bench policy --json"}


def _argv(run: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in run]


def test_every_documented_option_is_run():
    ran: dict[tuple[str, ...], set[str]] = {}
    for _, argv, _ in RUNS:
        cmd, _, rest = resolve(list(argv))
        path = tuple(w for w in argv if not w.startswith("-"))[: len(argv) - len(rest)]
        ran.setdefault(path, set()).update(w for w in rest if w.startswith("--"))
    for where, command in documented_commands():
        flat = command.replace("\\|", "|")
        for c in "[]()":
            flat = flat.replace(c, " ")
        words = [w.split("|")[0] for w in flat.split()[1:] if w != "..."]
        if not words or words[0].startswith("-"):
            continue  # `kvrelay ... --model NAME`: any command
        _, _, rest = resolve(list(words))
        path = tuple(words[: len(words) - len(rest)])
        if not path or path in NOT_RUN:
            continue  # no such command (test_docs.py reports it) or run elsewhere
        assert path in ran, f"{where}: `{command}` has no scaled-down run in RUNS"
        for opt in (w for w in rest if w.startswith("--") and w not in ("--help",)):
            assert opt in ran[path] or (*path, opt) in NOT_RUN, f"{where}: {opt} of `{command}` is never run"


def json_fields(section: str) -> set[str]:
    text = (ROOT / "docs" / "json.md").read_text()
    body = text.split(f"## `{section}`", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in re.findall(r"^\| (`.*)$", body, re.M) if "only when" not in r]  # conditional fields say so
    return {f for row in rows for f in re.findall(r"`([a-z_0-9]+)`", row.split(" | ")[0])}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    out = {}
    for name, argv, _ in RUNS:
        res = CliRunner().invoke(app, _argv(argv, tmp), env={"COLUMNS": "200"})
        out[name] = (res, _argv(argv, tmp))
    return tmp, out


@pytest.mark.integration
@pytest.mark.parametrize(("name", "expect"), [(r[0], r[2]) for r in RUNS], ids=[r[0] for r in RUNS])
def test_documented_command_runs_and_says_what_the_docs_say(results, name, expect):
    res, _ = results[1][name]
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    for piece in expect:
        assert " ".join(piece.split()) in flat, (piece, res.output)


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(JSON_SECTIONS))
def test_json_has_the_documented_fields_and_its_command(results, name):
    tmp, runs = results
    res, argv = runs[name]
    assert res.exit_code == 0, res.output
    path = Path(argv[argv.index("--json") + 1])
    data = json.loads(path.read_text())
    missing = json_fields(JSON_SECTIONS[name]) - data.keys()
    assert not missing, f"docs/json.md lists {sorted(missing)} for {name}; the JSON has none of them"
    assert data["command"] == shlex.join(["kvrelay", *argv])  # the full command line, every flag


@pytest.mark.integration
def test_audit_folder_holds_the_documented_files(results):
    tmp, runs = results
    assert runs["audit"][0].exit_code == 0
    folder = tmp / "audit"
    for f in ("records.jsonl", "config.json", "run.json", "summary.json", "report.md", "report.html"):
        assert (folder / f).is_file(), f
    run = json.loads((folder / "run.json").read_text())
    assert run["commands"][-1] == shlex.join(["kvrelay", *runs["audit"][1]])
    summary = json.loads((folder / "summary.json").read_text())
    assert "too few tasks to tell" in summary["verdict"]
