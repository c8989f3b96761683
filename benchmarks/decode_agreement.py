"""How far each engine mode's next-token choices are from fp32's, and llama.cpp's on the same GGUF.

    .venv/bin/python benchmarks/decode_agreement.py --model qwen2.5-coder-0.5b \\
        --engines bf16,int8,int4,bf16+int8 --llama-cpp --json docs/bench/decode_agreement_qwen2.5-coder-0.5b.json

A zoo model is a GGUF whose tensors are already quantized (Q5_0 / Q6_K / Q8_0 blocks of 16-32
weights with their own scales); kvrelay's fp32 weights are those blocks dequantized, and llama.cpp
computes with the blocks themselves. A compact decode copy (per-row int8, int4 in groups of 32)
puts the same weights onto another grid. This script shows what that costs, token by token, on real
text (the contexts and questions of audit task sets) — a cheaper and finer measure than an audit's
success rate, which it does not replace:

* ``prefill``: one forward over each text as a prefill computes it (the mode's prefill precision);
* ``decode``: the same forward with every linear layer on the weights a one-token decode step uses
  (``models.engine.decode_weights``, as speculative verification runs it);
* ``llama.cpp``: the GGUF in llama-cpp-python (an optional extra: ``make peers``), all logits kept.

Per row: ``top1_agree`` (the share of positions whose greedy next token equals fp32's), ``kl`` (mean
KL(fp32 || mode) over positions, nats), ``positions``, and the GGUF's tensor types (``gguf_types``:
parameters per quantization type). Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

SPLIT = {"squad": 6, "arc_challenge": 12}  # task set -> texts taken (seed 7)


def agreement(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Top-1 agreement and mean KL(reference || other) over all positions of paired (T, V) logits."""
    agree = kl = total = 0
    for r, o in zip(reference, other, strict=True):
        v = min(r.shape[-1], o.shape[-1])  # a GGUF may pad its vocabulary
        r, o = r[:, :v].double(), o[:, :v].double()  # (T, V)
        agree += int((r.argmax(-1) == o.argmax(-1)).sum())
        lr, lo = r.log_softmax(-1), o.log_softmax(-1)
        kl += float((lr.exp() * (lr - lo)).sum())
        total += r.shape[0]
    return {"positions": total, "top1_agree": agree / total, "kl": kl / total}


def texts(limit_tokens: int, tokenizer) -> list[list[int]]:
    from kvrelay.audit.tasks import load_tasks

    out = []
    for name, n in SPLIT.items():
        for t in load_tasks(name, limit=n, seed=7):
            out.append(tokenizer(t.context + "\n" + t.prompt).input_ids[:limit_tokens])
    return out


@torch.inference_mode()
def kvrelay_logits(model, ids: list[list[int]], *, decode: bool) -> list[torch.Tensor]:
    from contextlib import nullcontext

    from kvrelay.models.engine import decode_weights

    with decode_weights(model) if decode else nullcontext():
        return [model(torch.tensor([x])).logits[0].float() for x in ids]  # (T, V) each


def llama_cpp_logits(gguf: Path, ids: list[list[int]], threads: int) -> list[torch.Tensor]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(map(len, ids)) + 8, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    out = []
    for x in ids:
        llm.reset()
        llm.eval(x)
        out.append(torch.from_numpy(np.array(llm.scores[: len(x)], dtype=np.float32)))  # (T, V)
    return out


def gguf_types(gguf: Path) -> dict[str, int]:
    from gguf import GGUFReader

    counts: Counter[str] = Counter()
    for t in GGUFReader(str(gguf)).tensors:
        counts[t.tensor_type.name] += int(t.n_elements)
    return dict(sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a zoo model (its GGUF feeds llama.cpp)")
    ap.add_argument("--engines", default="bf16,int8,int4,bf16+int8", help="modes compared with fp32 (comma-separated)")
    ap.add_argument("--tokens", type=int, default=400, help="tokens kept from each text")
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the same GGUF (make peers)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from kvrelay.models.engine import mode
    from kvrelay.models.loader import clear_model_cache, load_model
    from kvrelay.models.zoo import gguf_path

    engines = [e for e in a.engines.split(",") if e]
    for e in engines:
        mode(e)  # a typed refusal before any model loads
    base = load_model(a.model)
    ids = texts(a.tokens, base.tokenizer)
    reference = kvrelay_logits(base.model, ids, decode=False)
    del base
    clear_model_cache()
    rows = []
    for e in engines:
        loaded = load_model(a.model, engine=e)
        for phase in ("prefill", "decode"):
            row = {"engine": e, "phase": phase,
                   **agreement(reference, kvrelay_logits(loaded.model, ids, decode=phase == "decode"))}
            rows.append(row)
            print(f"{e:12} {phase:8} top-1 {100 * row['top1_agree']:6.2f}%  KL {row['kl']:.5f}", flush=True)
        del loaded
        clear_model_cache()
    gguf = gguf_path(a.model)
    if a.llama_cpp:
        row = {"engine": "llama.cpp", "phase": "prefill", **agreement(reference, llama_cpp_logits(gguf, ids, a.threads))}
        rows.append(row)
        print(f"{'llama.cpp':12} {'prefill':8} top-1 {100 * row['top1_agree']:6.2f}%  KL {row['kl']:.5f}", flush=True)
    result = {"model": a.model, "texts": {k: v for k, v in SPLIT.items()}, "tokens_per_text": a.tokens,
              "reference": "fp32 (the GGUF's blocks dequantized)", "gguf_types": gguf_types(gguf), "rows": rows,
              "threads": a.threads, "command": "python benchmarks/decode_agreement.py " + " ".join(sys.argv[1:])}
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
