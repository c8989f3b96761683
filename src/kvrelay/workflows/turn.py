"""One agent's turn, the same in every executor: answer, then account for what it read and wrote.

``take_turn`` runs ``Agent.respond`` on a relayed payload (``cache``) or on token ids (``base``,
re-encoded: the text channel), checks that the payload it returns holds exactly the turn's token
sequence (``turn_ids``), and returns a ``TurnOut``: the answer, the token counts and the time
split the way a transport splits it (see ``workflows.run``). Executors add only how a payload
reaches the agent and leaves it (``get_s`` / ``put_s``): nothing for in-process hand-over, the
object store for Ray actors, a store for worker processes and store-backed in-process runs — those two
share ``store_turn``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvrelay.agents.agent import Agent
from kvrelay.core.errors import OverBudget, StoreError
from kvrelay.kv.payload import KVPayload
from kvrelay.kv.sign import Key, Keyring
from kvrelay.transport.bytestore import ByteStore
from kvrelay.transport.stores import get_payload_sized, put_payload


@dataclass(frozen=True, slots=True)
class TurnOut:
    """What a turn produced; ``payload`` is the executor's handle on the whole-turn cache (or None)."""

    text: str
    token_ids: tuple[int, ...]  # answer tokens (stop token excluded)
    ids: tuple[int, ...]  # the whole turn's token sequence (what its cache holds)
    input_tokens: int
    prefill_tokens: int
    relayed_tokens: int
    prefill_s: float
    decode_s: float
    relay_bytes: int  # bytes of the payload it received as they travelled (0 without one)
    relay_encode_s: float
    relay_decode_s: float
    get_s: float = 0.0  # the executor's fetch of the relayed payload
    put_s: float = 0.0  # the executor's hand-off of the produced payload
    put_error: str = ""  # why the produced payload could not be stored, "KIND: message" (StoreError or
    # OverBudget: the store's byte budget refused it); "" = it was stored
    payload: Any = field(default=None, repr=False)

    def to_json(self) -> dict:
        """Every field but ``payload`` (the handle) as JSON-ready values."""
        d = {f: getattr(self, f) for f in self.__slots__ if f != "payload"}
        return d | {"token_ids": list(self.token_ids), "ids": list(self.ids)}

    @classmethod
    def from_json(cls, d: dict, payload: Any = None) -> TurnOut:
        return cls(**{**d, "token_ids": tuple(d["token_ids"]), "ids": tuple(d["ids"])}, payload=payload)

    def with_handle(self, payload: Any, put_s: float = 0.0, get_s: float | None = None) -> TurnOut:
        return replace(self, payload=payload, put_s=put_s, get_s=self.get_s if get_s is None else get_s)


def turn_ids(agent: Agent, prompt: str, base: Sequence[int], layout: str, answer: Sequence[int]) -> list[int]:
    """The tokens an agent's cache holds after its turn; equals the returned payload's ``token_ids``."""
    if layout == "replace":
        head = agent.system_ids() + list(base) + agent.prompt_ids(prompt, with_role=False)
    else:
        head = list(base) + agent.prompt_ids(prompt)
    return head + list(answer) + agent.encode(agent.fmt.assistant_end)


def take_turn(agent: Agent, prompt: str, base: Sequence[int], cache: KVPayload | None, layout: str, *,
              max_new_tokens: int, min_new_tokens: int = 0, want_payload: bool = False,
              get_s: float = 0.0, relay_bytes: int | None = None) -> TurnOut:
    """``agent`` answers ``prompt`` continuing ``cache`` (a relayed payload) or re-encoding ``base``.

    The returned ``TurnOut.payload`` is the agent's whole-turn ``KVPayload`` when ``want_payload``
    (an executor swaps in its own handle), else None. ``get_s``: what fetching ``cache`` cost;
    ``relay_bytes``: the bytes it travelled as (None: handed over as the object, ``cache.nbytes``).
    """
    arg = cache if cache is not None else torch.tensor(list(base), dtype=torch.int64)
    t1 = time.perf_counter()
    r = agent.respond(prompt, arg, layout=layout, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                      return_payload=want_payload)
    t2 = time.perf_counter()
    ids = turn_ids(agent, prompt, base, layout, r.token_ids)
    if r.payload is not None and r.payload.token_ids[0].tolist() != ids:
        raise RuntimeError(f"{agent.name}: payload tokens differ from the turn's token sequence")
    prefix = len(agent.system_ids()) if (cache is not None and layout == "replace") else 0
    encode_s = (t2 - t1 - r.cache_build_s - r.prefill_s - r.decode_s) if r.payload is not None else 0.0
    return TurnOut(text=r.text, token_ids=tuple(r.token_ids), ids=tuple(ids),
                   input_tokens=r.prefill_tokens + r.relayed_tokens + prefix, prefill_tokens=r.prefill_tokens + prefix,
                   relayed_tokens=r.relayed_tokens, prefill_s=r.prefill_s, decode_s=r.decode_s,
                   relay_bytes=(cache.nbytes if relay_bytes is None else relay_bytes) if cache is not None else 0,
                   relay_encode_s=max(encode_s, 0.0),
                   relay_decode_s=r.cache_build_s if cache is not None else 0.0, get_s=get_s, payload=r.payload)


def store_turn(agent: Agent, store: ByteStore, prompt: str, base: Sequence[int], key: str | None, layout: str, *,
               codec: str, out_key: str, max_new_tokens: int, min_new_tokens: int = 0,
               want_payload: bool = False, keys: Keyring | None = None, signer: Key | None = None) -> TurnOut:
    """A turn whose payloads travel through ``store``: the relayed one is read under ``key`` (None: the text
    channel), the produced one is put under ``out_key`` with ``codec``, and the result's handle is that key.

    ``relay_bytes`` is what the sender's put wrote (the bytes read back: fp16 or int8 sizes, not the
    decoded fp32 cache's); ``get_s`` / ``put_s`` time the store's read and write. ``keys`` verifies the
    relayed payload's signature, ``signer`` signs the produced one (``kv.sign``). A payload over the agent's
    byte budget is refused from its header, before it is decoded (``OverBudget``).
    """
    cache, get_s, nbytes = None, 0.0, 0
    if key is not None:
        t0 = time.perf_counter()
        cache, nbytes = get_payload_sized(store, key, expect=agent.identity, keys=keys, admit=agent.admit)
        get_s = time.perf_counter() - t0
    out = take_turn(agent, prompt, base, cache, layout, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                    want_payload=want_payload, get_s=get_s, relay_bytes=nbytes)
    if out.payload is None:
        return out
    t0 = time.perf_counter()
    try:
        put_key = put_payload(store, out.payload, codec, key=out_key, model=agent.model, signer=signer)
    except (StoreError, OverBudget) as e:  # the turn stands; its payload is not stored (none is left behind)
        return replace(out.with_handle(None, put_s=time.perf_counter() - t0), put_error=f"{type(e).__name__}: {e}")
    return out.with_handle(put_key, put_s=time.perf_counter() - t0)
