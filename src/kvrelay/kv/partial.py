"""Receiver-driven partial payloads: the positions of a cache the receiver's own question attends to.

The receiver sends a ``PartialRequest``: the token ids it will append after the relayed context (its
prompt, in the continue layout) and a ``Budget``. The sender runs those tokens after its cache once
(``evict.attention_probe``: they sit at the positions the receiver will give them, so the scores are
the attention the receiver's first forward would pay), scores every cached position per layer and KV
head, and keeps, per (layer, KV head), the sinks, the recent tail and the top-scored positions in
between (``evict.evict`` in ``headwise`` mode by default; sliding-window layers keep their whole
window, ``evict.recent_floor``). With ``lookahead`` N > 0 (the default, 8) the sender first answers
the question itself for N greedy tokens on its full cache and scores by those tokens' attention instead
(``evict.answer_probe``): they look where the receiver's answer will look. With ``verify`` (the default)
the sender makes that selection under each of ``VERIFY_CANDIDATES`` (pool widths and modes) and sends the
one whose partial payload best reproduces its own look-ahead answer (``answer_fit``, teacher-forced),
stopping at the first that reproduces all of it (``first_exact``, the default);
``backfill`` corrects the kept values by orthogonal backfill. The result travels through
the codec chain (``kv.codecs``: an optional layer subset, then raw/fp16/int8/int4).

Layout (``payload.py``): keys/values per held layer ``(B, H_kv, T_l, D)``, one unpadded row.

What the receiver gets and why it is exact. Keys are post-RoPE, so a kept key keeps the phase of its
ORIGINAL position; attention between the receiver's queries and the kept keys is the attention over
exactly those (token, position) pairs, i.e. the attention of a full prefill with the dropped
positions masked out for the receiver's tokens (tests/kv/test_partial.py checks the logits). The
receiver continues at the original end (the recent tail is always kept, so
``KVPayload.next_positions`` is the sender's end). ``PartialSelection.kept`` (L, H_kv, T) bool over
the sender's slots is that mask: True where layer l's head h kept slot t.

Budgets (``Budget``; several may be given, the tightest wins): ``fraction`` of the positions,
``top_k`` positions, or ``nbytes`` of the partial payload as it travels (after its codec). The
sinks and recent tail always count towards the budget and are never dropped, so a budget below
them keeps just them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace

import torch

from kvrelay.core.errors import CorruptPayload, InvalidInput
from kvrelay.kv.codecs import Codec, Compressed, Evict, Layers, compress, parse
from kvrelay.kv.evict import (
    EVICTION_MODES,
    AttentionProbe,
    answer_probe,
    attention_probe,
    eviction_plan,
    recent_floor,
)
from kvrelay.kv.transforms import select_layers

REQUEST_FORMAT = "kvrelay-partial-request/1"
DEFAULT_WINDOW: int | None = None  # question tokens whose attention scores the cache (None: all)
DEFAULT_POOL = 3  # neighbouring positions a score is max-pooled over (docs/layouts.md: the ablation)
DEFAULT_LOOKAHEAD = 8  # the sender's own answer tokens that score the cache (0: the question's)
DEFAULT_VERIFY = True  # try VERIFY_CANDIDATES and send the one that best reproduces the look-ahead answer
DEFAULT_FIRST_EXACT = True  # with verify: stop at the first candidate that predicts the whole look-ahead answer
VERIFY_CANDIDATES = ((1, "headwise"), (3, "headwise"), (5, "headwise"),
                     (1, "layerwise"), (3, "layerwise"), (5, "layerwise"))  # (pool, mode)


@dataclass(frozen=True, slots=True)
class Budget:
    """How much of the cache to send; ``None`` fields are not limits."""

    fraction: float | None = None  # of the payload's positions, in (0, 1]
    top_k: int | None = None  # positions
    nbytes: int | None = None  # bytes of the tensors that travel (``Compressed.nbytes``)

    def __post_init__(self):
        if self.fraction is None and self.top_k is None and self.nbytes is None:
            raise InvalidInput("a budget with no limit", "a budget that needs a fraction, a top_k or an nbytes")
        if self.fraction is not None and not (isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
            raise InvalidInput(f"budget fraction {self.fraction!r}", "a budget fraction that must be in (0, 1]")
        for name in ("top_k", "nbytes"):
            x = getattr(self, name)
            if x is not None and (type(x) is not int or x < 1):
                raise InvalidInput(f"budget {name} {x!r}", f"budget {name} must be an int >= 1")

    def positions(self, total: int) -> int:
        """The most positions of ``total`` that the fraction and top-k allow (the byte limit comes later)."""
        k = total
        if self.fraction is not None:
            k = min(k, max(1, math.floor(self.fraction * total + 0.5)))
        if self.top_k is not None:
            k = min(k, self.top_k)
        return k


@dataclass(frozen=True, slots=True)
class PartialRequest:
    """What the receiver sends the sender: its question tokens and what it can take."""

    question_ids: tuple[int, ...]
    budget: Budget
    layers: tuple[int, ...] | None = None  # a layer subset (model indices); None = every layer
    encoding: str = "raw"  # the codec's representation: raw | fp16 | bf16 | int8 | int4 | intN-gG
    mode: str = "headwise"  # evict.EVICTION_MODES: per (layer, KV head), per layer, or one set
    sink: int = 4
    recent: int = 8
    window: int | None = DEFAULT_WINDOW  # score by the last ``window`` question tokens only (None: all; lookahead 0 only)
    pool: int = DEFAULT_POOL  # max-pool scores over this many neighbouring slots (odd; 1: none)
    lookahead: int = DEFAULT_LOOKAHEAD  # score by the sender's first N answer tokens instead (0: by the question)
    backfill: bool = False  # correct the kept values for what the dropped ones gave the probe's rows (OBF)
    verify: bool = DEFAULT_VERIFY  # the sender checks candidate selections against its look-ahead answer
    # (with a look-ahead and every layer; a layer subset keeps the request's own pool and mode)
    first_exact: bool = DEFAULT_FIRST_EXACT  # with ``verify``: send the first candidate that predicts every
    # look-ahead token, without checking the rest (fewer of the sender's forwards; a tie on tokens is not broken
    # by log-likelihood). A request from before this field (none on the wire) checked every candidate.

    def __post_init__(self):
        if not self.question_ids or any(type(i) is not int or i < 0 for i in self.question_ids):
            raise InvalidInput("question_ids", "question_ids must be a non-empty tuple of token ids (ints >= 0)")
        if self.mode not in EVICTION_MODES:
            raise InvalidInput(f"mode {self.mode!r}", f"mode must be one of {EVICTION_MODES}")
        if self.sink < 0 or self.recent < 1:
            raise InvalidInput(f"sink={self.sink}, recent={self.recent}", "need sink >= 0 and recent >= 1")
        if self.window is not None and (type(self.window) is not int or self.window < 1):
            raise InvalidInput(f"window {self.window!r}", "window must be None or an int >= 1 (question tokens)")
        if type(self.pool) is not int or self.pool < 1 or self.pool % 2 == 0:
            raise InvalidInput(f"pool {self.pool!r}", "pool must be an odd int >= 1 (slots)")
        if type(self.lookahead) is not int or self.lookahead < 0:
            raise InvalidInput(f"lookahead {self.lookahead!r}", "lookahead must be an int >= 0 (answer tokens)")
        if type(self.backfill) is not bool:
            raise InvalidInput(f"backfill {self.backfill!r}", "backfill must be true or false")
        if type(self.verify) is not bool:
            raise InvalidInput(f"verify {self.verify!r}", "verify must be true or false")
        if type(self.first_exact) is not bool:
            raise InvalidInput(f"first_exact {self.first_exact!r}", "first_exact must be true or false")
        enc = parse(self.encoding)
        if enc.stages:
            raise InvalidInput(f"encoding {self.encoding!r}", "a representation only (raw, fp16, int8, ...); "
                               "layer subsets go in layers=, selection is the budget's")
        if self.layers is not None:
            parse(Layers(tuple(self.layers)).name)  # increasing, distinct, non-negative

    def to_bytes(self) -> bytes:
        """The request on the wire: compact JSON (the question ids dominate)."""
        d = {"format": REQUEST_FORMAT, "question_ids": list(self.question_ids), "fraction": self.budget.fraction,
             "top_k": self.budget.top_k, "nbytes": self.budget.nbytes,
             "layers": list(self.layers) if self.layers is not None else None, "encoding": self.encoding,
             "mode": self.mode, "sink": self.sink, "recent": self.recent, "window": self.window, "pool": self.pool,
             "lookahead": self.lookahead, "backfill": self.backfill, "verify": self.verify,
             "first_exact": self.first_exact}
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PartialRequest:
        try:
            d = json.loads(bytes(data))
            if not isinstance(d, dict) or d.get("format") != REQUEST_FORMAT:
                raise CorruptPayload(f"not a {REQUEST_FORMAT} request")
            budget = Budget(d["fraction"], d["top_k"], d["nbytes"])
            layers = tuple(d["layers"]) if d["layers"] is not None else None
            return cls(tuple(d["question_ids"]), budget, layers, d["encoding"], d["mode"], d["sink"], d["recent"],
                       d.get("window"), d.get("pool", 1), d.get("lookahead", 0), d.get("backfill", False),
                       d.get("verify", False), d.get("first_exact", False))
        except CorruptPayload:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptPayload(f"malformed partial request: {e}") from None


@dataclass(frozen=True, eq=False)
class PartialSelection:
    """The sender's answer: the partial payload as it travels, what it kept, and what choosing cost."""

    compressed: Compressed
    kept: torch.Tensor = field(repr=False)  # (L_sent, H_kv, T) bool over the sender's slots, per layer sent
    positions_kept: int  # slots per (layer, head) in the partial payload (full-attention layers)
    positions_total: int  # slots of the sender's payload
    score_s: float  # the probe forward over the question tokens
    select_s: float  # top-k, gather and encoding (and, with ``verify``, checking the candidates)
    pool: int = DEFAULT_POOL  # the pool and mode of the selection sent (with ``verify``: the one chosen)
    mode: str = "headwise"
    checked: int = 0  # candidate payloads read with the sender's model (``verify``; one per distinct selection)

    @property
    def fraction(self) -> float:
        return self.positions_kept / self.positions_total


def _codec(request: PartialRequest, keep: float) -> Codec:
    enc = parse(request.encoding).encoding
    stages: tuple = (Evict(keep, request.mode, request.backfill),)
    if request.layers is not None:
        stages = (Layers(tuple(request.layers)), *stages)
    return Codec(stages, enc)


def _fixed(p, request: PartialRequest) -> tuple[int, int]:
    """(slots always kept, slots chosen among) for one row of ``p``."""
    T = p.num_tokens
    head = min(request.sink, T)
    tail = min(recent_floor(p, request.recent), T - head)
    return head + tail, T - head - tail


def _keep_for(p, request: PartialRequest, n: int) -> float:
    """The eviction fraction of the middle slots that keeps ``n`` positions in all."""
    fixed, middle = _fixed(p, request)
    return 1.0 if middle == 0 else min(1.0, max(0, n - fixed) / middle)


def select(p, request: PartialRequest, *, model=None, probe: AttentionProbe | None = None) -> PartialSelection:
    """Score ``p`` (one unpadded row, every layer) by the request's question and keep what the budget allows.

    ``model``: the sender's model (runs the probe, and checks the candidates with ``verify``); or pass
    ``probe`` measured already (``request_probe``). With ``verify``, a look-ahead answer and every layer
    travelling, each of ``VERIFY_CANDIDATES`` (the request's own pool and mode first) is selected under
    the same budget and the one whose partial payload best reproduces the sender's answer (``answer_fit``)
    is sent; otherwise the request's own pool and mode (``PartialSelection.pool``, ``.mode`` say which).
    A candidate that keeps the same positions as an earlier one is not read again (``.checked`` counts
    the candidates read); on equal fits the earlier candidate is sent. With ``first_exact`` the checking
    stops at the first candidate that predicts every look-ahead token.
    """
    if p.batch_size != 1 or not bool(p.mask.all()):
        raise ValueError("a partial payload is chosen for one unpadded row")
    t0 = time.perf_counter()
    given = probe is not None
    if probe is None:
        if model is None:
            raise ValueError("select needs the sender's model (or a probe) to score the cache")
        probe = request_probe(model, p, request)
    score_s = 0.0 if given else time.perf_counter() - t0
    t1 = time.perf_counter()
    options = [request]
    everything = request.budget.nbytes is None and request.budget.positions(p.num_tokens) >= p.num_tokens
    if request.verify and probe.answer and request.layers is None and not everything:  # reads every layer
        if model is None:
            raise ValueError("verify checks candidates with the sender's model: pass model=")
        options += [replace(request, pool=pool, mode=mode) for pool, mode in VERIFY_CANDIDATES
                    if (pool, mode) != (request.pool, request.mode)]
    best, best_fit, seen = None, None, []
    for r in options:
        c, kept, n = _choose(p, r, probe)
        if any(torch.equal(kept, k) for k in seen):  # the same positions as an earlier candidate: the same fit
            continue
        seen.append(kept)
        fit = answer_fit(model, c.decompress(), request.question_ids, probe.answer) if len(options) > 1 else None
        if best is None or fit > best_fit:
            best, best_fit = (c, kept, n, r), fit
        if request.first_exact and fit is not None and fit[0] == len(probe.answer):
            break  # every look-ahead token predicted: no candidate can predict more
    c, kept, n, r = best
    checked = len(seen) if len(options) > 1 else 0
    return PartialSelection(c, kept, n, p.num_tokens, score_s, time.perf_counter() - t1, r.pool, r.mode, checked)


def _choose(p, request: PartialRequest, probe: AttentionProbe) -> tuple[Compressed, torch.Tensor, int]:
    """One selection: (the partial payload as it travels, kept (L_sent, H_kv, T), slots per (layer, head))."""
    window = probe.lookahead or request.window  # the answer's rows when the sender looked ahead
    scores = probe.pooled(window=window, pool=request.pool)  # (L, 1, H_kv, T)
    T = p.num_tokens
    n = request.budget.positions(T)
    fixed, _ = _fixed(p, request)
    n = max(n, fixed)
    c = compress(p, _codec(request, _keep_for(p, request, n)), scores=scores, probe=probe, sink=request.sink,
                 recent=request.recent)
    if request.budget.nbytes is not None and c.nbytes > request.budget.nbytes:
        c = _fit_bytes(p, request, scores, probe, n, c)
    keep = c.codec.stages[-1].keep
    sent = p
    if request.layers is not None:  # the selection is made on the layers that travel
        idx = [p.meta.layer_indices.index(i) for i in request.layers]
        sent, scores = select_layers(p, request.layers), scores[idx]
    plan, _ = eviction_plan(sent, scores, keep, sink=request.sink, recent=request.recent, mode=request.mode)
    kept = torch.zeros(len(sent.keys), scores.shape[2], T, dtype=torch.bool)  # (L_sent, H_kv, T)
    kept.scatter_(2, plan, True)
    for j in range(len(sent.keys)):  # sliding layers: what they hold of the kept tail
        T_l = sent.keys[j].shape[2]
        if T_l < T:
            kept[j] = False
            kept[j, :, T - min(T_l, plan.shape[2]):] = True
    return c, kept, int(plan.shape[2])


def answer_fit(model, part, question_ids, answer) -> tuple[int, float]:
    """How well a (partial) payload reproduces ``answer`` after ``question_ids``, teacher-forced in one
    forward: (answer tokens it predicts greedily, their summed log-probability); larger is better."""
    hit, logp = answer_hits(model, part, question_ids, answer)
    return int(hit.sum()), logp


@torch.inference_mode()
def answer_hits(model, part, question_ids, answer) -> tuple[torch.Tensor, float]:
    """``answer_fit``'s forward, token by token: (hit (k,) bool, whether each answer token is the greedy
    prediction; the answer's summed log-probability)."""
    from kvrelay.kv.cache import to_cache

    ids = torch.tensor([list(question_ids) + list(answer)])  # (1, q + k)
    start, k = int(part.next_positions[0]), len(answer)
    logits = model(input_ids=ids, position_ids=(start + torch.arange(ids.shape[1]))[None],
                   cache=to_cache(part, model.config), use_cache=True,
                   logits_to_keep=k + 1).logits[0].float()  # (k + 1, V): from the question's last token on
    want = torch.tensor(list(answer))
    at = logits[:k]  # (k, V): the logits that predict each answer token
    return at.argmax(-1) == want, float(at.log_softmax(-1).gather(1, want[:, None]).sum())


def request_probe(model, p, request: PartialRequest) -> AttentionProbe:
    """The attention rows that score ``p`` for ``request``: its question's, followed with ``lookahead`` > 0
    by the sender's own first answer tokens (``evict.answer_probe``), whose rows then do the scoring."""
    if request.lookahead:
        return answer_probe(model, p, list(request.question_ids), request.lookahead)
    return attention_probe(model, p, list(request.question_ids))


def _fit_bytes(p, request: PartialRequest, scores: torch.Tensor, probe: AttentionProbe, n: int,
               c: Compressed) -> Compressed:
    """The largest selection of at most ``n`` positions within the byte budget (bytes grow with positions)."""
    fixed, _ = _fixed(p, request)
    lo_c = compress(p, _codec(request, 0.0), scores=scores, probe=probe, sink=request.sink, recent=request.recent)
    if lo_c.nbytes >= request.budget.nbytes or n <= fixed:
        return lo_c  # the sinks and the recent tail are never dropped
    lo, hi = fixed, n  # bytes(lo) <= budget < bytes(hi)
    best = lo_c
    while hi - lo > 1:
        mid = (lo + hi) // 2
        m = compress(p, _codec(request, _keep_for(p, request, mid)), scores=scores, probe=probe, sink=request.sink,
                     recent=request.recent)
        if m.nbytes <= request.budget.nbytes:
            lo, best = mid, m
        else:
            hi = mid
    return best


def full_request(question_ids, *, encoding: str = "raw", layers=None) -> PartialRequest:
    """The request that keeps every position (the partial protocol's own full-relay reference)."""
    return PartialRequest(tuple(int(i) for i in question_ids), Budget(fraction=1.0), layers, encoding)


def with_budget(request: PartialRequest, **budget) -> PartialRequest:
    return replace(request, budget=Budget(**budget))
