"""Variants: BASE+ADAPTER loads with its own fingerprint; an aLoRA variant caches a base prefix exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvrelay.core.errors import UnknownModel  # noqa: E402
from kvrelay.models.loader import clear_model_cache, load_model  # noqa: E402
from kvrelay.models.tiny import tiny_lm  # noqa: E402
from kvrelay.models.variants import adapter_digest, split_name  # noqa: E402
from tests.models.tiny_model_folders import save_tiny_model, tiny_llama_config  # noqa: E402


def _kv(model, ids: list[int]):
    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids])
    with torch.inference_mode():
        model(input_ids=x, position_ids=torch.arange(len(ids))[None], cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _adapter(model, folder, seed: int, **kw):
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False, **kw)
    peft = get_peft_model(model, cfg)
    peft.save_pretrained(str(folder))
    return peft


def test_alora_caches_a_base_prefix_exactly():
    base, lm = tiny_lm("qwen2", seed=0), tiny_lm("qwen2", seed=0)
    tok = lm.tokenizer
    invoke = tok("<|im_start|> assistant", add_special_tokens=False)["input_ids"]
    torch.manual_seed(3)
    alora = get_peft_model(lm.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                                init_lora_weights=False, alora_invocation_tokens=invoke,
                                                task_type="CAUSAL_LM"))
    prefix = tok("the code of the vault is blue and the answer is five", add_special_tokens=False)["input_ids"]
    after = tok("the code is", add_special_tokens=False)["input_ids"]
    ids = prefix + invoke + after
    got, want = _kv(alora, ids), _kv(base.model, ids)
    n = len(prefix)
    for (k, v), (kb, vb) in zip(got, want, strict=True):
        assert torch.equal(k[:, :, :n], kb[:, :, :n]) and torch.equal(v[:, :, :n], vb[:, :, :n])
    assert any(not torch.allclose(k[:, :, n + len(invoke):], kb[:, :, n + len(invoke):]) for (k, _), (kb, _)
               in zip(got, want, strict=True))
    plain = get_peft_model(tiny_lm("qwen2", seed=0).model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                       target_modules=["q_proj", "k_proj", "v_proj"]))
    assert not torch.allclose(_kv(plain, prefix)[-1][0], want[-1][0][:, :, :n])  # a plain LoRA does move it


def test_base_plus_adapter_loads_merged_with_its_own_fingerprint(tmp_path):
    from transformers import AutoModelForCausalLM

    base_dir = save_tiny_model(tmp_path / "base", tiny_llama_config())
    peft = _adapter(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "ad1", seed=1)
    _adapter(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "ad2", seed=2)
    clear_model_cache()
    base = load_model(str(base_dir))
    v1 = load_model(f"{base_dir}+{tmp_path / 'ad1'}")
    v2 = load_model(f"{base_dir}+{tmp_path / 'ad2'}")
    assert len({base.identity.fingerprint, v1.identity.fingerprint, v2.identity.fingerprint}) == 3
    assert v1.identity.tokenizer_hash == base.identity.tokenizer_hash
    x = torch.tensor([[2, 3, 4, 5, 6]])
    with torch.inference_mode():
        assert torch.allclose(v1.model(input_ids=x).logits, peft(input_ids=x).logits, atol=1e-5)
        assert not torch.allclose(v1.model(input_ids=x).logits, base.model(input_ids=x).logits, atol=1e-3)
    clear_model_cache()
    assert load_model(f"{base_dir}+{tmp_path / 'ad1'}").identity.fingerprint == v1.identity.fingerprint
    assert adapter_digest(tmp_path / "ad1") != adapter_digest(tmp_path / "ad2")
    with pytest.raises(UnknownModel, match="adapter_config.json"):
        load_model(f"{base_dir}+no-such-adapter")
    clear_model_cache()


def test_split_name():
    assert split_name("qwen2.5-coder-0.5b+qa") == ("qwen2.5-coder-0.5b", "qa")
    assert split_name("qwen2.5-coder-0.5b") is None
    with pytest.raises(UnknownModel):
        split_name("qwen2.5-coder-0.5b+")


def test_every_registered_variant_is_shipped_as_its_spec_says():
    import json

    from kvrelay.models.variants import PACKAGED, VARIANTS, is_alora

    for name, spec in VARIANTS.items():
        folder = PACKAGED / name  # what a user gets without training (a local $KVRELAY_HOME copy would shadow it)
        assert (folder / "adapter_model.safetensors").is_file(), f"{name} is not shipped with kvrelay"
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["r"] == spec.rank and cfg["lora_alpha"] == spec.alpha
        assert sorted(cfg["target_modules"]) == sorted(spec.targets)
        assert is_alora(folder) == spec.alora
        trained = json.loads((folder / "loss.json").read_text())
        assert trained["variant"] == name and len(trained["loss"]) == spec.steps
        assert trained["spec"] == {**{f: getattr(spec, f) for f in spec.__dataclass_fields__},
                                   "targets": list(spec.targets)}
    assert len({adapter_digest(PACKAGED / n) for n in VARIANTS}) == len(VARIANTS)  # three distinct fingerprints
