"""A client of LMCache's multiprocess server, run by the Python of vLLM's environment (``make peers-vllm``).

Stand-alone on purpose: that environment has vLLM and LMCache but not kvrelay, so this file imports
neither kvrelay nor anything kvrelay depends on beyond torch. It reads one JSON command per line on
stdin and answers one JSON line on stdout (``kvrelay.bench.peers.lmcache_vllm`` drives it):

* ``{"op": "store", "file": F}`` — ``F`` holds ``torch.save({"ids": [...], "chunks": [...]})``, the chunks
  in LMCache's layout of vLLM's CPU cache (``kvrelay.kv.lmcache_chunks``); they are committed under the
  key vLLM's connector looks up (model name, world size 1, worker 0, the tokens from the first) →
  ``{"ok": bool, "tokens": n, "store_s": s}``;
* ``{"op": "fetch", "ids": [...], "file": F}`` — the whole chunks LMCache holds for these tokens (a lookup,
  then a retrieve, as vLLM's connector does) saved to ``F`` → ``{"ok": bool, "chunks": k}``;
* ``{"op": "clear"}`` — drop every stored chunk → ``{"ok": true}``.

The client registers itself as an engine-driven context with the layout vLLM registers for this model
(``argv``: server URL, model name as vLLM keys it — the path it was started with —, layers, KV heads,
head dim, block size), so the server accepts chunks of that shape from it.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
import uuid
from pathlib import Path


def main() -> None:
    here = str(Path(__file__).resolve().parent)  # kvrelay's vllm.py there must not shadow the real vllm
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    import torch
    import zmq
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey, RegisterEngineDrivenContextPayload
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    url, model, layers, heads, head_dim, block = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    cli = RequestClientFactory.create(url, context=zmq.Context.instance())
    chunk = cli.get_chunk_size().result(60)
    me = uuid.uuid4().int & ((1 << 62) - 1)
    cli.register_kv_cache_engine_driven_context(RegisterEngineDrivenContextPayload(
        instance_id=me, model_name=model, world_size=1, block_size=block, num_layers=layers,
        hidden_dim_size=heads * 2 * head_dim, dtype_str="float32", use_mla=True, num_physical_slots=chunk)).result(60)

    def key(ids, end, worker, rid):
        return IPCCacheServerKey(model_name=model, world_size=1, worker_id=worker, token_ids=tuple(ids), start=0,
                                 end=end, request_id=rid, num_kv_readers=1)

    print(json.dumps({"ok": True, "chunk_tokens": chunk}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        rid = f"kvrelay-{uuid.uuid4().hex[:12]}"
        if cmd["op"] == "store":
            t0 = time.perf_counter()
            data = torch.load(cmd["file"])
            n = len(data["chunks"]) * chunk
            k = key(data["ids"][:n], n, 0, rid)
            cli.prepare_store(k, me).result(60)
            ok = bool(cli.commit_store(k, me, pickle.dumps(data["chunks"])).result(120))
            out = {"ok": ok, "tokens": n, "store_s": time.perf_counter() - t0}
        elif cmd["op"] == "fetch":
            ids = cmd["ids"][: len(cmd["ids"]) // chunk * chunk]
            cli.lookup(key(ids, len(ids), None, rid), 1).result(60)
            found = None
            for _ in range(600):
                found = cli.query_prefetch_status(rid).result(60)
                if found is not None:
                    break
                time.sleep(0.05)
            chunks = []
            if found:
                k = key(ids, found * chunk, 0, rid)
                resp = cli.prepare_retrieve(k, me).result(120)
                chunks = pickle.loads(resp.data) if resp.success and resp.data else []
                cli.commit_retrieve(k, me).result(60)
            cli.end_session(rid).result(60)
            torch.save(chunks, cmd["file"])
            out = {"ok": bool(chunks), "chunks": len(chunks)}
        elif cmd["op"] == "clear":
            cli.clear(True).result(60)
            out = {"ok": True}
        else:
            out = {"ok": False, "error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
