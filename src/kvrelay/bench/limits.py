"""The machine's physical limits for one model, and how close an engine gets to them.

Two limits, both measured on the machine the benchmark runs on, with the benchmark's thread count:

* **memory bandwidth** (``mem_gbs``, 1e9 bytes/s): a decode step reads every weight once, so no
  engine decodes faster than ``mem_gbs / weight bytes read per token`` tokens/s. Measured as the
  best of three streaming kernels over arrays far larger than the caches — read (a sum), copy,
  and a STREAM-style triad ``a = b + s * c`` — counting the bytes each must move.
* **GEMM peak** (``gemm_gflops``): fp32 matmuls at the shapes of a prefill (thousands of tokens
  through the model's own linear layers). Prefill FLOPs per token are about twice the linear
  parameters plus attention; ``prefill_fraction_of_limit`` is the achieved FLOP rate over that peak.
  An engine whose prefill does not run fp32 GEMMs (llama.cpp's quantized dot products) may exceed 1.

The arithmetic (``decode_limit_tokens_per_s``, ``prefill_flops``, ``fraction``) is pure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BANDWIDTH_BYTES = 1 << 29  # 512 MiB per array: far beyond any last-level cache


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the FLOP count needs from a decoder-only transformer's config."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> Geometry:
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim, cfg.vocab_size)

    @property
    def linear_params(self) -> int:
        """Weights of every layer's q, k, v, o and gated MLP (embedding and lm-head excluded)."""
        attn = self.hidden * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.num_layers * (attn + mlp)


def prefill_flops(g: Geometry, tokens: int, cached: int = 0) -> float:
    """FLOPs of prefilling ``tokens`` tokens after ``cached`` ones, logits for the last position only.

    Linear layers: 2 FLOPs per weight per token. Attention (causal): the token at position t scores
    and mixes t + 1 keys, 2 * head_dim FLOPs each for QK^T and again for AV, in every head of every
    layer. The lm-head runs once (2 * vocab * hidden), as both engines keep only the last logits.
    """
    if tokens < 1 or cached < 0:
        raise ValueError(f"need tokens >= 1 and cached >= 0, got {tokens} and {cached}")
    keys = tokens * cached + tokens * (tokens + 1) / 2  # sum over new tokens of the keys each attends to
    attention = g.num_layers * g.num_heads * 4 * g.head_dim * keys
    return 2.0 * g.linear_params * tokens + attention + 2.0 * g.vocab * g.hidden


def decode_limit_tokens_per_s(mem_gbs: float, weight_bytes: float) -> float:
    """The bandwidth bound on decode: every weight byte read once per token."""
    if mem_gbs <= 0 or weight_bytes <= 0:
        raise ValueError(f"need positive bandwidth and weight bytes, got {mem_gbs} GB/s and {weight_bytes} B")
    return mem_gbs * 1e9 / weight_bytes


def decode_fraction(tokens_per_s: float, mem_gbs: float, weight_bytes: float) -> float:
    """Achieved decode tokens/s over the bandwidth bound for ``weight_bytes`` read per token."""
    return tokens_per_s / decode_limit_tokens_per_s(mem_gbs, weight_bytes)


def prefill_fraction(tokens_per_s: float, flops_per_token: float, gemm_gflops: float) -> float:
    """Achieved FLOP rate of a prefill over the machine's GEMM peak."""
    if gemm_gflops <= 0:
        raise ValueError(f"need a positive GEMM peak, got {gemm_gflops} GFLOP/s")
    return tokens_per_s * flops_per_token / (gemm_gflops * 1e9)


# ---- weight bytes a llama.cpp decode step reads (kvrelay's own: models.engine.decode_weight_bytes) --

def gguf_decode_weight_bytes(path: str | Path) -> int:
    """Bytes of tensor data a llama.cpp decode step reads from a GGUF file: every tensor, except the
    token embedding when the file has a separate ``output.weight`` (then only one row is read)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embd = tensors.get("token_embd.weight")
    if embd is not None and "output.weight" in tensors:
        rows = int(embd.shape[-1])  # GGUF shapes are (columns, rows): (hidden, vocab)
        total -= int(embd.n_bytes) - int(embd.n_bytes) // rows
    return total


# ---- measuring the machine -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MachineLimits:
    mem_gbs: float  # best of read / copy / triad
    gemm_gflops: float  # best fp32 GEMM over the prefill shapes
    read_gbs: float
    copy_gbs: float
    triad_gbs: float
    gemm: dict  # "MxKxN" -> GFLOP/s (median of repeats)
    threads: int
    array_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def _median_time(fn, repeats: int) -> float:
    fn()  # first touch / warm-up, not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(array_bytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> dict[str, float]:
    """GB/s of a read (sum), a copy and a triad over fp32 arrays of ``array_bytes`` each."""
    n = array_bytes // 4
    a, b, c = (torch.full((n,), v, dtype=torch.float32) for v in (0.0, 1.0, 2.0))
    read = _median_time(lambda: b.sum(), repeats)
    copy = _median_time(lambda: a.copy_(b), repeats)
    triad = _median_time(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return {"read_gbs": 4 * n / read / 1e9, "copy_gbs": 8 * n / copy / 1e9, "triad_gbs": 12 * n / triad / 1e9}


def prefill_shapes(g: Geometry, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's own prefill matmuls: q/o projections and the MLP's up and down."""
    return [(tokens, g.hidden, g.num_heads * g.head_dim), (tokens, g.hidden, g.intermediate),
            (tokens, g.intermediate, g.hidden)]


def measure_gemm(shapes: list[tuple[int, int, int]], repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of fp32 ``(M, K) @ (K, N)`` for each shape (median time of ``repeats``)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=gen)  # (M, K)
        w = torch.randn(k, n, generator=gen)  # (K, N)
        y = torch.empty(m, n)
        t = _median_time(lambda x=x, w=w, y=y: torch.matmul(x, w, out=y), repeats)
        out[f"{m}x{k}x{n}"] = 2.0 * m * k * n / t / 1e9
    return out


def measure_limits(g: Geometry, tokens: int, *, repeats: int = 5,
                   array_bytes: int = BANDWIDTH_BYTES) -> MachineLimits:
    """Both limits on this machine with torch's current thread count."""
    bw = measure_bandwidth(array_bytes, repeats)
    gemm = measure_gemm(prefill_shapes(g, tokens), repeats)
    return MachineLimits(mem_gbs=max(bw.values()), gemm_gflops=max(gemm.values()), **bw, gemm=gemm,
                         threads=torch.get_num_threads(), array_bytes=array_bytes)
