"""Real text to fill contexts with, read at run time from what ships with Python itself.

* ``prose``: the Python Language Reference topics bundled in the stdlib (``pydoc_data.topics``,
  ~460k characters of real technical English).
* ``code``: real stdlib source files (``json/decoder.py``, ``textwrap.py``, ...).

Nothing is copied into the repository; benchmarks cut these to an exact token count.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

CODE_FILES = ("textwrap.py", "json/decoder.py", "json/encoder.py", "shlex.py", "fnmatch.py", "heapq.py",
              "bisect.py", "difflib.py", "csv.py", "configparser.py")


def prose(offset: int = 0) -> str:
    """All reference topics, starting at topic ``offset`` (wrapping around)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    k = offset % len(names)
    return "\n\n".join(topics[n].strip() for n in names[k:] + names[:k])


def code(offset: int = 0) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = CODE_FILES[offset % len(CODE_FILES):] + CODE_FILES[: offset % len(CODE_FILES)]
    return "\n\n".join(f"# file: {f}\n" + (root / f).read_text(encoding="utf-8") for f in files if (root / f).exists())
