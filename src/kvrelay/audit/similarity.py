"""Similarity analysis: how the receiver's internals change with the relay.

For a sample of tasks, one receiver prefill of its prompt per condition, with attention weights
and hidden states read from the model's public outputs (eager attention for the duration):

* ``attention_mass_on_relayed`` — share of the last prompt token's attention (mean over layers
  and heads) that lands on the relayed slots, per condition (``kv``, ``text_full``, ``kv_mismatched``).
* ``hidden_cosine`` — cosine similarity of the last-layer hidden state of the last prompt token
  between ``kv`` and ``text_full`` (≈ 1 when relay is exact) and between ``kv`` and ``kv_mismatched``.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from kvrelay.kv.cache import to_cache
from kvrelay.models.attention import eager_attention


@torch.inference_mode()
def _probe(model, cache, ids: list[int], start: int, relayed: int) -> tuple[float, torch.Tensor]:
    """Attention mass of the last token on slots [0, relayed) and its last hidden state."""
    x = torch.tensor([ids])
    pos = torch.arange(start, start + len(ids))[None]
    out = model(input_ids=x, position_ids=pos, cache=cache, use_cache=True, output_attentions=True,
                output_hidden_states=True, logits_to_keep=1)
    masses = []
    for att in out.attentions:  # (1, heads, q, kv_len) per layer
        last = att[0, :, -1, :]  # (heads, kv_len)
        kv_len = last.shape[-1]
        total_seen = start + len(ids)
        first_slot = total_seen - kv_len  # sliding layers see only a window of the latest slots
        upto = max(0, min(relayed - first_slot, kv_len))
        masses.append(float(last[:, :upto].sum(dim=-1).mean()))
    return float(np.mean(masses)), out.hidden_states[-1][0, -1].float()


def _ci(values: list[float], seed: int = 0) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    arr = np.asarray(values)
    boots = arr[rng.integers(0, len(arr), (2000, len(arr)))].mean(axis=1)
    return float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def similarity_rows(runner, tasks, seed: int = 0) -> list[dict]:
    """Rows for ``summary["similarity"]`` over ``tasks`` (one regime/task set)."""
    if not tasks:
        return []
    lm, recv = runner.lm, runner.receiver
    model = lm.model
    att = {"kv": [], "text_full": [], "kv_mismatched": []}
    cos = {"kv_vs_text_full": [], "kv_vs_mismatched": []}
    with eager_attention(model):
        for i, task in enumerate(tasks):
            p = runner.sender.read(task.context)
            m = runner._mismatched(tasks, (i + 1) % len(tasks), p.num_tokens)
            prompt = recv.prompt_ids(task.prompt)
            T = p.num_tokens
            a_kv, h_kv = _probe(model, to_cache(p, model.config), prompt, T, T)
            a_mm, h_mm = _probe(model, to_cache(m, model.config), prompt, T, T)
            full = p.token_ids[0].tolist() + prompt
            a_tf, h_tf = _probe(model, DynamicCache(config=model.config), full, 0, T)
            att["kv"].append(a_kv)
            att["kv_mismatched"].append(a_mm)
            att["text_full"].append(a_tf)
            cos["kv_vs_text_full"].append(float(torch.nn.functional.cosine_similarity(h_kv, h_tf, dim=0)))
            cos["kv_vs_mismatched"].append(float(torch.nn.functional.cosine_similarity(h_kv, h_mm, dim=0)))
    rows = []
    t0 = tasks[0]
    for cond, vals in att.items():
        lo, hi = _ci(vals)
        rows.append({"regime": t0.regime, "task": t0.task, "comparison": cond, "metric": "attention_mass_on_relayed",
                     "mean": float(np.mean(vals)), "ci_low": lo, "ci_high": hi, "n": len(vals)})
    for comp, vals in cos.items():
        lo, hi = _ci(vals)
        rows.append({"regime": t0.regime, "task": t0.task, "comparison": comp, "metric": "hidden_cosine",
                     "mean": float(np.mean(vals)), "ci_low": lo, "ci_high": hi, "n": len(vals)})
    return rows
