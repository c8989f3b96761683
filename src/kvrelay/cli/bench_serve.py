"""``kvrelay bench serve`` (mounted under ``bench`` by the root CLI): workflows through the HTTP API."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, command_line, note, write_json

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(width=None if Console().is_terminal else 160)


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_result(res: dict) -> None:
    t = Table(title=f"bench serve — {res['workflows']} workflows x {res.get('agents', 3)} agents, {res['clients']} clients, "
                    f"~{res['doc_tokens']} document tokens, {res.get('replicas', 1)} replica(s) per model (load: {(res['load_average'] or {}).get('status', '-')})")
    for c in ("strategy", "p50 s", "p99 s", "req/s", "accuracy", "95% CI", "relay hits", "fallbacks", "note"):
        t.add_column(c, justify="left" if c in ("strategy", "fallbacks", "note") else "right")
    for r in res["strategies"]:
        ci = f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]" if r["run"] else "-"
        fb = ", ".join(f"{k} {n}" for k, n in r.get("fallbacks", {}).items()) or "-"
        t.add_row(r["name"], _fmt(r["p50_s"]), _fmt(r["p99_s"]), _fmt(r["throughput_rps"], ".3f"),
                  _fmt(r["accuracy"]), ci, str(r.get("relay_hits", "-")), fb, r.get("reason", ""))
    console.print(t)
    if len(res.get("regimes", [])) > 1:  # each regime on its own
        t = Table(title="by regime: p50 s / accuracy [95% CI]")
        t.add_column("strategy")
        for regime in res["regimes"]:
            t.add_column(regime, justify="right")
        for r in res["strategies"]:
            if r["run"]:
                cells = [(r["by_regime"].get(g) or {}) for g in res["regimes"]]
                t.add_row(r["name"], *(f"{_fmt(c.get('p50_s'))} / {_fmt(c.get('accuracy'))} "
                                       f"[{_fmt(c.get('ci_low'))}, {_fmt(c.get('ci_high'))}]" for c in cells))
        console.print(t)
    console.print(f"scheduler dominated (paired by workflow, beyond the 95% intervals): {res['scheduler_dominated']} "
                  f"(by: {', '.join(res['dominated_by']) or 'none'})")
    console.print(f"on point estimates alone (p50 and accuracy): {res['scheduler_point_dominated']} "
                  f"(by: {', '.join(res['point_dominated_by']) or 'none'})")


@app.command("serve")
def bench_serve_cmd(
    models: str = typer.Option("smollm2-135m,qwen2.5-coder-0.5b", help="the kvrelay pool (comma-separated)"),
    workflows: int = typer.Option(4, help="workflows per strategy and regime (each: reader -> checker -> answerer)"),
    clients: int = typer.Option(2, help="concurrent clients"),
    doc_tokens: int = typer.Option(1024, help="document length of each task (tokens, approximate)"),
    max_tokens: int = typer.Option(24, help="max_tokens of every agent's request"),
    slo: float = typer.Option(60.0, help="the scheduler's per-request latency target (kv_slo_s), seconds"),
    audits: str = typer.Option(None, help="comma-separated kvrelay audit folders for the scheduler's value model "
                               "(kvrelay serve --audits)"),
    strategies: str = typer.Option(",".join(("scheduler", "round_robin", "always_smallest", "always_largest",
                                             "always_text", "transformers_serve", "transformers_serve_prefix_arranged",
                                             "vllm", "vllm_prefix_arranged")),
                                   help="which strategies to run (comma-separated)"),
    seed: int = typer.Option(0, help="task seed"),
    single: bool = typer.Option(False, "--single", help="each workflow is one plain chat request (the document and "
                                "its question, no hand-off): the gateway's own cost against the peers"),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's, one per core)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    batch: bool = typer.Option(False, "--batch", help="kvrelay's replicas answer concurrent requests together "
                               "(kvrelay serve --batch; engine fp32)"),
    replicas: int = typer.Option(1, help="replicas per model in kvrelay's pool (kvrelay serve --replicas); a peer "
                                 "server then gets --threads x --replicas threads"),
    regimes: str = typer.Option("private", help="whose workflows run, comma-separated: private (a generated "
                                "document only the reader sees), shared (ARC-Challenge problems every agent sees); "
                                "--workflows of each, alternating"),
    json_path: Path = typer.Option(None, "--json", help="write the result as JSON"),
):
    """The scheduler against fixed routings, text hand-offs and transformers serve, on the same workflows."""
    from kvrelay.bench.serve import REGIMES, STRATEGIES, ServeBenchConfig, bench_serve

    names = v.csv(models, "--models", "smollm2-135m,qwen2.5-coder-0.5b")
    for n in names:
        v.model(n, "--models")
    chosen = v.names(strategies, "--strategies", STRATEGIES, "scheduler,always_text")
    regime_list = v.names(regimes, "--regimes", REGIMES, "private,shared")  # each once: ServeBenchConfig
    v.positive(workflows, "--workflows")
    v.positive(clients, "--clients")
    v.positive(doc_tokens, "--doc-tokens", minimum=64)
    v.positive(max_tokens, "--max-tokens")
    v.positive(threads, "--threads")
    v.positive(replicas, "--replicas")
    v.engine(engine)
    v.writable_path(json_path, "--json")
    audit_dirs = v.audit_folders(audits)
    if slo <= 0:
        raise v.InvalidInput(f"--slo {slo}", "a positive number of seconds")
    cfg = ServeBenchConfig(models=names, workflows=workflows, clients=clients, doc_tokens=doc_tokens,
                           max_tokens=max_tokens, slo_s=slo, strategies=chosen, seed=seed, threads=threads,
                           engine=engine, audits=audit_dirs, single=single, batch=batch,
                           regimes=regime_list, replicas=replicas)
    res = bench_serve(cfg, progress=note,
                      checkpoint=lambda part: write_json(json_path, part | {"command": command_line()}))
    res["command"] = command_line()
    print_result(res)
    write_json(json_path, res)
