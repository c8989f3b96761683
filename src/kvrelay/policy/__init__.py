"""When to relay: a cost model, a value model fitted on audit records, ``decide()``, a runtime switch.

Mechanism-free: this package decides from plain numbers and never touches a tensor (docs/policy.md).
"""
