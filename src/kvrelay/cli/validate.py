"""The checks every command runs on its arguments before it loads a model or creates a folder.

Each check returns the parsed value or raises ``InvalidInput`` (``kvrelay.core.errors``), whose
message is one line: what was wrong; what was expected; a close valid value when there is one.
Nothing here imports torch or transformers, so a wrong argument fails in well under a second.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.errors import InvalidInput
from kvrelay.core.records_file import DESCRIBED, is_records_file, record_folders, records_file

MIN_TASKS_FOR_MISMATCH = 2  # the mismatched arm pairs each task with another task of its set


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def suggest(value: str, known: Iterable[str]) -> str | None:
    """The closest of ``known`` to ``value`` (quoted), or None when nothing is close."""
    close = difflib.get_close_matches(str(value), [str(k) for k in known], n=1, cutoff=0.6)
    return repr(close[0]) if close else None


def _one_of(known: Sequence[str]) -> str:
    return "one of " + ", ".join(known)


def choice(value: str, flag: str, known: Sequence[str]) -> str:
    if value not in known:
        raise InvalidInput(f"{flag} {value!r} is not known", _one_of(known), suggest(value, known))
    return value


def positive(n: int | None, flag: str, minimum: int = 1, maximum: int | None = None) -> int | None:
    """``n`` (None passes: an option left at its default) must be an integer >= ``minimum`` (and <= ``maximum``)."""
    if n is not None and n < minimum:
        raise InvalidInput(f"{flag} {n} is too small", f"an integer >= {minimum}")
    if n is not None and maximum is not None and n > maximum:
        raise InvalidInput(f"{flag} {n} is too large", f"an integer from {minimum} to {maximum:,}")
    return n


def fraction(x: float | None, flag: str) -> float | None:
    """``x`` (None passes) must be a fraction in (0, 1]."""
    if x is not None and not 0 < x <= 1:
        raise InvalidInput(f"{flag} {x:g} is not a fraction of the positions", "a number in (0, 1], such as 0.25")
    return x


def seconds(x: float | None, flag: str) -> float | None:
    """A duration (None passes): a finite number of seconds > 0."""
    if x is not None and not (math.isfinite(x) and x > 0):
        raise InvalidInput(f"{flag} {x}", "a positive, finite number of seconds")
    return x


def nonempty_text(value: str | None, flag: str) -> str:
    if value is None or not value.strip():
        raise InvalidInput(f"{flag} is empty", "some text")
    return value


def csv(value: str | None, flag: str, example: str) -> tuple[str, ...]:
    """A comma-separated list with at least one item (blank items are an error, not skipped)."""
    items = tuple(x.strip() for x in (value or "").split(","))
    if not value or not value.strip() or any(not x for x in items):
        raise InvalidInput(f"{flag} {value!r} has an empty item", f"a comma-separated list such as {example}")
    return items


def int_list(value: str, flag: str, minimum: int = 1, example: str = "512,2048") -> list[int]:
    out = []
    for item in csv(value, flag, example):
        try:
            n = int(item)
        except ValueError:
            raise InvalidInput(f"{flag} {value!r}: {item!r} is not an integer",
                               f"comma-separated integers >= {minimum} such as {example}") from None
        if n < minimum:
            raise InvalidInput(f"{flag} {value!r}: {n} is too small",
                               f"comma-separated integers >= {minimum} such as {example}")
        out.append(n)
    return out


def float_list(value: str, flag: str, minimum: float = 0.0, example: str = "10,100") -> list[float]:
    out = []
    for item in csv(value, flag, example):
        try:
            x = float(item)
        except ValueError:
            raise InvalidInput(f"{flag} {value!r}: {item!r} is not a number",
                               f"comma-separated numbers > {minimum:g} such as {example}") from None
        if not x > minimum:
            raise InvalidInput(f"{flag} {value!r}: {item} is too small",
                               f"comma-separated numbers > {minimum:g} such as {example}")
        out.append(x)
    return out


def names(value: str, flag: str, known: Sequence[str], example: str) -> tuple[str, ...]:
    """A comma list whose every item is one of ``known``."""
    items = csv(value, flag, example)
    for x in items:
        if x not in known:
            raise InvalidInput(f"{flag}: {x!r} is not known", _one_of(known), suggest(x, known))
    return items


def parsed_names(value: str, flag: str, parse: Callable[[str], object], expected: str,
                 known: Sequence[str] = (), example: str = "") -> tuple[str, ...]:
    """A comma list whose every item ``parse`` accepts (``parse`` raises ValueError otherwise)."""
    items = csv(value, flag, example or expected)
    for x in items:
        try:
            parse(x)
        except ValueError as err:
            why = one_line(err).split("; ")[0].split(" available:")[0].rstrip(",;")  # the list is in `expected`
            raise InvalidInput(f"{flag}: {x!r} is not valid ({why})", expected,
                               suggest(x, known) if known else None) from None
    return items


def text_file(path: str | Path, flag: str) -> str:
    """The UTF-8 text of an existing, non-empty file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InvalidInput(f"{flag} {str(path)!r}: no such file (relative paths start at {Path.cwd()})",
                           "an existing text file" + ("; for literal text use --context-text" if flag == "--context"
                                                      else ""))
    if not p.is_file():
        raise InvalidInput(f"{flag} {str(path)!r} is not a file", "a text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{flag} {str(path)!r} is not UTF-8 text", "a UTF-8 text file") from None
    if not text.strip():
        raise InvalidInput(f"{flag} {str(path)!r} is empty", "a file with some text in it")
    return text


def existing_file(path: str | Path, flag: str, what: str = "an existing file") -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidInput(f"{flag} {str(path)!r}: no such file", what)
    if p.stat().st_size == 0:
        raise InvalidInput(f"{flag} {str(path)!r} is empty", what)
    return p


def existing_dir(path: str | Path, flag: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise InvalidInput(f"{flag} {str(path)!r}: no such folder", what)
    return p


def records_of(folder: str | Path, flag: str, what: str) -> Path:
    """The records file (``core.records_file``: ``records.jsonl`` or ``records.jsonl.gz``) of an existing
    audit folder, not empty."""
    p = Path(folder).expanduser()
    if not p.is_dir():
        raise InvalidInput(f"{flag} {str(folder)!r}: no such file or folder", what)
    return existing_file(records_file(p), flag, what)


def audit_folders(value: str | None, flag: str = "--audits") -> tuple[Path, ...]:
    """A comma list of ``kvrelay audit --out`` folders (each with config.json and records); () for None."""
    if value is None:
        return ()
    what = f"folders written by kvrelay audit --out (config.json and {DESCRIBED}), such as docs/audit/full-MODEL"
    out = []
    for item in csv(value, flag, "docs/audit/full-qwen2.5-coder-0.5b"):
        p = existing_dir(item, flag, what)
        if not (p / "config.json").is_file():
            raise InvalidInput(f"{flag}: {item!r} has no config.json", what)
        if not records_file(p).is_file():
            raise InvalidInput(f"{flag}: {item!r} has no {DESCRIBED}", what)
        out.append(p)
    return tuple(out)


def records_folders(value: str, flag: str, example: str) -> list[Path]:
    """A comma list of audit folders, folders of them, or records files -> the audit folders (in order, each
    folder's own sub-folders sorted); ``InvalidInput`` for an item that holds no records."""
    what = f"an audit folder (with {DESCRIBED}), a folder of them, or a records file"
    folders: list[Path] = []
    for a in csv(value, flag, example):
        p = Path(a).expanduser()
        if is_records_file(p):
            folders.append(p.parent)
            continue
        found = record_folders(existing_dir(a, flag, what))
        if not found:
            raise InvalidInput(f"{flag} {a!r} holds no {DESCRIBED}", "audit folders written by kvrelay audit")
        folders += found
    return folders


def writable_path(path: Path | None, flag: str) -> Path | None:
    """An output path: not an existing folder (for files) and not below an existing file."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise InvalidInput(f"{flag} {str(path)!r} is a folder", "a file path such as out/result.json")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise InvalidInput(f"{flag} {str(path)!r}: {str(parent)!r} is a file", "a path inside a folder")
    return p


def output_folder(path: Path, flag: str = "--out") -> Path:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InvalidInput(f"{flag} {str(path)!r} is a file", "a folder (new, or one a previous run wrote)")
    return p


# -- models --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelRef:
    """A model argument, resolved without loading weights."""

    name: str
    kind: str  # "zoo" | "folder" | "gguf" | "tiny" | "variant" | "hub"
    config: Path | None  # its config.json when one is on disk
    max_positions: int | None  # max_position_embeddings, when known


def _text_configs(config_path: Path | None) -> list[dict]:
    if config_path is None or not config_path.is_file():
        return []
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return []
    return [d for d in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None) if isinstance(d, dict)]


def num_layers(ref: ModelRef) -> int | None:
    """The model's layer count, read from its config without loading weights (None when unknown)."""
    if ref.kind == "tiny":
        from kvrelay.models.tiny import parse_tiny, tiny_config

        return tiny_config(parse_tiny(ref.name)[0]).num_hidden_layers
    for d in reversed(_text_configs(ref.config)):
        n = d.get("num_hidden_layers")
        if type(n) is int and n > 0:
            return n
    return None


def codec_layers(codec, layers: int | None, flag: str = "--codec") -> None:
    """A codec's ``layers:SPEC`` stages must name layers the model has (``layers`` None: not known yet)."""
    if layers is None:
        return
    for stage in getattr(codec, "stages", ()):
        wanted = getattr(stage, "layers", None)
        if wanted is not None and max(wanted) >= layers:
            raise InvalidInput(f"{flag} {codec.name!r} keeps layer {max(wanted)} but the model has {layers} layers",
                               f"layers from 0 to {layers - 1}")


def max_positions(config_path: Path | None) -> int | None:
    """``max_position_embeddings`` from a transformers ``config.json`` (or its ``text_config``)."""
    if config_path is None or not config_path.is_file():
        return None
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    for d in (cfg, cfg.get("text_config") or {}):
        n = d.get("max_position_embeddings") if isinstance(d, dict) else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def model(name: str, flag: str = "--model") -> ModelRef:
    """A zoo name, a local model folder, a ``.gguf`` file, ``tiny:ARCH[:SEED]``, ``BASE+ADAPTER``, or
    (anything else) a transformers id.

    Mirrors ``kvrelay.models.loader.load_model``'s resolution, minus the loading: a zoo-name typo
    or a missing path fails here, with the zoo listed.
    """
    from kvrelay.core.paths import home
    from kvrelay.models.zoo import ZOO

    zoo = list(ZOO)
    if not name or not name.strip():
        raise InvalidInput(f"{flag} is empty", f"a zoo name ({', '.join(zoo)}), a model folder or a transformers id")
    if name.startswith("tiny:"):  # a random tiny model (models.tiny): torch is imported only for these
        from kvrelay.models.tiny import parse_tiny, tiny_config

        arch, _ = parse_tiny(name)  # UnknownModel (one line) when malformed
        return ModelRef(name, "tiny", None, tiny_config(arch).max_position_embeddings)
    if name not in ZOO and not Path(name).expanduser().exists() and "+" in name:  # BASE+ADAPTER (docs/models.md)
        from kvrelay.models.variants import adapter_dir, split_name

        base, adapter = split_name(name)
        ref = model(base, flag)
        adapter_dir(adapter)  # UnknownModel naming where it looked
        return ModelRef(name, "variant", ref.config, ref.max_positions)
    if name in ZOO:
        cfg = home() / "models" / name / "hf" / "config.json"
        return ModelRef(name, "zoo", cfg if cfg.is_file() else None, max_positions(cfg))
    p = Path(name).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise InvalidInput(f"{flag} {name!r} is a folder without config.json",
                               "a transformers model folder (config.json, weights, tokenizer)")
        return ModelRef(name, "folder", cfg, max_positions(cfg))
    if p.is_file():
        if p.suffix != ".gguf":
            raise InvalidInput(f"{flag} {name!r} is a file but not a .gguf", "a model folder or a .gguf file")
        return ModelRef(name, "gguf", None, None)
    if name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        raise InvalidInput(f"{flag} {name!r}: no such folder or file", "a model folder, a .gguf file or a zoo name "
                           f"({', '.join(zoo)})")
    close = suggest(name, zoo)
    if close and "/" not in name:
        raise InvalidInput(f"{flag} {name!r} is not a zoo model", f"one of {', '.join(zoo)}, a model folder or a "
                           "transformers id", close)
    return ModelRef(name, "hub", None, None)


ENGINES = ("fp32", "fp32p", "fp16w", "bf16", "fp16", "int8", "int4", "bf16+fp32", "bf16+fp32p", "bf16+fp16w",
           "bf16+bf16", "bf16+fp16", "bf16+int8", "bf16+int4", "auto")  # models.engine.ENGINES + "auto"; tested equal


def engine(name: str, flag: str = "--engine") -> str:
    return choice(name, flag, ENGINES)


def fits(ref: ModelRef, tokens: int, flag: str, reserve: int = 0) -> int:
    """``tokens`` + ``reserve`` (prompt and answer room) must fit the model's position limit."""
    if ref.max_positions is not None and tokens + reserve > ref.max_positions:
        room = ref.max_positions - reserve
        raise InvalidInput(f"{flag} {tokens} does not fit {ref.name} ({ref.max_positions:,} positions, "
                           f"{reserve} kept for prompts and answers)", f"at most {room:,}")
    return tokens


def no_auto_edges(wf, workflow: str, allowed: tuple[str, str] | None = None) -> None:
    """A command that runs no policy (``audit --workflow``) refuses ``channel = "auto"`` edges here, before
    any model loads; ``bench pipeline`` builds one (``auto_policy_files``)."""
    auto = [f"{e.src}->{e.dst}" for e in wf.edges if e.channel == "auto" and (e.src, e.dst) != allowed]
    if auto:
        raise InvalidInput(f"--workflow {workflow!r} has channel \"auto\" edges ({', '.join(auto)})",
                           "kv or text edges here (kvrelay bench pipeline runs auto edges with --profile and "
                           "--value; docs/workflows.md)")


AUTO_OPTIONS = ("--profile PATH (kvrelay calibrate --json) and --value AUDIT[,AUDIT...] (audit folders or "
                "records.jsonl[.gz])")


def auto_policy_files(wf, workflow: str, profile: str | None, value: str | None,
                      slo: float | None) -> tuple[Path, list[Path]] | None:
    """What a policy for ``wf``'s ``channel = "auto"`` edges is built from (``bench.auto_policy``): the cost
    profile file and the audit folders; None when ``wf`` has no auto edge (then the options are a mistake)."""
    auto = [f"{e.src}->{e.dst}" for e in wf.edges if e.channel == "auto"]
    given = [f for f, x in (("--profile", profile), ("--value", value), ("--slo", slo)) if x is not None]
    if not auto:
        if given:
            raise InvalidInput(f"{'/'.join(given)} with --workflow {workflow!r}, which has no channel \"auto\" edge",
                               "these options only with a workflow TOML that has auto edges (docs/workflows.md)")
        return None
    missing = [f for f, x in (("--profile", profile), ("--value", value)) if x is None]
    if missing:
        raise InvalidInput(f"--workflow {workflow!r} has channel \"auto\" edges ({', '.join(auto)}) and no "
                           f"{' or '.join(missing)} to build the policy that decides them", AUTO_OPTIONS)
    if slo is not None and not slo > 0:
        raise InvalidInput(f"--slo {slo}", "a latency budget > 0 seconds")
    prof = existing_file(profile, "--profile", "a JSON written by `kvrelay calibrate --json` (or its saved profile)")
    return prof, records_folders(value, "--value", "docs/audit/full-qwen2.5-coder-0.5b")
