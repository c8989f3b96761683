"""Audit report: Markdown + self-contained HTML, rebuilt from a run directory, rendered in headless Chromium."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from kvrelay.audit import plots
from kvrelay.audit.paired import CONTRASTS
from kvrelay.audit.report import read_records, rebuild, write_report
from kvrelay.audit.stats import summarize

ARMS = ("none", "text_message", "text_full", "kv", "kv_mismatched", "kv_zeroed", "kv_random", "kv_noise:0.1",
        "kv_noise:1.0", "kv_codec:int8")  # fmt: skip
#: P(success) per regime and arm: matched content pays in the private regime, nothing does in the shared one.
SUCCESS = {
    "private": {"none": 0.08, "text_message": 0.55, "text_full": 0.85, "kv": 0.8, "kv_mismatched": 0.1,
                "kv_zeroed": 0.05, "kv_random": 0.04, "kv_noise:0.1": 0.78, "kv_noise:1.0": 0.25,
                "kv_codec:int8": 0.79},
    "shared": {arm: 0.45 for arm in ARMS} | {"none": 0.4, "text_message": 0.47},
}  # fmt: skip
CELLS = (("private", "generated"), ("private", "squad"), ("shared", "arc_challenge"), ("shared", "gsm8k"))
META = {"model": "qwen2.5-coder-0.5b", "preset": "quick", "tasks": [t for _, t in CELLS], "arms": list(ARMS),
        "seeds": [0, 1], "elapsed_s": 734.2, "versions": {"kvrelay": "0.1.0", "torch": "2.13.0"},
        "command": ["kvrelay", "audit", "--preset", "quick", "--out", "runs/quick"]}  # fmt: skip
SIMILARITY = [{"regime": regime, "task": "ALL", "comparison": comparison, "metric": metric, "mean": mean,
               "ci_low": mean - 0.05, "ci_high": mean + 0.04, "n": 16}
              for regime in ("private", "shared")
              for comparison, mean in (("kv_vs_text_full", 0.9), ("kv_vs_mismatched", 0.6))
              for metric in ("attention_mass_on_relayed", "hidden_cosine")]  # fmt: skip
N_BOOT = 200


def make_records(cells=CELLS, arms=ARMS, n_tasks: int = 16, seeds=(0, 1), covariates: bool = True,
                 seed: int = 0) -> list[dict]:  # fmt: skip
    """Trials like a runner writes them. A shared uniform per (task, seed) couples the arms, as real pairs are;
    generated tasks carry dial covariates; long documents hurt kv; text_full pays prefill for the document."""
    rng = np.random.default_rng(seed)
    records = []
    for regime, task in cells:
        for i in range(n_tasks):
            covs = {"doc_tokens": int(rng.integers(150, 3000))}
            if task == "generated":
                covs |= {"n_facts": int(rng.integers(2, 9)), "hops": int(rng.integers(1, 4))}
            for s in seeds:
                u = rng.random()
                for arm in arms:
                    p = SUCCESS[regime][arm] - (0.1 if arm == "kv" and covs["doc_tokens"] > 2000 else 0.0)
                    prefill = 40 + (covs["doc_tokens"] if arm == "text_full" else 0)
                    kv_bytes = 12_288 * covs["doc_tokens"] // (2 if arm == "kv_codec:int8" else 1)
                    records.append({
                        "task_id": f"{task}-{i}", "task": task, "regime": regime, "arm": arm, "seed": s,
                        "score": float(u < p), "answer": "x",
                        "latency_s": 0.2 + prefill * 2e-4 + (0.05 if arm.startswith("kv") else 0.0)
                        + (0.4 if arm == "text_message" else 0.0),
                        "relay_bytes": kv_bytes if arm.startswith("kv") else 0, "prefill_tokens": prefill,
                        "covariates": covs if covariates else {},
                    })  # fmt: skip
    return records


def write_run(out: Path, records: list[dict], meta: dict | None = META, summary: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    if meta is not None:
        (out / "run.json").write_text(json.dumps(meta))
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A rebuilt run directory; an earlier summary.json holds the similarity rows a rebuild must keep."""
    out = write_run(tmp_path_factory.mktemp("audit"), make_records(), summary={"similarity": SIMILARITY})
    written = rebuild(out, n_boot=N_BOOT)
    summary = json.loads((out / "summary.json").read_text())
    return out, written, summary


class _Resources(HTMLParser):
    """Every src/href attribute and every tag name of a page."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [(tag, k, v or "") for k, v in attrs if k in ("src", "href", "srcset", "action", "data")]


# ---------------------------------------------------------------- content


def test_rebuild_writes_summary_and_report(run):
    out, written, summary = run
    assert {"summary.json", "report.md", "report.html"} <= set(written)
    figures = {"forest", "dose_response", "cate", "cost_benefit", "similarity"}
    assert {f"figures/{f}.png" for f in figures} <= set(written)
    for path in written.values():
        assert path.is_file() and path.stat().st_size > 0
    assert summary["model"] == "qwen2.5-coder-0.5b"
    assert summary["similarity"] == SIMILARITY  # not recomputable from records: carried over
    assert summary["settings"]["n_boot"] == N_BOOT
    assert summary["effects"] and summary["verdict"].startswith("private regime:")


def test_rebuild_again_reproduces_the_numbers(tmp_path):
    """Statistics settings come from the summary a rebuild replaces, so `kvrelay audit report` is stable."""
    records = make_records(cells=(("private", "squad"),), arms=("kv", "kv_mismatched"), n_tasks=8, covariates=False)
    first = json.loads(rebuild(write_run(tmp_path, records), n_boot=150, margin=5.0)["summary.json"].read_text())
    again = json.loads(rebuild(tmp_path)["summary.json"].read_text())
    assert again["settings"]["n_boot"] == 150 and again["settings"]["margin"] == 5.0
    assert again["effects"] == first["effects"] and again["verdict"] == first["verdict"]
    assert "similarity" not in again
    (tmp_path / "similarity.json").write_text(json.dumps(SIMILARITY[:2]))  # as the runner writes it
    written = rebuild(tmp_path)
    assert json.loads(written["summary.json"].read_text())["similarity"] == SIMILARITY[:2]
    assert "figures/similarity.png" in written and 'id="similarity"' in written["report.html"].read_text()


def test_every_effect_row_and_the_verdict_are_in_both_reports(run):
    out, _, summary = run
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert len(summary["effects"]) == 2 * 3 * 5 * 4  # regimes × (2 task sets + pooled) × contrasts × outcomes
    for e in summary["effects"]:
        a, b = CONTRASTS[e["contrast"]]
        task = "pooled (ALL)" if e["task"] == "ALL" else e["task"]
        assert f"| {e['regime']} | {task} | {e['contrast']} | {a} − {b} | {e['outcome']} |" in md, e
        assert f'data-key="{e["regime"]}/{e["task"]}/{e["contrast"]}/{e["outcome"]}"' in page, e
    for e in summary["equivalence"]:
        assert f'data-key="{e["regime"]}/{e["task"]}/{e["contrast"]}"' in page
    # the verdict is the last section of both, every line of it present
    headings = re.findall(r"^## (.+)$", md, flags=re.M)
    assert headings[-1] == "Verdict" and headings[0] == "Run"
    assert {"Effects on success", "Equivalence (TOST)", "Dose-response", "Conditional effects (CATE)",
            "Cost-benefit", "Similarity analysis"} <= set(headings)  # fmt: skip
    assert page.rindex("<section ") == page.index('<section id="verdict">')
    for line in summary["verdict"].splitlines():
        assert line.strip() in md.split("## Verdict", 1)[1]
        assert _escape(line.strip()) in page.split('<section id="verdict">', 1)[1]
    assert "qwen2.5-coder-0.5b" in md and "kvrelay audit --preset quick --out runs/quick" in md


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def test_html_is_self_contained(run):
    out, written, _ = run
    page = (out / "report.html").read_text()
    assert "http://" not in page and "https://" not in page
    parser = _Resources()
    parser.feed(page)
    assert "link" not in parser.tags and "iframe" not in parser.tags
    figures = [k for k in written if k.startswith("figures/")]
    images = [v for tag, k, v in parser.refs if tag == "img"]
    assert len(images) == len(figures) == 5
    for src in images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(v.startswith("#") for tag, k, v in parser.refs if k == "href")  # in-page anchors only
    assert "default-src 'none'" in page  # the CSP forbids anything but inline content
    assert "img-src data:" in page


def test_missing_sections_become_notes_not_crashes(tmp_path):
    # one regime, one task set, no baselines, no dose arms, no covariates, no similarity
    records = make_records(cells=(("private", "squad"),), arms=("kv", "kv_mismatched", "kv_zeroed"), n_tasks=6,
                           seeds=(0,), covariates=False)  # fmt: skip
    summary = {"model": "m", **summarize(records, n_boot=N_BOOT)}
    written = write_report(tmp_path, records, summary, {})
    md, page = written["report.md"].read_text(), written["report.html"].read_text()
    assert "No dose arms" in md and "no dose-response" in md
    assert "No covariates were recorded" in md
    assert "Neither none nor text_full was run" in md
    assert "Similarity" not in md and 'id="similarity"' not in page
    assert list(k for k in written if k.startswith("figures/")) == ["figures/forest.png"]
    assert re.findall(r"^## (.+)$", md, flags=re.M)[-1] == "Verdict"
    assert summary["verdict"].splitlines()[0] in md
    # no contrast at all: the effects section says so, the verdict is still last
    records = make_records(cells=(("shared", "gsm8k"),), arms=("kv_zeroed", "kv_random"), n_tasks=4, seeds=(0,))
    summary = summarize(records, n_boot=N_BOOT)
    written = write_report(tmp_path / "bare", records, summary, {"model": None})
    md = written["report.md"].read_text()
    assert "No contrast could be estimated" in md
    assert md.rstrip().endswith(summary["verdict"].splitlines()[-1].strip())
    assert not any(k.startswith("figures/") for k in written)


def test_text_is_escaped_in_html(tmp_path):
    records = make_records(cells=(("private", "a<b>&c"),), arms=("kv", "kv_mismatched"), n_tasks=4, seeds=(0,))
    meta = {"model": "<script>alert(1)</script>", "command": "kvrelay audit --out 'x<y>'", "note": 'say "hi" & <b>'}
    summary = summarize(records, n_boot=N_BOOT)
    page = write_report(tmp_path, records, summary, meta)["report.html"].read_text()
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "a&lt;b&gt;&amp;c" in page and "<b>" not in page
    assert "x&lt;y&gt;" in page and "say &quot;hi&quot; &amp; &lt;b&gt;" in page
    assert page.count("<script>") == 1  # only the report's own image-count script


def test_rebuild_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="records.jsonl"):
        rebuild(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        rebuild(tmp_path / "missing")
    (tmp_path / "records.jsonl").write_text('{"task_id": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"records.jsonl:2: not valid JSON"):
        read_records(tmp_path / "records.jsonl")
    (tmp_path / "records.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no trial records"):
        rebuild(tmp_path)
    (tmp_path / "records.jsonl").write_text('{"task_id": "a"}\n')
    with pytest.raises(ValueError, match=r"records.jsonl: record 0: missing field"):
        rebuild(tmp_path)


def test_plots_return_none_without_rows():
    assert plots.forest_plot([]) is None
    assert plots.dose_response_plot([]) is None
    assert plots.cate_plot([], "pairing") is None
    assert plots.cost_benefit_plot([]) is None
    assert plots.similarity_plot([]) is None


# ---------------------------------------------------------------- in a real browser


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium; a skip outside CI, a failure in CI (.ci/run installs it)."""
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is not installed, but CI is set: .ci/run must install it")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); CI installs it")
    return exe


def _headless(exe: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _images_loaded(exe: str, profile: Path, url: str) -> tuple[str, int, int]:
    """``(DOM, images decoded, images on the page)`` after the page's load script ran."""
    dom = _headless(exe, profile, "--virtual-time-budget=5000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom.stdout)
    assert body, dom.stdout[:500]
    total = re.search(r'data-images-total="(\d+)"', body.group(0))
    loaded = re.search(r'data-images-loaded="(\d+)"', body.group(0))
    assert total and loaded, f"the load script did not run: {body.group(0)}"
    return dom.stdout, int(loaded.group(1)), int(total.group(1))


@pytest.mark.browser
def test_report_renders_in_headless_chromium(chromium, run, tmp_path):
    exe = chromium
    out, written, summary = run
    url = (out / "report.html").resolve().as_uri()
    # the page's own script counts decoded images on load; --dump-dom prints the DOM after it ran
    dom, loaded, total = _images_loaded(exe, tmp_path / "p1", url)
    n_figures = sum(k.startswith("figures/") for k in written)
    assert loaded == total == n_figures == 5
    assert '<section id="verdict">' in dom
    first = summary["verdict"].splitlines()[0]
    assert first[: first.index(", Holm")] in dom  # the serialiser escapes < and ' its own way
    # a screenshot: a real PNG of the requested size, not blank, with coloured plot pixels in it
    png = tmp_path / "report.png"
    shot = _headless(exe, tmp_path / "p2", f"--screenshot={png}", "--window-size=1280,4000", url)
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    from PIL import Image  # a matplotlib dependency

    with Image.open(png) as im:
        assert im.size == (1280, 4000)
        rgb = np.asarray(im.convert("RGB"), dtype=np.int32)  # (H, W, 3)
    assert rgb.std() > 20, "blank screenshot"
    packed = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]  # (H, W) one int per colour
    assert np.unique(packed).size > 200
    saturated = (rgb.max(axis=2) - rgb.min(axis=2)) > 80  # (H, W): plot colours, not grey text or tables
    assert saturated.sum() > 5000, f"only {saturated.sum()} coloured pixels: the plots did not render"


@pytest.mark.browser
def test_the_image_check_catches_a_broken_plot(chromium, run, tmp_path):
    """Negative control: one corrupted PNG must show up as one image that did not load."""
    exe = chromium
    out, _, _ = run
    page = (out / "report.html").read_text()
    broken = re.sub(r"data:image/png;base64,[A-Za-z0-9+/]{64}", "data:image/png;base64," + "A" * 64, page, count=1)
    assert broken != page
    (tmp_path / "broken.html").write_text(broken)
    _, loaded, total = _images_loaded(exe, tmp_path / "p", (tmp_path / "broken.html").as_uri())
    assert total == 5 and loaded == 4
