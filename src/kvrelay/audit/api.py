"""``kvrelay.audit(...)``: run an audit config (or a preset by name) into a folder and return its summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvrelay.audit.presets import preset
from kvrelay.audit.report import rebuild
from kvrelay.audit.runner import AuditConfig, AuditRunner


def run_audit(config: AuditConfig | str, out_dir: str | Path, *, lm=None,
              progress: Callable[[int], None] | None = None, **overrides) -> dict:
    """Run ``config`` (an ``AuditConfig``, or a preset name such as ``"smoke"`` with ``overrides`` like
    ``model=``, ``limit=``) into ``out_dir`` — ``records.jsonl``, ``summary.json``, ``report.md`` and
    ``report.html`` — and return the summary. Resumes a folder that already holds records of the same
    config. ``lm``: an already loaded model (default: ``load_model(config.model)``). The CLI
    (``kvrelay audit``) additionally probes cache similarity per task set."""
    cfg = preset(config, **overrides) if isinstance(config, str) else config
    if lm is None:
        from kvrelay.models.loader import load_model

        lm = load_model(cfg.model)
    AuditRunner(cfg, lm, Path(out_dir), progress).run()
    paths = rebuild(out_dir, margin=cfg.margin, n_boot=cfg.n_boot)
    return json.loads(Path(paths["summary.json"]).read_text())
