"""The LangGraph example on a tiny model: its handles carry the caches, so each later node prefills
only its own turn, and the graph writes what a text hand-off of the same conversation writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("langgraph")  # in the dev extra, so `make test` runs this

from kvrelay.serve.chat import Message, answer_start_ids, conversation_ids  # noqa: E402
from kvrelay.serve.langgraph import KVRelayNodes  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_review.py"
SOURCE = "def add(a, b):\n    return a - b\n"


def _example():
    spec = importlib.util.spec_from_file_location("langgraph_review", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_graph_nodes_continue_each_others_caches(gateway):
    nodes = KVRelayNodes(gateway["url"], model="tiny:qwen2", max_tokens=8)
    out = _example().build(nodes, SOURCE).invoke({"handle": None, "answers": {}, "trace": []})
    reader, reviewer, fixer = out["trace"]
    assert reader["channel"] == "none" and reader["relayed_tokens"] == 0
    agent = gateway["pool"].pick("tiny:qwen2").agent
    for step, prompt in ((reviewer, "Which function has a bug, and why?"),
                         (fixer, f"The reviewer said: {out['answers']['reviewer']}\nPropose the fix in one sentence.")):
        assert step["channel"] == "kv"
        own = len(conversation_ids(agent, [Message("user", prompt)]) + answer_start_ids(agent))
        assert step["prompt_tokens"] - step["relayed_tokens"] == own  # the node prefilled its own turn only
    assert fixer["relayed_tokens"] > reviewer["relayed_tokens"] > 0
    # the same conversation handed over as text gives the same last answer
    c = gateway["client"]
    history = [{"role": "system", "content": "You are a careful code reviewer."}]
    for name, prompt in (("reader", f"{SOURCE}\n\nSummarize what this code does in one sentence."),
                         ("reviewer", "Which function has a bug, and why?"),
                         ("fixer", f"The reviewer said: {out['answers']['reviewer']}\nPropose the fix in one sentence.")):
        history.append({"role": "user", "content": prompt})
        r = c.chat.completions.create(model="tiny:qwen2", messages=history, max_tokens=8)
        assert r.choices[0].message.content == out["answers"][name]
        history.append({"role": "assistant", "content": r.choices[0].message.content})
