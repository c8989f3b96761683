"""The fuser's training data on disk (``fuse.fuser_data``): the same examples as the in-memory pass, one file
per task, resumable, stale folders emptied; streamed feature statistics; batched steps."""

from __future__ import annotations

import pytest
import torch

from kvrelay.audit.tasks.task import Task
from kvrelay.fuse import align
from kvrelay.fuse import fuser as F
from kvrelay.fuse import fuser_data as FD
from kvrelay.fuse import fuser_train as FT
from kvrelay.fuse.bridge import TokenBridge
from kvrelay.models.tiny import tiny_lm

WORDS = ["four", "two", "one", "nine", "six", "zero", "three", "eight"]


@pytest.fixture(scope="module")
def pair():
    return tiny_lm("llama"), tiny_lm("qwen2", seed=1)  # receiver, sharer (one tokenizer)


def _tasks(n: int) -> list[Task]:
    long = " ".join(WORDS * 12)  # a reading over the token cap: skipped
    return [Task(id=f"t/{i}", task="t", regime="shared",
                 context=long if i == 2 else f"the code of vault {i} is {WORDS[i % 8]} {WORDS[(3 * i) % 8]}",
                 prompt=f"what is the code of vault {i}", answers=(f"{WORDS[i % 8]} {WORDS[(3 * i) % 8]}",),
                 scorer="qa_success") for i in range(n)]


def _disk(pair, tasks, work, want=5, layers=(0, 1, 2, 3), log=print):
    receiver, sharer = pair
    s_dir = FD.open_folder(work / "sharer", {"k": 1}, log)
    readings = FD.sharer_readings(sharer, tasks, set(layers), 64, want, s_dir)
    r_dir = FD.open_folder(work / "receiver", {"k": 1}, log)
    return readings, FD.receiver_examples(receiver, {t.id: t for t in tasks}, readings, TokenBridge(), r_dir)


def test_disk_examples_equal_the_in_memory_pass_and_skip_long_readings(tmp_path, pair):
    receiver, sharer = pair
    tasks = _tasks(8)
    readings, disk = _disk(pair, tasks, tmp_path)
    assert [torch.load(f, weights_only=False)["id"] for f in readings] == ["t/0", "t/1", "t/3", "t/4", "t/5"]
    memory = FT.receiver_pass(receiver, tasks, FT.sharer_pass(sharer, [t.context for t in tasks], set(range(4)), 64),
                              TokenBridge())
    assert len(disk) == 5 and [ex.task_id for ex in disk] == [ex.task_id for ex in memory[:5]]
    for a, b in zip(disk, memory[:5], strict=True):
        assert a.tail_ids == b.tail_ids and a.n_prompt == b.n_prompt
        assert all(torch.equal(x, y) for x, y in zip(a.own_k + a.own_v, b.own_k + b.own_v, strict=True))
        assert all(torch.equal(a.feats[s], b.feats[s]) for s in b.feats)
    assert isinstance(disk[1:], FD.DiskExamples) and disk[1:][0].task_id == "t/1"


def test_a_resumed_pass_reads_what_is_there_and_only_the_kept_layers(tmp_path, pair):
    tasks = _tasks(8)
    _disk(pair, tasks, tmp_path, want=2)  # stopped early
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "sharer").glob("*.pt")}
    readings, disk = _disk(pair, tasks, tmp_path, want=5, layers=(0, 1, 2, 3))
    assert all((tmp_path / "sharer" / n).stat().st_mtime_ns == t for n, t in before.items())  # not recomputed
    assert len(disk) == 5
    _, sparse = _disk(pair, tasks, tmp_path / "sparse", layers=(1, 3))
    assert set(sparse[0].feats) == {1, 3}


def test_a_folder_of_other_settings_is_emptied_and_a_changed_mix_refused(tmp_path, pair):
    tasks = _tasks(6)
    _disk(pair, tasks, tmp_path)
    notes = []
    folder = FD.open_folder(tmp_path / "sharer", {"k": 2}, notes.append)
    assert notes and not list(folder.glob("*.pt"))  # made from another key: removed, never mixed in
    FD.sharer_readings(pair[1], tasks, {0}, 64, 3, folder)
    renamed = [Task(id=f"u/{i}", task=t.task, regime=t.regime, context=t.context, prompt=t.prompt, answers=t.answers,
                    scorer=t.scorer) for i, t in enumerate(tasks)]
    with pytest.raises(ValueError, match="fitting mix changed"):
        FD.sharer_readings(pair[1], renamed, {0}, 64, 3, folder)


def test_streamed_statistics_equal_the_whole_set(tmp_path, pair):
    _, disk = _disk(pair, _tasks(8), tmp_path)
    layer_map = align.depth_proportional(4, 4)
    net = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
    FT.standardise(net, disk, layer_map)
    for t, s in enumerate(layer_map):
        x = torch.cat([ex.feats[s][0].float() for ex in disk])  # (N, F)
        assert torch.allclose(net.mu[t], x.mean(0), atol=1e-5)
        assert torch.allclose(net.sd[t], x.std(0).clamp_min(1e-3), atol=1e-4)


def test_a_batched_step_is_the_mean_of_its_examples_and_resumes_exactly(tmp_path, pair):
    receiver, _ = pair
    _, disk = _disk(pair, _tasks(8), tmp_path)
    layer_map = align.depth_proportional(4, 4)

    def fresh():
        net = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
        FT.standardise(net, disk, layer_map)
        return net

    cfg = FT.TrainConfig(steps=4, lr=2e-2, eval_every=4, batch=3)
    net = fresh()
    state = FT.train(net, receiver.model, receiver.identity, layer_map, disk, disk[:1], cfg)
    first = state.train[0]
    assert len(first["example"]) == 3  # three examples in the step
    ex = {e.task_id: e for e in disk}
    probe = fresh()
    gates = F.gate_values(probe.gate, F.tau_at(0, 4), torch.Generator().manual_seed(0 * 1_000_003 + 0))
    with torch.no_grad():
        want = sum(float(FT.example_loss(probe, receiver.model, receiver.identity, layer_map, ex[i], gates))
                   for i in first["example"]) / 3
    assert first["loss"] == pytest.approx(want, abs=1e-4)
    half = fresh()
    st = FT.train(half, receiver.model, receiver.identity, layer_map, disk, disk[:1], cfg, until=2)
    FT.save_checkpoint(tmp_path / "c.pt", half, st)
    resumed = F.FuserNet(4, 2 * 2 * 16, 2, 16, rank=8)
    FT.train(resumed, receiver.model, receiver.identity, layer_map, disk, disk[:1], cfg,
             FT.load_checkpoint(tmp_path / "c.pt", resumed))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(net.parameters(), resumed.parameters(), strict=True))


def test_a_checkpoint_resumes_only_with_the_settings_it_was_trained_with(tmp_path):
    """``fuse train`` run again continues its checkpoint; with another step size (or data, rank, batch...) it
    stops with a typed error naming what changed instead of mixing two runs."""
    from dataclasses import replace as swap

    from kvrelay.bench.fuse_fit import TrainSettings, train_fuser
    from kvrelay.core.errors import InvalidInput
    from kvrelay.models.loader import load_model

    s = TrainSettings(steps=2, examples=4, held_out=1, max_tokens=400, rank=4, eval_every=2)
    got = train_fuser("tiny:qwen2", "tiny:llama", load_model, s, work=tmp_path / "w", out=tmp_path / "a")
    assert got.steps == 2
    more = train_fuser("tiny:qwen2", "tiny:llama", load_model, swap(s, steps=4), work=tmp_path / "w",
                       out=tmp_path / "b")  # more steps of the same run: resumed
    assert more.steps == 4
    with pytest.raises(InvalidInput, match=r"lr 0.001 -> 0.0003"):
        train_fuser("tiny:qwen2", "tiny:llama", load_model, swap(s, steps=6, lr=3e-4), work=tmp_path / "w",
                    out=tmp_path / "c")
