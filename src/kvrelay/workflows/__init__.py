"""Multi-agent workflows with text / kv / kv+text channels, their runner and the pipeline benchmark."""

from kvrelay.workflows.spec import CHANNELS, AgentSpec, Edge, Workflow, chain, hierarchy

__all__ = ["CHANNELS", "AgentSpec", "Edge", "Workflow", "chain", "hierarchy"]
