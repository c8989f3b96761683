"""The shipped qa adapter on qwen2.5-coder-0.5b: its own fingerprint, base payloads refused unless repaired."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from kvrelay.agents.agent import Agent  # noqa: E402
from kvrelay.core.errors import IncompatiblePayload  # noqa: E402
from kvrelay.fuse.repair import repair_adapter  # noqa: E402
from kvrelay.models.loader import load_model  # noqa: E402

pytestmark = pytest.mark.integration
TEXT = "The access code for the north vault is 4817. The south vault uses 2290."


def test_qa_variant_is_a_sibling_that_needs_a_repair():
    base, qa = load_model("qwen2.5-coder-0.5b"), load_model("qwen2.5-coder-0.5b+qa")
    assert qa.identity.fingerprint != base.identity.fingerprint
    assert qa.identity.tokenizer_hash == base.identity.tokenizer_hash
    payload = Agent(base, "reader").read(TEXT)
    with pytest.raises(IncompatiblePayload):
        Agent(qa, "answerer").respond("What is the north vault's code?", payload)
    fixed = Agent(qa, "answerer", adapter=repair_adapter(qa, "recompute:tokens=1")).check(payload)
    own = Agent(qa, "answerer").prefill(payload.token_ids[0].tolist())
    assert max(float((a - b).abs().max()) for a, b in zip(fixed.keys, own.keys, strict=True)) < 1e-3
