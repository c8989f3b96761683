"""A private ``redis-server`` for commands and tests that were given no ``--redis-url``.

It listens on a free loopback port (redis has no ``--port 0``, so a port is picked by binding a
socket, then handed over; a lost race is retried), keeps nothing on disk (``--save ''
--appendonly no``, a temporary ``--dir``), and is stopped when the ``with`` block ends.

``persist=True`` keeps an append-only file in that folder, written through on every command
(``--appendonly yes --appendfsync always``): ``kill()`` (SIGKILL, a crash) then ``start()`` brings the
server back on the same port with what it held. Without it a restarted server is empty.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvrelay.core.errors import KVRelayError

INSTALL_HINT = "install it with `apt-get install redis-server` (Debian/Ubuntu) or pass --redis-url"


class RedisServerError(KVRelayError):
    """``redis-server`` is missing or did not start."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """``with RedisServer() as srv: RedisStore(srv.url)`` — a throwaway server on 127.0.0.1."""

    def __init__(self, *, executable: str | None = None, host: str = "127.0.0.1", startup_timeout_s: float = 10.0,
                 persist: bool = False):
        self.executable = executable or shutil.which("redis-server")
        if self.executable is None:
            raise RedisServerError(f"redis-server was not found on PATH; {INSTALL_HINT}")
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.persist = persist
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not running; use it as a context manager or call start()")
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server; after ``kill()``, on the same port and folder (with its data when ``persist``)."""
        if self._proc is not None:
            return self
        restart = self.port is not None
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvrelay-redis-"))
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        last = ""
        for _ in range(1 if restart else 3):  # another process may grab the port between our bind and redis'
            port = self.port if restart else free_port(self.host)
            log = self._dir / f"redis-{port}.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [self.executable, "--port", str(port), "--bind", self.host, "--save", "", *aof,
                     "--dir", str(self._dir), "--daemonize", "no", "--protected-mode", "yes"],
                    stdout=out, stderr=subprocess.STDOUT)
            if self._wait_ready(proc, port):
                self._proc, self.port = proc, port
                return self
            _terminate(proc)
            last = log.read_text(errors="replace")[-2000:]
        self.stop()
        raise RedisServerError(f"redis-server did not start on {self.host}; its log ends with:\n{last}")

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing flushed beyond what ``persist`` wrote already); its port and
        folder are kept for ``start()``."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _wait_ready(self, proc: subprocess.Popen, port: int) -> bool:
        import redis

        client = redis.Redis(host=self.host, port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
                except redis.ResponseError:  # loading / busy: not ready yet
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is not None:
            _terminate(self._proc)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.port = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def redis_url_or_private(url: str | None) -> Iterator[str]:
    """For commands taking ``--redis-url``: use it when given, else run a private server for the block."""
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url
