"""``kvrelay bench soak``: producer and consumer processes through one store, throughput and latency, every
payload checked (``bench.soak``)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvrelay.cli import validate as v
from kvrelay.cli.common import write_json

app = typer.Typer(pretty_exceptions_enable=False)


@app.command("soak")
def soak_cmd(
    store: str = typer.Option(None, help="redis://HOST:PORT/DB (or file:///DIR); default: a private redis-server "
                              "on loopback"),
    producers: int = typer.Option(2, help="producer processes (1..16)"),
    consumers: int = typer.Option(2, help="consumer processes (1..16)"),
    seconds: float = typer.Option(10.0, help="how long producers put (at most 600)"),
    codec: str = typer.Option("fp16", help="the codec payloads travel under (kv.codecs)"),
    json_path: Path = typer.Option(None, "--json", help="write the figures as JSON"),
) -> None:
    """Real processes through a store on loopback: throughput, p50/p99 put/get latency, zero lost or mixed up."""
    from kvrelay.bench.soak import MAX_PROCS, MAX_SECONDS, run_soak
    from kvrelay.kv import codecs

    for n, flag in ((producers, "--producers"), (consumers, "--consumers")):
        if not 1 <= n <= MAX_PROCS:
            raise v.InvalidInput(f"{flag} {n}", f"an integer in 1..{MAX_PROCS}")
    if not 0 < seconds <= MAX_SECONDS:
        raise v.InvalidInput(f"--seconds {seconds}", f"a number of seconds in (0, {MAX_SECONDS}]")
    if store is not None and (not store.strip() or store.startswith("memory://")):
        raise v.InvalidInput(f"--store {store!r}", "a store other processes can open: redis://HOST:PORT/DB or file:///DIR")
    v.parsed_names(codec, "--codec", codecs.parse, "a codec name (kv.codecs)")
    v.writable_path(json_path, "--json")
    res = run_soak(store, producers=producers, consumers=consumers, seconds=seconds, codec=codec)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"soak: {producers} producers, {consumers} consumers, {seconds:g} s through {res['store']}")
    for col in ("puts", "gets", "lost", "mixed up", "payloads/s", "MB/s", "put p50/p99 ms", "get p50/p99 ms"):
        t.add_column(col)
    t.add_row(str(res["puts"]), str(res["gets"]), str(res["lost"]), str(res["mixed_up"]),
              f"{res['throughput_payloads_per_s']:.1f}", f"{res['throughput_mb_per_s']:.1f}",
              f"{res['put_p50_ms']}/{res['put_p99_ms']}", f"{res['get_p50_ms']}/{res['get_p99_ms']}")
    Console().print(t)
    write_json(json_path, res)
    if res["lost"] or res["mixed_up"]:
        raise typer.Exit(1)
