"""Adapter arms' channel: another model (the sharer) reads the context, an adapter carries its cache.

``kv_adapter:NAME`` names an adapter artefact: a folder under ``artefacts/fuse/`` (``NAME`` as
``kvrelay fuse fit`` / ``fuse train`` wrote it, e.g. ``qwen2.5-coder-0.5b__qwen2.5-coder-1.5b__ridge``)
or a path to one. Its ``adapter.json`` names the sharer model, which the runner loads once; the
artefact must have been made for the audited model (``AdapterMismatch`` otherwise, before any trial).

Per task the sharer reads the context with the sender's role; ``kv_adapter`` relays that payload,
``kv_adapter_mismatched`` the sharer's reading of another task cut to the same number of sharer
tokens (``runner.length_matched``), labelled with the matched task's tokens, so an adapter that
re-reads the text (the fuser: the receiver's own reading of the matched tokens, fused) gets
everything of the matched task except the sharer's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvrelay.agents.agent import Agent
from kvrelay.fuse import artefact
from kvrelay.kv.payload import KVPayload


def available() -> list[str]:
    """Names of the adapter artefacts under ``artefacts/fuse/``."""
    d = artefact.root()
    return sorted(p.name for p in d.iterdir() if (p / artefact.CONFIG).is_file()) if d.is_dir() else []


def resolve(name: str) -> Path:
    """The artefact folder an adapter arm names; ``ValueError`` listing the committed ones otherwise."""
    for folder in (artefact.root() / name, Path(name).expanduser()):
        if (folder / artefact.CONFIG).is_file():
            return folder
    raise ValueError(f"adapter {name!r} is neither a folder under {artefact.root()} nor a path to an adapter "
                     f"artefact; committed: {', '.join(available()) or 'none'}")


@dataclass(frozen=True)
class Channel:
    """One adapter arm's sharer agent and adapter."""

    name: str
    folder: Path
    adapter: object
    agent: Agent

    def read(self, text: str) -> KVPayload:
        return self.agent.read(text)


def load_adapter(folder: Path, sharer_lm, receiver_lm):
    """The adapter in ``folder`` (ridge or fuser), checked against both loaded models."""
    from kvrelay.fuse.fuser import FuserAdapter
    from kvrelay.fuse.ridge import RidgeAdapter

    config = artefact.ArtefactConfig.from_json((folder / artefact.CONFIG).read_text())
    config.check_pair(receiver_lm.identity, sharer_lm.identity.fingerprint, where=f"adapter artefact {folder}")
    if config.method == "ridge":
        return RidgeAdapter.load(folder, sharer_lm.tokenizer, receiver_lm.tokenizer)
    if config.method == "fuser":
        return FuserAdapter.load(folder, receiver_lm, sharer_lm.tokenizer)
    raise ValueError(f"{folder}: adapter method {config.method!r} has no audit arm (ridge, fuser)")


def open_channel(name: str, receiver_lm, role: str, load: Callable[[str], object] | None = None) -> Channel:
    """Load the sharer named by artefact ``name`` (``load``: default ``models.loader.load_model``) and its adapter."""
    if load is None:
        from kvrelay.models.loader import load_model as load
    folder = resolve(name)
    config = artefact.ArtefactConfig.from_json((folder / artefact.CONFIG).read_text())
    sharer_lm = load(config.sharer.name)
    return Channel(name, folder, load_adapter(folder, sharer_lm, receiver_lm), Agent(sharer_lm, "sharer", role=role))


def relabelled(mismatched: KVPayload, matched: KVPayload) -> KVPayload:
    """``mismatched``'s cache under ``matched``'s token ids and positions (same length): the control's payload."""
    if mismatched.num_tokens != matched.num_tokens:
        raise ValueError(f"a mismatched sharer payload must be length-matched ({mismatched.num_tokens} != "
                         f"{matched.num_tokens} tokens)")
    return replace(mismatched, token_ids=matched.token_ids, positions=matched.positions, mask=matched.mask)
