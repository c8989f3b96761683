"""``kvrelay fuse``: fit cross-model cache adapters and evaluate them against the text baselines."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Cross-model cache relay: fit adapters (ridge, layers), train a fuser, evaluate translate / "
                  "fuse against text.",
                  no_args_is_help=True)
console = Console()


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
    from kvrelay.bench.fuse_fit import fit_layers, fit_ridge
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli

    if method not in ("ridge", "layers"):
        raise v.InvalidInput(f"--method {method!r} is not fitted by `fuse fit`",
                             "ridge (closed form) or layers (chosen by attention)")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    s_lm = load_for_cli(sharer, threads)
    r_lm = load_for_cli(receiver, threads)
    if method == "layers":
        got = fit_layers(r_lm, s_lm, receiver, sharer, problems=texts, max_tokens=max_tokens, fraction=fraction,
                         alpha=alpha, ridge_dir=ridge_dir, out=out)
        console.print(f"wrote {got.folder}  ({got.problems} problems; layers {list(got.chosen)} of "
                      f"{len(got.importance)}; importance {float(got.importance.min()):.3f}.."
                      f"{float(got.importance.max()):.3f})")
        return
    folder, state, config = fit_ridge(r_lm, s_lm, receiver, sharer, texts=texts, max_tokens=max_tokens,
                                      spread=spread, out=out)
    r2k, r2v = config.metrics["r2_k"], config.metrics["r2_v"]
    console.print(f"wrote {folder}  ({state.texts} texts, {state.tokens} tokens; held-out R² K "
                  f"{min(r2k):.3f}..{max(r2k):.3f}, V {min(r2v):.3f}..{max(r2v):.3f}; layer map {list(config.layer_map)})")


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
    batch: int = typer.Option(1, min=1, help="examples per step (gradients accumulated; their mean loss)"),
    keep: str = typer.Option("best", help="which fuser the artefact holds: best (lowest held-out loss) or last"),
    work: Path | None = typer.Option(None, help="checkpoints and precomputed caches (default: out/fuse-train/R__S)"),
    out: Path | None = typer.Option(None, help="artefact folder (default: artefacts/fuse/R__S__fuser)"),
    threads: int | None = typer.Option(None, help="torch intra-op threads"),
):
    """Train a fuser with both models frozen; resumable (re-run the same command to continue)."""
    from kvrelay.bench.fuse_fit import KEEP, TrainSettings, train_fuser
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli

    if method != "fuser":
        raise v.InvalidInput(f"--method {method!r} is not trained by `fuse train`",
                             "fuser (ridge is fitted in closed form by `kvrelay fuse fit`)")
    if keep not in KEEP:
        raise v.InvalidInput(f"--keep {keep!r}", "best or last")
    if held_out >= examples:
        raise v.InvalidInput(f"--held-out {held_out} leaves no training tasks of --examples {examples}",
                             "--held-out smaller than --examples")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    settings = TrainSettings(steps=steps, examples=examples, held_out=held_out, max_tokens=max_tokens, rank=rank,
                             lr=lr, seed=seed, eval_every=eval_every, keep=keep, batch=batch)
    got = train_fuser(receiver, sharer, lambda name: load_for_cli(name, threads), settings, work=work, out=out,
                      log=console.print)
    h = got.held
    console.print(f"wrote {got.folder} ({got.n_params:,} parameters, {got.steps} steps, kept the {got.kept} at step "
                  f"{got.kept_step}; held-out answer loss {h.get('fused', float('nan')):.3f} vs receiver alone "
                  f"{h.get('receiver', float('nan')):.3f}; {h.get('open', '?')}/{got.layers} gates open)")


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
    from tqdm import tqdm

    from kvrelay.audit.tasks import available
    from kvrelay.audit.tasks.datasets import load_tasks
    from kvrelay.bench.fuse_eval import METHODS, eval_result, load_adapters, settings_label
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli, write_json
    from kvrelay.core.errors import RecordsError

    task_sets = v.names(tasks, "--tasks", available(), "squad,gen")
    method_list = v.names(methods, "--methods", METHODS, "receiver,ridge")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.writable_path(records, "--records")
    s_lm, r_lm = load_for_cli(sharer, threads), load_for_cli(receiver, threads)
    adapters = load_adapters(r_lm, s_lm, receiver, sharer, method_list, ridge=artefact_dir, layers=layers_dir,
                             fuser=fuser_dir)
    chosen = [t for name in task_sets for t in load_tasks(name, limit, seed)]
    try:
        out = eval_result(r_lm, s_lm, chosen, method_list, adapters, threads=threads, max_new_tokens=max_new_tokens,
                          records=records, progress=lambda xs, d: tqdm(xs, desc=d, unit="task"))
    except RecordsError as err:
        raise typer.BadParameter(str(err), param_hint="--records") from None
    out["settings"] = {"tasks": tasks, "limit": limit, "seed": seed, "max_new_tokens": max_new_tokens,
                       **settings_label(adapters)}  # `command` (the argv): write_json
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

    from kvrelay.bench.fuse_eval import read_trials, summarize
    from kvrelay.cli.common import write_json

    try:
        trials = read_trials(records)
    except ValueError as err:
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
    import torch

    from kvrelay.bench.fuse_eval import load_adapters, ttft_result
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli, write_json

    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    if method not in ("ridge", "layers"):
        raise v.InvalidInput(f"--method {method!r} has no TTFT run", "ridge or layers")
    s_lm, r_lm = load_for_cli(sharer, threads), load_for_cli(receiver, threads)
    adapters = load_adapters(r_lm, s_lm, receiver, sharer, (method,), **{method: artefact_dir})
    out = ttft_result(r_lm, s_lm, adapters["adapter" if method == "ridge" else method], method, tokens, repeats,
                      threads or torch.get_num_threads())
    console.print(f"{out['context_tokens']} context tokens: re-prefill {out['text_full_ttft_s']:.2f}s, {method} "
                  f"{out[f'{method}_ttft_s']:.2f}s -> {out['speedup']:.1f}x "
                  f"(load {out['load_average']['status']}, max {out['load_average']['max']:.2f})")
    write_json(json_path, out)
