"""The fault corpus: which defence of the receive path catches each way a relayed cache can be wrong.

One genuine payload (the producer reading ``context_tokens`` of real text, signed with an HMAC key,
round 5) is faulted in each way below; each faulted payload goes through the receiver's defences
in order, and the first that refuses it is recorded:

    checksum     the wire checksums (``kv.wire``: CorruptPayload)
    signature    the producer's signature (``kv.sign``: UnsignedPayload, BadSignature)
    fingerprint  another model's payload (``kv.compat``: IncompatiblePayload on model_fingerprint)
    invariants   the format's and the receiver's structural checks (other IncompatiblePayload), and
                 NaN/Inf in the K/V (``agents.verify``)
    round check  the round book (StalePayload, MissingRound, ExpiredPayload)
    layer0       verification: layer 0 recomputed at every position
    spot-check   verification: k random positions recomputed through every layer

Faults that pass the signature were made by someone holding the key (a buggy or compromised
producer): only recomputation can catch those. Random faults (noise, which positions are checked)
are drawn ``trials`` times; ``detection_probability`` is the share of draws caught. The
false-positive rate is measured on ``genuine`` payloads of the benchmarks' inputs (the contexts of the
``squad``, ``gen``, ``drop`` and ``gsm8k`` task sets at their natural lengths, capped at
``GENUINE_MAX_TOKENS``), made in each engine mode in turn (payload ``i`` in ``corpus_mode(i)``, by a producer and
checked by a receiver in that mode) and each checked under every codec a receiver accepts.
``cost_fraction`` is ``agents.verify``'s: multiply-adds run over those of a full re-prefill (0 for a
defence that reads the header only). Every finished row is appended to ``records`` (JSONL) and a rerun
with the same file resumes; ``assemble`` builds the JSON from whatever the records hold (marked
``complete: false`` until every row is there).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvrelay.agents.agent import READER_ROLE, Agent
from kvrelay.agents.receive import RoundBook, RoundRules, check_geometry, receive
from kvrelay.agents.verify import VerifySpec, verify_payload
from kvrelay.core import corpus
from kvrelay.core.errors import (
    BadSignature,
    CorruptPayload,
    ExpiredPayload,
    IncompatiblePayload,
    MissingRound,
    ProducerModelChanged,
    StalePayload,
    UnsignedPayload,
)
from kvrelay.core.jsonl import append_json_lines, resume_json_lines
from kvrelay.kv import codecs, wire
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.sign import Key, Keyring, sign_parts
from kvrelay.models.engine import ENGINES
from kvrelay.transport.payloads import decode_bytes

CODECS = ("raw", "fp16", "bf16", "int8", "int4")  # what a receiver accepts (eviction and layer subsets refuse)
KEY = Key("hmac", "corpus", bytes(range(100, 132)))
ROUND = 5
K_SWEEP = (4, 8, 16, 32)
GENUINE_SETS = ("squad", "gen", "drop", "gsm8k")  # the benchmarks' task sets whose contexts are relayed
GENUINE_MAX_TOKENS = 512
FAULTS = ("edited_bytes", "forged_resigned", "unsigned", "other_model", "truncated_layers", "nan", "inf",
          "stale_round", "skipped_round", "expired", "noise_all", "noise_10pct", "noise_1pct", "noise_one_layer",
          "other_text", "other_task", "shifted_positions", "other_weights", "reordered_tokens",
          "noise_10pct_upper_layers", "noise_1pct_upper_layers")


def _signed_bytes(p: KVPayload | dict, key: Key | None = KEY, meta: dict | None = None) -> bytes:
    parts = wire.encode_parts(p) if isinstance(p, KVPayload) else wire.pack_parts(p, meta)
    return b"".join(bytes(b) for b in (sign_parts(parts, key) if key is not None else parts))


def _noise(p: KVPayload, positions: torch.Tensor, layers, g: torch.Generator) -> KVPayload:
    """``p`` with the K/V of ``positions`` in ``layers`` replaced by Gaussian noise of the same norm."""
    keys, values = list(p.keys), list(p.values)
    for layer in layers:
        for ts in (keys, values):
            t = ts[layer].clone()  # (1, H, T, D)
            old = t[:, :, positions]  # (1, H, m, D)
            n = torch.randn(old.shape, generator=g, dtype=torch.float32).to(old.dtype)
            scale = old.float().pow(2).sum(dim=(1, 3), keepdim=True).sqrt() / n.float().pow(2).sum(
                dim=(1, 3), keepdim=True).sqrt()
            t[:, :, positions] = (n.float() * scale).to(t.dtype)
            ts[layer] = t
    return KVPayload(tuple(keys), tuple(values), p.token_ids, p.positions, p.mask, p.meta)


def _relabel(other: KVPayload, p: KVPayload) -> KVPayload:
    """``other``'s K/V under ``p``'s token ids, positions and metadata."""
    return KVPayload(other.keys, other.values, p.token_ids, p.positions, p.mask, p.meta)


class Receiver:
    """The defences in order, for one loaded model, one trusted key and the round book's expectations."""

    def __init__(self, lm, made_at: float):
        self.lm, self.made_at = lm, made_at

    def defend(self, data: bytes, spec: VerifySpec, *, now_round: int = ROUND) -> tuple[str, str, float]:
        """(detected_by or "", reason, cost_fraction) for kvrelay/1 bytes."""
        ident = self.lm.identity
        try:
            p = decode_bytes(data, expect=ident, keys=Keyring((KEY,)))
        except CorruptPayload as e:
            return "checksum", str(e), 0.0
        except (UnsignedPayload, BadSignature) as e:
            return "signature", str(e), 0.0
        except IncompatiblePayload as e:
            return ("fingerprint" if e.field == "model_fingerprint" else "invariants"), str(e), 0.0
        book = RoundBook(RoundRules(max_age_s=600.0), held={p.meta.producer: ROUND},
                         models={p.meta.producer: ident.fingerprint})
        try:  # the receiver's clock stands just after the genuine payload was made: a long run ages nothing
            receive(p, ident, book, now_round=now_round, now_s=self.made_at + 60.0)
            check_geometry(p, ident)
        except (StalePayload, MissingRound, ExpiredPayload, ProducerModelChanged) as e:
            return "round check", str(e), 0.0
        except IncompatiblePayload as e:
            return ("fingerprint" if e.field == "model_fingerprint" else "invariants"), str(e), 0.0
        v = verify_payload(self.lm.model, p, spec, codec=wire.read_meta(data).get("codec", "raw"))
        return (v.detected_by if v.verdict != "ok" else ""), v.reason, v.cost_fraction


def _read(lm, text: str, tokens: int, *, name: str = "producer") -> KVPayload:
    a = Agent(lm, name, role=READER_ROLE)
    a.round = ROUND
    ids = a.reading_ids(text)[:tokens]
    return a.prefill(ids)


def _text(tokenizer, tokens: int, kind: str, offset: int) -> str:
    """At least ``tokens`` tokens of real text (prose or code that ships with Python)."""
    src = corpus.prose if kind == "prose" else corpus.code
    text, i = "", 0
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens + 64:
        text += src(offset + i)
        i += 1
    return text


def faulted(fault: str, lm, p: KVPayload, g: torch.Generator) -> bytes:
    """The kvrelay/1 bytes of ``p`` faulted as ``fault`` says (``g`` draws anything random)."""
    L, T = len(p.keys), p.num_tokens

    def positions(frac: float) -> torch.Tensor:
        m = max(1, round(frac * T))
        return torch.randperm(T, generator=g)[:m].sort().values

    if fault == "edited_bytes":
        data = bytearray(_signed_bytes(p))
        data[len(data) - 1 - int(torch.randint(0, 4096, (1,), generator=g))] ^= 0x10
        return bytes(data)
    if fault in ("forged_resigned", "unsigned"):
        tensors, meta = wire.unpack(_signed_bytes(_noise(p, positions(0.1), range(L), g), key=None))
        return _signed_bytes(tensors, Key("hmac", KEY.id, os.urandom(32)) if fault == "forged_resigned" else None,
                             meta)
    if fault == "other_model":
        return _signed_bytes(p.with_meta(model_fingerprint="f" * 64))
    if fault == "truncated_layers":
        tensors, meta = wire.unpack(_signed_bytes(p, key=None))
        last = L - 1
        del tensors[f"layers.{last}.k"], tensors[f"layers.{last}.v"]
        for f in ("layer_indices", "layer_types"):
            meta[f] = json.dumps(json.loads(meta[f])[:-1])
        return _signed_bytes(tensors, KEY, meta)
    if fault in ("nan", "inf"):
        keys = list(p.keys)
        t = keys[L // 2].clone()
        t[0, 0, int(torch.randint(0, T, (1,), generator=g)), 0] = math.nan if fault == "nan" else math.inf
        keys[L // 2] = t
        return _signed_bytes(KVPayload(tuple(keys), p.values, p.token_ids, p.positions, p.mask, p.meta))
    if fault == "stale_round":
        return _signed_bytes(p.with_meta(round=ROUND - 2))
    if fault == "skipped_round":
        return _signed_bytes(p.with_meta(round=ROUND + 3))
    if fault == "expired":
        return _signed_bytes(p.with_meta(created_at=p.meta.created_at - 3600))
    if fault.startswith("noise_"):
        frac = {"all": 1.0, "10pct": 0.1, "1pct": 0.01, "one": 1.0}[fault.split("_")[1]]
        layers = [L // 2] if fault == "noise_one_layer" else range(1, L) if fault.endswith("upper_layers") else range(L)
        return _signed_bytes(_noise(p, positions(frac), layers, g))
    if fault in ("other_text", "other_task"):
        kind = "prose" if fault == "other_text" else "code"
        offset = int(torch.randint(1000, 9000, (1,), generator=g))
        other = _read(lm, _text(lm.tokenizer, T, kind, offset), T)
        return _signed_bytes(_relabel(other, p))
    if fault == "shifted_positions":
        return _signed_bytes(KVPayload(p.keys, p.values, p.token_ids, p.positions + 1, p.mask, p.meta))
    if fault == "reordered_tokens":
        perm = torch.randperm(T, generator=g)
        return _signed_bytes(KVPayload(p.keys, p.values, p.token_ids[:, perm], p.positions, p.mask, p.meta))
    raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")


def _other_weights(lm, p: KVPayload, seed: int) -> bytes:
    """The cache a same-architecture model with other weights (every weight moved by 2% of its spread)
    computes for ``p``'s tokens, labelled as ``p``."""
    model = copy.deepcopy(lm.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            if w.ndim == 2:
                w.add_(torch.randn(w.shape, generator=g) * (0.02 * float(w.std())))
    twin = dataclasses.replace(lm, model=model)
    other = Agent(twin, "producer", role=READER_ROLE).prefill(p.token_ids[0])
    del model
    return _signed_bytes(_relabel(other, p))


def _hit_probability(T: int, m: int, k: int) -> float:
    """P(at least one of k distinct random positions of T lands on one of m tampered ones)."""
    if k >= T:
        return 1.0
    return 1.0 - math.exp(math.lgamma(T - m + 1) - math.lgamma(T - m - k + 1) + math.lgamma(T - k + 1)
                          - math.lgamma(T + 1)) if T - m >= k else 1.0


def run_corpus(model: str, *, k: int = 32, genuine: int = 200, context_tokens: int = 2048, trials: int = 20,
               records: Path | None = None, threads: int | None = None, engine: str = "fp32", lm=None,
               progress: Callable[[dict], None] | None = None) -> dict:
    """Every fault of ``FAULTS`` at ``k`` (and the upper-layer noise over ``K_SWEEP``), and the false-positive
    rate over ``genuine`` payloads × ``CODECS`` (engine modes in turn); the JSON ``kvrelay verify --corpus``
    writes. ``progress`` gets the partial JSON after every finished row (a long run's results land as they
    come)."""
    if lm is None:
        from kvrelay.models.loader import load_model

        if threads:
            torch.set_num_threads(threads)
        lm = load_model(model, engine=engine)
    load_before = list(os.getloadavg())
    done = {r["id"]: r for r in resume_json_lines(records)} if records is not None else {}
    p = _read(lm, _text(lm.tokenizer, context_tokens, "prose", 0), context_tokens)
    rx = Receiver(lm, p.meta.created_at)

    def result() -> dict:
        return assemble(done, model=model, k=k, genuine=genuine, context_tokens=p.num_tokens, layers=len(p.keys),
                        trials=trials, load_before=load_before, engine=lm.engine)

    def finished(row: dict) -> None:
        done[row["id"]] = row
        if records is not None:
            append_json_lines(records, [row])
        if progress is not None:
            progress(result())

    for fault, kk in _plan(k):
        if f"{fault}@k={kk}" not in done:
            finished(_fault_row(fault, kk, lm, p, rx, trials))
    _false_positives(lm, genuine, k, done, finished)
    return result()


def _plan(k: int) -> list[tuple[str, int]]:
    plan = [(f, k) for f in FAULTS if not f.endswith("upper_layers")]
    return plan + [(f, kk) for f in FAULTS if f.endswith("upper_layers") for kk in K_SWEEP]


RANDOM_FAULTS = {"edited_bytes", "nan", "inf", "other_text", "other_task", "reordered_tokens", "other_weights"}
NOISE_FRACTION = {"noise_10pct": 0.1, "noise_1pct": 0.01, "noise_10pct_upper_layers": 0.1,
                  "noise_1pct_upper_layers": 0.01}


def _fault_row(fault: str, k: int, lm, p: KVPayload, rx: Receiver, trials: int) -> dict:
    """``fault`` drawn ``trials`` times (once for a deterministic one, or one that prefills the whole context)."""
    n = trials if (fault.startswith("noise_") or fault in RANDOM_FAULTS) else 1
    n = 1 if fault in ("other_text", "other_task", "other_weights") else n
    caught, by, costs, reasons = 0, {}, [], []
    for t in range(n):
        g = torch.Generator().manual_seed(1000 * t + FAULTS.index(fault))
        data = _other_weights(lm, p, t) if fault == "other_weights" else faulted(fault, lm, p, g)
        d, reason, cost = rx.defend(data, VerifySpec(k=k, seed=t))
        caught += bool(d)
        by[d or "missed"] = by.get(d or "missed", 0) + 1
        costs.append(cost)
        reasons.append(reason)
    frac = NOISE_FRACTION.get(fault)
    T = p.num_tokens
    return {"id": f"{fault}@k={k}", "fault": fault, "detected": caught == n, "detected_by": max(by, key=by.get),
            "detected_by_counts": by, "k": k, "trials": n, "detection_probability": caught / n,
            "cost_fraction": round(sum(costs) / n, 6), "reason": reasons[0][:300],
            "hit_probability": round(_hit_probability(T, max(1, round(frac * T)), k), 6) if frac else None}


def genuine_inputs(n: int) -> list[str]:
    """``n`` contexts of the benchmarks' task sets, round robin over ``GENUINE_SETS`` (each set in its
    seed-0 order), so payload ``i`` is always the same text."""
    from kvrelay.audit.tasks import load_tasks

    per = -(-n // len(GENUINE_SETS))
    pools = [load_tasks(name, limit=per, seed=0) for name in GENUINE_SETS]
    return [pools[i % len(pools)][i // len(pools)].context for i in range(n)]


def genuine_payload(lm, text: str) -> KVPayload:
    """A producer's payload of ``text`` (the first ``GENUINE_MAX_TOKENS`` of its reading) in ``lm``'s mode."""
    a = Agent(lm, "producer", role=READER_ROLE)
    a.round = ROUND
    return a.prefill(a.reading_ids(text)[:GENUINE_MAX_TOKENS])


def shipped(p: KVPayload, codec: str) -> KVPayload:
    """``p`` as a receiver gets it after travelling under ``codec`` (``raw``: as it is)."""
    return p if codec == "raw" else codecs.decompress(codecs.compress(p, codec))


def corpus_mode(i: int) -> str:
    """The engine mode genuine payload ``i`` is made and checked in: ``ENGINES`` in turn."""
    return ENGINES[i % len(ENGINES)]


def _false_positives(lm, n: int, k: int, done: dict, finished: Callable[[dict], None]) -> None:
    """Genuine payloads ``genuine:i`` (``genuine_inputs``; engine mode ``corpus_mode(i)``) checked under every
    codec in ``CODECS`` (one resumable record per payload), mode by mode so one mode's weights are held at a
    time. A record made in another mode than ``corpus_mode(i)`` (by a run before the modes it rotates over
    changed) is made again, and the new row replaces it."""
    from kvrelay.models.engine import with_engine

    todo = [i for i in range(n) if done.get(f"genuine:{i}", {}).get("engine") != corpus_mode(i)]
    if not todo:
        return
    texts = genuine_inputs(n)
    for mode in ENGINES:
        mine = [i for i in todo if corpus_mode(i) == mode]
        if not mine:
            continue
        lm_e = lm if mode == lm.engine else with_engine(lm, mode)
        for i in mine:
            p = genuine_payload(lm_e, texts[i])
            row = {"id": f"genuine:{i}", "engine": mode, "set": GENUINE_SETS[i % len(GENUINE_SETS)],
                   "tokens": p.num_tokens, "flagged": [], "error_over_tolerance": {}, "tolerance": {}}
            for c in CODECS:
                v = verify_payload(lm_e.model, shipped(p, c), VerifySpec(k=k, seed=i), codec=c)
                row["error_over_tolerance"][c] = round(v.max_error / v.tolerance, 6)
                row["tolerance"][c] = v.tolerance
                if v.verdict != "ok":
                    row["flagged"].append(c)
            finished(row)
        del lm_e


def _fp_summary(per: list[dict]) -> dict:
    checks = len(per) * len(CODECS)
    flagged = sum(len(r["flagged"]) for r in per)
    return {"payloads": len(per), "codecs": list(CODECS), "engines": list(ENGINES), "sets": list(GENUINE_SETS),
            "checks": checks, "flagged": flagged, "false_positive_rate": flagged / max(1, checks),
            "flagged_per_codec": {c: sum(c in r["flagged"] for r in per) for c in CODECS},
            "payloads_per_engine": {m: sum(r.get("engine") == m for r in per) for m in ENGINES},
            "flagged_per_engine": {m: sum(len(r["flagged"]) for r in per if r.get("engine") == m) for m in ENGINES},
            "worst_error_over_tolerance": {c: max((r["error_over_tolerance"][c] for r in per), default=0.0)
                                           for c in CODECS},
            "tokens": [min((r["tokens"] for r in per), default=0), max((r["tokens"] for r in per), default=0)]}


def assemble(done: dict[str, dict], *, model: str, k: int, genuine: int, context_tokens: int, layers: int,
             trials: int, load_before: list[float] | None, engine: str = "fp32") -> dict:
    """The corpus JSON from finished rows ``done`` (records ids -> rows); ``complete`` says whether every
    planned row and genuine payload is there (a partial run is assembled the same way)."""
    rows = [done[f"{f}@k={kk}"] for f, kk in _plan(k) if f"{f}@k={kk}" in done]
    per = [done[f"genuine:{i}"] for i in range(genuine) if f"genuine:{i}" in done]
    return {"model": model, "engine": engine, "context_tokens": context_tokens, "layers": layers, "k": k,
            "trials": trials, "rows": rows, "false_positives": _fp_summary(per),
            "spot_check_cost_fraction": round(k / context_tokens, 6),
            "complete": len(rows) == len(_plan(k)) and len(per) == genuine,
            "machine": platform.node(), "load_average": {"before": load_before, "after": list(os.getloadavg())},
            "created_at": time.time()}


def print_corpus(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"fault corpus on {res['model']} ({res['context_tokens']} tokens, {res['layers']} layers)")
    for col in ("fault", "detected", "detected by", "k", "P(detect)", "cost"):
        t.add_column(col)
    for r in res["rows"]:
        t.add_row(r["fault"], "yes" if r["detected"] else "NO", r["detected_by"], str(r["k"]),
                  f"{r['detection_probability']:.2f}", f"{r['cost_fraction']:.4f}")
    Console().print(t)
    fp = res["false_positives"]
    print(f"false positives: {fp['flagged']} of {fp['checks']} checks ({fp['payloads']} genuine payloads x "
          f"{len(fp['codecs'])} codecs; per engine mode {fp['payloads_per_engine']})")
