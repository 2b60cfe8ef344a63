"""build_plan: turn a request + capabilities + model description into frozen decisions with reasons.

Pure: it resolves nothing, probes nothing, reads (never changes) what it is given and touches no GPU. Each
feature decides for itself (``features/<name>``'s ``decide``); this module only orders them and collects the
result. Turning a preset name into a SpeedupConfig and the machine into Capabilities happens once, at the
public door the request came in by (the trainer, ``training_arguments``, ``load_model``, the CLI, the
estimator); :func:`plan_for` is that door for code that holds a preset name and wants the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import SpeedupConfig, SpeedupConfigError
from .features import FEATURES
from .hardware import Capabilities, probe
from .measured import measuring_enabled, shared_across_ranks
from .model_info import ModelInfo, describe_model
from .plan_types import Plan, PlanContext
from .presets import resolve


def build_plan(config: SpeedupConfig, caps: Capabilities, model: ModelInfo | None = None, args: Any = None) -> Plan:
    """Decide every feature for a resolved ``config`` on the machine ``caps`` describes, for the model facts
    ``model`` (None: planned without a model) and the user's TrainingArguments ``args`` (None: without them)."""
    _check_inputs(config, caps, model)
    if problems := cpu_world_problems(caps, args):
        raise SpeedupConfigError(problems)
    ctx = PlanContext(config=config, caps=caps, model=model, args=args)
    for feature in FEATURES:
        ctx.decisions[feature.NAME] = feature.decide(ctx)
    return Plan(config=config, caps=caps, model=model, decisions=ctx.decisions)


def plan_for(speedup: Any = "auto", caps: Capabilities | None = None, model: Any = None, args: Any = None) -> Plan:
    """The door for a request in any form ``SpeedupTrainer(speedup=...)`` takes (arguments in :func:`build_plan`'s
    order): resolved, the device ``args`` train on probed (unless ``caps`` is given), an ``nn.Module`` described,
    each once, then :func:`build_plan`."""
    config = resolve(speedup)  # a bad request fails here, before the machine or the model is looked at
    info = model if model is None or isinstance(model, ModelInfo) else describe_model(model)
    return build_plan(config, measure(config, caps if caps is not None else probe(args), info), info, args)


def measure(config: SpeedupConfig, caps: Capabilities, model: ModelInfo | None) -> Capabilities:
    """``caps`` with what the features time at the model's shapes (their optional ``measure`` hooks, see
    :mod:`hf_speedup.measured`), for :func:`build_plan` to decide by. Called at the doors, once, after the probe;
    figures already in ``caps.measured`` (a test's, a caller's) are kept and not timed again."""
    if model is None or not measuring_enabled():
        return caps

    def each_feature() -> dict:
        found: dict = {}
        for feature in FEATURES:  # each hook sees what the ones before it measured (the experts are timed in
            if (hook := getattr(feature, "measure", None)) is not None:  # the dtype precision's figure picks)
                seen = dataclasses.replace(caps, measured={**found, **caps.measured})
                found.update(hook(config, seen, model) or {})
        return found

    return dataclasses.replace(caps, measured={**shared_across_ranks(each_feature), **caps.measured})


def cpu_world_problems(caps: Capabilities, args: Any) -> list[str]:
    """Several processes on CPUs need ``use_cpu=True``: without it TrainingArguments set up no process group, each
    rank takes itself for the whole world, and the run is silently wrong (every rank trains on all the rows while
    FSDP shards the model across them, or two ranks race on one checkpoint folder)."""
    if caps.device_type != "cpu" or caps.world_size < 2 or args is None or getattr(args, "use_cpu", True):
        return []
    return [f"TrainingArguments.use_cpu = False on {caps.world_size} CPU processes (WORLD_SIZE={caps.world_size}): "
            "without it each rank takes itself for the whole world (TrainingArguments.world_size = 1), so every rank "
            "trains on all the rows and saves into the same output_dir, while FSDP or DeepSpeed shard across the "
            "ranks; allowed: use_cpu=True for several processes on CPUs; fix: TrainingArguments(use_cpu=True, ...)"]


def _check_inputs(config: Any, caps: Any, model: Any) -> None:
    """A loose request reaching the pure planner is a caller's bug: say which door does the resolving."""
    wrong = []
    if not isinstance(config, SpeedupConfig):
        wrong.append(f"config = {config!r} ({type(config).__name__}); allowed: a SpeedupConfig")
    if not isinstance(caps, Capabilities):
        wrong.append(f"caps = {caps!r} ({type(caps).__name__}); allowed: Capabilities (hardware.probe(args))")
    if model is not None and not isinstance(model, ModelInfo):
        wrong.append(f"model = {type(model).__name__}; allowed: a ModelInfo (model_info.describe_model(model)) or None")
    if wrong:
        raise TypeError("build_plan takes resolved inputs: " + "; ".join(wrong) + ". Fix: call "
                        "hf_speedup.plan_for(speedup, model, args), which resolves, probes and describes once")
