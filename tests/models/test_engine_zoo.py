"""The int8 engine on a real model stays within a stated tolerance of fp32 (integration).

Measured on qwen2.5-coder-0.5b with this protocol (64-token prose prefill, 16 teacher-forced
one-token steps): int8 (bf16 activations) max |Δlogit| 0.43 (logits span ±29), KL 0.0014, the same
argmax at every step whose fp32 top-two margin exceeds NEAR_TIE (16 of 17 here; the 17th, a near-tie, matched
in some runs and not in others); int4 2.5 and KL 0.04 (opt-in only). The bounds leave about 2x headroom over int8.
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.core.corpus import prose
from kvrelay.models.generate import forward_last
from kvrelay.models.loader import with_engine

pytestmark = pytest.mark.integration
MAX_ABS_LOGIT, MAX_KL = 1.0, 0.005
# The one-token kernels return bf16, whose spacing is 0.0625 for logits in [8, 16): where fp32's top two
# logits are closer than NEAR_TIE the compact mode may pick either (step 8 of this protocol: margin 0.08).
NEAR_TIE = 0.25


def _steps(lm, ctx, steps):
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    out = [forward_last(lm.model, torch.tensor([ctx]), torch.arange(len(ctx))[None], cache, None)]
    for i, t in enumerate(steps):
        out.append(forward_last(lm.model, torch.tensor([[t]]), torch.tensor([[len(ctx) + i]]), cache, None))
    return torch.cat(out)  # (1 + steps, V)


def test_int8_logits_stay_within_tolerance_of_fp32(qwen05):
    ids = qwen05.tokenizer(prose(0))["input_ids"][:80]
    ref = _steps(qwen05, ids[:64], ids[64:80])
    got = _steps(with_engine(qwen05, "int8"), ids[:64], ids[64:80])
    assert (got - ref).abs().max().item() <= MAX_ABS_LOGIT
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    assert (lp.exp() * (lp - lq)).sum(-1).max().item() <= MAX_KL
    top = ref.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > NEAR_TIE  # steps where fp32's choice is not a near-tie
    assert clear.sum() >= 12 and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert not torch.equal(got, ref)  # the one-token steps did run on the int8 weights
