"""``DraftModel``: a smaller model of the receiver's tokenizer that drafts tokens for speculative decoding.

The sender ships the draft model's payload of the relayed tokens beside the target's, so neither
model prefills the context: ``Agent.respond(prompt, target_payload, speculate=DraftModel(draft_lm,
draft_payload))``. The draft's payload is checked like any relayed payload (its own model's
fingerprint, tokenizer, geometry) and must hold the same tokens at the same positions as the
start of what the receiver's cache holds; without one the draft reads the whole history itself.
Drafting only proposes: the target verifies every token (``models.speculative``), so the output
is the target's own greedy output whatever the draft writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvrelay.agents.receive import RoundBook, receive
from kvrelay.core.errors import IncompatiblePayload
from kvrelay.kv.cache import to_cache
from kvrelay.kv.payload import KVPayload
from kvrelay.models.speculative import ModelDrafter, check_draft_lengths


@dataclass(frozen=True, eq=False, slots=True)
class DraftModel:
    lm: object  # ``LoadedModel`` of the draft
    payload: KVPayload | None = None  # the draft's cache of the relayed tokens (one row)
    num_draft: int = 4  # most tokens drafted per verify forward
    min_draft: int = 1  # fewest tokens drafted per verify forward (``models.speculative``)

    def __post_init__(self):
        check_draft_lengths(self.min_draft, self.num_draft)
        if self.payload is not None and self.payload.batch_size != 1:
            raise ValueError("a draft payload holds one row")

    def drafter(self, lm, history: Sequence[int], next_position: int) -> ModelDrafter:
        """A drafter for a receiver on ``lm`` whose cache holds ``history``, next token at ``next_position``."""
        if not same_vocabulary(lm, self.lm):
            raise IncompatiblePayload("vocabulary", lm.identity.tokenizer_hash, self.lm.identity.tokenizer_hash,
                                      "a draft model must share the receiver's token ids (its tokens are verified "
                                      "by the receiver as they are)")
        origin = next_position - len(history)
        model = self.lm.model
        if self.payload is None:
            from transformers import DynamicCache

            return ModelDrafter(model, DynamicCache(config=model.config), 0, origin, self.num_draft, self.min_draft)
        p = receive(self.payload, self.lm.identity, RoundBook())
        held = p.token_ids[0].tolist()
        if held != list(history[: len(held)]) or int(p.positions[0, 0]) != origin or not bool(p.mask.all()):
            raise IncompatiblePayload("token_ids", "the first tokens of the receiver's cache at the same positions",
                                      f"{len(held)} other tokens from position {int(p.positions[0, 0])}",
                                      "the draft's payload must encode the relayed tokens the target's does")
        return ModelDrafter(model, to_cache(p, model.config), len(held), origin, self.num_draft, self.min_draft)


@lru_cache(maxsize=8)
def same_vocabulary(a, b) -> bool:
    """Whether two loaded models map token ids to the same strings (chat templates may differ: drafts are ids)."""
    if a.identity.tokenizer_hash == b.identity.tokenizer_hash:
        return True
    ta, tb = a.tokenizer, b.tokenizer
    return ta.get_vocab() == tb.get_vocab() and ta.all_special_ids == tb.all_special_ids
