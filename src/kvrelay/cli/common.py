"""What every model-running command does first: set torch's intra-op threads, then load the model."""

from __future__ import annotations


def load_for_cli(model: str, threads: int | None = None):
    """``load_model(model)`` after ``torch.set_num_threads(threads)`` (``None`` keeps torch's default).

    One place for the ``--threads`` option's meaning: every CLI that runs a model calls this.
    """
    import torch

    from kvrelay.models.loader import load_model

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return load_model(model)
