"""``kvrelay verify``: recompute part of a relayed payload from its own token ids and say whether it is genuine.

    kvrelay verify doc.kv --model qwen2.5-coder-0.5b --k 32 --json verdict.json
    kvrelay verify doc.kv --model qwen2.5-coder-0.5b --full
    kvrelay verify --corpus --model qwen2.5-coder-0.5b --json docs/bench/trust_qwen2.5-coder-0.5b.json

Exit status 0 when the verdict is ``ok``, 1 when it is ``tampered`` or ``refused`` (argument mistakes: 2).
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, note, write_json

app = typer.Typer(pretty_exceptions_enable=False)


@app.command("verify")
def verify_cmd(
    payload: Path = typer.Argument(None, help="a kvrelay/1 file (from `kvrelay read --out`); not with --corpus"),
    model: str = typer.Option("qwen2.5-coder-0.5b", help="the receiver's model (the payload's own)"),
    k: int = typer.Option(32, help="positions spot-checked through every layer (>= 2); layer 0 checks all"),
    full: bool = typer.Option(False, "--full", help="re-prefill every token instead of a spot check"),
    seed: int = typer.Option(None, help="fix the spot-checked positions (default: drawn fresh each time)"),
    keys_file: Path = typer.Option(None, help="require a signature by one of these keys (kvrelay.kv.sign key lines; "
                                   "default $KVRELAY_KEYS when set)"),
    corpus: bool = typer.Option(False, "--corpus", help="run the fault corpus: every fault, which defence catches "
                                "it, at what k and cost, and the false-positive rate on genuine payloads"),
    genuine: int = typer.Option(200, help="--corpus: genuine payloads checked for false positives"),
    context_tokens: int = typer.Option(2048, help="--corpus: tokens of the faulted payload"),
    trials: int = typer.Option(20, help="--corpus: random draws per fault (noise and positions)"),
    records: Path = typer.Option(None, help="--corpus: resumable JSONL of finished rows"),
    threads: int = typer.Option(None, help="torch intra-op threads"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    json_path: Path = typer.Option(None, "--json", help="write the verdict (or the corpus table) as JSON"),
) -> None:
    """Verify a payload: layer 0 at every position and k random positions through every layer, recomputed
    from the payload's own token ids, compared within a tolerance set by its engine mode, dtype and codec."""
    from kvrelay.agents.verify import VerifySpec

    if corpus == (payload is not None):
        raise v.InvalidInput("--corpus takes no PAYLOAD" if corpus else "no PAYLOAD given", "PAYLOAD or --corpus")
    v.positive(k, "--k", 2)
    v.positive(threads, "--threads")
    if seed is not None:
        v.positive(seed, "--seed", 0)
    v.engine(engine)
    v.model(model)
    v.writable_path(json_path, "--json")
    spec = VerifySpec(k=k, full=full, seed=seed)
    if corpus:
        v.positive(genuine, "--genuine")
        v.positive(context_tokens, "--context-tokens", 64)
        v.positive(trials, "--trials")
        from kvrelay.bench.trust import print_corpus, run_corpus

        res = run_corpus(model, k=k, genuine=genuine, context_tokens=context_tokens, trials=trials,
                         records=records, threads=threads, engine=engine,
                         progress=(lambda partial: write_json(json_path, partial)) if json_path else None)
        print_corpus(res)
        write_json(json_path, res)
        return
    data = Path(v.existing_file(payload, "PAYLOAD", "a kvrelay/1 file")).read_bytes()
    from kvrelay.kv.sign import keyring_from

    keys = keyring_from(keys_file)
    from kvrelay.agents.verify import verify_bytes
    from kvrelay.cli.common import load_for_cli

    lm = load_for_cli(model, threads, engine)
    verdict = verify_bytes(lm, data, spec, keys=keys or None)
    note(f"checked {len(verdict.checked_positions)} positions through every layer; cost {verdict.cost_fraction:.4f} "
         "of a full re-prefill")
    print(f"{verdict.verdict}: {verdict.reason}")
    write_json(json_path, {"payload": str(payload), "model": model, "k": k, "full": full, **verdict.to_json()})
    if verdict.verdict != "ok":
        raise typer.Exit(1)
