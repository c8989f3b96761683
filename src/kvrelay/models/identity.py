"""Who a model is: fingerprint, tokenizer hash, cache geometry and rope parameters.

A payload is usable by a receiver only when the receiver can prove it was produced by the
same weights under the same tokenizer (homogeneous relay). ``ModelIdentity`` holds exactly the
facts needed for that proof and for position-exact transforms (RoPE re-rotation per layer type).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding of one layer type: the angle per pair of dims is ``position * inv_freq``."""

    layer_type: str
    inv_freq: tuple[float, ...]  # (rotary_dim / 2,)
    attention_scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def inv_freq_tensor(self) -> torch.Tensor:
        return torch.tensor(self.inv_freq, dtype=torch.float64)


def rope_for(rope: tuple[RopeSpec, ...], layer_type: str) -> RopeSpec:
    """The spec of ``layer_type`` among ``rope`` (a model's or a payload's, one per distinct layer type)."""
    for spec in rope:
        if spec.layer_type == layer_type:
            return spec
    raise KeyError(f"no rope parameters for layer type {layer_type!r}")


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    fingerprint: str  # sha256 over canonical config + weights
    tokenizer_hash: str  # sha256 over vocabulary + special tokens + chat template
    arch: str  # config.model_type
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # per layer: "full_attention" | "sliding_attention"
    sliding_window: int | None
    rope: tuple[RopeSpec, ...]  # one per distinct layer type
    engine: str = "fp32"  # kernel mode (``models.engine``): caches of one mode are refused by another
    vocab_size: int | None = None  # rows of the input embedding: token ids a receiver can read (None: unknown)

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected num_layers={self.num_layers}")
        missing = set(self.layer_types) - {r.layer_type for r in self.rope}
        if missing:
            raise ValueError(f"no rope parameters for layer types {sorted(missing)}")

    def rope_for(self, layer_type: str) -> RopeSpec:
        return rope_for(self.rope, layer_type)


def _canonical_config(config) -> str:
    d = config.to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "quantization_config",
              "architectures", "_attn_implementation_autoset", "use_cache", "attn_implementation"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer, in name order (used when no weight file is at hand)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module, weights_sha256: str | None = None) -> str:
    h = hashlib.sha256()
    h.update(_canonical_config(model.config).encode())
    h.update((weights_sha256 or weights_digest(model)).encode())
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 over the vocabulary, the special tokens and the chat template; '' for no tokenizer."""
    if tokenizer is None:
        return ""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def _rope_specs(model, layer_types: tuple[str, ...]) -> tuple[RopeSpec, ...]:
    rotary = model.get_decoder().rotary_emb
    specs = []
    for lt in dict.fromkeys(layer_types):
        inv = getattr(rotary, f"{lt}_inv_freq", None)
        if inv is None:
            inv = rotary.inv_freq
        scale = getattr(rotary, f"{lt}_attention_scaling", getattr(rotary, "attention_scaling", 1.0))
        specs.append(RopeSpec(lt, tuple(float(x) for x in inv.detach().double().tolist()), float(scale)))
    return tuple(specs)


def model_identity(model, tokenizer=None, weights_sha256: str | None = None) -> ModelIdentity:
    """Read a transformers causal LM's identity. ``weights_sha256`` avoids re-hashing known weight files."""
    cfg = model.config.get_text_config(decoder=True)
    n = cfg.num_hidden_layers
    layer_types = tuple(getattr(cfg, "layer_types", None) or ["full_attention"] * n)[:n]
    if any(lt not in ("full_attention", "sliding_attention") for lt in layer_types):
        raise ValueError(f"unsupported layer types {sorted(set(layer_types))}: kvrelay handles full and sliding attention")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    window = getattr(cfg, "sliding_window", None) if "sliding_attention" in layer_types else None
    return ModelIdentity(
        fingerprint=model_fingerprint(model, weights_sha256),
        tokenizer_hash=tokenizer_hash(tokenizer),
        arch=cfg.model_type,
        num_layers=n,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        layer_types=layer_types,
        sliding_window=window,
        rope=_rope_specs(model, layer_types),
        vocab_size=_vocab_size(model, cfg),
    )


def _vocab_size(model, cfg) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None) or getattr(cfg, "vocab_size", None)
    return int(n) if n else None
