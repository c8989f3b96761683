"""``ridge``: a closed-form linear map from a sharer's cache to a receiver's, per receiver layer.

For receiver layer ``t`` reading sharer layer ``s = layer_map[t]``, with RoPE stripped from both
models' keys (``align.strip_rope``) and heads flattened::

    x = [K_s_pre, V_s] (2·H_s·D_s,)   at the sharer slot aligned to a receiver slot (``bridge``)
    K_r_pre ≈ [x, 1] @ W_k            (H_r·D_r,)
    V_r     ≈ [x, 1] @ W_v

Each output column is its own ridge regression, so this is the per-receiver-head map (every head
sees the whole sharer layer: head counts and head dims need not divide). The ridge strength is
chosen per layer and per K/V on held-out texts (every 5th) from a grid, then refitted on all;
held-out R² per layer is recorded in the artefact. Keys are re-rotated at the receiver's
positions with the receiver's rope (``align.apply_rope``).

The first slots every fitting text shares (the chat template's opening tokens, which attention
uses as a sink) depend on nothing but themselves; the artefact stores the receiver's own K/V for
them (``anchor``) and the adapter writes those exactly when a payload opens with the same tokens.
They are left out of the regression.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from kvrelay.core.errors import IncompatiblePayload
from kvrelay.fuse import align, artefact
from kvrelay.fuse.adapter import stamp
from kvrelay.fuse.bridge import TokenBridge, flat_heads, pre_rope_kv, read, sharer_features, unflat_heads
from kvrelay.kv.compat import require_raw
from kvrelay.kv.layout import held_tokens
from kvrelay.kv.payload import RAW, KVPayload
from kvrelay.models.identity import ModelIdentity

ALPHAS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strength, relative to the mean feature variance
HOLDOUT_EVERY = 5


@dataclass
class _Moments:
    """Sufficient statistics of one regression split: [x,1]ᵀ[x,1], [x,1]ᵀy, Σy², Σy, n."""

    xtx: torch.Tensor
    xty: torch.Tensor
    yy: torch.Tensor
    ys: torch.Tensor
    n: int = 0

    @classmethod
    def zeros(cls, f: int, o: int) -> _Moments:
        z = torch.zeros
        return cls(z(f + 1, f + 1, dtype=torch.float64), z(f + 1, o, dtype=torch.float64),
                   z(o, dtype=torch.float64), z(o, dtype=torch.float64))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x (N, F), y (N, O)."""
        x1 = torch.cat((x, x.new_ones(x.shape[0], 1)), 1).double()
        y = y.double()
        self.xtx += x1.T @ x1
        self.xty += x1.T @ y
        self.yy += (y * y).sum(0)
        self.ys += y.sum(0)
        self.n += x.shape[0]

    def __add__(self, o: _Moments) -> _Moments:
        return _Moments(self.xtx + o.xtx, self.xty + o.xty, self.yy + o.yy, self.ys + o.ys, self.n + o.n)


def _solve(m: _Moments, alpha: float) -> torch.Tensor:
    f = m.xtx.shape[0] - 1
    lam = alpha * float(m.xtx.diagonal()[:f].mean())
    reg = torch.zeros_like(m.xtx)
    reg.diagonal()[:f] = lam  # the bias column is not shrunk
    return torch.linalg.solve(m.xtx + reg, m.xty)  # (F+1, O)


def _r2(w: torch.Tensor, m: _Moments) -> float:
    sse = float(m.yy.sum() - 2 * (w * m.xty).sum() + (w * (m.xtx @ w)).sum())
    sst = float((m.yy - m.ys ** 2 / max(m.n, 1)).sum())
    return 1.0 - sse / sst if sst > 0 else 0.0


def _select(train: _Moments, held: _Moments | None, alphas) -> tuple[torch.Tensor, float, float]:
    """(weights refitted on both splits, chosen alpha, held-out R² at that alpha; -inf with no held-out data)."""
    if held is None or not held.n:
        return _solve(train, alphas[0]).float(), alphas[0], float("-inf")
    r2, alpha = max((_r2(_solve(train, a), held), a) for a in alphas)
    return _solve(train + held, alpha).float(), alpha, r2


@dataclass
class RidgeFit:
    """Accumulates paired caches (sharer payload, receiver payload of the same text) layer by layer.

    ``candidates[t]`` are the sharer layers tried for receiver layer ``t``; ``solve`` keeps the one
    with the best held-out R² (a layer map learned by validation). K and V share one design matrix.
    """

    candidates: tuple[tuple[int, ...], ...]
    bridge: TokenBridge = field(default_factory=TokenBridge)
    stats: dict = field(default_factory=dict)  # (layer, sharer layer, split) -> _Moments over [K | V] columns
    anchor_ids: list[int] | None = None
    anchor_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer (H, A, D) pre-RoPE
    texts: int = 0
    tokens: int = 0

    def add(self, sharer: KVPayload, receiver: KVPayload, index: torch.Tensor, skip: int) -> None:
        """One text: ``receiver`` slot i reads sharer slot ``index[i]``; the first ``skip`` slots are anchors."""
        split = "held" if self.texts % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else "train"
        feats = {s: sharer_features(sharer, s)[0, index][skip:] for s in {s for c in self.candidates for s in c}}
        for t, cands in enumerate(self.candidates):
            k, v = pre_rope_kv(receiver, t)
            y = torch.cat((flat_heads(k)[0, skip:], flat_heads(v)[0, skip:]), -1)  # (N, 2·H_r·D_r)
            for s in cands:
                key = (t, s, split)
                if key not in self.stats:
                    self.stats[key] = _Moments.zeros(feats[s].shape[1], y.shape[1])
                self.stats[key].add(feats[s], y)
        self.texts += 1
        self.tokens += int(index.shape[0]) - skip

    def solve(self, alphas=ALPHAS) -> tuple[tuple[int, ...], dict[str, torch.Tensor], dict]:
        """(layer map, tensors, metrics): per receiver layer the best candidate, K and V alphas chosen apart."""
        tensors, chosen = {}, []
        metrics: dict[str, list] = {"r2_k": [], "r2_v": [], "alpha_k": [], "alpha_v": [], "candidates": []}
        for t, cands in enumerate(self.candidates):
            best = None
            for s in cands:
                train, held = self.stats[(t, s, "train")], self.stats.get((t, s, "held"))
                o = train.xty.shape[1] // 2
                parts = [_select(_columns(train, c), _columns(held, c) if held else None, alphas)
                         for c in (slice(0, o), slice(o, 2 * o))]
                score = (parts[0][2] + parts[1][2]) / 2
                if best is None or score > best[0]:
                    best = (score, s, parts)
            _, s, ((wk, ak, rk), (wv, av, rv)) = best
            chosen.append(s)
            tensors[f"w_k.{t}"], tensors[f"w_v.{t}"] = wk, wv
            for name, val in (("r2_k", round(rk, 4)), ("r2_v", round(rv, 4)), ("alpha_k", ak), ("alpha_v", av),
                              ("candidates", list(cands))):
                metrics[name].append(val)
        for t, (ak_, av_) in enumerate(self.anchor_kv):
            tensors[f"anchor_k.{t}"], tensors[f"anchor_v.{t}"] = ak_, av_
        return tuple(chosen), tensors, metrics


def _columns(m: _Moments, cols: slice) -> _Moments:
    return _Moments(m.xtx, m.xty[:, cols], m.yy[cols], m.ys[cols], m.n)


def candidate_layers(n_receiver: int, n_sharer: int, spread: int = 1) -> tuple[tuple[int, ...], ...]:
    """Per receiver layer: the depth-proportional and last-aligned sharer layers, ± ``spread`` around the former."""
    dp, la = align.depth_proportional(n_receiver, n_sharer), align.last_aligned(n_receiver, n_sharer)
    out = []
    for t in range(n_receiver):
        near = range(max(dp[t] - spread, 0), min(dp[t] + spread, n_sharer - 1) + 1)
        out.append(tuple(sorted({*near, la[t]})))
    return tuple(out)


def common_prefix(seqs: list[list[int]]) -> list[int]:
    out = []
    for col in zip(*seqs, strict=False):
        if len(set(col)) != 1:
            break
        out.append(col[0])
    return out


def fit(sharer_lm, receiver_lm, readings: list[list[int]], candidates: tuple[tuple[int, ...], ...], *,
        bridge: TokenBridge | None = None, progress: Iterable | None = None) -> RidgeFit:
    """Fit on sharer token sequences ``readings`` (each read by the sharer, and by the receiver via ``bridge``)."""
    bridge = bridge or TokenBridge()
    pairs = [(ids, *bridge.receiver_reading(ids)) for ids in readings]
    anchor = common_prefix([r for _, r, _ in pairs])[:8] if len(pairs) > 1 else []
    state = RidgeFit(candidates, bridge, anchor_ids=anchor)
    for ids, r_ids, index in (progress(pairs) if progress else pairs):
        s_pay = read(sharer_lm.model, sharer_lm.identity, ids)
        r_pay = read(receiver_lm.model, receiver_lm.identity, r_ids)
        if anchor and not state.anchor_kv:
            state.anchor_kv = [tuple(x[0, :, : len(anchor)].clone() for x in pre_rope_kv(r_pay, t))
                               for t in range(receiver_lm.identity.num_layers)]
        state.add(s_pay, r_pay, index, len(anchor))
    return state


@dataclass(frozen=True)
class RidgeAdapter:
    """A fitted ridge map as an ``Adapter``: sharer payloads in, receiver payloads out (stamped)."""

    config: artefact.ArtefactConfig
    tensors: dict = field(repr=False)
    bridge: TokenBridge = field(default_factory=TokenBridge)
    name: str = "ridge"

    @property
    def fingerprint(self) -> str:
        return artefact.digest(self.config, self.tensors)

    @classmethod
    def load(cls, folder, sharer_tokenizer=None, receiver_tokenizer=None) -> RidgeAdapter:
        return cls(*load_mapped(folder, "ridge", sharer_tokenizer, receiver_tokenizer))

    def adapt(self, payload: KVPayload, receiver: ModelIdentity) -> KVPayload:
        check_source(self.config, f"{self.name}@{self.fingerprint[:16]}", payload, receiver)
        return map_layers(self.config, self.tensors, self.bridge, payload, receiver,
                          tuple(range(len(self.config.layer_map))), self)

    @property
    def anchor_ids(self) -> list[int]:
        return list(self.config.alignment.get("anchor_ids", []))


def load_mapped(folder, method: str, sharer_tokenizer=None, receiver_tokenizer=None
                ) -> tuple[artefact.ArtefactConfig, dict, TokenBridge]:
    """(config, tensors, token bridge) of a ridge-map artefact of ``method`` (``ridge`` or ``layers``)."""
    config, tensors = artefact.load(folder)
    if config.method != method:
        raise ValueError(f"{folder} holds a {config.method!r} adapter, not {method}")
    return config, tensors, TokenBridge.between(config.sharer.tokenizer_hash, config.receiver.tokenizer_hash,
                                                sharer_tokenizer, receiver_tokenizer, what="this adapter")


def check_source(config: artefact.ArtefactConfig, where: str, payload: KVPayload, receiver: ModelIdentity) -> None:
    """Refuse (typed) a payload this pair's maps were not fitted for: other models, tokenizer, batch, subset, codec."""
    m = payload.meta
    config.check_pair(receiver, m.model_fingerprint, where=where)
    if m.tokenizer_hash != config.sharer.tokenizer_hash:
        raise IncompatiblePayload("tokenizer_hash", config.sharer.tokenizer_hash, m.tokenizer_hash)
    if payload.batch_size != 1 or not bool(payload.mask.all()):
        raise ValueError(f"{where} maps one unpadded row at a time (split the batch)")
    require_raw(m, complete=True)


def map_layers(config: artefact.ArtefactConfig, tensors: dict, bridge: TokenBridge, payload: KVPayload,
               receiver: ModelIdentity, layers: tuple[int, ...], adapter) -> KVPayload:
    """``payload`` (a checked sharer reading) mapped into receiver ``layers`` with the ridge ``tensors``.

    The result holds exactly ``layers`` (``meta.layer_indices``), at the receiver's tokens and positions,
    stamped by ``adapter``.
    """
    r_ids, index = bridge.receiver_reading(payload.token_ids[0].tolist())
    start = int(payload.positions[0, 0])
    pos = start + torch.arange(len(r_ids), dtype=torch.int64)[None]  # (1, T_r)
    anchor_ids = list(config.alignment.get("anchor_ids", []))
    anchor = len(anchor_ids)
    anchored = anchor > 0 and start == 0 and len(r_ids) > anchor and r_ids[:anchor] == anchor_ids
    keys, values = [], []
    feats = {s: sharer_features(payload, s)[:, index] for s in {config.layer_map[t] for t in layers}}  # (1, T_r, F)
    for t in layers:
        x = feats[config.layer_map[t]]
        x1 = torch.cat((x, x.new_ones(*x.shape[:2], 1)), -1)
        k = unflat_heads(x1 @ tensors[f"w_k.{t}"], receiver.num_kv_heads)  # (1, H_r, T_r, D_r) pre-RoPE
        v = unflat_heads(x1 @ tensors[f"w_v.{t}"], receiver.num_kv_heads)
        if anchored:
            k[0, :, :anchor], v[0, :, :anchor] = tensors[f"anchor_k.{t}"], tensors[f"anchor_v.{t}"]
        k = align.apply_rope(k, pos, receiver.rope_for(receiver.layer_types[t]))
        held = held_tokens(receiver.layer_types[t], receiver.sliding_window, len(r_ids))
        keys.append(k[:, :, -held:].contiguous())
        values.append(v[:, :, -held:].contiguous())
    ids_t = torch.tensor([r_ids], dtype=torch.int64)
    meta = replace(stamp(payload.meta, receiver, adapter, layer_indices=layers), dtype="float32", codec=RAW)
    return KVPayload(tuple(keys), tuple(values), ids_t, pos, torch.ones_like(ids_t, dtype=torch.bool), meta)


def to_artefact(state: RidgeFit, receiver: tuple[str, ModelIdentity], sharer: tuple[str, ModelIdentity],
                training: dict, alphas=ALPHAS,
                layer_rule: str = "best held-out R² among candidate sharer layers") -> tuple[artefact.ArtefactConfig, dict]:
    """The artefact (config, tensors) of a finished fit; ``training`` records the data it saw."""
    layer_map, tensors, metrics = state.solve(alphas)
    tokens = "same tokenizer" if state.bridge.same else "receiver tokens; last sharer token covering each span"
    config = artefact.ArtefactConfig(
        method="ridge", receiver=artefact.ModelRef.of(*receiver), sharer=artefact.ModelRef.of(*sharer),
        layer_map=layer_map,
        alignment={"layers": layer_rule, "tokens": tokens, "rope": "stripped from both models' keys; "
                   "re-applied at the receiver's positions with its rope", "heads": "all sharer heads -> each receiver head",
                   "anchor_ids": list(state.anchor_ids or [])},
        training={**training, "n_texts": state.texts, "n_tokens": state.tokens, "steps": "closed form"},
        metrics=metrics, hyper={"alphas": list(alphas), "holdout_every": HOLDOUT_EVERY,
                                "features": "pre-RoPE K and V of one sharer layer, heads flattened, + bias"})
    return config, tensors
