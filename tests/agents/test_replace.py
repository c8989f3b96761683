"""The replace layout on tiny llama / qwen2 / gemma3: the relayed cache moved behind the receiver's own
prefix must be exactly a plain prefill of the relayed tokens at the shifted offset (fp32, <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.kv.transforms import concat
from tests.agents.test_exact import TOL, logits_after
from tests.conftest import random_ids


@pytest.mark.parametrize("T, start", [(6, 0), (23, 3)])  # 23 tokens cross gemma3's window of 8; start moves Δ
def test_replace_layout_equals_prefill_at_the_shifted_offset(tiny, T, start):
    sender = Agent(tiny, "sender", role="read the report")
    receiver = Agent(tiny, "receiver", role="answer the question now", max_new_tokens=4)
    payload = sender.prefill(random_ids(T, 5), start=start)  # relayed at positions start..start+T-1
    prompt = "what is the key"
    res = receiver.respond(prompt, payload, layout="replace", return_payload=True)

    own = receiver.encode(receiver.fmt.system(receiver.role))
    S = len(own)
    assert S > 0 and res.relayed_tokens == T
    # reference: the receiver's prefix at 0..S-1, then the relayed tokens prefilled on their own at S..S+T-1
    moved = receiver.prefill(payload.token_ids[0].tolist(), start=S)
    context = concat(receiver.prefill(own), moved)
    q = receiver.prompt_ids(prompt, with_role=False)
    logits = logits_after(tiny, context, q, S + T)  # (q, V)
    out = res.payload
    assert out.positions[0].tolist() == list(range(out.num_tokens))  # no gap, no overlap: exact positions
    assert out.token_ids[0, :S + T + len(q)].tolist() == own + payload.token_ids[0].tolist() + q
    ref = receiver.extend(context, out.token_ids[0, S + T:].tolist())
    assert torch.equal(ref.positions, out.positions)
    for j, (a, b) in enumerate(zip((*ref.keys, *ref.values), (*out.keys, *out.values), strict=True)):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL, f"tensor {j}"
    if res.token_ids:  # the first answer token is the reference's greedy choice
        assert res.token_ids[0] == int(logits[-1].argmax())
