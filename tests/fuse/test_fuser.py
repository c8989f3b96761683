"""The fuser on tiny random models: closed gates are the receiver exactly, artefacts round-trip,
other models are refused, and training lowers the answer loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvrelay.agents.agent import Agent
from kvrelay.audit.tasks.task import Task
from kvrelay.core.errors import AdapterMismatch, IncompatiblePayload
from kvrelay.fuse import align, artefact
from kvrelay.fuse import fuser as F
from kvrelay.fuse import fuser_train as FT
from kvrelay.fuse.bridge import TokenBridge
from kvrelay.kv.cache import to_cache
from kvrelay.kv.transforms import select_layers
from kvrelay.models.generate import forward_all
from kvrelay.models.tiny import tiny_lm

CODES = [("four", "two"), ("one", "nine"), ("six", "zero"), ("three", "eight")]


@pytest.fixture(scope="module")
def pair():
    return tiny_lm("llama"), tiny_lm("qwen2", seed=1)  # receiver, sharer (one tokenizer, other weights)


@pytest.fixture(scope="module")
def examples(pair):
    receiver, sharer = pair
    tasks = [Task(id=f"t/{i}", task="t", regime="shared", context=f"the code of the red vault is {a} {b}",
                  prompt="what is the code of the red vault", answers=(f"{a} {b}",), scorer="qa_success")
             for i, (a, b) in enumerate(CODES)]
    shared = FT.sharer_pass(sharer, [t.context for t in tasks], set(range(4)), 64)
    return FT.receiver_pass(receiver, tasks, shared, TokenBridge())


def _adapter(pair, gate: float, seed: int = 0) -> F.FuserAdapter:
    receiver, sharer = pair
    net = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (net.up_k, net.up_v, net.weight_b):
            p.copy_(torch.randn(p.shape, generator=g))
        net.gate.fill_(gate)
    config, tensors = F.to_artefact(net, ("receiver", receiver.identity), ("sharer", sharer.identity),
                                    align.depth_proportional(4, 4), {"datasets": {"test": 1}, "steps": 0}, {})
    return F.FuserAdapter(config, tensors, receiver.model)


def _logits(receiver, payload, new):
    pos = torch.arange(payload.num_tokens, payload.num_tokens + len(new))[None]
    return forward_all(receiver.model, torch.tensor([new]), pos, to_cache(payload, receiver.model.config), None)


def test_closed_gates_leave_the_receiver_exactly_unchanged(pair):
    receiver, sharer = pair
    ctx, new = "the code of the red vault is four two", [22, 15, 30, 31]
    own = Agent(receiver).read(ctx)
    closed = Agent(receiver, adapter=_adapter(pair, gate=-1.0)).check(Agent(sharer).read(ctx))
    assert closed.meta.adapter.startswith("fuser@") and closed.meta.model_fingerprint == receiver.identity.fingerprint
    assert all(torch.equal(a, b) for a, b in zip(closed.keys + closed.values, own.keys + own.values, strict=True))
    assert torch.equal(_logits(receiver, closed, new), _logits(receiver, own, new))
    opened = Agent(receiver, adapter=_adapter(pair, gate=1.0)).check(Agent(sharer).read(ctx))  # the same weights, open
    assert opened.keys[0].shape == own.keys[0].shape and torch.equal(opened.positions, own.positions)
    assert not torch.allclose(_logits(receiver, opened, new), _logits(receiver, own, new), atol=1e-3)


def test_artefact_round_trip_and_refusals(tmp_path, pair):
    receiver, sharer = pair
    adapter = _adapter(pair, gate=1.0)
    folder = artefact.save(tmp_path / "f", adapter.config, adapter.tensors)
    loaded = F.FuserAdapter.load(folder, receiver)
    assert loaded.config == adapter.config and loaded.fingerprint == F.FuserAdapter.load(folder, receiver).fingerprint
    p = Agent(sharer).read("the code of the blue vault is one two")
    a, b = adapter.adapt(p, receiver.identity), loaded.adapt(p, receiver.identity)
    assert all(torch.allclose(x, y, atol=2e-2) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))
    other = tiny_lm("llama", seed=3)
    with pytest.raises(AdapterMismatch, match="receiver"):
        F.FuserAdapter.load(folder, other)
    with pytest.raises(AdapterMismatch, match="receiver"):
        loaded.adapt(p, other.identity)
    with pytest.raises(AdapterMismatch, match="sharer"):
        loaded.adapt(Agent(other).read("the code"), receiver.identity)
    with pytest.raises(IncompatiblePayload, match="decode the payload with its codec first"):
        loaded.adapt(p.with_meta(codec="int8"), receiver.identity)
    with pytest.raises(IncompatiblePayload, match="layer_indices"):
        loaded.adapt(select_layers(p, [0, 1]), receiver.identity)
    artefact.save(tmp_path / "r", replace(adapter.config, method="ridge"), adapter.tensors)
    with pytest.raises(ValueError, match="not a fuser"):
        F.FuserAdapter.load(tmp_path / "r", receiver)


def test_gumbel_gates_and_annealing():
    logits = torch.tensor([2.0, -2.0, 0.5])
    assert torch.equal(F.gate_values(logits), torch.tensor([1.0, 0.0, 1.0]))
    cold = F.gate_values(logits, 0.01, torch.Generator().manual_seed(0))
    assert bool(((cold < 0.01) | (cold > 0.99)).all())  # near-hard at a low temperature
    assert F.tau_at(0, 100) == pytest.approx(1.0) and F.tau_at(99, 100) == pytest.approx(0.1)
    assert F.tau_at(50, 101) == pytest.approx(0.1 ** 0.5)


def test_training_lowers_the_answer_loss_and_resumes_exactly(tmp_path, pair, examples):
    receiver, _ = pair
    layer_map = align.depth_proportional(4, 4)

    def fresh():
        net = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
        FT.standardise(net, examples, layer_map)
        return net

    net = fresh()
    before, alone = FT.held_losses(net, receiver.model, receiver.identity, layer_map, examples)
    assert before == pytest.approx(alone, abs=1e-6)  # zero-initialised projections: the receiver alone
    cfg = FT.TrainConfig(steps=12, lr=2e-2, eval_every=12)
    state = FT.train(net, receiver.model, receiver.identity, layer_map, examples, examples, cfg)
    after, _ = FT.held_losses(net, receiver.model, receiver.identity, layer_map, examples)
    assert after < before - 0.05
    assert [h["step"] for h in state.held] == [12] and len(state.train) == 12
    assert all(not p.requires_grad for p in receiver.model.parameters())

    half = fresh()  # 5 steps of the same schedule, checkpoint, reload into a new net, the rest: the same weights
    st = FT.train(half, receiver.model, receiver.identity, layer_map, examples, examples, cfg, until=5)
    FT.save_checkpoint(tmp_path / "c.pt", half, st)
    resumed = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
    st = FT.load_checkpoint(tmp_path / "c.pt", resumed)
    assert st.step == 5
    FT.train(resumed, receiver.model, receiver.identity, layer_map, examples, examples, cfg, st)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(net.parameters(), resumed.parameters(), strict=True))


def test_the_best_held_out_fuser_is_kept_beside_the_last(tmp_path, pair, examples):
    """``TrainState.best`` is the fuser at the lowest held-out loss; it survives a checkpoint round trip."""
    receiver, _ = pair
    layer_map = align.depth_proportional(4, 4)
    net = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
    FT.standardise(net, examples, layer_map)
    # Six steps at the step size that lowers the loss, then six more after a fresh optimizer at a step size that
    # wrecks the fuser (every weight moves by ~50): the best held-out fuser is in the middle by construction,
    # not by the chance of one machine's floating point.
    good, wreck = (FT.TrainConfig(steps=12, lr=lr, eval_every=3) for lr in (2e-2, 50.0))
    state = FT.train(net, receiver.model, receiver.identity, layer_map, examples[2:], examples[:2], good, until=6)
    state.optimizer = None
    state = FT.train(net, receiver.model, receiver.identity, layer_map, examples[2:], examples[:2], wreck, state)
    losses = {h["step"]: h["fused"] for h in state.held}
    assert list(losses) == [3, 6, 9, 12]
    assert state.best["step"] == min(losses, key=losses.get) and state.best["fused"] == min(losses.values())
    assert state.best["step"] not in (3, 12)  # neither the first nor the last: keeping either would fail here
    kept = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
    kept.load_state_dict(state.best["net"])
    got, _ = FT.held_losses(kept, receiver.model, receiver.identity, layer_map, examples[:2])
    assert got == pytest.approx(state.best["fused"], abs=1e-5)  # the kept weights are the ones that scored it
    FT.save_checkpoint(tmp_path / "c.pt", net, state)
    back = FT.load_checkpoint(tmp_path / "c.pt", F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8))
    assert back.best["step"] == state.best["step"]
    assert all(torch.equal(back.best["net"][k], state.best["net"][k]) for k in state.best["net"])
