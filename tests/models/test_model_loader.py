"""load_model on tiny random folders: identity, caching, errors (no download)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tiny_model_folders import save_tiny_model, tiny_llama_config

from kvrelay.core.errors import UnknownModel
from kvrelay.models.loaded import LoadedModel
from kvrelay.models.loader import clear_model_cache, load_model, model_facts
from kvrelay.models.tiny import tiny_lm


def test_local_folder_loads_in_eval_mode_with_identity(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir))
    assert isinstance(lm, LoadedModel)
    assert not lm.model.training
    assert lm.model.config._attn_implementation == "sdpa"
    assert lm.dtype == torch.float32
    assert lm.source == str(tiny_llama_dir.resolve())
    assert lm.chat is False
    ident = lm.identity
    assert (ident.arch, ident.num_layers, ident.num_kv_heads, ident.head_dim) == ("llama", 2, 2, 8)
    assert ident.layer_types == ("full_attention",) * 2 and ident.sliding_window is None


def test_loads_are_cached_in_process_by_name_and_dtype(tiny_llama_dir):
    a = load_model(str(tiny_llama_dir))
    assert load_model(tiny_llama_dir) is a  # Path or str, same key
    b = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    assert b is not a and b.dtype == torch.bfloat16
    clear_model_cache()
    c = load_model(str(tiny_llama_dir))
    assert c is not a
    assert c.identity == a.identity  # fingerprint from the weight files: stable across loads


def test_fingerprint_follows_the_weights(tmp_path):
    a = load_model(str(save_tiny_model(tmp_path / "a", tiny_llama_config(), seed=0)))
    b = load_model(str(save_tiny_model(tmp_path / "b", tiny_llama_config(), seed=1)))
    same = load_model(str(save_tiny_model(tmp_path / "same", tiny_llama_config(), seed=0)))
    assert a.identity.fingerprint != b.identity.fingerprint
    assert a.identity.fingerprint == same.identity.fingerprint
    assert a.identity.tokenizer_hash == b.identity.tokenizer_hash


def test_gemma3_folder_exposes_layer_types_window_and_two_rope_bases(tiny_gemma3_dir):
    facts = model_facts(load_model(str(tiny_gemma3_dir)))
    assert facts["layer_type_counts"] == {"sliding_attention": 5, "full_attention": 1}
    assert facts["sliding_window"] == 8
    thetas = {r["layer_type"]: r["theta"] for r in facts["rope"]}
    assert thetas == {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    assert facts["kv_bytes_per_token_fp32"] == 2 * 6 * 1 * 16 * 4


def test_bad_names_raise_unknown_model(tmp_path):
    with pytest.raises(UnknownModel, match="smollm2-135m"):
        load_model(str(tmp_path / "no-such-folder"))
    (tmp_path / "weights.txt").write_text("not a model")
    with pytest.raises(UnknownModel):
        load_model(str(tmp_path / "weights.txt"))
    with pytest.raises(UnknownModel, match="did you mean 'smollm2-135m'"):
        load_model("smollm2")
    with pytest.raises(ValueError, match="dtype"):
        load_model("smollm2-135m", dtype=torch.int8)


def test_unreachable_transformers_id_raises_unknown_model_listing_the_zoo():
    # A fresh interpreter with the hub switched off: the id route is tried and fails cleanly.
    code = ("from kvrelay.models.loader import load_model\n"
            "from kvrelay.core.errors import UnknownModel\n"
            "try:\n    load_model('no-such-org/no-such-model')\n"
            "except UnknownModel as e:\n    print('UNKNOWN', e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "UNKNOWN" in out.stdout, out.stderr[-2000:]
    assert "qwen2.5-coder-0.5b" in out.stdout


def test_tiny_models_are_loaded_models_rebuilt_from_arch_and_seed():
    direct = tiny_lm("qwen2", seed=3)
    loaded = load_model("tiny:qwen2:3")
    assert isinstance(direct, LoadedModel) and isinstance(loaded, LoadedModel)
    assert (direct.name, loaded.name) == ("tiny-qwen2", "tiny:qwen2:3")
    assert (loaded.source, loaded.chat, loaded.engine) == ("tiny", True, "fp32")
    assert loaded.identity.fingerprint == direct.identity.fingerprint
    assert loaded.identity.fingerprint != tiny_lm("qwen2", seed=4).identity.fingerprint
