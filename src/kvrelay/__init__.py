"""kvrelay: relay KV caches between LLM agents, audit when it pays, decide per request."""

__version__ = "0.1.0"
