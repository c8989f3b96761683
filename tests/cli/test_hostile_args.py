"""Hostile or broken arguments to `read`, `respond`, `inspect` and workflow TOML files: each is one ``error:``
line and exit 2, before any model loads (the rules of tests/cli/test_cli_mistakes.py), never an "internal
error". The environment faults are real: nothing listens on port 1, a path below a file cannot be a folder."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app
from tests.cli.test_cli_mistakes import SMOL, check_one_error, user_folder  # noqa: F401 - user_folder is a fixture

READ = ["read", "--model", SMOL, "--context", "ctx.md"]
RESPOND = ["respond", "--model", SMOL, "--payload", "ctx.md", "--question", "Q?"]
TRUE_TOML = 'name = "x"\n[[agents]]\nname = "a"\nrole = "r"\nprompt = "p"\nmax_new_tokens = true\n'
STR_TOML = 'name = "x"\n[[agents]]\nname = "a"\nrole = "r"\nprompt = "p"\nmax_new_tokens = "5"\n'
NO_DST_TOML = ('name = "x"\n[[agents]]\nname = "a"\nrole = "r"\nprompt = "p"\n[[agents]]\nname = "b"\nrole = "r"\n'
               'prompt = "p"\n[[edges]]\nsrc = "a"\n')

HOSTILE = [
    ("read-redis-no-server", [*READ, "--store", "redis://127.0.0.1:1/0"], "redis store redis://127.0.0.1:1/0"),
    ("read-redis-db-not-a-number", [*READ, "--store", "redis://127.0.0.1:1/abc"], "database 'abc' is not a number"),
    ("read-redis-port-not-a-number", [*READ, "--store", "redis://127.0.0.1:x/0"], "the port is not a number"),
    ("read-store-under-a-file", [*READ, "--store", "ctx.md/store"], "cannot open"),
    ("read-ttl-inf", [*READ, "--store", "memory://", "--ttl", "inf"], "--ttl inf"),
    ("read-ttl-nan", [*READ, "--store", "memory://", "--ttl", "nan"], "--ttl nan"),
    ("read-codec-layers-past-the-model", [*READ, "--out", "p.kv", "--codec", "layers:0-99+fp16"],
     "keeps layer 99 but the model has 30 layers"),
    ("respond-max-new-tokens-20-digits", [*RESPOND, "--max-new-tokens", "12345678901234567890"], "is too large"),
    ("respond-max-new-tokens-past-the-model", [*RESPOND, "--max-new-tokens", "9000"], "does not fit smollm2-135m"),
    ("respond-redis-no-server", ["respond", "--model", SMOL, "--key", "k", "--store", "redis://127.0.0.1:1/0",
                                 "--question", "Q?"], "expected a Redis server"),
    ("inspect-redis-no-server", ["inspect", "k", "--store", "redis://127.0.0.1:1/0"], "expected a Redis server"),
    ("pipeline-toml-max-new-tokens-true", ["bench", "pipeline", "--model", SMOL, "--workflow", "true.toml"],
     "agents[0].max_new_tokens is True; expected an integer"),
    ("pipeline-toml-max-new-tokens-str", ["bench", "pipeline", "--model", SMOL, "--workflow", "str.toml"],
     "agents[0].max_new_tokens is '5'; expected an integer"),
    ("pipeline-toml-edge-without-dst", ["bench", "pipeline", "--model", SMOL, "--workflow", "nodst.toml"],
     "edges[0]: missing ['dst']"),
]


@pytest.fixture()
def folder(user_folder):  # noqa: F811 - the fixture imported above
    (user_folder / "true.toml").write_text(TRUE_TOML)
    (user_folder / "str.toml").write_text(STR_TOML)
    (user_folder / "nodst.toml").write_text(NO_DST_TOML)
    return user_folder


@pytest.mark.parametrize(("argv", "expect"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_argument_gives_one_error_line_and_exit_2(folder, monkeypatch, argv, expect):
    monkeypatch.chdir(folder)
    before = sorted(p.name for p in folder.iterdir())
    res = CliRunner().invoke(app, argv)
    check_one_error(res.exit_code, res.stderr, expect)
    assert "internal error" not in res.stderr and "Python" not in res.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
