"""Property tests over hostile files (hypothesis, fixed seed, bounded): arbitrary bytes, mutated genuine files of
every codec, re-sealed header edits (oversized or negative shapes, lying offsets, huge declared sizes,
metadata of the wrong type) and Redis manifests — every reader returns or raises a typed ``KVRelayError``,
``describe`` agrees with ``decode``, memory stays bounded. ``KVRELAY_FUZZ_EXAMPLES`` scales the runs (default
small enough for ``make test``); tests/fuzz/fuzz_wire.py is the longer, coverage-guided run."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import missing_service
from tests.fuzz.targets import check_all, check_decode, check_manifest, seed_corpus
from tests.kv.test_wire_hostile import forge, split

EXAMPLES = int(os.environ.get("KVRELAY_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SEEDS = seed_corpus()
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                    | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                    max_leaves=8)
HUGE = st.sampled_from([-1, 0, 1, 2, 3, 7, 2**31, 2**40, 2**62, 2**63 - 1, 2**64, 10**30])


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(data):
    check_all(data)


@FUZZ
@given(st.sampled_from(SEEDS), st.data())
def test_byte_mutations_of_every_codec(seed, data):
    raw = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    check_all(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))


@FUZZ
@given(st.sampled_from(SEEDS), st.data())
def test_resealed_edits_of_every_codec(seed, data):
    """What a forger writes: any field of the header or the metadata replaced, the checksums recomputed."""
    header, body = split(seed)
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(sorted(header)))
        if name == "__metadata__":
            meta = header[name]
            key = data.draw(st.sampled_from(sorted(k for k in meta if k not in ("sha256", "tensor_sha256"))
                                            + ["codec_raw_nbytes", "extra"]))
            value = data.draw(JSON | st.sampled_from(["abc", "int9", "fp16", "int4-g32", "raw", "-1", "1e999"]))
            meta[key] = value if isinstance(value, str) or data.draw(st.booleans()) else json.dumps(value)
        elif data.draw(st.booleans()):
            entry = header[name]
            shape = list(entry["shape"])
            if shape:
                shape[data.draw(st.integers(0, len(shape) - 1))] = data.draw(HUGE)
            entry["shape"] = data.draw(st.sampled_from([shape, shape + [1], shape[:-1], []]))
        else:
            begin, end = header[name]["data_offsets"]
            header[name]["data_offsets"] = [data.draw(st.sampled_from([begin, data.draw(HUGE)])),
                                            data.draw(st.sampled_from([end, data.draw(HUGE)]))]
    check_all(forge(header, body))


@FUZZ
@given(st.dictionaries(st.sampled_from(["version", "chunks", "size", "full", "x"]), JSON | HUGE, max_size=5)
       | JSON)
def test_redis_manifests(manifest):
    check_manifest(json.dumps(manifest).encode())


def test_huge_declared_sizes_allocate_nothing():
    """Shapes claiming terabytes, with offsets to match, are refused from the header: a few MB at most."""
    header, body = split(SEEDS[1])
    n = 2**40 // 4
    header["layers.0.k"]["shape"] = [1, 1, n, 4]
    header["layers.0.k"]["data_offsets"] = [0, n * 4 * 2]
    tracemalloc.start()
    try:
        check_decode(forge(header, body))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_deep_json_is_refused_not_a_recursion_error():
    deep = "[" * 200_000 + "]" * 200_000
    check_all(len(deep).to_bytes(8, "little") + deep.encode())
    header, body = split(SEEDS[0])
    header["__metadata__"]["rope"] = deep
    check_all(forge(header, body))
    check_manifest(deep.encode())


def test_the_atheris_target_runs(tmp_path):
    """The coverage-guided target itself, bounded: the seed corpus of genuine files, a fixed libFuzzer seed and
    2,000 inputs (a few seconds). atheris is a dev dependency (``make setup`` installs it); without it the test
    skips on a developer's machine and fails under ``CI``."""
    import subprocess
    import sys

    try:
        import atheris  # noqa: F401
    except ImportError as e:
        missing_service("atheris", f"{e}; pip install -e '.[dev]'")
    import resource

    script = Path(__file__).with_name("fuzz_wire.py")
    # libFuzzer's -rss_limit_mb reads the peak RSS of getrusage, which on Linux a child starts from its parent's
    # RSS at the fork (kept across exec): a pytest process holding 3.7 GB of models made a fresh fuzzer "use"
    # 3.7 GB before its first input. The bound is 2 GB above what this process could pass on.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    r = subprocess.run([sys.executable, str(script), "-atheris_runs=2000", "-seed=1", "-max_len=4096",
                        f"-rss_limit_mb={2048 + inherited_mb}", "--summary", str(tmp_path / "s.json"),
                        str(tmp_path / "corpus")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["runs"] == 2000 and s["crashes"] == 0 and "check_resealed" in s["targets"], s
