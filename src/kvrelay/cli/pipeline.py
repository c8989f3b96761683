"""``kvrelay bench pipeline`` (mounted under ``bench`` by the root CLI); also
``python -m kvrelay.cli.pipeline pipeline ...``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP

app = typer.Typer(help="Multi-agent workflows: text vs kv channels.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 150)


@app.callback()
def _group() -> None:
    """Keep ``pipeline`` a named sub-command even while it is the only one."""


def load_workload(workflow: str, tokenizer, context_tokens: int, *, seed: int, layout: str | None,
                  source: str | None, max_new_tokens: int | None, min_new_tokens: int | None):
    from kvrelay.workflows.spec import Workflow
    from kvrelay.workflows.workloads import build_workload

    custom = Workflow.load(workflow) if workflow.endswith(".toml") else None
    wl = build_workload(custom.name if custom else workflow, tokenizer, context_tokens, seed=seed, layout=layout,
                        workflow=custom, source=source)
    if max_new_tokens is not None or min_new_tokens is not None:
        from dataclasses import replace

        wl = replace(wl, workflow=wl.workflow.with_tokens(max_new_tokens, min_new_tokens))
    return wl


def print_result(res: dict) -> None:
    t = Table(title=f"bench pipeline — {res['workflow']} on {res['model']}, {res['context_tokens']} context tokens, "
                    f"{res['layout']} layout (medians of {res['repeats']})")
    for col in ("agent", "channel", "mode", "prefill tok", "prefill s", "decode tok", "decode s", "relayed tok",
                "relay MB", "relay s", "wall s", "same"):
        t.add_column(col, justify="left" if col in ("agent", "channel", "mode") else "right")
    for r in res["per_agent"]:
        for mode in ("text", "kv"):
            t.add_row(r["agent"] if mode == "text" else "", r["channel"] if mode == "kv" else "text", mode,
                      str(r[f"{mode}_prefill_tokens"]), f"{r[f'{mode}_prefill_s']:.2f}",
                      str(r[f"{mode}_decode_tokens"]), f"{r[f'{mode}_decode_s']:.2f}",
                      str(r[f"{mode}_relayed_tokens"]), f"{r[f'{mode}_relay_bytes'] / 1e6:.1f}",
                      f"{r[f'{mode}_relay_s']:.3f}", f"{r[f'{mode}_wall_s']:.2f}",
                      "" if mode == "text" else ("yes" if r["identical"] else f"no ({r['common_prefix_tokens']})"))
    console.print(t)
    f = res["fact"]
    console.print(f"text {res['text_s']:.2f}s  kv {res['kv_s']:.2f}s  speedup {res['speedup']:.2f}x  "
                  f"ideal {res['ideal_speedup']:.2f}x  ({res['speedup_vs_ideal']:.2f} of ideal)  "
                  f"outputs identical: {res['outputs_identical']}  "
                  f"fact exact-match text/kv: {f['text_exact_match']}/{f['kv_exact_match']}  "
                  f"min tokens written: {res['min_decode_tokens']}")


@app.command("pipeline")
def pipeline(
    workflow: str = typer.Option("doc5", help="built-in workload (review3, doc5, dialogue, hierarchy) or a .toml file"),
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: int = typer.Option(2048, help="shared context size in tokens (real text)"),
    repeats: int = typer.Option(3, help="interleaved text/kv repeats; medians are reported"),
    layout: str = typer.Option(None, help="continue | replace (default: the workflow's)"),
    source: str = typer.Option(None, help="prose | code (default: the workload's)"),
    max_new_tokens: int = typer.Option(None, help="override every agent's max_new_tokens"),
    min_new_tokens: int = typer.Option(None, help="override every agent's min_new_tokens (default 32)"),
    seed: int = typer.Option(0, help="picks the text offset and the known-answer fact"),
    json_path: Path = typer.Option(None, "--json", help="write the result here (plot beside it as .png)"),
    plot: bool = typer.Option(True, help="write the PNG next to the JSON"),
    threads: int = typer.Option(None, help="torch intra-op threads (1 is steadier on a shared, busy CPU)"),
    backend: str = typer.Option("inprocess", help="inprocess | ray (every agent a Ray actor; payloads through the "
                                "object store; --ray-address for an existing cluster, see docs/ray.md) | process "
                                "(every agent its own OS process; payloads only through --store)"),
    store: str = typer.Option(None, help="store URL every kv edge goes through (file:///DIR, a folder, "
                              "redis://HOST:PORT/DB, memory:// in process); process backend default: a temporary folder"),
    codec: str = typer.Option("raw", help="codec of payloads through the store (kv.codecs: fp16, int8, int4, evict:F...)"),
    ray_address: str = typer.Option(None, help="Ray cluster address (default: start a local one)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
) -> None:
    """Text vs kv runs of one workflow, interleaved in one process: speedup, ideal speedup, identical outputs."""
    from kvrelay.bench.pipeline import bench_pipeline
    from kvrelay.bench.plot import plot_pipeline
    from kvrelay.cli.common import load_for_cli

    lm = load_for_cli(model, threads, engine)
    wl = load_workload(workflow, lm.tokenizer, context_tokens, seed=seed, layout=layout, source=source,
                       max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)
    with _executor(backend, lm, model, wl.workflow, store=store, codec=codec, threads=threads,
                   ray_address=ray_address) as ex:  # None: in process, payloads handed over as objects
        res = bench_pipeline(lm, wl, repeats=repeats, model_name=model, progress=lambda s: console.print(s),
                             executor=ex)
    res["backend"] = backend
    res["store"], res["codec"] = store, codec
    res["engine"] = lm.engine
    res["context_tokens_requested"] = context_tokens
    res["command"] = (f"kvrelay bench pipeline --workflow {workflow} --model {model} --context-tokens {context_tokens}"
                      f" --repeats {repeats}" + (f" --layout {layout}" if layout else "")
                      + (f" --threads {threads}" if threads is not None else "")
                      + (f" --backend {backend}" if backend != "inprocess" else "")
                      + (f" --store {store}" if store else "") + (f" --codec {codec}" if codec != "raw" else "")
                      + f" --engine {engine}")
    print_result(res)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=2) + "\n")
        console.print(f"wrote {json_path}")
        if plot:
            console.print(f"wrote {plot_pipeline(res, json_path.with_suffix('.png'))}")


@contextlib.contextmanager
def _executor(backend: str, lm, model: str, wf, *, store: str | None, codec: str, threads: int | None,
              ray_address: str | None):
    """The executor a ``--backend`` names (``workflows.executors``), closed afterwards."""
    if backend == "inprocess":
        from kvrelay.workflows.executors import InProcessExecutor

        yield InProcessExecutor(lm, store=store, codec=codec) if (store or codec != "raw") else None
    elif backend == "ray":
        if store or codec != "raw":
            raise typer.BadParameter("--store/--codec go with --backend inprocess or process; Ray actors hand "
                                     "payloads over through Ray's object store")
        import ray

        from kvrelay.workflows.ray_executor import ModelSpec, RayExecutor

        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                 **({} if ray_address else {"num_cpus": 2}))
        with RayExecutor(ModelSpec(name=model, engine=lm.engine), wf, threads=threads) as ex:
            yield ex
    elif backend == "process":
        import tempfile

        from kvrelay.workflows.process_executor import ProcessExecutor

        with tempfile.TemporaryDirectory(prefix="kvrelay-pipeline-store-") as tmp:
            with ProcessExecutor(model, wf, store=store or f"file://{tmp}", codec=codec, threads=threads or 1,
                                 engine=lm.engine) as ex:
                yield ex
    else:
        raise typer.BadParameter(f"--backend must be inprocess, ray or process, got {backend!r}")


@app.command("replace-quality")
def replace_quality_cmd(
    workflows: str = typer.Option("review3,doc5,dialogue,hierarchy", help="comma-separated built-in workloads"),
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: int = typer.Option(512, help="shared context size in tokens"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds (text offset and fact)"),
    threads: int = typer.Option(None, help="torch intra-op threads"),
    json_path: Path = typer.Option(None, "--json", help="write the result here"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
) -> None:
    """The replace layout's quality cost: outputs vs text mode and exact match on a known fact."""
    from kvrelay.bench.pipeline import replace_quality
    from kvrelay.cli.common import load_for_cli

    lm = load_for_cli(model, threads, engine)
    res = replace_quality(lm, [w.strip() for w in workflows.split(",") if w.strip()], context_tokens,
                          [int(s) for s in seeds.split(",")], model_name=model, progress=console.print)
    t = Table(title=f"replace layout vs text — {model}, {context_tokens} context tokens")
    for col in ("workflow", "seed", "agents differing", "agreement", "fact text", "fact kv", "fact continue"):
        t.add_column(col)
    for r in res["rows"]:
        t.add_row(r["workflow"], str(r["seed"]), f"{r['agents_differing']}/{r['agents']}", f"{r['mean_agreement']:.2f}",
                  str(r["text_exact_match"]), str(r["kv_exact_match"]), str(r.get("continue_exact_match", "")))
    console.print(t)
    console.print(res["summary"])
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=2) + "\n")
        console.print(f"wrote {json_path}")


if __name__ == "__main__":  # pragma: no cover
    app()
