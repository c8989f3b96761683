"""The limit arithmetic behind ``bench engine``: FLOPs per prefill, the bandwidth bound, weight bytes read."""

from __future__ import annotations

import pytest
import torch

from kvrelay.bench.limits import (
    Geometry,
    decode_fraction,
    decode_limit_tokens_per_s,
    gguf_decode_weight_bytes,
    measure_bandwidth,
    measure_gemm,
    prefill_flops,
    prefill_fraction,
)
from kvrelay.models.engine import PhaseLinear, decode_weight_bytes
from kvrelay.models.tiny import tiny_lm

# qwen2.5-coder-0.5b's config, as the zoo model loads it
QWEN05 = Geometry(num_layers=24, hidden=896, intermediate=4864, num_heads=14, num_kv_heads=2, head_dim=64,
                  vocab=151936)


def test_linear_params_of_qwen05_are_its_layers_weights():
    per_layer = 896 * 896 * 2 + 896 * 128 * 2 + 3 * 896 * 4864  # q, o; k, v; gate, up, down
    assert QWEN05.linear_params == 24 * per_layer == 357_826_560


def test_prefill_flops_counts_linear_attention_and_one_lm_head():
    g = QWEN05
    # one token, nothing cached: every weight twice, attention over 1 key, the lm-head once
    assert prefill_flops(g, 1) == 2 * g.linear_params + 24 * 14 * 4 * 64 * 1 + 2 * 151936 * 896
    # causal attention: token t attends to t + 1 keys -> T(T+1)/2 keys in all
    t = 2048
    attn = prefill_flops(g, t) - 2 * g.linear_params * t - 2 * g.vocab * g.hidden
    assert attn == pytest.approx(24 * 14 * 4 * 64 * t * (t + 1) / 2)
    # after a cache of c tokens every new token also attends to all c
    assert prefill_flops(g, 10, cached=100) - prefill_flops(g, 10) == pytest.approx(24 * 14 * 4 * 64 * 10 * 100)
    with pytest.raises(ValueError):
        prefill_flops(g, 0)


def test_bandwidth_bound_and_fractions():
    # 18 GB/s over 2 GB of weights per token: at most 9 tokens/s; 6.3 tokens/s is 0.7 of it
    assert decode_limit_tokens_per_s(18.0, 2e9) == pytest.approx(9.0)
    assert decode_fraction(6.3, 18.0, 2e9) == pytest.approx(0.7)
    # halving the bytes read doubles the bound, so the same speed is half the fraction
    assert decode_fraction(6.3, 18.0, 1e9) == pytest.approx(0.35)
    # 100 tokens/s at 0.8 GFLOP/token on a 160 GFLOP/s peak: half of it
    assert prefill_fraction(100.0, 0.8e9, 160.0) == pytest.approx(0.5)
    for bad in ((0.0, 1e9), (18.0, 0)):
        with pytest.raises(ValueError):
            decode_limit_tokens_per_s(*bad)
    with pytest.raises(ValueError):
        prefill_fraction(1.0, 1.0, 0.0)


def test_geometry_from_a_real_config():
    lm = tiny_lm("qwen2")
    cfg = lm.model.config
    g = Geometry.from_config(cfg)
    assert (g.num_layers, g.hidden, g.intermediate, g.vocab) == (cfg.num_hidden_layers, cfg.hidden_size,
                                                                cfg.intermediate_size, cfg.vocab_size)
    linear = sum(m.weight.numel() for n, m in lm.model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in n)
    assert g.linear_params == linear


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_decode_weight_bytes_reads_every_matrix_once_and_one_embedding_row(arch):
    model = tiny_lm(arch).model
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    params = {id(p): p for p in model.parameters()}.values()
    every = sum(p.numel() * 4 for p in params)
    want = every - emb.numel() * 4 + emb.shape[1] * 4  # the embedding reads one row per token
    if head is emb:  # tied: the lm-head still reads the whole matrix
        want += head.numel() * 4
    assert decode_weight_bytes(model) == want


def test_decode_weight_bytes_counts_the_compact_copy_a_linear_multiplies_with():
    lin = torch.nn.Linear(64, 32, bias=True)
    assert decode_weight_bytes(torch.nn.Sequential(lin)) == (64 * 32 + 32) * 4
    int8 = torch.nn.Sequential(PhaseLinear(lin, "int8"))
    assert decode_weight_bytes(int8) == 32 * 64 + 32 * 2 + 32 * 4  # int8 rows + bf16 scales + fp32 bias
    fp16w = torch.nn.Sequential(PhaseLinear(lin, "fp16w"))
    assert decode_weight_bytes(fp16w) == 32 * 64 * 2 + 32 * 4  # fp16 weights behind fbgemm's handle + fp32 bias


def _write_gguf(path, names):
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "qwen2")
    for name, shape in names.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_weight_bytes_skip_the_embedding_only_when_the_output_matrix_is_separate(tmp_path):
    sep = {"token_embd.weight": (100, 16), "output.weight": (100, 16), "blk.0.ffn_up.weight": (32, 16)}
    _write_gguf(tmp_path / "sep.gguf", sep)
    assert gguf_decode_weight_bytes(tmp_path / "sep.gguf") == (16 + 100 * 16 + 32 * 16) * 4
    tied = {"token_embd.weight": (100, 16), "blk.0.ffn_up.weight": (32, 16)}
    _write_gguf(tmp_path / "tied.gguf", tied)  # llama.cpp multiplies with token_embd as the output
    assert gguf_decode_weight_bytes(tmp_path / "tied.gguf") == (100 * 16 + 32 * 16) * 4


def test_measurements_return_positive_rates_for_the_bytes_and_flops_they_move():
    bw = measure_bandwidth(array_bytes=1 << 22, repeats=1)
    assert set(bw) == {"read_gbs", "copy_gbs", "triad_gbs"} and all(v > 0 for v in bw.values())
    gemm = measure_gemm([(8, 16, 32)], repeats=1)
    assert list(gemm) == ["8x16x32"] and gemm["8x16x32"] > 0
