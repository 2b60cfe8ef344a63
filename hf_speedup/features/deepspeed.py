"""DeepSpeed ZeRO: the user's engine, named in the plan, verified on the live engine, and the plan adapted to it.

A DeepSpeed config (``TrainingArguments.deepspeed``, or ``accelerate launch`` with a DeepSpeed config) is the
user's explicit choice: hf_speedup never edits it. This feature reads it once (ZeRO stage, offload, its own
optimizer, the precision it enables) and the features after it adapt: compile stays off under ZeRO-3 (DeepSpeed
gathers each block's parameters in module hooks, which regional compile would trace into and recompile at every
gather), the optimizer is the config's where it names one, a bitsandbytes 8-bit optimizer a preset asked for
gives way to AdamW (ZeRO partitions torch optimizers' fp32 state, not bitsandbytes' 8-bit one), precision follows
an explicit ``bf16``/``fp16`` block. What cannot hold together is refused before any model work: FSDP and
DeepSpeed at once, several CPU processes without ``use_cpu=True``.

``verify`` reads the engine ``train()`` builds: ``trainer.is_deepspeed_enabled``, the engine's ZeRO stage, the
optimizer it steps and, under ZeRO-3, that every parameter is partitioned.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..config import SpeedupConfigError
from ..plan_types import OFF, Decision, Outcome, PlanContext

NAME = "deepspeed"
APPLIES_TO = "args"  # the TrainingArguments (or the launch) carry it; hf_speedup only adapts to it
EIGHT_BIT = ("adamw_bnb_8bit", "paged_adamw_8bit")


@dataclass(frozen=True)
class Settings:
    stage: int | None = None  # ZeRO stage (0-3)
    offload_optimizer: str | None = None  # device the optimizer state lives on ("cpu", "nvme"), None: the GPU
    offload_param: str | None = None  # ZeRO-3 parameter offload device
    optimizer: str | None = None  # the config's own optimizer type: it steps instead of the Trainer's
    precision: str | None = None  # "bf16"/"fp16" the config enables explicitly (None: "auto" or off)
    source: str = ""  # where the config came from
    fixed_batch: bool = False  # the config sets the batch itself (not "auto"): memory.budget keeps it

    @property
    def offloaded(self) -> bool:
        return bool(self.offload_optimizer or self.offload_param)


def engine_config(args: Any) -> tuple[dict | None, str]:
    """(the DeepSpeed config, where it came from), or (None, "") when the run does not use DeepSpeed."""
    given = getattr(args, "deepspeed", None)  # as the user wrote it ("auto" values unfilled)
    if isinstance(given, dict):
        return given, "TrainingArguments.deepspeed"
    if isinstance(given, (str, os.PathLike)) and os.path.isfile(given):
        with open(given) as f:
            return json.load(f), f"TrainingArguments.deepspeed ({os.fspath(given)})"
    hf_config = getattr(args, "hf_deepspeed_config", None)  # a JSON string, or a config object of its own
    if hf_config is not None:
        return dict(hf_config.config), "TrainingArguments.deepspeed"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path and os.path.isfile(path):
            with open(path) as f:
                return json.load(f), f"accelerate launch ({path})"
        config: dict = {"zero_optimization": {"stage": int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))}}
        for key, env in (("offload_optimizer", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                         ("offload_param", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")):
            if os.environ.get(env, "none") != "none":
                config["zero_optimization"][key] = {"device": os.environ[env]}
        return config, "accelerate launch (deepspeed_config)"
    return None, ""


def _settings(config: dict, source: str) -> Settings:
    zero = config.get("zero_optimization") or {}
    offload = {key: (zero.get(key) or {}).get("device") for key in ("offload_optimizer", "offload_param")}
    precision = next((p for p in ("bf16", "fp16") if (config.get(p) or {}).get("enabled") is True), None)
    fixed = any(config.get(k, "auto") != "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                             "gradient_accumulation_steps"))
    return Settings(stage=int(zero.get("stage", 0)), optimizer=(config.get("optimizer") or {}).get("type"),
                    precision=precision, source=source, fixed_batch=fixed,
                    **{k: (v if v not in (None, "none") else None) for k, v in offload.items()})


def decide(ctx: PlanContext) -> Decision:
    config, source = engine_config(ctx.args)
    if config is None:
        return Decision(NAME, requested="off", applied=OFF, settings=Settings(),
                        reason="not in use (no TrainingArguments.deepspeed, no accelerate DeepSpeed launch)")
    s = _settings(config, source)
    _refuse_what_cannot_hold(ctx, s)
    label = f"zero-{s.stage}"
    offload = ", ".join(f"{k.removeprefix('offload_')} offloaded to {v}" for k, v in
                        (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)) if v)
    reason = (f"{source}: ZeRO stage {s.stage}" + (f" ({offload})" if offload else "")
              + (f", its own optimizer {s.optimizer}" if s.optimizer else "")
              + "; the config is yours: hf_speedup adapts its plan to it and never edits it")
    return Decision(NAME, requested=label, applied=label + ("+offload" if s.offloaded else ""), reason=reason,
                    settings=s)


def _refuse_what_cannot_hold(ctx: PlanContext, s: Settings) -> None:
    problems = []
    if ctx.config.fsdp.enabled is True:
        problems.append(f"fsdp.enabled = True with a DeepSpeed config ({s.source}); allowed: one sharding engine; "
                        "fix: a preset without FSDP (auto, fast, memory, lora), or drop the DeepSpeed config")
    if problems:
        raise SpeedupConfigError(problems)


def training_args(decision: Decision, args) -> dict:
    return {}  # the DeepSpeed config stays the user's


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Nothing before the Trainer exists: accelerate builds the engine when ``train()`` starts."""


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    enabled = bool(getattr(trainer, "is_deepspeed_enabled", False))
    if not decision.active:
        return False, "off" if not enabled else "MISMATCH: DeepSpeed runs, but no DeepSpeed config was planned for"
    if not enabled:
        return False, "the Trainer has no DeepSpeed plugin: the config did not reach accelerate"
    live = getattr(trainer, "model_wrapped", None)  # the DeepSpeedEngine once train() built it
    if not hasattr(live, "zero_optimization_stage"):
        return False, "the DeepSpeed engine is built when train() starts: verified then"
    stage = int(live.zero_optimization_stage())
    opt = getattr(live, "optimizer", None)
    inner = getattr(opt, "optimizer", None)
    outcome.facts.update(live_stage=stage, world_size=int(getattr(live, "world_size", 1)),
                         zero_optimizer=type(opt).__name__ if opt is not None else None,
                         optimizer=type(inner).__name__ if inner is not None else None)
    found = f"engine at ZeRO stage {stage} on {outcome.facts['world_size']} process(es), optimizer " \
            f"{outcome.facts['zero_optimizer']}({outcome.facts['optimizer']})"
    if stage != decision.settings.stage:
        return False, f"MISMATCH: planned ZeRO stage {decision.settings.stage}, {found}"
    if stage == 3:
        params = list(live.module.parameters())
        partitioned = sum(1 for p in params if hasattr(p, "ds_id"))
        outcome.facts["partitioned_parameters"] = f"{partitioned}/{len(params)}"
        if partitioned != len(params):
            return False, f"{found}; only {partitioned}/{len(params)} parameters partitioned"
        found += f"; {partitioned}/{len(params)} parameters partitioned"
    return True, found


def zero_stage(ctx: PlanContext) -> int | None:
    """The ZeRO stage the run trains under (None without DeepSpeed): what the features after this one adapt to."""
    decision = ctx.decisions.get(NAME)
    return decision.settings.stage if decision is not None and decision.active else None


def engine(ctx: PlanContext) -> Settings:
    """The DeepSpeed config's settings as this feature read them (empty without DeepSpeed)."""
    decision = ctx.decisions.get(NAME)
    return decision.settings if decision is not None else Settings()


def adapted(ctx: PlanContext, field: str, asked: Any, why: str, fix: str) -> str:
    """A preset's ``field = asked`` that the DeepSpeed config contradicts: the fallback text (the plan adapts), or,
    under ``deepspeed.strict``, the run refused now with ``fix``."""
    if ctx.config.deepspeed.strict:
        raise SpeedupConfigError([f"{field} = {asked!r} under DeepSpeed ({engine(ctx).source}): {why}; allowed: what "
                                  f"the DeepSpeed config allows; fix: {fix}, or deepspeed.strict: false to adapt"])
    return f"{field}={asked!r} -> adapted to DeepSpeed: {why}"


# the memory model's view of the config (the estimate, memory.budget)
def zero_sharding(ds, world_size: int) -> dict | None:
    """DeepSpeed ZeRO in the memory model's sharding terms: ZeRO-2 keeps the weights whole and shards gradients
    and optimizer state (FSDP's ``shard_grad_op``), ZeRO-3 shards all three (``full_shard``, gathered in the
    weights' own dtype), both offloads under ZeRO-3 keep none of them on the device. None where it does not map
    (ZeRO-0/1, one offload alone: :func:`zero_note` says so)."""
    if ds is None or ds.stage not in (2, 3):
        return None
    both = ds.stage == 3 and bool(ds.offload_optimizer and ds.offload_param)
    return dict(fsdp="shard_grad_op" if ds.stage == 2 else "full_shard", shard_group=max(1, world_size),
                cpu_offload=both, gather_bytes=0)


def zero_note(ds, world_size: int) -> str:
    """How the estimate models the DeepSpeed config (and what it leaves out)."""
    if zero_sharding(ds, world_size) is None:
        return (f"DeepSpeed ZeRO-{ds.stage}: not modelled (estimated unsharded; ZeRO-1 would split the optimizer "
                f"state over {world_size} ranks)")
    what = "gradients and optimizer state" if ds.stage == 2 else "weights, gradients and optimizer state"
    note = f"DeepSpeed ZeRO-{ds.stage}: {what} split over {world_size} ranks"
    if zero_sharding(ds, world_size)["cpu_offload"]:
        note += "; all three offloaded to the CPU (none on the device)"
    elif ds.offload_optimizer or ds.offload_param:
        note += "; one offload alone is not modelled (estimated on the device)"
    return note
