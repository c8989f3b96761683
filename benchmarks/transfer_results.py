"""Render a `kvrelay bench transfer --json` file as the markdown tables kept beside it.

    .venv/bin/python benchmarks/transfer_results.py docs/bench/transfer_qwen2.5-coder-0.5b.json

writes ``docs/bench/transfer_qwen2.5-coder-0.5b.md`` (same name, ``.md``). Nothing here runs a model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _f(x: float, d: int = 3) -> str:
    return f"{x:.{d}f}"


def _overhead(d: dict, ctx: int) -> list[str]:
    out = [f"## Relay overhead vs the prefill it saves ({ctx} tokens)", "",
           "| store | codec | payload MB | ratio vs fp32 | encode s | put s | get s | decode s | overhead s | "
           "saved prefill s | overhead % |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in d["rows"] if r["context_tokens"] == ctx):
        out.append(f"| {r['store']} | {r['codec']} | {r['payload_bytes'] / 1e6:.1f} | {r['compression_ratio']:.2f} | "
                   f"{_f(r['encode_s'])} | {_f(r['put_s'])} | {_f(r['get_s'])} | {_f(r['decode_s'])} | "
                   f"{_f(r['overhead_s'])} | {r['saved_prefill_s']:.1f} | {100 * r['overhead_fraction']:.2f} |")
    return out


def _measured(b: dict) -> str:
    m = b["measured"]
    if m.get("bound") == "between":
        lo, hi = m["rates_mbit"]
        return f"{b['measured_mbps']:.1f} (between {lo:g} and {hi:g})"
    if m.get("bound") == "below":
        return f"< {m['lowest_rate_mbit']:g} (kv faster at every measured rate)"
    return f"{b['measured_mbps']:.1f}" if b.get("measured_mbps") is not None else str(m)


def render(d: dict, json_name: str) -> str:
    la = d.get("load_average")
    lines = [f"# bench transfer — {d['model']}", "",
             f"Command: `{d['command']}` (medians of {d['repeats']} interleaved repeats, {d['threads']} torch "
             f"threads, engine {d['engine']}; 1-min load average at the end "
             f"{la[0] if isinstance(la, list) else la:.1f}; it counts jobs niced to 19 that shared the cores). Raw JSON: `{json_name}`.", ""]
    for ctx in sorted({r["context_tokens"] for r in d["rows"]}, reverse=True)[:1]:
        lines += _overhead(d, ctx) + ["", "Other sizes are in the JSON.", ""]
    lines += ["## Break-even bandwidth (below it, sending text and re-prefilling is faster)", "",
              "| codec | context | measured Mbit/s | closed form Mbit/s |", "|---|---:|---:|---:|"]
    lines += [f"| {b['codec']} | {b['context_tokens']} | {_measured(b)} | {b['closed_form_mbps']:.1f} |"
              for b in d["break_even"]]
    lines += ["", f"`break_even_mbps` = **{d['break_even_mbps']:.1f} Mbit/s** ({d['break_even_basis']}).", "",
              "## End to end at the receiver over the emulated link", "",
              "| context | rate Mbit/s | codec | transfer s | kv s | text s | faster |", "|---:|---:|---|---:|---:|---:|---|"]
    lines += [f"| {r['context_tokens']} | {r['rate_mbit']:g} | {r['codec']} | {r['transfer_s']:.2f} | {r['kv_s']:.2f} | "
              f"{r['text_s']:.2f} | {'kv' if r['kv_faster'] else 'text'} |" for r in d["links"]]
    lines += ["", f"Link: {d['link_note']}.", ""]
    p = d.get("pipeline_over_link")
    if p:
        lines += [f"## Pipeline across the link ({p['method']})", "",
                  f"`{p['workflow']}` at {p['context_tokens']} context tokens, {p['hand_offs']} kv hand-offs "
                  f"({p['relay_bytes'] / 1e6:.0f} MB in all), in-process speedup {p['in_process_speedup']:.2f}x:", "",
                  "| rate Mbit/s | speedup vs text |", "|---:|---:|"]
        lines += [f"| {r['rate_mbit']:g} | {r['speedup']:.2f}x |" for r in p["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    a = ap.parse_args()
    out = a.json.with_suffix(".md")
    out.write_text(render(json.loads(a.json.read_text()), a.json.name))
    print(out)


if __name__ == "__main__":
    main()
