"""``kvrelay bench serve``: multi-agent workflows through an OpenAI-compatible HTTP API, by N clients.

A workflow is three agents over one audit task (``regimes``). Private regime (``audit.tasks.generate``:
a facility log with one access code the last agent is asked for; the document reaches the first
agent only): the reader reads the document and summarises it, the checker names the holders it
gives codes for, the answerer answers the task's question. Shared regime (ARC-Challenge, in the
audit's order): the reader reads the problem and restates it, the checker names the choices it rules
out, the answerer is asked the whole problem again and answers with a letter — it needs nothing the
earlier agents read. The last answer is scored with the task's scorer (``audit.tasks.score``); with
both regimes their workflows alternate, and each row also reports each regime on its own. ``clients``
threads take workflows from one list, so up to ``clients`` workflows run at once, each agent's request
after the previous one's answer. ``single``: each workflow is instead one plain chat request — the
document and the question, no hand-off — which measures what the gateway itself costs against a peer
server when nothing is relayed.

Strategies (``STRATEGIES``), all on the same tasks:

* ``scheduler`` — ``model: "auto"`` (``serve.scheduler``) with ``kv_slo_s``; each agent passes the
  previous agent's handle (``kv_context``) and sends only its own turn.
* ``round_robin`` — models in turn, request by request, with handles (a handle from another
  model falls back to text: the response says ``incompatible``).
* ``always_smallest`` / ``always_largest`` — one model (by parameter count), with handles.
* ``always_text`` — the largest model, no handles: each agent re-sends the whole conversation.
* ``transformers_serve`` — ``transformers serve --continuous-batching`` (fp32, a paged cache that
  shares prefix blocks) on the largest model, started by the benchmark on loopback, text hand-offs
  written the common way: each agent its own system prompt, then one message with the transcript of
  the earlier turns (``prompts="roles"``), so consecutive requests share no prefix to reuse.
* ``transformers_serve_prefix_arranged`` — the same server with the requests of ``always_text`` (one
  system prompt, the whole conversation re-sent, ``prompts="conversation"``): each request extends the
  previous one's prompt and answer token for token, the best case of its prefix sharing.
* ``vllm`` / ``vllm_prefix_arranged`` — the same two ways of writing hand-offs through vLLM's CPU build
  (bf16, automatic prefix caching) on the largest model. Both are reported as not run unless its
  optional environment exists (``bench.peer_servers.vllm_python``); their rows record vLLM's
  prefix-cache hit rate over the strategy (``prefix_cache_hit_rate``, from its ``/metrics``).

Each peer strategy starts its own server (``peer_start_s`` in its row says how long it took to answer), so
no peer strategy finds in a prefix cache the documents another one read.

kvrelay's own strategies share one gateway and run **interleaved**: in rounds of ``clients`` workflows, each
strategy answers the round's workflows in turn, the order rotating round by round, so a transient slowdown of
the machine falls on every strategy alike rather than on whichever ran at the time (strategies run one after
another differed by up to 30% on the same workflow for that reason alone). The peers cannot share rounds (each
strategy starts its own server) and run after them.

Before the timed workflows each server answers one untimed workflow on another task (``warm_up``): through
every model of kvrelay's pool, and through each peer before its strategies, so no strategy pays a cold
engine's first requests (kernel set-up, cache allocation) for the others. With ``batch``, the pages
kvrelay's replicas keep for prefix sharing are dropped before each strategy (``Batcher.drop_cached_pages``),
so none reuses the documents an earlier strategy read; a peer starts with an empty cache. Per strategy: p50 / p99
end-to-end workflow latency, throughput (requests per second of the
strategy's wall time), accuracy with a BCa bootstrap interval (``audit.bootstrap.bca_ci``), and
the 1-minute load average before and after. ``versus_scheduler`` pairs each strategy with the scheduler
workflow by workflow (``versus``). ``scheduler_dominated`` is true when another strategy beats the scheduler
beyond run-to-run noise in that pairing (``credibly_dominating``: credibly faster at no lower accuracy, or
credibly more accurate at no higher latency), by the point rule for a strategy that cannot be paired
(``dominating``). ``scheduler_point_dominated`` is the point rule alone — a p50 no higher and an accuracy no
lower, one of them strictly — which flips between two strategies that route every request alike (the
scheduler choosing the largest model for everything ties ``always_largest``), so it is reported, not judged
by (docs/json.md).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvrelay.audit.bootstrap import bca_ci
from kvrelay.audit.tasks import Task, generate, score
from kvrelay.bench.peer_servers import (
    PeerServer,
    model_folder,
    prefix_cache_counts,
    transformers_serve,
    vllm_available,
    vllm_serve,
)
from kvrelay.bench.quiet import load1, load_status
from kvrelay.core.errors import InvalidInput, PeerUnavailable

STRATEGIES = ("scheduler", "round_robin", "always_smallest", "always_largest", "always_text", "transformers_serve",
              "transformers_serve_prefix_arranged", "vllm", "vllm_prefix_arranged")
ARRANGED = "_prefix_arranged"  # a peer strategy with this suffix re-sends the conversation (prompts="conversation")
KVRELAY_STRATEGIES = STRATEGIES[:5]
READER = "You are a careful reader. Read the document."
ROLES = (READER, "You are a checker. You check which holders a document gives access codes for.",
         "You answer questions about a document exactly, in a few words.")  # prompts="roles": one per agent
AGENTS = ("reader", "checker", "answerer")
TURNS = ("Summarize the document above in one sentence.",
         "Which holders does the document give an access code for? Name two.")
REGIMES = ("private", "shared")
SHARED_SET = "arc_challenge"  # the shared regime's workflows: the audit's ARC-Challenge tasks, in its order
SHARED_TURNS = ("Restate the problem above in one sentence.", "Which choices can be ruled out? Name them.")
SHARED_ROLES = (READER, "You are a checker. You rule out wrong choices of a multiple-choice problem.",
                "You answer multiple-choice problems with the letter of the correct choice.")
PROMPTS = ("conversation", "roles")  # how text hand-offs are written (``text_messages``)


WARM_UP_SEED = 1000  # the warm-up workflow's task seed: config.seed + this

@dataclass(frozen=True)
class ServeBenchConfig:
    models: tuple[str, ...]  # the kvrelay pool
    workflows: int = 4  # per strategy
    clients: int = 2
    doc_tokens: int = 1024
    max_tokens: int = 24  # per agent
    slo_s: float = 60.0  # per request, for the scheduler
    strategies: tuple[str, ...] = STRATEGIES
    seed: int = 0
    threads: int | None = None
    engine: str = "fp32"
    audits: tuple[Path, ...] = ()  # the scheduler's value models (serve.scheduler.fit_value_models)
    single: bool = False  # each workflow is one plain chat request (document + question): no hand-off
    batch: bool = False  # kvrelay's replicas answer concurrent requests together (serve.batcher)
    regimes: tuple[str, ...] = ("private",)  # REGIMES: whose workflows run (``workflows`` of each)
    replicas: int = 1  # per model (kvrelay serve --replicas); a peer server gets threads × replicas threads

    def __post_init__(self):
        if not self.regimes or len(set(self.regimes)) != len(self.regimes) or set(self.regimes) - set(REGIMES):
            raise InvalidInput(f"regimes {', '.join(self.regimes) or '(none)'}",
                               f"one or both of {', '.join(REGIMES)}, each once")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise InvalidInput(f"unknown strategies {', '.join(bad)}", f"some of {', '.join(STRATEGIES)}")
        if (self.workflows < 1 or self.clients < 1 or self.doc_tokens < 64 or self.max_tokens < 1 or self.slo_s <= 0
                or self.replicas < 1):
            raise InvalidInput("--workflows, --clients, --doc-tokens, --max-tokens, --slo or --replicas out of range",
                               "workflows, clients, max-tokens, replicas >= 1, doc-tokens >= 64, a positive SLO")

    @property
    def peer_threads(self) -> int | None:
        """A peer server's threads: the cores kvrelay's replicas of one model use together (None: its default)."""
        return self.threads * self.replicas if self.threads else None

    @property
    def cores(self) -> int:
        """The cores the run is meant to use (``peer_threads``, or every core): what its load is judged against."""
        return self.peer_threads or os.cpu_count() or 1


# -- one workflow over HTTP ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Route:
    """Where a strategy's requests go: base URL, the model per request, and whether handles are used.

    ``extensions`` false: the server is another OpenAI-compatible one (a peer), so a request carries
    only standard fields — a strict server refuses kvrelay's ``kv_*`` fields (transformers serve: 422)."""

    url: str
    model: Callable[[], str]
    relay: bool
    slo_s: float | None = None
    extensions: bool = True
    prompts: str = "conversation"  # PROMPTS: how a text hand-off is written when relay is off

    def __post_init__(self):
        if self.relay and not self.extensions:
            raise ValueError("relaying handles needs kvrelay's request fields (extensions=True)")
        if self.prompts not in PROMPTS:
            raise ValueError(f"prompts must be one of {PROMPTS}, got {self.prompts!r}")


def text_messages(prompts: str, turns: Sequence[str], answers: Sequence[str],
                  roles: Sequence[str] = ROLES) -> list[dict]:
    """The messages the agent at turn ``len(answers)`` sends when hand-offs are text.

    ``conversation``: the reader's system prompt and the whole conversation so far, so each request's
    prompt is the previous request's prompt plus its answer plus one turn — a prefix cache reuses it all.
    ``roles``: the agent's own system prompt, then one user message with a transcript of the earlier
    turns and answers (the document first) and its own turn — what agents that hand each other text
    usually send; the prompt differs from the previous request's from the system prompt on.
    """
    k = len(answers)
    if prompts == "conversation":
        msgs = [{"role": "system", "content": READER}]
        for turn, answer in zip(turns[:k], answers, strict=True):
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return msgs + [{"role": "user", "content": turns[k]}]
    if prompts == "roles":
        said = [f"The {AGENTS[i]} was asked: {turns[i]}\nThe {AGENTS[i]} answered: {answers[i]}" for i in range(k)]
        return [{"role": "system", "content": roles[k]},
                {"role": "user", "content": "\n\n".join([*said, turns[k]])}]
    raise ValueError(f"prompts must be one of {PROMPTS}, got {prompts!r}")


def _post(client, url: str, body: dict) -> dict:
    r = client.post(url + "/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise PeerUnavailable(f"{url} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def run_one(client, route: Route, task: Task, max_tokens: int, single: bool = False) -> dict:
    """The three agents of one workflow (``single``: one request with the document and the question); a
    record with its latency, score and what each request did."""
    shared = task.regime == "shared"  # the prompt holds the whole problem
    lead, roles = (SHARED_TURNS, SHARED_ROLES) if shared else (TURNS, ROLES)
    if single:
        turns = [task.prompt if shared else f"{task.context}\n\n{task.prompt}"]
    else:
        turns = [f"{task.context}\n\n{lead[0]}", lead[1], task.prompt]
    answers: list[str] = []
    handle = None
    steps = []
    t0 = time.perf_counter()
    for text in turns:
        own = {"role": "user", "content": text}
        body = {"model": route.model(), "max_tokens": max_tokens, "temperature": 0}
        if route.relay:
            body["messages"] = ([] if handle else [{"role": "system", "content": READER}]) + [own]
            if handle:
                body["kv_context"] = [handle]
            if route.slo_s is not None:
                body["kv_slo_s"] = route.slo_s
        else:
            body["messages"] = text_messages(route.prompts, turns, answers, roles)
            if route.extensions:
                body["kv_handle"] = False  # store no cache: nothing will continue from it
        t = time.perf_counter()
        out = _post(client, route.url, body)
        answer = out["choices"][0]["message"]["content"] or ""
        ext = out.get("kvrelay") or {}
        handle = ext.get("handle")
        answers.append(answer)
        steps.append({"model": out.get("model", body["model"]), "s": time.perf_counter() - t,
                      "prompt_tokens": out.get("usage", {}).get("prompt_tokens"),
                      "relayed_tokens": ext.get("relayed_tokens", 0),
                      "context": [c.get("fallback", c.get("channel")) for c in ext.get("context", [])],
                      "channel": (ext.get("scheduler") or {}).get("channel"),
                      "reason": (ext.get("scheduler") or {}).get("reason"),
                      "predicted_s": (ext.get("scheduler") or {}).get("predicted")})  # per model, with model "auto"
    return {"task": task.id, "regime": task.regime, "e2e_s": time.perf_counter() - t0, "score": score(task, answer),
            "answer": answer, "steps": steps}


def warm_up(route: Route, config: ServeBenchConfig) -> None:
    """One untimed workflow through ``route`` on a task of another seed (no timed task's document)."""
    import httpx

    task = generate(1, config.seed + WARM_UP_SEED, doc_tokens=config.doc_tokens)[0]
    with httpx.Client(timeout=None) as client:
        run_one(client, route, task, config.max_tokens, config.single)


def run_strategy(route: Route, tasks: Sequence[Task], clients: int, max_tokens: int,
                 single: bool = False) -> tuple[list[dict], float]:
    import httpx

    with httpx.Client(timeout=None) as client, ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        records = list(pool.map(lambda t: run_one(client, route, t, max_tokens, single), tasks))
        return records, time.perf_counter() - t0


# -- figures ---------------------------------------------------------------------------------------
def summarize(name: str, records: Sequence[dict], wall_s: float, load: Sequence[float]) -> dict:
    e2e = np.array([r["e2e_s"] for r in records])
    ci = bca_ci([r["score"] for r in records], seed=0)
    n_req = sum(len(r["steps"]) for r in records)
    ctx = [c for r in records for s in r["steps"] for c in s["context"]]
    return {"name": name, "run": True, "p50_s": float(np.percentile(e2e, 50)), "p99_s": float(np.percentile(e2e, 99)),
            "throughput_rps": n_req / wall_s, "accuracy": ci.estimate, "ci_low": ci.low, "ci_high": ci.high,
            "workflows": len(records), "requests": n_req, "wall_s": wall_s,
            "relay_hits": ctx.count("kv"), "fallbacks": {k: ctx.count(k) for k in sorted(set(ctx) - {"kv", "none"})},
            "left_out": ctx.count("none"),
            "models_used": {m: sum(s["model"] == m for r in records for s in r["steps"])
                            for m in sorted({s["model"] for r in records for s in r["steps"]})},
            "load1_before": load[0], "load1_after": load[1], "by_regime": by_regime(records)}


def by_regime(records: Sequence[dict]) -> dict[str, dict]:
    """Per regime in the records: its workflows, p50 end-to-end latency and accuracy (95% BCa)."""
    out = {}
    for regime in REGIMES:
        mine = [r for r in records if r.get("regime", "private") == regime]
        if mine:
            ci = bca_ci([r["score"] for r in mine], seed=0)
            out[regime] = {"workflows": len(mine), "p50_s": float(np.percentile([r["e2e_s"] for r in mine], 50)),
                           "accuracy": ci.estimate, "ci_low": ci.low, "ci_high": ci.high}
    return out


def not_run(name: str, reason: str) -> dict:
    return {"name": name, "run": False, "reason": reason, "p50_s": None, "p99_s": None, "throughput_rps": None,
            "accuracy": None, "ci_low": None, "ci_high": None}


def point_dominating(rows: Sequence[dict], who: str = "scheduler") -> list[str]:
    """The other strategies that ran at least as fast (p50) and as accurate as ``who``, better in one."""
    me = next((r for r in rows if r["name"] == who and r["run"]), None)
    if me is None:
        return []
    return [r["name"] for r in rows if r["name"] != who and r["run"]
            and r["p50_s"] <= me["p50_s"] and r["accuracy"] >= me["accuracy"]
            and (r["p50_s"] < me["p50_s"] or r["accuracy"] > me["accuracy"])]


def dominating(rows: Sequence[dict], paired: dict[str, dict], point: Sequence[str]) -> list[str]:
    """The strategies that beat the scheduler: beyond noise for those paired with it workflow by workflow
    (``credibly_dominating`` on ``paired``), by the point rule (``point``, from ``point_dominating``) for
    those that could not be paired."""
    credible = set(credibly_dominating(paired))
    return [r["name"] for r in rows if r["name"] in credible or (r["name"] in point and r["name"] not in paired)]


def credibly_dominating(paired: dict[str, dict]) -> list[str]:
    """The strategies that beat the scheduler beyond noise, from ``versus``: credibly faster workflow by
    workflow (latency ratio interval below 1) at no lower accuracy (paired delta >= 0), or credibly more
    accurate (delta interval above 0) at no higher latency (ratio <= 1). Between identical routings the
    point rule (``point_dominating``) flips with run-to-run noise; this does not."""
    return [name for name, v in paired.items()
            if (v["latency_ratio_ci_high"] < 1.0 and v["accuracy_delta"] >= 0.0)
            or (v["accuracy_delta_ci_low"] > 0.0 and v["latency_ratio"] <= 1.0)]


def versus(rows: Sequence[dict], who: str = "scheduler") -> dict[str, dict]:
    """Each other strategy that ran against ``who``, paired on the workflows both ran (same tasks):
    ``latency_ratio`` — the geometric mean of its end-to-end seconds over ``who``'s, workflow by
    workflow (< 1: faster) — and ``accuracy_delta`` (its score minus ``who``'s), each with a 95% BCa
    interval. A point-rule dominance (``point_dominating``) whose latency interval spans 1 is run-to-run noise.
    Workflows of one interleaved round ran side by side under the same conditions, so they are not
    independent: the interval resamples rounds (their mean log ratio and delta), ``units`` says how many;
    records without a shared round are their own units."""
    me = next((r for r in rows if r["name"] == who and r["run"] and r.get("records")), None)
    if me is None:
        return {}
    mine = {r["task"]: r for r in me["records"]}
    out = {}
    for row in rows:
        if row["name"] == who or not row["run"] or not row.get("records"):
            continue
        pairs = [(r, mine[r["task"]]) for r in row["records"] if r["task"] in mine]
        if len(pairs) < 2:
            continue
        units: dict[object, list[tuple[float, float]]] = {}  # round (interleaved runs) or workflow: its pairs
        for i, (a, b) in enumerate(pairs):
            same = a.get("round") is not None and a.get("round") == b.get("round")
            units.setdefault(("round", a["round"]) if same else ("workflow", i), []).append(
                (float(np.log(a["e2e_s"] / b["e2e_s"])), a["score"] - b["score"]))
        if len(units) < 2:
            continue
        lr = bca_ci([float(np.mean([x for x, _ in u])) for u in units.values()], seed=0)
        acc = bca_ci([float(np.mean([y for _, y in u])) for u in units.values()], seed=0)
        out[row["name"]] = {"workflows": len(pairs), "units": len(units), "latency_ratio": float(np.exp(lr.estimate)),
                            "latency_ratio_ci_low": float(np.exp(lr.low)), "latency_ratio_ci_high": float(np.exp(lr.high)),
                            "accuracy_delta": acc.estimate, "accuracy_delta_ci_low": acc.low,
                            "accuracy_delta_ci_high": acc.high}
    return out


# -- peers ---------------------------------------------------------------------------------------
# -- the benchmark ---------------------------------------------------------------------------------
def workflow_tasks(config: ServeBenchConfig) -> list[Task]:
    """``config.workflows`` tasks per regime; with both, private and shared workflows alternate."""
    from kvrelay.audit.tasks import load_tasks

    by = {"private": lambda: generate(config.workflows, config.seed, doc_tokens=config.doc_tokens),
          "shared": lambda: load_tasks(SHARED_SET, limit=config.workflows)}
    lists = [by[r]() for r in config.regimes]
    return [t for group in zip(*lists, strict=True) for t in group]


def bench_serve(config: ServeBenchConfig, *, progress: Callable[[str], None] = lambda s: None,
                checkpoint: Callable[[dict], None] = lambda res: None) -> dict:
    """Every strategy of ``config`` on the same workflows. ``checkpoint`` receives the result so far after
    each strategy (the CLI writes it, so a long run that stops keeps what it measured)."""
    import httpx

    from kvrelay.serve.server import Gateway, ServeConfig

    tasks = workflow_tasks(config)
    rows: dict[str, dict] = {}
    serve_cfg = ServeConfig(models=config.models, port=0, store="memory://bench-serve", max_tokens=config.max_tokens,
                            limit_max_tokens=max(config.max_tokens, 2048), threads=config.threads,
                            engine=config.engine, slo_s=config.slo_s, audits=config.audits, batch=config.batch,
                            replicas=config.replicas)
    wanted = [s for s in KVRELAY_STRATEGIES if s in config.strategies]
    gateway = Gateway(serve_cfg)
    with gateway as url:
        pool = gateway.scheduler.pool
        by_size = sorted(pool.models, key=lambda m: pool.replicas[m][0].params)
        small, large = by_size[0], by_size[-1]
        turn = itertools.cycle(pool.models)
        lock = threading.Lock()

        def rr() -> str:
            with lock:
                return next(turn)

        routes = {"scheduler": Route(url, lambda: "auto", True, config.slo_s), "round_robin": Route(url, rr, True),
                  "always_smallest": Route(url, lambda: small, True), "always_largest": Route(url, lambda: large, True),
                  "always_text": Route(url, lambda: large, False)}
        if wanted:
            progress("warming up: one untimed workflow per model")
            for m in pool.models:
                warm_up(Route(url, lambda m=m: m, True), config)
        done: dict[str, tuple[list[dict], float, float, float]] = {}  # name: (records, wall, load before, after)
        step = config.clients  # a round: each strategy answers `clients` workflows at once
        rounds = [tasks[i:i + step] for i in range(0, len(tasks), step)] if wanted else []
        if wanted:
            progress(f"{', '.join(wanted)}: {len(tasks)} workflows each in {len(rounds)} interleaved rounds, "
                     f"{config.clients} clients")
        for k, chunk in enumerate(rounds):
            for name in wanted[k % len(wanted):] + wanted[:k % len(wanted)]:  # the order rotates round by round
                for r in pool.all():  # with --batch, no strategy may take pages an earlier one left cached
                    if getattr(r, "batcher", None) is not None:
                        r.batcher.drop_cached_pages()
                before = load1()
                records, wall = run_strategy(routes[name], chunk, config.clients, config.max_tokens, config.single)
                records = [r | {"round": k} for r in records]
                had, w, b, _ = done.get(name, ([], 0.0, before, before))
                done[name] = (had + records, w + wall, b, load1())
            for name in wanted:
                records, wall, b, a = done[name]
                rows[name] = summarize(name, records, wall, (b, a)) | {"records": records}
            progress(f"round {k + 1}/{len(rounds)} done")
            checkpoint(_result(config, rows, small, large) | {"complete": False})
    folder = model_folder(large)
    peers = [("transformers_serve", None, lambda: transformers_serve(folder, config.peer_threads)),
             ("vllm", vllm_available(), lambda: vllm_serve(folder, large, config.peer_threads))]
    for peer, missing, command in peers:
        names = [n for n in STRATEGIES if n.startswith(peer) and n in config.strategies]
        if names and (folder is None or missing):
            for n in names:
                rows[n] = not_run(n, missing or f"{large} is not a model folder")
            continue
        for n in names:  # a fresh server per strategy: no prefix cache carries documents between strategies
            progress(f"{n}: starting {peer} on {large}")
            server = PeerServer(command())
            try:
                t0 = time.perf_counter()
                with server as peer_url:
                    started = time.perf_counter() - t0
                    progress(f"{n}: {config.workflows} workflows, {config.clients} clients")
                    rows[n] = _peer_strategy(n, peer_url, folder, large, tasks, config) | {"peer_start_s": started}
                    checkpoint(_result(config, rows, small, large) | {"complete": False})
            except (PeerUnavailable, httpx.HTTPError) as err:  # reported, not fatal: kvrelay's figures stand alone
                why = f"{type(err).__name__}: {err}" + (f"; {server.died()}" if server.died() else "") + \
                    f"; its log ends: {server.log_tail(300)!r}"
                rows.setdefault(n, not_run(n, why))
    return _result(config, rows, small, large)


def peer_route(name: str, url: str, served: str) -> Route:
    """How peer strategy ``name`` writes its requests: standard fields only, text hand-offs as a re-sent
    conversation for the ``…_prefix_arranged`` strategies, as each agent's own prompt otherwise."""
    return Route(url, lambda: served, False, extensions=False,
                 prompts="conversation" if name.endswith(ARRANGED) else "roles")


def _peer_strategy(name: str, url: str, folder: Path, large: str, tasks: Sequence[Task],
                   config: ServeBenchConfig) -> dict:
    """One peer strategy's row: text hand-offs through the peer at ``url`` (only standard request fields)."""
    import httpx

    vllm = name.startswith("vllm")
    served = large if vllm else str(folder)  # transformers serve answers to the folder it loaded
    route = peer_route(name, url, served)
    warm_up(route, config)
    counts = prefix_cache_counts(httpx.get(url + "/metrics", timeout=10).text) if vllm else None
    before = load1()
    records, wall = run_strategy(route, tasks, config.clients, config.max_tokens, config.single)
    load = (before, load1())
    for r in records:  # name the zoo model, not a local path the peer echoes
        for st in r["steps"]:
            st["model"] = large
    row = summarize(name, records, wall, load) | {"records": records, "model": large}
    if counts is not None:
        after = prefix_cache_counts(httpx.get(url + "/metrics", timeout=10).text)
        queries, hits = after["queries"] - counts["queries"], after["hits"] - counts["hits"]
        row |= {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else None}
    return row


def _result(config: ServeBenchConfig, rows: dict[str, dict], small: str, large: str) -> dict:
    ordered = [rows[s] for s in STRATEGIES if s in rows]
    loads = [x for r in ordered if r["run"] for x in (r["load1_before"], r["load1_after"])]
    paired = versus(ordered)
    point_by = point_dominating(ordered)
    beaten_by = dominating(ordered, paired, point_by)
    return {"strategies": ordered, "scheduler_dominated": bool(beaten_by), "dominated_by": beaten_by,
            "scheduler_point_dominated": bool(point_by), "point_dominated_by": point_by, "versus_scheduler": paired,
            "complete": True,
            "models": list(config.models), "smallest": small, "largest": large, "workflows": config.workflows,
            "clients": config.clients, "agents": 1 if config.single else 3, "engine": config.engine, "batch": config.batch,
            "replicas": config.replicas,
            "doc_tokens": config.doc_tokens, "max_tokens": config.max_tokens,
            "slo_s": config.slo_s, "seed": config.seed, "warm_up": True, "audits": [str(a) for a in config.audits],
            "regimes": list(config.regimes),
            "task_set": ", ".join({"private": "gen (private regime)", "shared": f"{SHARED_SET} (shared regime)"}[r]
                                  for r in config.regimes),
            "load_average": load_status(loads, config.cores) if loads else None}
