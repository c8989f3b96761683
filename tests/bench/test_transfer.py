"""``bench transfer`` on a tiny model with real stores (memory, disk, real Redis), real network
namespaces rate-limited with tc tbf, and the break-even arithmetic."""

from __future__ import annotations

import math
import os
import subprocess

import pytest

from kvrelay.bench.transfer import (
    bench_transfer,
    closed_form_break_even_mbps,
    measured_break_even_mbps,
)
from kvrelay.transport import netem

CONTRACT = ("store", "codec", "context_tokens", "raw_bytes", "payload_bytes", "encode_s", "put_s", "get_s",
            "decode_s", "overhead_s", "saved_prefill_s", "overhead_fraction")


def _link_or_skip():
    ok, why = netem.available()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root with iproute2, the link tests must run: {why}")
        pytest.skip(why)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# -- the arithmetic ------------------------------------------------------------------------------
def test_closed_form_break_even():
    # 10 MB more than the text, 2 s of compute saved -> 80 Mbit / 2 s = 40 Mbit/s
    assert closed_form_break_even_mbps(10_000_000 + 5000, 5000, 2.5, 0.5) == pytest.approx(40.0)
    assert math.isinf(closed_form_break_even_mbps(10_000_000, 0, 1.0, 1.0))  # kv saves nothing: never pays
    assert math.isinf(closed_form_break_even_mbps(10_000_000, 0, 1.0, 2.0))
    assert closed_form_break_even_mbps(100, 200, 1.0, 0.5) == 0.0  # smaller than the text and cheaper


def test_measured_break_even_interpolates_in_inverse_rate():
    # kv = 1 s + 80 Mbit / rate, text = 3 s: equal at 40 Mbit/s, exact because kv is linear in 1/rate
    rates = [10.0, 30.0, 100.0, 1000.0]
    kv = [1.0 + 80.0 / r for r in rates]
    got = measured_break_even_mbps(rates, kv, [3.0] * 4)
    assert got["bound"] == "between" and got["rates_mbit"] == [30.0, 100.0]
    assert got["mbps"] == pytest.approx(40.0)
    assert measured_break_even_mbps(rates, [0.5] * 4, [3.0] * 4)["bound"] == "below"
    assert measured_break_even_mbps(rates, [5.0] * 4, [3.0] * 4)["bound"] == "above"
    assert measured_break_even_mbps([], [], [])["mbps"] is None


def test_tbf_arguments():
    args = netem.tbf_args(10)
    assert args[:3] == ["tbf", "rate", "10mbit"] and int(args[4]) >= 128 << 10
    assert int(netem.tbf_args(10_000)[4]) == int(10_000e6 / 8 * 0.010)  # 10 ms of tokens at high rates
    with pytest.raises(ValueError):
        netem.tbf_args(0)


# -- the store rows ------------------------------------------------------------------------------
def test_bench_rows_have_contract_fields_and_add_up(tiny_by_arch, redis_url):
    res = bench_transfer(tiny_by_arch["qwen2"], [40], codec_names=("raw", "fp16", "int8", "evict:0.2"),
                         repeats=1, redis_url=redis_url, link=False)
    rows = res["rows"]
    assert {(r["store"], r["codec"]) for r in rows} == {(s, c) for s in ("memory", "disk", "redis")
                                                        for c in ("raw", "fp16", "int8-g32", "evict:0.2")}
    for r in rows:
        assert set(CONTRACT) <= set(r)
        assert all(r[k] > 0 for k in ("encode_s", "put_s", "get_s", "decode_s", "saved_prefill_s", "raw_bytes",
                                      "payload_bytes"))
        assert r["overhead_s"] == pytest.approx(r["encode_s"] + r["put_s"] + r["get_s"] + r["decode_s"])
        assert r["overhead_fraction"] == pytest.approx(r["overhead_s"] / r["saved_prefill_s"])
        assert r["path"] == "store"  # every codec through the real store
    by = {(r["store"], r["codec"]): r for r in rows}
    assert by[("disk", "fp16")]["payload_bytes"] < by[("disk", "raw")]["payload_bytes"]
    assert by[("redis", "int8-g32")]["payload_bytes"] < by[("redis", "fp16")]["payload_bytes"]
    assert "break_even_mbps" in res and res["break_even_mbps"] > 0  # closed form without a link
    assert "skipped" in res["link_note"] and res["links"] == []
    assert {b["codec"] for b in res["break_even"]} == {"raw", "fp16", "int8-g32", "evict:0.2"}


def test_unknown_store_or_codec_fails_loudly(tiny_by_arch):
    with pytest.raises(ValueError, match="store"):
        bench_transfer(tiny_by_arch["qwen2"], [16], stores=("tape",), link=False)
    with pytest.raises(ValueError, match="codec"):
        bench_transfer(tiny_by_arch["qwen2"], [16], stores=("memory",), codec_names=("zip",), link=False)


# -- the link ------------------------------------------------------------------------------------
def test_tbf_link_limits_the_rate():
    _link_or_skip()
    data = os.urandom(1 << 20)  # 1 MiB = 8.4 Mbit
    with netem.Link() as link:
        assert link.ns_a in _namespaces()
        link.set_rate(10)
        slow = link.send(data)
        link.set_rate(1000)
        fast = link.send([data[:1000], data[1000:]])  # parts, as the wire format hands them over
    assert slow >= 0.6, f"1 MiB over 10 Mbit/s took {slow:.3f}s"
    assert fast < slow / 5, f"1000 Mbit/s took {fast:.3f}s vs {slow:.3f}s at 10"
    assert link.ns_a not in _namespaces() and link.ns_b not in _namespaces()


def test_stale_namespaces_are_removed():
    _link_or_skip()
    name = "kvr-999999999-a"  # pid above any pid_max: its owner is surely gone
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netem.remove_stale()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert name not in _namespaces()


def test_bench_over_link_reports_break_even(tiny_by_arch):
    _link_or_skip()
    res = bench_transfer(tiny_by_arch["llama"], [40], stores=("memory",), codec_names=("raw", "int8"), repeats=1,
                         rates_mbit=(10, 1000))
    measured = {(lr["codec"], lr["rate_mbit"]) for lr in res["links"]}
    assert measured >= {(c, r) for c in ("raw", "int8-g32") for r in (10, 1000)}
    assert {c for c, _ in measured} == {"raw", "int8-g32"}  # only raw is bracketed around its break-even
    assert len(measured) <= 6
    for lr in res["links"]:
        assert lr["transfer_s"] > 0 and lr["kv_s"] > lr["transfer_s"] and lr["text_s"] > lr["text_transfer_s"]
    for b in res["break_even"]:
        assert b["measured"]["bound"] in ("between", "below", "above")
        assert b["closed_form_mbps"] >= 0
    assert "tbf" in res["link_note"]
    assert f"kvr-{os.getpid()}-" not in _namespaces()
