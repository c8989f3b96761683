"""Engine modes: which weights a linear layer multiplies with, chosen per call by its token count.

On a CPU the fastest precision differs between the two phases of generation:

* **prefill** (many tokens per call) is compute-bound: fp32 GEMM, or bf16 GEMM where the CPU has
  bf16 dot-product instructions (``avx512_bf16``, AMX) and oneDNN's bf16 GEMM outruns fp32 (on
  AVX2-only hosts it is several times slower; ``benchmarks/prefill_gemm.py`` measures it);
* **decode** (one token per call) is memory-bound: every weight is read once per token, so
  compact weights (bf16/fp16, per-row int8, group-wise int4) cut the bytes read, and a layout the
  kernel reads without repacking (``fp32p``) reads the same bytes faster.

A mode names both phases: ``PREFILL+DECODE`` (``bf16+int8``: bf16 prefill GEMMs, int8 one-token
calls); a bare decode name (``int8``) keeps fp32 prefill, as every mode did before prefill had a
choice; ``fp32`` is fp32 in both phases. ``precisions(name)`` splits a name into its two phases.

``apply_engine(model, mode)`` swaps every ``nn.Linear`` (through the public module tree, as
quantizers do) for a ``PhaseLinear`` that keeps the original fp32 parameter (and, for bf16 prefill,
a bf16 copy) for calls with more than one token and a compact copy for one-token calls — ``x`` of
shape (..., 1, in). Activations, norms, attention and the KV cache stay fp32, so a cache looks the
same in every mode; only the linear layers' products differ. A tied lm-head keeps sharing its fp32
weight with the embedding; its copies are made once.

Decode precisions: ``fp32``, ``fp32p`` (the fp32 weights reordered once into oneDNN's blocked layout,
``torch.ops.mkldnn._reorder_linear_weight``, multiplied by ``torch.ops.mkldnn._linear_pointwise``: the
same precision as ``fp32``, only the summation order differs; on the CPUs measured a plain fp32 GEMM of
one to a few rows reads the weights well below the memory's speed, docs/engine.md), ``fp16w`` (fp16 weights
packed once for fbgemm's fp16 GEMM, ``torch.ops.quantized.linear_dynamic_fp16``: fp32 activations and fp32
accumulation, each weight rounded to fp16 — a relative rounding under 2^-11 — at half fp32's bytes; CPUs
with AVX2), ``bf16``, ``fp16``, ``int8`` (PyTorch's ``_weight_int8pack_mm``,
per-row symmetric int8 weights, bf16 activations), ``int4`` (``_weight_int4pack_mm_for_cpu``,
asymmetric int4 in groups of 32 along the input, bf16 activations; layers that do not fit its shape
rules use int8). The mode is part of a model's identity (``ModelIdentity.engine``) and of every
payload's metadata: caches made in one mode are refused by another unless accepted explicitly
(``kvrelay.fuse.engine``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from kvrelay.core.modes import DECODES, PREFILLS, mode_name

INT4_GROUP = 32  # input features per int4 scale/zero pair


_DECODE = {
    "fp32": ("fp32 weights", 4.0),
    "fp32p": ("fp32 weights in oneDNN's blocked layout", 4.0),
    "fp16w": ("fp16 weights in fbgemm's layout (fp32 activations and accumulation)", 2.0),
    "bf16": ("bf16 weights and activations", 2.0),
    "fp16": ("fp16 weights and activations", 2.0),
    "int8": ("per-row int8 weights (bf16 activations)", 1.0),
    "int4": (f"int4 weights in groups of {INT4_GROUP} (bf16 activations)", 0.5 + 4 / INT4_GROUP),
}


@dataclass(frozen=True, slots=True)
class EngineMode:
    name: str
    prefill: str  # precision of multi-token calls: one of PREFILLS
    decode: str  # precision of one-token calls: one of DECODES
    description: str
    weight_bytes: float  # bytes per weight read by a one-token call (the decode memory traffic)

    def __post_init__(self):
        if self.prefill not in PREFILLS or self.decode not in DECODES:
            raise ValueError(f"expected a prefill in {PREFILLS} and a decode in {DECODES}, "
                             f"got {self.prefill!r}, {self.decode!r}")

    @property
    def phase_uniform(self) -> bool:
        """Both phases compute with the fp32 weights (no swap at all)."""
        return self.prefill == "fp32" and self.decode == "fp32"


def _mode(prefill: str, decode: str) -> EngineMode:
    what, nbytes = _DECODE[decode]
    return EngineMode(mode_name(prefill, decode), prefill, decode,
                      f"{prefill} prefill; {what} for one-token calls", nbytes)


ENGINE_MODES = {m.name: m for m in (_mode(p, d) for p in PREFILLS for d in DECODES)}
ENGINES = tuple(ENGINE_MODES)  # every concrete mode; "auto" resolves to one of them (``models.engine_auto``)


def mode(name: str) -> EngineMode:
    if name not in ENGINE_MODES:
        raise ValueError(f"engine must be one of {[*ENGINES, 'auto']}, got {name!r}")
    return ENGINE_MODES[name]


def precisions(name: str) -> tuple[str, str]:
    """(prefill, decode) precisions of mode ``name`` (what a payload made in that mode was computed with)."""
    m = mode(name)
    return m.prefill, m.decode


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


def _packed(w: torch.Tensor) -> torch.Tensor:
    """(N, K) fp32 -> the same weights in oneDNN's blocked layout (an opaque mkldnn tensor, N*K floats)."""
    if not torch.backends.mkldnn.is_available():
        raise ValueError("decode precision 'fp32p' needs PyTorch built with oneDNN (torch.backends.mkldnn); "
                         "use 'fp32' on this build")
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def fp16w_available() -> bool:
    """fbgemm's fp16 GEMM is built into this PyTorch and this CPU runs it (AVX2 or wider)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def _fp16_packed(w: torch.Tensor):
    """(N, K) fp32 -> the weights rounded to fp16 and packed for fbgemm (an opaque object, N*K halves)."""
    if not fp16w_available():
        raise ValueError("decode precision 'fp16w' needs PyTorch's fbgemm and a CPU with AVX2 "
                         f"(this one: {torch.backends.cpu.get_cpu_capability()}); use 'fp32p' or 'fp32' here")
    big = float(w.abs().max()) if w.numel() else 0.0
    if big > torch.finfo(torch.float16).max:
        raise ValueError(f"decode precision 'fp16w': a weight of magnitude {big:g} does not fit fp16 "
                         f"(at most {torch.finfo(torch.float16).max:g}); use 'fp32p' or 'fp32' for this model")
    return torch.ops.quantized.linear_prepack_fp16(w, None)


_OPAQUE = {"fp32p": _packed, "fp16w": _fp16_packed}  # kinds whose copy is an opaque packed object


def _int4_fits(w: torch.Tensor) -> bool:
    return w.shape[0] % 16 == 0 and w.shape[1] % INT4_GROUP == 0


class PhaseLinear(nn.Linear):
    """``nn.Linear`` that multiplies one-token inputs with compact weights and the rest in the prefill precision.

    ``weight``/``bias`` are the original parameters (shared, e.g. with a tied embedding); the copies
    live in non-persistent buffers, so ``state_dict`` and weight hashes are those of the model. The
    ``fp32p`` and ``fp16w`` copies are opaque packed objects (a oneDNN tensor, an fbgemm handle) that cannot
    be copied or moved, so they are plain attributes, left out of the module's state and packed again from
    ``weight`` on ``copy.deepcopy``.
    """

    def __init__(self, src: nn.Linear, kind: str, prefill: str = "fp32"):
        nn.Module.__init__(self)
        self.in_features, self.out_features = src.in_features, src.out_features
        self.weight, self.bias = src.weight, src.bias
        self.every_call = False  # True inside ``decode_weights``: multi-token calls use the compact copy too
        w = src.weight.detach().float()  # (N, K)
        if kind == "int4" and not _int4_fits(w):
            kind = "int8"
        self.kind, self.prefill = kind, prefill
        if kind == "fp32":
            self.act = torch.float32
        elif kind in _OPAQUE:
            self.act = torch.float32
            self.w_c = _OPAQUE[kind](w)  # (N, K) opaque, not a buffer (class docstring)
        elif kind in ("bf16", "fp16"):
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
        if prefill == "bf16":  # the prefill GEMM's weights; shared with a bf16 decode copy
            self.register_buffer("w_p", self.w_c if kind == "bf16" else w.to(torch.bfloat16), persistent=False)
        elif prefill != "fp32":
            raise ValueError(f"no prefill precision {prefill!r}; expected one of {PREFILLS}")
        else:
            self.w_p = None

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) fp32 -> (M, N) fp32 through the compact weights."""
        if self.kind == "fp32":
            return nn.functional.linear(x, self.weight)
        if self.kind == "fp32p":
            return torch.ops.mkldnn._linear_pointwise(x, self.w_c, None, "none", [], "")
        if self.kind == "fp16w":
            return torch.ops.quantized.linear_dynamic_fp16(x, self.w_c)
        xa = x.to(self.act)
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xa, self.w_c, self.s_c)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.w_c, INT4_GROUP, self.s_c)
        else:
            y = xa @ self.w_c.T
        return y.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., q, K)
        if x.ndim < 2 or x.dtype != torch.float32:
            return nn.functional.linear(x, self.weight, self.bias)
        if x.shape[-2] != 1 and not self.every_call:
            if self.w_p is None:
                return nn.functional.linear(x, self.weight, self.bias)
            y = nn.functional.linear(x.to(torch.bfloat16), self.w_p).float()  # (..., q, N), bf16 GEMM
            return y if self.bias is None else y + self.bias
        y = self.compact(x.reshape(-1, self.in_features))  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def decode_bytes(self) -> int:
        """Bytes of the weights (and scales) a one-token call reads, bias excluded."""
        if self.kind == "fp16w":
            return self.weight.numel() * 2  # an opaque fbgemm handle to N*K halves
        mats = [t for t in (getattr(self, "w_c", None), getattr(self, "s_c", None)) if t is not None] or [self.weight]
        return sum(t.numel() * t.element_size() for t in mats)

    def __getstate__(self):
        state = self.__dict__.copy()
        if self.kind in _OPAQUE:
            del state["w_c"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.kind in _OPAQUE:
            self.w_c = _OPAQUE[self.kind](self.weight.detach().float())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, prefill={self.prefill}, "
                f"one_token={self.kind}")


def apply_engine(model: nn.Module, name: str) -> nn.Module:
    """Swap ``model``'s linear layers for ``PhaseLinear`` of mode ``name`` (in place; fp32: no-op).

    A linear module reached under several names (a tied head) is wrapped once and re-attached at each.
    """
    m = mode(name)
    if m.phase_uniform:
        return model
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"engine {name!r} needs an fp32 model (its weights are the fp32 ones)")
    done: dict[int, PhaseLinear] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                if id(child) not in done:
                    done[id(child)] = PhaseLinear(child, m.decode, m.prefill)
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
    """Bytes of weights one one-token forward of ``model`` reads.

    Every linear layer reads its weight matrix — the compact copy its engine mode multiplies one
    token with (``PhaseLinear.decode_bytes``: its compact weights and their scales) when it has one —
    plus its bias; an embedding reads one row; any other parameter (norms) is read whole. A tied
    lm-head is a linear layer of its own and is counted as one, its embedding as one row.
    """
    total = 0
    for mod in {id(m): m for m in model.modules()}.values():
        if isinstance(mod, nn.Linear):
            compact = mod.decode_bytes() if isinstance(mod, PhaseLinear) else None
            total += mod.weight.numel() * mod.weight.element_size() if compact is None else compact
            if mod.bias is not None:
                total += mod.bias.numel() * mod.bias.element_size()
        elif isinstance(mod, nn.Embedding):
            total += mod.weight.shape[1] * mod.weight.element_size()
        else:
            total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
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
