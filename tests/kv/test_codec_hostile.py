"""Crafted codec outputs (fp16 — the CLI's default — int8, int4, eviction, layer subsets): every defect is a
``CorruptPayload`` from ``kr.load`` / ``decode`` / ``get_payload``, never a ValueError, IndexError or
RuntimeError from inside the codec; and ``describe`` (``kvrelay inspect``) says ``ok`` exactly when
``decode`` accepts the bytes.

Each file is re-sealed with valid checksums (``wire.pack`` or ``forge``), so what refuses it is the
structural validation, not the checksum.
"""

from __future__ import annotations

import pytest
import torch

import kvrelay as kr
from kvrelay.core.errors import CorruptPayload
from kvrelay.kv import codecs, wire
from kvrelay.kv.describe import describe
from kvrelay.kv.payload import MAX_POSITION
from kvrelay.transport.payloads import compressed_from_bytes, decode_bytes
from tests.kv.test_wire_hostile import forge, split, synthetic

CODECS = ["fp16", "bf16", "int8", "int4", "int8-g4", "evict:0.5+fp16", "layers:0+fp16", "evict:0.5"]


def sealed(codec: str, edit=None, meta_edit: dict | None = None) -> bytes:
    """The codec's output of ``synthetic()``, its tensors passed through ``edit`` and its metadata updated."""
    tensors, meta = codecs.compress(synthetic(), codec).to_wire()
    tensors = edit(dict(tensors)) if edit else tensors
    return wire.pack(tensors, {**meta, **(meta_edit or {})})


def refused(data: bytes, match: str) -> None:
    """Every reader refuses ``data`` with a ``CorruptPayload``, and inspect does not say ok."""
    for read in (wire.decode, decode_bytes, compressed_from_bytes):
        if read is compressed_from_bytes and wire.read_meta(data).get("codec", "raw") == "raw":
            continue
        with pytest.raises(CorruptPayload, match=match):
            read(data)
    d = describe(data)
    assert d["status"] == "corrupt" and d["reason"], d


@pytest.mark.parametrize("codec", CODECS)
def test_genuine_codec_output_loads_from_a_file(codec, tmp_path):
    """``kr.load`` reads what ``kvrelay read --out`` writes (fp16 by default): a raw float payload back."""
    p = synthetic()
    path = tmp_path / "p.kv"
    wire.atomic_write(path, wire.pack_parts(*codecs.compress(p, codec).to_wire()))
    got = kr.load(path)
    want = codecs.apply(p, codec)
    assert got.meta.codec == "raw" and got.meta.dtype == p.meta.dtype
    assert got.meta.layer_indices == want.meta.layer_indices
    assert all(torch.equal(a, b) for a, b in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True))
    assert torch.equal(got.positions, want.positions) and torch.equal(got.token_ids, want.token_ids)
    assert describe(path.read_bytes())["status"] == "ok"


def test_partial_load_of_a_codec_output_equals_the_transforms(tmp_path):
    from kvrelay.kv.transforms import select_layers, select_tokens

    path = tmp_path / "p.kv"
    wire.atomic_write(path, wire.pack_parts(*codecs.compress(synthetic(), "int8").to_wire()))
    full = kr.load(path)
    got = kr.load(path, layers=[1], tokens=slice(4, 6))
    want = select_tokens(select_layers(full, [1]), [4, 5])
    assert got.meta == want.meta and torch.equal(got.keys[0], want.keys[0]) and torch.equal(got.mask, want.mask)


def _drop_layer(t: dict) -> dict:
    return {n: x for n, x in t.items() if not n.startswith("layers.1.")}


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "evict:0.5+fp16"])
def test_a_dropped_layer_is_named(codec):
    refused(sealed(codec, _drop_layer), r"payload lacks tensors \['layers\.1\.")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "", " 7", "1" * 40])
def test_codec_raw_nbytes_must_be_a_count(codec, value):
    refused(sealed(codec, meta_edit={"codec_raw_nbytes": value}), "metadata field 'codec_raw_nbytes'")


@pytest.mark.parametrize("codec", CODECS)
def test_zero_tokens_are_refused(codec):
    def empty(t):
        return {n: x[:, :, :0] if x.ndim == 4 else x[:, :0] for n, x in t.items()}
    refused(sealed(codec, empty), r"token_ids has shape \[1, 0\]")


@pytest.mark.parametrize("name, value, match", [
    ("codec", "int9", "metadata field 'codec': unknown codec"),
    ("codec", "int8", "'int8' is not written that way; expected 'int8-g32'"),
    ("codec", "int4-g32", "codec int4-g32"),  # int8 codes read as int4: wrong code shapes
    ("codec", "raw", r"is stored as (F16|U8)|lacks tensors"),
    ("round", '"x"', "metadata field 'round'"),
    ("num_model_layers", "-1", "metadata field 'num_model_layers'"),
    ("layer_indices", "[0, 0]", "metadata field 'layer_indices'"),
    ("layer_indices", "[0]", "metadata field 'layer_types'"),
    ("dtype", "float64", "metadata field 'dtype'"),
])
@pytest.mark.parametrize("codec", ["fp16", "int8-g32"])
def test_bad_metadata_of_a_codec_output(codec, name, value, match):
    if name == "codec" and value == "int4-g32" and codec == "fp16":
        match = "lacks tensors"
    refused(sealed(codec, meta_edit={name: value}), match)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("part, shape_edit", [("codes", lambda x: x[..., :-1]), ("scale", lambda x: x[:, :1]),
                                             ("zero", lambda x: x[:, :, :1])])
def test_quantized_side_tensors_of_the_wrong_shape(codec, part, shape_edit):
    def edit(t):
        t[f"layers.0.v.{part}"] = shape_edit(t[f"layers.0.v.{part}"]).contiguous()
        return t
    refused(sealed(codec, edit), rf"layers\.0\.v\.{part} is .*, expected")


def test_quantized_statistics_of_the_wrong_dtype():
    def edit(t):
        t["layers.1.k.scale"] = t["layers.1.k.scale"].float()
        return t
    refused(sealed("int8", edit), r"layers\.1\.k\.scale is F32 .*, expected F16")


def test_an_extra_tensor_is_refused():
    refused(sealed("fp16", lambda t: {**t, "layers.0.k.codes": torch.zeros(1, 2, 6, 4, dtype=torch.uint8)}),
            r"holds tensors \['layers\.0\.k\.codes'\]")


def test_float_layers_of_another_dtype_than_the_codec_stores():
    refused(sealed("fp16", lambda t: {**t, "layers.0.k": t["layers.0.k"].bfloat16()}),
            r"layers\.0\.k is stored as BF16 but the metadata declares dtype float32 and codec fp16 \(F16\)")


# -- payload invariants: through every codec ------------------------------------------------------------
@pytest.mark.parametrize("codec", ["raw", "fp16", "int8"])
@pytest.mark.parametrize("field, make, match", [
    ("mask", lambda t: torch.zeros_like(t), "every row must hold at least one real token"),
    ("positions", lambda t: t + (2**63 - 10), r"positions of real tokens must lie in \[0, "),
    ("positions", lambda t: t - 3, r"positions of real tokens must lie in \[0, "),
    ("token_ids", lambda t: -t, "token_ids of real tokens must be >= 0"),
])
def test_payload_invariants_hold_through_every_codec(codec, field, make, match):
    refused(sealed(codec, lambda t: {**t, field: make(t[field])}), f"tensors violate the payload invariants: {match}")


def test_the_largest_position_is_accepted_and_the_next_is_not():
    def at(last: int):
        return lambda t: {**t, "positions": torch.arange(last - 5, last + 1)[None]}
    assert int(wire.decode(sealed("fp16", at(MAX_POSITION))).positions.max()) == MAX_POSITION
    refused(sealed("fp16", at(MAX_POSITION + 1)), "positions of real tokens must lie in")


def test_a_padded_row_with_real_tokens_is_still_fine():
    def pad(t):
        t["mask"] = torch.tensor([[False, False, True, True, True, True]])
        return t
    assert wire.decode(sealed("fp16", pad)).lengths.tolist() == [4]


def test_forged_header_of_a_codec_output(tmp_path):
    """A forger edits the header entry of a side tensor and re-seals: refused before any decompression."""
    header, body = split(sealed("int8"))
    header["layers.0.k.scale"]["shape"] = [1, 2, 1, 2, 2]  # same bytes, another rank
    refused(forge(header, body), r"layers\.0\.k\.scale has shape \[1, 2, 1, 2, 2\]")
