"""The layout rules (which slots a layer holds, tensor names) and the one compatibility rule, without a model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.core.errors import IncompatiblePayload
from kvrelay.kv.compat import check_meta, require_raw
from kvrelay.kv.layout import (
    FULL,
    LAYER_TYPES,
    SLIDING,
    TOKEN_TENSORS,
    any_sliding,
    held_tokens,
    is_sliding,
    kv_tensor_names,
    tensor_name,
    window_slots,
)
from kvrelay.kv.payload import RAW, PayloadMeta
from kvrelay.models.identity import ModelIdentity, RopeSpec


# -- layout ------------------------------------------------------------------------------------------
def test_layer_kinds():
    assert LAYER_TYPES == ("full_attention", "sliding_attention") and (FULL, SLIDING) == LAYER_TYPES
    assert TOKEN_TENSORS == ("token_ids", "positions", "mask")
    assert is_sliding(SLIDING, 8) and not is_sliding(FULL, 8)
    assert not is_sliding(SLIDING, None) and not is_sliding(SLIDING, 0)  # no window: a full layer in effect
    assert any_sliding((FULL, SLIDING), 8) and not any_sliding((FULL, FULL), 8) and not any_sliding((SLIDING,), None)
    assert not any_sliding((), 8)


@pytest.mark.parametrize("total, want", [(0, 0), (1, 1), (6, 6), (7, 7), (8, 7), (23, 7)])
def test_sliding_layers_hold_window_minus_one(total, want):
    assert window_slots(8) == 7  # the new token is the window's last: transformers keeps window - 1
    assert held_tokens(SLIDING, 8, total) == want
    assert held_tokens(FULL, 8, total) == total
    assert held_tokens(SLIDING, None, total) == total


def test_tensor_names():
    assert tensor_name(0, "k") == "layers.0.k" and tensor_name(11, "v") == "layers.11.v"
    assert tensor_name(2, "k", "codes") == "layers.2.k.codes"
    assert tensor_name(2, "v", "") == "layers.2.v"
    for bad in ("K", "kv", "", "q"):
        with pytest.raises(ValueError, match="'k' or 'v'"):
            tensor_name(0, bad)
    assert kv_tensor_names(2) == ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"]
    assert kv_tensor_names(0) == []


# -- compatibility -------------------------------------------------------------------------------------
ROPE = (RopeSpec(FULL, (1.0, 0.5)), RopeSpec(SLIDING, (1.0, 0.25)))
IDENT = ModelIdentity(fingerprint="f" * 64, tokenizer_hash="t" * 64, arch="gemma3", num_layers=3, num_kv_heads=2,
                      head_dim=4, layer_types=(SLIDING, FULL, SLIDING), sliding_window=8, rope=ROPE)


def meta(**changes) -> PayloadMeta:
    return replace(PayloadMeta.from_identity(IDENT), **changes)


def field_of(m: PayloadMeta, **kw) -> str:
    with pytest.raises(IncompatiblePayload) as e:
        check_meta(m, IDENT, **kw)
    return e.value.field


def test_a_model_and_its_payload_find_the_rope_of_each_layer_type_alike():
    for holder in (IDENT, meta()):
        assert holder.rope_for(FULL) is ROPE[0] and holder.rope_for(SLIDING) is ROPE[1]
        with pytest.raises(KeyError, match="no rope parameters for layer type 'other'"):
            holder.rope_for("other")


def test_own_payload_is_compatible_complete_or_not():
    check_meta(meta(), IDENT)
    check_meta(meta(), IDENT, complete=True)
    part = meta(layer_indices=(1, 2), layer_types=(FULL, SLIDING))
    check_meta(part, IDENT)  # a partial payload is fine until a receiver needs every layer
    with pytest.raises(IncompatiblePayload, match="a receiver needs every layer") as e:
        check_meta(part, IDENT, complete=True)
    assert (e.value.field, e.value.expected, e.value.got) == ("layer_indices", (0, 1, 2), (1, 2))


def test_reading_tensors_needs_a_decoded_payload_and_with_complete_every_layer():
    require_raw(meta())
    require_raw(meta(), complete=True)
    with pytest.raises(IncompatiblePayload, match="decode the payload with its codec first") as e:
        require_raw(meta(codec="int8-g32"))
    assert (e.value.field, e.value.expected, e.value.got) == ("codec", RAW, "int8-g32")
    part = meta(layer_indices=(1, 2), layer_types=(FULL, SLIDING))
    require_raw(part)  # a partial raw payload can be read; an adapter that maps every layer needs them all
    with pytest.raises(IncompatiblePayload) as e:
        require_raw(part, complete=True)
    assert (e.value.field, e.value.expected, e.value.got) == ("layer_indices", (0, 1, 2), (1, 2))
    with pytest.raises(IncompatiblePayload) as e:
        require_raw(replace(part, codec="fp16"), complete=True)
    assert e.value.field == "layer_indices"  # the missing layers are named first


@pytest.mark.parametrize("changes, field", [
    ({"format": "kvrelay/2"}, "format"),
    ({"model_fingerprint": "e" * 64}, "model_fingerprint"),
    ({"tokenizer_hash": "u" * 64}, "tokenizer_hash"),
    ({"num_model_layers": 4, "layer_indices": (0, 1, 2)}, "num_model_layers"),
    ({"layer_types": (SLIDING, SLIDING, SLIDING)}, "layer_types"),
    ({"layer_types": (FULL, FULL, SLIDING)}, "layer_types"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"sliding_window": None}, "sliding_window"),
])
def test_each_difference_is_named(changes, field):
    m = meta(**changes)
    assert field_of(m) == field
    with pytest.raises(IncompatiblePayload) as e:
        check_meta(m, IDENT)
    assert e.value.got == (tuple(getattr(m, field)) if field == "layer_types" else getattr(m, field))


def test_first_difference_wins_in_a_fixed_order():
    assert field_of(meta(format="x", model_fingerprint="e" * 64)) == "format"
    assert field_of(meta(model_fingerprint="e" * 64, tokenizer_hash="u" * 64)) == "model_fingerprint"
    assert field_of(meta(tokenizer_hash="u" * 64, sliding_window=16)) == "tokenizer_hash"


def test_layer_types_compare_the_held_layers_only():
    check_meta(meta(layer_indices=(1,), layer_types=(FULL,)), IDENT)
    assert field_of(meta(layer_indices=(1,), layer_types=(SLIDING,))) == "layer_types"
    # a payload of a deeper model (layer 4 of 5) is refused by name, never an IndexError
    deeper = meta(num_model_layers=5, layer_indices=(0, 4), layer_types=(SLIDING, SLIDING))
    assert field_of(deeper) == "num_model_layers"
    wide = ModelIdentity(**{**{f: getattr(IDENT, f) for f in IDENT.__dataclass_fields__}, "num_layers": 5,
                            "layer_types": (SLIDING, FULL, SLIDING, FULL, SLIDING)})
    m = meta(num_model_layers=5, layer_indices=(0, 4), layer_types=(SLIDING, SLIDING))
    check_meta(m, wide)
    with pytest.raises(IncompatiblePayload) as e:
        check_meta(replace(m, layer_types=(SLIDING, FULL)), wide)
    assert e.value.field == "layer_types" and e.value.expected == (SLIDING, SLIDING)


def test_a_deeper_models_layer_just_past_the_end_is_refused_by_name():
    deeper = meta(num_model_layers=4, layer_indices=(0, 3), layer_types=(SLIDING, FULL))  # index 3 == IDENT's depth
    assert field_of(deeper) == "num_model_layers"


def test_an_engine_mode_is_its_own_compatibility_field():
    from kvrelay.core.errors import EngineMismatch

    other = meta(engine="int8")
    with pytest.raises(EngineMismatch) as e:
        check_meta(other, IDENT)
    assert (e.value.field, e.value.expected, e.value.got) == ("engine", "fp32", "int8")
    assert isinstance(e.value, IncompatiblePayload)
    check_meta(meta(engine="int8"), replace(IDENT, engine="int8"))
