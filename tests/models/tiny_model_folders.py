"""Tiny random-initialised models saved in transformers layout, with a word-level tokenizer (no download)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

WORDS = "the a cat dog sat on mat red blue key value is what".split()


def save_tiny_tokenizer(folder: Path, chat_template: str | None = None) -> None:
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)


def save_tiny_model(folder: Path, config, seed: int = 0) -> Path:
    """A random-initialised causal LM + word-level tokenizer in transformers layout."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(WORDS) + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def tiny_gemma3_config():
    from transformers import Gemma3TextConfig

    # 6 layers: 5 sliding + 1 full, like the real 270M model's pattern; window 8 instead of 512.
    return Gemma3TextConfig(vocab_size=len(WORDS) + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                            max_position_embeddings=128)
