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


def test_break_evens_from_constructed_link_rows():
    """Deterministic: link rows built by hand (kv = 0.2 s + 8 Mbit / rate, text = 1 s) break even at 10 Mbit/s."""
    from kvrelay.bench.links import LinkRow, break_evens

    def row(codec, rate):
        t = 8.0 / rate
        return LinkRow(codec=codec, context_tokens=64, rate_mbit=rate, payload_bytes=1_000_000, text_bytes=0,
                       transfer_s=t, text_transfer_s=0.0, goodput_mbit=rate, kv_s=0.2 + t, text_s=1.0,
                       kv_faster=0.2 + t < 1.0)

    links = [row("raw", r) for r in (2.0, 5.0, 20.0, 100.0)] + [row("other", 2.0)]
    codec_rows = [{"codec": "raw", "context_tokens": 64, "payload_bytes": 1_000_000, "text_bytes": 0,
                   "text_fixed_s": 1.0, "kv_fixed_s": 0.2},
                  {"codec": "fp16", "context_tokens": 64, "payload_bytes": 500_000, "text_bytes": 0,
                   "text_fixed_s": 1.0, "kv_fixed_s": 0.2}]
    raw, fp16 = break_evens(codec_rows, links)
    assert raw["measured"]["bound"] == "between" and raw["measured"]["rates_mbit"] == [5.0, 20.0]
    assert raw["measured_mbps"] == pytest.approx(10.0) and raw["closed_form_mbps"] == pytest.approx(10.0)
    assert fp16["measured"] == {"mbps": None, "bound": "skipped"} and fp16["closed_form_mbps"] == pytest.approx(5.0)
    # non-monotonic measurements (kv faster, then slower, then faster again) are reported as such
    assert measured_break_even_mbps([1.0, 2.0], [0.5, 2.0], [1.0, 1.0])["bound"] == "non-monotonic"
    # unordered input is sorted by rate first
    assert measured_break_even_mbps([20.0, 5.0], [0.6, 1.8], [1.0, 1.0])["mbps"] == pytest.approx(10.0)


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
def test_tbf_link_limits_a_payload_far_above_its_burst():
    """16 token-bucket bursts of data: the bucket empties, so the rate (not the burst) decides. Only
    orderings are checked, never a time threshold: more bytes or a lower rate always take longer."""
    _link_or_skip()
    burst = int(netem.tbf_args(20)[4])
    data = os.urandom(16 * burst)
    with netem.Link() as link:
        assert link.ns_a in _namespaces()
        link.set_rate(20)
        slow = link.send(data)
        half = link.send(data[: len(data) // 2])
        link.set_rate(2000)
        fast = link.send([data[:1000], data[1000:]])  # parts, as the wire format hands them over
    assert fast < slow and half < slow
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


def test_bench_over_a_link_that_limits_the_payload(tiny_by_arch):
    """4096 tokens of tiny llama (1.1 MB raw, 0.57 MB fp16): both over four times the 128 KiB burst."""
    _link_or_skip()
    res = bench_transfer(tiny_by_arch["llama"], [4096], stores=("memory",), codec_names=("raw", "fp16"), repeats=1,
                         rates_mbit=(20, 2000), bracket_codecs=())
    burst = int(netem.tbf_args(20)[4])
    names = ("raw", "fp16")
    links = {(lr["codec"], lr["rate_mbit"]): lr for lr in res["links"]}
    assert set(links) == {(c, r) for c in names for r in (20, 2000)}
    fixed = {cr["codec"]: cr for cr in res["codecs"]}
    for c in names:
        slow, fast = links[(c, 20)], links[(c, 2000)]
        assert slow["payload_bytes"] == fast["payload_bytes"] == fixed[c]["payload_bytes"] > 4 * burst
        assert slow["transfer_s"] > fast["transfer_s"]  # the link, not the machine, set the pace
        for lr in (slow, fast):
            assert lr["kv_s"] == pytest.approx(fixed[c]["kv_fixed_s"] + lr["transfer_s"])
            assert lr["text_s"] == pytest.approx(fixed[c]["text_fixed_s"] + lr["text_transfer_s"])
            assert lr["kv_faster"] == (lr["kv_s"] < lr["text_s"])
    assert links[("raw", 20)]["payload_bytes"] > 1.9 * links[("fp16", 20)]["payload_bytes"]
    assert links[("raw", 20)]["transfer_s"] > links[("fp16", 20)]["transfer_s"]  # more bytes, same rate
    for b in res["break_even"]:  # the reported break-even is the documented function of these measurements
        mine = sorted((lr for lr in res["links"] if lr["codec"] == b["codec"]), key=lambda lr: lr["rate_mbit"])
        assert b["measured"] == measured_break_even_mbps([lr["rate_mbit"] for lr in mine],
                                                         [lr["kv_s"] for lr in mine], [lr["text_s"] for lr in mine])
        cr = fixed[b["codec"]]
        assert b["closed_form_mbps"] == closed_form_break_even_mbps(cr["payload_bytes"], cr["text_bytes"],
                                                                    cr["text_fixed_s"], cr["kv_fixed_s"])
    assert "tbf" in res["link_note"]
    assert f"kvr-{os.getpid()}-" not in _namespaces()
