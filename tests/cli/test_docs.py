"""README, docs/ and --help say what the code does (fast checks; the scaled-down runs are in test_docs_run.py).

* every ``kvrelay ...`` command written in README.md or docs/*.md names a real command, and every
  option it uses exists on that command;
* help texts list what the code's own lists hold (presets, workloads, bench commands, engines);
* the TOML shown in docs/workflows.md is the shipped example and loads;
* the Python example in docs/api.md runs (on a tiny random model).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kvrelay.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GLOBAL = {"--debug", "--quiet", "--help"}


def documented_commands() -> list[tuple[str, str]]:
    """``(file, command)`` for every ``kvrelay`` command in inline code or in a shell block."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
        for line in (ln for b in blocks for ln in b.splitlines()):
            line = line.split(" #")[0].strip()
            if line.startswith("kvrelay "):
                out.append((path.name, line))
        for inline in re.findall(r"`(kvrelay [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            out.append((path.name, inline))
    return out


def resolve(words: list[str]):
    """The click command a word list names, its parents' options, and the words left over."""
    cmd, opts = get_command(app), set(GLOBAL)
    while words and hasattr(cmd, "commands") and words[0] in cmd.commands:
        opts |= {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        cmd = cmd.commands[words.pop(0)]
    return cmd, opts | {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}, words


def test_the_docs_have_commands():
    assert len(documented_commands()) >= 30


@pytest.mark.parametrize(("where", "command"), documented_commands())
def test_documented_command_exists_with_its_options(where, command):
    if command.split()[1] == "...":  # `kvrelay ... --model NAME`: any command; --model is on every one that loads
        pytest.skip("stands for any command")
    alternatives = command.replace("\\|", "|")
    for c in "[]()":
        alternatives = alternatives.replace(c, " ")
    words = [w for w in alternatives.split()[1:] if w != "..."]
    words = [w.split("|")[0] for w in words]  # `list | pull NAME`, `continue|replace`: the first stands for all
    cmd, opts, rest = resolve(words)
    assert not hasattr(cmd, "commands") or not rest or rest[0].startswith("-"), f"{where}: no command {rest[0]!r}"
    for w in rest:
        if w.startswith("--"):
            assert w.split("=")[0] in opts, f"{where}: `{command}` uses {w}, which {cmd.name} does not have"


def _help(*argv: str) -> str:
    res = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_help_lists_what_the_code_has():
    from kvrelay.audit.presets import PRESETS
    from kvrelay.workflows.workloads import WORKLOADS

    bench = get_command(app).commands["bench"]
    assert all(name in _help() for name in bench.commands)  # the top-level help promises only real commands
    assert "policy" in bench.commands and "calibrate" in get_command(app).commands  # decide per request: real
    audit = _help("audit")
    assert all(f"{name}:" in audit for name in PRESETS)
    pipeline = _help("bench", "pipeline")
    assert all(name in pipeline for name in WORKLOADS) and "inprocess | ray | process" in pipeline


def test_engine_names_match_the_engine_modes():
    from kvrelay.cli.validate import ENGINES
    from kvrelay.models.engine import ENGINES as MODE_NAMES

    assert ENGINES == (*MODE_NAMES, "auto")


def test_workflow_toml_in_the_docs_is_the_shipped_example():
    from kvrelay.workflows.spec import Workflow

    shown = re.search(r"```toml\n(.*?)```", (ROOT / "docs" / "workflows.md").read_text(), re.S).group(1)
    shipped = Workflow.load(ROOT / "docs" / "demo" / "review2.toml")
    doc = Workflow.from_toml(shown)
    assert (doc.name, doc.layout, doc.agents, doc.edges) == (shipped.name, shipped.layout, shipped.agents, shipped.edges)


def test_api_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S).group(1)
    exec(compile(code, "docs/api.md", "exec"), {})  # its asserts: kv == text, workflow outputs equal
    assert "'reader':" in capsys.readouterr().out  # it printed the answers by agent


def test_every_kr_name_in_the_api_page_exists():
    import kvrelay as kr

    names = set(re.findall(r"`kr\.([A-Za-z_]+)", (ROOT / "docs" / "api.md").read_text()))
    assert names and names <= set(kr.__all__), sorted(names - set(kr.__all__))


def test_the_commands_docs_engine_md_says_take_engine_are_those_that_do():
    """docs/engine.md lists the commands with ``--engine``; the command tree has exactly those."""
    def with_engine(cmd, path=()):
        if any("--engine" in p.opts for p in cmd.params):
            yield " ".join(path)
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from with_engine(sub, (*path, name))

    text = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    sentence = text[text.index("These commands take `--engine`"):text.index("`kvrelay bench engine` takes several")]
    listed = set()
    for item in re.findall(r"`([^`]+)`", sentence)[2:]:  # past `--engine` and the default's name
        *group, names = item.split()
        listed |= {" ".join((*group, name)) for name in names.split("|")}
    assert listed == set(with_engine(get_command(app)))
