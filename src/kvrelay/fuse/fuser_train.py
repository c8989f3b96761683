"""Training a fuser (``fuse.fuser``) with both models frozen, on the receiver's answer loss.

Data (``Example``): for each training task both models read the task's context (the shared, fuse
regime: the same input); the sharer's features at the receiver's slots and the receiver's own
cache are computed once (``sharer_pass``, ``receiver_pass``) and kept, so a step costs only the
fuser, the receiver's forward over prompt + answer on the fused cache, and its backward.

Loss: next-token cross-entropy over the answer tokens (the gold answer, then the end-of-turn
marker) after the prompt and the assistant opening. Gates are Gumbel-sigmoid samples whose
temperature is annealed from ``tau0`` to ``tau1``; the held-out loss is measured with hard gates
(what inference uses) next to the receiver alone (every gate closed) on the same examples; the
fuser at the lowest held-out loss so far is kept beside the current one (``TrainState.best``).

Deterministic and resumable: example order and Gumbel noise are functions of (seed, step), so a run
resumed from a checkpoint (``save_checkpoint`` / ``load_checkpoint``) takes the same steps as one
that never stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from kvrelay.fuse.bridge import TokenBridge, read, sharer_features
from kvrelay.fuse.fuser import FuserNet, check_full_attention, fuse_kv, gate_values, tau_at
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.models.identity import ModelIdentity
from kvrelay.models.prompt import format_for


@dataclass(frozen=True)
class Example:
    """One training task, precomputed: the receiver's own cache and the sharer's aligned features."""

    task_id: str
    own_k: tuple[torch.Tensor, ...]  # per receiver layer (1, H_r, T, D_r), fp16
    own_v: tuple[torch.Tensor, ...]
    feats: dict[int, torch.Tensor]  # sharer layer -> (1, T, F) at the receiver's slots, fp16
    tail_ids: tuple[int, ...]  # prompt + assistant opening + answer + end marker (receiver tokens)
    n_prompt: int  # tokens of ``tail_ids`` before the answer

    @property
    def tokens(self) -> int:
        return int(self.own_k[0].shape[2])


def reading_ids(tokenizer, text: str) -> list[int]:
    """The tokens of a role-less reader reading ``text`` as one user turn (``Agent.read`` without a role)."""
    return tokenizer(format_for(tokenizer).user(text), add_special_tokens=False)["input_ids"]


def answer_tail(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """(prompt turn + assistant opening + answer + end marker, tokens before the answer)."""
    fmt = format_for(tokenizer)

    def enc(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    head = enc(fmt.user(prompt)) + enc(fmt.assistant_start)
    return head + enc(answer) + enc(fmt.assistant_end)[:1], len(head)


def sharer_pass(sharer_lm, contexts: Sequence[str], layers: set[int], max_tokens: int,
                progress: Callable | None = None) -> list[dict | None]:
    """Per context: ``{"ids", "feats": {layer: (1, T_s, F) fp16}}``, or None when its reading exceeds ``max_tokens``."""
    check_full_attention(sharer_lm.identity, "sharer")
    out: list[dict | None] = []
    for text in progress(contexts) if progress else contexts:
        ids = reading_ids(sharer_lm.tokenizer, text)
        if len(ids) > max_tokens:
            out.append(None)
            continue
        p = read(sharer_lm.model, sharer_lm.identity, ids)
        out.append({"ids": ids, "feats": {s: sharer_features(p, s).half() for s in sorted(layers)}})
    return out


def receiver_pass(receiver_lm, tasks, shared: Sequence[dict | None], bridge: TokenBridge,
                  progress: Callable | None = None) -> list[Example]:
    """The receiver's own cache of each kept task's reading, and the sharer features at its slots."""
    check_full_attention(receiver_lm.identity, "receiver")
    out = []
    for task, s in zip(tasks, progress(shared) if progress else shared, strict=True):
        if s is None:
            continue
        r_ids, index = bridge.receiver_reading(s["ids"])
        own = read(receiver_lm.model, receiver_lm.identity, r_ids)
        tail, n_prompt = answer_tail(receiver_lm.tokenizer, task.prompt, task.answers[0])
        out.append(Example(task.id, tuple(k.half() for k in own.keys), tuple(v.half() for v in own.values),
                           {layer: f[:, index] for layer, f in s["feats"].items()}, tuple(tail), n_prompt))
    return out


def standardise(net: FuserNet, examples: Iterable[Example], layer_map: tuple[int, ...]) -> None:
    """Set the fuser's per-layer feature mean and spread from ``examples`` (sharer features, all slots),
    streamed: one example at a time, sums in float64, so a training set on disk is never loaded whole."""
    layers = sorted(set(layer_map))
    n, s1, s2 = 0, {}, {}
    for ex in examples:
        for s in layers:
            x = ex.feats[s][0].double()  # (T, F)
            s1[s] = s1.get(s, 0) + x.sum(0)
            s2[s] = s2.get(s, 0) + (x * x).sum(0)
        n += ex.tokens
    for t, s in enumerate(layer_map):
        mu = s1[s] / n
        var = (s2[s] - n * mu * mu) / max(n - 1, 1)  # unbiased, as torch.std
        net.mu[t] = mu.float()
        net.sd[t] = var.clamp_min(0).sqrt().float().clamp_min(1e-3)


def _cache(model, keys, values) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v  # (1, H, T, D)
    return cache


def example_loss(net: FuserNet, model, ident: ModelIdentity, layer_map: tuple[int, ...], ex: Example,
                 gates: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens after ``ex``'s fused context (differentiable in ``net``)."""
    T = ex.tokens
    pos = torch.arange(T, dtype=torch.int64)[None]  # (1, T)
    own = KVPayload(tuple(k.float() for k in ex.own_k), tuple(v.float() for v in ex.own_v),
                    torch.zeros(1, T, dtype=torch.int64), pos, torch.ones(1, T, dtype=torch.bool),
                    PayloadMeta.from_identity(ident, producer="train"))
    keys, values = fuse_kv(net, own, {s: f.float() for s, f in ex.feats.items()}, layer_map, ident, gates)
    ids = torch.tensor([ex.tail_ids], dtype=torch.int64)  # (1, n)
    tail_pos = T + torch.arange(ids.shape[1], dtype=torch.int64)[None]
    logits = model(input_ids=ids, position_ids=tail_pos, cache=_cache(model, keys, values), use_cache=True).logits
    pred = logits[0, ex.n_prompt - 1: -1].float()  # (n_answer, V)
    return torch.nn.functional.cross_entropy(pred, ids[0, ex.n_prompt:])


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float = 1e-3
    seed: int = 0
    tau0: float = 1.0
    tau1: float = 0.1
    eval_every: int = 25
    grad_clip: float = 1.0
    batch: int = 1  # examples per step (their mean loss; the same gate noise for all of them)


@dataclass
class TrainState:
    """What a checkpoint holds besides the fuser: the optimizer, the step reached and the curves."""

    step: int = 0
    optimizer: dict | None = None
    train: list[dict] = field(default_factory=list)  # {"step", "loss", "tau"} per step
    held: list[dict] = field(default_factory=list)  # {"step", "fused", "receiver", "open"}
    best: dict | None = None  # {"step", "fused", "net"}: the fuser at its lowest held-out loss so far


def example_at(step: int, n: int, seed: int) -> int:
    """Index of the example a step trains on: a seeded permutation per epoch."""
    epoch, k = divmod(step, n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1_000 * seed + epoch))
    return int(perm[k])


def held_losses(net, model, ident, layer_map, held: Sequence[Example]) -> tuple[float, float]:
    """(mean held-out loss with hard gates, the receiver alone's: every gate closed)."""
    if not held:
        return math.nan, math.nan
    with torch.no_grad():
        hard = gate_values(net.gate)
        closed = torch.zeros_like(net.gate)
        fused = [float(example_loss(net, model, ident, layer_map, ex, hard)) for ex in held]
        alone = [float(example_loss(net, model, ident, layer_map, ex, closed)) for ex in held]
    return sum(fused) / len(fused), sum(alone) / len(alone)


def train(net: FuserNet, model, ident: ModelIdentity, layer_map: tuple[int, ...], examples: Sequence[Example],
          held: Sequence[Example], cfg: TrainConfig, state: TrainState | None = None,
          progress: Callable | None = None, checkpoint: Callable[[TrainState], None] | None = None,
          until: int | None = None) -> TrainState:
    """Train ``net`` in place from ``state``'s step up to ``until`` (default ``cfg.steps``: the schedule's
    length, which sets the temperature annealing); ``checkpoint`` is called at every held-out evaluation."""
    if not examples:
        raise ValueError("no training examples (every reading was longer than the token cap?)")
    model.requires_grad_(False)
    state = state or TrainState()
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=0.0)
    if state.optimizer:
        opt.load_state_dict(state.optimizer)
    steps = range(state.step, min(cfg.steps, cfg.steps if until is None else until))
    for step in progress(steps) if progress else steps:
        tau = tau_at(step, cfg.steps, cfg.tau0, cfg.tau1)
        opt.zero_grad()
        total, names = 0.0, []
        for j in range(cfg.batch):  # gradients accumulate over the batch's examples
            gates = gate_values(net.gate, tau, torch.Generator().manual_seed(1_000_003 * cfg.seed + step))
            ex = examples[example_at(step * cfg.batch + j, len(examples), cfg.seed)]
            loss = example_loss(net, model, ident, layer_map, ex, gates) / cfg.batch
            loss.backward()
            total += loss.item()
            names.append(ex.task_id)
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        opt.step()
        state.step = step + 1
        state.train.append({"step": step, "loss": round(total, 5), "tau": round(tau, 4),
                            "example": names[0] if cfg.batch == 1 else names})
        if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
            fused, alone = held_losses(net, model, ident, layer_map, held)
            state.held.append({"step": state.step, "fused": fused, "receiver": alone,
                               "open": int(gate_values(net.gate).sum())})
            if not math.isnan(fused) and (state.best is None or fused < state.best["fused"]):
                state.best = {"step": state.step, "fused": fused,
                              "net": {k: v.detach().clone() for k, v in net.state_dict().items()}}
            state.optimizer = opt.state_dict()
            if checkpoint:
                checkpoint(state)
    state.optimizer = opt.state_dict()
    return state


def save_checkpoint(path: Path, net: FuserNet, state: TrainState, settings: dict | None = None) -> None:
    """``net`` and ``state`` to ``path`` (written to a temporary file, then renamed: never half a checkpoint);
    ``settings``: what the run was made with, which a resumed run must match (``checkpoint_settings``)."""
    tmp = Path(path).with_suffix(".tmp")
    torch.save({"net": net.state_dict(), "step": state.step, "optimizer": state.optimizer,
                "train": state.train, "held": state.held, "best": state.best, "settings": settings}, tmp)
    tmp.replace(path)


def checkpoint_settings(path: Path) -> dict | None:
    """The settings a checkpoint was saved with (None: none recorded, or no checkpoint)."""
    return torch.load(path, weights_only=False).get("settings") if Path(path).is_file() else None


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint reached (0 when there is none)."""
    return int(torch.load(path, weights_only=False)["step"]) if Path(path).is_file() else 0


def net_from_checkpoint(path: Path) -> FuserNet:
    """A fuser shaped and filled from a checkpoint alone (no training data needed)."""
    return FuserNet.from_tensors(torch.load(path, weights_only=False)["net"])


def load_checkpoint(path: Path, net: FuserNet) -> TrainState:
    d = torch.load(path, weights_only=False)
    net.load_state_dict(d["net"])
    return TrainState(d["step"], d["optimizer"], d["train"], d["held"], d.get("best"))
