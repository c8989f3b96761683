"""The llama.cpp peer on a real GGUF (runs only where `make peers` installed llama-cpp-python)."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra: `make peers`")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def peer():
    from kvrelay.bench.peers.llamacpp import LlamaCppPeer
    from kvrelay.models.zoo import assemble

    return LlamaCppPeer(assemble("smollm2-135m", progress=False), threads=2, n_ctx=1024)


def test_restored_state_answers_like_re_reading_the_text(peer):
    from kvrelay.bench.peers.llamacpp import make_state, trial

    ctx = peer.tokenize("The vault code is blue seven. The river runs north past the mill. " * 8)
    question = peer.tokenize("What is the vault code?")
    state, _, _ = make_state(peer, ctx)
    assert list(state.token_ids) == ctx and state.nbytes > 0
    peer.prefill(ctx + question)
    text_ids, _ = peer.generate(6, set(), 6)
    r = trial(peer, state, question, 6, set())
    assert r["answer_ids"] == text_ids and r["decode_tokens"] == 6
    assert r["text_prefill_tokens"] == len(ctx) + len(question)


def test_state_hand_offs_hold_every_turn(peer):
    from kvrelay.bench.peers.llamacpp import Turn, pipeline

    ctx = peer.tokenize("A short shared document about rivers and mills.")
    turns = [Turn(f"a{i}", tuple(peer.tokenize(f" Agent {i}, add one fact.")), tuple(peer.tokenize("\n")))
             for i in range(3)]
    for handoff in ("text", "state"):
        run = pipeline(peer, ctx, turns, 4, set(), handoff)
        assert [a["decode_tokens"] for a in run["agents"]] == [4, 4, 4]
        assert (run["agents"][1]["relay_bytes"] > 0) == (handoff == "state")
    with pytest.raises(ValueError, match="handoff"):
        pipeline(peer, ctx, turns, 4, set(), "kv")
