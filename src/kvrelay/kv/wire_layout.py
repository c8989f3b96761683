"""Which tensors a ``kvrelay/1`` payload holds under each codec, with their dtypes and shapes.

Checked from the header alone (names, safetensors dtype codes, shapes), before a tensor byte is
read, and the same for every codec:

* token tensors: ``token_ids`` / ``positions`` I64 and ``mask`` BOOL, all ``(B, T)`` with B, T >= 1;
* codec ``raw`` and float codecs (``fp16``, ``bf16``, with or without ``layers:`` / ``evict…:``
  stages): ``layers.{j}.k`` / ``.v`` per held layer ``j``, equal ``(B, H, T_j, D)`` with H, D >= 1 and
  ``T_j`` the slots the layer type holds (``kv.layout.held_tokens``), in the dtype the codec stores
  (``Encoding.float_dtype``: the metadata's own for ``raw``, F16 for ``fp16``, ...);
* int codecs (``kv.quant``): ``layers.{j}.k.codes`` / ``.scale`` / ``.zero`` and the same for ``v``,
  U8 codes and F16 statistics in the shapes ``quant.quantized_shapes`` gives (int4: an even D).

Nothing else: a missing or extra tensor, a shape that disagrees with the metadata or with another
tensor, or a codec name that is not one (``codecs.codec_of``) is a ``CorruptPayload`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv.codecs import Encoding, codec_of
from kvrelay.kv.layout import TOKEN_TENSORS, held_tokens, tensor_name
from kvrelay.kv.payload import PayloadMeta
from kvrelay.kv.quant import QUANT_PARTS, SCALE_DTYPE, quantized_shapes
from kvrelay.kv.wire_header import ST_CODES

# name -> (safetensors dtype code, shape): what a header declares, or what tensors in memory are.
Specs = Mapping[str, tuple[str, tuple[int, ...]]]
_CODES_DTYPE, _STATS_DTYPE = "U8", ST_CODES[SCALE_DTYPE]


def specs_of(tensors: Mapping) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``Specs`` of torch tensors (a dtype kvrelay/1 cannot hold is corrupt)."""
    out = {}
    for name, t in tensors.items():
        if t.dtype not in ST_CODES:
            raise CorruptPayload(f"tensor {name!r} has dtype {t.dtype}, which kvrelay/1 does not hold")
        out[name] = (ST_CODES[t.dtype], tuple(t.shape))
    return out


def check_tokens(specs: Specs) -> tuple[int, int]:
    """The token tensors' rule; returns (B, T)."""
    missing = [n for n in TOKEN_TENSORS if n not in specs]
    if missing:
        raise CorruptPayload(f"payload lacks tensors {missing}")
    shape = specs["token_ids"][1]
    if len(shape) != 2:
        raise CorruptPayload(f"token_ids has shape {list(shape)}, expected (B, T)")
    B, T = shape
    if B == 0 or T == 0:
        raise CorruptPayload(f"token_ids has shape {[B, T]}: a payload holds at least one row of one token")
    for name, code in (("token_ids", "I64"), ("positions", "I64"), ("mask", "BOOL")):
        if specs[name] != (code, (B, T)):
            raise CorruptPayload(f"{name} is {specs[name][0]} {list(specs[name][1])}, expected {code} {[B, T]}")
    return B, T


def _float_layer(specs: Specs, m: PayloadMeta, j: int, want: str, B: int, held: int) -> None:
    kn, vn = tensor_name(j, "k"), tensor_name(j, "v")
    for name in (kn, vn):
        if specs[name][0] != want:
            raise CorruptPayload(f"{name} is stored as {specs[name][0]} but the metadata declares dtype "
                                 f"{m.dtype} and codec {m.codec} ({want})")
    k, v = specs[kn][1], specs[vn][1]
    if len(k) != 4 or k != v or k[0] != B or k[2] != held or k[1] < 1 or k[3] < 1:
        raise CorruptPayload(f"layer {j} ({m.layer_types[j]}): k {list(k)} / v {list(v)}, "
                             f"expected equal (B={B}, H, T_l={held}, D) with H, D >= 1")


def _int_layer(specs: Specs, m: PayloadMeta, j: int, enc: Encoding, B: int, held: int) -> None:
    names = {kv: {part: tensor_name(j, kv, part) for part in QUANT_PARTS} for kv in "kv"}
    scale = specs[names["k"]["scale"]][1]
    if len(scale) != 4 or scale[1] < 1 or scale[3] < 1 or (enc.bits == 4 and scale[3] % 2):
        raise CorruptPayload(f"layer {j}: {names['k']['scale']} has shape {list(scale)}, expected "
                             f"(B, H, ceil(T_l/G), D) with H, D >= 1" + (", D even" if enc.bits == 4 else ""))
    want = quantized_shapes(B, scale[1], held, scale[3], enc.bits, enc.group_size)
    for kv in "kv":
        for part in QUANT_PARTS:
            name, code = names[kv][part], _CODES_DTYPE if part == "codes" else _STATS_DTYPE
            if specs[name] != (code, want[kv][part]):
                raise CorruptPayload(f"layer {j} ({m.layer_types[j]}): {name} is {specs[name][0]} "
                                     f"{list(specs[name][1])}, expected {code} {list(want[kv][part])} "
                                     f"under codec {m.codec} (B={B}, T_l={held})")


def check_layout(specs: Specs, m: PayloadMeta) -> tuple[int, int]:
    """Raise ``CorruptPayload`` unless ``specs`` are exactly the tensors ``m`` (its codec, layers, types) needs;
    returns (B, T)."""
    enc = codec_of(m).encoding
    B, T = check_tokens(specs)
    n = len(m.layer_indices)
    parts = QUANT_PARTS if enc.kind == "int" else (None,)
    need = [tensor_name(j, kv, part) for j in range(n) for kv in "kv" for part in parts]
    missing = [name for name in need if name not in specs]
    if missing:
        raise CorruptPayload(f"payload lacks tensors {missing} (metadata lists {n} layers, codec {m.codec})")
    extra = sorted(set(specs) - set(need) - set(TOKEN_TENSORS))
    if extra:
        raise CorruptPayload(f"payload holds tensors {extra} that {n} layers under codec {m.codec} do not have")
    want = None if enc.kind == "int" else ST_CODES[enc.float_dtype(m.dtype)]
    for j in range(n):
        held = held_tokens(m.layer_types[j], m.sliding_window, T)
        if want is None:
            _int_layer(specs, m, j, enc, B, held)
        else:
            _float_layer(specs, m, j, want, B, held)
    return B, T
