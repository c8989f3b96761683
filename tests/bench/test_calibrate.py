"""``kvrelay calibrate``'s library side: rates from a transfer run, and a whole calibration on a tiny model."""

from __future__ import annotations

import pytest

from kvrelay.bench.calibrate import agreement, calibrate, profile_from_transfer
from kvrelay.policy.cost import CostProfile


def _codec_row(codec, n, payload, compress=0.01, prefill=None):
    return {"codec": codec, "context_tokens": n, "raw_bytes": 1000 * n, "payload_bytes": payload,
            "text_bytes": 4 * n, "compress_s": compress, "pack_s": 0.001, "unpack_s": 0.001, "decompress_s": 0.002,
            "cache_build_s": 0.001, "prompt_prefill_kv_s": 0.1, "prompt_prefill_text_s": 0.1,
            "prefill_context_s": 0.1 + 0.002 * n if prefill is None else prefill}


def test_rates_from_a_transfer_run_are_the_line_through_its_prefills():
    res = {"codecs": [_codec_row(c, n, 1000 * n // r) for n in (500, 1000) for c, r in (("raw", 1), ("int8-g32", 4))],
           "rows": [{"store": "memory", "codec": "raw", "payload_bytes": 1000 * n, "put_s": 1e-4, "get_s": 2e-4}
                    for n in (500, 1000)],
           "fingerprint": "f", "threads": 2}
    p = profile_from_transfer(res, model="m", prompt_tokens=0, decode_s_per_token=0.02)
    assert p.prefill_s_per_token == pytest.approx(0.002) and p.prefill_fixed_s == pytest.approx(0.1)
    assert p.codec("int8").ratio == 4.0 and p.raw_bytes_per_token == 1000.0 and p.text_bytes_per_token == 4.0
    assert p.codec("raw").encode_s_per_byte == pytest.approx(2 * 0.011 / 1.5e6)
    assert p.store("memory").put_s_per_byte == pytest.approx(2e-4 / 1.5e6)
    # the profile's break-even at 1000 tokens against a transfer run whose measured figure is the closed form
    be = p.break_even_mbps("raw", 1000, 0)
    rows = agreement(p, {"break_even": [{"codec": "raw", "context_tokens": 1000, "measured_mbps": be,
                                         "measured": {"bound": "between"}, "closed_form_mbps": be}]}, 0)
    assert rows[0]["profile_over_measured"] == pytest.approx(1.0)


def test_calibrate_a_tiny_model(tiny_by_arch, tmp_path):
    res = calibrate(tiny_by_arch["llama"], [48, 96], codec_names=["raw", "int8"], stores=["memory"], repeats=1,
                    compare=False)
    prof = CostProfile.from_dict(res["profile"])
    assert [c.name for c in prof.codecs] == ["raw", "int8-g32"]
    assert prof.codec("raw").lossless and prof.codec("int8").ratio > 1.5
    assert prof.decode_s_per_token > 0 and prof.raw_bytes_per_token > 0
    assert {(b["codec"], b["context_tokens"]) for b in res["break_even"]} >= {("raw", max(prof.measured["sizes"]))}
    assert "agreement" not in res and res["load_average_before"] and res["load_average_after"]
    assert CostProfile.load(prof.save(tmp_path / "p.json")) == prof
