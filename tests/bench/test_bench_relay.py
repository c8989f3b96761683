"""``bench relay`` on a tiny model: its JSON records the 1-minute load before every repeat and after the run."""

from __future__ import annotations

import torch

from kvrelay.bench.relay import bench_relay
from kvrelay.models.tiny import tiny_lm


def test_bench_relay_records_the_load_of_every_repeat():
    threads = torch.get_num_threads()
    readings = iter([0.4, 0.61234, threads + 9.0, 0.5, 0.3])  # 2 sizes x 2 repeats, then after; one far above
    res = bench_relay(tiny_lm("qwen2"), [32, 48], repeats=2, max_new_tokens=2, show_progress=False,
                      load=lambda: next(readings))
    assert res["load_average"] == {"load1_before_repeat": [0.4, 0.61, threads + 9.0, 0.5], "load1_after": 0.3,
                                   "status": "loaded", "limit": threads + 0.5, "max": threads + 9.0}
    assert len(res["rows"]) == 2 and res["threads"] == threads
    for r in res["rows"]:
        assert r["outputs_identical"] and len(r["speedup_per_repeat"]) == 2
        assert r["ttft_speedup"] == r["text_ttft_s"] / r["kv_ttft_s"]
    for after, status in ((0.0, "quiet"), (threads + 1.0, "loaded")):  # the reading after the run counts too
        two = iter([0.0, after])
        load = bench_relay(tiny_lm("qwen2"), [32], repeats=1, max_new_tokens=2, show_progress=False,
                           load=two.__next__)["load_average"]
        assert load == {"load1_before_repeat": [0.0], "load1_after": after, "status": status,
                        "limit": threads + 0.5, "max": after}
