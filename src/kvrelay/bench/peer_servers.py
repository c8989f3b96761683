"""OpenAI-compatible servers a benchmark starts beside kvrelay on loopback: the tools users would pick instead.

* ``transformers_serve(folder)`` — ``transformers serve --continuous-batching`` (shipped with the pinned
  transformers), fp32 on the CPU;
* ``vllm_serve(folder)`` — vLLM's CPU build with automatic prefix caching, bf16, from its own virtual
  environment (``make peers-vllm``; ``$KVRELAY_VLLM_PYTHON`` points at another one: ``vllm_python``). vLLM reuses the KV of
  a prompt prefix it has seen token for token, so text hand-offs that extend the previous request reuse it.

``PeerServer`` is the mechanism: start the process, wait until ``/v1/models`` answers (or the process
exits, or ``PEER_START_S`` passes: ``PeerUnavailable`` with the tail of its log), stop it on exit. Its log
goes to a temporary file, not a pipe: a chatty server blocks once a pipe nobody reads is full.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.core.errors import PeerUnavailable

PEER_START_S = 900  # a peer server may take this long to load (and, for vLLM, warm up) on a loaded machine
VLLM_KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: room for a few 4k-token sequences of a small model
VLLM_MAX_MODEL_LEN = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PeerCommand:
    """How to start one peer: its name (for messages), the argv with ``{port}`` where the port goes, extra env."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    ready_path: str = "/v1/models"  # answers 200 once the server is up

    def resolved(self, port: int) -> list[str]:
        return [a.replace("{port}", str(port)) for a in self.argv]


class PeerServer:
    """A peer server on loopback for the block: ``with PeerServer(cmd) as url: ...``."""

    def __init__(self, command: PeerCommand, start_s: float = PEER_START_S):
        self.command, self.start_s = command, start_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")
        self.last_log = ""

    def log_tail(self, n: int = 600) -> str:
        """The end of the server's log (kept after the block: why a peer died is read after it)."""
        if not self.log.closed:
            self.log.flush()
            self.log.seek(0)
            self.last_log = self.log.read()
        return self.last_log[-n:]

    def __enter__(self) -> str:
        import httpx

        self.proc = subprocess.Popen(self.command.resolved(self.port), stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True, env=os.environ | dict(self.command.env))
        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.__exit__()
                raise PeerUnavailable(f"{self.command.name} exited {self.proc.returncode}: {tail}")
            try:
                if httpx.get(self.url + self.command.ready_path, timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__()
        raise PeerUnavailable(f"{self.command.name} did not answer within {self.start_s:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_tail()
        self.log.close()

    def died(self) -> str | None:
        """Why the server is gone (its exit status, a kill by signal -9 is often the kernel's OOM killer), or None."""
        if self.proc is None or self.proc.returncode is None:
            return None
        return f"{self.command.name} exited {self.proc.returncode}" + \
            (" (SIGKILL: out of memory?)" if self.proc.returncode == -9 else "")


def _threads_env(threads: int | None) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads)} if threads else {}


def transformers_serve(folder: Path, threads: int | None) -> PeerCommand:
    exe = Path(sys.executable).with_name("transformers")
    return PeerCommand("transformers serve", (str(exe), "serve", str(folder), "--host", "127.0.0.1", "--port", "{port}",
                                              "--device", "cpu", "--dtype", "float32", "--continuous-batching",
                                              "--log-level", "warning"), _threads_env(threads))


def vllm_python() -> Path:
    """The Python of vLLM's environment: ``$KVRELAY_VLLM_PYTHON``, else where ``make peers-vllm`` puts it."""
    return Path(os.environ.get("KVRELAY_VLLM_PYTHON", Path.home() / ".cache/kvrelay/vllm-venv/bin/python"))


def vllm_available(python: Path | None = None) -> str | None:
    """None when vLLM's environment is there; otherwise why not (the reason a strategy is reported not run)."""
    if not (python or vllm_python()).exists():
        return ("vLLM's CPU build is an optional peer (make peers-vllm); no environment at $KVRELAY_VLLM_PYTHON "
                "(default ~/.cache/kvrelay/vllm-venv/bin/python)")
    return None


def vllm_serve(folder: Path, name: str, threads: int | None, python: Path | None = None,
               dev: bool = False) -> PeerCommand:
    """vLLM's OpenAI server on ``folder`` in bf16 with prefix caching, answering to model ``name``.

    Its ``vllm`` console script does not start in the CPU build's package, so the module is run; the OpenMP
    threads are bound to the first ``threads`` cores (vLLM would otherwise cut torch to one thread).
    ``dev``: also serve vLLM's development endpoints (``/reset_prefix_cache``: a benchmark's cold start)."""
    n = threads or os.cpu_count() or 1
    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
           "OMP_NUM_THREADS": str(n)} | ({"VLLM_SERVER_DEV_MODE": "1"} if dev else {})
    return PeerCommand("vLLM", (str(python or vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                "--served-model-name", name, "--dtype", "bfloat16", "--max-model-len",
                                str(VLLM_MAX_MODEL_LEN), "--enable-prefix-caching", "--host", "127.0.0.1",
                                "--port", "{port}"), env)


def lmcache_available(python: Path | None = None) -> str | None:
    """None when vLLM's environment also has LMCache (its ``lmcache`` command); otherwise why not."""
    missing = vllm_available(python)
    if missing:
        return missing
    if not (python or vllm_python()).with_name("lmcache").exists():
        return ("LMCache is an optional peer in vLLM's environment (make peers-vllm installs it); no lmcache "
                f"command beside {python or vllm_python()}")
    return None


def lmcache_server(zmq_port: int, python: Path | None = None) -> PeerCommand:
    """LMCache's multiprocess cache server (ZMQ on ``zmq_port``; ready when its HTTP ``/healthcheck`` answers)."""
    exe = (python or vllm_python()).with_name("lmcache")
    return PeerCommand("LMCache", (str(exe), "server", "--host", "127.0.0.1", "--port", str(zmq_port),
                                   "--http-host", "127.0.0.1", "--http-port", "{port}", "--chunk-size", "256",
                                   "--l1-size-gb", "2", "--eviction-policy", "LRU", "--supported-transfer-mode",
                                   "auto", "--disable-observability"), {}, "/healthcheck")


def vllm_lmcache_serve(folder: Path, name: str, threads: int | None, zmq_port: int,
                       python: Path | None = None) -> PeerCommand:
    """vLLM's OpenAI server on ``folder`` in fp32 with LMCache's multiprocess connector to ``zmq_port`` and
    no prefix cache of its own (every reuse is LMCache's)."""
    n = threads or os.cpu_count() or 1
    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
           "OMP_NUM_THREADS": str(n)}
    connector = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": zmq_port}}
    return PeerCommand("vLLM+LMCache", (str(python or vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
                                        "--model", str(folder), "--served-model-name", name, "--dtype", "float32",
                                        "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--no-enable-prefix-caching",
                                        "--kv-transfer-config", json.dumps(connector), "--host", "127.0.0.1",
                                        "--port", "{port}"), env)


def prefix_cache_counts(metrics_text: str) -> dict[str, float]:
    """vLLM's prefix-cache counters from its Prometheus ``/metrics`` text: ``{"queries", "hits"}`` in tokens.

    Sums every sample of ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (one per
    engine and model label set). Missing counters are an error: a vLLM without them cannot show its reuse."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            for key in ("queries", "hits"):
                if s.name == f"vllm:prefix_cache_{key}_total":
                    out[key] = out.get(key, 0.0) + s.value
    if set(out) != {"queries", "hits"}:
        raise PeerUnavailable(f"vLLM's /metrics has no prefix-cache counters (found {sorted(out) or 'none'})")
    return out


def model_folder(name: str) -> Path | None:
    """The transformers folder of a zoo model or a model folder (what a peer server loads); None otherwise."""
    from kvrelay.core.paths import home

    for p in (home() / "models" / name / "hf", Path(name).expanduser()):
        if (p / "config.json").is_file():
            return p
    return None
