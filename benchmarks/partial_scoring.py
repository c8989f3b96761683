"""Which scoring lets a receiver's question pick the positions it needs: an ablation of receiver-driven
partial relay's selection at one budget.

    .venv/bin/python benchmarks/partial_scoring.py --model qwen2.5-coder-0.5b --tasks squad,gen_easy \\
        --limit 20 --budget 0.25 --json docs/bench/partial_scoring_qwen2.5-coder-0.5b.json

On each task the sender reads the document (the audit's roles, as ``kvrelay bench partial``), the
receiver's prompt is run once over the sender's cache (``evict.attention_probe``), and the receiver
answers from the partial payload each variant selects from those same attention rows at ``--budget``
of the positions; ``full`` is the whole payload. A variant is (``window``: score by the last N prompt
tokens only, or all; ``pool``: max-pool the scores over that many neighbouring slots; ``mode``:
per (layer, KV head) or per layer; ``lookahead``: score by the sender's own first N answer tokens instead,
``evict.answer_probe``). Per variant: accuracy in points, the paired difference against
``full`` with its BCa CI, and the share of tasks where the receiver's answer equals full relay's.
Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

VARIANTS = [  # (window, pool, mode); the first round of the ablation
    (None, 1, "headwise"), (None, 7, "headwise"), (8, 1, "headwise"), (8, 7, "headwise"),
    (None, 7, "layerwise"), (8, 7, "layerwise"), (16, 7, "layerwise"), (8, 15, "layerwise"),
]
ROUND2 = [  # around the first round's best, on other tasks (``--offset``)
    (None, 7, "layerwise"), (16, 7, "layerwise"), (24, 7, "layerwise"), (16, 11, "layerwise"),
    (None, 11, "layerwise"), (16, 7, "headwise"), (None, 15, "layerwise"), (16, 15, "layerwise"),
]
ROUND3 = [  # (window, pool, mode, lookahead): scoring by the sender's own first answer tokens
    (None, 7, "headwise", 0), (None, 7, "headwise", 4), (None, 3, "headwise", 4), (None, 7, "headwise", 8),
    (None, 3, "headwise", 8), (None, 5, "headwise", 8), (None, 3, "headwise", 12), (None, 3, "layerwise", 8),
]
ROUND4 = [  # (window, pool, mode, lookahead, reweighting): the look-ahead rows reweighted (``reweight``)
    (None, 3, "headwise", 8, ""), (None, 3, "headwise", 8, "vnorm"), (None, 3, "headwise", 8, "blend"),
    (None, 3, "headwise", 8, "prompt"), (None, 3, "headwise", 8, "span"), (None, 3, "headwise", 8, "span+vnorm"),
    (None, 5, "headwise", 8, "span"),
]
ROUND5 = [  # the look-ahead's selection, its kept values corrected by orthogonal backfill (``backfill``)
    (None, 3, "headwise", 8, ""), (None, 3, "headwise", 8, "backfill"), (None, 1, "headwise", 8, "backfill"),
    (None, 3, "headwise", 12, "backfill"), (None, 3, "layerwise", 8, "backfill"),
    (None, 5, "headwise", 8, "backfill"),
]
ROUND6 = [  # the sender checks candidate selections against its own look-ahead answer (``verified``)
    (None, 3, "headwise", 8, ""), (None, 3, "headwise", 8, "verify"), (None, 3, "headwise", 8, "verify-h"),
]
ROUND7 = [  # the checked selection, then repaired where it still misses the look-ahead answer (``repaired``)
    (None, 3, "headwise", 8, "verify"), (None, 3, "headwise", 8, "verify+repair"),
    (None, 3, "headwise", 8, "verify+repair3"), (None, 3, "headwise", 8, "verify+prompt"),
]
CANDIDATES = {"verify": [(pool, mode) for pool in (1, 3, 5) for mode in ("headwise", "layerwise")],
              "verify-h": [(pool, "headwise") for pool in (1, 3, 5)]}
ROUNDS = {1: VARIANTS, 2: ROUND2, 3: ROUND3, 4: ROUND4, 5: ROUND5, 6: ROUND6, 7: ROUND7}


def answer_check(model, part, question, answer) -> tuple[tuple[int, float], int]:
    """``kv.partial.answer_fit``'s fit, and the first answer token the partial payload does not predict
    greedily (``len(answer)`` when it predicts them all)."""
    from kvrelay.kv.partial import answer_hits

    hit, logp = answer_hits(model, part, question, answer)
    miss = int((~hit).nonzero()[0, 0]) if not bool(hit.all()) else len(answer)
    return (int(hit.sum()), logp), miss


def focus(probe, tokens):
    """A probe whose scores weigh the look-ahead's rows (all answer tokens) and each of answer ``tokens``' own
    rows equally: the positions the tokens the partial payload got wrong attend to move up."""
    from kvrelay.kv.evict import AttentionProbe

    k = probe.lookahead
    rows = []
    for p in probe.probs:  # (B, H_kv, group × k, T), answer token fastest
        B, H, R, T = p.shape
        by_token = p.reshape(B, H, R // k, k, T)
        rows.append(torch.cat((p.mean(dim=2, keepdim=True),
                               *(by_token[:, :, :, j].mean(dim=2, keepdim=True) for j in tokens)), dim=2))
    return AttentionProbe(tuple(rows), 0, 0)


def verified(sender, payload, question, probe, budget, candidates, answer, *, probes=(), repair=0, memo=None):
    """The candidate selection whose partial payload best reproduces the sender's own look-ahead answer
    (``kv.partial.answer_fit``; ``PartialRequest(verify=True)`` does this over ``VERIFY_CANDIDATES``).
    ``probes``: further scorings (name, probe), each selected under every candidate pool and mode as well.
    ``repair`` > 0: while the best payload still mispredicts an answer token, select again (the best's pool
    and mode) with the rows of every token mispredicted so far weighed in (``focus``), keeping the new
    payload if it fits better; at most ``repair`` times. ``memo`` (a dict kept per task) shares the checked
    selections between the variants of one task: the same selection is read once."""
    from kvrelay.kv.partial import PartialRequest, select

    memo = {} if memo is None else memo

    def pick(key, pr, pool, mode):
        if (key, pool, mode) not in memo:
            req = PartialRequest(tuple(question), budget, pool=pool, mode=mode, lookahead=pr.lookahead, verify=False)
            part = select(payload, req, probe=pr).compressed.decompress()
            fit, miss = answer_check(sender.model, part, question, answer)
            memo[key, pool, mode] = (fit, miss, part, pool, mode)
        return memo[key, pool, mode]

    best = None
    for key, pr in (("answer", probe), *probes):
        for pool, mode in candidates:
            c = pick(key, pr, pool, mode)
            if best is None or c[0] > best[0]:
                best = c
    missed: tuple[int, ...] = ()
    for _ in range(repair):
        if best[1] >= len(answer):
            break
        missed += (best[1],)
        c = pick(("focus", missed), focus(probe, missed), best[3], best[4])
        if c[0] <= best[0]:
            break
        best = c
    return best[2]


def reweight(probe, how: str, payload, prompt_probe, answer_ids):
    """The look-ahead ``probe`` changed by ``how`` ("+"-joined): ``vnorm`` weighs each slot by its value
    vector's norm (VATP, arXiv 2406.12335); ``blend`` averages each head's rows with its layer's mean;
    ``prompt`` averages the answer's rows with the prompt's (``prompt_probe``) at equal weight; ``span``
    keeps the slots where a run of two or more of the sender's answer tokens (``answer_ids``) occurs in the
    context (the answer span the look-ahead copies from); ``backfill`` asks the sender to correct the kept
    values (``PartialRequest.backfill``) and leaves the rows as they are."""
    from kvrelay.kv.evict import AttentionProbe

    probs = list(probe.probs)  # (B, H_kv, R, T) each
    T = payload.num_tokens
    for part in filter(None, how.split("+")):
        if part == "backfill":  # a request option (``PartialRequest.backfill``), not a reweighting
            continue
        if part == "vnorm":
            for j, p in enumerate(probs):
                v = payload.values[j].float().norm(dim=-1)  # (B, H_kv, T_l)
                w = v.new_zeros(*v.shape[:2], T)
                w[..., T - v.shape[2]:] = v
                probs[j] = p * w[:, :, None, :]
        elif part == "blend":
            probs = [0.5 * p + 0.5 * p.mean(dim=1, keepdim=True) for p in probs]
        elif part == "prompt":
            probs = [torch.cat((p.mean(dim=2, keepdim=True), q.mean(dim=2, keepdim=True)), dim=2)
                     for p, q in zip(probs, prompt_probe.probs, strict=True)]
            return AttentionProbe(tuple(probs), 0, 0)
        elif part == "span":
            ctx = payload.token_ids[0].tolist()
            grams = {tuple(answer_ids[i:i + 2]) for i in range(len(answer_ids) - 1)}
            hit = torch.zeros(T, dtype=torch.bool)
            for i in range(T - 1):
                if tuple(ctx[i:i + 2]) in grams:
                    hit[i:i + 2] = True
            probs = [p + hit.float() * (1.0 + float(p.max())) for p in probs]
        else:
            raise ValueError(f"unknown reweighting {part!r}")
    return AttentionProbe(tuple(probs), probe.tokens, probe.lookahead)


def name(window, pool, mode, lookahead=0, how="") -> str:
    return (f"window={window or 'all'},pool={pool},{mode}" + (f",lookahead={lookahead}" if lookahead else "")
            + (f",{how}" if how else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tasks", default="squad,gen_easy")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--offset", type=int, default=0, help="skip the first N tasks of each set (held-out choice)")
    ap.add_argument("--round", type=int, choices=tuple(ROUNDS), default=1, help="which list of variants")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from kvrelay.agents.agent import Agent
    from kvrelay.agents.partial import partial_relay
    from kvrelay.audit.bootstrap import bca_ci
    from kvrelay.audit.runner import RECEIVER_ROLE, SENDER_ROLE
    from kvrelay.audit.tasks import load_tasks
    from kvrelay.audit.tasks.scoring import score
    from kvrelay.kv.evict import answer_probe, attention_probe
    from kvrelay.kv.partial import Budget
    from kvrelay.models.loader import load_model

    lm = load_model(a.model)
    sender = Agent(lm, "sender", SENDER_ROLE)
    receiver = Agent(lm, "receiver", RECEIVER_ROLE, max_new_tokens=a.max_new_tokens)
    tasks = [t for s in a.tasks.split(",") for t in load_tasks(s, a.offset + a.limit)[a.offset:]]
    variants = [(*v, 0, "")[:5] if len(v) < 5 else v for v in ROUNDS[a.round]]
    rows: dict[str, list[float]] = {"full": []}
    same: dict[str, list[bool]] = {}
    for task in tqdm(tasks, desc="partial scoring"):
        payload = sender.read(task.context)
        full = receiver.respond(task.prompt, payload)
        rows["full"].append(score(task, full.text))
        question = receiver.prompt_ids(task.prompt)
        need = {v[3] for v in variants} | ({0} if any("prompt" in v[4] for v in variants) else set())  # look-aheads
        longest = answer_probe(sender.model, payload, question, max(need)) if max(need) else None
        probes = {n: longest.answer_prefix(n) if n else attention_probe(sender.model, payload, question)
                  for n in need}
        memo: dict = {}  # this task's checked selections, shared by its variants
        for w, pool, mode, n, how in variants:
            base, _, extra = how.partition("+")
            if base in CANDIDATES:  # the probe carries its look-ahead answer (no second decode)
                more = (("prompt", reweight(probes[n], "prompt", payload, probes[0], [])),) if extra == "prompt" else ()
                fix = {"repair": 1, "repair3": 3}.get(extra, 0)
                part = verified(sender, payload, question, probes[n], Budget(fraction=a.budget), CANDIDATES[base],
                                probes[n].answer, probes=more, repair=fix, memo=memo)
                r = receiver.respond(task.prompt, part)
                rows.setdefault(name(w, pool, mode, n, how), []).append(score(task, r.text))
                same.setdefault(name(w, pool, mode, n, how), []).append(r.token_ids == full.token_ids)
                continue
            probe = reweight(probes[n], how, payload, probes.get(0), list(probes[n].answer)) if how else probes[n]
            o = partial_relay(sender, payload, receiver, task.prompt, Budget(fraction=a.budget), probe=probe,
                              window=w, pool=pool, mode=mode, lookahead=n, backfill="backfill" in how.split("+"),
                              verify=False)
            rows.setdefault(name(w, pool, mode, n, how), []).append(score(task, o.response.text))
            same.setdefault(name(w, pool, mode, n, how), []).append(o.response.token_ids == full.token_ids)
    base = np.array(rows["full"])
    out = []
    for k, xs in rows.items():
        x = np.array(xs)
        acc = bca_ci(x * 100)
        row = {"variant": k, "accuracy": acc.estimate, "ci_low": acc.low, "ci_high": acc.high, "n": len(xs)}
        if k != "full":
            d = bca_ci((x - base) * 100)
            row |= {"delta_vs_full": d.estimate, "delta_ci_low": d.low, "delta_ci_high": d.high,
                    "same_answer_as_full": float(np.mean(same[k]))}
        out.append(row)
    doc = {"model": a.model, "tasks": a.tasks, "limit": a.limit, "offset": a.offset, "budget": a.budget,
           "max_new_tokens": a.max_new_tokens, "rows": out,
           "command": "python benchmarks/partial_scoring.py " + shlex.join(sys.argv[1:] if argv is None else argv)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1) + "\n")
    for r in out:
        print(f"{r['variant']:34s} {r['accuracy']:6.1f}  delta {r.get('delta_vs_full', 0):+6.1f} "
              f"[{r.get('delta_ci_low', 0):+.1f}, {r.get('delta_ci_high', 0):+.1f}]  same {r.get('same_answer_as_full', 1):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
