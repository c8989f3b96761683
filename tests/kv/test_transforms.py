"""Pure payload transforms on synthetic payloads whose K/V entries name their own slot (no model, fast).

Layer 0 is full attention, layer 1 sliding with window 4 (holds the last 3 slots). Entry
``keys[j][b, h, s, d] = 1000 j + 100 b + s + d / 10`` (values: the same, negated), so a selection
can be read off the numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.kv.transforms import (
    concat,
    layer_rms,
    moment_matched_random,
    pad_batch,
    select_layers,
    select_tokens,
    shift_positions,
    to_dtype,
    unpad_row,
    with_noise,
    zeroed,
)
from kvrelay.models.identity import RopeSpec

FULL, SLIDING = "full_attention", "sliding_attention"
WINDOW = 4
ROPE = (RopeSpec(FULL, (1.0, 0.5)), RopeSpec(SLIDING, (0.25, 0.125)))


def make(T: int, *, B: int = 1, start: int = 0, producer: str = "p", round_: int = 0, fp: str = "f" * 64,
         layers: tuple[int, ...] = (0, 1)) -> KVPayload:
    types = tuple((FULL, SLIDING)[i] for i in layers)
    meta = PayloadMeta(model_fingerprint=fp, tokenizer_hash="t", arch="gemma3", num_model_layers=2,
                       layer_indices=layers, layer_types=types, sliding_window=WINDOW, rope=ROPE,
                       producer=producer, round=round_, created_at=1.0)
    keys, values = [], []
    for j in layers:
        held = T if j == 0 else min(T, WINDOW - 1)
        s = torch.arange(T - held, T, dtype=torch.float32)
        k = (1000 * j + 100 * torch.arange(B)[:, None, None, None] + s[None, None, :, None]
             + torch.arange(4)[None, None, None, :] / 10).expand(B, 2, held, 4).clone()  # (B, H, T_l, D)
        keys.append(k)
        values.append(-k)
    pos = (start + torch.arange(T)).expand(B, T).clone()
    return KVPayload(tuple(keys), tuple(values), (10 + torch.arange(T)).expand(B, T).clone(), pos,
                     torch.ones(B, T, dtype=torch.bool), meta)


def slots(t: torch.Tensor, row: int = 0) -> list[int]:
    """The slot numbers a (B, H, T_l, D) tensor holds, read off head 0, dim 0."""
    return [int(x) % 100 for x in t[row, 0, :, 0].abs().tolist()]


# -- select_layers ---------------------------------------------------------------------------------
def test_select_layers():
    p = make(6)
    q = select_layers(p, [1, 1])
    assert q.meta.layer_indices == (1,) and q.meta.layer_types == (SLIDING,)
    assert torch.equal(q.keys[0], p.keys[1]) and torch.equal(q.values[0], p.values[1])
    r = select_layers(p, [1, 0])  # sorted, whatever the order asked
    assert r.meta.layer_indices == (0, 1) and torch.equal(r.keys[0], p.keys[0])
    with pytest.raises(ValueError, match=r"layers \[2\] are not held"):
        select_layers(p, [0, 2])
    with pytest.raises(ValueError, match=r"layers \[0\] are not held"):
        select_layers(q, [0])


# -- select_tokens ---------------------------------------------------------------------------------
def test_select_tokens_on_full_and_sliding_layers():
    p = make(10)
    q = select_tokens(p, [0, 2, 7, 8, 9])
    assert q.token_ids[0].tolist() == [10, 12, 17, 18, 19] and q.positions[0].tolist() == [0, 2, 7, 8, 9]
    assert slots(q.keys[0]) == [0, 2, 7, 8, 9] and slots(q.values[0]) == [0, 2, 7, 8, 9]
    assert slots(q.keys[1]) == [7, 8, 9] and slots(q.values[1]) == [7, 8, 9]  # the last window - 1 kept slots
    short = select_tokens(p, [8, 9])
    assert slots(short.keys[1]) == [8, 9] and short.keys[1].shape[2] == 2
    prefix = select_tokens(make(3), [0, 1])  # a short payload: the sliding layer holds every slot
    assert slots(prefix.keys[1]) == [0, 1]


def test_select_tokens_refuses_what_a_sliding_layer_never_cached():
    p = make(10)
    with pytest.raises(ValueError, match=r"holding slots 7\.\.9; the selection needs slot 6"):
        select_tokens(p, [0, 6, 8, 9])
    assert slots(select_tokens(p, [0, 7, 8, 9]).keys[1]) == [7, 8, 9]


@pytest.mark.parametrize("index", [[], [[0, 1]], [2, 1], [1, 1], [-1, 3], [3, 10], [0, 5, 3]])
def test_select_tokens_validates_the_index(index):
    with pytest.raises(ValueError, match="index must be"):
        select_tokens(make(10), index)


def test_select_tokens_last_slot_is_allowed():
    assert select_tokens(make(10), [9]).positions[0].tolist() == [9]
    assert select_tokens(make(3), [0]).positions[0].tolist() == [0]


# -- shift_positions -------------------------------------------------------------------------------
def test_shift_rotates_each_layer_type_with_its_own_rope():
    p = make(3)
    unit = torch.zeros(1, 2, 3, 4)
    unit[..., 0] = 1.0  # first rotary pair (dims 0 and 2): (1, 0)
    p = KVPayload((unit, unit.clone()), p.values, p.token_ids, p.positions, p.mask, p.meta)
    d = 3
    q = shift_positions(p, d)
    for j, inv in ((0, 1.0), (1, 0.25)):  # full layer: inv_freq 1.0; sliding layer: 0.25
        k = q.keys[j][0, 0, 0]
        assert k.tolist() == pytest.approx([math.cos(d * inv), 0.0, math.sin(d * inv), 0.0], abs=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(q.values, p.values, strict=True))  # values carry no position
    assert q.positions[0].tolist() == [3, 4, 5]


def test_shift_composes_and_undoes():
    p = make(6, start=4)
    there = shift_positions(shift_positions(p, 5), -2)
    direct = shift_positions(p, 3)
    assert torch.equal(there.positions, direct.positions)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(there.keys, direct.keys, strict=True))
    back = shift_positions(direct, -3)
    assert torch.equal(back.positions, p.positions)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(back.keys, p.keys, strict=True))
    same = shift_positions(p, 0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(same.keys, p.keys, strict=True))


def test_shift_per_row_leaves_padding_alone():
    batch = pad_batch([make(3, start=0), make(5, start=2)])
    moved = shift_positions(batch, torch.tensor([10, 1]))
    assert moved.positions[0].tolist() == [0, 0, 10, 11, 12]  # padding slots keep their (unused) position
    assert moved.positions[1].tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="delta must be an int or shape"):
        shift_positions(batch, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="negative positions"):
        shift_positions(make(4, start=2), -3)
    assert shift_positions(make(4, start=2), -2).positions[0].tolist() == [0, 1, 2, 3]


# -- concat ------------------------------------------------------------------------------------------
def test_concat_appends_and_keeps_the_window():
    a, b = make(4, producer="a", round_=3), make(3, start=4, producer="b", round_=1)
    c = concat(a, b)
    assert c.token_ids[0].tolist() == a.token_ids[0].tolist() + b.token_ids[0].tolist()
    assert c.positions[0].tolist() == list(range(7)) and bool(c.mask.all())
    assert slots(c.keys[0]) == [0, 1, 2, 3, 0, 1, 2]  # a's four slots, then b's three
    assert c.keys[1].shape[2] == 3 and torch.equal(c.keys[1], b.keys[1])  # the window: b's last three
    assert torch.equal(c.values[1], b.values[1])
    assert c.meta.round == 3 and c.meta.producer == "b"
    assert concat(a, make(3, start=4, producer="")).meta.producer == "a"
    assert concat(make(4, round_=1), make(2, start=4, round_=5)).meta.round == 5
    small = concat(make(1), make(1, start=1))
    assert small.keys[1].shape[2] == 2 and slots(small.keys[1]) == [0, 0]


def test_concat_refuses_what_cannot_follow():
    a = make(4)
    with pytest.raises(ValueError, match="same model and layers"):
        concat(a, make(2, start=4, fp="e" * 64))
    with pytest.raises(ValueError, match="same model and layers"):
        concat(a, make(2, start=4, layers=(0,)))
    with pytest.raises(ValueError, match="batch sizes differ"):
        concat(a, make(2, start=4, B=2))
    with pytest.raises(ValueError, match="must not be padded"):
        concat(pad_batch([make(4), make(4)]), pad_batch([make(2, start=4), make(1, start=4)]))
    with pytest.raises(ValueError, match="must come after"):
        concat(a, make(2, start=3))
    concat(a, make(2, start=4))
    concat(a, make(2, start=9))  # a gap in positions is allowed


# -- pad_batch / unpad_row -----------------------------------------------------------------------------
def test_pad_batch_left_pads_and_unpad_row_inverts_it():
    rows = [make(2, round_=1), make(6, round_=4), make(4)]
    batch = pad_batch(rows)
    assert batch.mask.tolist() == [[False] * 4 + [True] * 2, [True] * 6, [False] * 2 + [True] * 4]
    assert batch.token_ids[0].tolist() == [0, 0, 0, 0, 10, 11] and batch.positions[2].tolist() == [0, 0, 0, 1, 2, 3]
    assert batch.keys[0].shape == (3, 2, 6, 4) and batch.keys[1].shape == (3, 2, 3, 4)
    assert bool((batch.keys[0][0, :, :4] == 0).all()) and bool((batch.values[1][0, :, :1] == 0).all())
    assert batch.meta.round == 4
    for i, r in enumerate(rows):
        back = unpad_row(batch, i)
        for name in ("token_ids", "positions", "mask"):
            assert torch.equal(getattr(back, name), getattr(r, name)), (i, name)
        for x, y in zip((*back.keys, *back.values), (*r.keys, *r.values), strict=True):
            assert torch.equal(x, y), i


def test_pad_batch_refuses_mixed_payloads():
    with pytest.raises(ValueError, match="at least one"):
        pad_batch([])
    assert torch.equal(pad_batch([make(3)]).keys[0], make(3).keys[0])
    with pytest.raises(ValueError, match="model_fingerprint differ"):
        pad_batch([make(3), make(3, fp="e" * 64)])
    with pytest.raises(ValueError, match="layer_indices differ"):
        pad_batch([make(3), make(3, layers=(0,))])
    with pytest.raises(ValueError, match="dtype differ"):
        pad_batch([make(3), to_dtype(make(3), "float16")])
    with pytest.raises(ValueError, match="codec differ"):
        pad_batch([make(3), make(3).with_meta(codec="int8-g32")])


# -- dtype and the audit's interventions -----------------------------------------------------------------
def test_to_dtype():
    for dt, name in ((torch.float16, "float16"), ("bfloat16", "bfloat16"), (torch.float32, "float32")):
        q = to_dtype(make(3), dt)
        assert q.meta.dtype == name and all(k.dtype == q.keys[0].dtype for k in (*q.keys, *q.values))
        assert q.keys[0].dtype == (dt if isinstance(dt, torch.dtype) else torch.bfloat16)
        assert torch.equal(q.token_ids, make(3).token_ids)


def test_zeroed_keeps_everything_but_the_content():
    p = make(5)
    z = zeroed(p)
    assert all(bool((t == 0).all()) and t.shape == u.shape for t, u in zip((*z.keys, *z.values), (*p.keys, *p.values),
                                                                          strict=True))
    assert torch.equal(z.token_ids, p.token_ids) and z.meta == p.meta


def test_layer_rms_over_valid_slots():
    t = torch.tensor([3.0, 4.0, 100.0]).reshape(1, 1, 3, 1)  # (1, 1, 3, 1)
    valid = torch.tensor([True, True, False]).reshape(1, 1, 3, 1)
    assert layer_rms(t, valid) == pytest.approx(math.sqrt(12.5))
    assert layer_rms(t, torch.zeros_like(valid)) == 0.0


def test_moment_matched_random_matches_each_rows_moments_and_zeros_padding():
    g = torch.Generator().manual_seed(0)
    batch = pad_batch([make(3), make(6)])
    r = moment_matched_random(batch, g)
    assert bool((r.keys[0][0, :, :3] == 0).all())  # padding slots stay empty
    for j in (0, 1):
        for real, fake in ((batch.keys[j], r.keys[j]), (batch.values[j], r.values[j])):
            for row in (0, 1):
                held = real.shape[2]
                n_valid = int(batch.mask[row, -held:].sum())
                x, y = real[row, :, -n_valid:].double(), fake[row, :, -n_valid:].double()
                assert not torch.equal(x, y)
                assert abs(y.mean() - x.mean()) < 0.35 * x.std(unbiased=False) + 1e-6, (j, row)
                assert float(y.std(unbiased=False)) == pytest.approx(float(x.std(unbiased=False)), rel=0.35), (j, row)
    again = moment_matched_random(batch, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(r.keys, again.keys, strict=True))


def test_with_noise_scales_with_sigma_and_spares_padding():
    batch = pad_batch([make(3), make(6)])
    assert all(torch.equal(a, b) for a, b in zip(with_noise(batch, 0.0).keys, batch.keys, strict=True))
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        with_noise(batch, -0.1)
    n = with_noise(batch, 0.5, torch.Generator().manual_seed(1))
    assert torch.equal(n.keys[0][0, :, :3], batch.keys[0][0, :, :3])  # padding untouched
    for j in (0, 1):
        for real, noisy in ((batch.keys[j], n.keys[j]), (batch.values[j], n.values[j])):
            valid = batch.mask[:, -real.shape[2]:][:, None, :, None]
            ratio = layer_rms(noisy - real, valid) / layer_rms(real, valid)
            assert ratio == pytest.approx(0.5, rel=0.3), j


def test_layer_rms_of_one_entry_and_of_a_half_precision_cache():
    one = torch.tensor([3.0, 4.0, 100.0]).reshape(1, 1, 3, 1)  # (1, 1, 3, 1)
    assert layer_rms(one, torch.tensor([True, False, False]).reshape(1, 1, 3, 1)) == 3.0
    half = torch.tensor([300.0, 400.0], dtype=torch.float16).reshape(1, 1, 2, 1)  # squares overflow float16
    assert layer_rms(half, torch.ones(1, 1, 2, 1, dtype=torch.bool)) == pytest.approx(math.sqrt(125000.0))


def test_moment_matched_random_reproduces_a_row_of_one_real_entry():
    p = make(1, layers=(0,))
    p = KVPayload((p.keys[0][:, :1, :, 1:2],), (p.values[0][:, :1, :, 1:2],), p.token_ids, p.positions, p.mask,
                  p.meta)  # keys (1, 1, 1, 1) = 0.1: mean is the entry, std 0
    r = moment_matched_random(p, torch.Generator().manual_seed(0))
    assert float(p.keys[0]) != 0.0
    assert torch.equal(r.keys[0], p.keys[0]) and torch.equal(r.values[0], p.values[0])


def test_with_noise_is_reproducible_from_its_generator():
    batch = pad_batch([make(3), make(6)])
    n1 = with_noise(batch, 0.5, torch.Generator().manual_seed(7))
    n2 = with_noise(batch, 0.5, torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip((*n1.keys, *n1.values), (*n2.keys, *n2.values), strict=True))
