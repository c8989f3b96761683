"""A fitted adapter on disk: ``adapter.safetensors`` (fp16 tensors) + ``adapter.json`` (what it is).

The JSON records everything needed to tell whether the adapter may be used and how it was made::

    format          "kvrelay-adapter/1"
    method          "ridge" | ...
    receiver        {"name", "fingerprint", "tokenizer_hash", "num_layers", "num_kv_heads", "head_dim"}
    sharer          the same for the sharer
    layer_map       [sharer layer read by receiver layer t, for each t]
    alignment       how tokens, heads, head dims and RoPE were aligned (method-specific)
    training        {"datasets": [...], "n_texts", "max_tokens", "seed", "steps", ...}: what it was fitted on
    metrics         fit diagnostics (held-out R² per layer, ...)
    hyper           method hyperparameters

``check_pair`` refuses (``AdapterMismatch``) a receiver or sharer whose fingerprint differs from
the one recorded: an adapter is a function of two exact sets of weights.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvrelay.core.errors import AdapterMismatch, ArtefactError
from kvrelay.models.identity import ModelIdentity

FORMAT = "kvrelay-adapter/1"
TENSORS, CONFIG = "adapter.safetensors", "adapter.json"


@dataclass(frozen=True, slots=True)
class ModelRef:
    name: str
    fingerprint: str
    tokenizer_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, name: str, ident: ModelIdentity) -> ModelRef:
        return cls(name, ident.fingerprint, ident.tokenizer_hash, ident.num_layers, ident.num_kv_heads, ident.head_dim)


@dataclass(frozen=True, slots=True)
class ArtefactConfig:
    method: str
    receiver: ModelRef
    sharer: ModelRef
    layer_map: tuple[int, ...]
    alignment: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    hyper: dict = field(default_factory=dict)
    format: str = FORMAT

    def __post_init__(self):
        if len(self.layer_map) != self.receiver.num_layers:
            raise ValueError(f"layer_map has {len(self.layer_map)} entries for {self.receiver.num_layers} receiver layers")
        if any(not 0 <= s < self.sharer.num_layers for s in self.layer_map):
            raise ValueError(f"layer_map {self.layer_map} reads layers outside the sharer's {self.sharer.num_layers}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ArtefactConfig:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ArtefactError(f"adapter format {d.get('format')!r} is not {FORMAT!r}")
        try:
            return cls(**{**d, "receiver": ModelRef(**d["receiver"]), "sharer": ModelRef(**d["sharer"]),
                          "layer_map": tuple(d["layer_map"])})
        except (KeyError, TypeError) as e:
            raise ArtefactError(f"adapter config is incomplete or has unknown fields: {e}") from e

    def check_pair(self, receiver: ModelIdentity | None = None, sharer_fingerprint: str | None = None,
                   where: str = "") -> None:
        """``AdapterMismatch`` unless the given receiver / sharer are the models this adapter was fitted for."""
        if receiver is not None and receiver.fingerprint != self.receiver.fingerprint:
            raise AdapterMismatch("receiver", self.receiver.fingerprint, receiver.fingerprint, where)
        if sharer_fingerprint is not None and sharer_fingerprint != self.sharer.fingerprint:
            raise AdapterMismatch("sharer", self.sharer.fingerprint, sharer_fingerprint, where)


def save(folder: str | Path, config: ArtefactConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` as fp16 safetensors and ``config`` as JSON into ``folder`` (created)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    half = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    save_file(half, str(folder / TENSORS), metadata={"format": FORMAT, "method": config.method})
    (folder / CONFIG).write_text(config.to_json() + "\n")
    return folder


def load(folder: str | Path) -> tuple[ArtefactConfig, dict[str, torch.Tensor]]:
    """The config and fp32 tensors of an artefact folder, or ``ArtefactError`` naming what is missing."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in (TENSORS, CONFIG):
        if not (folder / name).is_file():
            raise ArtefactError(f"{folder} has no {name}: not an adapter artefact (fit one with `kvrelay fuse fit`)")
    config = ArtefactConfig.from_json((folder / CONFIG).read_text())
    tensors = {k: v.to(torch.float32) for k, v in load_file(str(folder / TENSORS)).items()}
    return config, tensors


def digest(config: ArtefactConfig, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the config and the fp16 tensor bytes (the adapter's fingerprint)."""
    h = hashlib.sha256(config.to_json().encode())
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().to(torch.float16).contiguous().numpy().tobytes())
    return h.hexdigest()


def root() -> Path:
    """Where kvrelay keeps the committed artefacts: ``artefacts/fuse``."""
    return Path(__file__).resolve().parents[3] / "artefacts" / "fuse"


def default_dir(receiver: str, sharer: str, method: str) -> Path:
    """The committed artefact of a pair: ``artefacts/fuse/<receiver>__<sharer>__<method>``."""
    return root() / f"{receiver}__{sharer}__{method}"
