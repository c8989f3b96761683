"""``fuser``: a trained, gated projection of a sharer's cache into the receiver's own cache (fuse mode).

Both models read the same input. For receiver layer ``t`` reading sharer layer ``s = layer_map[t]``
(depth-proportional), at every receiver slot (``bridge``: the sharer slot aligned to it)::

    x      = standardise([K_s_pre, V_s])                      (F,)  F = 2·H_s·D_s, RoPE stripped
    h      = silu(x @ down_t + b_t)                           (r,)  r = rank (the size knob)
    w      = sigmoid(x @ weight_t + c_t)                      (2·H_r,) a weight per token and head, K and V
    ΔK_pre = (h @ up_k_t) ⊙ w_K,  ΔV = (h @ up_v_t) ⊙ w_V     (H_r, D_r)
    K'     = K_r + g_t · rope(ΔK_pre at the receiver's positions),  V' = V_r + g_t · ΔV

``g_t`` is a per-layer gate: a Gumbel-sigmoid of ``gate_t`` with an annealed temperature while
training, hard at inference (1 when ``gate_t > 0``, else the layer is the receiver's own, untouched).
The fused cache keeps the receiver's shape and positions; a closed gate everywhere is exactly the
receiver alone. ``up_k``/``up_v`` start at zero, so training starts from the receiver alone too.

``FuserAdapter`` is the ``Adapter``: a sharer payload in, the receiver's own reading of the same
text (prefilled with its public forward) fused with it out, stamped ``fuser@…``. It refuses a
receiver or sharer whose fingerprint differs from the artefact's (``AdapterMismatch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from kvrelay.core.errors import IncompatiblePayload
from kvrelay.fuse import align, artefact
from kvrelay.fuse.adapter import stamp
from kvrelay.fuse.bridge import TokenBridge, read, sharer_features
from kvrelay.kv.compat import require_raw
from kvrelay.kv.payload import RAW, KVPayload
from kvrelay.models.identity import ModelIdentity

GATE_INIT = 1.0  # gates start open (logit > 0); training closes the layers that do not help


def gate_values(logits: torch.Tensor, tau: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """(L,) gates: hard 0/1 (``tau`` None, inference) or a Gumbel-sigmoid sample at temperature ``tau``."""
    if tau is None:
        return (logits > 0).to(logits.dtype)
    u = torch.rand(logits.shape, generator=generator).clamp(1e-6, 1 - 1e-6).to(logits.dtype)
    return torch.sigmoid((logits + torch.log(u) - torch.log1p(-u)) / tau)


def tau_at(step: int, steps: int, tau0: float = 1.0, tau1: float = 0.1) -> float:
    """Temperature annealed geometrically from ``tau0`` to ``tau1`` over ``steps``."""
    frac = min(max(step / max(steps - 1, 1), 0.0), 1.0)
    return tau0 * (tau1 / tau0) ** frac


class FuserNet(nn.Module):
    """The fuser's parameters for ``n_layers`` receiver layers (shapes in the module docstring)."""

    def __init__(self, n_layers: int, f_in: int, heads: int, head_dim: int, rank: int, gate_init: float = GATE_INIT):
        super().__init__()
        if min(n_layers, f_in, heads, head_dim, rank) < 1:
            raise ValueError("FuserNet needs positive layer, feature, head, head-dim and rank sizes")
        L, o = n_layers, heads * head_dim
        self.heads, self.head_dim, self.rank = heads, head_dim, rank
        g = torch.Generator().manual_seed(0)
        self.down = nn.Parameter(torch.randn(L, f_in, rank, generator=g) / math.sqrt(f_in))
        self.down_b = nn.Parameter(torch.zeros(L, rank))
        self.up_k = nn.Parameter(torch.zeros(L, rank, o))
        self.up_v = nn.Parameter(torch.zeros(L, rank, o))
        self.weight = nn.Parameter(torch.zeros(L, f_in, 2 * heads))
        self.weight_b = nn.Parameter(torch.zeros(L, 2 * heads))
        self.gate = nn.Parameter(torch.full((L,), float(gate_init)))
        self.register_buffer("mu", torch.zeros(L, f_in))
        self.register_buffer("sd", torch.ones(L, f_in))

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def delta(self, t: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, F) sharer features -> (ΔK_pre, ΔV), each (B, H_r, T, D_r)."""
        z = (x - self.mu[t]) / self.sd[t]
        h = torch.nn.functional.silu(z @ self.down[t] + self.down_b[t])  # (B, T, r)
        w = torch.sigmoid(z @ self.weight[t] + self.weight_b[t])  # (B, T, 2·H_r)
        B, T, _ = x.shape
        H, D = self.heads, self.head_dim
        dk = (h @ self.up_k[t]).reshape(B, T, H, D) * w[..., :H, None]
        dv = (h @ self.up_v[t]).reshape(B, T, H, D) * w[..., H:, None]
        return dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state_dict().items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> FuserNet:
        L, f_in, rank = tensors["down"].shape
        heads = tensors["weight"].shape[2] // 2
        net = cls(L, f_in, heads, tensors["up_k"].shape[2] // heads, rank)
        net.load_state_dict({k: v.float() for k, v in tensors.items()})
        return net.eval().requires_grad_(False)


def fuse_kv(net: FuserNet, own: KVPayload, feats: dict[int, torch.Tensor], layer_map: tuple[int, ...],
            receiver: ModelIdentity, gates: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Receiver layers of ``own`` (B, H_r, T, D_r) with the gated sharer deltas added; differentiable.

    ``feats[s]`` (B, T, F): sharer layer ``s``'s features at the receiver's slots. A gate of exactly
    0 keeps that layer's own tensors (no arithmetic on them at all).
    """
    keys, values = [], []
    for t, s in enumerate(layer_map):
        k, v = own.keys[t], own.values[t]
        if float(gates[t].detach()) == 0.0:
            keys.append(k)
            values.append(v)
            continue
        dk, dv = net.delta(t, feats[s])
        dk = align.apply_rope(dk, own.positions, receiver.rope_for(receiver.layer_types[t]))
        keys.append(k + gates[t] * dk.to(k.dtype))
        values.append(v + gates[t] * dv.to(v.dtype))
    return keys, values


def check_full_attention(ident: ModelIdentity, who: str) -> None:
    if ident.sliding_window and any("sliding" in t for t in ident.layer_types):
        raise ValueError(f"the fuser maps full-attention caches only; the {who} has sliding-window layers")


@dataclass(frozen=True)
class FuserAdapter:
    """A trained fuser as an ``Adapter``, bound to the loaded receiver model whose own cache it extends."""

    config: artefact.ArtefactConfig
    tensors: dict = field(repr=False)
    receiver_model: object = field(repr=False)
    bridge: TokenBridge = field(default_factory=TokenBridge)
    name: str = "fuser"
    net: FuserNet = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "net", FuserNet.from_tensors(self.tensors))

    @property
    def fingerprint(self) -> str:
        return artefact.digest(self.config, self.tensors)

    @classmethod
    def load(cls, folder, receiver_lm, sharer_tokenizer=None) -> FuserAdapter:
        """The artefact in ``folder`` bound to ``receiver_lm``; ``AdapterMismatch`` if it is another model."""
        config, tensors = artefact.load(folder)
        if config.method != "fuser":
            raise ValueError(f"{folder} holds a {config.method!r} adapter, not a fuser")
        config.check_pair(receiver_lm.identity, where=f"fuser artefact {folder}")
        bridge = TokenBridge.between(config.sharer.tokenizer_hash, config.receiver.tokenizer_hash, sharer_tokenizer,
                                     receiver_lm.tokenizer, what="this fuser")
        return cls(config, tensors, receiver_lm.model, bridge)

    def adapt(self, payload: KVPayload, receiver: ModelIdentity) -> KVPayload:
        """The receiver's own reading of ``payload``'s text, fused with ``payload`` (hard gates)."""
        m = payload.meta
        self.config.check_pair(receiver, m.model_fingerprint, where=f"{self.name}@{self.fingerprint[:16]}")
        if m.tokenizer_hash != self.config.sharer.tokenizer_hash:
            raise IncompatiblePayload("tokenizer_hash", self.config.sharer.tokenizer_hash, m.tokenizer_hash)
        if payload.batch_size != 1 or not bool(payload.mask.all()):
            raise ValueError("the fuser maps one unpadded row at a time (split the batch)")
        require_raw(m, complete=True)
        if int(payload.positions[0, 0]) != 0:
            raise ValueError("the fuser fuses readings that start at position 0")
        r_ids, index = self.bridge.receiver_reading(payload.token_ids[0].tolist())
        own = read(self.receiver_model, receiver, r_ids, producer=m.producer)
        return self.fuse(own, payload, index, receiver)

    def fuse(self, own: KVPayload, sharer: KVPayload, index: torch.Tensor, receiver: ModelIdentity) -> KVPayload:
        """``own`` (the receiver's reading) fused with ``sharer``; receiver slot i reads sharer slot ``index[i]``."""
        check_full_attention(receiver, "receiver")
        feats = {s: sharer_features(sharer, s)[:, index] for s in set(self.config.layer_map)}  # (1, T_r, F)
        with torch.no_grad():
            keys, values = fuse_kv(self.net, own, feats, self.config.layer_map, receiver, gate_values(self.net.gate))
        meta = replace(stamp(sharer.meta, receiver, self), dtype=own.meta.dtype, codec=RAW)
        return KVPayload(tuple(keys), tuple(values), own.token_ids, own.positions, own.mask, meta)


def to_artefact(net: FuserNet, receiver: tuple[str, ModelIdentity], sharer: tuple[str, ModelIdentity],
                layer_map: tuple[int, ...], training: dict, metrics: dict,
                layer_rule: str = "depth-proportional") -> tuple[artefact.ArtefactConfig, dict]:
    """The artefact (config, tensors) of a trained fuser; ``training`` records the data and steps."""
    same = receiver[1].tokenizer_hash == sharer[1].tokenizer_hash
    config = artefact.ArtefactConfig(
        method="fuser", receiver=artefact.ModelRef.of(*receiver), sharer=artefact.ModelRef.of(*sharer),
        layer_map=tuple(layer_map),
        alignment={"layers": layer_rule, "tokens": "same tokenizer" if same else
                   "receiver tokens; last sharer token covering each span",
                   "rope": "stripped from the sharer's keys; the key delta is rotated at the receiver's positions",
                   "heads": "all sharer heads -> each receiver head (low-rank)",
                   "fusion": "receiver's own cache + hard-gated, per-token per-head weighted projection"},
        training=training, metrics={**metrics, "n_params": net.n_params,
                                    "gates": [round(float(g), 4) for g in net.gate.detach()]},
        hyper={"rank": net.rank, "f_in": int(net.down.shape[1]), "heads": net.heads, "head_dim": net.head_dim,
               "gate_init": GATE_INIT})
    return config, net.tensors()
