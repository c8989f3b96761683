"""``Agent``: a model plus a role, that reads text into a payload and responds with or without one.

Two position layouts for a relayed payload (docs/architecture.md):

* ``continue`` — the receiver's tokens follow the relayed ones at the next positions (one
  global position counter across agents). Exact: the receiver computes what it would have
  computed by prefilling the relayed tokens itself.
* ``replace`` — the receiver keeps its own prefix (its role prompt at positions 0..S-1) and the
  payload is moved behind it by RoPE re-rotation. Positions are exact; content is not, because
  the relayed K/V never attended to the receiver's prefix. Its quality cost is measured, not assumed;
  ``respond(..., layout="replace", repair="recompute:tokens=F")`` recomputes the fraction ``F`` of
  relayed tokens whose K/V deviate most once they attend to the prefix (``fuse.repair``).

A receiver never uses a payload it cannot prove compatible (same model fingerprint, tokenizer,
format, every layer held) or one older than what it already holds from that producer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from kvrelay.agents.receive import RoundBook, RoundRules, admit, receive, receiver_budget
from kvrelay.agents.verify import VerifySpec, require_verified
from kvrelay.fuse.adapter import Adapter
from kvrelay.fuse.repair import RepairSpec, parse_repair, selective_recompute
from kvrelay.kv.cache import from_cache, to_cache, to_layered_cache
from kvrelay.kv.payload import KVPayload, PayloadMeta
from kvrelay.kv.transforms import concat, pad_batch, shift_positions
from kvrelay.models.attention import tail_aligned_attention
from kvrelay.models.engine import mode
from kvrelay.models.generate import forward_last, generate
from kvrelay.models.prompt import PromptFormat, format_for
from kvrelay.models.sampling import Sampler
from kvrelay.models.speculative import SpecStats
from kvrelay.transport.budget import ByteBudget

LAYOUTS = ("continue", "replace")  # where a relayed cache sits: docs/layouts.md
READER_ROLE = "You are a careful reader. Read the document."  # the sender of `kvrelay relay` / `kvrelay read`
Context = KVPayload | str | Sequence[int] | torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Response:
    text: str
    token_ids: tuple[int, ...]  # generated, stop token excluded
    prefill_tokens: int  # tokens this agent prefilled (context re-encode + its own prompt)
    relayed_tokens: int  # tokens that arrived as a cache (0 for text)
    ttft_s: float  # cache build + prefill (the first token is the argmax of the prefill's logits)
    cache_build_s: float
    prefill_s: float
    decode_s: float
    layout: str
    payload: KVPayload | None = field(default=None, repr=False)  # state after answering, when asked for
    speculation: SpecStats | None = None  # drafts proposed and kept, when decoded speculatively


class Agent:
    """One role on one loaded model. State: a round counter and the rounds it holds per producer.

    ``budget`` (a ``ByteBudget``, policy ``refuse``): the most decoded bytes of relayed payloads one call
    holds at once (``agents.receive.admit``); a payload that would exceed it is ``OverBudget`` before it
    is checked further or used. It keeps no payload between calls, so there is nothing to evict."""

    def __init__(self, lm, name: str = "agent", role: str = "", *, max_new_tokens: int = 64,
                 fmt: PromptFormat | None = None, adapter: Adapter | None = None,
                 round_rules: RoundRules | None = None, verify: VerifySpec | None = None,
                 budget: ByteBudget | None = None):
        self.lm = lm
        self.model = lm.model
        self.tokenizer = lm.tokenizer
        self.identity = lm.identity
        self.name = name
        self.role = role
        self.max_new_tokens = max_new_tokens
        self.fmt = fmt or format_for(self.tokenizer)
        self.round = 0
        self.adapter = adapter  # maps payloads of other models (kvrelay.fuse); None: same model only
        self._rounds = RoundBook(round_rules or RoundRules())  # what it accepts of each producer's rounds
        self.verify = verify  # recompute part of every payload of its own model before using it (agents.verify)
        self.budget = receiver_budget(budget)
        self.stop_ids = self._stop_ids()
        self._system: tuple[tuple[PromptFormat, str], tuple[int, ...]] | None = None  # system_ids, per format and role

    # -- tokens ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _stop_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        vocab = self.tokenizer.get_vocab()
        ids |= {vocab[s] for s in self.fmt.stop_strings if s in vocab}
        if self.fmt.name == "plain":
            ids |= {i for i in self.encode("\n\n")[-1:]}
        return ids

    def system_ids(self) -> list[int]:
        """Tokens of this agent's role as a system turn (none without a role): what it reads first and the
        prefix it keeps in the replace layout. Encoded once per format and role."""
        key = (self.fmt, self.role)
        if self._system is None or self._system[0] != key:
            self._system = (key, tuple(self.encode(self.fmt.system(self.role))))
        return list(self._system[1])

    def reading_ids(self, text: str) -> list[int]:
        """Tokens of this agent reading ``text``: its role as system prompt, then the text as a user turn."""
        return self.system_ids() + self.encode(self.fmt.user(text))

    def prompt_ids(self, prompt: str, *, with_role: bool = True) -> list[int]:
        """Tokens this agent appends to answer ``prompt`` (role folded into the turn in the continue layout)."""
        body = f"{self.role}\n\n{prompt}" if (with_role and self.role) else prompt
        return self.encode(self.fmt.user(body)) + self.encode(self.fmt.assistant_start)

    # -- producing payloads ------------------------------------------------------------------
    def meta(self) -> PayloadMeta:
        return PayloadMeta.from_identity(self.identity, producer=self.name, round=self.round)

    def prefill(self, ids: Sequence[int] | torch.Tensor, *, start: int = 0) -> KVPayload:
        """Encode ``ids`` at positions ``start..`` into a payload (one forward, no generation)."""
        ids_t = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.int64)
        ids_t = ids_t.reshape(1, -1)  # (1, T)
        if ids_t.shape[1] == 0:
            raise ValueError("nothing to prefill: empty token sequence")
        pos = torch.arange(start, start + ids_t.shape[1], dtype=torch.int64)[None]  # (1, T)
        cache = self._empty_cache()
        forward_last(self.model, ids_t, pos, cache, None)
        return from_cache(cache, ids_t, pos, torch.ones_like(ids_t, dtype=torch.bool), self.meta())

    def extend(self, p: KVPayload, ids: Sequence[int]) -> KVPayload:
        """``p`` followed by ``ids`` (prefilled after it at the next positions): only the new tokens cost."""
        if p.batch_size != 1:
            raise ValueError("extend takes a single-row payload")
        if not ids:
            return p
        ids_t = torch.tensor([list(ids)], dtype=torch.int64)  # (1, n)
        pos = int(p.next_positions[0]) + torch.arange(len(ids), dtype=torch.int64)[None]  # (1, n)
        cache = to_cache(p, self.model.config)
        forward_last(self.model, ids_t, pos, cache, None)
        all_ids = torch.cat((p.token_ids, ids_t), 1)
        return from_cache(cache, all_ids, torch.cat((p.positions, pos), 1), torch.ones_like(all_ids, dtype=torch.bool),
                          p.meta)

    def read(self, text: str, *, start: int = 0) -> KVPayload:
        """Read ``text`` (with this agent's role as system prompt) and return the cache as a payload."""
        return self.prefill(self.reading_ids(text), start=start)

    def _empty_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    # -- receiving ---------------------------------------------------------------------------
    def admit(self, *sizes: int) -> None:
        """``OverBudget`` (naming this receiver) unless payloads of these decoded sizes fit its byte budget at
        once; a store's reader calls it with ``kv.wire.decoded_nbytes`` before decoding."""
        admit(sizes, self.budget, f"receiver {self.name!r}")

    def check(self, p: KVPayload, rounds: RoundBook | None = None) -> KVPayload:
        """The payload this agent may attend to — ``p``, or ``p`` through its adapter — or a typed error
        (``OverBudget`` under its byte budget, ``IncompatiblePayload``, ``StalePayload``, ``MissingRound``,
        ``ExpiredPayload``, ``ProducerModelChanged``, ``TamperedPayload`` when it verifies); records its round
        in ``rounds`` (default: the agent's own book; see ``agents.receive``)."""
        book = self._rounds if rounds is None else rounds
        kw = {"now_round": self.round, "budget": self.budget, "where": f"receiver {self.name!r}"}
        if self.verify is None:
            return receive(p, self.identity, book, self.adapter, **kw)
        trial = RoundBook(book.rules, dict(book.held), dict(book.models), {k: set(v) for k, v in book.retired.items()})
        usable = receive(p, self.identity, trial, self.adapter, **kw)
        if usable is p:  # its own model's payload (an adapter's output is approximate by design)
            require_verified(self.model, p, self.verify)
        book.held, book.models, book.retired = trial.held, trial.models, trial.retired  # recorded once verified
        return usable

    def _prefix_payload(self) -> KVPayload | None:
        ids = self.system_ids()
        return self.prefill(ids) if ids else None

    def respond(self, prompt: str, context: Context = None, *, layout: str = "continue",
                max_new_tokens: int | None = None, return_payload: bool = False,
                min_new_tokens: int = 0, repair: str | RepairSpec | None = None, speculate=None) -> Response:
        """Answer ``prompt`` greedily, given a relayed payload, a text context, raw token ids, or nothing.

        * ``KVPayload``: relayed cache (checked, then used in ``layout``).
        * ``str``: a document re-encoded as a user turn before the prompt (the text channel).
        * token ids: re-encoded verbatim — with a payload's ``token_ids`` this is the exact text baseline.

        ``min_new_tokens`` suppresses stop tokens until that many tokens are written (benchmarks).
        ``repair`` (replace layout only): recompute part of the moved payload behind the prefix; its cost
        is part of ``cache_build_s`` and so of ``ttft_s``.
        ``speculate``: decode speculatively, same tokens — ``models.speculative.PromptLookup()`` (drafts from
        the tokens the cache holds and the answer so far) or ``agents.draft.DraftModel`` (a smaller model's).
        """
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if repair is not None and (layout != "replace" or not isinstance(context, KVPayload)):
            raise ValueError("repair applies to a relayed payload in the replace layout; a payload from another "
                             "model is repaired by the receiver's adapter (fuse.repair.repair_adapter)")
        n_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        t0 = time.perf_counter()
        relayed = 0
        if isinstance(context, KVPayload):
            context = self.check(context)
            if context.batch_size != 1:
                raise ValueError("respond takes one payload; use respond_batch for a batch")
            layered = not context.meta.complete  # a partial adapter's output: some layers hold the prefix
            if layered and (layout != "continue" or return_payload or not bool(context.mask.all())):
                raise ValueError("a payload for some layers only (fuse.layers) is read in the continue layout, "
                                 "unpadded, without return_payload")
            if layout == "replace":
                prefix = self._prefix_payload()
                start = prefix.num_tokens if prefix is not None else 0
                moved = shift_positions(context, start - int(context.positions[0, 0]))
                context = concat(prefix, moved) if prefix is not None else moved
                if repair is not None and prefix is not None:
                    spec = parse_repair(repair) if isinstance(repair, str) else repair
                    context, _ = selective_recompute(self.model, context, spec.plan(self.identity.num_layers),
                                                     exact_prefix=start)
                ids = self.prompt_ids(prompt, with_role=False)
            else:
                ids = self.prompt_ids(prompt)
            cache = (to_layered_cache if layered else to_cache)(context, self.model.config)
            relayed = context.num_tokens - (start if layout == "replace" else 0)
            start_pos = int(context.next_positions[0])
            history_ids, history_pos = context.token_ids, context.positions
        else:
            pre = self._context_ids(context)
            if layout == "replace":
                ids = self.system_ids() + pre + self.prompt_ids(prompt, with_role=False)
            else:
                ids = pre + self.prompt_ids(prompt)
            cache = self._empty_cache()
            start_pos = 0
            history_ids = history_pos = None
            layered = False
        return self._answer(cache, ids, start_pos, history_ids, history_pos, build_s=time.perf_counter() - t0,
                            relayed=relayed, layout=layout, max_new_tokens=n_new, min_new_tokens=min_new_tokens,
                            return_payload=return_payload, layered=layered, speculate=speculate)

    def respond_ids(self, ids: Sequence[int], context: KVPayload | None = None, *, max_new_tokens: int | None = None,
                    return_payload: bool = False, on_token: Callable[[torch.Tensor], None] | None = None,
                    rounds: RoundBook | None = None) -> Response:
        """Answer greedily after the raw token ids ``ids`` (already formatted: turns and the assistant
        marker), continuing ``context`` (a relayed payload, checked; continue layout) or from nothing.

        With a payload holding tokens ``P`` this computes what ``respond_ids(P + ids)`` computes (exact).
        ``on_token`` sees every chosen token (a (1,) tensor, stop token included) as it is chosen.
        ``rounds``: the round book the payload is checked against (a stateless server passes a new one per
        request, since its clients may continue any earlier turn); default the agent's own.
        """
        if not ids:
            raise ValueError("nothing to answer: empty token sequence")
        n_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        t0 = time.perf_counter()
        if context is None:
            return self._answer(self._empty_cache(), list(ids), 0, None, None, build_s=time.perf_counter() - t0,
                                relayed=0, layout="continue", max_new_tokens=n_new, return_payload=return_payload,
                                on_token=on_token)
        context = self.check(context, rounds)
        if context.batch_size != 1 or not context.meta.complete or not bool(context.mask.all()):
            raise ValueError("respond_ids continues one unpadded payload holding every layer")
        cache = to_cache(context, self.model.config)
        return self._answer(cache, list(ids), int(context.next_positions[0]), context.token_ids, context.positions,
                            build_s=time.perf_counter() - t0, relayed=context.num_tokens, layout="continue",
                            max_new_tokens=n_new, return_payload=return_payload, on_token=on_token)

    def _answer(self, cache, ids: list[int], start_pos: int, history_ids, history_pos, *, build_s: float, relayed: int,
                layout: str, max_new_tokens: int, min_new_tokens: int = 0, return_payload: bool = False,
                layered: bool = False, on_token=None, speculate=None) -> Response:
        """Prefill ``ids`` at ``start_pos..`` after ``cache`` and decode greedily: the end of every answer."""
        history = drafter = None
        if speculate is not None:  # its set-up (an n-gram index, the draft's cache) is part of the cache build
            t0 = time.perf_counter()
            history = ([] if history_ids is None else history_ids[0].tolist()) + ids
            drafter = speculate.drafter(self.lm, history, start_pos + len(ids))
            build_s += time.perf_counter() - t0
        ids_t = torch.tensor([ids], dtype=torch.int64)  # (1, q)
        pos_t = torch.arange(start_pos, start_pos + len(ids), dtype=torch.int64)[None]  # (1, q)
        with tail_aligned_attention(self.model) if layered else nullcontext():
            out = generate(self.model, cache, ids_t, pos_t, None, max_new_tokens, self.stop_ids,
                           pad_id=self.tokenizer.pad_token_id or 0, min_new_tokens=min_new_tokens,
                           keep_prefill=return_payload and not mode(self.identity.engine).phase_uniform,
                           on_token=on_token, drafter=drafter, history=history)
        n = int(out.lengths[0])
        gen = out.tokens[0, :n].tolist()
        payload = None
        if return_payload:
            payload = self._finish_turn(cache, out, ids_t, pos_t, history_ids, history_pos)
        self.round += 1
        return Response(self.decode(gen), tuple(gen), len(ids), relayed, build_s + out.prefill_s, build_s,
                        out.prefill_s, out.decode_s, layout, payload, out.speculation)

    def _finish_turn(self, cache, out, ids_t, pos_t, history_ids, history_pos) -> KVPayload:
        """The cache holding the whole turn: context, prompt, answer and the end-of-turn marker.

        Where the engine decodes with other weights than it prefills (``models.engine``), the answer's
        K/V are recomputed in one prefill over the cache as it was after the prompt, so the payload
        holds what a reader of the same text computes; otherwise only the tokens the decode loop did
        not feed (the last one and the end marker) are prefilled.
        """
        n = int(out.lengths[0])
        gen = out.tokens[0, : out.tokens.shape[1]].tolist()
        prefix_ids = ids_t if history_ids is None else torch.cat((history_ids, ids_t), 1)
        prefix_pos = pos_t if history_pos is None else torch.cat((history_pos, pos_t), 1)
        if out.prefill_kv is not None:
            fed, tail = [], gen[:n]
            keys, values = zip(*out.prefill_kv, strict=True)
            after_prompt = KVPayload(keys, values, prefix_ids, prefix_pos, torch.ones_like(prefix_ids, dtype=torch.bool),
                                     self.meta())
            cache = to_cache(after_prompt, self.model.config)
        else:
            fed = gen[:-1]  # every generated token but the last went through the model already
            tail = gen[-1:] if n == len(gen) else []  # last token if it was not a stop token
        tail += self.encode(self.fmt.assistant_end)
        start = int(pos_t[0, -1]) + 1 + len(fed)
        tail_t = torch.tensor([tail], dtype=torch.int64).reshape(1, -1)  # (1, t)
        tail_pos = torch.arange(start, start + len(tail), dtype=torch.int64)[None]  # (1, t)
        if tail:
            forward_last(self.model, tail_t, tail_pos, cache, None)
        fed_pos = torch.arange(int(pos_t[0, -1]) + 1, start, dtype=torch.int64)[None]  # (1, len(fed))
        new_ids = torch.cat((prefix_ids, torch.tensor([fed], dtype=torch.int64).reshape(1, -1), tail_t), dim=1)
        new_pos = torch.cat((prefix_pos, fed_pos, tail_pos), 1)
        return from_cache(cache, new_ids, new_pos, torch.ones_like(new_ids, dtype=torch.bool),
                          PayloadMeta.from_identity(self.identity, producer=self.name, round=self.round))

    def respond_batch(self, prompts: Sequence[str], contexts: Sequence[Context], *,
                      max_new_tokens: int | None = None, temperature: float = 0.0,
                      seeds: Sequence[int] | None = None) -> list[Response]:
        """Answer several prompts in one padded batch (continue layout).

        ``contexts`` are either all payloads (each row continues its own relayed cache) or all
        text-like (token ids, a document string, or None: each row prefills its context itself).
        Rows are left-padded; an explicit (B, cached + new) attention mask hides every pad slot.
        ``temperature`` > 0 samples instead of decoding greedily, row ``b`` from its own generator
        seeded with ``seeds[b]`` (``models.sampling.Sampler``): reproducible per row, whatever the batch.
        """
        if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
            raise ValueError(f"sampling at temperature {temperature} needs one seed per prompt")
        if len(prompts) != len(contexts) or not prompts:
            raise ValueError(f"need as many prompts as contexts (got {len(prompts)} and {len(contexts)})")
        relayed = [isinstance(c, KVPayload) for c in contexts]
        if any(relayed) and not all(relayed):
            raise ValueError("a batch mixes relayed payloads and text contexts; split it by channel")
        if all(relayed):
            self.admit(*(c.nbytes for c in contexts))  # the batch's payloads are held at once
            contexts = [self.check(c) for c in contexts]
            ids = [self.prompt_ids(p) for p in prompts]
        else:
            ids = [self._context_ids(c) + self.prompt_ids(p) for p, c in zip(prompts, contexts, strict=True)]
        if all(relayed) and self.identity.sliding_window and len({len(i) for i in ids}) > 1:
            # A sliding-window cache keeps the last window-1 *slots*; padding between a payload and a
            # shorter prompt would take window room from real tokens. Batch equal-length prompts only.
            groups: dict[int, list[int]] = {}
            for b, i in enumerate(ids):
                groups.setdefault(len(i), []).append(b)
            out: list[Response | None] = [None] * len(prompts)
            for members in groups.values():
                part = self.respond_batch([prompts[b] for b in members], [contexts[b] for b in members],
                                          max_new_tokens=max_new_tokens, temperature=temperature,
                                          seeds=None if seeds is None else [seeds[b] for b in members])
                for b, r in zip(members, part, strict=True):
                    out[b] = r
            return out  # type: ignore[return-value]
        n_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        pad = self.tokenizer.pad_token_id or 0
        t0 = time.perf_counter()
        q = max(len(i) for i in ids)
        real = torch.tensor([[False] * (q - len(i)) + [True] * len(i) for i in ids])  # (B, q)
        offs = (torch.cumsum(real.long(), dim=1) - 1).clamp_min(0)  # (B, q): index among real tokens
        if all(relayed):
            batch = pad_batch(contexts)
            cache = to_cache(batch, self.model.config)
            pos_t = batch.next_positions[:, None] + offs  # (B, q)
            mask = torch.cat((batch.mask, real), dim=1)  # (B, T + q)
        else:
            cache = self._empty_cache()
            pos_t = offs
            mask = real if not bool(real.all()) else None
        build_s = time.perf_counter() - t0
        ids_t = torch.tensor([[pad] * (q - len(i)) + i for i in ids], dtype=torch.int64)  # (B, q)
        choose = Sampler(temperature, seeds) if temperature > 0 else None  # type: ignore[arg-type]
        out = generate(self.model, cache, ids_t, pos_t.to(torch.int64), mask, n_new, self.stop_ids, pad_id=pad,
                       choose=choose)
        self.round += 1
        res = []
        for b, c in enumerate(contexts):
            gen = out.tokens[b, : int(out.lengths[b])].tolist()
            n_relayed = c.num_tokens if isinstance(c, KVPayload) else 0
            res.append(Response(self.decode(gen), tuple(gen), len(ids[b]), n_relayed,
                                build_s + out.prefill_s, build_s, out.prefill_s, out.decode_s, "continue"))
        return res

    def _context_ids(self, context: Context) -> list[int]:
        """Token ids a text-like context contributes before the prompt (the text channel)."""
        if context is None:
            return []
        if isinstance(context, str):
            return self.encode(self.fmt.user(context))
        return [int(t) for t in (context.reshape(-1).tolist() if isinstance(context, torch.Tensor) else context)]
