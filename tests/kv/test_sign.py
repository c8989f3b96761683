"""Signed payloads: HMAC-SHA256 and Ed25519 over the unsigned root; a receiver holding keys refuses an
unsigned, re-signed, wrongly keyed or edited payload with a typed error naming the producer."""

from __future__ import annotations

import json

import pytest
import torch

from kvrelay.core.errors import BadSignature, CorruptPayload, InvalidInput, UnsignedPayload
from kvrelay.kv import wire
from kvrelay.kv.layout import FULL
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.kv.sign import Key, Keyring, check_signature, keyring_from, new_key, parse_keys, sign_parts
from kvrelay.models.identity import ModelIdentity, RopeSpec
from kvrelay.transport.payloads import decode_bytes, get_payload, put_payload, save_payload
from kvrelay.transport.stores import open_store

IDENT = ModelIdentity(fingerprint="a" * 64, tokenizer_hash="t" * 64, arch="llama", num_layers=2, num_kv_heads=2,
                      head_dim=8, layer_types=(FULL, FULL), sliding_window=None, rope=(RopeSpec(FULL, (1.0, 0.5)),))
HMAC = Key("hmac", "team", bytes(range(32)))
ED = Key("ed25519-private", "planner-ed", bytes(range(1, 33)), ("planner",))


def payload(producer: str = "planner", seed: int = 0) -> KVPayload:
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(1, 2, 6, 8, generator=g) for _ in range(4)]  # (1, H, T, D)
    return KVPayload(tuple(kv[:2]), tuple(kv[2:]), torch.arange(3, 9)[None], torch.arange(6)[None],
                     torch.ones(1, 6, dtype=torch.bool), PayloadMeta.from_identity(IDENT, producer=producer, round=1))


def signed(p: KVPayload, key: Key) -> bytes:
    return b"".join(bytes(b) for b in sign_parts(wire.encode_parts(p), key))


def same(a: KVPayload, b: KVPayload) -> bool:
    return all(torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True))


@pytest.mark.parametrize("key", [HMAC, ED], ids=["hmac", "ed25519"])
def test_a_signed_payload_verifies_and_decodes_to_the_same_payload(key):
    p = payload()
    data = signed(p, key)
    receiver = Keyring((key.public(),))
    assert check_signature(data, receiver) == key.id
    assert same(decode_bytes(data, expect=IDENT, keys=receiver), p)
    assert same(wire.decode(data), p)  # a signed file is a plain kvrelay/1 file to a reader without keys
    assert json.loads(wire.read_meta(data)["signature"])["alg"] == key.alg
    unsigned_root = wire.read_meta(wire.encode(p))  # signing keeps the unsigned root as what is signed
    assert wire.read_meta(data)["producer"] == unsigned_root["producer"]


def test_a_receiver_with_keys_refuses_an_unsigned_payload_naming_the_producer():
    with pytest.raises(UnsignedPayload, match="'planner'") as e:
        decode_bytes(wire.encode(payload()), keys=Keyring((HMAC,)))
    assert e.value.producer == "planner"
    decode_bytes(wire.encode(payload()), keys=Keyring())  # an empty keyring asks for nothing


def test_an_edited_payload_with_recomputed_checksums_fails_its_signature():
    """The forger keeps the signature field and rewrites a tensor and every checksum: the wire checks pass."""
    data = signed(payload(), HMAC)
    tensors, meta = wire.unpack(data)
    tensors["layers.0.k"] = tensors["layers.0.k"] + 0.01
    forged = wire.pack(tensors, meta)
    wire.decode(forged)  # checksums consistent
    with pytest.raises(BadSignature, match="does not match") as e:
        decode_bytes(forged, keys=Keyring((HMAC,)))
    assert (e.value.producer, e.value.key_id) == ("planner", "team")
    meta["producer"] = "fixer"  # or relabel who made it
    with pytest.raises(BadSignature, match="'fixer'"):
        decode_bytes(wire.pack(wire.unpack(data)[0], meta), keys=Keyring((HMAC,)))


def test_a_forgery_re_signed_without_the_key_is_refused():
    forger = Key("hmac", "team", b"x" * 32)  # the right key id, another secret
    with pytest.raises(BadSignature, match="does not match"):
        check_signature(signed(payload(), forger), Keyring((HMAC,)))
    other_ed = Key("ed25519-private", "planner-ed", bytes(range(2, 34)), ("planner",))
    with pytest.raises(BadSignature, match="does not match"):
        check_signature(signed(payload(), other_ed), Keyring((ED.public(),)))
    with pytest.raises(BadSignature, match="holds no key of that id"):
        check_signature(signed(payload(), new_key("hmac", "stranger")), Keyring((HMAC,)))
    with pytest.raises(BadSignature, match="signed as 'hmac' but the key is 'ed25519'"):
        check_signature(signed(payload(), Key("hmac", "planner-ed", b"y" * 32)), Keyring((ED.public(),)))


def test_a_key_bound_to_producers_signs_for_them_only():
    with pytest.raises(ValueError, match="not for producer 'fixer'"):
        sign_parts(wire.encode_parts(payload("fixer")), ED)
    unbound = Key("ed25519-private", ED.id, ED.secret)  # the same key without the binding signs anything...
    with pytest.raises(BadSignature, match="signs only for \\['planner'\\]"):  # ...the receiver still refuses it
        check_signature(signed(payload("fixer"), unbound), Keyring((ED.public(),)))
    with pytest.raises(ValueError, match="public key"):
        ED.public().sign("0" * 64)


def test_a_malformed_signature_field_is_refused():
    tensors, meta = wire.unpack(wire.encode(payload()))
    for bad in ("not json", json.dumps({"alg": "hmac", "key": "team"}), json.dumps({"alg": 1, "key": "t", "sig": "x"})):
        with pytest.raises(BadSignature, match="signature field"):
            check_signature(wire.pack(tensors, {**meta, "signature": bad}), Keyring((HMAC,)))
    with pytest.raises(BadSignature, match="does not match"):
        check_signature(wire.pack(tensors, {**meta, "signature": json.dumps(
            {"alg": "ed25519", "key": "planner-ed", "sig": "zz"})}), Keyring((ED.public(),)))


@pytest.mark.parametrize("codec", ["raw", "fp16", "int8"])
def test_signed_payloads_travel_through_stores_and_files_in_every_codec(codec, tmp_path):
    store = open_store(tmp_path / "store")
    keyring = Keyring((HMAC,))
    k = put_payload(store, payload(), codec, signer=HMAC)
    got = get_payload(store, k, expect=IDENT, keys=keyring)
    assert got.num_tokens == 6 and got.meta.producer == "planner"
    save_payload(tmp_path / "p.kv", payload(), codec, signer=HMAC)
    decode_bytes((tmp_path / "p.kv").read_bytes(), keys=keyring)
    with pytest.raises(UnsignedPayload):
        get_payload(store, put_payload(store, payload(seed=1), codec), keys=keyring)


def test_a_corrupt_signed_file_is_still_corrupt_first():
    data = bytearray(signed(payload(), HMAC))
    data[40] ^= 1  # inside the header
    with pytest.raises(CorruptPayload):
        decode_bytes(bytes(data), keys=Keyring((HMAC,)))


def test_keys_come_from_a_file_or_the_environment_and_bad_lines_never_echo_secrets(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# team key\n{HMAC.to_line()}\n{ED.public().to_line()}  # planner's public key\n")
    ring = keyring_from(f)
    assert [k.id for k in ring.keys] == ["team", "planner-ed"] and ring.keys[1].producers == ("planner",)
    assert ring.signer("planner") == HMAC and ring.signer("x") == HMAC
    assert Keyring((ED.public(),)).signer("planner") is None  # a public key never signs
    env = {"KVRELAY_KEYS": f"{HMAC.to_line()}; {ED.to_line()}"}
    assert [k.id for k in keyring_from(environ=env).keys] == ["team", "planner-ed"]
    assert not keyring_from(environ={})
    secret = "ab" * 20
    for text, why in ((f"hmac:team:{secret}zz", "non-hexadecimal"), (f"hmac:team:{'ab' * 4}", "at least 16 bytes"),
                      (f"rsa:team:{secret}", "kind must be one of"), (f"hmac:team:{secret} owner=me", "unknown option"),
                      (f"hmac:a:{secret}\nhmac:a:{secret}", "unique"), ("hmac:team", "KIND:ID:HEX")):
        with pytest.raises(InvalidInput, match=why) as e:
            parse_keys(text)
        assert secret not in str(e.value)
    with pytest.raises(InvalidInput, match="cannot be read"):
        keyring_from(tmp_path / "absent")
