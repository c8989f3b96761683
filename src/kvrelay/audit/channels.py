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

``kv_variant:NAME:REPAIR`` (``audit.vocab``) uses the same channel with another sharer: ``BASE+NAME``,
the fine-tuned variant ``NAME`` of the audited model's base (``models.variants``; an audited model
that is itself a variant ``BASE+OTHER`` shares its base), read through the loader's ``BASE+ADAPTER``
route. Its cache reaches the receiver through the repair the arm names: ``raw`` is an
``IdentityAdapter`` (the receiver's explicit consent to use the sibling's cache unchanged), anything
else a ``RecomputeAdapter`` that accepts that sibling only (``fuse.repair``). The control
``kv_variant_mismatched`` is relabelled as above, so a repair recomputes from the matched task's
tokens over the sibling's cache of another task: the pairing contrast isolates what the sibling's
*matched* cache adds beyond the tokens the repair recomputes itself.
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
    folder: Path | None  # the adapter artefact (None for a variant channel: its adapters are per arm)
    adapter: object | None
    agent: Agent

    def read(self, text: str) -> KVPayload:
        return self.agent.read(text)


def load_adapter(folder: Path, sharer_lm, receiver_lm):
    """The adapter in ``folder`` (ridge, layers or fuser), checked against both loaded models."""
    from kvrelay.fuse.fuser import FuserAdapter
    from kvrelay.fuse.ridge import RidgeAdapter

    config = artefact.ArtefactConfig.from_json((folder / artefact.CONFIG).read_text())
    config.check_pair(receiver_lm.identity, sharer_lm.identity.fingerprint, where=f"adapter artefact {folder}")
    if config.method == "ridge":
        return RidgeAdapter.load(folder, sharer_lm.tokenizer, receiver_lm.tokenizer)
    if config.method == "fuser":
        return FuserAdapter.load(folder, receiver_lm, sharer_lm.tokenizer)
    if config.method == "layers":
        from kvrelay.fuse.layers import LayersAdapter

        return LayersAdapter.load(folder, sharer_lm.tokenizer, receiver_lm.tokenizer)
    raise ValueError(f"{folder}: adapter method {config.method!r} has no audit arm (ridge, layers, fuser)")


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


def variant_model(model: str, variant: str) -> str:
    """``BASE+variant`` for audited model ``model`` (``BASE`` itself, or a variant ``BASE+OTHER``)."""
    from kvrelay.models.variants import SEP, split_name

    parts = split_name(model) if SEP in model else None
    return f"{parts[0] if parts else model}{SEP}{variant}"


def open_variant(variant: str, model: str, receiver_lm, role: str,
                 load: Callable[[str], object] | None = None) -> Channel:
    """The channel of variant arms ``kv_variant:VARIANT:*``: the sibling ``BASE+VARIANT`` as sharer."""
    if load is None:
        from kvrelay.models.loader import load_model as load
    sharer_lm = load(variant_model(model, variant))
    if sharer_lm.identity.fingerprint == receiver_lm.identity.fingerprint:
        raise ValueError(f"kv_variant:{variant}: the variant is the audited model itself; its cache is arm kv")
    return Channel(f"variant:{variant}", None, None, Agent(sharer_lm, "sharer", role=role))


def variant_adapter(repair: str, sharer_lm, receiver_lm):
    """The receive-path adapter of repair ``repair`` (``raw`` or a recompute spec) for that sibling only."""
    from kvrelay.audit.vocab import RAW_REPAIR
    from kvrelay.fuse.adapter import IdentityAdapter
    from kvrelay.fuse.repair import repair_adapter

    src = sharer_lm.identity.fingerprint
    if repair == RAW_REPAIR:
        return IdentityAdapter(src, receiver_lm.identity.fingerprint)
    return repair_adapter(receiver_lm, repair, sources=(src,))
