"""Tiny random-initialised llama / qwen2 / gemma3 models, no download: ``load_model("tiny:qwen2")``.

``tiny:ARCH`` or ``tiny:ARCH:SEED`` (``models.loader``) builds the same weights from ``(arch, seed)``
in any process, so separate worker processes (``workflows.process_executor``), Ray actors and the
CLI (``kvrelay read --model tiny:llama``) can share a model without downloading one.

Each has the geometry features of its family that relay must get right: GQA (fewer KV heads
than query heads), qwen2's attention biases, gemma3's sliding-window layers with their own rope
base and a window small enough that tests cross it. A word-level tokenizer with ChatML markers
makes ``Agent`` usable on them.
"""

from __future__ import annotations

import torch

from kvrelay.models.identity import model_identity
from kvrelay.models.loaded import LoadedModel

WORDS = ("the a an of to in is was and or not yes no what which who where when how many code key value "
         "vault blue red green alpha beta gamma delta one two three four five six seven eight nine zero "
         "answer question report bug fix function file line error agent read write check plan step").split()
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "system", "user", "assistant", "\n"]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.decode  # noqa: B018 - keep attribute resolution eager
    return fast


def tiny_config(arch: str, vocab_size: int = 128):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  pad_token_id=0, eos_token_id=4, bos_token_id=4, tie_word_embeddings=False)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        common.update(num_hidden_layers=6, head_dim=16)
        return Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                                + ["full_attention"])
    raise ValueError(f"unknown tiny arch {arch!r}; expected llama, qwen2 or gemma3")


ARCHS = ("llama", "qwen2", "gemma3")


def parse_tiny(name: str) -> tuple[str, int] | None:
    """``"tiny:ARCH[:SEED]"`` -> ``(arch, seed)``; None for other names; ``UnknownModel`` if malformed."""
    from kvrelay.core.errors import UnknownModel

    if not name.startswith("tiny:"):
        return None
    arch, _, seed = name.removeprefix("tiny:").partition(":")
    if arch not in ARCHS or (seed and not seed.isdigit()):
        raise UnknownModel(f"{name!r}: a tiny model is tiny:ARCH or tiny:ARCH:SEED with ARCH one of "
                           f"{', '.join(ARCHS)} and SEED a non-negative integer")
    return arch, int(seed or 0)


def tiny_lm(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, name: str | None = None) -> LoadedModel:
    """A random ``arch`` model whose weights depend only on ``seed`` (same in every process)."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = tiny_config(arch, vocab_size=max(128, len(tok)))
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return LoadedModel(name or f"tiny-{arch}", model, tok, model_identity(model, tok), source="tiny", chat=True)
