"""``kvrelay fuse``: fit cross-model cache adapters and evaluate them against the text baselines."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Cross-model cache relay: fit adapters (ridge, layers), train a fuser, evaluate translate / "
                  "fuse against text.",
                  no_args_is_help=True)
console = Console()
METHODS = ("ridge", "layers", "fuser")


def _bridge(sharer, receiver):
    from kvrelay.fuse.bridge import TokenBridge

    if sharer.identity.tokenizer_hash == receiver.identity.tokenizer_hash:
        return TokenBridge()
    return TokenBridge(sharer.tokenizer, receiver.tokenizer)


def _readings(sharer, texts: list[str], max_tokens: int) -> list[list[int]]:
    from kvrelay.models.prompt import format_for

    fmt = format_for(sharer.tokenizer)
    return [sharer.tokenizer(fmt.user(t), add_special_tokens=False)["input_ids"][:max_tokens] for t in texts]


@app.command()
def fit(
    receiver: str = typer.Option("qwen2.5-coder-0.5b", help="the model that will read the mapped cache"),
    sharer: str = typer.Option("qwen2.5-coder-1.5b", help="the model whose cache is mapped"),
    method: str = typer.Option("ridge", help="ridge (closed form) or layers (the ridge maps of the layers the "
                               "receiver attends to most); the fuser is trained by `fuse train`"),
    texts: int = typer.Option(96, min=5, help="ridge: fitting texts (BoolQ, SciQ, CommonsenseQA, TriviaQA/NQ, "
                              "generated); layers: calibration problems (SciQ, CommonsenseQA, BoolQ, TriviaQA)"),
    max_tokens: int = typer.Option(384, min=16, help="tokens per text (the sharer's reading, truncated; layers: "
                                   "longer readings are skipped)"),
    spread: int = typer.Option(1, min=0, help="ridge: candidate sharer layers: depth-proportional ± spread, and "
                               "last-aligned"),
    fraction: float = typer.Option(0.3, min=0.01, max=1.0, help="layers: share of receiver layers relayed"),
    alpha: float = typer.Option(0.5, min=0.0, max=1.0, help="layers: weight of measured attention vs the "
                                "mid-depth Gaussian prior"),
    ridge_dir: Path | None = typer.Option(None, "--ridge", help="layers: the pair's ridge artefact (default: "
                                          "committed)"),
    out: Path | None = typer.Option(None, help="artefact folder (default: artefacts/fuse/R__S__METHOD)"),
    threads: int | None = typer.Option(None, help="torch intra-op threads"),
):
    """Fit an adapter on paired caches of the same unlabelled texts read by both models; save its artefact."""
    from tqdm import tqdm

    from kvrelay.audit.tasks.fitting import GEN_SEED, fitting_texts
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli
    from kvrelay.fuse import artefact, ridge

    if method not in ("ridge", "layers"):
        raise v.InvalidInput(f"--method {method!r} is not fitted by `fuse fit`",
                             "ridge (closed form) or layers (chosen by attention)")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    s_lm = load_for_cli(sharer, threads)
    r_lm = load_for_cli(receiver, threads)
    if method == "layers":
        _fit_layers(r_lm, s_lm, receiver, sharer, texts, max_tokens, fraction, alpha, ridge_dir, out)
        return
    corpus = fitting_texts(texts)
    readings = _readings(s_lm, [t for _, t in corpus], max_tokens)
    cands = ridge.candidate_layers(r_lm.identity.num_layers, s_lm.identity.num_layers, spread)
    state = ridge.fit(s_lm, r_lm, readings, cands, bridge=_bridge(s_lm, r_lm),
                      progress=lambda xs: tqdm(xs, desc=f"fit ridge {receiver} <- {sharer}", unit="text"))
    sources = {}
    for src, _ in corpus:
        sources[src] = sources.get(src, 0) + 1
    training = {"datasets": sources, "max_tokens": max_tokens, "generated_seed": GEN_SEED,
                "format": "each text as one ChatML user turn (the sharer's reading)"}
    config, tensors = ridge.to_artefact(state, (receiver, r_lm.identity), (sharer, s_lm.identity), training)
    folder = artefact.save(out or artefact.default_dir(receiver, sharer, method), config, tensors)
    r2k, r2v = config.metrics["r2_k"], config.metrics["r2_v"]
    console.print(f"wrote {folder}  ({state.texts} texts, {state.tokens} tokens; held-out R² K "
                  f"{min(r2k):.3f}..{max(r2k):.3f}, V {min(r2v):.3f}..{max(r2v):.3f}; layer map {list(config.layer_map)})")


def _problem_sources(task_ids: list[str]) -> dict[str, int]:
    """Fitting problems per source dataset, from their ids (``fit-SOURCE/i``), in first-seen order."""
    return dict(Counter(tid.split("/")[0].removeprefix("fit-") for tid in task_ids))


def _fit_layers(r_lm, s_lm, receiver: str, sharer: str, problems: int, max_tokens: int, fraction: float,
                alpha: float, ridge_dir: Path | None, out: Path | None) -> None:
    """``fuse fit --method layers``: measure per-layer attention on the ridge-mapped context, choose, save."""
    from tqdm import tqdm

    from kvrelay.agents.agent import Agent
    from kvrelay.audit.tasks.fitting import PROBLEM_SOURCES, fitting_problems
    from kvrelay.fuse import artefact
    from kvrelay.fuse import layers as LY
    from kvrelay.fuse.ridge import RidgeAdapter

    rdir = ridge_dir or artefact.default_dir(receiver, sharer, "ridge")
    ridge = RidgeAdapter.load(rdir, s_lm.tokenizer, r_lm.tokenizer)
    reader, asker = Agent(s_lm, "sharer"), Agent(r_lm, "receiver")
    pairs, used = [], []
    for t in tqdm(fitting_problems(problems * 2), desc=f"sharer reads ({sharer})", unit="task"):
        if len(pairs) >= problems:
            break
        if len(reader.reading_ids(t.context)) > max_tokens:
            continue
        pairs.append((reader.read(t.context), asker.prompt_ids(t.prompt)))
        used.append(t.id)
    imp = LY.importance(r_lm, ridge, pairs, progress=lambda xs: tqdm(xs, desc=f"receiver attends ({receiver})",
                                                                     unit="task"))
    prior = LY.gaussian_prior(len(imp))
    score = LY.scores(imp, alpha, prior)
    chosen = LY.select(score, LY.n_chosen(fraction, len(imp)))
    calibration = {"datasets": _problem_sources(used), "sources": list(PROBLEM_SOURCES), "n_problems": len(used),
                   "max_tokens": max_tokens, "ridge_artefact": rdir.name,
                   "regime": "shared (the sharer reads the task's context; the receiver's prompt follows it)"}
    config, tensors = LY.to_artefact(ridge, chosen, imp, score, prior, alpha, fraction, calibration)
    folder = artefact.save(out or artefact.default_dir(receiver, sharer, "layers"), config, tensors)
    console.print(f"wrote {folder}  ({len(used)} problems; layers {list(chosen)} of {len(imp)}; importance "
                  f"{float(imp.min()):.3f}..{float(imp.max()):.3f})")


@app.command()
def train(
    receiver: str = typer.Option("qwen2.5-coder-0.5b", help="the model whose cache is extended (frozen)"),
    sharer: str = typer.Option("qwen2.5-coder-1.5b", help="the model whose cache is fused in (frozen)"),
    method: str = typer.Option("fuser", help="fuser (gated low-rank projection, trained on the answer loss)"),
    steps: int = typer.Option(300, min=1, help="optimizer steps in all (a resumed run continues to this count)"),
    examples: int = typer.Option(96, min=4, help="training tasks (SciQ, CommonsenseQA, BoolQ, TriviaQA/NQ)"),
    held_out: int = typer.Option(8, min=1, help="of those, kept out of training for the held-out loss"),
    max_tokens: int = typer.Option(160, min=16, help="skip tasks whose reading is longer (sharer tokens)"),
    rank: int = typer.Option(64, min=1, help="projection rank per layer (parameters grow linearly with it)"),
    lr: float = typer.Option(1e-3, min=0.0),
    seed: int = typer.Option(0),
    eval_every: int = typer.Option(25, min=1, help="steps between held-out losses and checkpoints"),
    keep: str = typer.Option("best", help="which fuser the artefact holds: best (lowest held-out loss) or last"),
    work: Path | None = typer.Option(None, help="checkpoints and precomputed caches (default: out/fuse-train/R__S)"),
    out: Path | None = typer.Option(None, help="artefact folder (default: artefacts/fuse/R__S__fuser)"),
    threads: int | None = typer.Option(None, help="torch intra-op threads"),
):
    """Train a fuser with both models frozen; resumable (re-run the same command to continue)."""
    import gc
    import json

    import torch
    from tqdm import tqdm

    from kvrelay.audit.tasks.fitting import PROBLEM_SOURCES, fitting_problems
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli
    from kvrelay.fuse import align, artefact
    from kvrelay.fuse import fuser as F
    from kvrelay.fuse import fuser_train as FT
    from kvrelay.models.loader import clear_model_cache

    if method != "fuser":
        raise v.InvalidInput(f"--method {method!r} is not trained by `fuse train`",
                             "fuser (ridge is fitted in closed form by `kvrelay fuse fit`)")
    if keep not in ("best", "last"):
        raise v.InvalidInput(f"--keep {keep!r}", "best or last")
    if held_out >= examples:
        raise v.InvalidInput(f"--held-out {held_out} leaves no training tasks of --examples {examples}",
                             "--held-out smaller than --examples")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    work = work or Path("out") / "fuse-train" / f"{receiver}__{sharer}"
    work.mkdir(parents=True, exist_ok=True)
    tasks = fitting_problems(examples * 2)  # twice as many: readings over --max-tokens are skipped
    data_path = work / f"sharer_{examples}_{max_tokens}.pt"
    # the sharer's readings first, then the sharer is dropped: the two models never sit in memory together
    s_lm = load_for_cli(sharer, threads)
    s_ident, s_tok = s_lm.identity, s_lm.tokenizer
    saved = torch.load(data_path, weights_only=False) if data_path.is_file() else None
    if saved is None or saved["sharer"] != s_ident.fingerprint:  # every sharer layer: the map needs the receiver
        shared = _shared_readings(s_lm, tasks, set(range(s_ident.num_layers)), max_tokens, examples)
        torch.save({"sharer": s_ident.fingerprint, "shared": shared}, data_path)
    else:
        shared = saved["shared"]
    del s_lm, saved
    clear_model_cache()
    gc.collect()
    r_lm = load_for_cli(receiver, threads)
    layer_map = align.depth_proportional(r_lm.identity.num_layers, s_ident.num_layers)
    kept = [(t, s) for t, s in zip(tasks, shared, strict=False) if s is not None][:examples]
    kept_ids = [t.id for t, _ in kept]
    ckpt = work / f"ckpt_rank{rank}_seed{seed}.pt"
    if FT.checkpoint_step(ckpt) >= steps:  # nothing left to train: the artefact from the checkpoint
        net = FT.net_from_checkpoint(ckpt)
        state = FT.load_checkpoint(ckpt, net)
        console.print(f"{ckpt} has {state.step} steps (>= --steps {steps}): writing its artefact")
    else:
        exs = _receiver_examples(r_lm, kept, s_ident, s_tok, work / f"receiver_{examples}_{max_tokens}.pt")
        held, train_ex = exs[:held_out], exs[held_out:]
        feat = next(iter(train_ex[0].feats.values())).shape[-1]
        net = F.FuserNet(r_lm.identity.num_layers, feat, r_lm.identity.num_kv_heads, r_lm.identity.head_dim, rank)
        state = None
        if ckpt.is_file():
            state = FT.load_checkpoint(ckpt, net)
            console.print(f"resuming {ckpt} at step {state.step}")
        else:
            FT.standardise(net, train_ex, layer_map)
        cfg = FT.TrainConfig(steps=steps, lr=lr, seed=seed, eval_every=eval_every)
        state = FT.train(net, r_lm.model, r_lm.identity, layer_map, train_ex, held, cfg, state,
                         progress=lambda xs: tqdm(xs, desc=f"train fuser {receiver} <- {sharer}", unit="step",
                                                  initial=xs.start, total=steps),
                         checkpoint=lambda st: FT.save_checkpoint(ckpt, net, st))
        FT.save_checkpoint(ckpt, net, state)
    sources = _problem_sources(kept_ids)
    last = state.held[-1] if state.held else {}
    which = "last"
    if keep == "best" and state.best is not None:
        net.load_state_dict(state.best["net"])
        last = next(h for h in state.held if h["step"] == state.best["step"])
        which = "best"
    elif keep == "best":
        console.print("the checkpoint has no best-held-out record (made before it was kept): writing the last step")
    taus = [r["tau"] for r in state.train]
    training = {"datasets": sources, "sources": list(PROBLEM_SOURCES), "n_examples": len(kept_ids) - held_out,
                "held_out": kept_ids[:held_out], "max_tokens": max_tokens, "steps": state.step, "lr": lr,
                "kept": f"{which} (step {last.get('step', state.step)})",
                "seed": seed, "batch": 1, "tau": [taus[0], taus[-1]] if taus else None,
                "loss": "answer tokens + end marker",
                "regime": "shared (both models read the task's context; the receiver answers its prompt)"}
    metrics = {"held_out_loss": last.get("fused"), "held_out_loss_receiver": last.get("receiver"),
               "open_layers": last.get("open")}
    config, tensors = F.to_artefact(net, (receiver, r_lm.identity), (sharer, s_ident), layer_map, training, metrics)
    folder = artefact.save(out or artefact.default_dir(receiver, sharer, "fuser"), config, tensors)
    curve = {"train": state.train, "held": state.held, "settings": training}
    (folder / "loss_curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    console.print(f"wrote {folder} ({net.n_params:,} parameters, {state.step} steps, kept the {which} at step "
                  f"{last.get('step', state.step)}; held-out answer loss "
                  f"{last.get('fused', float('nan')):.3f} vs receiver alone {last.get('receiver', float('nan')):.3f}; "
                  f"{last.get('open', '?')}/{len(layer_map)} gates open)")


def _receiver_examples(r_lm, kept, s_ident, s_tok, path: Path) -> list:
    """The receiver's pass over the kept tasks (``fuser_train.receiver_pass``), cached in ``path``."""
    import torch
    from tqdm import tqdm

    from kvrelay.fuse import fuser_train as FT

    key = [r_lm.identity.fingerprint, s_ident.fingerprint, [t.id for t, _ in kept]]
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved["key"] == key:
            return saved["examples"]
    exs = FT.receiver_pass(r_lm, [t for t, _ in kept], [s for _, s in kept], _bridge_for(s_ident, s_tok, r_lm),
                           progress=lambda xs: tqdm(xs, desc=f"receiver reads ({r_lm.name})", unit="task"))
    torch.save({"key": key, "examples": exs}, path)
    return exs


def _bridge_for(s_ident, s_tok, r_lm):
    from kvrelay.fuse.bridge import TokenBridge

    if s_ident.tokenizer_hash == r_lm.identity.tokenizer_hash:
        return TokenBridge()
    return TokenBridge(s_tok, r_lm.tokenizer)


def _shared_readings(s_lm, tasks, layers: set[int], max_tokens: int, want: int) -> list:
    """The sharer's features of task contexts, until ``want`` readings fit ``max_tokens`` (None: skipped)."""
    from tqdm import tqdm

    from kvrelay.fuse import fuser_train as FT

    out: list = []
    bar = tqdm(total=want, desc=f"sharer reads ({s_lm.name})", unit="task")
    for t in tasks:
        r = FT.sharer_pass(s_lm, [t.context], layers, max_tokens)[0]
        out.append(r)
        if r is not None:
            bar.update(1)
            if sum(x is not None for x in out) >= want:
                break
    bar.close()
    return out


def _load_pair(receiver: str, sharer: str, threads: int | None, artefact_dir: Path | None, ridge: bool = True):
    from kvrelay.cli.common import load_for_cli
    from kvrelay.fuse import artefact
    from kvrelay.fuse.ridge import RidgeAdapter

    s_lm, r_lm = load_for_cli(sharer, threads), load_for_cli(receiver, threads)
    if not ridge:
        return r_lm, s_lm, None
    folder = artefact_dir or artefact.default_dir(receiver, sharer, "ridge")
    return r_lm, s_lm, RidgeAdapter.load(folder, s_lm.tokenizer, r_lm.tokenizer)


@app.command("eval")
def eval_(
    receiver: str = typer.Option("qwen2.5-coder-0.5b"),
    sharer: str = typer.Option("qwen2.5-coder-1.5b"),
    tasks: str = typer.Option("squad,gen", help="comma-separated task sets (private: squad, gen; shared: "
                              "arc_challenge, openbookqa, mmlu)"),
    limit: int = typer.Option(32, min=2, help="tasks per set"),
    methods: str = typer.Option(",".join(("receiver", "sharer", "text", "text_full", "ridge")),
                                help="comma-separated: receiver, sharer, text, text_full, ridge, layers, fuser"),
    max_new_tokens: int = typer.Option(16, min=1),
    seed: int = typer.Option(0, help="task order seed"),
    artefact_dir: Path | None = typer.Option(None, "--artefact", help="ridge artefact folder (default: committed)"),
    fuser_dir: Path | None = typer.Option(None, "--fuser", help="fuser artefact folder (default: committed)"),
    layers_dir: Path | None = typer.Option(None, "--layers", help="layers artefact folder (default: committed)"),
    json_path: Path | None = typer.Option(None, "--json"),
    records: Path | None = typer.Option(None, help="every trial as JSON lines, written as it lands; an existing "
                                        "file is resumed (its trials are kept, not rerun)"),
    threads: int | None = typer.Option(None),
):
    """Accuracy (bootstrap CI), median TTFT and bytes per method; pairing (matched − mismatched) for ridge,
    layers and fuser."""
    import json

    from tqdm import tqdm

    from kvrelay.audit.tasks import available
    from kvrelay.audit.tasks.datasets import load_tasks
    from kvrelay.bench.fuse_eval import Trial, run_tasks, summarize, trial_rows
    from kvrelay.cli import validate as v
    from kvrelay.cli.app import write_json
    from kvrelay.core.jsonl import read_json_lines, write_json_lines

    task_sets = v.names(tasks, "--tasks", available(), "squad,gen")
    method_list = v.names(methods, "--methods", ("receiver", "sharer", "text", "text_full", "ridge", "layers", "fuser"),
                          "receiver,ridge")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.writable_path(records, "--records")
    r_lm, s_lm, adapter = _load_pair(receiver, sharer, threads, artefact_dir, ridge="ridge" in method_list)
    fuser = None
    if "fuser" in method_list:
        from kvrelay.fuse import artefact
        from kvrelay.fuse.fuser import FuserAdapter

        fuser = FuserAdapter.load(fuser_dir or artefact.default_dir(receiver, sharer, "fuser"), r_lm, s_lm.tokenizer)
    layers = None
    if "layers" in method_list:
        from kvrelay.fuse import artefact
        from kvrelay.fuse.layers import LayersAdapter

        layers = LayersAdapter.load(layers_dir or artefact.default_dir(receiver, sharer, "layers"), s_lm.tokenizer,
                                    r_lm.tokenizer)
    chosen = [t for name in task_sets for t in load_tasks(name, limit, seed)]
    earlier = []
    if records and records.is_file():  # resume: keep the trials already written
        try:
            earlier = [Trial(**row) for row in read_json_lines(records, cut_tail_ok=True)]
        except (ValueError, TypeError) as err:  # TypeError: a line without a trial's fields
            raise typer.BadParameter(f"{records}: {err}", param_hint="--records") from None
    ids = {t.id for t in chosen}
    done = [t for t in earlier if t.task_id in ids]
    sink_fh = None
    if records:
        records.parent.mkdir(parents=True, exist_ok=True)
        write_json_lines(records, trial_rows(earlier))  # every earlier trial stays, this run's tasks or not
        sink_fh = records.open("a")

    def sink(trial):
        if sink_fh:
            sink_fh.write(json.dumps(trial_rows([trial])[0]) + "\n")
            sink_fh.flush()

    trials = run_tasks(r_lm, s_lm, adapter, chosen, method_list,
                       max_new_tokens=max_new_tokens, progress=lambda xs, d: tqdm(xs, desc=d, unit="task"),
                       done=done, sink=sink, fuser=fuser, layers=layers)
    out = summarize(trials, receiver, sharer)
    out["settings"] = {"tasks": tasks, "limit": limit, "seed": seed, "max_new_tokens": max_new_tokens,
                       "adapter": adapter and f"{adapter.name}@{adapter.fingerprint[:16]}",
                       "fuser": fuser and f"{fuser.name}@{fuser.fingerprint[:16]}",
                       "layers": layers and f"{layers.name}@{layers.fingerprint[:16]}"}  # `command` (the argv): write_json
    _print(out, receiver, sharer)
    write_json(json_path, out)


def _print(out: dict, receiver: str, sharer: str) -> None:
    from rich.table import Table

    table = Table("regime", "method", "accuracy", "95% CI", "TTFT s", "bytes", "n", title=f"{receiver} <- {sharer}")
    for p in out["pairs"]:
        ci = f"[{p['ci_low']:.2f}, {p['ci_high']:.2f}]" if p["ci_low"] is not None else "-"
        table.add_row(p["regime"], p["method"], f"{p['accuracy']:.3f}", ci, f"{p['ttft_s']:.2f}", str(p["bytes"]), str(p["n"]))
    console.print(table)
    for p in out["pairing"]:
        console.print(f"pairing {p['regime']} {p['method']}: {p['estimate']:+.3f} [{p['ci_low']}, {p['ci_high']}]")


@app.command()
def report(
    records: list[Path] = typer.Argument(..., help="trial files written by `fuse eval --records` (one pair)"),
    json_path: Path | None = typer.Option(None, "--json"),
):
    """Summarise trial records (e.g. of an interrupted or split eval) into the `fuse eval` JSON and table."""

    from kvrelay.bench.fuse_eval import Trial, summarize
    from kvrelay.cli.app import write_json
    from kvrelay.core.jsonl import read_json_lines

    try:
        trials = [Trial(**row) for f in records for row in read_json_lines(f, cut_tail_ok=True)]
    except (ValueError, TypeError) as err:  # TypeError: a line without a trial's fields
        raise typer.BadParameter(str(err), param_hint="RECORDS") from None
    if not trials:
        raise typer.BadParameter("no trials in the given records")
    names = records[0].stem.removeprefix("eval_").split("__")
    receiver, sharer = (names + ["?", "?"])[:2]
    out = summarize(trials, receiver, sharer)
    out["settings"] = {"records": [str(f) for f in records]}  # `command` (the argv): write_json
    _print(out, receiver, sharer)
    write_json(json_path, out)


@app.command()
def ttft(
    receiver: str = typer.Option("qwen2.5-coder-0.5b"),
    sharer: str = typer.Option("qwen2.5-coder-1.5b"),
    tokens: int = typer.Option(2048, min=64, help="context length in tokens (a generated record)"),
    repeats: int = typer.Option(3, min=1),
    method: str = typer.Option("ridge", help="ridge (every layer mapped) or layers (the chosen layers only)"),
    artefact_dir: Path | None = typer.Option(None, "--artefact", help="the method's artefact folder (default: "
                                             "committed)"),
    json_path: Path | None = typer.Option(None, "--json"),
    threads: int | None = typer.Option(None),
):
    """Time to first token at a long context: receiver re-prefilling the text vs reading the mapped cache.

    The sharer's payload is built with the sharer's real tokens and geometry but random K/V (the
    adapter's cost does not depend on the values), so the sharer's own long prefill is not needed.
    """
    import statistics

    from kvrelay.bench.fuse_eval import synthetic_payload, time_ttft
    from kvrelay.cli import validate as v
    from kvrelay.cli.app import write_json

    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    if method not in ("ridge", "layers"):
        raise v.InvalidInput(f"--method {method!r} has no TTFT run", "ridge or layers")
    if method == "ridge":
        r_lm, s_lm, adapter = _load_pair(receiver, sharer, threads, artefact_dir)
    else:
        from kvrelay.fuse import artefact
        from kvrelay.fuse.layers import LayersAdapter

        r_lm, s_lm, _ = _load_pair(receiver, sharer, threads, None, ridge=False)
        adapter = LayersAdapter.load(artefact_dir or artefact.default_dir(receiver, sharer, "layers"),
                                     s_lm.tokenizer, r_lm.tokenizer)
    text, payload = synthetic_payload(s_lm, tokens)
    prompt = "Question: What is the access code for the red vault?\nAnswer with the number only."
    text_s, mapped_s = time_ttft(r_lm, adapter, text, payload, prompt, repeats)
    moved = adapter.adapt(payload, r_lm.identity).nbytes if method == "layers" else payload.nbytes
    out = {"receiver": receiver, "sharer": sharer, "method": method, "context_tokens": payload.num_tokens,
           "repeats": repeats, "text_full_ttft_s": statistics.median(text_s),
           f"{method}_ttft_s": statistics.median(mapped_s),
           "speedup": statistics.median(text_s) / statistics.median(mapped_s), "text_full_all": text_s,
           f"{method}_all": mapped_s, "bytes": moved}
    console.print(f"{payload.num_tokens} context tokens: re-prefill {out['text_full_ttft_s']:.2f}s, {method} "
                  f"{out[f'{method}_ttft_s']:.2f}s -> {out['speedup']:.1f}x")
    write_json(json_path, out)
