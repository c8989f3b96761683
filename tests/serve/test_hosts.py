"""Replicas on one host share its cores: what a request sent beside busy replicas pays and imposes
(processor sharing), and the contention a replica measures while it answers."""

from __future__ import annotations

import uuid

import pytest

from kvrelay.serve.chat import Message
from kvrelay.serve.hosts import ALONE, Host, Placement, Sharing, destretch, host_of, sharing
from kvrelay.serve.protocol import ChatRequest


def test_sharing_starts_when_busy_replicas_outnumber_the_slots():
    assert sharing(1, []) == ALONE and sharing(1, [0, 0]) == ALONE  # idle neighbours cost nothing
    assert sharing(1, [3]) == Sharing(2.0, 3.0)  # half the cores; each of the 3 waits a full length longer
    assert sharing(2, [1]) == ALONE  # two slots: one neighbour runs beside it at full speed
    assert sharing(2, [1, 2]) == Sharing(1.5, 1.5)
    assert Placement("h", cores=2, threads=2).slots == 1 and Placement("h", cores=16, threads=4).slots == 4
    assert Placement("h", cores=1, threads=4).slots == 1  # never below one
    assert destretch(2.0, 1) == 2.0 and destretch(2.0, 2) == 1.0 and destretch(0.5, 1) == 1.0


def test_a_host_integrates_its_busy_replicas_over_time():
    h = Host()
    h.enter()
    alone = h.mark()
    assert h.mean_busy(alone) == pytest.approx(1.0, rel=1e-9)
    h.enter()
    both = h.mark()
    assert h.mean_busy(both) == pytest.approx(2.0, rel=1e-9)
    h.leave()
    h.leave()
    idle = h.mark()
    assert h.mean_busy(idle) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("batch", [False, True])
def test_a_replica_reports_the_contention_it_answered_under(batch):
    from kvrelay.models.tiny import tiny_lm
    from kvrelay.serve.replica import Replica

    here = Placement(f"hosts-test-{uuid.uuid4().hex[:8]}", cores=2, threads=2)
    r = Replica("tiny:llama", tiny_lm("llama", name="tiny:llama"), None, b"k" * 32, batch=batch, placement=here)
    try:
        ask = ChatRequest("tiny:llama", (Message("user", "hello there"),), 4, kv_handle=False)
        assert r.submit(ask, []).result().host_busy == pytest.approx(1.0, rel=1e-6)
        neighbour = host_of(here)  # another replica of the process placed on the same host, busy throughout
        assert neighbour is r.host
        neighbour.enter()
        try:
            assert r.submit(ask, []).result().host_busy == pytest.approx(2.0, rel=1e-6)
        finally:
            neighbour.leave()
    finally:
        r.close()
