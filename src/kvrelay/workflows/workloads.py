"""Built-in multi-agent workloads (code review, document pipeline, support dialogue, hierarchy), over real text cut to a token budget.

* ``review3``   — static analysis -> logic check -> fix proposal on real stdlib source code.
* ``doc5``      — five agents in a line over one long document (the Python Language Reference).
* ``dialogue``  — a support conversation (customer and support take turns, then a ticket note)
  over a long shared knowledge base.
* ``hierarchy`` — planner -> three workers -> aggregator over one long document.

The text is read at run time from what ships with Python (``kvrelay.core.corpus``). One line with a
known answer (an internal reference number drawn from ``seed``) is placed in the middle of the
context; the last agent is asked to state it, so a run also yields an exact-match score — the
yardstick for the replace layout's quality cost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvrelay.core import corpus
from kvrelay.workflows.spec import AgentSpec, Workflow, chain, hierarchy

MAX_NEW_TOKENS = 32  # each agent may write this many tokens
BENCH_NEW_TOKENS = 32  # benchmarks only (bench.pipeline.fixed_length): every agent writes exactly this many
FACT_QUESTION = "Finally, state the internal reference number given in the document."


@dataclass(frozen=True, slots=True)
class Workload:
    workflow: Workflow
    context: str  # the shared context, real text with the fact line in it
    fact: str  # the known answer the last agent is asked for
    source: str  # prose | code

    @property
    def name(self) -> str:
        return self.workflow.name

    def fact_first(self) -> Workload:
        """The last agent asked for the fact *before* its task, so short answers still reach it."""
        last = self.workflow.agents[-1]
        task = last.prompt.replace(FACT_QUESTION, "").strip()
        asked = replace(last, prompt=f"First state the internal reference number given in the document. Then: {task}")
        return replace(self, workflow=replace(self.workflow, agents=(*self.workflow.agents[:-1], asked)))

    def fact_found(self, answer: str) -> bool:
        """Exact match: the reference number appears verbatim in the answer."""
        return self.fact in answer


def _a(name: str, role: str, prompt: str) -> AgentSpec:
    return AgentSpec(name, role, prompt, max_new_tokens=MAX_NEW_TOKENS)


def review3() -> Workflow:
    return chain("review3", [
        _a("static", "You are a static-analysis tool for Python code.",
           "List concrete static-analysis findings for the code above: unused names, shadowed "
           "built-ins, missing error handling. Cite function names."),
        _a("logic", "You are a senior engineer reviewing program logic.",
           "Check the logic of the code and the findings so far. Name one function whose behaviour on "
           "edge cases is questionable and explain why."),
        _a("fix", "You propose minimal, safe fixes.",
           "Propose a concrete fix for the most important problem found above, as a short code change. "
           + FACT_QUESTION),
    ], description="code review: static analysis -> logic check -> fix proposal")


def doc5() -> Workflow:
    return chain("doc5", [
        _a("outline", "You are a technical editor.", "List the main topics the document covers."),
        _a("terms", "You are a glossary writer.", "Define three technical terms used in the document."),
        _a("examples", "You are a Python teacher.",
           "Give a short Python example that illustrates one rule from the document."),
        _a("critic", "You are a careful fact checker.",
           "Point out anything in the notes above that is inaccurate or incomplete."),
        _a("summary", "You write summaries for newcomers.",
           "Write a short summary of the document for a newcomer. " + FACT_QUESTION),
    ], description="five-agent document pipeline over one long document")


def dialogue() -> Workflow:
    customer = "You are a customer writing to the support desk of a Python training company."
    support = "You are the support agent; answer from the knowledge base above."
    return chain("dialogue", [
        _a("customer1", customer, "Write your first question to support about something in the knowledge base."),
        _a("support1", support, "Answer the customer's question."),
        _a("customer2", customer, "Write a follow-up question about the answer you got."),
        _a("support2", support, "Answer the follow-up question."),
        _a("ticket", "You close support tickets.",
           "Write the ticket note: the customer's problem and the resolution. " + FACT_QUESTION),
    ], description="multi-turn support conversation over a long shared knowledge base")


def hierarchy5() -> Workflow:
    workers = [_a(f"worker{i}", "You are an analyst who carries out one sub-task of a plan.",
                  f"Carry out sub-task {i} of the plan above.") for i in (1, 2, 3)]
    return hierarchy(
        "hierarchy",
        _a("planner", "You are a planner who splits work among three analysts.",
           "Split the analysis of the document into three sub-tasks, numbered 1 to 3, one line each."),
        workers,
        _a("aggregator", "You combine the analysts' reports into one answer.",
           "Combine the reports into one short answer. " + FACT_QUESTION),
        description="planner -> three workers -> aggregator over one long document")


WORKLOADS = {"review3": (review3, "code"), "doc5": (doc5, "prose"), "dialogue": (dialogue, "prose"),
             "hierarchy": (hierarchy5, "prose")}
HEADERS = {"code": "Code under review:\n\n", "prose": "Document:\n\n"}


def fill_context(tokenizer, n_tokens: int, source: str, fact_line: str, offset: int = 0) -> str:
    """Real ``source`` text (whole lines) with ``fact_line`` in the middle, about ``n_tokens`` tokens long."""
    if n_tokens < 16:
        raise ValueError(f"context_tokens must be >= 16, got {n_tokens}")
    text = corpus.code(offset) if source == "code" else corpus.prose(offset)
    lines = text.splitlines(keepends=True)
    budget = n_tokens - _count(tokenizer, HEADERS[source] + fact_line + "\n")
    kept, used = [], 0
    for line in lines:
        n = _count(tokenizer, line)
        if used + n > budget:
            break
        kept.append(line)
        used += n
    mid = len(kept) // 2
    blank = [i for i in range(mid, len(kept)) if not kept[i].strip()]  # land between blocks when possible
    mid = blank[0] + 1 if blank else mid
    body = "".join(kept[:mid]) + fact_line + "\n" + "".join(kept[mid:])
    return HEADERS[source] + body


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_workload(name: str, tokenizer, context_tokens: int, *, seed: int = 0, layout: str | None = None,
                   workflow: Workflow | None = None, source: str | None = None) -> Workload:
    """A built-in workload (or ``workflow`` from TOML, named ``name``) over ~``context_tokens`` of real text."""
    if workflow is None:
        if name not in WORKLOADS:
            raise KeyError(f"unknown workload {name!r}; built-in: {', '.join(WORKLOADS)} (or a .toml file)")
        make, default_source = WORKLOADS[name]
        workflow = make()
    else:
        default_source = "prose"
    src = source or default_source
    if src not in HEADERS:
        raise ValueError(f"source must be one of {sorted(HEADERS)}, got {src!r}")
    fact = str(random.Random(seed).randint(10_000, 99_999))
    line = (f"# Internal reference number of this code: {fact}" if src == "code"
            else f"(Internal reference number of this document: {fact}.)")
    context = fill_context(tokenizer, context_tokens, src, line, offset=seed)
    if layout is not None:
        workflow = workflow.with_layout(layout)
    return Workload(workflow, context, fact, src)
