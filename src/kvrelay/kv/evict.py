"""Token eviction by attention score, with optional Orthogonal BackFill (OBF) of evicted values.

Layout (see ``payload.py``): keys/values per held layer ``(B, H, T_l, D)``; token_ids / positions
/ mask ``(B, T)``; sliding layers hold the last ``T_l = min(T, window - 1)`` slots. Scores are
``(L, B, H, T)`` over the payload's slots (higher = more worth keeping; 0 where a layer holds nothing).

What is kept, per row: the first ``sink`` tokens, the last ``recent`` tokens, and the top
``round(keep × rest)`` of the tokens in between by score. Three ways to pick the top-k:

* ``layerwise`` (default) — each layer picks its own tokens, shared by its KV heads;
* ``headwise`` — each (layer, KV head) picks its own tokens, the same *count* per head;
* ``shared`` — one token set for every layer and head (scores summed over layers and heads).

Why per-layer / per-head token sets stay correct. Keys are cached *post-RoPE*: the phase of every
kept key already encodes its original position, and attention between a new query and a cached
key depends on nothing else. So slot ``s`` of layer ``l``, head ``h`` may hold a different token
than slot ``s`` of another head, and the receiver's attention is still the attention over exactly
the kept (token, position) pairs. What must stay right is the *position cursor*: the receiver's
next token continues at the ORIGINAL sequence end, not at the number of kept tokens. The last
``recent ≥ 1`` tokens are always kept (in every layer and head), so ``KVPayload.next_positions``
(max position + 1) is the original end and ``Agent.respond`` continues there.

What ``token_ids`` / ``positions`` mean after eviction. They are the *consensus* selection (the
``shared`` choice: sinks + top-k of the summed scores + recent), strictly increasing, starting
at the first sink and ending at the original last token. In ``shared`` mode they describe every
layer and head exactly; in ``layerwise``/``headwise`` modes the sink and recent slots are exact
for every layer and head and the middle slots are representative only (``eviction_plan`` gives
the exact per-layer/per-head original slots). Nothing downstream needs more: ``to_cache`` ignores
positions, ``shift_positions`` adds one delta to all of them, ``concat`` needs only the end.

Sliding-window layers (gemma3) hold the last ``window - 1`` slots, and transformers' sliding
mask counts *slots*, not positions; a sliding layer is exact only if its slots are the original
last ``window - 1`` tokens, contiguous. So on a model with sliding layers the recent tail is at
least ``window - 1`` tokens: sliding layers stay exactly as they were and eviction acts on the
full-attention layers (which hold everything else anyway). On gemma3-270m (window 512) this
floor is 511 tokens, so ``keep`` cannot shrink a 2k-token payload below ~25 % of its tokens.

OBF (Orthogonal BackFill, arXiv 2604.13349; our reading — the paper's exact algorithm is not
at hand). Eviction changes the attention output of a query ``q`` over the cache from
``O = Σ_all a_t v_t`` to ``Ô = Σ_kept â_t v_t`` (``â`` = ``a`` renormalised over kept slots: keys
are untouched, so the kept logits do not change). With probe queries whose full attention
distributions ``P`` (R × T) we have, OBF adds a correction ``ΔV`` to the kept *values only*
(never keys: they are post-RoPE and carry positions) that solves the ridge least-squares problem

    min ||Â_S ΔV − (P V − Â_S V_S)||²  +  λ ||ΔV||²,     Â_S = P[:, S] renormalised (R × T')

i.e. ``ΔV = Â_Sᵀ (Â_S Â_Sᵀ + λ I)⁻¹ R``. The right-hand side ``R`` is the evicted values'
contribution the kept ones miss; ``ΔV`` is the minimum-norm update, it lies in the row space of
``Â_S`` (rank ≤ R) — the span orthogonal to the null space the probes cannot see, so queries that
attend like the probes get the evicted values back and others are disturbed as little as
possible — and it is truncated to rank ``obf_rank`` by SVD. Sink values are left alone (every
query attends to them; moving them would disturb the queries the probes do not represent).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from kvrelay.kv.layout import any_sliding, held_tokens, window_slots
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.transforms import pad_batch, unpad_row
from kvrelay.models.attention import eager_attention

EVICTION_MODES = ("layerwise", "headwise", "shared")  # what one kept set is chosen for: each (layer, KV head), each layer, all


# -- scores ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AttentionProbe:
    """How probe queries attend to a payload's cached slots (the cache part of softmax, renormalised).

    ``probs[l]`` is (B, H_kv, R, T): R = (query heads per KV head) × (probe tokens) rows, probe token
    fastest, each a distribution over the T slots (0 on slots layer l does not hold and on padding).
    ``tokens``: the probe tokens q (0 when not known: ``pooled`` then cannot take a window).
    """

    probs: tuple[torch.Tensor, ...]
    tokens: int = 0
    lookahead: int = 0  # the last ``lookahead`` probe tokens are the model's own answer (``lookahead_ids``)
    answer: tuple[int, ...] = ()  # those answer tokens' ids, when the probe knows them (``answer_probe``)

    @property
    def scores(self) -> torch.Tensor:
        """(L, B, H_kv, T): attention each cached slot receives, averaged over probe rows."""
        return torch.stack([p.mean(dim=2) for p in self.probs])

    def pooled(self, *, window: int | None = None, pool: int = 1) -> torch.Tensor:
        """(L, B, H_kv, T): ``scores`` over the rows of the last ``window`` probe tokens only (None: all),
        then max-pooled over ``pool`` neighbouring slots (odd; 1: none), as SnapKV keeps the spans around
        what its observation window attends to (arXiv 2404.14469): an answer sits next to the words a
        question matches, and those draw the attention."""
        if pool < 1 or pool % 2 == 0:
            raise ValueError(f"pool must be an odd number of slots >= 1, got {pool}")
        if window is not None and not (self.tokens and 1 <= window):
            raise ValueError(f"a window of probe tokens needs window >= 1 and a probe that knows its tokens, "
                             f"got window={window}, tokens={self.tokens}")
        out = []
        for p in self.probs:  # (B, H, R, T)
            B, H, R, T = p.shape
            if window is not None and window < self.tokens:
                p = p.reshape(B, H, R // self.tokens, self.tokens, T)[:, :, :, -window:].reshape(B, H, -1, T)
            s = p.mean(dim=2)  # (B, H, T)
            if pool > 1:
                s = torch.nn.functional.max_pool1d(s.reshape(B * H, 1, T), pool, stride=1, padding=pool // 2)
                s = s.reshape(B, H, T)
            out.append(s)
        return torch.stack(out)

    def answer_prefix(self, n: int) -> AttentionProbe:
        """A look-ahead probe's rows for its first ``n`` answer tokens: a shorter look-ahead is a prefix of
        the same greedy answer, so one decode serves every length (``answer_probe``). A probe with fewer
        answer tokens, or one that fell back to the prompt's rows (``lookahead`` 0), is returned as it is."""
        k = self.lookahead
        if n < 1:
            raise ValueError(f"an answer prefix needs n >= 1, got {n}")
        if not k or n >= k:
            return self
        probs = tuple(p.reshape(*p.shape[:2], -1, k, p.shape[-1])[:, :, :, :n].reshape(*p.shape[:2], -1, p.shape[-1])
                      for p in self.probs)  # (B, H_kv, group × n, T): answer token fastest
        return AttentionProbe(probs, n, n, self.answer[:n])

    def row(self, b: int, start: int) -> AttentionProbe:
        return AttentionProbe(tuple(p[b:b + 1, :, :, start:] for p in self.probs), self.tokens, self.lookahead,
                              self.answer)


def _probe_tokens(p: KVPayload, probe_ids, n_probe: int) -> torch.Tensor:
    if probe_ids is None:
        n = min(n_probe, int(p.lengths.min()))
        return p.token_ids[:, -n:]  # (B, q): re-read the tail (left padding keeps it real)
    ids = torch.as_tensor(probe_ids, dtype=torch.int64)
    ids = ids.reshape(1, -1).expand(p.batch_size, -1) if ids.ndim <= 1 else ids
    if ids.shape[0] != p.batch_size or ids.shape[1] == 0:
        raise ValueError(f"probe_ids must be (q,) or (B={p.batch_size}, q) with q > 0, got {tuple(ids.shape)}")
    return ids


@torch.inference_mode()
def attention_probe(model, p: KVPayload, probe_ids=None, *, n_probe: int = 8) -> AttentionProbe:
    """Attention paid to each cached slot by probe tokens appended after the payload.

    ``probe_ids`` (q,) or (B, q): the receiver's question when known (best: that is who will read
    the cache). Without it the payload's last ``n_probe`` tokens are re-read as probes at the
    next positions (a stand-in for SnapKV's observation window). The model runs through its
    public API, with eager attention for the one forward that returns attention weights
    (``models.attention.eager_attention``).
    """
    from kvrelay.kv.cache import to_cache

    if not p.meta.complete:
        raise ValueError(f"attention scores need every layer (payload holds {list(p.meta.layer_indices)})")
    ids = _probe_tokens(p, probe_ids, n_probe)  # (B, q)
    B, q = ids.shape
    T = p.num_tokens
    pos = p.next_positions[:, None] + torch.arange(q)[None]  # (B, q)
    attn_mask = None if bool(p.mask.all()) else torch.cat((p.mask, torch.ones(B, q, dtype=torch.bool)), 1)
    cache = to_cache(p, model.config)
    with eager_attention(model):
        out = model(input_ids=ids, position_ids=pos, cache=cache, attention_mask=attn_mask, use_cache=True,
                    output_attentions=True, logits_to_keep=1)
    if out.attentions is None or len(out.attentions) != len(p.keys):
        raise RuntimeError("the model returned no per-layer attention weights for output_attentions=True")
    probs = []
    for j, a in enumerate(out.attentions):  # a: (B, Hq, q, T_l + q)
        H, T_l = p.keys[j].shape[1], p.keys[j].shape[2]
        a = a[..., :T_l].float()  # (B, Hq, q, T_l): the cache part
        a = a / a.sum(-1, keepdim=True).clamp_min(1e-30)
        a = a.reshape(B, H, -1, T_l)  # (B, H_kv, group × q, T_l): query heads of a KV group are adjacent
        full = a.new_zeros(B, H, a.shape[2], T)
        full[..., T - T_l:] = a
        probs.append(full)  # (B, H_kv, R, T)
    return AttentionProbe(tuple(probs), q)


def eos_ids(model) -> set[int]:
    """The model's own stop tokens (its generation config's ``eos_token_id``, one id or several)."""
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if e is None:
        e = getattr(model.config, "eos_token_id", None)
    return set() if e is None else {int(e)} if isinstance(e, int) else {int(i) for i in e}


@torch.inference_mode()
def _lookahead(model, p: KVPayload, prompt_ids, n: int, stop_ids: set[int] | None,
               rows: bool) -> tuple[list[int], list[tuple[torch.Tensor, ...]]]:
    """Greedy answer tokens after ``prompt_ids`` on ``p``'s cache and, with ``rows``, each answer token's
    attention over ``p``'s slots per layer (B, H_kv, group, T), taken as it is decoded
    (``generate.decode_n_tokens`` with a step that keeps the weights)."""
    from kvrelay.kv.cache import to_cache
    from kvrelay.models.generate import decode_n_tokens, forward_last

    if p.batch_size != 1 or not bool(p.mask.all()):
        raise ValueError("a look-ahead decodes one unpadded row")
    if n < 1:
        return [], []
    T = p.num_tokens
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.int64).reshape(1, -1)  # (1, q)
    start = int(p.next_positions[0])
    cache = to_cache(p, model.config)
    stops = eos_ids(model) if stop_ids is None else set(stop_ids)
    logits = forward_last(model, ids, (start + torch.arange(ids.shape[1]))[None], cache, None)  # (1, V)
    kept: list[tuple[torch.Tensor, ...]] = []

    def step(model, tok, pos, cache, mask) -> torch.Tensor:  # a decode step that keeps its attention rows
        out = model(input_ids=tok, position_ids=pos, cache=cache, attention_mask=mask, use_cache=True,
                    output_attentions=True, logits_to_keep=1)
        kept.append(tuple(_cache_rows(a, p, j, T) for j, a in enumerate(out.attentions)))
        return out.logits[:, -1, :].float()

    # with rows, one more step runs the n-th token's forward (its attention row); its successor is dropped
    with eager_attention(model) if rows else nullcontext():
        tokens, lengths, _ = decode_n_tokens(model, cache, logits, torch.tensor([start + ids.shape[1]]), None,
                                             n + int(rows), stops, forward=step if rows else forward_last)
    k = min(int(lengths[0]), n)
    return tokens[0, :k].tolist(), kept[:k]


def _cache_rows(a: torch.Tensor, p: KVPayload, j: int, T: int) -> torch.Tensor:
    """One answer token's attention (1, Hq, 1, kv) in layer j -> (1, H_kv, group, T) over ``p``'s slots,
    renormalised over them. A sliding layer (it holds fewer than T slots, and decoding pushes its oldest
    out) gets zeros: its kept slots are its window whatever the scores (``recent_floor``)."""
    H, T_l = p.keys[j].shape[1], p.keys[j].shape[2]
    out = a.new_zeros(1, H, a.shape[1] // H, T, dtype=torch.float32)
    if T_l == T and p.meta.layer_types[j] != "sliding_attention":
        x = a[0, :, 0, :T].float()  # (Hq, T)
        x = x / x.sum(-1, keepdim=True).clamp_min(1e-30)
        out[0] = x.reshape(H, -1, T)  # query heads of a KV group are adjacent
    return out


def lookahead_ids(model, p: KVPayload, prompt_ids, n: int, stop_ids: set[int] | None = None) -> list[int]:
    """The first ``n`` tokens ``model`` answers greedily after ``prompt_ids`` (q,) on ``p``'s cache (one
    unpadded row), cut before a stop token (default: ``eos_ids``). ``p`` is not written to."""
    return _lookahead(model, p, prompt_ids, n, stop_ids, rows=False)[0]


def answer_probe(model, p: KVPayload, prompt_ids, lookahead: int, stop_ids: set[int] | None = None) -> AttentionProbe:
    """The attention the model's own first ``lookahead`` answer tokens after ``prompt_ids`` pay ``p``'s
    slots: where the answer looks, so a better guide to what to keep than the prompt (Lookahead Q-Cache's
    pseudo queries, arXiv 2505.20334). The rows are taken while the answer is decoded (one forward per
    token, eager attention), so the prompt is read once. ``probe.lookahead`` = ``probe.tokens`` = the
    answer tokens (fewer when it stops), ``probe.answer`` their ids; an empty answer falls back to the prompt's rows
    (``attention_probe``, ``lookahead`` 0)."""
    tokens, rows = _lookahead(model, p, prompt_ids, lookahead, stop_ids, rows=True)
    if not tokens:
        return attention_probe(model, p, prompt_ids)
    k = len(tokens)
    probs = tuple(torch.stack([r[j] for r in rows], dim=3).reshape(1, rows[0][j].shape[1], -1, p.num_tokens)
                  for j in range(len(p.keys)))  # (1, H_kv, group × k, T): answer token fastest
    return AttentionProbe(probs, k, k, tuple(tokens))


def attention_scores(model, p: KVPayload, probe_ids=None, *, n_probe: int = 8) -> torch.Tensor:
    """(L, B, H_kv, T): attention the probe tokens pay to each cached slot, averaged over the
    query heads of each KV group and over probe tokens. See ``attention_probe``."""
    return attention_probe(model, p, probe_ids, n_probe=n_probe).scores


def key_norm_scores(p: KVPayload) -> torch.Tensor:
    """(L, B, H_kv, T) model-free fallback: tokens with *small* key norm tend to draw attention
    (Devoto et al. 2024, "A simple and effective L2 norm-based strategy for KV cache
    compression"), so score = 1 / ||k||, normalised to sum 1 per (layer, row, head)."""
    B, T = p.token_ids.shape
    out = []
    for k in p.keys:
        T_l = k.shape[2]
        s = 1.0 / k.float().norm(dim=-1).clamp_min(1e-6)  # (B, H, T_l)
        s = s * p.mask[:, None, T - T_l:]
        s = s / s.sum(-1, keepdim=True).clamp_min(1e-30)
        full = s.new_zeros(B, k.shape[1], T)
        full[..., T - T_l:] = s
        out.append(full)
    return torch.stack(out)


# -- what to keep ----------------------------------------------------------------------------
def recent_floor(p: KVPayload, recent: int) -> int:
    """The recent tail actually kept: ``recent``, raised to ``window - 1`` when sliding layers are held."""
    if any_sliding(p.meta.layer_types, p.meta.sliding_window):
        return max(recent, window_slots(p.meta.sliding_window))
    return recent


def _check(p: KVPayload, scores: torch.Tensor, keep: float, sink: int, recent: int, mode: str) -> None:
    if mode not in EVICTION_MODES:
        raise ValueError(f"mode must be one of {EVICTION_MODES}, got {mode!r}")
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep must be a fraction in [0, 1], got {keep}")
    if sink < 0 or recent < 1:
        raise ValueError(f"need sink >= 0 and recent >= 1 (the last token carries the position cursor), "
                         f"got sink={sink}, recent={recent}")
    want = (len(p.keys), p.batch_size, p.keys[0].shape[1], p.num_tokens)
    if tuple(scores.shape) != want:
        raise ValueError(f"scores must be (L, B, H_kv, T) = {want}, got {tuple(scores.shape)}")


def eviction_plan(p: KVPayload, scores: torch.Tensor, keep: float, *, sink: int = 4, recent: int = 8,
                  mode: str = "layerwise") -> tuple[torch.Tensor, torch.Tensor]:
    """For a single unpadded row: ``(plan (L, H, T'), consensus (T',))`` original slots kept, sorted.

    ``plan[l, h]`` is what layer l, head h keeps (sliding layers then keep its last window-1
    entries, which are the original tail); ``consensus`` is the ``shared`` choice that becomes
    the payload's token_ids/positions.
    """
    _check(p, scores, keep, sink, recent, mode)
    if p.batch_size != 1 or not bool(p.mask.all()):
        raise ValueError("eviction_plan works on one unpadded row (use unpad_row first)")
    L, _, H, T = scores.shape
    head = min(sink, T)
    tail = min(recent_floor(p, recent), T - head)
    m = T - head - tail
    k = min(m, int(math.floor(keep * m + 0.5)))
    s = scores[:, 0, :, head:T - tail].float()  # (L, H, m)
    fixed_head, fixed_tail = torch.arange(head), torch.arange(T - tail, T)

    def pick(x: torch.Tensor) -> torch.Tensor:  # (..., m) -> (..., T') sorted original slots
        mid = x.topk(k, dim=-1).indices.sort(dim=-1).values + head
        shape = (*x.shape[:-1], -1)
        return torch.cat((fixed_head.expand(shape), mid, fixed_tail.expand(shape)), dim=-1)

    consensus = pick(s.sum(dim=(0, 1)))  # (T',)
    if mode == "shared":
        plan = consensus.expand(L, H, -1)
    elif mode == "layerwise":
        plan = pick(s.sum(dim=1))[:, None, :].expand(L, H, -1)
    else:
        plan = pick(s)
    return plan.contiguous(), consensus


# -- OBF -------------------------------------------------------------------------------------
def backfill(v: torch.Tensor, probs: torch.Tensor, kept: torch.Tensor, editable: torch.Tensor, *,
             rank: int = 8, ridge: float = 1e-2) -> torch.Tensor:
    """Corrected kept values of one head: v (T, D) all values, probs (R, T), kept (T',) slots,
    editable (T',) bool (which kept slots may change) -> (T', D). See the module docstring."""
    x = v.double()
    P = probs.double()  # (R, T)
    A = P[:, kept]  # (R, T')
    A = A / A.sum(-1, keepdim=True).clamp_min(1e-30)
    Vs = x[kept]  # (T', D)
    resid = P @ x - A @ Vs  # (R, D): what the evicted values contributed and the kept ones miss
    Ae = A[:, editable]  # (R, E)
    if Ae.shape[1] == 0 or rank < 1:
        return v[kept]
    G = Ae @ Ae.T  # (R, R)
    lam = ridge * float(G.diagonal().mean()) + 1e-12
    dV = Ae.T @ torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), resid)  # (E, D)
    U, S, Vh = torch.linalg.svd(dV, full_matrices=False)
    r = min(rank, S.numel())
    dV = (U[:, :r] * S[:r]) @ Vh[:r]  # rank-r truncation
    Vs = Vs.clone()
    Vs[editable] += dV
    return Vs.to(v.dtype)


# -- evict -----------------------------------------------------------------------------------
def _evict_row(p: KVPayload, scores: torch.Tensor, keep: float, sink: int, recent: int, mode: str,
               obf: AttentionProbe | None, obf_rank: int) -> KVPayload:
    plan, consensus = eviction_plan(p, scores, keep, sink=sink, recent=recent, mode=mode)
    T, T_new = p.num_tokens, consensus.numel()
    head = min(sink, T)
    keys, values = [], []
    for j, (k, v) in enumerate(zip(p.keys, p.values, strict=True)):
        T_l = k.shape[2]
        if T_l < T:  # sliding: keep the original tail (inside the kept recent floor)
            held = held_tokens(p.meta.layer_types[j], p.meta.sliding_window, T_new)
            keys.append(k[:, :, T_l - held:])  # (1, H, held, D)
            values.append(v[:, :, T_l - held:])
            continue
        idx = plan[j][None, :, :, None].expand(1, -1, -1, k.shape[3])  # (1, H, T', D)
        kk, vv = k.gather(2, idx), v.gather(2, idx)  # (1, H, T', D)
        if obf is not None and T_new < T:
            vv = torch.stack([backfill(v[0, h], obf.probs[j][0, h], plan[j][h], plan[j][h] >= head,  # sinks stay
                                       rank=obf_rank) for h in range(k.shape[1])])[None]  # (1, H, T', D)
        keys.append(kk)
        values.append(vv)
    return replace(p, keys=tuple(keys), values=tuple(values), token_ids=p.token_ids[:, consensus],
                   positions=p.positions[:, consensus], mask=p.mask[:, consensus])


def evict(p: KVPayload, scores: torch.Tensor, keep: float, *, sink: int = 4, recent: int = 8,
          mode: str = "layerwise", obf: AttentionProbe | None = None, obf_rank: int = 8) -> KVPayload:
    """Keep sinks + top-``keep`` of the rest by ``scores`` (L, B, H_kv, T) + the recent tail.

    ``obf``: the probe whose attention rows drive the OBF value correction (None = plain
    eviction). Rows of a batch are evicted separately (each keeps ``round(keep × its rest)``) and
    left-padded again. The result keeps ``meta`` (codec naming is the caller's business).
    """
    _check(p, scores, keep, sink, recent, mode)
    if obf is not None and len(obf.probs) != len(p.keys):
        raise ValueError(f"obf probe has {len(obf.probs)} layers, payload {len(p.keys)}")
    T = p.num_tokens
    rows = []
    for b in range(p.batch_size):
        row = unpad_row(p, b)
        start = T - row.num_tokens
        rows.append(_evict_row(row, scores[:, b:b + 1, :, start:], keep, sink, recent, mode,
                               obf.row(b, start) if obf is not None else None, obf_rank))
    return rows[0] if len(rows) == 1 else pad_batch(rows)
