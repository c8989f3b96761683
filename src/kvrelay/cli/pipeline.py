"""``kvrelay bench pipeline`` (mounted under ``bench`` by the root CLI); also
``python -m kvrelay.cli.pipeline pipeline ...``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, command_line, load_for_cli, note, write_json
from kvrelay.workflows.workloads import BENCH_NEW_TOKENS, MAX_NEW_TOKENS, WORKLOADS

WORKLOAD_NAMES = tuple(WORKLOADS)

app = typer.Typer(help="Multi-agent workflows: text vs kv channels.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 150)


@app.callback()
def _group() -> None:
    """Keep ``pipeline`` a named sub-command even while it is the only one."""


BACKENDS = ("inprocess", "ray", "process")
STORE_SCHEMES = ("file", "memory", "redis", "rediss", "unix")  # transport.stores.open_store
AGENT_RESERVE = 160  # tokens per agent kept for its role, prompt and the turns it quotes


def check_workflow(workflow: str):
    """A built-in workload name or a workflow ``.toml`` file (parsed here, before any model loads)."""
    from kvrelay.workflows.spec import Workflow
    from kvrelay.workflows.workloads import WORKLOADS

    if not workflow.endswith(".toml"):
        v.choice(workflow, "--workflow", [*WORKLOADS, "FILE.toml"])
        return WORKLOADS[workflow][0]()
    path = v.existing_file(workflow, "--workflow", "a workflow TOML file (see docs/workflows.md)")
    try:
        wf = Workflow.load(path)
    except (ValueError, TypeError, KeyError) as err:  # tomllib's errors are ValueErrors
        raise v.InvalidInput(f"--workflow {workflow!r} is not a valid workflow ({v.one_line(err)})",
                             "the TOML format in docs/workflows.md") from None
    return wf


def check_fits(ref, wf, context_tokens: int, max_new_tokens: int | None) -> None:
    per_agent = [(a.max_new_tokens if max_new_tokens is None else max_new_tokens) + AGENT_RESERVE for a in wf.agents]
    v.fits(ref, context_tokens, "--context-tokens", reserve=sum(per_agent))


def load_workload(workflow: str, tokenizer, context_tokens: int, *, seed: int, layout: str | None,
                  source: str | None, max_new_tokens: int | None, min_new_tokens: int | None):
    from kvrelay.bench.pipeline import fixed_length
    from kvrelay.workflows.spec import Workflow
    from kvrelay.workflows.workloads import build_workload

    custom = Workflow.load(workflow) if workflow.endswith(".toml") else None
    wl = build_workload(custom.name if custom else workflow, tokenizer, context_tokens, seed=seed, layout=layout,
                        workflow=custom, source=source)
    return fixed_length(wl, max_new_tokens, min_new_tokens)


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
    for a in res.get("auto_routes", ()):
        how = a["channel"] + (f" ({a['codec']})" if a["codec"] else "")
        console.print(f"auto edge {a['edge']}: {how} in kv repeat(s) {', '.join(str(r + 1) for r in a['repeats'])}"
                      f" — {a['reason']}")
    for ev in res.get("switch_events", ()):
        console.print(f"relay switch on {ev['edge']}: {'on' if ev['relay_on'] else 'off'} "
                      f"(estimate {ev['estimate']:.3f} nats/token)")
    if res.get("noise"):
        console.print(f"[yellow]note:[/yellow] {res['noise']}")


@app.command("pipeline")
def pipeline(
    workflow: str = typer.Option("doc5", help="a built-in workload (" + ", ".join(WORKLOAD_NAMES) + ") or a "
                                 "workflow .toml file (docs/workflows.md)"),
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: int = typer.Option(2048, help="shared context size in tokens (real text)"),
    repeats: int = typer.Option(3, help="interleaved text/kv repeats; medians are reported"),
    layout: str = typer.Option(None, help="continue | replace (default: the workflow's)"),
    source: str = typer.Option(None, help="prose | code (default: the workload's)"),
    max_new_tokens: int = typer.Option(None, help=f"every agent's max_new_tokens (default: the workflow's, "
                                       f"{MAX_NEW_TOKENS} for the built-ins)"),
    min_new_tokens: int = typer.Option(BENCH_NEW_TOKENS, help="every agent writes at least this many tokens, so "
                                       "both modes decode alike (0: stop at the end token)"),
    seed: int = typer.Option(0, help="picks the text offset and the known-answer fact"),
    json_path: Path = typer.Option(None, "--json", help="write the result here (plot beside it as .png)"),
    plot: bool = typer.Option(True, help="write the PNG next to the JSON"),
    threads: int = typer.Option(None, help="torch intra-op threads (1 is steadier on a shared, busy CPU)"),
    backend: str = typer.Option("inprocess", help=" | ".join(BACKENDS) + " (ray: every agent a Ray actor, "
                                "payloads through the object store; --ray-address for an existing cluster, "
                                "see docs/ray.md; process: every agent its own OS process, payloads only "
                                "through --store)"),
    store: str = typer.Option(None, help="store URL every kv edge goes through (file:///DIR, a folder, "
                              "redis://HOST:PORT/DB, memory:// in process; docs/payloads.md); process backend "
                              "default: a temporary folder"),
    codec: str = typer.Option("auto", help="codec of payloads through the store (docs/codecs.md: raw, fp16, int8, "
                              "int4, evict:F, ...); auto: fp16 through a store or between processes, payloads "
                              "handed over as objects otherwise"),
    ray_address: str = typer.Option(None, help="Ray cluster address (default: start a local one)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    profile: str = typer.Option(None, help="cost profile that prices the channels of the workflow's channel = "
                                "\"auto\" edges: the JSON of `kvrelay calibrate --json` or the profile it saved "
                                "($KVRELAY_HOME/profiles/MODEL__ENGINE.json, or its --profile); needed with auto edges"),
    value: str = typer.Option(None, help="comma-separated audit folders (each with records.jsonl[.gz]; or a folder "
                              "of them, or a records.jsonl[.gz]) the value model of auto edges is fitted on; needed with "
                              "auto edges"),
    slo: float = typer.Option(None, help="the latency budget in seconds each auto edge's receiver is decided under "
                              "(default: none)"),
) -> None:
    """Text vs kv runs of one workflow, interleaved in one process: speedup, ideal speedup, identical outputs.

    A workflow TOML with channel = "auto" edges needs --profile and --value: in kv mode each auto edge is
    decided per run (kv with a codec, text or none; docs/workflows.md) and its route is printed and kept in
    the JSON; text mode re-encodes it like every edge."""
    from kvrelay.workflows.spec import LAYOUTS
    from kvrelay.workflows.workloads import HEADERS

    wf = check_workflow(workflow)
    files = v.auto_policy_files(wf, workflow, profile, value, slo)
    if files is not None and backend != "inprocess":
        raise v.InvalidInput(f"--backend {backend} with channel \"auto\" edges", "--backend inprocess (the "
                             "in-process executor tells compatibility and runs the switch's probe)")
    v.positive(context_tokens, "--context-tokens", minimum=16)
    v.positive(repeats, "--repeats")
    if layout is not None:
        v.choice(layout, "--layout", LAYOUTS)
    if source is not None:
        v.choice(source, "--source", sorted(HEADERS))
    v.positive(max_new_tokens, "--max-new-tokens")
    v.positive(min_new_tokens, "--min-new-tokens", minimum=0)
    v.positive(threads, "--threads")
    v.choice(backend, "--backend", BACKENDS)
    check_store(backend, store, codec)
    codec = resolve_codec(backend, store, codec)
    v.engine(engine)
    v.writable_path(json_path, "--json")
    ref = v.model(model)
    check_fits(ref, wf, context_tokens, max_new_tokens)

    from kvrelay.bench.auto_policy import auto_policy
    from kvrelay.bench.pipeline import bench_pipeline
    from kvrelay.bench.plot import plot_pipeline

    policy, policy_summary = auto_policy(*files, slo_s=slo) if files is not None else (None, None)
    if policy is not None and policy.cost.model != model:
        note(f"the cost profile is of {policy.cost.model}, not {model}: auto edges are priced with its rates")
    lm = load_for_cli(model, threads, engine)
    wl = load_workload(workflow, lm.tokenizer, context_tokens, seed=seed, layout=layout, source=source,
                       max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)
    with _executor(backend, lm, model, wl.workflow, store=store, codec=codec, threads=threads,
                   ray_address=ray_address) as ex:  # None: in process, payloads handed over as objects
        res = bench_pipeline(lm, wl, repeats=repeats, model_name=model, progress=note, executor=ex, policy=policy)
    res["policy"] = policy_summary
    res["backend"] = backend
    res["store"], res["codec"] = store, codec
    res["engine"] = lm.engine
    res["context_tokens_requested"] = context_tokens
    res["command"] = command_line()
    print_result(res)
    if json_path is not None:
        write_json(json_path, res, console=console)
        if plot:
            console.print(f"wrote {plot_pipeline(res, json_path.with_suffix('.png'))}")


def resolve_codec(backend: str, store: str | None, codec: str) -> str:
    """``auto``: the wire default (``kv.codecs.WIRE_CODEC``) when payloads cross a store or a process, else
    ``raw`` (handed over as objects, in process or through Ray's object store)."""
    from kvrelay.kv.codecs import WIRE_CODEC

    if codec != "auto":
        return codec
    return WIRE_CODEC if (store is not None or backend == "process") else "raw"


def check_store(backend: str, store: str | None, codec: str) -> None:
    from kvrelay.kv.codecs import available_codecs, parse

    if codec != "auto":
        v.parsed_names(codec, "--codec", parse,
                       "auto or one codec name (docs/codecs.md: " + ", ".join(available_codecs()) + ")")
    if backend == "ray" and (store or codec not in ("raw", "auto")):
        raise v.InvalidInput("--store/--codec do not apply to --backend ray (Ray actors hand payloads over through "
                             "Ray's object store)", "--backend inprocess or process with --store/--codec")
    if store is not None:
        scheme = store.partition("://")[0] if "://" in store else None
        if not store.strip() or (scheme is not None and scheme not in STORE_SCHEMES) or (
                scheme == "file" and not store.startswith("file:///")):
            raise v.InvalidInput(f"--store {store!r} is not a store URL", "file:///ABS/DIR, a folder, "
                                 "redis://HOST:PORT/DB or memory:// (docs/payloads.md)")


@contextlib.contextmanager
def _executor(backend: str, lm, model: str, wf, *, store: str | None, codec: str, threads: int | None,
              ray_address: str | None):
    """The executor a ``--backend`` names (``workflows.executors``), closed afterwards."""
    if backend == "inprocess":
        from kvrelay.workflows.executors import InProcessExecutor

        yield InProcessExecutor(lm, store=store, codec=codec) if (store or codec != "raw") else None
    elif backend == "ray":
        import ray

        from kvrelay.workflows.ray_executor import ModelSpec, RayExecutor

        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                 **({} if ray_address else {"num_cpus": 2}))
        with RayExecutor(ModelSpec(name=model, engine=lm.engine), wf, threads=threads) as ex:
            yield ex
    else:  # process (check_store and --backend's check ran before the model loaded)
        import tempfile

        from kvrelay.workflows.process_executor import ProcessExecutor

        with tempfile.TemporaryDirectory(prefix="kvrelay-pipeline-store-") as tmp:
            with ProcessExecutor(model, wf, store=store or f"file://{tmp}", codec=codec, threads=threads or 1,
                                 engine=lm.engine) as ex:
                yield ex


@app.command("replace-quality")
def replace_quality_cmd(
    workflows: str = typer.Option(",".join(WORKLOAD_NAMES), help="comma-separated built-in workloads ("
                                  + ", ".join(WORKLOAD_NAMES) + ")"),
    model: str = typer.Option("qwen2.5-coder-0.5b", help="zoo name, local folder or transformers id"),
    context_tokens: int = typer.Option(512, help="shared context size in tokens"),
    seeds: str = typer.Option("0,1,2", help="comma-separated seeds (text offset and fact)"),
    threads: int = typer.Option(None, help="torch intra-op threads"),
    json_path: Path = typer.Option(None, "--json", help="write the result here"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
) -> None:
    """The replace layout's quality cost: outputs vs text mode and exact match on a known fact."""
    names = v.names(workflows, "--workflows", WORKLOAD_NAMES, "review3,doc5")
    v.positive(context_tokens, "--context-tokens", minimum=16)
    seed_list = v.int_list(seeds, "--seeds", minimum=0, example="0,1,2")
    v.positive(threads, "--threads")
    v.writable_path(json_path, "--json")
    v.engine(engine)
    ref = v.model(model)
    for name in names:
        check_fits(ref, WORKLOADS[name][0](), context_tokens, BENCH_NEW_TOKENS)

    from kvrelay.bench.pipeline import replace_quality

    lm = load_for_cli(model, threads, engine)
    res = replace_quality(lm, list(names), context_tokens, seed_list, model_name=model, progress=note)
    res["engine"] = lm.engine
    res["command"] = command_line()
    print_replace_quality(res)
    write_json(json_path, res, console=console)


def print_replace_quality(res: dict) -> None:
    t = Table(title=f"replace layout vs text — {res['model']}, {res['context_tokens']} context tokens")
    for col in ("workflow", "seed", "agents differing", "agreement", "fact text", "fact kv", "fact continue"):
        t.add_column(col)
    for r in res["rows"]:
        t.add_row(r["workflow"], str(r["seed"]), f"{r['agents_differing']}/{r['agents']}", f"{r['mean_agreement']:.2f}",
                  str(r["text_exact_match"]), str(r["kv_exact_match"]), str(r.get("continue_exact_match", "")))
    console.print(t)
    s = res["summary"]
    st = Table(title=f"over {s['runs']} runs (workflow x seed)")
    for col in ("agent outputs differing", "final answers differing", "mean agreement", "fact text", "fact kv (replace)",
                "fact continue"):
        st.add_column(col, justify="right")
    st.add_row(f"{100 * s['fraction_agent_outputs_differing']:.0f}%", f"{100 * s['fraction_final_answers_differing']:.0f}%",
               f"{s['mean_agreement']:.2f}", f"{100 * s['text_exact_match']:.0f}%", f"{100 * s['kv_exact_match']:.0f}%",
               f"{100 * s['continue_exact_match']:.0f}%" if "continue_exact_match" in s else "—")
    console.print(st)


if __name__ == "__main__":  # pragma: no cover
    app()
