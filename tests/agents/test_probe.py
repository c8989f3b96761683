"""The runtime switch on a real small model: the probe signal keeps relay on where the relayed cache is the
sender's own reading, and turns it off where the cache is planted to hurt (another task's reading)."""

from __future__ import annotations

import pytest

from kvrelay.agents.agent import Agent
from kvrelay.agents.probe import relay_gain
from kvrelay.core.corpus import prose
from kvrelay.policy.switch import RelaySwitch

QUESTION = "Summarise the text above."


@pytest.fixture(scope="module")
def smol():
    from kvrelay.models.loader import load_model

    return load_model("smollm2-135m")


@pytest.mark.integration
def test_switch_keeps_helpful_relay_and_drops_a_planted_cache(smol):
    sender, receiver = Agent(smol, "sender", max_new_tokens=12), Agent(smol, "receiver")
    turns = [sender.reading_ids(prose(7 * i)[:300]) + sender.prompt_ids(QUESTION) for i in range(6)]
    payloads = [sender.prefill(t[:-1]) for t in turns]  # the sender's turn; its last token opens the probe
    texts = [t[-1:] + list(sender.respond_ids(t[-1:], p, max_new_tokens=12).token_ids)
             for t, p in zip(turns, payloads, strict=True)]
    sw = RelaySwitch(threshold=2.0, hysteresis=0.5, min_samples=3, window=6)
    for i in range(6):
        sw.observe("matched", relay_gain(receiver, payloads[i], texts[i]))
        sw.observe("planted", relay_gain(receiver, payloads[(i + 1) % 6], texts[i]))  # another task's cache
    assert sw.relay_on("matched") and sw.estimate("matched") > 2.5
    assert not sw.relay_on("planted") and sw.estimate("planted") < 2.0
    assert [e.edge for e in sw.log] == ["planted"] and len(sw.log[0].evidence) >= 3
