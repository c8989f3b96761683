"""LangGraph nodes that talk to ``kvrelay serve`` and hand context handles along edges, not text.

A node built by ``KVRelayNodes.node`` sends only its own turn, plus the handle the previous node
left in the graph state (``kv_context``), and leaves its answer's handle for the next node; the
server continues the relayed cache, so a node prefills its own turn only. The state is a plain
mapping (``RelayState``): ``handle`` — the last turn's handle (None before the first node);
``answers`` — each node's answer by name; ``trace`` — per node what the server did (model, channel,
prompt and relayed tokens). Nodes are plain functions of the state, so any LangGraph
``StateGraph(RelayState)`` can use them (``examples/langgraph_review.py``; the ``langgraph`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypedDict

Prompt = str | Callable[[Mapping[str, Any]], str]


class RelayState(TypedDict, total=False):
    handle: str | None
    answers: dict[str, str]
    trace: list[dict]


class KVRelayNodes:
    """Node factory for one ``kvrelay serve`` URL (``http://HOST:PORT``)."""

    def __init__(self, base_url: str, *, model: str = "auto", max_tokens: int = 64, timeout: float | None = 300.0):
        import httpx

        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model, self.max_tokens = model, max_tokens
        self.client = httpx.Client(timeout=timeout)

    def node(self, name: str, prompt: Prompt, *, system: str | None = None,
             model: str | None = None) -> Callable[[Mapping[str, Any]], dict]:
        """A node that answers ``prompt`` (text, or a function of the state) continuing the state's handle.

        ``system`` is sent only when there is no handle yet (a continued cache already holds one).
        """

        def run(state: Mapping[str, Any]) -> dict:
            text = prompt(state) if callable(prompt) else prompt
            handle = state.get("handle")
            msgs = ([{"role": "system", "content": system}] if system and not handle else [])
            body = {"model": model or self.model, "max_tokens": self.max_tokens, "temperature": 0,
                    "messages": msgs + [{"role": "user", "content": text}]}
            if handle:
                body["kv_context"] = [handle]
            r = self.client.post(self.base_url + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"kvrelay serve answered {r.status_code} to node {name!r}: {r.text[:300]}")
            out = r.json()
            ext = out.get("kvrelay", {})
            answer = out["choices"][0]["message"]["content"] or ""
            step = {"node": name, "model": out["model"], "prompt_tokens": out["usage"]["prompt_tokens"],
                    "relayed_tokens": ext.get("relayed_tokens", 0),
                    "channel": ext["context"][0]["channel"] if ext.get("context") else "none"}
            return {"handle": ext.get("handle"), "answers": {**state.get("answers", {}), name: answer},
                    "trace": [*state.get("trace", []), step]}

        return run

    def close(self) -> None:
        self.client.close()
