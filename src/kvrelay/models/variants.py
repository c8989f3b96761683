"""Fine-tuned variants of one base model: ``BASE+ADAPTER`` names, LoRA adapters, their fingerprints.

A variant is a base model plus a ``peft`` adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``). ``load_variant("qwen2.5-coder-0.5b+qa")`` loads the base and

* a plain LoRA adapter: merges it into the weights (``merge_and_unload``), so the model runs at
  the base model's speed and every kvrelay path (prefill, relay, repair) sees an ordinary model;
* an activated LoRA (aLoRA, arXiv 2504.12397): keeps it as a ``PeftModel``, because the adapter
  only acts on tokens after its invocation sequence, so a prefix without that sequence is cached
  exactly as the base model caches it.

Each variant has its own fingerprint: the base's weight digest combined with the adapter's file
digest, so a payload made by one variant never passes as another's (``kv.compat``). Adapter
folders are found, in order, at a literal path, under ``$KVRELAY_HOME/variants/NAME``, then among
the adapters shipped with kvrelay (``kvrelay/models/adapters/NAME``). ``peft`` is an optional
dependency (``pip install kvrelay[variants]``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.errors import UnknownModel
from kvrelay.core.paths import home
from kvrelay.models.zoo import file_sha256

SEP = "+"
PACKAGED = Path(__file__).with_name("adapters")


@dataclass(frozen=True, slots=True)
class VariantSpec:
    """How one adapter is trained: its role data, and the dials that set how far it drifts from the base."""

    name: str
    base: str
    role: str  # training data: "qa" (SQuAD passages) | "summarize" (stdlib functions -> docstring)
    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    steps: int = 20
    lr: float = 1e-3
    max_tokens: int = 96
    seed: int = 0
    alora: bool = False  # activated LoRA: acts only after the assistant turn starts

    def __post_init__(self):
        if self.role not in ("qa", "summarize"):
            raise ValueError(f"role must be 'qa' or 'summarize', got {self.role!r}")
        if self.rank < 1 or self.steps < 1 or self.max_tokens < 16:
            raise ValueError("rank and steps must be >= 1 and max_tokens >= 16")


# The registry: two roles with different data and divergence, and the aLoRA control.
VARIANTS: dict[str, VariantSpec] = {s.name: s for s in (
    VariantSpec("qa", "qwen2.5-coder-0.5b", "qa", rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                steps=20, lr=1e-3, max_tokens=96),
    VariantSpec("summarizer", "qwen2.5-coder-0.5b", "summarize", rank=8,
                targets=("q_proj", "v_proj", "up_proj", "down_proj"), steps=20, lr=1e-3, max_tokens=96),
    VariantSpec("qa-alora", "qwen2.5-coder-0.5b", "qa", rank=8, targets=("q_proj", "k_proj", "v_proj"),
                steps=10, lr=1e-3, max_tokens=96, alora=True),
)}


def split_name(name: str) -> tuple[str, str] | None:
    """``("BASE", "ADAPTER")`` for ``"BASE+ADAPTER"``, else None."""
    if SEP not in name:
        return None
    base, _, adapter = name.rpartition(SEP)
    if not base or not adapter:
        raise UnknownModel(f"{name!r}: expected BASE+ADAPTER with both parts non-empty")
    return base, adapter


def adapter_dir(adapter: str) -> Path:
    """The folder of adapter ``adapter`` (a path, a trained one under $KVRELAY_HOME, or a shipped one)."""
    for cand in (Path(adapter).expanduser(), home() / "variants" / adapter, PACKAGED / adapter):
        if (cand / "adapter_config.json").is_file() and (cand / "adapter_model.safetensors").is_file():
            return cand
    known = sorted(p.name for p in PACKAGED.iterdir() if p.is_dir()) if PACKAGED.is_dir() else []
    raise UnknownModel(f"no adapter {adapter!r}: expected a folder with adapter_config.json and "
                       f"adapter_model.safetensors (a path, {home() / 'variants' / adapter}, or one of {known}); "
                       f"train one with `python -m kvrelay.bench.train_variants NAME`")


def adapter_digest(folder: Path) -> str:
    """sha256 over the adapter's config (canonical JSON) and its weight file."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.pop("base_model_name_or_path", None)
    cfg.pop("revision", None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    h.update(file_sha256(folder / "adapter_model.safetensors").encode())
    return h.hexdigest()


def variant_weights_digest(base_fingerprint: str, adapter_sha: str) -> str:
    """What a variant's fingerprint hashes in place of weight files: base fingerprint + adapter digest."""
    return hashlib.sha256(f"{base_fingerprint}{SEP}{adapter_sha}".encode()).hexdigest()


def is_alora(folder: Path) -> bool:
    return bool(json.loads((folder / "adapter_config.json").read_text()).get("alora_invocation_tokens"))


def apply_adapter(model, folder: Path):
    """``model`` with the adapter in ``folder``: merged for LoRA, a ``PeftModel`` for aLoRA."""
    try:
        from peft import PeftModel
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise UnknownModel("loading an adapter needs peft: pip install 'kvrelay[variants]'") from err
    peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=False)
    if is_alora(folder):
        return peft_model.eval()
    return peft_model.merge_and_unload().eval()
