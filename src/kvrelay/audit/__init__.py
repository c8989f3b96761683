"""The causal audit. The package is callable: ``kvrelay.audit(config_or_preset, out_dir, ...)`` is
``kvrelay.audit.api.run_audit`` (so ``import kvrelay as kr; kr.audit("smoke", "out", model=...)``)."""

import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from kvrelay.audit.api import run_audit

        return run_audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
