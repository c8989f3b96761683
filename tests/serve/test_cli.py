"""``kvrelay serve`` as a user starts it: a real process, a request, then SIGTERM and a clean exit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import missing_service

openai = pytest.importorskip("openai")

KVRELAY = str(Path(sys.executable).with_name("kvrelay"))


def test_serve_answers_then_shuts_down_gracefully_on_sigterm():
    if shutil.which("redis-server") is None:  # serve keeps its handles in a private redis-server
        missing_service("redis-server", "not on PATH (apt-get install redis-server)")
    env = os.environ | {"KVRELAY_TEST_THREADS": "1"}
    proc = subprocess.Popen([KVRELAY, "--quiet", "serve", "--models", "tiny:qwen2", "--port", "0", "--threads", "1",
                             "--max-tokens", "8"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None and time.monotonic() < deadline:  # bounded wait for the "ready" line
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            m = re.search(r"(http://\S+)/v1", line)
            url = m.group(1) if m else None
        assert url, f"no URL printed (exit {proc.poll()})"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="tiny:qwen2", messages=[{"role": "user", "content": "what is the key"}])
        assert r.model_extra["kvrelay"]["handle"].startswith("kvr1.")  # stored in the private redis-server
        assert r.usage.completion_tokens <= 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args,expected", [
    (["--models", "tiny:qwen2,"], "--models"),
    (["--models", "tiny:qwen2,tiny:qwen2"], "twice"),
    (["--models", "tiny:qwen2", "--port", "70000"], "--port"),
    (["--models", "tiny:qwen2", "--store", "ftp://x"], "store"),
    (["--models", "tiny:nope"], "tiny"),
    (["--models", "tiny:qwen2", "--audits", "no/such/audit"], "--audits"),
    (["--models", "tiny:qwen2", "--audits", "docs"], "no config.json"),
])
def test_serve_mistakes_are_one_line_before_loading(args, expected):
    r = subprocess.run([KVRELAY, "serve", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
