"""``bench.quiet``: a run is quiet only when every load reading is within its own threads + 0.5."""

from __future__ import annotations

import pytest

from kvrelay.bench.quiet import load_status, require_quiet
from kvrelay.core.errors import KVRelayError, MachineLoaded


def test_a_run_is_loaded_when_any_reading_exceeds_threads_plus_half():
    assert load_status([2.0, 2.5], threads=2)["status"] == "quiet"
    assert load_status([2.0, 2.51, 1.0], threads=2) == {"status": "loaded", "limit": 2.5, "max": 2.51}
    assert load_status([4.4], threads=4)["status"] == "quiet"


def test_require_quiet_refuses_a_busy_reading_unless_load_is_allowed():
    require_quiet(2.5, 2, allow_load=False, when="now")
    require_quiet(13.0, 2, allow_load=True, when="now")
    with pytest.raises(MachineLoaded) as err:
        require_quiet(2.6, 2, allow_load=False, when="before repeat 2")
    assert isinstance(err.value, KVRelayError)
    assert "2.60 before repeat 2" in str(err.value) and "expected a quiet machine (load <= 2.5)" in str(err.value)


def test_a_run_without_readings_is_refused():
    with pytest.raises(ValueError, match="at least one load reading"):
        load_status([], threads=2)
