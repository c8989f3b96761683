"""Crafted kvrelay/1 files: every header and metadata defect is a ``CorruptPayload`` naming what is wrong.

The checksums are unkeyed sha256, so whoever crafts a file can recompute them: ``forge`` below
re-seals an edited header the way the format documents it (``kv/wire.py``), and each test
checks that the *structural* validation, not the checksum, refuses the edit.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.core.errors import CorruptPayload
from kvrelay.kv import wire
from kvrelay.kv.payload import KVPayload, PayloadMeta, payload_tensors
from kvrelay.models.identity import RopeSpec

FULL, SLIDING = "full_attention", "sliding_attention"


def synthetic(T: int = 6, window: int | None = 4, B: int = 1) -> KVPayload:
    """A small payload without a model: layer 0 full attention, layer 1 sliding (T_1 = min(T, window - 1))."""
    g = torch.Generator().manual_seed(T)
    types = (FULL, SLIDING) if window else (FULL, FULL)
    meta = PayloadMeta(model_fingerprint="ab" * 32, tokenizer_hash="tok", arch="gemma3", num_model_layers=2,
                       layer_indices=(0, 1), layer_types=types, sliding_window=window,
                       rope=tuple(RopeSpec(t, (1.0, 0.25)) for t in dict.fromkeys(types)), producer="p", round=2,
                       created_at=5.0)
    held = [T, min(T, window - 1) if window else T]
    k = tuple(torch.randn(B, 2, h, 4, generator=g) for h in held)  # (B, H, T_l, D)
    v = tuple(torch.randn(B, 2, h, 4, generator=g) for h in held)
    ids = torch.randint(9, 60, (B, T), generator=g)
    return KVPayload(k, v, ids, torch.arange(T).expand(B, T).clone(), torch.ones(B, T, dtype=torch.bool), meta)


def split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def forge(header: object, body: bytes, *, digests: bool = True) -> bytes:
    """Bytes of ``header`` + ``body`` with valid checksums recomputed as the format documents them."""
    if isinstance(header, dict) and isinstance(header.get("__metadata__"), dict):
        meta = header["__metadata__"]
        tensors = {n: e for n, e in header.items() if n != "__metadata__"}
        if digests:
            d = {}
            for name, e in tensors.items():
                try:
                    b, end = e["data_offsets"]
                    h = hashlib.sha256(f"{name}\0{e['dtype']}\0{json.dumps(list(e['shape']))}\0".encode())
                    h.update(body[b:end])
                    d[name] = h.hexdigest()
                except (TypeError, ValueError, KeyError):
                    d[name] = "0" * 64
            meta["tensor_sha256"] = json.dumps(d, sort_keys=True)
        try:
            root = {"metadata": {k: v for k, v in meta.items() if k != "sha256"},
                    "tensors": [[n, tensors[n]["dtype"], list(tensors[n]["shape"])] for n in sorted(tensors)]}
            meta["sha256"] = hashlib.sha256(json.dumps(root, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        except (TypeError, KeyError):
            pass
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + body


@pytest.fixture(scope="module")
def good() -> bytes:
    return wire.encode(synthetic())


def edited(data: bytes, edit) -> bytes:
    header, body = split(data)
    body = edit(header, body) or body
    return forge(header, body)


def refused(data: bytes, match: str) -> CorruptPayload:
    with pytest.raises(CorruptPayload, match=match) as e:
        wire.decode(data)
    return e.value


def test_forge_reproduces_the_writer(good):
    """The re-sealer matches the writer byte for byte, so every refusal below is structural."""
    header, body = split(good)
    assert wire.decode(forge(header, body)).meta == synthetic().meta


# -- header structure -----------------------------------------------------------------------------
def test_header_must_be_an_object(good):
    for h in ([1, 2], "text", 7, None):
        refused(forge(h, b""), "expected an object")


def test_tensor_entry_must_be_an_object(good):
    def edit(h, body):
        h["mask"] = [h["mask"]["dtype"]]
    refused(edited(good, edit), "'mask': header entry is not an object")


@pytest.mark.parametrize("shape", [[-1, 6], [1.0, 6], ["1", 6], [True, 6], "1x6", None, [1, None]])
def test_shape_must_be_non_negative_ints(good, shape):
    def edit(h, body):
        h["mask"]["shape"] = shape
    refused(edited(good, edit), r"'mask': shape .* is not a list of non-negative ints")


@pytest.mark.parametrize("offs", [[-6, 0], [0.0, 6.0], ["0", "6"], [False, True], [6, 0], [0], [0, 6, 7], "0-6", None])
def test_offsets_must_be_ordered_ints(good, offs):
    def edit(h, body):
        h["mask"]["data_offsets"] = offs
    refused(edited(good, edit), r"'mask': data_offsets .* are not \[begin, end\]")


def _shift_after(h: dict, name: str, by: int) -> None:
    """Move every tensor stored after ``name`` by ``by`` bytes."""
    cut = h[name]["data_offsets"][1]
    for n, e in h.items():
        if n != "__metadata__" and e["data_offsets"][0] >= cut:
            e["data_offsets"] = [e["data_offsets"][0] + by, e["data_offsets"][1] + by]


def test_gap_in_the_tensor_layout_is_refused(good):
    def edit(h, body):
        cut = h["layers.0.k"]["data_offsets"][1]
        _shift_after(h, "layers.0.k", 8)
        return body[:cut] + bytes(8) + body[cut:]  # 8 junk bytes between two tensors
    refused(edited(good, edit), r"starts at byte \d+, expected \d+ \(tensors must tile the data\)")


def test_overlapping_tensors_are_refused(good):
    def edit(h, body):
        first = min((e["data_offsets"][0], n) for n, e in h.items() if n != "__metadata__")[1]
        nbytes = h[first]["data_offsets"][1]
        # the second tensor starts inside the first; the file ends early by as much
        _shift_after(h, first, -4)
        return body[:nbytes] + body[nbytes + 4:]
    refused(edited(good, edit), r"starts at byte \d+, expected \d+")


def test_trailing_bytes_after_the_tensors_are_refused(good):
    header, body = split(good)
    refused(forge(header, body + bytes(16)), r"tensors cover \d+ bytes but the data section has \d+")


def test_truncated_tensor_is_refused(good):
    header, body = split(good)
    refused(forge(header, body[:-8]), r"truncated payload: tensor .* ends at byte")


# -- integrity fields -----------------------------------------------------------------------------
@pytest.mark.parametrize("value, match", [
    ("not json", "tensor_sha256 metadata is not JSON"),
    ("[]", "does not list exactly the file's tensors"),
    ("{}", "does not list exactly the file's tensors"),
])
def test_malformed_digest_table(good, value, match):
    header, body = split(good)
    header["__metadata__"]["tensor_sha256"] = value
    refused(forge(header, body, digests=False), match)


@pytest.mark.parametrize("digest", [5, None, "zz" * 32, "AB" * 32, "ab" * 31, ["ab" * 32]])
def test_malformed_digest_value(good, digest):
    header, body = split(good)
    table = json.loads(header["__metadata__"]["tensor_sha256"])
    table["mask"] = digest
    header["__metadata__"]["tensor_sha256"] = json.dumps(table)
    refused(forge(header, body, digests=False), r"tensor_sha256 of \['mask'\] is not a sha256 hex digest")


def test_extra_digest_is_refused(good):
    header, body = split(good)
    table = json.loads(header["__metadata__"]["tensor_sha256"]) | {"ghost": "ab" * 32}
    header["__metadata__"]["tensor_sha256"] = json.dumps(table)
    refused(forge(header, body, digests=False), "does not list exactly")


def test_missing_checksums(good):
    header, body = split(good)
    del header["__metadata__"]["sha256"]
    head = json.dumps(header).encode()
    refused(len(head).to_bytes(8, "little") + head + body, "lacks the checksums")


# -- tensor bytes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("byte", [2, 0x80, 0xFF])
def test_bool_bytes_other_than_0_and_1(good, byte):
    def edit(h, body):
        b, _ = h["mask"]["data_offsets"]
        return body[:b] + bytes([byte]) + body[b + 1:]
    refused(edited(good, edit), "'mask': bool tensor holds bytes other than 0 and 1")


# -- metadata ---------------------------------------------------------------------------------------
def meta_with(**fields: str) -> bytes:
    p = synthetic()
    return wire.pack(payload_tensors(p), p.meta.to_strings() | fields)


def test_non_string_metadata_value_is_named(good):
    header, body = split(good)
    header["__metadata__"]["round"] = 3
    refused(forge(header, body), r"metadata fields \['round'\] are not strings")


BAD_FIELDS = [
    ("round", '"x"'), ("round", "x"), ("round", "true"), ("round", "1.5"), ("round", "-1"), ("round", "null"),
    ("num_model_layers", "0"), ("num_model_layers", "false"), ("num_model_layers", '"2"'), ("num_model_layers", "2.0"),
    ("layer_indices", '[0, "1"]'), ("layer_indices", "[1, 0]"), ("layer_indices", "[0, 0]"),
    ("layer_indices", "[0, true]"), ("layer_indices", "[-1, 0]"), ("layer_indices", "{}"), ("layer_indices", "[0, 5]"),
    ("layer_types", '["full_attention", "chunked_attention"]'), ("layer_types", '"full_attention"'),
    ("layer_types", '["full_attention"]'), ("layer_types", "[0, 1]"),
    ("sliding_window", "0"), ("sliding_window", "true"), ("sliding_window", "4.5"), ("sliding_window", '"4"'),
    ("rope", "[]"), ("rope", "{}"), ("rope", '[{"layer_type": "full_attention"}]'),
    ("rope", '[{"layer_type": "full_attention", "inv_freq": [1.0], "attention_scaling": "1"}]'),
    ("rope", '[{"layer_type": "full_attention", "inv_freq": ["1"], "attention_scaling": 1.0}]'),
    ("rope", '[{"layer_type": "full_attention", "inv_freq": [], "attention_scaling": 1.0}]'),
    ("rope", '[{"layer_type": "odd", "inv_freq": [1.0], "attention_scaling": 1.0}]'),
    ("rope", '[{"layer_type": "full_attention", "inv_freq": [NaN], "attention_scaling": 1.0}]'),
    ("rope", '[{"layer_type": "full_attention", "inv_freq": [1.0], "attention_scaling": 1.0, "x": 1}]'),
    ("rope", '[{"layer_type": "full_attention", "inv_freq": [1.0], "attention_scaling": 1.0}]'),  # sliding lacks one
    ("rope", '[{"layer_type": "full_attention", "inv_freq": [1.0], "attention_scaling": 1.0}, '
             '{"layer_type": "full_attention", "inv_freq": [1.0], "attention_scaling": 1.0}, '
             '{"layer_type": "sliding_attention", "inv_freq": [1.0], "attention_scaling": 1.0}]'),
    ("rope", "[1]"), ("created_at", '"now"'), ("created_at", "NaN"), ("created_at", "true"), ("created_at", "{"),
    ("dtype", "float64"),
]


@pytest.mark.parametrize("name, value", BAD_FIELDS)
def test_mistyped_metadata_field_is_named(name, value):
    e = refused(meta_with(**{name: value}), f"metadata field '{name}'")
    assert not isinstance(e, (TypeError, KeyError))


def test_round_x_never_reaches_the_receiver():
    """The crafted file of the report: ``round: "x"`` used to decode, then crash the receiver."""
    refused(meta_with(round='"x"'), "metadata field 'round': expected an int >= 0, got 'x'")


def test_missing_metadata_field_is_named():
    p = synthetic()
    meta = p.meta.to_strings()
    del meta["tokenizer_hash"]
    refused(wire.pack(payload_tensors(p), meta), r"metadata lacks the fields \['tokenizer_hash'\]")


def test_optional_adapter_field_may_be_absent():
    p = synthetic()
    meta = p.meta.to_strings()
    del meta["adapter"]
    assert wire.decode(wire.pack(payload_tensors(p), meta)).meta == p.meta


def test_from_strings_round_trips_every_field():
    m = synthetic().meta
    assert PayloadMeta.from_strings(m.to_strings()) == m
    no_window = synthetic(window=None).meta
    assert PayloadMeta.from_strings(no_window.to_strings()) == no_window


# -- shapes against the metadata, and the payload invariants ------------------------------------------
def test_zero_token_payload_is_corrupt():
    p = synthetic()
    t = payload_tensors(p)
    empty = {n: x[..., :0, :] if n.startswith("layers.") else x[:, :0] for n, x in t.items()}
    refused(wire.pack(empty, p.meta.to_strings()), r"token_ids has shape \[1, 0\]")
    empty_rows = {n: x[:0] for n, x in t.items()}
    refused(wire.pack(empty_rows, p.meta.to_strings()), r"token_ids has shape \[0, 6\]")


def test_sliding_layer_holding_the_wrong_slots():
    p = synthetic()
    t = payload_tensors(p) | {"layers.1.k": p.keys[0], "layers.1.v": p.values[0]}  # 6 slots, window allows 3
    refused(wire.pack(t, p.meta.to_strings()), r"layer 1 \(sliding_attention\): .*T_l=3")


def test_token_tensor_of_the_wrong_shape_or_rank():
    p = synthetic()
    refused(wire.pack(payload_tensors(p) | {"positions": p.positions[:, :5]}, p.meta.to_strings()),
            r"positions is I64 \[1, 5\], expected I64 \[1, 6\]")
    refused(wire.pack(payload_tensors(p) | {"token_ids": p.token_ids[0]}, p.meta.to_strings()),
            r"token_ids has shape \[6\], expected \(B, T\)")


@pytest.mark.parametrize("field, tensor, match", [
    ("positions", torch.tensor([[0, 1, 2, 2, 4, 5]]), "positions must be strictly increasing"),
    ("mask", torch.tensor([[True, False, True, True, True, True]]), "mask must be left-padded"),
])
def test_payload_invariants_are_corrupt_not_value_errors(field, tensor, match):
    p = synthetic()
    refused(wire.pack(payload_tensors(p) | {field: tensor}, p.meta.to_strings()),
            f"tensors violate the payload invariants: {match}")


# -- property: random edits never escape as anything but CorruptPayload -------------------------------
FUZZ = settings(max_examples=int(os.environ.get("KVRELAY_FUZZ_EXAMPLES", "150")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(st.data())
def test_random_byte_edits_raise_only_corrupt_payload(data):
    raw = bytearray(wire.encode(synthetic()))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        wire.decode(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))
    except CorruptPayload:
        pass


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=True) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)


@FUZZ
@given(st.data())
def test_resealed_header_edits_raise_only_corrupt_payload(data):
    """Edits a forger would make: any header or metadata value replaced, checksums recomputed."""
    header, body = split(wire.encode(synthetic()))
    name = data.draw(st.sampled_from(sorted(header)))
    if name == "__metadata__":
        key = data.draw(st.sampled_from(sorted(k for k in header[name] if k not in ("sha256", "tensor_sha256"))))
        value = data.draw(JSON)
        header[name][key] = value if data.draw(st.booleans()) else json.dumps(value)
    else:
        key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][key] = data.draw(JSON)
    try:
        p = wire.decode(forge(header, body))
    except CorruptPayload:
        return
    assert isinstance(p, KVPayload)  # an edit that decodes is a well-formed payload (e.g. a new producer name)


# -- the exact limits and messages of the checks -------------------------------------------------------
def test_limits_are_inclusive_and_small_files_are_named_exactly(good):
    n = int.from_bytes(good[:8], "little")
    assert wire.decode(good, max_header_bytes=n).meta == synthetic().meta  # a header of exactly the limit is fine
    refused_limit = pytest.raises(CorruptPayload, match=f"header length {n} bytes exceeds the limit of {n - 1} bytes")
    with refused_limit:
        wire.decode(good, max_header_bytes=n - 1)
    data_len = len(good) - 8 - n
    assert wire.decode(good, max_total_bytes=data_len).num_tokens == 6
    with pytest.raises(CorruptPayload, match=f"data section of {data_len} bytes exceeds the limit of {data_len - 1}"):
        wire.decode(good, max_total_bytes=data_len - 1)
    refused(bytes(7), r"^truncated payload: 7 bytes, expected at least 8 \(the header length\)$")
    refused(bytes(8), "header is not valid UTF-8 JSON")  # 8 bytes hold a (zero) length: the header is what fails
    refused((100).to_bytes(8, "little") + b"{}", r"^truncated payload: header declares 100 bytes but only 2 follow$")
    refused(forge([1], b""), r"^header is a JSON list, expected an object$")


def test_byte_count_mismatch_is_reported_with_both_counts(good):
    def edit(h, body):
        h["mask"]["shape"] = [1, 5]
    refused(edited(good, edit), r"^tensor 'mask': 6 bytes for shape \[1, 5\] BOOL, expected 5$")


def test_digest_must_be_lowercase_hex_of_64_digits(good):
    for bad in ("XY" * 32, "X" * 64, "0" * 63 + "g"):
        header, body = split(good)
        table = json.loads(header["__metadata__"]["tensor_sha256"])
        table["mask"] = bad
        header["__metadata__"]["tensor_sha256"] = json.dumps(table)
        refused(forge(header, body, digests=False), "is not a sha256 hex digest")


def test_empty_tensors_keep_their_dtype():
    for dt in (torch.int64, torch.bool, torch.float16, torch.uint8):
        got, _ = wire.unpack(wire.pack({"e": torch.empty(0, 3, dtype=dt)}, {}))
        assert got["e"].dtype == dt and got["e"].shape == (0, 3)


def test_layer_tensor_names_and_shapes_in_messages():
    p = synthetic()
    t = payload_tensors(p) | {"layers.0.v": p.values[0].half()}
    refused(wire.pack(t, p.meta.to_strings()), r"^layers\.0\.v is stored as F16 but the metadata declares dtype float32")
    t = payload_tensors(p) | {"layers.1.k": p.keys[1].half()}
    refused(wire.pack(t, p.meta.to_strings()), r"^layers\.1\.k is stored as F16")
    t = payload_tensors(p) | {"layers.0.v": torch.zeros(1, 1, 6, 4)}  # one head fewer than k
    refused(wire.pack(t, p.meta.to_strings()), r"layer 0 \(full_attention\): k \[1, 2, 6, 4\] / v \[1, 1, 6, 4\]")
    t = payload_tensors(p) | {"layers.0.k": torch.zeros(1, 2, 6), "layers.0.v": torch.zeros(1, 2, 6)}  # 3-D
    refused(wire.pack(t, p.meta.to_strings()), r"layer 0 \(full_attention\): k \[1, 2, 6\] / v \[1, 2, 6\]")


def test_partial_decode_of_bytes_equals_the_transforms():
    from kvrelay.kv.transforms import select_layers, select_tokens

    p = synthetic()  # T = 6; layer 1 sliding, holds slots 3..5
    data = wire.encode(p)
    for tokens, idx in ((slice(3, 5), [3, 4]), (slice(4, 6), [4, 5]), (slice(2, 3), [2]), (None, list(range(6)))):
        if tokens == slice(2, 3):  # the sliding layer never cached slot 2
            with pytest.raises(ValueError, match=r"^layer 1 is a sliding-window layer holding slots 3\.\.5; "
                                                 r"the selection needs slot 2, which it never cached$"):
                wire.decode(data, tokens=tokens)
            continue
        got, want = wire.decode(data, tokens=tokens), select_tokens(p, idx)
        assert got.num_tokens == len(idx)
        assert all(torch.equal(a, b) for a, b in zip((*got.keys, *got.values, got.positions),
                                                     (*want.keys, *want.values, want.positions), strict=True))
    assert wire.decode(data, layers=[1]).meta == select_layers(p, [1]).meta
    with pytest.raises(ValueError, match=r"^layers \[5\] are not held by this payload \(holds \[0, 1\]\)$"):
        wire.decode(data, layers=[0, 5])
    for bad in (slice(2, 2), slice(0, 6, 2), slice(9, 12)):
        with pytest.raises(ValueError, match=r"^tokens must select a non-empty contiguous slot range of \[0, 6\)"):
            wire.decode(data, tokens=bad)
    assert wire.decode(data, tokens=slice(5, 6)).num_tokens == 1
