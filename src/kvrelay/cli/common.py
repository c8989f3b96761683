"""What every command shares: the global flags' state, the recorded command line, progress notes,
``write_json``, an output folder that only exists when a run succeeded, and model loading.

One place each, so that every command behaves the same way:

* ``command_line()`` — the full argv of this invocation, ``shlex``-quoted: the ``command`` field of
  every JSON a command writes, enough to reproduce the run.
* ``note(msg)`` — a progress line on stderr; ``--quiet`` silences it (results are never silenced).
* ``write_json(path, obj)`` — atomic (temporary file + rename), parent folders created, ``command``
  added when the object has none.
* ``output_dir(path)`` — a context manager: a folder created for this run is removed again if the
  run fails before it wrote any result.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from kvrelay.core.atomic import write_json_atomic

GLOBAL_FLAGS = ("--debug", "--quiet")
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}  # what --quiet sets (child processes inherit it)
DEFAULT_ENGINE = "fp32"
ENGINE_HELP = ("kernel mode: fp32 | fp32p (fp32 weights in oneDNN's blocked layout for one-token steps) | "
               "fp16w (fp16 weights, fp32 arithmetic, for one-token steps) | bf16 | fp16 | int8 | int4 (fp32 "
               "prefill, compact weights for one-token decode steps), each also as bf16+DECODE (bf16 prefill) | "
               "auto (the fastest of the decodes that keep fp32's answers — fp32/fp32p/fp16w — and of fp32/bf16 "
               "prefill, measured once on this machine, cached under $KVRELAY_HOME). Payloads of one mode are "
               "refused by another")


@dataclass
class CLIState:
    """Set once per invocation by the root command (``kvrelay.cli.app``)."""

    argv: list[str] = field(default_factory=list)  # everything after ``kvrelay``, as typed
    debug: bool = False  # show tracebacks instead of one ``error:`` line
    quiet: bool = False  # no progress bars, no weight-loading noise, no progress notes


state = CLIState()
err_console = Console(stderr=True, highlight=False)


def begin(argv: list[str]) -> list[str]:
    """Record ``argv`` and take the global flags out of it, wherever they stand; returns the rest.

    ``--debug`` and ``--quiet`` are accepted before or after the command name.
    """
    state.argv = list(argv)
    state.debug = "--debug" in argv or os.environ.get("KVRELAY_DEBUG", "") not in ("", "0")
    state.quiet = "--quiet" in argv
    if state.quiet:
        quiet_libraries()
    rest = list(argv)
    if "--" in rest:
        cut = rest.index("--")
        return [a for a in rest[:cut] if a not in GLOBAL_FLAGS] + rest[cut:]
    return [a for a in rest if a not in GLOBAL_FLAGS]


def command_line() -> str:
    """``kvrelay <argv>`` exactly as this process was invoked (quoted for a POSIX shell)."""
    argv = state.argv if state.argv else sys.argv[1:]
    return shlex.join(["kvrelay", *argv])


def quiet_libraries() -> None:
    """No progress bars or info logs from tqdm, transformers, huggingface_hub (also in child processes)."""
    os.environ.update(QUIET_ENV)
    if "transformers" in sys.modules:  # already imported (in-process callers, tests): switch it off now
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def note(msg: str) -> None:
    """A progress line for people, on stderr; silent under ``--quiet``."""
    if not state.quiet:
        err_console.print(msg, style="dim", markup=False)


def progress_bar(**kw):
    """A ``tqdm`` bar on stderr that ``--quiet`` disables."""
    from tqdm import tqdm

    return tqdm(disable=state.quiet or kw.pop("disable", False), **kw)


def write_json(path: Path | None, obj: dict, *, console: Console | None = None) -> Path | None:
    """Write ``obj`` as indented JSON to ``path`` atomically; adds ``command`` when ``obj`` has none."""
    if path is None:
        return None
    if "command" not in obj:
        obj = {**obj, "command": command_line()}
    path = write_json_atomic(path, obj)
    (console or err_console).print(f"wrote {path}", markup=False, highlight=False)
    return path


@contextlib.contextmanager
def output_dir(path: Path, keep_if: str = "records.jsonl") -> Iterator[Path]:
    """Create ``path`` for a run; if the run raises and ``path`` did not exist before, remove it again
    unless it holds ``keep_if`` with content (partial results a re-run resumes from)."""
    path = Path(path)
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        kept = path / keep_if
        if not existed and not (kept.exists() and kept.stat().st_size > 0):
            shutil.rmtree(path, ignore_errors=True)
        raise


def load_for_cli(model: str, threads: int | None = None, engine: str = DEFAULT_ENGINE):
    """``load_model(model, engine=engine)`` after ``torch.set_num_threads(threads)`` (``None`` keeps torch's
    default).

    One place for the ``--threads`` and ``--engine`` options' meaning: every CLI that runs a model calls this.
    Threads are set first, so ``auto`` measures (and caches) under the threads the command will use. Validate
    the other arguments (``kvrelay.cli.validate``) before calling it: loading takes seconds.
    """
    from kvrelay.cli import validate as v

    v.positive(threads, "--threads")
    v.engine(engine)
    from kvrelay.models.loader import load_model

    if state.quiet:
        quiet_libraries()
    use_threads(threads)
    return load_model(model, engine=engine)


def use_threads(threads: int | None) -> int:
    """``torch.set_num_threads(threads)`` (``None`` keeps torch's default); the threads now in use.

    The ``--threads`` option's one meaning; ``load_for_cli`` calls it, and so does a command that loads
    its models another way (``doctor link``)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
