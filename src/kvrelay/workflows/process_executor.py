"""Every agent its own OS process (``workflows.worker``); payloads travel only through a store URL.

The driver starts one ``python -m kvrelay.workflows.worker`` per agent and talks to each over its
stdin/stdout, one JSON line per request (prompts, token ids, store keys). A sender writes its
whole-turn payload to the store (``file:///DIR`` shared by processes on a machine, or
``redis://HOST:PORT/DB`` reachable from several machines), optionally encoded with a codec; the
receiver reads it back by key and proves it compatible with its own model before use. Nothing
else carries a cache: the pipes carry keys only.

    with ProcessExecutor("tiny:qwen2", wf, store="redis://127.0.0.1:6379/0", codec="int8") as ex:
        trace = run_workflow(ex, wf, context)

``relay_transfer_s`` is the sender's ``put_payload`` + the receiver's ``get_payload``, each timed
inside its own process (so they include the codec and the kvrelay/1 checksums).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrelay.core.errors import StoreError, WorkerError
from kvrelay.kv import codecs
from kvrelay.transport.stores import open_store
from kvrelay.workflows.executors import run_key
from kvrelay.workflows.run import RunTrace, run_workflow
from kvrelay.workflows.spec import Workflow
from kvrelay.workflows.turn import TurnOut
from kvrelay.workflows.worker import STORE_ENV


class _Worker:
    """One worker process and its pipes; ``call`` sends a request and waits for the reply line."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._err = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, bufsize=1, env=env)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log.read_text(errors="replace").strip().splitlines()[-12:]
            raise WorkerError(f"worker exited with status {self.proc.returncode}:\n" + "\n".join(tail))
        return json.loads(line)

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        resp = self.read()
        if "error" in resp:
            err = WorkerError(f"{resp['error']}: {resp['message']}")
            err.kind, err.refused = resp["error"], bool(resp.get("refused"))
            raise err
        return resp

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


class ProcessExecutor:
    """One worker process per agent of ``wf``, started once (``start`` resets their agents per run).

    ``model``: any ``load_model`` name (every worker loads it itself). ``store``: a URL every worker
    can open (not ``memory://``; it reaches the workers through their environment, so a Redis password
never shows in a process list). ``keys_file``: signing keys for every worker (``kv.sign``; without
it the workers read ``$KVRELAY_KEYS``): each signs what it writes and refuses unsigned or wrongly
signed payloads. ``codec``: what senders encode payloads with (``kv.codecs``; default
    the wire default ``WIRE_CODEC``, fp16); it
    travels with each turn request, so ``set_codec`` changes it between runs.
    """

    def __init__(self, model: str, wf: Workflow, *, store: str, codec: str = codecs.WIRE_CODEC, threads: int = 1,
                 engine: str = "fp32", python: str = sys.executable, keys_file: str | os.PathLike | None = None):
        if str(store).startswith("memory://"):
            raise ValueError(f"store {store!r} lives in one process; worker processes need file:///DIR or "
                             "redis://HOST:PORT/DB")
        self.store_url, self.codec = str(store), codecs.parse(codec).name
        self.store = open_store(self.store_url)  # the driver deletes payloads nobody needs any more
        self._logs = tempfile.TemporaryDirectory(prefix="kvrelay-workers-")
        self.workers: dict[str, _Worker] = {}
        try:
            for a in wf.agents:
                cmd = [python, "-m", "kvrelay.workflows.worker", "--model", model, "--name", a.name, "--role", a.role,
                       "--max-new-tokens", str(a.max_new_tokens), "--threads", str(threads), "--engine", engine]
                cmd += ["--keys-file", str(keys_file)] if keys_file is not None else []
                env = {**os.environ, STORE_ENV: self.store_url}  # the URL may hold a password: not in argv
                self.workers[a.name] = _Worker(cmd, Path(self._logs.name) / f"{a.name}.log", env)
            ready = {name: w.read() for name, w in self.workers.items()}  # they load their models in parallel
        except BaseException:
            self.close()
            raise
        fps = {r["fingerprint"] for r in ready.values()}
        if len(fps) != 1:
            self.close()
            raise WorkerError(f"workers loaded different models (fingerprints {sorted(fps)}); relay needs one model")
        self.fingerprint = fps.pop()
        self.pids = {name: r["pid"] for name, r in ready.items()}
        self.wf, self.run_id = wf, ""
        self.unreleased: list[str] = []

    def set_codec(self, codec: str) -> None:
        self.codec = codecs.parse(codec).name

    def start(self, wf: Workflow) -> None:
        if [a.name for a in wf.agents] != list(self.workers):
            raise ValueError(f"these workers run agents {list(self.workers)}, not {[a.name for a in wf.agents]}")
        for name, w in self.workers.items():
            spec = wf.verify_for(name)
            w.call({"op": "reset", "verify": None if spec is None else
                    {"k": spec.k, "full": spec.full, "seed": spec.seed, "codec": self.codec},
                    "max_bytes": wf.agent(name).max_bytes})
        self.run_id = secrets.token_hex(6)

    def context_ids(self, agent: str, context: str) -> list[int]:
        return self.workers[agent].call({"op": "context_ids", "context": context})["ids"]

    def turn(self, agent: str, prompt: str, base: Sequence[int], cache: Any, *, layout: str, max_new_tokens: int,
             min_new_tokens: int, want_payload: bool) -> TurnOut:
        resp = self.workers[agent].call({
            "op": "turn", "prompt": prompt, "base": list(base), "cache": cache, "layout": layout,
            "max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens, "want_payload": want_payload,
            "out_key": run_key(self.run_id, agent), "codec": self.codec})
        return TurnOut.from_json(resp["turn"], payload=resp["payload"])

    def release(self, handle: Any) -> None:
        """Delete a payload nobody needs; a store that cannot be reached does not stop the run (the key is
        kept in ``unreleased``; a TTL or ``clear`` frees it later)."""
        if isinstance(handle, str):
            try:
                self.store.delete(handle)
            except StoreError:
                self.unreleased.append(handle)

    def run(self, context: str, *, mode: str = "kv") -> RunTrace:
        return run_workflow(self, self.wf, context, mode=mode)

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self.workers = {}
        self._logs.cleanup()
        if hasattr(self.store, "close"):
            self.store.close()

    def __enter__(self) -> ProcessExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
