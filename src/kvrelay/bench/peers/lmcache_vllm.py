"""LMCache into vLLM as a receiver of relayed caches: a payload exported as LMCache chunks, and vLLM's
request for the same tokens served from them (``kvrelay bench connector``).

Three processes from vLLM's environment, started once for the benchmark (a server's start is not a
request's): LMCache's multiprocess cache server, vLLM's OpenAI server in fp32 with LMCache's
multiprocess connector and no prefix cache of its own, and ``lmcache_client.py`` — a stand-alone
client of the cache server that stores and fetches chunks (that environment has no kvrelay).
kvrelay packs a payload into chunks (``kv.lmcache_chunks``), hands them to the client through a file,
and the client commits them under the key vLLM's connector looks up; vLLM then loads them into its
paged cache instead of prefilling those tokens. ``fetch`` is the other direction: the chunks vLLM
stored for a prompt, read back as a ``KVPayload``.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvrelay.bench.peer_servers import PeerServer, free_port, lmcache_server, vllm_lmcache_serve, vllm_python
from kvrelay.bench.peers.vllm import VllmPeer
from kvrelay.core.errors import PeerUnavailable
from kvrelay.kv.lmcache_chunks import BLOCK_SIZE, from_chunks, to_chunks
from kvrelay.kv.payload import KVPayload, PayloadMeta

CLIENT = Path(__file__).with_name("lmcache_client.py")


class LmcacheVllm:
    """``with LmcacheVllm(folder, name, threads, identity) as peer:`` — ``clear``, ``store``, ``fetch``, ``stream``."""

    def __init__(self, folder: Path, name: str, threads: int | None, identity):
        self.folder, self.name, self.identity = folder, name, identity
        self.zmq_port = free_port()
        self.cache_server = PeerServer(lmcache_server(self.zmq_port))
        self.vllm = VllmPeer(folder, name, threads, command=vllm_lmcache_serve(folder, name, threads, self.zmq_port))
        self.client: subprocess.Popen | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix="kvrelay-lmcache-")
        self.client_log = tempfile.TemporaryFile(mode="w+")

    def __enter__(self) -> LmcacheVllm:
        self.cache_server.__enter__()
        try:
            self.vllm.__enter__()
            i = self.identity
            self.client = subprocess.Popen(
                [str(vllm_python()), "-P", str(CLIENT), f"tcp://127.0.0.1:{self.zmq_port}", str(self.folder),
                 str(i.num_layers), str(i.num_kv_heads), str(i.head_dim), str(BLOCK_SIZE)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.client_log, text=True)
            self.chunk_tokens = self._answer()["chunk_tokens"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.client is not None and self.client.poll() is None:
            self.client.stdin.close()
            self.client.wait(30)
        self.vllm.__exit__(*exc)
        self.cache_server.__exit__(*exc)
        self.tmp.cleanup()
        self.client_log.close()

    def _answer(self) -> dict:
        line = self.client.stdout.readline()
        if not line:
            self.client_log.seek(0)
            raise PeerUnavailable(f"the LMCache client exited {self.client.poll()}; its log ends: "
                                  f"{self.client_log.read()[-600:]!r}")
        return json.loads(line)

    def _ask(self, cmd: dict) -> dict:
        self.client.stdin.write(json.dumps(cmd) + "\n")
        self.client.stdin.flush()
        out = self._answer()
        if not out.get("ok"):
            raise PeerUnavailable(f"LMCache refused {cmd['op']}: {out}")
        return out

    def clear(self) -> None:
        self._ask({"op": "clear"})

    def store(self, p: KVPayload) -> dict:
        """Export ``p``'s whole chunks into LMCache: ``{"tokens", "pack_s", "store_s"}`` (store: the client's
        load and commit)."""
        t0 = time.perf_counter()
        f = Path(self.tmp.name) / "store.pt"
        torch.save({"ids": p.token_ids[0].tolist(), "chunks": to_chunks(p, self.chunk_tokens)}, f)
        pack_s = time.perf_counter() - t0
        out = self._ask({"op": "store", "file": str(f)})
        return {"tokens": out["tokens"], "pack_s": pack_s, "store_s": out["store_s"]}

    def fetch(self, token_ids: Sequence[int], meta: PayloadMeta) -> KVPayload:
        """The chunks LMCache holds for ``token_ids`` (whole chunks from the first token) as a payload."""
        f = Path(self.tmp.name) / "fetch.pt"
        self._ask({"op": "fetch", "ids": list(token_ids), "file": str(f)})
        return from_chunks(torch.load(f), token_ids, meta, self.identity.num_kv_heads)

    def stream(self, prompt_ids: Sequence[int], max_tokens: int) -> dict:
        return self.vllm.stream(prompt_ids, max_tokens)
