"""The README's first Python example runs as written on the default model and names the right function."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def first_python_block(md: str) -> str:
    return re.search(r"```python\n(.*?)```", md, re.S).group(1)


def printed_block(md: str) -> str:
    """The output the README says the example prints (the plain block right after it)."""
    after = md.split(first_python_block(md), 1)[1]
    return re.search(r"It prints[^\n]*\n\n```\n(.*?)```", after, re.S).group(1).strip()


@pytest.mark.integration
def test_readme_first_example_answers_correctly(tmp_path):
    md = (ROOT / "README.md").read_text()
    code = first_python_block(md).replace('"docs/demo/context.md"', repr(str(ROOT / "docs/demo/context.md")))
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)  # report.kv lands here
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    answer = out.getvalue().strip()
    assert "export_orders" in answer  # the incident report's bug is in export_orders, not write_csv
    assert answer == printed_block(md)  # and the README shows exactly what it prints
    import kvrelay as kr

    assert kr.load(tmp_path / "report.kv").num_tokens > 100
