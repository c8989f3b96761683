"""``kvrelay serve``: the OpenAI-compatible gateway (``kvrelay.serve``; docs/serve.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvrelay.cli import validate as v
from kvrelay.cli.common import DEFAULT_ENGINE, ENGINE_HELP, err_console, quiet_libraries, state

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)


def _phase_uniform(engine: str) -> bool:
    from kvrelay.models.engine import mode

    return mode(engine).phase_uniform


@app.command("serve")
def serve_cmd(
    models: str = typer.Option(..., help="comma-separated models to serve: zoo names, folders, tiny:ARCH, ..."),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="TCP port (0: any free port; the URL is printed)"),
    store: str = typer.Option(None, help="where context handles' caches live: memory://, file:///DIR or "
                              "redis://HOST:PORT/DB (default: a private redis-server for this run)"),
    replicas: int = typer.Option(1, help="replicas per model (each answers one request at a time, or several "
                                 "together with --batch)"),
    handle_ttl: float = typer.Option(600.0, help="seconds a context handle and its cache live"),
    max_tokens: int = typer.Option(128, help="max_tokens of a request that gives none"),
    limit_max_tokens: int = typer.Option(2048, help="the most max_tokens a request may ask for"),
    secret_file: Path = typer.Option(None, help="file with the key that signs handles (default: a random key "
                                     "per run, so handles do not outlive the server)"),
    slo: float = typer.Option(None, help="latency target in seconds for requests to model \"auto\" that give no "
                              "kv_slo_s: among the models predicted to meet it, the scheduler picks the most accurate (with every model "
                              "audited: the one not credibly less accurate that costs the host least, its own seconds plus the delay "
                              "it imposes on busy replicas sharing the host's cores)"),
    audits: str = typer.Option(None, help="comma-separated kvrelay audit folders: the scheduler fits a value model per "
                               "audited model and picks each request's channel with the policy (docs/serve.md)"),
    ray: bool = typer.Option(False, "--ray", help="run each replica as a Ray actor (its own model copy) on a local "
                             "Ray cluster, or on --ray-address; the store must be redis:// or file://"),
    ray_address: str = typer.Option(None, help="an existing Ray cluster to use with --ray (auto, ray://HOST:10001)"),
    threads: int = typer.Option(None, help="torch intra-op threads (default: torch's, one per core; with --ray: "
                                "per actor, default 1)"),
    engine: str = typer.Option(DEFAULT_ENGINE, help=ENGINE_HELP),
    batch: bool = typer.Option(False, "--batch", help="each replica answers concurrent requests together in "
                               "transformers' continuous batching, relayed caches entering as prefix pages "
                               "(engine fp32, models without sliding-window layers; docs/serve.md)"),
):
    """Serve models over an OpenAI-compatible API whose answers return context handles (relayed KV caches)."""
    names = v.csv(models, "--models", "qwen2.5-coder-0.5b,smollm2-135m")
    for n in names:
        v.model(n, "--models")
    v.positive(replicas, "--replicas")
    v.positive(max_tokens, "--max-tokens")
    v.positive(limit_max_tokens, "--limit-max-tokens", minimum=max_tokens)
    v.positive(threads, "--threads")
    v.engine(engine)
    if batch and engine != "auto" and not _phase_uniform(engine):
        raise v.InvalidInput(f"--batch with --engine {engine}", "--engine fp32: a batch of one-token decodes would "
                             "compute with the prefill's weights in a mode that swaps them")
    if handle_ttl <= 0:
        raise v.InvalidInput(f"--handle-ttl {handle_ttl}", "a positive number of seconds")
    if slo is not None and slo <= 0:
        raise v.InvalidInput(f"--slo {slo}", "a positive number of seconds")
    if not 0 <= port <= 65535:
        raise v.InvalidInput(f"--port {port}", "a TCP port in 0..65535")
    audit_dirs = v.audit_folders(audits)
    if secret_file is not None:
        v.existing_file(secret_file, "--secret-file")
    if ray_address is not None and not ray:
        raise v.InvalidInput("--ray-address without --ray", "--ray --ray-address ADDRESS")
    if ray and store is not None and store.startswith("memory://"):
        raise v.InvalidInput(f"--store {store} with --ray", "a store every actor reaches: redis:// or file:///DIR")
    if store is not None:
        from kvrelay.transport.stores import open_store

        open_store(store)  # UnknownStore (one line) before any model loads

    from kvrelay.serve.server import Gateway, ServeConfig

    if state.quiet:
        quiet_libraries()
    config = ServeConfig(models=names, host=host, port=port, store=store, replicas=replicas,
                         handle_ttl_s=handle_ttl, max_tokens=max_tokens, limit_max_tokens=limit_max_tokens,
                         engine=engine, threads=threads, secret_file=secret_file, slo_s=slo, ray=ray,
                         ray_address=ray_address, audits=audit_dirs, batch=batch)
    Gateway(config).run(on_ready=lambda url: err_console.print(f"kvrelay serve: {url}/v1 ({', '.join(names)})"))
