"""``bench speculative`` on tiny models: every mode runs on every workload and writes text's tokens."""

from __future__ import annotations

import pytest
import torch

from kvrelay.bench.speculative import MODES, ROW_FIELDS, WORKLOADS, Setup, bench_speculative, report
from kvrelay.core.errors import MachineLoaded
from kvrelay.models.tiny import tiny_lm


def test_every_mode_on_every_workload_writes_the_text_answer():
    quiet = float(torch.get_num_threads())
    raw = bench_speculative(tiny_lm("qwen2"), tiny_lm("qwen2", seed=1), Setup(48, 6, 2, codec="raw"),
                            load_reader=lambda: quiet)
    res = report(raw, target="tiny:qwen2", draft="tiny:qwen2:1", command="c")
    assert [(r["workload"], r["mode"]) for r in res["rows"]] == [(w, m) for w in WORKLOADS for m in MODES]
    for r in res["rows"]:
        assert set(ROW_FIELDS) <= set(r) and r["outputs_identical"] and r["decode_tokens"] == 6
        assert (r["acceptance"] is None) == (r["mode"] in ("text", "relay"))
        assert r["decode_speedup_vs_relay"] > 0
    assert res["load_average"]["status"] == "quiet" and len(res["load_average"]["load1"]) == 1 + 2
    assert all(len(runs) == 2 for by_mode in raw["runs"].values() for runs in by_mode.values())


def test_a_loaded_machine_stops_the_run_unless_allowed():
    with pytest.raises(MachineLoaded):
        bench_speculative(tiny_lm("qwen2"), None, Setup(48, 4, 1, ("answer",)), modes=("text", "relay"),
                          load_reader=lambda: 99.0)
    raw = bench_speculative(tiny_lm("qwen2"), None, Setup(48, 4, 1, ("answer",)), modes=("text", "relay"),
                            load_reader=lambda: 99.0, allow_load=True)
    assert report(raw, target="t", draft=None, command="c")["load_average"]["status"] == "loaded"


def test_modes_without_text_or_a_draft_for_relay_draft_are_refused():
    with pytest.raises(ValueError, match="include text"):
        bench_speculative(tiny_lm("qwen2"), None, modes=("relay",))
    with pytest.raises(ValueError, match="draft model"):
        bench_speculative(tiny_lm("qwen2"), None, modes=("text", "relay_draft"))
