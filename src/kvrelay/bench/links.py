"""Links and break-even bandwidth for ``bench transfer``: a codec's bytes across an emulated,
rate-limited link (``transport.netem``), and the bandwidth below which relaying text is faster.

The break-even is *measured* by interpolating ``kv − text`` linearly in 1/rate between the two
measured rates around the sign change, and given in *closed form* as
``8 (payload_bytes − text_bytes) / (text fixed costs − kv fixed costs)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.kv import codecs
from kvrelay.kv.wire import pack_parts
from kvrelay.policy.cost import closed_form_break_even_mbps  # noqa: F401 - the one closed form, re-exported here


def wire_parts(c: codecs.Compressed) -> list:
    """The kvrelay/1 bytes of a codec's output, as the zero-copy parts a link or store sends."""
    return pack_parts(*c.to_wire())


@dataclass(frozen=True, slots=True)
class LinkRow:
    codec: str
    context_tokens: int
    rate_mbit: float
    payload_bytes: int
    text_bytes: int
    transfer_s: float  # payload over the link, measured
    text_transfer_s: float  # the context text over the link, measured
    goodput_mbit: float  # payload bits / transfer_s
    kv_s: float  # end to end at the receiver, see the module docstring
    text_s: float
    kv_faster: bool


def measured_break_even_mbps(rates: list[float], kv_s: list[float], text_s: list[float]) -> dict:
    """Where ``kv − text`` changes sign, interpolated linearly in 1/rate (transfer time ∝ 1/rate).

    Returns ``{"mbps": float | None, "bound": "between" | "below" | "above"}``: "below" = kv was
    faster at every measured rate (break-even under the lowest), "above" = text always faster."""
    pts = sorted(zip(rates, (k - t for k, t in zip(kv_s, text_s, strict=True)), strict=True))
    if not pts:
        return {"mbps": None, "bound": "none"}
    if all(d < 0 for _, d in pts):
        return {"mbps": None, "bound": "below", "lowest_rate_mbit": pts[0][0]}
    if all(d >= 0 for _, d in pts):
        return {"mbps": None, "bound": "above", "highest_rate_mbit": pts[-1][0]}
    for (r1, d1), (r2, d2) in zip(pts, pts[1:], strict=False):
        if d1 >= 0 > d2:  # text faster at r1, kv faster at r2
            x1, x2 = 1.0 / r1, 1.0 / r2
            x = x1 + (0.0 - d1) * (x2 - x1) / (d2 - d1)
            return {"mbps": 1.0 / x, "bound": "between", "rates_mbit": [r1, r2]}
    return {"mbps": None, "bound": "non-monotonic"}


def break_evens(codec_rows: list[dict], links: list[LinkRow]) -> list[dict]:
    out = []
    for cr in codec_rows:
        mine = [lr for lr in links if lr.codec == cr["codec"] and lr.context_tokens == cr["context_tokens"]]
        meas = measured_break_even_mbps([lr.rate_mbit for lr in mine], [lr.kv_s for lr in mine],
                                        [lr.text_s for lr in mine]) if mine else {"mbps": None, "bound": "skipped"}
        out.append({"codec": cr["codec"], "context_tokens": cr["context_tokens"], "measured_mbps": meas["mbps"],
                    "measured": meas, "closed_form_mbps": closed_form_break_even_mbps(
                        cr["payload_bytes"], cr["text_bytes"], cr["text_fixed_s"], cr["kv_fixed_s"])})
    return out


def bench_links(per_size: dict, codec_rows: list[dict], rates, say, bracket=("raw",),
                 max_transfer_s: float = 300.0) -> tuple[list[LinkRow], str]:
    """Every codec at every rate in ``rates``; the ``bracket`` codecs also at half and twice their
    closed-form break-even (when that is not near a listed rate and the send takes <= ``max_transfer_s``)."""
    from kvrelay.transport import netem

    ok, why = netem.available()
    if not ok:
        return [], f"link emulation skipped: {why}"
    out = []
    fixed = {(cr["codec"], cr["context_tokens"]): cr for cr in codec_rows}
    plan = [(rate, n, name) for rate in rates for n, (comps, _) in per_size.items() for name in comps]
    for n, (comps, _) in per_size.items():  # rates around the closed-form break-even, so it is bracketed
        for name in comps:
            if name not in bracket:
                continue
            cr = fixed[(name, n)]
            cf = closed_form_break_even_mbps(cr["payload_bytes"], cr["text_bytes"], cr["text_fixed_s"], cr["kv_fixed_s"])
            for r in (cf / 2, cf * 2):
                slow = 8 * cr["payload_bytes"] / (r * 1e6) if 0 < r < float("inf") else float("inf")
                near = any(abs(r - x) / x < 0.25 for x in rates) if slow < float("inf") else True
                if not near and slow <= max_transfer_s:
                    plan.append((round(r, 3), n, name))
    with netem.Link() as link:
        for rate in sorted({p[0] for p in plan}):
            link.set_rate(rate)
            for n, (comps, text) in per_size.items():
                todo = [name for r, m, name in plan if r == rate and m == n]
                if not todo:
                    continue
                t_text = link.send(text)
                for name in todo:
                    parts = wire_parts(comps[name])
                    nb = sum(memoryview(p).nbytes for p in parts)
                    say(f"link {rate:g} Mbit/s: {name} at {n} tokens ({nb / 1e6:.1f} MB)")
                    t = link.send(parts)
                    cr = fixed[(name, n)]
                    kv_s, text_s = cr["kv_fixed_s"] + t, cr["text_fixed_s"] + t_text
                    out.append(LinkRow(codec=name, context_tokens=n, rate_mbit=rate, payload_bytes=nb,
                                       text_bytes=len(text), transfer_s=t, text_transfer_s=t_text,
                                       goodput_mbit=8 * nb / t / 1e6, kv_s=kv_s, text_s=text_s, kv_faster=kv_s < text_s))
    note = (f"veth pair between namespaces {link.ns_a} and {link.ns_b} (10.201.0.1/30 -> 10.201.0.2/30), "
            "tc tbf on the sender's egress; no propagation delay (netem unavailable)")
    return out, note


def headline(breaks: list[dict]) -> dict:
    """The figure for the contract field: raw payload at the largest context, measured if possible."""
    raw = [b for b in breaks if codecs.parse(b["codec"]).lossless]
    if not raw:
        return {"mbps": None, "basis": "no raw codec measured"}
    b = max(raw, key=lambda x: x["context_tokens"])
    if b["measured_mbps"] is not None:
        return {"mbps": b["measured_mbps"], "basis": f"measured, raw payload, {b['context_tokens']} tokens"}
    return {"mbps": b["closed_form_mbps"], "basis": f"closed form, raw payload, {b['context_tokens']} tokens "
                                                    f"(measured: {b['measured']['bound']})"}


def pipeline_over_link(pipeline: dict, res: dict) -> dict:
    """A measured in-process ``bench pipeline`` result re-costed with every kv hand-off crossing each
    measured link: + wire pack/unpack (this run's raw throughput) + transfer at the measured goodput.
    Text hand-offs send the same tokens as text (bytes per token from this run). Computed, not run."""
    raw_codecs = [c for c in res["codecs"] if codecs.parse(c["codec"]).lossless]
    big = max(raw_codecs, key=lambda c: c["context_tokens"])
    wire_s_per_byte = (big["pack_s"] + big["unpack_s"]) / big["payload_bytes"]
    text_bytes_per_token = big["text_bytes"] / big["context_tokens"]
    out = []
    for rate in sorted({lr["rate_mbit"] for lr in res["links"]}):
        lr = max((x for x in res["links"] if x["rate_mbit"] == rate and codecs.parse(x["codec"]).lossless),
                 key=lambda x: x["payload_bytes"])
        goodput = lr["goodput_mbit"] * 1e6 / 8  # bytes/s
        text_goodput = max(lr["text_bytes"] / lr["text_transfer_s"], 1.0)
        kv_extra = sum(a["kv_relay_bytes"] * wire_s_per_byte + a["kv_relay_bytes"] / goodput
                       for a in pipeline["per_agent"] if a["kv_relay_bytes"])
        text_extra = sum(a["kv_relayed_tokens"] * text_bytes_per_token / text_goodput
                         for a in pipeline["per_agent"] if a["kv_relay_bytes"])
        kv_s, text_s = pipeline["kv_s"] + kv_extra, pipeline["text_s"] + text_extra
        out.append({"rate_mbit": rate, "goodput_mbit": lr["goodput_mbit"], "text_s": text_s, "kv_s": kv_s,
                    "speedup": text_s / kv_s})
    return {"method": "computed: measured in-process pipeline + measured link goodput and wire costs per hand-off",
            "workflow": pipeline.get("workflow"), "context_tokens": pipeline.get("context_tokens"),
            "model": pipeline.get("model"), "in_process_speedup": pipeline["speedup"],
            "hand_offs": sum(1 for a in pipeline["per_agent"] if a["kv_relay_bytes"]),
            "relay_bytes": sum(a["kv_relay_bytes"] for a in pipeline["per_agent"]), "rows": out}
