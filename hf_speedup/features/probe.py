"""The mode a verification probe runs in: a probe reads the live model, it must not change training."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eager_train_mode(model):
    """Train mode, fresh RNG state and no compiled code, restored afterwards (verification must not
    change training, nor trigger a compile)."""
    modes = [(m, m.training) for m in model.modules()]
    stance = getattr(torch.compiler, "set_stance", None)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices), (stance("force_eager") if stance else contextlib.nullcontext()):
            model.train()
            yield
    finally:
        for m, was in modes:
            m.training = was
