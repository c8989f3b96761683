"""Train the registry's LoRA / aLoRA variants on CPU, resumably: ``python -m kvrelay.bench.train_variants NAME``.

Real role data, never the benchmark's items:

* ``qa`` — SQuAD passages and questions from the audit's task set, answer as target; tasks from
  index ``QA_SKIP`` of the seed-0 order on (the repair benchmark reads the first ones).
* ``summarize`` — functions from the Python standard library (``ast``), docstring removed; the
  target is the docstring's first sentence.

Prompts use the agent's chat format (system role, user turn, assistant start); the loss covers the
target tokens only. Batch 1, AdamW, fixed seed, a checkpoint (adapter + optimizer + step + losses)
every ``CKPT_EVERY`` steps under ``OUT/ckpt.pt``, so a killed run resumes where it stopped. The
finished folder holds ``adapter_model.safetensors``, ``adapter_config.json`` and ``loss.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import time
from pathlib import Path

import torch

from kvrelay.core.paths import home
from kvrelay.models.prompt import CHATML
from kvrelay.models.variants import VARIANTS, VariantSpec

QA_SKIP = 400
CKPT_EVERY = 5
ROLES = {"qa": "You answer questions about a passage with a short span from it.",
         "summarize": "You summarize Python functions in one sentence."}
STDLIB_MODULES = ("argparse.py", "calendar.py", "collections/__init__.py", "ftplib.py", "gettext.py", "imaplib.py",
                  "inspect.py", "ipaddress.py", "locale.py", "mailbox.py", "pathlib/__init__.py", "pickle.py",
                  "pprint.py", "statistics.py", "tarfile.py", "tempfile.py", "threading.py", "zipfile/__init__.py")


def qa_pairs() -> list[tuple[str, str, str]]:
    from kvrelay.audit.tasks.datasets import load_tasks

    return [(t.context, f"\n\n{t.prompt}", t.answers[0]) for t in load_tasks("squad", seed=0)[QA_SKIP:]]


def summary_pairs() -> list[tuple[str, str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod in STDLIB_MODULES:
        path = root / mod
        if not path.exists():
            continue
        src = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc.split()) < 4:
                continue
            body = node.body[1:]
            if not body:
                continue
            head = ast.get_source_segment(src, node).split("\n", 1)[0]
            rest = "\n".join(ast.get_source_segment(src, b) or "" for b in body)
            first = doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".") + "."
            out.append((f"Summarize this function:\n{head}\n{rest}", "", first))
    return out


def examples(spec: VariantSpec, tokenizer, limit: int | None = None) -> list[tuple[list[int], int]]:
    """(token ids, index where the target starts); the context (passage or code) is cut, never the
    question, so the whole fits ``spec.max_tokens``."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pairs = qa_pairs() if spec.role == "qa" else summary_pairs()
    random.Random(spec.seed).shuffle(pairs)
    out = []
    sys_ids, start = enc(CHATML.system(ROLES[spec.role])), enc(CHATML.assistant_start)
    for text, question, target in pairs:
        tgt = enc(target + CHATML.assistant_end)[: spec.max_tokens // 4]
        head, tail = enc("<|im_start|>user\n"), enc("<|im_end|>\n")
        q = enc(question) if question else []
        room = spec.max_tokens - len(sys_ids) - len(head) - len(tail) - len(start) - len(tgt) - len(q)
        if room < 16:
            continue
        ids = sys_ids + head + enc(text)[:room] + q + tail + start
        out.append((ids + tgt, len(ids)))
        if limit is not None and len(out) >= limit:
            break
    return out


def peft_model(spec: VariantSpec, model, tokenizer):
    from peft import LoraConfig, get_peft_model

    kw = {}
    if spec.alora:
        kw["alora_invocation_tokens"] = tokenizer(CHATML.assistant_start, add_special_tokens=False)["input_ids"]
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM", **kw)
    return get_peft_model(model, cfg)


def train(spec: VariantSpec, out: Path, log_every: int = 1) -> Path:
    """Train (or resume) ``spec`` into ``out``; returns ``out``."""
    from kvrelay.models.loader import load_model

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    base = load_model(spec.base)
    from kvrelay.models.loader import (
        _from_pretrained,  # a private, fresh copy: training must not touch the cache
    )

    model = peft_model(spec, _from_pretrained(base.source, torch.float32), base.tokenizer)
    data = examples(spec, base.tokenizer, limit=spec.steps)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    step, losses = 0, []
    ckpt = out / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        for p, t in zip(params, state["params"], strict=True):
            p.data.copy_(t)
        opt.load_state_dict(state["opt"])
        step, losses = state["step"], state["losses"]
        print(f"resumed {spec.name} at step {step}", flush=True)
    model.train()
    t0 = time.time()
    while step < spec.steps:
        ids, cut = data[step % len(data)]
        x = torch.tensor([ids])
        labels = x.clone()
        labels[:, :cut] = -100
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        losses.append(round(float(loss.detach()), 4))
        if step % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            print(f"{spec.name} step {step}/{spec.steps} loss {recent:.3f} ({time.time() - t0:.0f}s)", flush=True)
        if step % CKPT_EVERY == 0 or step == spec.steps:
            torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict(), "step": step,
                        "losses": losses}, ckpt)
            (out / "loss.json").write_text(json.dumps({"variant": spec.name, "spec": _spec_dict(spec),
                                                       "loss": losses}, indent=0))
    model.eval()
    model.save_pretrained(str(out))
    ckpt.unlink(missing_ok=True)
    return out


def _spec_dict(spec: VariantSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="+", choices=sorted(VARIANTS))
    ap.add_argument("--out", type=Path, default=None, help="parent folder (default $KVRELAY_HOME/variants)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.names:
        dest = (args.out or home() / "variants") / name
        if (dest / "adapter_model.safetensors").exists():
            print(f"{name}: already trained at {dest}")
            continue
        print(f"{name}: trained into {train(VARIANTS[name], dest)}", flush=True)


if __name__ == "__main__":
    main()
