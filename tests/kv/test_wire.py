"""kvrelay/1 wire format: bit-exact round trips, partial loads, and typed errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import CorruptPayload, IncompatiblePayload
from kvrelay.kv import wire
from kvrelay.kv.transforms import pad_batch, select_layers, select_tokens, to_dtype
from tests.conftest import random_ids


def assert_same(a, b):
    assert a.meta == b.meta
    for x, y in zip((*a.keys, *a.values, a.token_ids, a.positions, a.mask),
                    (*b.keys, *b.values, b.token_ids, b.positions, b.mask), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def payload(tiny):
    return Agent(tiny, "sender").prefill(random_ids(23, 1))  # 23 slots cross gemma3's window of 8


def header_of(data: bytes) -> tuple[dict, int]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), 8 + n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(payload, dtype):
    p = to_dtype(payload, dtype)
    assert_same(wire.decode(wire.encode(p)), p)


def test_round_trip_padded_batch(tiny):
    sender = Agent(tiny, "sender")
    batch = pad_batch([sender.prefill(random_ids(n, 10 + n)) for n in (4, 13, 22)])
    assert not bool(batch.mask.all())
    assert_same(wire.decode(wire.encode(batch)), batch)


def test_save_load_and_safetensors_interop(payload, tmp_path):
    path = tmp_path / "p.safetensors"
    wire.save(payload, path)
    assert_same(wire.load(path), payload)
    assert [f.name for f in tmp_path.iterdir()] == ["p.safetensors"]  # no temporary file left behind
    with safe_open(str(path), "pt") as f:  # a plain safetensors file for any other reader
        assert f.metadata()["format"] == "kvrelay/1"
        assert torch.equal(f.get_tensor("layers.0.k"), payload.keys[0])


def test_partial_loads_equal_transforms(payload, tmp_path):
    path = tmp_path / "p.safetensors"
    wire.save(payload, path)
    n_layers, T = payload.meta.num_model_layers, payload.num_tokens
    data = wire.encode(payload)
    for layers in (range(1, 3), slice(2, None), [0, n_layers - 1]):
        want = select_layers(payload, range(n_layers)[layers] if isinstance(layers, slice) else layers)
        assert_same(wire.load(path, layers=layers), want)
        assert_same(wire.decode(data, layers=layers), want)
    # Token ranges that end at T keep every sliding layer's cached tail; gemma3's window is 8.
    for tokens in (slice(T - 7, T), slice(T - 5, None), slice(-3, None)):
        want = select_tokens(payload, range(T)[tokens])
        assert_same(wire.load(path, tokens=tokens), want)
        assert_same(wire.load(path, layers=range(1, 3), tokens=tokens), select_layers(want, range(1, 3)))
    if "sliding_attention" not in payload.meta.layer_types:  # a prefix is only cached by full layers
        assert_same(wire.load(path, tokens=slice(0, 16)), select_tokens(payload, range(16)))
    else:
        with pytest.raises(ValueError, match="never cached"):
            wire.load(path, tokens=slice(0, 16))
    with pytest.raises(ValueError, match="not held"):
        wire.decode(wire.encode(select_layers(payload, [0, 1])), layers=range(2, 4))


def test_pack_unpack_codec_side_tensors():
    tensors = {"q": torch.arange(-8, 8, dtype=torch.int8).reshape(4, 4), "packed": torch.arange(6, dtype=torch.uint8),
               "scale": torch.rand(4, dtype=torch.float16), "ids": torch.arange(3), "empty": torch.zeros(0, 3)}
    data = wire.pack(tensors, {"codec": "int8", "group": "32"})
    got, meta = wire.unpack(data)
    assert meta == {"codec": "int8", "group": "32", "format": "kvrelay/1"}
    assert set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)
    assert set(wire.unpack(data, names={"scale"})[0]) == {"scale"}
    assert set(wire.unpack(data, names=lambda n: n.startswith("s"))[0]) == {"scale"}
    with pytest.raises(CorruptPayload, match="lacks tensors"):
        wire.unpack(data, names={"nope"})
    with pytest.raises(ValueError, match="dtype"):
        wire.pack({"x": torch.zeros(2, dtype=torch.float64)}, {})
    with pytest.raises(ValueError, match="reserved"):
        wire.pack({}, {"sha256": "x"})


# -- bad input -----------------------------------------------------------------------------
def test_empty_and_truncated_bytes(payload):
    data = wire.encode(payload)
    _, start = header_of(data)
    with pytest.raises(CorruptPayload, match="truncated"):
        wire.decode(b"")
    for cut in (3, 8, start - 5, start, start + 100, len(data) - 1):
        with pytest.raises(CorruptPayload, match="truncated|tensors cover"):
            wire.decode(data[:cut])


def test_truncated_file(payload, tmp_path):
    path = tmp_path / "p.safetensors"
    path.write_bytes(wire.encode(payload)[:-10])
    with pytest.raises(CorruptPayload, match="truncated|tensors cover"):
        wire.load(path)
    path.write_bytes(b"")
    with pytest.raises(CorruptPayload, match="truncated"):
        wire.load(path)


def test_flipped_tensor_byte_fails_its_checksum(payload, tmp_path):
    data = bytearray(wire.encode(payload))
    header, start = header_of(bytes(data))
    begin, end = header["layers.1.v"]["data_offsets"]
    data[start + (begin + end) // 2] ^= 0x01
    with pytest.raises(CorruptPayload, match="layers.1.v.*sha256 mismatch"):
        wire.decode(bytes(data))
    path = tmp_path / "p.safetensors"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPayload, match="sha256 mismatch"):
        wire.load(path, layers=[1])
    wire.load(path, layers=[0])  # a partial load that skips the damaged tensor verifies what it reads


def test_edited_header_checksum_or_metadata(payload):
    data = wire.encode(payload)
    header, _ = header_of(data)
    sha = header["__metadata__"]["sha256"]
    edited = data.replace(sha.encode(), (("0" if sha[0] != "0" else "1") + sha[1:]).encode())
    with pytest.raises(CorruptPayload, match="checksum mismatch"):
        wire.decode(edited)
    producer = json.dumps(header["__metadata__"]["producer"])[:-1]  # '"sender' (same-length edit)
    edited = data.replace(producer.encode(), producer[:-1].encode() + b"X")
    with pytest.raises(CorruptPayload, match="checksum mismatch"):
        wire.decode(edited)


def test_absurd_header_length_is_refused_before_reading(payload):
    data = wire.encode(payload)
    with pytest.raises(CorruptPayload, match="exceeds the limit"):
        wire.decode((1 << 62).to_bytes(8, "little") + data[8:])
    with pytest.raises(CorruptPayload, match="exceeds the limit"):
        wire.decode(data, max_header_bytes=64)
    with pytest.raises(CorruptPayload, match="exceeds the limit"):
        wire.decode(data, max_total_bytes=16)


def test_non_json_header_and_bad_offsets(payload):
    junk = b"\xff\xfe not json at all"
    with pytest.raises(CorruptPayload, match="JSON"):
        wire.decode(len(junk).to_bytes(8, "little") + junk)
    data = wire.encode(payload)
    header, start = header_of(data)
    header["token_ids"]["data_offsets"][1] += 10**9
    head = json.dumps(header).encode()
    with pytest.raises(CorruptPayload, match="truncated|bytes for shape"):
        wire.decode(len(head).to_bytes(8, "little") + head + data[start:])
    header, _ = header_of(data)
    header["layers.0.k"]["dtype"] = "F64"
    head = json.dumps(header).encode()
    with pytest.raises(CorruptPayload, match="'F64' is not allowed"):
        wire.decode(len(head).to_bytes(8, "little") + head + data[start:])


def test_dtype_differing_from_declared_dtype(payload):
    """Tensors stored as float32 under metadata that declares float16: checksums fine, layout not."""
    meta = payload.meta.to_strings() | {"dtype": "float16"}
    with pytest.raises(CorruptPayload, match="declares dtype float16"):
        wire.decode(wire.pack(wire.payload_tensors(payload), meta))
    tensors = wire.payload_tensors(payload) | {"mask": payload.mask.to(torch.uint8)}
    with pytest.raises(CorruptPayload, match="mask is U8"):
        wire.decode(wire.pack(tensors, payload.meta.to_strings()))
    tensors = wire.payload_tensors(payload)
    del tensors["layers.0.v"]
    with pytest.raises(CorruptPayload, match="lacks tensors"):
        wire.decode(wire.pack(tensors, payload.meta.to_strings()))


def test_foreign_safetensors_file(tmp_path):
    plain = st_save({"weight": torch.zeros(2, 2)})
    with pytest.raises(CorruptPayload, match="not a kvrelay/1 payload"):
        wire.decode(plain)
    other = st_save({"weight": torch.zeros(2, 2)}, metadata={"format": "pt"})
    path = tmp_path / "model.safetensors"
    path.write_bytes(other)
    with pytest.raises(CorruptPayload, match="not a kvrelay/1 payload.*'pt'"):
        wire.load(path)


def test_wrong_model_is_incompatible(tiny_by_arch):
    from kvrelay.models.tiny import tiny_lm

    p = Agent(tiny_by_arch["llama"], "sender").prefill(random_ids(12, 3))
    data = wire.encode(p)
    assert_same(wire.decode(data, expect=tiny_by_arch["llama"].identity), p)
    other = tiny_lm("llama", seed=1)  # same config, different weights
    with pytest.raises(IncompatiblePayload, match="model_fingerprint") as e:
        wire.decode(data, expect=other.identity)
    assert e.value.field == "model_fingerprint"
    with pytest.raises(IncompatiblePayload) as e:
        wire.decode(data, expect=tiny_by_arch["gemma3"].identity)
    assert e.value.field == "model_fingerprint"


def test_read_meta_reads_only_the_header(payload, tmp_path):
    path = tmp_path / "p.safetensors"
    wire.save(payload, path, extra_meta={"expires_at": "123.5"})
    meta = wire.read_meta(path)
    assert meta["expires_at"] == "123.5" and meta["model_fingerprint"] == payload.meta.model_fingerprint
    assert "sha256" not in meta
    assert_same(wire.load(path), payload)  # store-side extras do not disturb the payload
    with pytest.raises(ValueError, match="override"):
        wire.encode(payload, extra_meta={"dtype": "float16"})


def test_decoded_tensors_own_their_memory(payload):
    data = bytearray(wire.encode(payload))
    p = wire.decode(data)
    data[:] = bytes(len(data))  # wipe the source buffer
    assert_same(p, payload)
    p.keys[0].add_(1)  # writable, and independent of any buffer


@pytest.mark.parametrize("codec", ["raw", "fp16", "bf16", "int8", "int4", "evict:0.5+fp16", "layers:0-1+int8"])
def test_decoded_nbytes_is_what_decode_allocates_read_from_the_header(payload, codec):
    """The count a receiver's byte budget refuses on before decoding: equal to the decoded payload's bytes
    for every codec (sliding layers, evicted tokens and dropped layers included), and from the header
    alone: a flipped tensor byte does not change it, a corrupt header is ``CorruptPayload``."""
    from kvrelay.kv import codecs

    data = (wire.encode(payload) if codec == "raw"
            else wire.pack(*codecs.compress(payload, codec, probe_ids=payload.token_ids[:, -4:]).to_wire()))
    assert wire.decoded_nbytes(data) == wire.decode(data).nbytes
    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    assert wire.decoded_nbytes(bytes(flipped)) == wire.decoded_nbytes(data)
    with pytest.raises(CorruptPayload):
        wire.decoded_nbytes(data[:-1])


def test_the_length_prefix_written_and_read_in_one_place(payload):
    """wire_header frames a header (length prefix, spaces to an 8-aligned data section) and reads the prefix
    back; a signed file and a store's parts are framed and read with the same two functions."""
    from kvrelay.kv.sign import Key, sign_parts
    from kvrelay.kv.wire_header import framed_header, header_length
    from kvrelay.transport.bytestore import header_bytes

    for n in range(0, 20):
        head = framed_header(b"{" + b"x" * n + b"}")
        assert len(head) % 8 == 0 and head[8:].rstrip(b" ") == b"{" + b"x" * n + b"}"
        assert header_length(head) == len(head) - 8 == int.from_bytes(head[:8], "little")
        assert header_bytes([memoryview(head[:3]), memoryview(head[3:] + b"tensors")]) == head
    with pytest.raises(CorruptPayload, match=r"^truncated payload: 7 bytes, expected at least 8"):
        header_length(bytes(7))
    key = Key("hmac", "k", b"\x07" * 32)  # made-up secret
    signed = sign_parts(wire.encode_parts(payload), key)
    assert header_length(signed[0]) == len(signed[0]) - 8 and len(signed[0]) % 8 == 0
    assert_same(wire.decode(b"".join(bytes(p) for p in signed)), payload)
    for cut in (5, 12):  # shorter than the prefix, or than the header it declares
        with pytest.raises(ValueError, match="length prefix and header as its first buffer"):
            sign_parts([bytes(signed[0][:cut]), *signed[1:]], key)
