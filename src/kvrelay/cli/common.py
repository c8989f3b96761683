"""What every model-running command does first: set torch's intra-op threads, then load the model."""

from __future__ import annotations

DEFAULT_ENGINE = "fp32"
ENGINE_HELP = ("kernel mode: fp32 | bf16 | fp16 | int8 | int4 (fp32 prefill, compact weights for one-token "
               "decode steps) | auto (the fastest of fp32/bf16/int8 measured once on this machine, cached "
               "under $KVRELAY_HOME). Payloads of one mode are refused by another")


def load_for_cli(model: str, threads: int | None = None, engine: str = DEFAULT_ENGINE):
    """``load_model(model, engine=engine)`` after ``torch.set_num_threads(threads)`` (``None`` keeps torch's default).

    One place for the ``--threads`` and ``--engine`` options' meaning: every CLI that runs a model calls this.
    Threads are set first, so ``auto`` measures (and caches) under the threads the command will use.
    """
    import torch

    from kvrelay.models.loader import load_model

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return load_model(model, engine=engine)
