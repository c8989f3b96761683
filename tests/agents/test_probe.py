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


def test_a_cut_payload_is_the_prefix_prefilled_alone(tiny_by_arch):
    """``payload_prefix(p, n)`` is the cache of ``p``'s first ``n`` tokens, so ``relay_gain(upto=n)`` scores
    what a payload of those tokens alone would; a sliding-window payload past its window cannot be cut."""
    import torch

    from kvrelay.agents.probe import can_cut, payload_prefix
    from kvrelay.core.errors import InvalidInput
    from tests.conftest import random_ids

    agent = Agent(tiny_by_arch["qwen2"], "a")
    ids, n = random_ids(40, seed=3), 25
    full, alone = agent.prefill(ids), agent.prefill(ids[:n])
    cut = payload_prefix(full, n)
    assert cut.num_tokens == n and cut.token_ids[0].tolist() == ids[:n]
    for a, b in zip(cut.keys + cut.values, alone.keys + alone.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    text = ids[n - 1:n + 8]
    assert abs(relay_gain(agent, full, text, upto=n) - relay_gain(agent, alone, text)) < 1e-4
    assert payload_prefix(full, 40) is full
    with pytest.raises(InvalidInput):
        payload_prefix(full, 0)
    gemma = Agent(tiny_by_arch["gemma3"], "g")
    long = gemma.prefill(random_ids(40, seed=4))  # the tiny gemma3's sliding window is 8 tokens
    assert not can_cut(long, 20) and can_cut(long, 40)
    with pytest.raises(InvalidInput, match="sliding-window"):
        payload_prefix(long, 20)
