"""A LangGraph code review whose nodes hand each other KV caches through ``kvrelay serve``.

    kvrelay serve --models qwen2.5-coder-0.5b --port 8000 &
    python examples/langgraph_review.py http://127.0.0.1:8000 qwen2.5-coder-0.5b FILE.py

reader -> reviewer -> fixer: the reader reads the file; the reviewer and the fixer send only their
own question, continuing the previous node's cache (its handle travels in the graph state).
Needs ``pip install 'kvrelay[serve,langgraph]'``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from langgraph.graph import END, START, StateGraph

from kvrelay.serve.langgraph import KVRelayNodes, RelayState


def build(nodes: KVRelayNodes, source: str):
    g = StateGraph(RelayState)
    g.add_node("reader", nodes.node("reader", f"{source}\n\nSummarize what this code does in one sentence.",
                                    system="You are a careful code reviewer."))
    g.add_node("reviewer", nodes.node("reviewer", "Which function has a bug, and why?"))
    g.add_node("fixer", nodes.node("fixer", lambda s: f"The reviewer said: {s['answers']['reviewer']}\n"
                                                      "Propose the fix in one sentence."))
    g.add_edge(START, "reader")
    g.add_edge("reader", "reviewer")
    g.add_edge("reviewer", "fixer")
    g.add_edge("fixer", END)
    return g.compile()


def main(url: str, model: str, path: str) -> None:
    nodes = KVRelayNodes(url, model=model, max_tokens=64)
    out = build(nodes, Path(path).read_text()).invoke({"handle": None, "answers": {}, "trace": []})
    for step in out["trace"]:
        print(f"{step['node']:>8}: {step['channel']:>4}  prompt {step['prompt_tokens']} tokens, "
              f"{step['relayed_tokens']} relayed")
    for name, answer in out["answers"].items():
        print(f"\n[{name}] {answer}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
