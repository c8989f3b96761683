"""llama.cpp as the peer of ``bench engine``, through llama-cpp-python (an optional extra: ``make peers``).

The peer gets exactly what kvrelay gets: the same GGUF file, the same thread count, the same token
ids (kvrelay's tokenizer comes from that GGUF; ``tokenization_identical`` in the result checks that
llama.cpp's own tokenizer agrees on the context), greedy decoding with stop tokens suppressed until
the answer has its full length. Its relay is its state save/restore: ``Llama.save_state`` after the
sender's prefill, ``Llama.load_state`` on the receiver — the public Python API a user calls. The
same restore through the C call alone (``llama_state_set_data``, without the Python wrapper's copy
of its logits buffer) is timed too, as ``relay_ttft_c_api_s``.

Everything here returns plain numbers (seconds, bytes, token ids): ``bench.engine`` turns a run's
raw result into report rows, and its tests read a recorded one.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.errors import PeerUnavailable

N_CTX = 4096  # the 2,048-token context, the question, and a 5-agent pipeline's turns fit


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as err:
        raise PeerUnavailable(
            "the llama.cpp peer needs llama-cpp-python (an optional extra): run `make peers` to build it from "
            f"source into the project's virtual environment ({err})") from None
    return llama_cpp


@dataclass(frozen=True, slots=True)
class State:
    """A saved llama.cpp state: the relayed bytes and the tokens they hold."""

    saved: object  # llama_cpp.LlamaState
    token_ids: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(self.saved.llama_state_size)


class LlamaCppPeer:
    """One llama.cpp model and context; greedy prefill / decode / state save and restore on token ids."""

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = N_CTX):
        llama_cpp = _llama_cpp()
        self.lib = llama_cpp
        self.gguf = str(gguf)
        self.threads = threads
        self.llm = llama_cpp.Llama(model_path=self.gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.params = {"n_ctx": n_ctx, "n_batch": self.llm.n_batch, "n_threads": threads,
                       "n_threads_batch": threads, "flash_attn": False, "kv_type": "f16 (default)"}

    @property
    def version(self) -> str:
        return self.lib.__version__

    def system_info(self) -> str:
        return self.lib.llama_print_system_info().decode(errors="replace").strip()

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    # -- the steps ----------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> float:
        """A fresh context reads ``ids``; seconds (the first token is the argmax of its last logits)."""
        t0 = time.perf_counter()
        self.llm.reset()
        self.llm.eval(list(ids))
        return time.perf_counter() - t0

    def extend(self, ids: Sequence[int]) -> float:
        """Read ``ids`` after what the context holds; seconds."""
        t0 = time.perf_counter()
        if ids:
            self.llm.eval(list(ids))
        return time.perf_counter() - t0

    def _argmax(self, suppress: Sequence[int]) -> int:
        import numpy as np

        ptr = self.lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))  # (V,) view of the last logits
        if suppress:
            logits = logits.copy()
            logits[list(suppress)] = -np.inf
        return int(logits.argmax())

    def generate(self, n_new: int, stop_ids: set[int], min_new: int) -> tuple[list[int], float]:
        """Greedy tokens from the current logits (the first is free) and the seconds of the n - 1 decode steps.

        Stops at a stop token once ``min_new`` tokens are written; the stop token is not returned.
        """
        stops = sorted(stop_ids)
        out: list[int] = []
        t0 = time.perf_counter()
        for step in range(n_new):
            tok = self._argmax(stops if step < min_new else ())
            if tok in stop_ids:
                break
            out.append(tok)
            if step == n_new - 1:
                break
            self.llm.eval([tok])
        return out, time.perf_counter() - t0

    def save(self) -> tuple[State, float]:
        t0 = time.perf_counter()
        saved = self.llm.save_state()
        ids = tuple(int(t) for t in self.llm.input_ids[: self.llm.n_tokens])
        return State(saved, ids), time.perf_counter() - t0

    def load(self, state: State) -> float:
        """Restore ``state`` through ``Llama.load_state``; seconds."""
        t0 = time.perf_counter()
        self.llm.load_state(state.saved)
        return time.perf_counter() - t0

    def load_c_api(self, state: State) -> float:
        """Restore ``state`` through ``llama_state_set_data`` alone (no copy of the Python logits buffer)."""
        t0 = time.perf_counter()
        size = state.nbytes
        buf = (ctypes.c_uint8 * size).from_buffer_copy(state.saved.llama_state)
        if self.lib.llama_state_set_data(self.llm._ctx.ctx, buf, size) != size:
            raise RuntimeError("llama_state_set_data did not restore the whole state")
        self.llm.n_tokens = len(state.token_ids)
        self.llm.input_ids[: len(state.token_ids)] = state.token_ids
        return time.perf_counter() - t0


# ---- one measuring trial ------------------------------------------------------------------------

def trial(peer: LlamaCppPeer, state: State, question_ids: Sequence[int], n_new: int, stop_ids: set[int]) -> dict:
    """Text TTFT (context re-read), relay TTFT (state restored) and decode of ``n_new`` tokens after it."""
    context = list(state.token_ids)
    text_s = peer.prefill(context + list(question_ids))
    c_load = peer.load_c_api(state)
    c_ttft = c_load + peer.extend(question_ids)
    load_s = peer.load(state)
    ttft = load_s + peer.extend(question_ids)
    tokens, decode_s = peer.generate(n_new, stop_ids, n_new)
    return {"text_ttft_s": text_s, "text_prefill_tokens": len(context) + len(question_ids),
            "relay_ttft_s": ttft, "relay_load_s": load_s, "relay_ttft_c_api_s": c_ttft, "relay_load_c_api_s": c_load,
            "decode_s": decode_s, "decode_tokens": len(tokens), "answer_ids": tokens}


def make_state(peer: LlamaCppPeer, context_ids: Sequence[int]) -> tuple[State, float, float]:
    """The sender: prefill the context, save the state. (state, prefill seconds, save seconds)."""
    prefill_s = peer.prefill(context_ids)
    state, save_s = peer.save()
    return state, prefill_s, save_s


# ---- a chain of agents ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Turn:
    """One agent's own tokens in a chain: its prompt turn, and what closes its answer."""

    name: str
    prompt_ids: tuple[int, ...]  # its user turn + assistant start
    end_ids: tuple[int, ...]  # the end-of-turn marker after its answer


def pipeline(peer: LlamaCppPeer, context_ids: Sequence[int], turns: Sequence[Turn], n_new: int,
             stop_ids: set[int], handoff: str) -> dict:
    """Agents in a line, each reading everything before it, writing ``n_new`` tokens.

    ``handoff="text"``: every agent prefills the whole sequence (context, earlier turns and answers).
    ``handoff="state"``: every agent restores its predecessor's saved state (which holds that same
    sequence) and prefills only its own turn; it then reads its last answer token and end marker
    and saves the state for the next one.
    """
    if handoff not in ("text", "state"):
        raise ValueError(f"handoff must be 'text' or 'state', got {handoff!r}")
    seq = list(context_ids)
    state: State | None = None
    agents = []
    t_run = time.perf_counter()
    for i, turn in enumerate(turns):
        t0 = time.perf_counter()
        relay_s = 0.0
        received = state.nbytes if (handoff == "state" and state is not None) else 0
        if handoff == "state" and state is not None:
            relay_s = peer.load(state)
            prefill_s = peer.extend(turn.prompt_ids)
        else:
            prefill_s = peer.prefill(seq + list(turn.prompt_ids))
        tokens, decode_s = peer.generate(n_new, stop_ids, n_new)
        seq = seq + list(turn.prompt_ids) + tokens + list(turn.end_ids)
        if handoff == "state" and i < len(turns) - 1:
            tail = tokens[-1:] + list(turn.end_ids)  # the last answer token has not been read yet
            t1 = time.perf_counter()
            peer.extend(tail)
            state, _ = peer.save()
            relay_s += time.perf_counter() - t1
            if list(state.token_ids) != seq:
                raise RuntimeError(f"{turn.name}: the saved state does not hold the turn's token sequence")
        agents.append({"agent": turn.name, "prefill_s": prefill_s, "decode_s": decode_s, "relay_s": relay_s,
                       "decode_tokens": len(tokens), "wall_s": time.perf_counter() - t0,
                       "relay_bytes": received,
                       "answer_ids": tokens})
    return {"handoff": handoff, "total_s": time.perf_counter() - t_run, "agents": agents}
