"""The experts feature's ``measure`` hook: what ``auto`` decides by, timed at the door (see :mod:`.timing`),
cached per machine, shapes and dtype by :func:`hf_speedup.measured.cached`."""

from __future__ import annotations

import logging

import torch

from ...dtypes import to_dtype
from ...measured import cached
from ...plan_types import PlanContext
from . import timing
from .kernels import KERNELS, TRANSFORMERS_DEFAULT, usable

logger = logging.getLogger("hf_speedup")


def compute_dtype(config, caps, info) -> torch.dtype:
    """The dtype the experts' matmuls will run in: the precision feature's choice (autocast), or 16-bit weights'."""
    weights = to_dtype(info.dtype) if info.dtype in ("float32", "bfloat16", "float16") else torch.float32
    if weights != torch.float32:
        return weights
    try:
        from .. import precision

        return precision.decide(PlanContext(config=config, caps=caps, model=info, args=None)).settings.dtype
    except Exception as exc:  # the plan proper reports precision's own problems; time in the weights' dtype
        logger.info("hf_speedup experts: timed in %s (precision undecided here: %s)", weights, exc)
        return weights


def measure(config, caps, info) -> dict:
    if config.experts.implementation != "auto" or info is None or not info.experts_modules or info.quantization:
        return {}
    if info.experts_implementation not in (None, TRANSFORMERS_DEFAULT):
        return {}  # auto keeps an implementation the user set
    shapes = timing.shapes(info)
    if shapes is None:
        return {}
    names = [k for k in KERNELS if usable(k, caps)[0]]
    weights = to_dtype(info.dtype) if info.dtype in ("float32", "bfloat16", "float16") else torch.float32
    compute = compute_dtype(config, caps, info)
    device = caps.device if caps.device_type in ("cpu", "cuda") else "cpu"
    if caps.device_type not in ("cpu", "cuda"):
        return {}
    threads = torch.get_num_threads()
    where = f"{caps.device_name}, {threads} thread(s), torch {torch.__version__}"
    key = {"device": caps.device_name, "threads": threads, "torch": torch.__version__, "shapes": shapes,
           "weights": str(weights), "compute": str(compute), "implementations": names}
    result = cached("experts.kernel", key,
                    lambda: timing.measurement(shapes, names, device, weights, compute, where))
    logger.info("hf_speedup experts: %s", result.text())
    return {"experts.kernel": result}
