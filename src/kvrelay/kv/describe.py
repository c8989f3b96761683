"""What a kvrelay/1 file holds, without trusting it: header, metadata, layers, tokens, bytes, codec, checksums.

``describe(data)`` never raises on damaged bytes: it verifies every tensor against its own digest
and reports each result (``checksum.bad`` lists the tensors whose bytes changed). ``status`` is
``"ok"`` exactly when ``kv.wire.decode`` accepts the bytes — the same validation, not a second
copy of it — and otherwise ``"corrupt"`` with ``reason``, the ``CorruptPayload`` that ``decode``
raised (a header that fails its own validation, a tensor whose bytes changed, metadata or shapes
that do not describe a payload, a codec's output that does not decode). Works on raw payloads and
on any codec's output (int8 codes and scales are tensors like any other).
"""

from __future__ import annotations

import json
import re

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.codecs import raw_nbytes_of
from kvrelay.kv.layout import SLIDING, TOKEN_TENSORS
from kvrelay.kv.wire import Source, decode, read_header, tensor_intact, unpack

_LAYER = re.compile(r"^layers\.(\d+)\.([kv])(?:\.(.+))?$")


def _meta_values(meta: dict[str, str]) -> dict:
    """Metadata strings with JSON-looking values parsed (numbers, lists, rope specs)."""
    out = {}
    for k, v in meta.items():
        try:
            out[k] = json.loads(v) if v[:1] in "[{0123456789-" or v in ("null", "true", "false") else v
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser follows
            out[k] = v
    return out


def _layers(h, meta: dict) -> list[dict]:
    """Per held layer: its model index, type, and the tensors (name, dtype, shape) that encode it."""
    idx, types = (meta.get(k) if isinstance(meta.get(k), list) else [] for k in ("layer_indices", "layer_types"))
    rows: dict[int, dict] = {}
    for name, e in sorted(h.tensors.items()):
        m = _LAYER.match(name)
        if not m:
            continue
        j = int(m.group(1))
        row = rows.setdefault(j, {"held": j, "model_layer": idx[j] if j < len(idx) else None,
                                  "type": types[j] if j < len(types) else None, "tensors": {}, "bytes": 0})
        row["tensors"][name] = {"dtype": e.dtype, "shape": list(e.shape)}
        row["bytes"] += e.end - e.begin
    return [rows[j] for j in sorted(rows)]


def _layout(data: Source, h, codec: str, layers: list[dict]) -> dict:
    """The payload's tensor layout: always ``B,H_kv,T_l,D`` on the wire (the flash and paged layouts are
    conversions, ``kv.flash`` / ``kv.paged``), whether it holds every position or a selection (an eviction
    or receiver-driven partial codec, or gaps in its positions), and its sliding-window layers."""
    gapped = None
    if "positions" in h.tensors and "mask" in h.tensors and tensor_intact(data, h, "positions") \
            and tensor_intact(data, h, "mask"):
        try:
            t, _ = unpack(data, names=("positions", "mask"), verify=False)
            pos, mask = t["positions"], t["mask"].bool()
            steps = pos[:, 1:] - pos[:, :-1]
            gapped = bool((steps[mask[:, 1:] & mask[:, :-1]] > 1).any())
        except (CorruptPayload, RuntimeError, ValueError):
            gapped = None
    evicted = any(s.split(":")[0].startswith("evict") for s in codec.split("+"))
    return {"name": "dense", "kv_axes": "B,H_kv,T_l,D",
            "positions": "unknown" if gapped is None else ("gapped" if gapped else "contiguous"),
            "selection": "partial" if (evicted or gapped) else "full",
            "sliding_layers": sum(1 for r in layers if r["type"] == SLIDING),
            "converts_to": {"flash": "B,T_l,H_kv,D (kv.flash)", "paged": "blocks + block table (kv.paged)"}}


def describe(data: Source) -> dict:
    """A JSON-ready description of kvrelay/1 bytes (see the module docstring)."""
    size = memoryview(data).nbytes
    try:
        h = read_header(data)
    except CorruptPayload as e:
        return {"status": "corrupt", "reason": str(e), "bytes": {"file": size}}
    meta = _meta_values(h.meta)
    bad = [n for n in sorted(h.tensors) if not tensor_intact(data, h, n)]
    try:
        decode(data)
        reason = None
    except CorruptPayload as e:
        reason = str(e)
    tensor_bytes = {n: e.end - e.begin for n, e in h.tensors.items()}
    layers = _layers(h, meta)
    ids = h.tensors.get("token_ids")
    return {
        "status": "ok" if reason is None else "corrupt",
        **({} if reason is None else {"reason": reason}),
        "header": {"format": h.meta.get("format"), "header_bytes": h.data_start, "tensors": len(h.tensors)},
        "meta": meta,
        "codec": h.meta.get("codec", "raw"),
        "layers": layers,
        "tokens": {"batch": ids.shape[0], "slots": ids.shape[1]} if ids is not None and len(ids.shape) == 2 else None,
        "layout": _layout(data, h, h.meta.get("codec", "raw"), layers),
        "bytes": {"file": size, "data": size - h.data_start, "kv": sum(r["bytes"] for r in layers),
                  "tokens": sum(tensor_bytes.get(n, 0) for n in TOKEN_TENSORS),
                  "raw_fp32": (raw_nbytes_of(h.meta) or None) if reason is None else None},
        "checksum": {"root": "ok", "tensors_verified": len(h.tensors) - len(bad), "bad": bad},
    }
