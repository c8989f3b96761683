"""``LoadedModel``: a causal LM ready to run, with its tokenizer and ``ModelIdentity``.

Every way of getting a model returns one: ``models.loader.load_model`` (zoo, folder, GGUF, hub id,
``BASE+ADAPTER`` variant) and ``models.tiny.tiny_lm`` (random tiny models, no download).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.models.identity import ModelIdentity


@dataclass(frozen=True, eq=False)
class LoadedModel:
    name: str  # zoo name, folder name, transformers id, or "tiny-ARCH" / "tiny:ARCH[:SEED]"
    model: torch.nn.Module  # transformers causal LM, eval mode
    tokenizer: object  # transformers tokenizer
    identity: ModelIdentity  # fingerprint, tokenizer hash, layer types, rope
    source: str  # where the weights were read from: a folder, a .gguf file, "hub:<id>", or "tiny"
    chat: bool  # tokenizer has a chat template

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def config(self):
        return self.model.config

    @property
    def engine(self) -> str:
        return self.identity.engine
