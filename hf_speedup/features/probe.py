"""The mode a verification probe runs in: a probe reads the live model, it must not change training."""

from __future__ import annotations

import contextlib

import torch


_PROBES = [0]  # probes running now (nested ones count)


def probing() -> bool:
    """Whether a verification probe is running: recorders of training (the tiled MLP's) leave it out."""
    return _PROBES[0] > 0


@contextlib.contextmanager
def eager_train_mode(model):
    """Train mode, fresh RNG state and no compiled code, restored afterwards (verification must not
    change training, nor trigger a compile)."""
    modes = [(m, m.training) for m in model.modules()]
    _PROBES[0] += 1
    stance = getattr(torch.compiler, "set_stance", None)
    # the RNG of the GPUs the model is on: a CPU run on a GPU host must not initialise CUDA here
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), (stance("force_eager") if stance else contextlib.nullcontext()):
            model.train()
            yield
    finally:
        _PROBES[0] -= 1
        for m, was in modes:
            m.training = was


def steps_trained(trainer, outcome) -> int:
    """Training steps since the first check inside ``train()`` (a resumed run enters it at the checkpoint's step,
    with no step of its own yet): what a verification that counts forwards may expect to have run."""
    step = getattr(getattr(trainer, "state", None), "global_step", 0) or 0
    if getattr(trainer, "is_in_train", False):
        return step - outcome.facts.setdefault("first_step_in_train", step)
    return step - outcome.facts.get("first_step_in_train", step)
