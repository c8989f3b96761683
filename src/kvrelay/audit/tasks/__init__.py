"""Audit tasks: generated private tasks with difficulty dials, and real evaluation sets by name.

    >>> from kvrelay.audit.tasks import load_tasks, score
    >>> task = load_tasks("gen", limit=1)[0]
    >>> score(task, task.answers[0])
    1.0
"""

from kvrelay.audit.tasks.datasets import available, load_tasks
from kvrelay.audit.tasks.generated import generate, grid
from kvrelay.audit.tasks.scoring import score
from kvrelay.audit.tasks.task import Task

__all__ = ["Task", "available", "generate", "grid", "load_tasks", "score"]
