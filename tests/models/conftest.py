"""Fixtures for the model tests: tiny random folders (no download) and real zoo models (integration).

Zoo models are loaded through ``load_model``'s in-process cache, so every test in a session
shares one copy; the first ever use downloads and converts (smollm2 ~30 s, qwen 0.5b ~2 min).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model_folders import save_tiny_model, tiny_gemma3_config, tiny_llama_config


@pytest.fixture()
def tiny_llama_dir(tmp_path) -> Path:
    return save_tiny_model(tmp_path / "tiny-llama", tiny_llama_config())


@pytest.fixture()
def tiny_gemma3_dir(tmp_path) -> Path:
    return save_tiny_model(tmp_path / "tiny-gemma3", tiny_gemma3_config())


@pytest.fixture(scope="session")
def smollm2():
    from kvrelay.models.loader import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05():
    from kvrelay.models.loader import load_model

    return load_model("qwen2.5-coder-0.5b")
