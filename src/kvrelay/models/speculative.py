"""Speculative greedy decoding over a cache: draft a few tokens, verify them in one forward, keep the
ones the model itself would have written, roll the cache back over the rest.

Exact under greedy decoding: a drafted token is kept only when it equals the argmax the model computes
at its position given every kept token before it, so the output is plain greedy decoding's, token for
token — up to the float rounding of one multi-token forward against one-token ones. The verify
forward multiplies with the weights a one-token call uses (``models.engine.decode_weights``), so in
a compact engine mode it computes what the plain decode loop computes, and attends over the cache
with grouped key/value heads as they are (``models.attention.gqa_causal_attention``), as a one-token
step does, instead of a copy of the cache with every head repeated. Like the plain decode loop, it
writes into a cache with room reserved (``models.reserve``), and rolling back a rejected draft keeps
that room instead of falling back to concatenation.

Drafters (``Drafter``: ``propose(seq, limit)``, then ``update(seq, proposed, accepted)``):

* ``LookupDrafter`` (prompt lookup): the continuation of the most recent earlier occurrence of the last
  ``n`` tokens, among the tokens the cache holds (a relayed payload's token ids, the prompt) and the
  output so far. No second model; it pays when the answer quotes what was relayed.
* ``ModelDrafter``: a smaller model of the same tokenizer continues from its own cache of the same
  tokens and writes greedy tokens one at a time.

Both adapt their draft length as Hugging Face's assisted generation does: +2 after a fully accepted
draft, -1 after a partly accepted one (never below ``min_draft``, never above ``num_draft``). A draft
that keeps too little costs a wider verify forward (and, for a draft model, its own forwards) for no
gain, so drafting where it does not pay is stopped: after a draft that keeps fewer than
``(min_draft + 1) // 2`` tokens (with the default ``min_draft`` = 1: none) the next ones are
``min_draft`` tokens long and drafting pauses for 1 step, then 2, 4, ... up to ``MAX_PAUSE`` steps
while the probes keep missing; a draft that pays ends the pause. Where drafts never pay, the cost
falls to about one probe per ``MAX_PAUSE`` steps; where they do, drafting never pauses.

``min_draft`` is for CPUs, where a forward of 2 or 3 tokens can cost as much as 2 or 3 one-token
steps while one of 5 costs about 2 (``benchmarks/verify_cost.py`` measures it; docs/engine.md): there
short drafts never pay, and with ``min_draft`` = 4 a draft pays when it keeps 2 tokens or more.

Layout: one row (B = 1). ``seq`` is every token the target cache holds (``history``) followed by the
tokens written since; the token at ``seq[i]`` sits at position ``origin + i`` with
``origin = next_position - len(history)`` (consecutive positions after the history).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvrelay.models.attention import gqa_causal_attention
from kvrelay.models.engine import decode_weights
from kvrelay.models.generate import forward_all, forward_last
from kvrelay.models.reserve import reserved


class Drafter(Protocol):
    def propose(self, seq: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens guessed to follow ``seq``."""

    def update(self, seq: Sequence[int], proposed: int, accepted: int) -> None:
        """``seq`` now ends with the ``accepted`` first of the ``proposed`` tokens of the last proposal."""


@dataclass(frozen=True, slots=True)
class PromptLookup:
    """Prompt-lookup drafting: match the last ``max_ngram``..``min_ngram`` tokens, propose what followed."""

    num_draft: int = 8  # most tokens proposed per verify forward
    max_ngram: int = 3
    min_ngram: int = 2
    min_draft: int = 1  # fewest tokens proposed per verify forward (module docstring)

    def __post_init__(self):
        check_draft_lengths(self.min_draft, self.num_draft)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"expected 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def drafter(self, lm, history: Sequence[int], next_position: int) -> LookupDrafter:
        return LookupDrafter(self, history)


MAX_PAUSE = 32  # most decode steps without drafting between two probes that keep missing


def check_draft_lengths(least: int, most: int) -> None:
    if not 1 <= least <= most:
        raise ValueError(f"expected 1 <= min_draft <= num_draft, got min_draft={least}, num_draft={most}")


class _Adaptive:
    """The draft length (+2 after a fully accepted draft, -1 after a partly accepted one, within [least, most])
    and the pause after drafts that kept fewer than ``(least + 1) // 2`` tokens (1, 2, 4, ... ``MAX_PAUSE``
    steps)."""

    def __init__(self, most: int, least: int = 1):
        check_draft_lengths(least, most)
        self.most, self.least, self.now = most, least, most
        self.pays = (least + 1) // 2  # tokens a draft must keep to pay for its wider forward
        self.skip = 0  # steps left in the current pause
        self.wait = 1  # the next pause's length

    def take(self) -> int:
        """The length of this step's draft: 0 while paused. Called once per decode step."""
        if self.skip:
            self.skip -= 1
            return 0
        return self.now

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        if accepted < self.pays and accepted < proposed:
            self.now, self.skip, self.wait = self.least, self.wait, min(MAX_PAUSE, 2 * self.wait)
            return
        self.wait = 1
        self.now = min(self.most, self.now + 2) if accepted == proposed else max(self.least, self.now - 1)


class LookupDrafter:
    """Index of every n-gram in ``seq`` -> the index just after its latest occurrence (one pass, kept up to date)."""

    def __init__(self, settings: PromptLookup, history: Sequence[int]):
        self.s = settings
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 1  # n-grams ending before seq[j] are indexed for every j < indexed
        self.length = _Adaptive(settings.num_draft, settings.min_draft)
        self._index_upto(history)

    def _index_upto(self, seq: Sequence[int]) -> None:
        for j in range(self.indexed, len(seq)):  # j: where the continuation starts; it needs seq[j] to exist
            for n in range(self.s.min_ngram, min(self.s.max_ngram, j) + 1):
                self.index[tuple(seq[j - n: j])] = j
        self.indexed = max(self.indexed, len(seq))

    def propose(self, seq: Sequence[int], limit: int) -> list[int]:
        self._index_upto(seq)
        k = min(self.length.take(), limit)
        if k < 1:
            return []
        for n in range(min(self.s.max_ngram, len(seq)), self.s.min_ngram - 1, -1):
            j = self.index.get(tuple(seq[len(seq) - n:]))
            if j is not None:
                return list(seq[j: j + k])
        return []

    def update(self, seq: Sequence[int], proposed: int, accepted: int) -> None:
        self.length.update(proposed, accepted)  # ``seq`` is indexed at the next proposal


class ModelDrafter:
    """A draft model over its own cache of ``seq[:fed]``: proposes its greedy continuation."""

    def __init__(self, model, cache, fed: int, origin: int, num_draft: int = 4, min_draft: int = 1):
        self.model, self.cache, self.fed, self.origin = model, cache, fed, origin
        self.length = _Adaptive(num_draft, min_draft)
        self._start = fed  # len(seq) when the last proposal was made
        cache.activate_past_recording()  # sliding-window layers keep what a rollback may need

    def propose(self, seq: Sequence[int], limit: int) -> list[int]:
        k = min(self.length.take(), limit)
        if k < 1:
            return []
        pending = torch.tensor([list(seq[self.fed:])], dtype=torch.int64)  # (1, p): what the draft has not read
        pos = torch.arange(self.origin + self.fed, self.origin + len(seq), dtype=torch.int64)[None]  # (1, p)
        logits = forward_last(self.model, pending, pos, self.cache, None)[0]  # (V,)
        self.fed = self._start = len(seq)
        out = []
        for i in range(k):
            out.append(int(logits.argmax()))
            if i == k - 1:
                break  # the last draft is not fed: the target's verify decides what follows it
            step = torch.tensor([[out[-1]]], dtype=torch.int64)  # (1, 1)
            logits = forward_last(self.model, step, torch.tensor([[self.origin + self.fed]]), self.cache, None)[0]
            self.fed += 1
        return out

    def update(self, seq: Sequence[int], proposed: int, accepted: int) -> None:
        if not proposed:  # a step without a draft (paused): nothing was fed, nothing to roll back
            return
        keep = self._start + min(accepted, self.fed - self._start)  # fed drafts the target kept
        if self.fed > keep:
            self.cache.crop(keep - self.fed)  # roll the draft's cache back over the rejected drafts
        self.fed = keep
        self.length.update(proposed, accepted)


@dataclass(frozen=True, slots=True)
class SpecStats:
    verify_forwards: int  # target forwards after the prefill (each verifies a draft, or is a plain step)
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens kept

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclass(frozen=True, slots=True)
class Speculated:
    tokens: list[int]  # generated, the stop token included when hit
    length: int  # tokens generated, stop token excluded
    stats: SpecStats


def verify_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
    """Every new position's logits (B, q, V) of a verify forward over ``cache``: the weights a one-token
    call uses (``decode_weights``) and the grouped-query causal attention (``gqa_causal_attention``)."""
    with decode_weights(model), gqa_causal_attention(model):
        return forward_all(model, input_ids, position_ids, cache, None)


def _picker(stop_ids: set[int], vocab: int, min_new_tokens: int):
    stops = torch.tensor(sorted(i for i in stop_ids if i < vocab), dtype=torch.int64)

    def pick(row: torch.Tensor, index: int) -> int:  # row: (V,); index: how many tokens were written before
        if index < min_new_tokens and len(stops):
            row = row.index_fill(0, stops, float("-inf"))  # as ``generate.decode_n_tokens`` suppresses them
        return int(row.argmax())

    return pick


@torch.inference_mode()
def speculative_decode(model, cache, history: Sequence[int], first_logits: torch.Tensor, next_position: int,
                       drafter: Drafter, max_new_tokens: int, stop_ids: set[int],
                       min_new_tokens: int = 0, on_token=None) -> Speculated:
    """Greedy decoding from ``first_logits`` (1, V) over ``cache`` (holding ``history``), drafts verified in
    one forward each; ``next_position``: where the first written token sits.

    On return ``cache`` holds what plain decoding leaves in it: the history and every written token but
    the last. ``on_token`` sees each kept token (1,) as soon as it is kept (streaming servers).
    """
    if first_logits.ndim != 2 or first_logits.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one row: first_logits (1, V), got {tuple(first_logits.shape)}")
    pick = _picker(stop_ids, first_logits.shape[-1], min_new_tokens)
    cache.activate_past_recording()  # sliding-window layers keep what a rollback may need
    out: list[int] = []
    seq = list(history)  # what the drafter sees: the history, then the output
    held = 0  # tokens fed to the cache since the history
    forwards = drafted = accepted_total = 0
    row = first_logits[0]  # (V,)
    done = max_new_tokens < 1
    # room for every token fed (drafts never run past max_new_tokens); rollbacks keep the reservation
    with reserved(cache, max_new_tokens, rollback=True):
        while not done:
            tok = pick(row, len(out))
            out.append(tok)
            seq.append(tok)
            if on_token is not None:
                on_token(torch.tensor([tok]))
            if tok in stop_ids or len(out) >= max_new_tokens:
                break
            draft = drafter.propose(seq, max_new_tokens - len(out))
            feed = torch.tensor([[tok, *draft]], dtype=torch.int64)  # (1, q)
            pos = (next_position + held + torch.arange(feed.shape[1], dtype=torch.int64))[None]  # (1, q)
            if draft:
                logits = verify_forward(model, feed, pos, cache)[0]  # (q, V)
            else:  # no draft: the plain decode step (``generate.decode_n_tokens``), last-position logits only
                logits = forward_last(model, feed, pos, cache, None)  # (1, V)
            held += feed.shape[1]
            forwards += 1
            a = 0
            for d in draft:
                if pick(logits[a], len(out)) != d:
                    break
                out.append(d)
                seq.append(d)
                a += 1
                if on_token is not None:
                    on_token(torch.tensor([d]))
                if d in stop_ids or len(out) >= max_new_tokens:
                    done = True
                    break
            rejected = len(draft) - a
            if rejected:
                cache.crop(-rejected)  # drop the K/V of the drafts the model did not write
                held -= rejected
            drafter.update(seq, len(draft), a)
            drafted += len(draft)
            accepted_total += a
            row = logits[a]  # the model's next-token logits after the kept tokens
        extra = held - max(len(out) - 1, 0)  # a kept last draft was fed; plain decoding never feeds its last token
        if extra > 0:
            cache.crop(-extra)
        cache.crop(0)  # sliding-window layers back to their window
    for layer in cache.layers:
        if hasattr(layer, "record_past"):
            layer.record_past = False
    n = len(out) - (1 if out and out[-1] in stop_ids else 0)
    return Speculated(out, n, SpecStats(forwards, drafted, accepted_total))
