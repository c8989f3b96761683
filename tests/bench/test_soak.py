"""``kvrelay bench soak`` through a real Redis: producer and consumer processes, every payload got back and
checked bit for bit, none lost or mixed up; the JSON has its documented fields."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvrelay.bench.soak import synthetic
from kvrelay.cli.app import app


def test_synthetic_payloads_are_their_seed():
    a, b = synthetic(7), synthetic(7)
    assert all(x.equal(y) for x, y in zip(a.keys, b.keys, strict=True)) and not synthetic(8).keys[0].equal(a.keys[0])


@pytest.mark.redis
def test_soak_through_redis_loses_and_mixes_nothing(redis_url, tmp_path):
    out = tmp_path / "soak.json"
    r = CliRunner().invoke(app, ["bench", "soak", "--store", redis_url, "--producers", "2", "--consumers", "2",
                                 "--seconds", "3", "--codec", "int8", "--json", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["puts"] > 0 and res["gets"] == res["puts"] and res["lost"] == res["mixed_up"] == res["unconsumed"] == 0
    assert {"put_p50_ms", "put_p99_ms", "get_p50_ms", "get_p99_ms", "throughput_payloads_per_s", "load_average",
            "command"} <= set(res)


def test_soak_arguments_are_checked_before_anything_starts():
    for args in (["--producers", "0"], ["--consumers", "17"], ["--seconds", "0"], ["--store", "memory://x"],
                 ["--codec", "zip"]):
        r = CliRunner().invoke(app, ["bench", "soak", *args])
        assert r.exit_code == 2 and r.output.strip().startswith("error:"), (args, r.output)
