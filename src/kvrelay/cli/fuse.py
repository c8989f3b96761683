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
    from kvrelay.cli.common import load_for_cli
    from kvrelay.fuse import artefact, ridge

    if method != "ridge":
        raise typer.BadParameter(f"only ridge is fitted by `fuse fit` (got {method!r}); see README: "
                                 "cross-model methods")
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
