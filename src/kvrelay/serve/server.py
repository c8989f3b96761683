"""Run the gateway: load the pool, open the store, serve HTTP with uvicorn, shut down gracefully.

``ServeConfig`` is everything ``kvrelay serve`` takes. ``Gateway(config).run()`` blocks (the CLI):
SIGINT / SIGTERM stop accepting connections, let open requests finish (at most
``graceful_s``), then the replicas finish their queues and a private Redis stops.
``with Gateway(config) as url:`` serves from a background thread (tests, ``kvrelay bench serve``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.errors import InvalidInput
from kvrelay.serve import handles
from kvrelay.serve.pool import Pool, in_process_pool

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SECRET_BYTES = 16  # at least this many bytes in a --secret-file
BACKLOG = 2048  # pending connections the listening socket holds (uvicorn's default)


@dataclass(frozen=True)
class ServeConfig:
    models: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the URL says which)
    store: str | None = None  # a store URL (transport.stores); None: a private redis-server
    replicas: int = 1
    handle_ttl_s: float = 600.0
    max_tokens: int = 128  # default max_tokens of a request
    limit_max_tokens: int = 2048  # the most a request may ask for
    engine: str = "fp32"
    threads: int | None = None
    secret_file: Path | None = None  # the HMAC key of handles; None: a random one per run
    graceful_s: float = 30.0
    slo_s: float | None = None  # the scheduler's latency target for requests that give no kv_slo_s
    quality: tuple[tuple[str, float], ...] = ()  # measured accuracy per model for the scheduler (else size)
    audits: tuple[Path, ...] = ()  # kvrelay audit folders: the scheduler's value model per audited model
    ray: bool = False  # one Ray actor per replica (serve.ray_pool) instead of threads in this process
    ray_address: str | None = None  # an existing cluster ("auto", "ray://HOST:10001"); None: a local one
    batch: bool = False  # replicas answer concurrent requests together (serve.batcher; engine fp32)

    def __post_init__(self):
        if not self.models:
            raise InvalidInput("no models to serve", "--models M[,M...]")
        if len(set(self.models)) != len(self.models):
            raise InvalidInput(f"--models names a model twice ({', '.join(self.models)})", "distinct models")
        if self.replicas < 1 or self.handle_ttl_s <= 0 or self.max_tokens < 1 or self.limit_max_tokens < self.max_tokens:
            raise InvalidInput("--replicas, --handle-ttl, --max-tokens out of range",
                               "replicas >= 1, a positive TTL, 1 <= max-tokens <= its limit")
        if self.slo_s is not None and self.slo_s <= 0:
            raise InvalidInput(f"--slo {self.slo_s}", "a positive number of seconds")
        unknown = sorted({m for m, _ in self.quality} - set(self.models))
        if unknown:
            raise InvalidInput(f"quality given for {', '.join(unknown)}, which is not served", "served models only")
        if not 0 <= self.port <= 65535:
            raise InvalidInput(f"--port {self.port}", "a TCP port in 0..65535")


def read_secret(path: Path | None) -> bytes:
    if path is None:
        return handles.new_secret()
    data = Path(path).read_bytes().strip()
    if len(data) < SECRET_BYTES:
        raise InvalidInput(f"--secret-file {path} holds {len(data)} bytes", f"at least {SECRET_BYTES} random bytes")
    return data


def load_pool(config: ServeConfig, store, secret: bytes) -> Pool:
    if config.ray:
        from kvrelay.serve.ray_pool import ray_pool

        return ray_pool(config.models, store.url, secret, replicas=config.replicas, engine=config.engine,
                        handle_ttl_s=config.handle_ttl_s, threads=config.threads or 1, batch=config.batch)
    import torch

    from kvrelay.models.loader import load_model

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    models = [(name, load_model(name, engine=config.engine)) for name in config.models]
    return in_process_pool(models, store, secret, replicas=config.replicas, handle_ttl_s=config.handle_ttl_s,
                           batch=config.batch)


class Gateway:
    """A configured server: ``run()`` in the foreground, or ``with Gateway(c) as url`` in a thread."""

    def __init__(self, config: ServeConfig, *, pool: Pool | None = None, store=None, secret: bytes | None = None):
        self.config = config
        self._pool, self._store, self._secret = pool, store, secret
        self.scheduler = None
        self._stack = contextlib.ExitStack()
        self._server = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def _prepare(self):
        import uvicorn

        from kvrelay.serve.app import create_app
        from kvrelay.transport.redis_server import RedisServer
        from kvrelay.transport.stores import open_store

        c = self.config
        secret = self._secret if self._secret is not None else read_secret(c.secret_file)
        store = self._store
        if store is None:
            url = c.store or self._stack.enter_context(RedisServer()).url
            store = open_store(url)
        if c.ray and self._pool is None:
            import ray

            if not ray.is_initialized():
                if c.ray_address:
                    ray.init(address=c.ray_address, log_to_driver=False)
                else:
                    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                             configure_logging=False)
                self._stack.callback(ray.shutdown)
        pool = self._pool if self._pool is not None else load_pool(c, store, secret)
        from kvrelay.serve.scheduler import Scheduler, fit_value_models

        self.scheduler = Scheduler(pool, slo_s=c.slo_s, quality=dict(c.quality) or None,
                                   value=fit_value_models(c.audits) if c.audits else None)
        self.scheduler.calibrate()
        app = create_app(pool, secret, default_max_tokens=c.max_tokens, limit_max_tokens=c.limit_max_tokens,
                         decide=self.scheduler.decide)
        sock = socket.socket(socket.AF_INET6 if ":" in c.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((c.host, c.port))
        sock.listen(BACKLOG)  # connections made once the URL is printed wait here until uvicorn accepts them
        host, port = sock.getsockname()[:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        cfg = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(c.graceful_s),
                             access_log=False, lifespan="on")
        self._server = uvicorn.Server(cfg)
        return sock

    def run(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve until SIGINT or SIGTERM, then shut down gracefully and return (exit status 0)."""
        with self._stack:
            sock = self._prepare()
            if on_ready is not None:
                on_ready(self.url)
            # uvicorn handles the signal, then re-raises it once it has shut down; by then the signal has
            # done its job, so the process returns normally instead of dying of it.
            main = threading.current_thread() is threading.main_thread()
            before = {s: signal.signal(s, lambda *_: None) for s in STOP_SIGNALS} if main else {}
            try:
                self._server.run(sockets=[sock])
            finally:
                for s, h in before.items():
                    signal.signal(s, h)

    def __enter__(self) -> str:
        self._stack.__enter__()
        sock = self._prepare()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting")
            self._thread.join(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._stack.__exit__(*exc)
