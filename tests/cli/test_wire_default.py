"""The wire default: payloads that cross a store or a process go as fp16 unless a codec is named."""

from __future__ import annotations

import inspect

import pytest

from kvrelay.cli import payload as payload_cli
from kvrelay.cli.pipeline import check_store, resolve_codec
from kvrelay.cli.validate import InvalidInput
from kvrelay.kv import codecs


@pytest.mark.parametrize(("backend", "store", "want"), [
    ("inprocess", None, "raw"),  # handed over as objects: nothing to encode
    ("inprocess", "memory://x", codecs.WIRE_CODEC),
    ("process", None, codecs.WIRE_CODEC),  # the process backend always goes through a store
    ("ray", None, "raw"),  # Ray's object store takes the object itself
])
def test_auto_codec_is_the_wire_codec_only_where_payloads_cross(backend, store, want):
    assert resolve_codec(backend, store, "auto") == want
    assert resolve_codec(backend, store, "int8") == "int8"  # a named codec always wins


def test_read_defaults_to_the_wire_codec():
    default = inspect.signature(payload_cli.read_cmd).parameters["codec"].default.default
    assert default == codecs.WIRE_CODEC == "fp16"


def test_auto_is_accepted_and_a_bad_codec_still_refused():
    check_store("inprocess", None, "auto")
    check_store("ray", None, "auto")
    with pytest.raises(InvalidInput, match="auto or one codec name"):
        check_store("inprocess", None, "fp13")
    with pytest.raises(InvalidInput, match="do not apply to --backend ray"):
        check_store("ray", None, "fp16")
