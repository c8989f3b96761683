"""vLLM's CPU build as a peer of ``kvrelay bench engine``: the same token ids through its OpenAI server.

vLLM runs in its own environment (``make peers-vllm``), so it is driven over HTTP on loopback
(``bench.peer_servers``): ``/v1/completions`` with the prompt as token ids (no second tokenization),
greedy, streamed, ``return_token_ids`` to get the answer's ids. It has no cache that crosses processes
here; what it has is automatic prefix caching, so its "relay" is the sender's context already in its
prefix cache when the receiver's request arrives (the same process). Per trial:

* ``text_ttft_s`` — the prefix cache reset (``/reset_prefix_cache``, which needs
  ``VLLM_SERVER_DEV_MODE=1``), context + question cold: time to the first streamed token;
* ``relay_ttft_s`` — reset, the sender's request (the context, one token) untimed, then context +
  question: time to the first token with the context's blocks cached;
* ``decode_s`` / ``decode_tokens`` — from that stream: first token to last (``ignore_eos``).

Times are what a client sees, HTTP and scheduling included (vLLM's own TTFT, the figure its users quote).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from kvrelay.bench.peer_servers import PeerCommand, PeerServer, vllm_serve
from kvrelay.core.errors import PeerUnavailable


class VllmPeer:
    """One vLLM server for the block: ``with VllmPeer(folder, name, threads) as peer: peer.trial(...)``."""

    def __init__(self, folder: Path, name: str, threads: int | None, command: PeerCommand | None = None):
        self.name = name
        self.server = PeerServer(command or vllm_serve(folder, name, threads, dev=True))
        self.url = ""
        self.ready_s = 0.0
        self.version = ""

    def __enter__(self) -> VllmPeer:
        import httpx

        t = time.perf_counter()
        self.url = self.server.__enter__()
        self.ready_s = time.perf_counter() - t
        self.client = httpx.Client(timeout=None)
        self.version = self.client.get(self.url + "/version").json().get("version", "")
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.server.__exit__(*exc)

    def reset(self) -> None:
        r = self.client.post(self.url + "/reset_prefix_cache")
        if r.status_code != 200:
            raise PeerUnavailable(f"vLLM refused /reset_prefix_cache ({r.status_code}): {r.text[:200]}")

    def stream(self, prompt_ids: Sequence[int], max_tokens: int) -> dict:
        """Greedy completion of ``prompt_ids``: first-token time, decode time, the answer's token ids."""
        body = {"model": self.name, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        ids: list[int] = []
        t0 = time.perf_counter()
        first = last = None
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise PeerUnavailable(f"vLLM answered {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                new = choice.get("token_ids") or []
                if new:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    ids += new
        if first is None or len(ids) != max_tokens:
            raise PeerUnavailable(f"vLLM streamed {len(ids)} token(s); expected {max_tokens}")
        return {"ttft_s": first - t0, "decode_s": last - first, "tokens": len(ids), "answer_ids": ids}

    def trial(self, context_ids: Sequence[int], question_ids: Sequence[int], n_new: int) -> dict:
        prompt = list(context_ids) + list(question_ids)
        self.reset()
        text = self.stream(prompt, 1)
        self.reset()
        self.stream(list(context_ids), 1)  # the sender read the context: its blocks are in the prefix cache
        relay = self.stream(prompt, n_new)
        return {"text_ttft_s": text["ttft_s"], "text_prefill_tokens": len(prompt), "relay_ttft_s": relay["ttft_s"],
                "decode_s": relay["decode_s"], "decode_tokens": relay["tokens"], "answer_ids": relay["answer_ids"]}

    def check(self, context_ids: Sequence[int], question_ids: Sequence[int], n_new: int) -> dict:
        """Untimed: the cold answer and the prefix-cached answer are the same tokens."""
        prompt = list(context_ids) + list(question_ids)
        self.reset()
        text_ids = self.stream(prompt, n_new)["answer_ids"]
        relay_ids = self.trial(context_ids, question_ids, n_new)["answer_ids"]
        return {"text_answer_ids": text_ids, "relay_answer_ids": relay_ids, "relay_identical": text_ids == relay_ids}
