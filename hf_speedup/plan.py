"""build_plan: turn a request + capabilities + model description into frozen decisions with reasons.

Pure: it reads, never changes, the model and touches no GPU. Each feature module decides for
itself (``features/<name>.py::decide``); this module only orders them and collects the result.
"""

from __future__ import annotations

from typing import Any

from .features import FEATURES
from .hardware import Capabilities, probe
from .model_info import ModelInfo, describe_model
from .plan_types import Plan, PlanContext
from .presets import resolve


def build_plan(config: Any = "auto", caps: Capabilities | None = None, model: Any = None, args: Any = None) -> Plan:
    """Decide every feature. ``config`` as ``speedup=`` takes it; ``model`` an ``nn.Module`` or a :class:`ModelInfo`."""
    cfg = resolve(config)
    caps = caps if caps is not None else probe(args)  # the device these arguments train on
    info = model if (model is None or isinstance(model, ModelInfo)) else describe_model(model)
    ctx = PlanContext(config=cfg, caps=caps, model=info, args=args)
    for feature in FEATURES:
        ctx.decisions[feature.NAME] = feature.decide(ctx)
    return Plan(config=cfg, caps=caps, model=info, decisions=ctx.decisions)
