"""``Agent.system_ids``: the role's system turn encoded once per format and role, the same tokens every caller
(reading, the replace layout's prefix, the workflow's turn ids, the audit's wrapper) would encode."""

from __future__ import annotations

from kvrelay.agents.agent import Agent
from kvrelay.audit.runner import wrapper_ids
from kvrelay.models.prompt import format_for
from kvrelay.workflows.turn import turn_ids


def test_system_ids_are_the_role_turn_encoded_once_per_role(tiny):
    a = Agent(tiny, "a", role="answer the question now")
    own = a.encode(a.fmt.system(a.role))
    calls = []
    real = a.encode
    a.encode = lambda text: (calls.append(text), real(text))[1]  # counts, then encodes as before
    assert own and a.system_ids() == own
    a.system_ids().append(-1)  # a caller's list is its own
    assert a.system_ids() == own and calls == [a.fmt.system(a.role)]
    a.role = "read the report"  # another role: encoded again
    assert a.system_ids() == real(a.fmt.system("read the report")) != own
    a.role = ""
    assert a.system_ids() == [] and a.reading_ids("x") == real(a.fmt.user("x"))


def test_callers_use_the_same_tokens(tiny):
    a = Agent(tiny, "a", role="answer the question now", fmt=format_for(tiny.tokenizer))
    own = a.encode(a.fmt.system(a.role))
    assert a.reading_ids("doc") == own + a.encode(a.fmt.user("doc"))
    head, _ = wrapper_ids(a)
    assert head[:len(own)] == own
    ids = turn_ids(a, "q", [11, 12], "replace", [13])
    assert ids == own + [11, 12] + a.prompt_ids("q", with_role=False) + [13] + a.encode(a.fmt.assistant_end)
