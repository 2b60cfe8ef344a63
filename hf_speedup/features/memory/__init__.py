"""Allocator knobs: periodic CUDA ``empty_cache``, ``expandable_segments``, and CPU freed-memory reuse.

- ``memory.empty_cache_steps`` -> ``TrainingArguments.torch_empty_cache_steps`` (the Trainer calls
  ``empty_cache`` every N steps: lower reserved memory and fragmentation, at some step-time cost).
- ``memory.expandable_segments`` -> the allocator grows a few large segments instead of caching many
  fixed-size ones, which cuts fragmentation ("reserved but unallocated" memory) on variable shapes.

Expandable segments are read by torch from ``PYTORCH_CUDA_ALLOC_CONF`` (falling back to
``PYTORCH_ALLOC_CONF`` in torch >= 2.9) when the allocator is first configured. SpeedupTrainer therefore
(1) exports both variables when CUDA is not initialised yet (child processes inherit them) and (2) always
sets the option at run time too (``torch._C._accelerator_setAllocatorSettings``), which torch reads at
every new segment. On a GPU, CUDA is initialised before the trainer applies it (by TrainingArguments and the
hardware probe), so the variables are too late there and the run-time setting is what acts: segments
reserved before it (typically the model weights, loaded before the trainer is built) stay fixed-size, the
report says how many. For the whole run, set it before launching::

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True accelerate launch train.py
    # or, first thing in the script:  hf_speedup.features.memory.enable_expandable_segments()
    # or:                             os.environ.update(hf_speedup.features.memory.memory_env("memory"))

On CPU neither knob exists (no CUDA caching allocator): reported, not engaged.

- ``memory.cpu_reuse_freed`` (CPU training only) -> glibc keeps freed blocks instead of unmapping them, so
  steady-state steps stop page-faulting on every activation (see :mod:`hf_speedup.cpu_allocator`). On CUDA
  it is not applied (tensors live in the CUDA caching allocator), with that reason.

Engagement rule: ``engaged`` is True iff every requested knob that applies here is verified in force (the
trainer's ``args.torch_empty_cache_steps``; the allocator settings read back from torch and, once the
allocator reserved segments after the setting, at least one of them expandable; for the CPU knob a probe:
re-allocating a freed 40 MiB block must not fault its pages in again).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, MutableMapping

from ...compat import get_allocator_settings, set_allocator_settings
from ...cpu_allocator import PROBE_BYTES, reallocation_faults, reuse_freed_memory, unavailable_reason
from ...plan_types import OFF, Decision, Outcome, PlanContext
from ...presets import resolve
from ..explicit_args import users_choice
from . import budget as memory_budget
from . import length as memory_length

NAME = "memory"
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the order torch's CUDA allocator reads them
EXPANDABLE = "expandable_segments:True"
logger = logging.getLogger("hf_speedup")


# ---------------------------------------------------------------------------------- allocator env
def _merge(conf: str, key: str, value: str) -> str:
    items = [kv.strip() for kv in conf.split(",") if kv.strip() and kv.split(":", 1)[0].strip() != key]
    return ",".join(items + [f"{key}:{value}"])


def allocator_env(expandable_segments: bool = True, environ: MutableMapping[str, str] | None = None) -> dict:
    """The allocator env vars with ``expandable_segments`` set, keeping every other setting already there.

    Both names get the same value: torch's CUDA allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` first and
    ignores ``PYTORCH_ALLOC_CONF`` when the former is set, so writing only one could drop the other's
    settings.
    """
    environ = os.environ if environ is None else environ
    current = next((environ[v] for v in ENV_VARS if environ.get(v)), "")
    conf = _merge(current, "expandable_segments", "True" if expandable_segments else "False")
    return {v: conf for v in ENV_VARS}


def memory_env(speedup: Any = "memory", environ: MutableMapping[str, str] | None = None) -> dict:
    """Env vars a launcher must export for ``speedup``'s allocator settings ({} when it asks for none).

    For ``accelerate launch`` (its YAML has no env section): ``export`` these before launching, or
    ``os.environ.update(memory_env(...))`` before CUDA is touched.
    """
    cfg = resolve(speedup)
    return allocator_env(True, environ) if cfg.memory.expandable_segments else {}


def cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def _cuda_segments() -> list[dict]:
    """The CUDA caching allocator's segments now (none before CUDA initialises: no query initialises it)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(torch.cuda.memory_snapshot())


def enable_expandable_segments(environ: MutableMapping[str, str] | None = None) -> tuple[bool, str]:
    """Turn expandable segments on as early as possible: env (if CUDA is not up yet) + run-time setting.

    torch reads the env once, when CUDA initialises (the hardware probe of a GPU run does that, and so do
    TrainingArguments built on a GPU); the run-time setting applies to every segment the allocator reserves
    from then on. Returns (set, how): ``set`` is False only when this torch offers no way to change it at
    run time and CUDA is already initialised; ``how`` says which segments it reaches.
    """
    environ = os.environ if environ is None else environ
    early = not cuda_initialized()
    if early:
        environ.update(allocator_env(True, environ))
    # torch resets every allocator option the string leaves out, so the user's others go in with ours
    in_force = get_allocator_settings() or next((environ[v] for v in ENV_VARS if environ.get(v)), "")
    live = set_allocator_settings(_merge(in_force, "expandable_segments", "True"))
    if early:
        return True, f"exported {ENV_VARS[0]}/{ENV_VARS[1]}={environ[ENV_VARS[0]]} before CUDA initialised"
    if not live:
        return False, (f"CUDA was already initialised and this torch cannot change it at run time; set "
                       f"{ENV_VARS[0]}={EXPANDABLE} before launching, e.g. in the environment of `accelerate launch`")
    before = _cuda_segments()
    if not before:
        return True, ("set at run time after CUDA initialised (too late for the environment variable, which torch "
                      "read then) but before the first CUDA allocation: every segment is expandable")
    held = sum(int(seg.get("total_size", 0)) for seg in before)
    return True, (f"set at run time after CUDA initialised: the {len(before)} segment(s) reserved before now "
                  f"({held / 2**30:.2f} GiB, e.g. the model weights) stay fixed-size; for the whole run set "
                  f"{ENV_VARS[0]}={EXPANDABLE} before launching")


def segment_addresses() -> list[int]:
    """Addresses of the segments reserved so far: those the run-time setting cannot reach."""
    return [int(seg.get("address", 0)) for seg in _cuda_segments()]


# --------------------------------------------------------------------------------------------- decide
@dataclass(frozen=True)
class Settings:
    empty_cache_steps: int | None = None  # CUDA only
    expandable_segments: bool = False  # CUDA only
    cpu_reuse_freed: bool = False  # CPU training on glibc only
    activation_offloading: bool = False  # CUDA, trainers whose arguments have it (TRL's SFTConfig)
    budget: Any = None  # memory_budget.BudgetFit: what memory.budget tried and chose
    track_live_tensors: bool = False  # the report tracks one step's live tensors (torch's MemTracker)


def _summary(steps: int | None, expandable: bool) -> str:
    parts = ([f"every {steps} steps"] if steps else []) + (["expandable"] if expandable else [])
    return " + ".join(parts) or OFF


CPU_REUSE = "cpu-reuse-freed"
CPU_REUSE_WHY = ("CPU malloc keeps freed blocks mapped (glibc mmap/trim thresholds raised): steady steps reuse "
                 "pages instead of faulting fresh ones in for every activation; resident memory stays at its peak")


def _join(a: str, b: str) -> str:
    return b if a in (OFF, "") else f"{a} + {b}"


def decide(ctx: PlanContext) -> Decision:
    cuda = _decide_cuda_knobs(ctx)
    decision = _with_cpu_reuse(cuda, ctx.caps) if ctx.config.memory.cpu_reuse_freed else cuda
    decision = _with_tracking(_with_budget(_with_offloading(decision, ctx), ctx), ctx)
    memory_length.attention_at_length(ctx, decision)  # quadratic attention: the longest row that fits, said there
    return decision


def _add_reason(decision: Decision, text: str) -> str:
    had = decision.applied != OFF or bool(decision.fallbacks)  # else the reason is "not requested"
    return f"{decision.reason}; {text}" if had else text


def _with_budget(decision: Decision, ctx: PlanContext) -> Decision:
    """memory.budget: the fit is searched (and the plan amended) here, before any model work."""
    if ctx.config.memory.budget is None:
        return decision
    fit, why_not = memory_budget.fit(ctx)
    if fit is None:
        logger.warning("hf_speedup memory: %s", why_not)
        return decision.replace(reason=_add_reason(decision, why_not),
                                fallbacks=decision.fallbacks + (f"budget: {why_not}",))
    text = memory_budget.describe(fit)
    changed = memory_budget.amend(ctx, fit)
    if fit.micro_batch is not None:
        mb, ga = (getattr(ctx.args, "per_device_train_batch_size", 8),
                  getattr(ctx.args, "gradient_accumulation_steps", 1))
        changed.insert(0, f"micro-batch {mb} x {ga} accumulation -> {fit.micro_batch} x {fit.grad_accum} "
                          "(TrainingArguments per_device_train_batch_size, gradient_accumulation_steps; the "
                          "effective batch is kept)")
    if changed:
        text += "; changes: " + ", ".join(changed)
        logger.info("hf_speedup memory: %s", text)
    label = f"budget {memory_budget.fmt_bytes(fit.budget_bytes)}" + (": fitted" if fit.changed else "")
    return decision.replace(applied=_join(decision.applied, label) if fit.changed else decision.applied,
                            reason=_add_reason(decision, text),
                            settings=dataclasses.replace(decision.settings, budget=fit))


TRACK_WHY = ("one training step's peak of live tensor bytes measured with torch's MemTracker (that step runs "
             "slower and is left out of the steady-state figures)")


def _with_tracking(decision: Decision, ctx: PlanContext) -> Decision:
    if not ctx.config.memory.track_live_tensors:
        return decision
    return decision.replace(reason=_add_reason(decision, TRACK_WHY),
                            settings=dataclasses.replace(decision.settings, track_live_tensors=True))


OFFLOAD = "offload-activations"


def _with_offloading(decision: Decision, ctx: PlanContext) -> Decision:
    """TRL's ``activation_offloading``: saved activations in pinned host memory, streamed back for backward."""
    asked = ctx.config.memory.activation_offloading
    if asked is False:
        return decision
    has_field = "activation_offloading" in getattr(ctx.args, "__dataclass_fields__", {})
    why = ("" if has_field and ctx.caps.is_cuda else
           f"needs CUDA (this is {ctx.caps.device_type})" if has_field else
           "only TRL trainers offload activations (their SFTConfig.activation_offloading); these arguments have none")
    if why:
        if asked is not True:
            return decision
        logger.info("hf_speedup memory: %s: %s", OFFLOAD, why)
        return decision.replace(fallbacks=decision.fallbacks + (f"{OFFLOAD}: {why}",))
    text = ("activation_offloading: TRL keeps the saved activations in pinned host memory and streams them back "
            "for backward (less GPU memory, some step time)")
    had = decision.applied != OFF
    settings = decision.settings if decision.settings is not None else Settings()
    return decision.replace(applied=_join(decision.applied, OFFLOAD),
                            reason=f"{decision.reason}; {text}" if had else text,
                            settings=Settings(settings.empty_cache_steps, settings.expandable_segments,
                                              settings.cpu_reuse_freed, activation_offloading=True))


def _with_cpu_reuse(decision: Decision, caps) -> Decision:
    had_reason = decision.applied != OFF or bool(decision.fallbacks)  # else the reason is "not requested"
    why = (f"not applied on {caps.device_type}: tensors live in the device allocator, not CPU malloc"
           if caps.device_type != "cpu" else unavailable_reason())
    changes: dict = {"requested": _join(decision.requested, CPU_REUSE)}
    if why:
        changes["fallbacks"] = decision.fallbacks + (f"{CPU_REUSE}: {why}",)
        logger.info("hf_speedup memory: %s: %s", CPU_REUSE, why)
        text = f"{CPU_REUSE}: {why}"
    else:
        changes["settings"] = Settings(decision.settings.empty_cache_steps, decision.settings.expandable_segments,
                                       cpu_reuse_freed=True)
        changes["applied"] = _join(decision.applied, CPU_REUSE)
        text = CPU_REUSE_WHY
    changes["reason"] = f"{decision.reason}; {text}" if had_reason else text
    return decision.replace(**changes)


def _decide_cuda_knobs(ctx: PlanContext) -> Decision:
    s, caps = ctx.config.memory, ctx.caps
    requested = _summary(s.empty_cache_steps, s.expandable_segments)
    if requested == OFF:
        user = getattr(ctx.args, "torch_empty_cache_steps", None) if ctx.args is not None else None
        note = f" (TrainingArguments' own torch_empty_cache_steps={user} is kept)" if user else ""
        return Decision(NAME, requested=OFF, applied=OFF, reason="not requested" + note, settings=Settings())
    if caps.device_type != "cuda":
        why = (f"not applicable on {caps.device_type}: no CUDA caching allocator (empty_cache and "
               "expandable_segments only act on CUDA memory)")
        logger.info("hf_speedup memory: %s", why)
        return Decision(NAME, requested=requested, applied=OFF, reason=why, settings=Settings(),
                        fallbacks=(f"{requested}: {why}",))
    reasons = []
    steps = s.empty_cache_steps
    explicit, users = users_choice(ctx.args, "torch_empty_cache_steps")
    if steps and explicit and "memory.empty_cache_steps" not in ctx.config.explicit_fields():
        reasons.append(f"kept your TrainingArguments.torch_empty_cache_steps={users} over the preset's {steps} (an "
                       "explicit TrainingArguments choice wins over a preset)")
        steps = None
    if steps:
        reasons.append(f"torch.cuda.empty_cache() every {steps} steps: lower reserved memory and "
                       "fragmentation, at some step-time cost")
    if s.expandable_segments:
        reasons.append("expandable_segments: the allocator grows segments instead of caching fixed-size ones "
                       "(less fragmentation); set before CUDA initialises where possible")
    return Decision(NAME, requested=requested, applied=_summary(steps, s.expandable_segments),
                    reason="; ".join(reasons),
                    settings=Settings(empty_cache_steps=steps or None, expandable_segments=bool(s.expandable_segments)))


# --------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    steps = decision.settings.empty_cache_steps
    out = {"torch_empty_cache_steps": steps} if steps else {}
    fit = decision.settings.budget
    if fit is not None and fit.micro_batch is not None:  # the effective batch is kept
        out.update(per_device_train_batch_size=fit.micro_batch, gradient_accumulation_steps=fit.grad_accum)
    if decision.settings.activation_offloading:
        out["activation_offloading"] = True
    return out


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    if decision.settings.cpu_reuse_freed:
        ok, how = reuse_freed_memory()
        outcome.facts["cpu_reuse_how"] = how
        (logger.info if ok else logger.warning)("hf_speedup memory: %s: %s", CPU_REUSE, how)
    if not decision.settings.expandable_segments:
        return
    ok, how = enable_expandable_segments()
    outcome.facts.update(expandable_how=how, expandable_set=ok, segments_before=segment_addresses())
    (logger.info if ok else logger.warning)("hf_speedup memory: expandable_segments %s", how)


# --------------------------------------------------------------------------------------------- verify
def _expandable_in_force(outcome: Outcome) -> tuple[bool, str]:
    """The settings read back from torch, and the proof: the segments reserved since the setting are expandable.

    Segments reserved before it (``segments_before``) cannot be. Where later segments exist and none is
    expandable the setting did not take (cudaMallocAsync, a driver without virtual memory management: torch
    then warns "expandable_segments not supported on this platform" and reserves fixed-size segments).
    """
    import torch

    conf = get_allocator_settings()
    if conf is None:  # torch < 2.9 has no getter: what was set, and the env
        conf = next((os.environ[v] for v in ENV_VARS if os.environ.get(v)), "")
        on = outcome.facts.get("expandable_set", False) or "expandable_segments:true" in conf.replace(" ", "").lower()
        text = f"set at run time: {bool(outcome.facts.get('expandable_set'))}, env: {conf!r}"
    else:
        on = "expandable_segments:true" in conf.replace(" ", "").lower()
        text = f"torch allocator settings: {conf!r}"
    if not (on and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return on, text
    backend = torch.cuda.memory.get_allocator_backend()
    text += f", backend {backend}"
    if backend != "native":
        return False, text + " (cudaMallocAsync ignores expandable_segments)"
    before = set(outcome.facts.get("segments_before", ()))
    segments = _cuda_segments()
    since = [seg for seg in segments if int(seg.get("address", 0)) not in before]
    n_exp = sum(1 for seg in since if seg.get("is_expandable"))
    text += (f", {n_exp}/{len(since)} segments reserved since the setting expandable"
             + (f" ({len(segments) - len(since)} reserved before it stay fixed-size)" if len(since) < len(segments)
                else ""))
    if since and not n_exp:
        return False, text + (" -> NOT in force: the allocator reserves fixed-size segments (this platform or "
                              "allocator does not support expandable segments)")
    return True, text


def _cpu_reuse_in_force(how: str | None) -> tuple[bool, str]:
    """Probe: a freed 40 MiB block allocated and written again must not fault its pages in again."""
    faults, pages = reallocation_faults()
    on = faults <= pages // 100
    text = (f"{CPU_REUSE} {'on' if on else 'OFF'}: re-allocating a freed {PROBE_BYTES >> 20} MiB block faulted "
            f"{faults}/{pages} pages in again ({how or 'not applied'})")
    return on, text


def _budget_in_force(fit, trainer) -> tuple[bool, str]:
    """The micro-batch the budget chose is the trainer's; its other changes are verified in their own entries."""
    text = f"memory.budget: predicted {memory_budget.fmt_bytes(fit.predicted_bytes)}"
    if fit.micro_batch is None:
        return True, text + " (checkpointing/optimizer/loss changes: see their entries)"
    have = (getattr(trainer.args, "per_device_train_batch_size", None),
            getattr(trainer.args, "gradient_accumulation_steps", None))
    on = have == (fit.micro_batch, fit.grad_accum)
    return on, text + f"; args micro-batch {have[0]} x accumulation {have[1]}" + (
        "" if on else f" (MISMATCH: planned {fit.micro_batch} x {fit.grad_accum})")


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    st = decision.settings
    fit = st.budget if st.budget is not None and st.budget.changed else None
    if not (st.empty_cache_steps or st.expandable_segments or st.cpu_reuse_freed or st.activation_offloading or fit):
        return False, decision.reason
    parts, ok = [], True
    if fit is not None:
        on, text = _budget_in_force(fit, trainer)
        ok = ok and on
        parts.append(text)
    if st.activation_offloading:
        ctx = type(getattr(trainer, "maybe_activation_offload_context", None)).__name__
        on = bool(getattr(trainer.args, "activation_offloading", False)) and ctx != "nullcontext"
        ok = ok and on
        parts.append(f"args.activation_offloading={getattr(trainer.args, 'activation_offloading', None)}, "
                     f"offload context {ctx}")
    if st.cpu_reuse_freed:
        on, text = _cpu_reuse_in_force(outcome.facts.get("cpu_reuse_how"))
        ok = ok and on
        parts.append(text)
    if st.empty_cache_steps:
        have = getattr(trainer.args, "torch_empty_cache_steps", None)
        ok = ok and have == st.empty_cache_steps
        parts.append(f"args.torch_empty_cache_steps={have}")
    if st.expandable_segments:
        on, text = _expandable_in_force(outcome)
        ok = ok and on
        parts.append(f"expandable_segments {'on' if on else 'OFF'} ({text})")
        if outcome.facts.get("expandable_how"):
            parts.append(outcome.facts["expandable_how"])
    return bool(ok), "; ".join(parts)
