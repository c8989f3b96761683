"""Adapters on the receive path: payloads of one model made usable by another (``adapter.Adapter``)."""

from kvrelay.fuse.adapter import Adapter, HeadMapAdapter, IdentityAdapter, stamp

__all__ = ["Adapter", "HeadMapAdapter", "IdentityAdapter", "stamp"]
