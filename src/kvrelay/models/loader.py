"""Load a causal LM by zoo name, local folder, GGUF file, transformers id, ``BASE+ADAPTER`` variant
(docs/models.md, ``models.variants``) or ``tiny:ARCH[:SEED]`` (``models.tiny``).

Every route ends in the same ``LoadedModel`` (``models.loaded``): an eval-mode model (``sdpa`` attention, eager
where sdpa is unsupported), its tokenizer, and its ``ModelIdentity``. The fingerprint is made
cheap and stable by hashing weight *files* (the pinned GGUF sha256 for zoo models, the
safetensors files for local folders, cached by path + size + mtime) instead of tensors.

``engine`` picks the kernel mode (``models.engine``: fp32 prefill everywhere, compact weights for
one-token decode steps in bf16/fp16/int8/int4; ``auto`` = the fastest mode measured on this machine,
``models.engine_auto``). The mode is part of the identity (``identity.engine``).

Loads are cached in-process by ``(name_or_path, dtype, engine)``: tests and benchmarks ask for the same
model many times. Treat a cached ``LoadedModel`` as read-only; ``clear_model_cache()`` drops it.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from kvrelay.core.atomic import write_json_atomic
from kvrelay.core.errors import UnknownModel
from kvrelay.core.paths import home
from kvrelay.models.engine import mode, with_engine
from kvrelay.models.identity import ModelIdentity, model_identity
from kvrelay.models.loaded import LoadedModel
from kvrelay.models.tiny import parse_tiny, tiny_lm
from kvrelay.models.variants import (
    adapter_digest,
    adapter_dir,
    apply_adapter,
    split_name,
    variant_weights_digest,
)
from kvrelay.models.zoo import ZOO, entry, file_sha256, pull, read_manifest

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CACHE_SIZE = 4  # models held in-process at once (qwen2.5-coder-1.5b is ~6 GB in fp32)


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, engine: str = "fp32") -> LoadedModel:
    """Load a zoo model (pulled on first use), a local folder or ``.gguf`` file, a transformers id, or a
    random tiny model ``tiny:ARCH[:SEED]`` (ARCH llama, qwen2 or gemma3; ``models.tiny``).

    ``engine``: one of ``models.engine.ENGINES`` or ``"auto"`` (needs ``dtype=float32`` unless "fp32").
    Raises ``UnknownModel`` (listing the zoo) when nothing matches, ``ChecksumMismatch`` /
    ``FetchError`` from a zoo pull, ``ValueError`` for an unsupported dtype or engine.
    """
    if not isinstance(name_or_path, str | os.PathLike) or not str(name_or_path).strip():
        raise UnknownModel(f"expected a zoo name, folder or transformers id, got {name_or_path!r}; "
                           f"zoo models are: {', '.join(ZOO)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in DTYPES]}, got {dtype!r}")
    key = str(name_or_path)
    if key not in ZOO:
        path = Path(key).expanduser()
        if path.exists():
            key = str(path.resolve())
    if engine == "auto":
        from kvrelay.models.engine_auto import pick_engine

        engine = pick_engine(_load_cached(key, dtype, "fp32")) if dtype == torch.float32 else "fp32"
    mode(engine)
    if engine != "fp32" and dtype != torch.float32:
        raise ValueError(f"engine {engine!r} runs on fp32 weights; got dtype {dtype}")
    return _load_cached(key, dtype, engine)


def clear_model_cache() -> None:
    """Forget every in-process loaded model (the next ``load_model`` reads from disk)."""
    _load_cached.cache_clear()


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_cached(key: str, dtype: torch.dtype, engine: str) -> LoadedModel:
    if engine != "fp32":
        return with_engine(_load_cached(key, dtype, "fp32"), engine)
    return _load_base(key, dtype)


def _load_base(key: str, dtype: torch.dtype) -> LoadedModel:
    if key not in ZOO and not Path(key).exists() and (parts := split_name(key)) is not None:
        return _load_variant(*parts, dtype)
    if (tiny := parse_tiny(key)) is not None:  # a random tiny model (models.tiny), rebuilt from (arch, seed)
        return tiny_lm(*tiny, dtype=dtype, name=key)
    if key in ZOO:
        return _load_zoo(key, dtype)
    path = Path(key)
    if path.is_dir():
        return _load_folder(path, dtype, name=path.name)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_file(path, dtype)
    if path.exists() or key.startswith((".", "/", "~")):
        raise UnknownModel(f"{key!r} is neither a model folder nor a .gguf file; zoo models are: {', '.join(ZOO)}")
    close = difflib.get_close_matches(key, ZOO, n=1, cutoff=0.6)
    if close and "/" not in key:  # a typo'd zoo name; don't spend 30 s of hub retries on it
        raise UnknownModel(f"{key!r} is not a zoo model; did you mean {close[0]!r}? zoo models are: {', '.join(ZOO)}")
    return _load_hub(key, dtype)


def _load_variant(base_name: str, adapter: str, dtype: torch.dtype) -> LoadedModel:
    """``BASE+ADAPTER``: a fresh copy of the base with the adapter merged (LoRA) or attached (aLoRA).

    Its fingerprint combines the base's with the adapter's digest (``models.variants``).
    """
    folder = adapter_dir(adapter)
    base = load_model(base_name, dtype)
    if not Path(base.source).is_dir():
        raise UnknownModel(f"{base_name!r}: a variant's base must be a zoo model or a model folder, got {base.source}")
    model = apply_adapter(_from_pretrained(base.source, dtype), folder)
    weights = variant_weights_digest(base.identity.fingerprint, adapter_digest(folder))
    identity = model_identity(model, base.tokenizer, weights_sha256=weights)
    return LoadedModel(name=f"{base.name}+{adapter}", model=model, tokenizer=base.tokenizer, identity=identity,
                       source=f"{base.source}+{folder}", chat=base.chat)


def _load_zoo(name: str, dtype: torch.dtype) -> LoadedModel:
    return _load_folder(pull(name), dtype, name=name)


def _load_folder(folder: Path, dtype: torch.dtype, *, name: str) -> LoadedModel:
    """A transformers-layout folder; a kvrelay conversion is fingerprinted by its GGUF sha256."""
    from transformers import AutoTokenizer

    manifest = read_manifest(folder)
    if manifest and manifest.get("gguf_sha256"):
        weights_sha = manifest["gguf_sha256"]
        name = manifest.get("zoo_name", name)
    else:
        weights_sha = folder_weights_sha256(folder)
    model = _from_pretrained(str(folder), dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return _finish(name, model, tokenizer, weights_sha, source=str(folder))


def _load_gguf_file(path: Path, dtype: torch.dtype) -> LoadedModel:
    """A bare GGUF file: dequantized on every load (slow; zoo models use the safetensors cache)."""
    from transformers import AutoTokenizer

    model = _from_pretrained(str(path.parent), dtype, gguf_file=path.name)
    model.hf_quantizer = None  # weights are dequantized; see zoo._convert
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return _finish(path.stem, model, tokenizer, _cached_file_sha256(path), source=str(path))


def _load_hub(model_id: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoTokenizer

    try:
        model = _from_pretrained(model_id, dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError) as err:
        raise UnknownModel(
            f"{model_id!r} is not a zoo model ({', '.join(ZOO)}), not a local folder, and could not be "
            f"loaded as a transformers id: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}"
        ) from err
    # No weight files at hand without poking at the hub cache: hash the tensors once.
    return _finish(model_id, model, tokenizer, None, source=f"hub:{model_id}")


def _from_pretrained(where: str, dtype: torch.dtype, **kw):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="sdpa", **kw)
    except ValueError as err:
        if "sdpa" not in str(err).lower():
            raise
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="eager", **kw)
    return model.eval()


def _finish(name: str, model, tokenizer, weights_sha: str | None, *, source: str) -> LoadedModel:
    identity = model_identity(model, tokenizer, weights_sha256=weights_sha)
    chat = bool(getattr(tokenizer, "chat_template", None))
    if name in ZOO:
        _check_against_zoo(entry(name), identity)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, identity=identity, source=source, chat=chat)


def _check_against_zoo(e, identity: ModelIdentity) -> None:
    got = (identity.arch, identity.num_layers, identity.num_kv_heads, identity.head_dim)
    want = (e.arch, e.num_layers, e.num_kv_heads, e.head_dim)
    if got != want:
        raise ValueError(f"{e.name}: loaded (arch, layers, kv heads, head dim) = {got}, zoo entry says {want}")


# ---- weight-file hashing, cached by path + size + mtime -------------------------------------------

def folder_weights_sha256(folder: Path) -> str | None:
    """sha256 over (file name, file sha256) of every weight file in ``folder``; None if it has none."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(_cached_file_sha256(p).encode())
    return h.hexdigest()


def _hash_cache_path() -> Path:
    return home() / "file_hashes.json"


def _cached_file_sha256(path: Path) -> str:
    path = path.resolve()
    st = path.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    cache_file = _hash_cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(str(path))
    if hit and hit.get("stamp") == stamp:
        return hit["sha256"]
    digest = file_sha256(path)
    cache[str(path)] = {"stamp": stamp, "sha256": digest}
    write_json_atomic(cache_file, cache, indent=1, end="")  # concurrent writers lose an entry at worst
    return digest


# ---- facts for `kvrelay models info` and benchmark headers -------------------------------------

def model_facts(loaded: LoadedModel) -> dict:
    """JSON-ready identity facts: fingerprint, tokenizer hash, geometry, layer types, rope per layer type."""
    ident = loaded.identity
    cfg = loaded.model.config.get_text_config(decoder=True)
    rope = []
    for spec in ident.rope:
        params = _rope_parameters(cfg, spec.layer_type)
        rope.append({
            "layer_type": spec.layer_type,
            "rope_type": params.get("rope_type", "default"),
            "theta": params.get("rope_theta"),
            "rotary_dim": spec.rotary_dim,
            "attention_scaling": spec.attention_scaling,
        })
    return {
        "name": loaded.name,
        "source": loaded.source,
        "arch": ident.arch,
        "chat": loaded.chat,
        "fingerprint": ident.fingerprint,
        "tokenizer_hash": ident.tokenizer_hash,
        "num_layers": ident.num_layers,
        "num_kv_heads": ident.num_kv_heads,
        "head_dim": ident.head_dim,
        "layer_types": list(ident.layer_types),
        "layer_type_counts": {lt: ident.layer_types.count(lt) for lt in dict.fromkeys(ident.layer_types)},
        "sliding_window": ident.sliding_window,
        "rope": rope,
        "kv_bytes_per_token_fp32": 2 * ident.num_layers * ident.num_kv_heads * ident.head_dim * 4,
        "num_parameters": sum(p.numel() for p in loaded.model.parameters()),
        "vocab_size": cfg.vocab_size,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "engine": loaded.identity.engine,
    }


def _rope_parameters(cfg, layer_type: str) -> dict:
    """The rope parameters of one layer type: per-type dict (gemma3) or one shared dict (llama, qwen2)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        return params[layer_type]
    if "rope_theta" not in params and getattr(cfg, "rope_theta", None) is not None:
        params = {**params, "rope_theta": cfg.rope_theta}
    return params
