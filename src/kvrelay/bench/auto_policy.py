"""The policy a command builds for a workflow's ``channel = "auto"`` edges, from files the user names.

``auto_policy`` loads a cost profile (what ``kvrelay calibrate --json`` wrote, or its saved profile
file), fits the value model on audit records (each folder's ``records.jsonl`` or ``.gz``; the task texts and the
engine come from its ``config.json`` and ``run.json``, as ``bench policy`` reads them) and returns the
``workflows.auto.AutoPolicy`` that decides every auto edge, with the runtime switch on
(``policy.switch.RelaySwitch`` defaults), plus a summary of what it was built from for the JSON.

``auto_routes`` groups the kv-mode runs' routes (``AgentRecord.decision``) per edge: one row per
distinct (channel, codec, reason), with the repeats it was taken in.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrelay.bench.policy import load_observations, task_texts
from kvrelay.core.errors import InvalidInput
from kvrelay.policy.cost import CostProfile
from kvrelay.policy.decide import Slo
from kvrelay.policy.value import N_BOOT, ValueModel
from kvrelay.workflows.auto import AutoPolicy


def auto_edges(wf) -> list[str]:
    """The workflow's ``channel = "auto"`` edges, as ``src->dst``."""
    return [f"{e.src}->{e.dst}" for e in wf.edges if e.channel == "auto"]


def _tasks(folder: Path) -> list[str]:
    cfg = folder / "config.json"
    return json.loads(cfg.read_text()).get("tasks", []) if cfg.is_file() else []


def auto_policy(profile: str | Path, audits, *, slo_s: float | None = None, seed: int = 0,
                n_boot: int = N_BOOT) -> tuple[AutoPolicy, dict]:
    """An ``AutoPolicy`` from the cost profile at ``profile`` and the audit folders ``audits`` (each holding
    ``records.jsonl``), with a latency SLO of ``slo_s`` seconds (None: none); and the summary dict."""
    folders = [Path(a) for a in audits]
    if not folders:
        raise InvalidInput("no audit records to fit the value model on", "audit folders written by kvrelay audit")
    cost = CostProfile.load(profile)
    texts = task_texts({t.split(":")[0] for f in folders for t in _tasks(f)})
    obs, _ = load_observations(folders, texts)
    if not obs:
        raise InvalidInput(f"no channel arm outcomes in {[str(f) for f in folders]}",
                           "audit records with channel arms (none, text_full, kv, kv_codec:int8)")
    value = ValueModel.fit(obs, n_boot=n_boot, seed=seed, sources=tuple(str(f) for f in folders))
    policy = AutoPolicy(value, cost, slo=Slo(latency_s=slo_s))
    summary = {"profile": str(profile), "profile_model": cost.model, "profile_engine": cost.engine,
               "profile_load_average": list(cost.load_average), "value_audits": [str(f) for f in folders],
               "value_observations": len(obs), "value_channels": sorted(value.fits), "slo_s": slo_s,
               "codecs": list(policy.codecs), "switch": policy.switch is not None}
    return policy, summary


def auto_routes(kv_runs) -> list[dict]:
    """Per auto edge, each distinct route the kv-mode runs took: edge, channel, codec, reason, repeats."""
    rows: dict[tuple, dict] = {}
    for r, t in enumerate(kv_runs):
        for a in t.agents:
            d = a.decision
            if d is None:
                continue
            key = (d["edge"], d["channel"], d["codec"], d["reason"])
            rows.setdefault(key, {"edge": d["edge"], "channel": d["channel"], "codec": d["codec"],
                                  "reason": d["reason"], "decided": d["decision"]["channel"], "repeats": []})
            rows[key]["repeats"].append(r)
    return list(rows.values())
