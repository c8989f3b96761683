"""Every figure the README and docs/*.md quote beside a committed JSON file is in that file.

A *sourced block* is a paragraph, list item or table that names a committed JSON path
(``docs/.../X.json``, or a ``docs/audit/RUN/`` folder, meaning the JSON files in it), or a table whose
caption (the paragraph or command block right above it) names one, or a block preceded by a
``<!-- figures: PATH ... -->`` line. Every number in a sourced block, outside inline code, fenced code,
link targets and table header rows, must be some value of its files (or of a string in them, such as
the recorded ``command``) at the precision printed: ``8.6`` matches 8.552, ``28.2%`` matches 0.2821
(x100), ``50.4 MB`` matches 50,406,528 bytes (x1e-6), ``8.5 min`` matches 511 s (/60); a figure printed
as ``N×`` or ``N%`` may also be the ratio of two numbers of one record (a speedup, a share). The check is
deliberately plain — a number is accepted if *any* value of the file rounds to it — so a wrong figure
is caught unless it happens to equal another value of the same file.

Also checked: every JSON under docs/ records the ``command`` that wrote it (an audit folder's
``run.json`` records it for the folder) and holds no machine-local path.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SOURCE = re.compile(r"docs/[\w.+\-/]*[\w/]")
MARKER = re.compile(r"<!--\s*figures:\s*(.*?)\s*-->")
NUMBER = re.compile(r"(?<![\w./])([+−]|(?<![\w.])-(?=\d))?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?!\.?\w)"
                    r"(?:\s?(×|%|MB|GB/s|GB|KB|ms|min\b|minutes|h\b|hours))?")
SCALES = {"×": (1.0,), "%": (1.0, 100.0), "MB": (1.0, 1e-6), "GB": (1.0, 1e-9), "GB/s": (1.0, 1e-9),
          "KB": (1.0, 1e-3), "ms": (1.0, 1e3), "min": (1 / 60,), "minutes": (1 / 60,), "h": (1 / 3600,),
          "hours": (1 / 3600,), "": (1.0, 100.0)}
LOCAL = re.compile(r"(?<![\w$])/(?:tmp|root|home|work|Users|var|mnt)/")


def json_files(ref: str) -> list[Path]:
    """The committed JSON files a path in the prose stands for (none when it names no JSON)."""
    p = ROOT / ref.rstrip("/")
    if p.suffix == ".json" and p.is_file():
        return [p]
    if p.is_dir():
        return sorted(p.glob("*.json"))
    if p.is_file():  # report.html, a generated .md or a .png: the JSON beside it
        twin = p.with_suffix(".json")
        return [twin] if twin.is_file() else sorted(p.parent.glob("*.json")) if "docs/audit/" in ref else []
    return []


def _numbers_in(value, out: list[float], ratios: list[float]) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value):
            out.append(float(value))
    elif isinstance(value, str):
        out.extend(float(m.replace(",", "")) for m in re.findall(r"-?\d+(?:\.\d+)?", value))
    elif isinstance(value, dict):
        own = [float(v) for v in value.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        ratios.extend(a / b for i, a in enumerate(own) for j, b in enumerate(own) if b and i != j)
        for v in value.values():
            _numbers_in(v, out, ratios)
    else:
        for v in value:
            _numbers_in(v, out, ratios)


@cache
def values_of(path: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(values, ratios)``: the file's numbers with those of the tables generated from it that sit beside it
    (an audit folder's report.md, a benchmark's .md of the same name); and the ratios of two numbers of one
    record, which a figure printed as a speedup (``N×``) or a share (``N%``) may be."""
    out: list[float] = []
    ratios: list[float] = []
    _numbers_in(json.loads(path.read_text(encoding="utf-8")), out, ratios)
    for generated in (path.with_suffix(".md"), path.parent / "report.md"):
        if generated.is_file():
            out.extend(value for _, value, _, _ in figures(generated.read_text(encoding="utf-8")))
    return tuple(sorted(set(out))), tuple(sorted(set(ratios)))


def matches(printed: float, decimals: int, unit: str, values, ratios=()) -> bool:
    """Whether some value, in the unit printed, rounds to the printed figure at its printed precision."""
    tol = 0.5 * 10.0 ** -decimals + 1e-9
    candidates = (*values, *ratios) if unit in ("×", "%") else values  # a speedup or a share: a ratio
    return any(abs(v * s - printed) <= tol for v in candidates for s in SCALES[unit])


def _strip(text: str) -> str:
    """Text with what is not a quoted figure removed: inline code, link targets, comments, arXiv ids, the
    "1-minute" of a load average's name."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<!--.*?-->", " ", text)
    text = re.sub(r"arXiv \d+\.\d+", " ", text)
    text = re.sub(r"\b1-min(?:ute)?\b", "one-minute", text)  # the name of a load figure, not a figure
    return text.replace("**", "").replace("\\|", "|")


def figures(text: str) -> list[tuple[str, float, int, str]]:
    """``(as printed, value, decimals, unit)`` for every number in a stretch of prose."""
    out = []
    for m in NUMBER.finditer(_strip(text)):
        sign, whole, frac, unit = m.group(1) or "", m.group(2), m.group(3), m.group(4) or ""
        value = float(whole.replace(",", "") + (f".{frac}" if frac else ""))
        out.append((m.group(0), -value if sign in ("−", "-") else value, len(frac or ""), unit))
    return out


def blocks(md: str) -> list[tuple[int, str, str]]:
    """``(first line, kind, text)`` per block: "code" (fenced or indented), "table", "prose", "marker"."""
    out, buf, kind, start, fence = [], [], None, 0, False

    def flush():
        nonlocal buf, kind
        if buf:
            out.append((start, kind, "\n".join(buf)))
        buf, kind = [], None

    for i, line in enumerate(md.splitlines(), 1):
        if line.startswith("```"):
            if fence:
                buf.append(line)
                flush()
                fence = False
                continue
            flush()
            fence, kind, start = True, "code", i
            buf.append(line)
            continue
        if fence:
            buf.append(line)
            continue
        if not line.strip():
            flush()
            continue
        this = ("marker" if MARKER.search(line) and not buf else "table" if line.lstrip().startswith("|")
                else "code" if line.startswith("    ") and kind in (None, "code") else kind or "prose")
        if kind is not None and this != kind and not (kind == "prose" and this == "code"):
            flush()
        if kind is None:
            kind, start = this, i
        buf.append(line)
        if this == "marker":
            flush()
    flush()
    return out


HEADER_UNIT = re.compile(r"\b(MB|GB|KB|ms|min)\b")


def with_header_units(table: str) -> str:
    """A table's body rows, each bare number carrying the unit its column's header names (``payload MB``)."""
    rows = table.splitlines()
    units = [(HEADER_UNIT.search(c) or [""])[0] for c in rows[0].split("|")]
    out = []
    for row in rows[2:]:
        cells = row.split("|")
        out.append("|".join(c.rstrip() + f" {units[i]} " if i < len(units) and units[i] and re.fullmatch(r"\s*[\d.,]+\s*", c)
                            else c for i, c in enumerate(cells)))
    return "\n".join(out)


def sourced_blocks() -> list[tuple[str, str, list[Path]]]:
    """``(where, text to check, JSON files)`` for every sourced block of every page."""
    out = []
    for page in PAGES:
        marker: list[Path] = []
        previous = ""
        for line, kind, text in blocks(page.read_text(encoding="utf-8")):
            where = f"{page.relative_to(ROOT)}:{line}"
            if kind == "marker":
                marker = [f for ref in MARKER.search(text).group(1).split() for f in json_files(ref)]
                assert marker, f"{where}: the marker names no committed JSON"
                continue
            if not re.sub(r"<!--.*?-->", "", text).strip():
                continue  # another tool's marker (<!-- mutation-table -->): transparent
            own = [f for ref in SOURCE.findall(text) for f in json_files(ref)]
            if kind == "table":  # a row that names its own files is checked against them, the others against
                caption = marker + [f for ref in SOURCE.findall(previous) for f in json_files(ref)]  # the caption's
                for n, (raw, body) in enumerate(zip(text.splitlines()[2:], with_header_units(text).splitlines(), strict=True)):
                    files = [f for ref in SOURCE.findall(raw) for f in json_files(ref)] or caption
                    if files:
                        out.append((f"{where}+{n + 2}", body, files))
            elif kind == "prose" and (marker or own):
                out.append((where, text, marker + own))
            marker, previous = [], text
    return out


SOURCED = sourced_blocks()


def test_the_pages_quote_sourced_figures():
    assert len(SOURCED) >= 60
    assert sum(len(figures(text)) for _, text, _ in SOURCED) >= 400


@pytest.mark.parametrize(("where", "text", "files"), SOURCED, ids=[w for w, _, _ in SOURCED])
def test_every_quoted_figure_is_in_its_json(where, text, files):
    values = [v for f in files for v in values_of(f)[0]]
    ratios = [r for f in files for r in values_of(f)[1]]
    wrong = [printed for printed, value, decimals, unit in figures(text)
             if not matches(value, decimals, unit, values, ratios)]
    assert not wrong, f"{where}: {wrong} not in {[str(f.relative_to(ROOT)) for f in files]}"


def test_a_planted_wrong_figure_is_caught():
    """The check fails on a figure its file does not hold, and passes on the printed rounding."""
    relay = ROOT / "docs/bench/relay_qwen2.5-coder-0.5b.json"
    values, ratios = values_of(relay)
    row = json.loads(relay.read_text())["rows"][0]
    assert matches(round(row["ttft_speedup"], 1), 1, "×", values, ratios)
    assert not matches(round(row["ttft_speedup"], 1) + 0.2, 1, "×", values, ratios)
    assert matches(round(row["payload_bytes"] / 1e6, 1), 1, "MB", values)
    assert not matches(round(row["payload_bytes"] / 1e6, 1), 1, "min", values)
    assert [f[:3] for f in figures("**8.6×**, 0.97 of ideal, −4.2 [−8.3, +2.1], 2,896,730 bytes, `--n 23` layers 0-3")] \
        == [("8.6×", 8.6, 1), ("0.97", 0.97, 2), ("−4.2", -4.2, 1), ("−8.3", -8.3, 1), ("+2.1", 2.1, 1),
            ("2,896,730", 2896730.0, 0), ("0", 0.0, 0), ("3", 3.0, 0)]


COMMITTED = sorted(p for p in (ROOT / "docs").rglob("*.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.relative_to(ROOT)) for p in COMMITTED])
def test_every_committed_json_records_its_command_and_no_local_path(path):
    text = path.read_text(encoding="utf-8")
    assert not LOCAL.search(text), f"{path.relative_to(ROOT)} holds a machine-local path: {LOCAL.search(text)}"
    data = json.loads(text)
    if "docs/audit/" in str(path) and path.name != "run.json" and (path.parent / "run.json").is_file():
        data = json.loads((path.parent / "run.json").read_text(encoding="utf-8"))  # the folder's record
    assert isinstance(data, dict) and (data.get("command") or data.get("commands")), \
        f"{path.relative_to(ROOT)} records no command"
