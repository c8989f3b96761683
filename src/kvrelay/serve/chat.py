"""Chat messages -> the tokens a model prefills.

Each message is one segment of the model's prompt format (``models.prompt``), tokenized on its own
and concatenated, so the tokens of a conversation are the tokens of its first turns followed by
those of the rest. That is what lets a request continue a relayed cache of the first turns and
prefill only its own messages, and compute exactly what re-sending the whole text computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.core.errors import InvalidInput

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}  # the newer OpenAI name for a system message


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # one of ROLES
    content: str

    def __post_init__(self):
        if self.role not in ROLES:
            raise InvalidInput(f"message role {self.role!r}", f"one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise InvalidInput(f"message content of type {type(self.content).__name__}", "a string")

    def to_json(self) -> dict:
        return {"role": self.role, "content": self.content}

    @classmethod
    def from_json(cls, d: dict) -> Message:
        return cls(d["role"], d["content"])


def message_ids(agent, m: Message) -> list[int]:
    """The tokens of one message in ``agent``'s prompt format."""
    fmt = agent.fmt
    if m.role == "system":
        return agent.encode(fmt.system(m.content))
    if m.role == "user":
        return agent.encode(fmt.user(m.content))
    return agent.encode(fmt.assistant_start) + agent.encode(m.content) + agent.encode(fmt.assistant_end)


def conversation_ids(agent, messages: Sequence[Message]) -> list[int]:
    """The tokens of ``messages``, segment by segment (a prefix of messages gives a prefix of tokens)."""
    return [t for m in messages for t in message_ids(agent, m)]


def answer_start_ids(agent) -> list[int]:
    """What follows the conversation so that the model writes the assistant's answer."""
    return agent.encode(agent.fmt.assistant_start)
