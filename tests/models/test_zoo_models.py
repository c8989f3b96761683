"""Real zoo models (downloaded and converted on first use): geometry, cache, identity, greedy text."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.loader import clear_model_cache, load_model, model_facts
from kvrelay.models.zoo import ZOO, converted_dir, read_manifest

pytestmark = pytest.mark.integration


def _greedy(lm, prompt: str, n: int = 10) -> str:
    tok = lm.tokenizer
    if lm.chat:
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
    else:
        enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = lm.model.generate(**enc, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_smollm2_geometry_and_converted_source(smollm2):
    ident = smollm2.identity
    assert (ident.arch, ident.num_layers, ident.num_kv_heads, ident.head_dim) == ("llama", 30, 3, 64)
    assert smollm2.chat and not smollm2.model.training
    # Loaded from the converted safetensors folder, not by dequantizing the GGUF.
    folder = converted_dir("smollm2-135m")
    assert smollm2.source == str(folder)
    assert (folder / "model.safetensors").is_file()
    assert getattr(smollm2.model.config, "quantization_config", None) is None
    assert getattr(smollm2.model, "hf_quantizer", None) is None
    assert read_manifest(folder)["gguf_sha256"] == ZOO["smollm2-135m"].sha256


def test_smollm2_reload_reads_the_cache_and_keeps_its_fingerprint(smollm2):
    clear_model_cache()
    again = load_model("smollm2-135m")
    assert again is not smollm2
    assert again.source == smollm2.source == str(converted_dir("smollm2-135m"))
    assert again.identity == smollm2.identity
    assert load_model("smollm2-135m") is again  # in-process cache


def test_smollm2_answers_a_trivial_question(smollm2):
    assert "Paris" in _greedy(smollm2, "What is the capital of France?")


def test_qwen_differs_from_smollm2_in_tokenizer_and_fingerprint(smollm2, qwen05):
    ident = qwen05.identity
    assert (ident.arch, ident.num_layers, ident.num_kv_heads, ident.head_dim) == ("qwen2", 24, 2, 64)
    assert ident.tokenizer_hash != smollm2.identity.tokenizer_hash
    assert ident.fingerprint != smollm2.identity.fingerprint


def test_gemma3_has_sliding_and_full_layers_with_two_rope_bases():
    lm = load_model("gemma3-270m")
    facts = model_facts(lm)
    assert (facts["arch"], facts["num_layers"], facts["num_kv_heads"], facts["head_dim"]) == ("gemma3_text", 18, 1, 256)
    assert facts["layer_type_counts"] == {"sliding_attention": 15, "full_attention": 3}
    assert facts["layer_types"][5] == "full_attention" and facts["sliding_window"] == 512
    assert {r["layer_type"]: r["theta"] for r in facts["rope"]} == {
        "sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    assert lm.chat is False  # base model: plain prompts
