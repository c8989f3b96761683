"""Typed errors. Every failure a user can cause has its own class and a message saying what was expected."""

from __future__ import annotations


class KVRelayError(Exception):
    """Base class of every kvrelay error."""

    def __reduce__(self):
        # Pickle (Ray, multiprocessing) rebuilds the error whole, whatever the subclass's __init__ takes.
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type, args: tuple, state: dict) -> KVRelayError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class InvalidInput(KVRelayError, ValueError):
    """An argument a user gave is wrong: what was wrong, what was expected, and a close valid value if any.

    ``str(err)`` is one line: ``<what>; expected <expected>[; did you mean <suggestion>?]``.
    """

    def __init__(self, what: str, expected: str, suggestion: str | None = None):
        self.what, self.expected, self.suggestion = what, expected, suggestion
        msg = f"{what}; expected {expected}"
        super().__init__(msg + (f"; did you mean {suggestion}?" if suggestion else ""))


class FetchError(KVRelayError):
    """A model or data package could not be fetched from the registry."""


class ChecksumMismatch(KVRelayError):
    """A downloaded artefact does not have the sha256 it is pinned to; it is not used."""


class UnknownModel(KVRelayError):
    """A model name is neither in the zoo, nor a local folder, nor a loadable transformers id."""


class PayloadError(KVRelayError):
    """Base class for errors about a relayed KV payload."""


class CorruptPayload(PayloadError):
    """The bytes are truncated, edited, foreign, or violate the format's limits."""


class IncompatiblePayload(PayloadError):
    """The payload was produced under a different model/tokenizer/format; ``field`` names what differs."""

    def __init__(self, field: str, expected: object, got: object, detail: str = ""):
        self.field, self.expected, self.got = field, expected, got
        msg = f"incompatible payload: {field} differs (receiver expects {expected!r}, payload has {got!r})"
        super().__init__(msg + (f"; {detail}" if detail else ""))


class EngineMismatch(IncompatiblePayload):
    """Same weights, another engine mode: the payload's K/V were computed with other kernels."""

    def __init__(self, receiver_engine: str, payload_engine: str):
        self.receiver_engine, self.payload_engine = receiver_engine, payload_engine
        super().__init__("engine", receiver_engine, payload_engine,
                         f"the payload was made by engine {payload_engine!r}, the receiver runs engine "
                         f"{receiver_engine!r}; accept it explicitly (kvrelay.fuse.engine.AcceptEngines) "
                         "to use it as a near-compatible payload")


class StalePayload(PayloadError):
    """The payload is from an older round than what the receiver already holds."""

    def __init__(self, payload_round: int, held_round: int, producer: str):
        self.payload_round, self.held_round, self.producer = payload_round, held_round, producer
        super().__init__(
            f"stale payload from {producer!r}: round {payload_round} is older than round {held_round} "
            "the receiver already holds"
        )


class MissingRound(PayloadError):
    """Rounds of a producer were skipped: the caches of the rounds in between were lost on the way."""

    def __init__(self, producer: str, missing: tuple[int, ...], held_round: int, payload_round: int):
        self.producer, self.missing = producer, tuple(missing)
        self.held_round, self.payload_round = held_round, payload_round
        shown = f"{missing[0]}..{missing[-1]}" if len(missing) > 3 else ", ".join(map(str, missing))
        super().__init__(
            f"missing rounds from {producer!r}: held round {held_round}, got round {payload_round}, "
            f"so round(s) {shown} never arrived; expected round {held_round} or the one after it "
            "(rebuild this edge from text)"
        )


class ExpiredPayload(PayloadError):
    """The payload is older than the receiver accepts, counted in rounds or in seconds."""

    def __init__(self, producer: str, age: float, limit: float, unit: str):
        self.producer, self.age, self.limit, self.unit = producer, age, limit, unit
        super().__init__(f"expired payload from {producer!r}: {age} {unit} old, the receiver accepts at most "
                         f"{limit} {unit}")


class ProducerModelChanged(PayloadError):
    """The producer's model changed since this payload was made: every payload of its old weights is refused."""

    def __init__(self, producer: str, payload_fingerprint: str, current_fingerprint: str):
        self.producer = producer
        self.payload_fingerprint, self.current_fingerprint = payload_fingerprint, current_fingerprint
        super().__init__(f"payload from {producer!r} was made by model {payload_fingerprint[:16]}, but that producer "
                         f"has since sent payloads of model {current_fingerprint[:16]}; expected a payload of its "
                         "current model (its old caches are invalid)")


class UnsignedPayload(PayloadError):
    """The receiver requires signed payloads (it holds keys) and this one carries no signature."""

    def __init__(self, producer: str):
        self.producer = producer
        super().__init__(f"unsigned payload from {producer!r}: the receiver accepts only payloads signed with one of "
                         "its keys (kvrelay.kv.sign)")


class BadSignature(PayloadError):
    """The payload's signature is malformed, made with a key the receiver does not trust, or does not match."""

    def __init__(self, producer: str, key_id: str, reason: str):
        self.producer, self.key_id, self.reason = producer, key_id, reason
        key = f" with key {key_id!r}" if key_id else ""
        super().__init__(f"bad signature on the payload from {producer!r}{key}: {reason}; expected a signature by "
                         "one of the receiver's keys over the payload as it was written")


class TamperedPayload(PayloadError):
    """Verification recomputed part of the payload from its own tokens and it is not what the model computes."""

    def __init__(self, producer: str, verdict: str, reason: str):
        self.producer, self.verdict, self.reason = producer, verdict, reason
        super().__init__(f"payload from {producer!r} failed verification ({verdict}): {reason}; expected the K/V "
                         "the receiver's model computes for the payload's token ids")


class OverBudget(KVRelayError):
    """A payload does not fit a store's byte budget under its policy (``transport.budget``)."""

    def __init__(self, where: str, nbytes: int, held: int, limit: int, policy: str):
        self.where, self.nbytes, self.held, self.limit, self.policy = where, nbytes, held, limit, policy
        super().__init__(f"{where or 'store'}: a payload of {nbytes} bytes does not fit the byte budget of {limit} "
                         f"({held} held, policy {policy}); expected a payload of at most the free bytes, or an "
                         "evicting policy (oldest, lru)")


class EdgeRefused(KVRelayError):
    """A workflow edge's relayed payload was refused by its receiver and the edge does not fall back to text."""

    def __init__(self, src: str, dst: str, reason: str, kind: str = ""):
        self.src, self.dst, self.reason, self.kind = src, dst, reason, kind
        super().__init__(f"edge {src}->{dst}: the relayed payload was refused ({kind + ': ' if kind else ''}{reason}); "
                         "set on_refused = \"text\" on the edge to rebuild it from text instead")


class AdapterMismatch(IncompatiblePayload):
    """A fitted adapter was asked to map between models other than the ones its artefact records."""

    def __init__(self, role: str, expected: str, got: str, artefact: str = ""):
        self.role = role
        where = f" (artefact {artefact})" if artefact else ""
        super().__init__(f"{role}_fingerprint", expected, got,
                         f"the adapter was fitted for another {role} model{where}; fit one for this pair")


class ArtefactError(KVRelayError):
    """An adapter artefact folder is missing, incomplete, or not in the format this version reads."""


class PayloadNotFound(KVRelayError, KeyError):
    """No live payload under a key in a store (never written, deleted, or expired)."""

    def __init__(self, key: str, store: str, detail: str = ""):
        self.key, self.store = key, store
        msg = f"no payload under key {key!r} in store {store}"
        super().__init__(msg + (f" ({detail})" if detail else ""))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])

    def __reduce__(self):  # picklable (it crosses process pools): rebuilt from its parts, not its message
        detail = str(self.args[0]).partition(f"in store {self.store} (")[2].removesuffix(")")
        return type(self), (self.key, self.store, detail)


class UnknownStore(KVRelayError, ValueError):
    """A store URL is none of ``memory://[NAME]``, ``file:///ABS/DIR`` (or a directory path), ``redis://HOST:PORT/DB``."""


class PeerUnavailable(KVRelayError):
    """A peer engine a benchmark compares against (llama.cpp) is not installed or cannot run."""


def _fixed(x: object, digits: int) -> str:
    """A number at ``digits`` decimals; anything else as it is (an error's message never fails to format)."""
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else str(x)


class MachineLoaded(KVRelayError):
    """A timing run met a busy machine: its 1-minute load exceeded the run's own threads by more than allowed."""

    def __init__(self, load1: float, threads: int, limit: float, when: str):
        self.load1, self.threads, self.limit, self.when = load1, threads, limit, when
        super().__init__(f"the 1-minute load average was {_fixed(load1, 2)} {when}, above the benchmark's {threads} "
                         f"threads + 0.5; expected a quiet machine (load <= {_fixed(limit, 1)}), or --allow-load to keep the "
                         "figures labelled loaded")


class WorkerError(KVRelayError):
    """An agent's worker process failed (it died, or a request to it raised); the message says which and why."""


class StoreError(KVRelayError):
    """A store cannot be reached, read or written (no server, a bad database, a read-only or full disk, a
    hostile manifest); the message names the store and what was expected. A failed put leaves no payload."""


class InvalidWorkflow(KVRelayError, ValueError):
    """A workflow definition (TOML) is malformed: the message names the key and what was expected."""


class RecordsError(KVRelayError, ValueError):
    """A records file (JSON lines, one trial a line) holds a line that is not one of the run's records; the
    message names the file and line."""
