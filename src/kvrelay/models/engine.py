"""Engine modes: which weights a linear layer multiplies with, chosen per call by its token count.

On a CPU the fastest precision differs between the two phases of generation:

* **prefill** (many tokens per call) is compute-bound: fp32 GEMM is the fastest there;
* **decode** (one token per call) is memory-bound: every weight is read once per token, so
  compact weights (bf16/fp16, per-row int8, group-wise int4) cut the bytes read.

``apply_engine(model, mode)`` swaps every ``nn.Linear`` (through the public module tree, as
quantizers do) for a ``PhaseLinear`` that keeps the original fp32 parameter for calls with more
than one token and a compact copy for one-token calls — ``x`` of shape (..., 1, in). Activations,
norms, attention and the KV cache stay fp32, so a cache looks the same in every mode; only the
one-token matmuls (decode steps and the last-position lm-head) differ. A tied lm-head keeps sharing
its fp32 weight with the embedding; its compact copy is made once.

Modes: ``fp32`` (no swap), ``bf16``, ``fp16``, ``int8`` (PyTorch's ``_weight_int8pack_mm``, per-row
symmetric int8 weights, bf16 activations), ``int4`` (``_weight_int4pack_mm_for_cpu``, asymmetric
int4 in groups of 32 along the input, bf16 activations; layers that do not fit its shape rules use
int8). The mode is part of a model's identity (``ModelIdentity.engine``): caches made in one mode
are refused by another unless accepted explicitly (``kvrelay.fuse.engine``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

INT4_GROUP = 32  # input features per int4 scale/zero pair


@dataclass(frozen=True, slots=True)
class EngineMode:
    name: str
    description: str
    weight_bytes: float  # bytes per weight read by a one-token call (the decode memory traffic)
    phase_uniform: bool  # decode and prefill compute with the same weights (no per-phase difference)


MODES = {m.name: m for m in (
    EngineMode("fp32", "fp32 weights in both phases", 4.0, True),
    EngineMode("bf16", "fp32 prefill; bf16 weights and activations for one-token calls", 2.0, False),
    EngineMode("fp16", "fp32 prefill; fp16 weights and activations for one-token calls", 2.0, False),
    EngineMode("int8", "fp32 prefill; per-row int8 weights (bf16 activations) for one-token calls", 1.0, False),
    EngineMode("int4", f"fp32 prefill; int4 weights in groups of {INT4_GROUP} (bf16 activations) "
                       "for one-token calls", 0.5 + 4 / INT4_GROUP, False),
)}
ENGINES = tuple(MODES)  # every concrete mode; "auto" resolves to one of them (``models.engine_auto``)


def mode(name: str) -> EngineMode:
    if name not in MODES:
        raise ValueError(f"engine must be one of {[*ENGINES, 'auto']}, got {name!r}")
    return MODES[name]


# ---- compact weights: (N, K) fp32 -> what a one-token call multiplies with ---------------------

def _int8_rows(w: torch.Tensor, act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: w ≈ q * s[:, None]; q (N, K) int8, s (N,) in the activation dtype."""
    s = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).to(act)  # (N,)
    q = torch.round(w / s.float()[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, s


def _int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``INT4_GROUP`` input features, packed for the CPU tinygemm kernel.

    Returns (packed (N, K/2) uint8, scale_zero (K/G, N, 2) bf16) with w ≈ (q - 8) * scale + zero.
    """
    N, K = w.shape
    g = w.reshape(N, K // INT4_GROUP, INT4_GROUP)  # (N, K/G, G)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-12)  # (N, K/G, 1)
    q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32).reshape(N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
    sz = torch.stack((scale.reshape(N, -1).T, zero.reshape(N, -1).T), dim=-1)  # (K/G, N, 2)
    return packed, sz.to(torch.bfloat16).contiguous()


def _int4_fits(w: torch.Tensor) -> bool:
    return w.shape[0] % 16 == 0 and w.shape[1] % INT4_GROUP == 0


class PhaseLinear(nn.Linear):
    """``nn.Linear`` that multiplies one-token inputs with compact weights and the rest with fp32.

    ``weight``/``bias`` are the original parameters (shared, e.g. with a tied embedding); the compact
    copy lives in non-persistent buffers, so ``state_dict`` and weight hashes are those of the model.
    """

    def __init__(self, src: nn.Linear, kind: str):
        nn.Module.__init__(self)
        self.in_features, self.out_features = src.in_features, src.out_features
        self.weight, self.bias = src.weight, src.bias
        self.every_call = False  # True inside ``decode_weights``: multi-token calls use the compact copy too
        w = src.weight.detach().float()  # (N, K)
        if kind == "int4" and not _int4_fits(w):
            kind = "int8"
        self.kind = kind
        if kind in ("bf16", "fp16"):
            self.act = torch.bfloat16 if kind == "bf16" else torch.float16
            self.register_buffer("w_c", w.to(self.act), persistent=False)  # (N, K)
        elif kind == "int8":
            self.act = torch.bfloat16  # the kernel's fp16 path is up to 24x slower on some CPUs (docs/engine.md)
            q, s = _int8_rows(w, self.act)
            self.register_buffer("w_c", q, persistent=False)  # (N, K) int8
            self.register_buffer("s_c", s, persistent=False)  # (N,)
        elif kind == "int4":
            self.act = torch.bfloat16
            packed, sz = _int4_groups(w)
            self.register_buffer("w_c", packed, persistent=False)  # (N, K/2) uint8
            self.register_buffer("s_c", sz, persistent=False)  # (K/G, N, 2)
        else:
            raise ValueError(f"no compact kernel {kind!r}")

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) fp32 -> (M, N) fp32 through the compact weights."""
        xa = x.to(self.act)
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xa, self.w_c, self.s_c)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.w_c, INT4_GROUP, self.s_c)
        else:
            y = xa @ self.w_c.T
        return y.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., q, K)
        if x.ndim < 2 or (x.shape[-2] != 1 and not self.every_call) or x.dtype != torch.float32:
            return nn.functional.linear(x, self.weight, self.bias)
        y = self.compact(x.reshape(-1, self.in_features))  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, one_token={self.kind}"


def apply_engine(model: nn.Module, name: str) -> nn.Module:
    """Swap ``model``'s linear layers for ``PhaseLinear`` of mode ``name`` (in place; fp32: no-op).

    A linear module reached under several names (a tied head) is wrapped once and re-attached at each.
    """
    m = mode(name)
    if m.phase_uniform:
        return model
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"engine {name!r} needs an fp32 model (prefill runs in fp32)")
    done: dict[int, PhaseLinear] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                if id(child) not in done:
                    done[id(child)] = PhaseLinear(child, name)
                setattr(parent, child_name, done[id(child)])
    return model


@contextmanager
def decode_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every call multiplies with the weights a one-token call uses.

    A speculative verify forward reads several tokens at once but must compute what one-token decode
    steps compute (``models.speculative``); in ``fp32`` (no ``PhaseLinear``) this changes nothing.
    """
    layers = [m for m in model.modules() if isinstance(m, PhaseLinear)]
    for m in layers:
        m.every_call = True
    try:
        yield model
    finally:
        for m in layers:
            m.every_call = False


def strip_engine(model: nn.Module) -> nn.Module:
    """Undo ``apply_engine``: plain ``nn.Linear`` over the same parameters (in place)."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, PhaseLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                lin.weight, lin.bias = child.weight, child.bias
                setattr(parent, child_name, lin)
    return model


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a one-token forward reads (compact copies where present, fp32 elsewhere)."""
    total = 0
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, PhaseLinear):
            for t in (mod.w_c, getattr(mod, "s_c", None), mod.bias):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    for name, p in model.named_parameters(remove_duplicate=True):
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(owner, PhaseLinear) or "embed" in name:
            continue  # compact copy counted above; an embedding reads one row per token
        total += p.numel() * p.element_size()
    return total


def with_engine(lm, engine: str):
    """A ``LoadedModel`` in engine mode ``engine``: a new model object, same fp32 parameters.

    The parameters are shared with ``lm`` (no second fp32 copy); ``lm`` itself is left as it was.
    """
    if lm.identity.engine != "fp32":
        raise ValueError(f"with_engine starts from an fp32 model, got engine {lm.identity.engine!r}")
    if mode(engine).phase_uniform:
        return lm
    memo = {id(p): p for p in lm.model.parameters()}  # share parameters, copy modules and buffers
    model = apply_engine(copy.deepcopy(lm.model, memo), engine)
    return replace(lm, model=model, identity=replace(lm.identity, engine=engine))
