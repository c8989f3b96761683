"""Fitting the cross-model adapters on the audit's fitting corpora: ``fit_ridge``, ``fit_layers`` and the
resumable ``train_fuser`` run (``kvrelay fuse fit`` / ``fuse train`` parse their options and call these).

Each writes one artefact folder (``fuse.artefact``) recording what it was fitted on. ``train_fuser`` keeps
its work under ``work``: the sharer's readings and the receiver's pass (one file per task, keyed by the
models' fingerprints: ``fuse.fuser_data``) and a checkpoint at every held-out evaluation, so running it again continues where it
stopped; the artefact holds the fuser at its lowest held-out loss (``keep="best"``) or the last step.
"""

from __future__ import annotations

import gc
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvrelay.agents.agent import Agent
from kvrelay.audit.tasks.fitting import GEN_SEED, PROBLEM_SOURCES, fitting_problems, fitting_texts
from kvrelay.core.errors import InvalidInput
from kvrelay.fuse import align, artefact, ridge
from kvrelay.fuse import fuser as F
from kvrelay.fuse import fuser_data as FD
from kvrelay.fuse import fuser_train as FT
from kvrelay.fuse import layers as LY
from kvrelay.fuse.bridge import TokenBridge
from kvrelay.fuse.ridge import RidgeAdapter
from kvrelay.models.loader import clear_model_cache
from kvrelay.models.prompt import format_for

KEEP = ("best", "last")  # which fuser a training run's artefact holds


def _log(_msg: str) -> None:
    """Progress notes are dropped unless the caller passes ``log``."""


def problem_sources(task_ids: list[str]) -> dict[str, int]:
    """Fitting problems per source dataset, from their ids (``fit-SOURCE/i``), in first-seen order."""
    return dict(Counter(tid.split("/")[0].removeprefix("fit-") for tid in task_ids))


def _readings(sharer, texts: list[str], max_tokens: int) -> list[list[int]]:
    fmt = format_for(sharer.tokenizer)
    return [sharer.tokenizer(fmt.user(t), add_special_tokens=False)["input_ids"][:max_tokens] for t in texts]


def fit_ridge(r_lm, s_lm, receiver: str, sharer: str, *, texts: int, max_tokens: int, spread: int,
              out: Path | None = None) -> tuple[Path, ridge.RidgeFit, artefact.ArtefactConfig]:
    """Closed-form ridge maps on ``texts`` unlabelled texts read by both models; (folder, fit, config)."""
    corpus = fitting_texts(texts)
    readings = _readings(s_lm, [t for _, t in corpus], max_tokens)
    cands = ridge.candidate_layers(r_lm.identity.num_layers, s_lm.identity.num_layers, spread)
    state = ridge.fit(s_lm, r_lm, readings, cands, bridge=TokenBridge.for_models(s_lm, r_lm),
                      progress=lambda xs: tqdm(xs, desc=f"fit ridge {receiver} <- {sharer}", unit="text"))
    training = {"datasets": dict(Counter(src for src, _ in corpus)), "max_tokens": max_tokens,
                "generated_seed": GEN_SEED, "format": "each text as one ChatML user turn (the sharer's reading)"}
    config, tensors = ridge.to_artefact(state, (receiver, r_lm.identity), (sharer, s_lm.identity), training)
    return artefact.save(out or artefact.default_dir(receiver, sharer, "ridge"), config, tensors), state, config


@dataclass(frozen=True)
class LayersFit:
    folder: Path
    problems: int  # calibration problems used
    chosen: tuple[int, ...]  # receiver layers relayed
    importance: torch.Tensor  # (L_r,) measured attention share per receiver layer


def fit_layers(r_lm, s_lm, receiver: str, sharer: str, *, problems: int, max_tokens: int, fraction: float,
               alpha: float, ridge_dir: Path | None = None, out: Path | None = None) -> LayersFit:
    """Measure per-layer attention on the ridge-mapped context of ``problems`` calibration problems, choose
    the layers, save the artefact (``ridge_dir``: the pair's ridge artefact, default the committed one)."""
    rdir = ridge_dir or artefact.default_dir(receiver, sharer, "ridge")
    maps = RidgeAdapter.load(rdir, s_lm.tokenizer, r_lm.tokenizer)
    reader, asker = Agent(s_lm, "sharer"), Agent(r_lm, "receiver")
    pairs, used = [], []
    for t in tqdm(fitting_problems(problems * 2), desc=f"sharer reads ({sharer})", unit="task"):
        if len(pairs) >= problems:
            break
        if len(reader.reading_ids(t.context)) > max_tokens:
            continue
        pairs.append((reader.read(t.context), asker.prompt_ids(t.prompt)))
        used.append(t.id)
    imp = LY.importance(r_lm, maps, pairs, progress=lambda xs: tqdm(xs, desc=f"receiver attends ({receiver})",
                                                                    unit="task"))
    prior = LY.gaussian_prior(len(imp))
    score = LY.scores(imp, alpha, prior)
    chosen = LY.select(score, LY.n_chosen(fraction, len(imp)))
    calibration = {"datasets": problem_sources(used), "sources": list(PROBLEM_SOURCES), "n_problems": len(used),
                   "max_tokens": max_tokens, "ridge_artefact": rdir.name,
                   "regime": "shared (the sharer reads the task's context; the receiver's prompt follows it)"}
    config, tensors = LY.to_artefact(maps, chosen, imp, score, prior, alpha, fraction, calibration)
    folder = artefact.save(out or artefact.default_dir(receiver, sharer, "layers"), config, tensors)
    return LayersFit(folder, len(used), tuple(chosen), imp)


@dataclass(frozen=True)
class TrainSettings:
    """``fuse train``'s options (see its ``--help``), validated here."""

    steps: int = 300
    examples: int = 96
    held_out: int = 8
    max_tokens: int = 160
    rank: int = 64
    lr: float = 1e-3
    seed: int = 0
    eval_every: int = 25
    keep: str = "best"
    batch: int = 1

    def __post_init__(self):
        if self.keep not in KEEP:
            raise ValueError(f"keep {self.keep!r}: expected one of {', '.join(KEEP)}")
        if self.held_out >= self.examples:
            raise ValueError(f"held_out {self.held_out} leaves no training tasks of {self.examples} examples")


@dataclass(frozen=True)
class Trained:
    folder: Path  # the artefact
    n_params: int
    steps: int  # steps the fuser has been trained
    kept: str  # "best" or "last"
    kept_step: int
    held: dict  # the held-out record of the kept step ({"fused", "receiver", "open"}; {} when none)
    layers: int  # receiver layers (gates)


def default_work(receiver: str, sharer: str) -> Path:
    return Path("out") / "fuse-train" / f"{receiver}__{sharer}"


def train_fuser(receiver: str, sharer: str, load: Callable, settings: TrainSettings = TrainSettings(), *,
                work: Path | None = None, out: Path | None = None, log: Callable[[str], None] = _log) -> Trained:
    """Train a fuser with both models frozen; resumable (calling it again continues from ``work``).

    ``load(name)`` loads a model: the sharer is loaded first, read from and dropped before the receiver is
    loaded, so the two models never sit in memory together."""
    cfg = settings
    work = work or default_work(receiver, sharer)
    work.mkdir(parents=True, exist_ok=True)
    tasks = fitting_problems(cfg.examples * 2)  # twice as many: readings over max_tokens are skipped
    r_layers = load(receiver).identity.num_layers  # the layer map decides which sharer layers are kept
    clear_model_cache()
    s_lm = load(sharer)
    s_ident, s_tok = s_lm.identity, s_lm.tokenizer
    layer_map = align.depth_proportional(r_layers, s_ident.num_layers)
    s_key = {"sharer": s_ident.fingerprint, "layers": sorted(set(layer_map)), "max_tokens": cfg.max_tokens}
    s_dir = FD.open_folder(work / "sharer", s_key, log)
    readings = FD.sharer_readings(s_lm, tasks, set(layer_map), cfg.max_tokens, cfg.examples, s_dir,
                                  progress=lambda **kw: tqdm(desc=f"sharer reads ({sharer})", unit="task", **kw))
    del s_lm
    clear_model_cache()
    gc.collect()
    r_lm = load(receiver)
    by_id = {t.id: t for t in tasks}
    kept_ids = [torch.load(f, weights_only=False)["id"] for f in readings]
    ckpt = work / f"ckpt_rank{cfg.rank}_seed{cfg.seed}_n{cfg.examples}_b{cfg.batch}.pt"
    run_key = {k: getattr(cfg, k) for k in ("examples", "held_out", "max_tokens", "rank", "lr", "seed", "batch")}
    prior = FT.checkpoint_settings(ckpt)
    if prior is not None and prior != run_key:  # resuming with another step size or data would mix two runs
        changed = ", ".join(f"{k} {prior.get(k)!r} -> {v!r}" for k, v in run_key.items() if prior.get(k) != v)
        raise InvalidInput(f"{ckpt} was trained with other settings ({changed})",
                           "the checkpoint's settings to resume it, or another --work folder to start a new run")
    if FT.checkpoint_step(ckpt) >= cfg.steps:  # nothing left to train: the artefact from the checkpoint
        net = FT.net_from_checkpoint(ckpt)
        state = FT.load_checkpoint(ckpt, net)
        log(f"{ckpt} has {state.step} steps (>= --steps {cfg.steps}): writing its artefact")
    else:
        bridge = TokenBridge.between(s_ident.tokenizer_hash, r_lm.identity.tokenizer_hash, s_tok, r_lm.tokenizer)
        r_key = {**s_key, "receiver": r_lm.identity.fingerprint}
        r_dir = FD.open_folder(work / "receiver", r_key, log)
        exs = FD.receiver_examples(r_lm, by_id, readings, bridge, r_dir,
                                   progress=lambda xs: tqdm(xs, desc=f"receiver reads ({receiver})", unit="task"))
        held, train_ex = exs[:cfg.held_out], exs[cfg.held_out:]
        feat = next(iter(train_ex[0].feats.values())).shape[-1]
        ident = r_lm.identity
        net = F.FuserNet(ident.num_layers, feat, ident.num_kv_heads, ident.head_dim, cfg.rank)
        state = None
        if ckpt.is_file():
            state = FT.load_checkpoint(ckpt, net)
            log(f"resuming {ckpt} at step {state.step}")
        else:
            FT.standardise(net, tqdm(train_ex, desc="feature statistics", unit="task"), layer_map)
        tc = FT.TrainConfig(steps=cfg.steps, lr=cfg.lr, seed=cfg.seed, eval_every=cfg.eval_every, batch=cfg.batch)
        state = FT.train(net, r_lm.model, ident, layer_map, train_ex, held, tc, state,
                         progress=lambda xs: tqdm(xs, desc=f"train fuser {receiver} <- {sharer}", unit="step",
                                                  initial=xs.start, total=cfg.steps),
                         checkpoint=lambda st: FT.save_checkpoint(ckpt, net, st, run_key))
        FT.save_checkpoint(ckpt, net, state, run_key)
    last = state.held[-1] if state.held else {}
    which = "last"
    if cfg.keep == "best" and state.best is not None:
        net.load_state_dict(state.best["net"])
        last = next(h for h in state.held if h["step"] == state.best["step"])
        which = "best"
    elif cfg.keep == "best":
        log("the checkpoint has no best-held-out record (made before it was kept): writing the last step")
    taus = [r["tau"] for r in state.train]
    training = {"datasets": problem_sources(kept_ids), "sources": list(PROBLEM_SOURCES),
                "n_examples": len(kept_ids) - cfg.held_out, "held_out": kept_ids[:cfg.held_out],
                "max_tokens": cfg.max_tokens, "steps": state.step, "lr": cfg.lr,
                "kept": f"{which} (step {last.get('step', state.step)})",
                "seed": cfg.seed, "batch": cfg.batch, "tau": [taus[0], taus[-1]] if taus else None,
                "loss": "answer tokens + end marker",
                "regime": "shared (both models read the task's context; the receiver answers its prompt)"}
    metrics = {"held_out_loss": last.get("fused"), "held_out_loss_receiver": last.get("receiver"),
               "open_layers": last.get("open")}
    config, tensors = F.to_artefact(net, (receiver, r_lm.identity), (sharer, s_ident), layer_map, training, metrics)
    folder = artefact.save(out or artefact.default_dir(receiver, sharer, "fuser"), config, tensors)
    curve = {"train": state.train, "held": state.held, "settings": training}
    (folder / "loss_curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    return Trained(folder, net.n_params, state.step, which, last.get("step", state.step), last, len(layer_map))
