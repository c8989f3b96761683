"""``kvrelay doctor models A B``: two models' configs side by side, and what relay from A to B needs.

A is the sender (sharer), B the receiver. The need is the first of these that holds:

* ``exact``     — same weights, tokenizer and engine mode: B uses A's cache as is;
* ``engine``    — same weights in another engine mode (``models.engine``): near-compatible, accepted
  explicitly with ``fuse.engine.AcceptEngines``; the drift it costs is measured here;
* ``head map``  — same geometry but for a multiple of A's KV heads (``fuse.adapter.HeadMapAdapter``);
  it is exact only when B's K/V projections repeat A's, which is measured (B's own cache of a probe
  against A's cache through the head map);
* ``variant``   — same geometry and tokenizer, weights a fine-tune apart (relative weight distance
  under ``VARIANT_DISTANCE``): a sibling's cache, used raw or through a recompute repair
  (docs/repair.md, the audit's ``kv_variant:V:REPAIR`` arms);
* ``adapter``   — a fitted adapter artefact for exactly this pair under ``artefacts/fuse/``, named with
  its held-out figures;
* ``impossible`` — none of these: the differing fields say why, and how to fit an adapter.
"""

from __future__ import annotations

import json

import torch

from kvrelay.bench.doctor import Check, Report
from kvrelay.models.loader import model_facts

VARIANT_DISTANCE = 0.25  # ||W_A - W_B|| / ||W_A|| below this: a fine-tune of one base, not another model
EXACT_REL = 1e-4  # relative K/V error under which a head map counts as exact
PROBE = ("the report says the key to the vault is blue seven and the bug is in the function check at line four "
         "the fix is to read the file and write the answer")

ROWS = ("arch", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size", "layer_types",
        "sliding_window", "rope", "tokenizer", "vocab_size", "dtype", "engine", "fingerprint")


def config_rows(lm) -> dict[str, str | int | None]:
    """The facts of ``lm`` the side-by-side table shows, one value per ``ROWS`` entry."""
    f = model_facts(lm)
    cfg = lm.model.config.get_text_config(decoder=True)
    rope = "; ".join(f"{r['layer_type'].removesuffix('_attention')}: {r['rope_type']} θ={r['theta']:g}"
                     if r["theta"] is not None else f"{r['layer_type'].removesuffix('_attention')}: {r['rope_type']}"
                     for r in f["rope"])
    types = ", ".join(f"{n}×{t.removesuffix('_attention')}" for t, n in f["layer_type_counts"].items())
    return {"arch": f["arch"], "num_layers": f["num_layers"], "num_attention_heads": cfg.num_attention_heads,
            "num_kv_heads": f["num_kv_heads"], "head_dim": f["head_dim"], "hidden_size": cfg.hidden_size,
            "layer_types": types, "sliding_window": f["sliding_window"], "rope": rope,
            "tokenizer": f["tokenizer_hash"][:12], "vocab_size": f["vocab_size"], "dtype": f["dtype"],
            "engine": f["engine"], "fingerprint": f["fingerprint"][:12]}


def weight_distance(a, b) -> float | None:
    """``||W_a - W_b|| / ||W_a||`` over the parameters both models have with the same name and shape;
    None when they share none (different architectures)."""
    sb = dict(b.model.named_parameters())
    num = den = 0.0
    shared = 0
    with torch.no_grad():
        for name, p in a.model.named_parameters():
            q = sb.get(name)
            if q is None or q.shape != p.shape:
                continue
            shared += 1
            num += float((p.float() - q.float()).pow(2).sum())
            den += float(p.float().pow(2).sum())
    return (num / den) ** 0.5 if shared and den > 0 else None


def _same_geometry(a, b, *, heads: bool) -> list[str]:
    """Identity fields that differ between ``a`` and ``b`` (KV heads only when ``heads``)."""
    ia, ib = a.identity, b.identity
    fields = ["tokenizer_hash", "num_layers", "head_dim", "layer_types", "sliding_window"]
    diff = [f for f in ("arch", *fields) if getattr(ia, f) != getattr(ib, f)]
    if tuple(r.inv_freq for r in ia.rope) != tuple(r.inv_freq for r in ib.rope):
        diff.append("rope")
    if heads and ia.num_kv_heads != ib.num_kv_heads:
        diff.append("num_kv_heads")
    return diff


def head_map_error(a, b) -> float:
    """Relative K/V error of A's probe cache through ``HeadMapAdapter`` against B's own cache of the same tokens."""
    from kvrelay.agents.agent import Agent
    from kvrelay.fuse.adapter import HeadMapAdapter

    sent = Agent(a, "sender").prefill(a.tokenizer(PROBE, add_special_tokens=False)["input_ids"])
    mapped = HeadMapAdapter(a.identity, b.identity).adapt(sent, b.identity)
    own = Agent(b, "receiver").prefill(sent.token_ids[0].tolist())
    return relative_error(mapped, own)


def relative_error(p, q) -> float:
    """``||K_p - K_q, V_p - V_q|| / ||K_q, V_q||`` over every layer (same shapes)."""
    num = den = 0.0
    for x, y in zip((*p.keys, *p.values), (*q.keys, *q.values), strict=True):
        num += float((x.float() - y.float()).pow(2).sum())
        den += float(y.float().pow(2).sum())
    return (num / max(den, 1e-30)) ** 0.5


def adapters_for(sender_fingerprint: str, receiver_fingerprint: str) -> list[dict]:
    """Committed adapter artefacts fitted for exactly this pair of weights, with their held-out figures."""
    from kvrelay.fuse import artefact

    root = artefact.root()
    out = []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        cfg_path = folder / artefact.CONFIG
        if not cfg_path.is_file():
            continue
        try:
            cfg = artefact.ArtefactConfig.from_json(cfg_path.read_text())
        except (ValueError, json.JSONDecodeError):
            continue
        if cfg.receiver.fingerprint == receiver_fingerprint and cfg.sharer.fingerprint == sender_fingerprint:
            out.append({"name": folder.name, "method": cfg.method, "held_out": held_out_figures(cfg.metrics)})
    return out


def held_out_figures(metrics: dict) -> str:
    """The artefact's own held-out figures in one phrase (ridge/layers: mean R² of K and V; fuser: loss)."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    if "held_out_loss" in metrics:
        base = metrics.get("held_out_loss_receiver")
        vs = f" (receiver alone {base:.3f})" if base is not None else ""
        return f"held-out answer loss {metrics['held_out_loss']:.3f}{vs}"
    for k, v in (("r2_k", "r2_v"), ("ridge_r2_k", "ridge_r2_v")):
        if k in metrics:
            return f"held-out R² K {mean(metrics[k]):.3f}, V {mean(metrics[v]):.3f} (mean over layers)"
    return "no held-out figures recorded"


def relay_need(sender, receiver) -> Check:
    """What relay from ``sender`` to ``receiver`` needs, as a check: ``value`` is the need (module docstring),
    ``passed`` is False only when it is ``impossible``."""
    ia, ib = sender.identity, receiver.identity
    if ia.fingerprint == ib.fingerprint and ia.tokenizer_hash == ib.tokenizer_hash:
        if ia.engine == ib.engine:
            return Check("relay", True, "exact", "same weights, tokenizer and engine mode: the cache is used as is")
        from kvrelay.fuse.engine import engine_drift

        ids = sender.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        d = engine_drift(sender, receiver, ids)
        return Check("relay", True, "engine",
                     f"same weights in engine modes {ia.engine} and {ib.engine}: near-compatible; accept it with "
                     f"kvrelay.fuse.engine.AcceptEngines(({ia.engine!r},)) — measured drift: max |ΔK/V| "
                     f"{d.max_abs_kv:.2g}, relative {d.rel_kv:.2g}, max |Δlogit| {d.max_abs_logit:.2g}", "engine")
    diff = _same_geometry(sender, receiver, heads=False)
    if not diff and ia.num_kv_heads != ib.num_kv_heads and ib.num_kv_heads % ia.num_kv_heads == 0:
        err = head_map_error(sender, receiver)
        if err < EXACT_REL:
            return Check("relay", True, "head map",
                         f"{ia.num_kv_heads} -> {ib.num_kv_heads} KV heads, all else equal: "
                         f"kvrelay.fuse.adapter.HeadMapAdapter is exact here (relative K/V error {err:.1g})",
                         "geometry")
        diff.append(f"weights (a head map leaves relative K/V error {err:.2f})")
    if not diff and ia.num_kv_heads == ib.num_kv_heads:
        dist = weight_distance(sender, receiver)
        if dist is not None and dist < VARIANT_DISTANCE:
            return Check("relay", True, "variant",
                         f"same geometry and tokenizer, weights {dist:.1%} apart: a fine-tune of one base; use the "
                         "sibling's cache raw or through a recompute repair (docs/repair.md; audit arms "
                         "kv_variant:V:REPAIR)", "model")
        diff.append(f"weights ({dist:.0%} apart)" if dist is not None else "weights")
    elif ia.num_kv_heads != ib.num_kv_heads and "num_kv_heads" not in diff:
        diff.append("num_kv_heads")
    found = adapters_for(ia.fingerprint, ib.fingerprint)
    if found:
        best = found[0]
        others = f"; also {', '.join(f['name'] for f in found[1:])}" if len(found) > 1 else ""
        return Check("relay", True, "adapter",
                     f"adapter {best['name']} ({best['method']}; {best['held_out']}){others}: "
                     f"`kvrelay doctor link --model {receiver.name} --sender-model {sender.name} "
                     f"--adapter {best['name']}` checks it", "model")
    return Check("relay", False, "impossible",
                 f"differs in {', '.join(diff)} and no adapter for this pair is under artefacts/fuse: fit one with "
                 f"`kvrelay fuse fit --receiver {receiver.name} --sharer {sender.name}`", "model")


def diagnose_models(sender, receiver) -> Report:
    """The side-by-side config table (``facts["rows"]``) and the ``relay`` check of what relay needs."""
    a, b = config_rows(sender), config_rows(receiver)
    rows = [{"field": k, "sender": a[k], "receiver": b[k], "same": a[k] == b[k]} for k in ROWS]
    return Report("models", (relay_need(sender, receiver),),
                  {"sender": sender.name, "receiver": receiver.name, "rows": rows, "threads": torch.get_num_threads()})
