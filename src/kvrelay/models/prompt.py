"""How an agent's turns become tokens.

Segments are tokenized one by one and concatenated, so a relayed payload's ``token_ids`` plus
the receiver's own segments are exactly the sequence a text re-encode would prefill: the two
paths see identical tokens, which is what makes relay exactness testable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """Turn wrappers. ``chatml`` for instruct models (Qwen2.5, SmolLM2), ``plain`` for base models."""

    name: str
    system_tpl: str
    user_tpl: str
    assistant_start: str
    assistant_end: str
    stop_strings: tuple[str, ...]

    def system(self, text: str) -> str:
        return self.system_tpl.format(text=text) if text else ""

    def user(self, text: str) -> str:
        return self.user_tpl.format(text=text)


CHATML = PromptFormat(
    name="chatml",
    system_tpl="<|im_start|>system\n{text}<|im_end|>\n",
    user_tpl="<|im_start|>user\n{text}<|im_end|>\n",
    assistant_start="<|im_start|>assistant\n",
    assistant_end="<|im_end|>\n",
    stop_strings=("<|im_end|>", "<|endoftext|>"),
)

PLAIN = PromptFormat(
    name="plain",
    system_tpl="{text}\n\n",
    user_tpl="{text}\n\n",
    assistant_start="Answer:",
    assistant_end="\n\n",
    stop_strings=("\n\n",),
)


def format_for(tokenizer) -> PromptFormat:
    """ChatML when the tokenizer knows ``<|im_start|>`` as one token, else plain text."""
    vocab = tokenizer.get_vocab()
    return CHATML if "<|im_start|>" in vocab and "<|im_end|>" in vocab else PLAIN
