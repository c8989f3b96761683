"""Every typed error survives pickling whole (type, message, fields): Ray actors and worker processes
hand errors back that way, and a receiver must see the IncompatiblePayload, not a serialisation failure."""

from __future__ import annotations

import inspect
import pickle

import pytest

from kvrelay.core import errors

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, errors.KVRelayError) and c.__module__ == errors.__name__]


def example(cls: type) -> errors.KVRelayError:
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if cls.__init__ is Exception.__init__ or not params:
        return cls(f"{cls.__name__} happened; expected something else")
    return cls(*[f"{p.name}-value" for p in params if p.default is inspect.Parameter.empty])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_error_round_trips_through_pickle(cls):
    err = example(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err) and back.args == err.args
    assert back.__dict__ == err.__dict__


def test_incompatible_payload_keeps_its_fields():
    err = errors.IncompatiblePayload("model_fingerprint", "a" * 64, "b" * 64, "use an adapter")
    back = pickle.loads(pickle.dumps(err))
    assert (back.field, back.expected, back.got) == ("model_fingerprint", "a" * 64, "b" * 64)
    assert "use an adapter" in str(back) and isinstance(back, errors.PayloadError)
    stale = pickle.loads(pickle.dumps(errors.StalePayload(1, 3, "planner")))
    assert (stale.payload_round, stale.held_round, stale.producer) == (1, 3, "planner")
