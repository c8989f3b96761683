"""Coverage-guided fuzzing of kvrelay's readers with atheris (a dev dependency: ``pip install -e '.[dev]'``).

    python tests/fuzz/fuzz_wire.py -atheris_runs=100000 -max_len=8192 [CORPUS_DIR]

starts from genuine files of every codec (``targets.seed_corpus``) and mutates them under coverage
guidance; every input goes through ``targets.check_all`` (``decode`` of every codec, ``describe``,
``decode_compressed``, Redis manifests). An input that escapes as anything but a typed ``KVRelayError``
(or makes ``describe`` disagree with ``decode``) stops the run and is written as ``crash-<sha1>``.
``--summary P`` writes ``{command, runs, seconds, crashes, targets, seeds}`` as JSON when the run ends
(docs/payloads.md, "Hostile files", has the last committed result).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: ``tests.fuzz.targets``


def _portable(arg: str) -> str:
    """An argument as the summary records it: no machine-local path (the corpus folder is CORPUS_DIR, a
    summary file its name under the repository, else its base name)."""
    if arg.startswith("-") or "/" not in arg:
        return arg
    p, root = Path(arg).resolve(), Path(__file__).resolve().parents[2]
    if p.is_dir():
        return "CORPUS_DIR"
    return str(p.relative_to(root)) if p.is_relative_to(root) else p.name


def main() -> int:
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: pip install -e '.[dev]' (or '.[fuzz]')", file=sys.stderr)
        return 0
    args = sys.argv[1:]
    summary = None
    if "--summary" in args:
        i = args.index("--summary")
        summary, args = args[i + 1], args[:i] + args[i + 2:]
    import numpy  # noqa: F401 - imported uninstrumented: only kvrelay's own code is traced
    import torch  # noqa: F401

    with atheris.instrument_imports(include=["kvrelay", "tests.fuzz"]):
        from tests.fuzz import targets
    corpus = next((a for a in args if not a.startswith("-")), None)
    if corpus is None:
        corpus = tempfile.mkdtemp(prefix="kvrelay-fuzz-")
        args.append(corpus)
    Path(corpus).mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(targets.seed_corpus()):
        (Path(corpus) / f"seed-{targets.SEED_CODECS[i].replace(':', '_').replace('+', '_')}").write_bytes(seed)
    runs, crashes, start = [0], [0], time.monotonic()

    def one(data: bytes) -> None:
        runs[0] += 1
        try:
            targets.check_all(data)
        except BaseException:
            crashes[0] += 1  # atheris reports it, writes crash-<sha1> and stops
            raise

    def report() -> None:
        if summary:
            Path(summary).write_text(json.dumps({
                "command": "python tests/fuzz/fuzz_wire.py " + " ".join(_portable(a) for a in sys.argv[1:]), "runs": runs[0],
                "seconds": round(time.monotonic() - start, 1), "crashes": crashes[0],
                "targets": [t.__name__ for t in targets.TARGETS], "seeds": list(targets.SEED_CODECS),
                "load_1min": os.getloadavg()[0]}, indent=2) + "\n")

    import atexit

    atexit.register(report)
    atheris.Setup([sys.argv[0], *args], one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
