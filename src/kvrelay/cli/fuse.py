"""``kvrelay fuse``: fit cross-model cache adapters and evaluate them against the text baselines."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Cross-model cache relay: fit adapters (ridge), evaluate translate / fuse against text.",
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
    method: str = typer.Option("ridge", help="ridge (closed form); layers and fuser are not fitted here"),
    texts: int = typer.Option(96, min=5, help="fitting texts (BoolQ, SciQ, CommonsenseQA, TriviaQA/NQ, generated)"),
    max_tokens: int = typer.Option(384, min=16, help="tokens per text (the sharer's reading, truncated)"),
    spread: int = typer.Option(1, min=0, help="candidate sharer layers: depth-proportional ± spread, and last-aligned"),
    out: Path | None = typer.Option(None, help="artefact folder (default: artefacts/fuse/R__S__METHOD)"),
    threads: int | None = typer.Option(None, help="torch intra-op threads"),
):
    """Fit an adapter on paired caches of the same unlabelled texts read by both models; save its artefact."""
    from tqdm import tqdm

    from kvrelay.audit.tasks.fitting import GEN_SEED, fitting_texts
    from kvrelay.cli import validate as v
    from kvrelay.cli.common import load_for_cli
    from kvrelay.fuse import artefact, ridge

    if method != "ridge":
        raise v.InvalidInput(f"--method {method!r} is not fitted by `fuse fit`", "ridge (closed form)")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    s_lm = load_for_cli(sharer, threads)
    r_lm = load_for_cli(receiver, threads)
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


@app.command()
def train(
    receiver: str = typer.Option("qwen2.5-coder-0.5b"),
    sharer: str = typer.Option("qwen2.5-coder-1.5b"),
    method: str = typer.Option("fuser"),
):
    """Train a gradient-fitted adapter (the fuser). Not available in this version."""
    raise typer.BadParameter(f"`fuse train --method {method}` is not implemented in this version: only the "
                             "closed-form ridge adapter exists (`kvrelay fuse fit`)")


def _load_pair(receiver: str, sharer: str, threads: int | None, artefact_dir: Path | None):
    from kvrelay.cli.common import load_for_cli
    from kvrelay.fuse import artefact
    from kvrelay.fuse.ridge import RidgeAdapter

    s_lm, r_lm = load_for_cli(sharer, threads), load_for_cli(receiver, threads)
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
                                help="comma-separated: receiver, sharer, text, text_full, ridge"),
    max_new_tokens: int = typer.Option(16, min=1),
    seed: int = typer.Option(0, help="task order seed"),
    artefact_dir: Path | None = typer.Option(None, "--artefact", help="ridge artefact folder (default: committed)"),
    json_path: Path | None = typer.Option(None, "--json"),
    records: Path | None = typer.Option(None, help="every trial as JSON lines, written as it lands; an existing "
                                        "file is resumed (its trials are kept, not rerun)"),
    threads: int | None = typer.Option(None),
):
    """Accuracy (bootstrap CI), median TTFT and bytes per method; pairing (matched − mismatched) for ridge."""
    import json

    from tqdm import tqdm

    from kvrelay.audit.tasks import available
    from kvrelay.audit.tasks.datasets import load_tasks
    from kvrelay.bench.fuse_eval import Trial, run_tasks, summarize, trial_rows
    from kvrelay.cli import validate as v
    from kvrelay.cli.app import write_json

    task_sets = v.names(tasks, "--tasks", available(), "squad,gen")
    method_list = v.names(methods, "--methods", ("receiver", "sharer", "text", "text_full", "ridge"), "receiver,ridge")
    v.model(receiver, "--receiver")
    v.model(sharer, "--sharer")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.writable_path(records, "--records")
    r_lm, s_lm, adapter = _load_pair(receiver, sharer, threads, artefact_dir)
    chosen = [t for name in task_sets for t in load_tasks(name, limit, seed)]
    done = []
    if records and records.is_file():  # resume: keep the trials already written
        done = [Trial(**json.loads(ln)) for ln in records.read_text().splitlines() if ln.strip().endswith("}")]
    ids = {t.id for t in chosen}
    done = [t for t in done if t.task_id in ids]
    sink_fh = None
    if records:
        records.parent.mkdir(parents=True, exist_ok=True)
        records.write_text("".join(json.dumps(r) + "\n" for r in trial_rows(done)))
        sink_fh = records.open("a")

    def sink(trial):
        if sink_fh:
            sink_fh.write(json.dumps(trial_rows([trial])[0]) + "\n")
            sink_fh.flush()

    trials = run_tasks(r_lm, s_lm, adapter, chosen, method_list,
                       max_new_tokens=max_new_tokens, progress=lambda xs, d: tqdm(xs, desc=d, unit="task"),
                       done=done, sink=sink)
    out = summarize(trials, receiver, sharer)
    out["settings"] = {"tasks": tasks, "limit": limit, "seed": seed, "max_new_tokens": max_new_tokens,
                       "adapter": f"{adapter.name}@{adapter.fingerprint[:16]}"}  # `command` (the argv): write_json
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
    import json

    from kvrelay.bench.fuse_eval import Trial, summarize
    from kvrelay.cli.app import write_json

    trials = [Trial(**json.loads(ln)) for f in records for ln in f.read_text().splitlines() if ln.strip().endswith("}")]
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
    artefact_dir: Path | None = typer.Option(None, "--artefact"),
    json_path: Path | None = typer.Option(None, "--json"),
    threads: int | None = typer.Option(None),
):
    """Time to first token at a long context: receiver re-prefilling the text vs reading the ridge-mapped cache.

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
    r_lm, s_lm, adapter = _load_pair(receiver, sharer, threads, artefact_dir)
    text, payload = synthetic_payload(s_lm, tokens)
    prompt = "Question: What is the access code for the red vault?\nAnswer with the number only."
    text_s, mapped_s = time_ttft(r_lm, adapter, text, payload, prompt, repeats)
    out = {"receiver": receiver, "sharer": sharer, "context_tokens": payload.num_tokens, "repeats": repeats,
           "text_full_ttft_s": statistics.median(text_s), "ridge_ttft_s": statistics.median(mapped_s),
           "speedup": statistics.median(text_s) / statistics.median(mapped_s), "text_full_all": text_s,
           "ridge_all": mapped_s, "bytes": payload.nbytes}
    console.print(f"{payload.num_tokens} context tokens: re-prefill {out['text_full_ttft_s']:.2f}s, ridge "
                  f"{out['ridge_ttft_s']:.2f}s -> {out['speedup']:.1f}x")
    write_json(json_path, out)
