"""Allocator knobs: periodic CUDA ``empty_cache``, ``expandable_segments``, and CPU freed-memory reuse.

- ``memory.empty_cache_steps`` -> ``TrainingArguments.torch_empty_cache_steps`` (the Trainer calls
  ``empty_cache`` every N steps: lower reserved memory and fragmentation, at some step-time cost).
- ``memory.expandable_segments`` -> the allocator grows a few large segments instead of caching many
  fixed-size ones, which cuts fragmentation ("reserved but unallocated" memory) on variable shapes.

Expandable segments are read by torch from ``PYTORCH_CUDA_ALLOC_CONF`` (falling back to
``PYTORCH_ALLOC_CONF`` in torch >= 2.9) when the allocator is first configured. SpeedupTrainer therefore
(1) exports both variables when CUDA is not initialised yet (child processes inherit them) and (2) always
sets the option at run time too (``torch._C._accelerator_setAllocatorSettings``), which torch reads at
every new segment: segments reserved before that (typically the model weights, loaded before the trainer
is built) stay fixed-size, the report says so. For the whole run, set it before launching::

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True accelerate launch train.py
    # or, first thing in the script:  hf_speedup.features.memory.enable_expandable_segments()
    # or:                             os.environ.update(hf_speedup.features.memory.memory_env("memory"))

On CPU neither knob exists (no CUDA caching allocator): reported, not engaged.

- ``memory.cpu_reuse_freed`` (CPU training only) -> glibc keeps freed blocks instead of unmapping them, so
  steady-state steps stop page-faulting on every activation (see :mod:`hf_speedup.cpu_allocator`). On CUDA
  it is not applied (tensors live in the CUDA caching allocator), with that reason.

Engagement rule: ``engaged`` is True iff every requested knob that applies here is verified in force (the
trainer's ``args.torch_empty_cache_steps``, the allocator settings read back from torch, and for the CPU
knob a probe: re-allocating a freed 40 MiB block must not fault its pages in again).
"""

from __future__ import annotations

import logging
import os
from typing import Any, MutableMapping

from ..plan import Decision, PlanContext

NAME = "empty_cache"
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
    from ..plan import resolve_config

    cfg = resolve_config(speedup)
    return allocator_env(True, environ) if cfg.memory.expandable_segments else {}


def cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def enable_expandable_segments(environ: MutableMapping[str, str] | None = None) -> tuple[bool, str]:
    """Turn expandable segments on as early as possible: env (if CUDA is not up yet) + run-time setting.

    Returns (set, how): ``set`` is False only when this torch offers no way to change it at run time and
    CUDA is already initialised.
    """
    from ..compat import set_allocator_settings

    environ = os.environ if environ is None else environ
    early = not cuda_initialized()
    if early:
        environ.update(allocator_env(True, environ))
    live = set_allocator_settings(EXPANDABLE)
    if early:
        return True, f"exported {ENV_VARS[0]}/{ENV_VARS[1]}={environ[ENV_VARS[0]]} before CUDA initialised"
    if live:
        return True, ("set at run time after CUDA initialised: segments reserved before now (e.g. the model "
                      f"weights) stay fixed-size; for the whole run set {ENV_VARS[0]}={EXPANDABLE} before launching")
    return False, (f"CUDA was already initialised and this torch cannot change it at run time; set "
                   f"{ENV_VARS[0]}={EXPANDABLE} before launching, e.g. in the environment of `accelerate launch`")


# --------------------------------------------------------------------------------------------- decide
def _summary(steps: int | None, expandable: bool) -> str:
    parts = ([f"every {steps} steps"] if steps else []) + (["expandable"] if expandable else [])
    return " + ".join(parts) or "off"


CPU_REUSE = "cpu-reuse-freed"
CPU_REUSE_WHY = ("CPU malloc keeps freed blocks mapped (glibc mmap/trim thresholds raised): steady steps reuse "
                 "pages instead of faulting fresh ones in for every activation; resident memory stays at its peak")


def _join(a: str, b: str) -> str:
    return b if a in ("off", "") else f"{a} + {b}"


def decide(ctx: PlanContext) -> Decision:
    decision = _decide_cuda_knobs(ctx)
    decision.settings["cpu_reuse_freed"] = False
    if ctx.config.memory.cpu_reuse_freed:
        _add_cpu_reuse(decision, ctx.caps)
    return decision


def _add_cpu_reuse(decision: Decision, caps) -> None:
    from ..cpu_allocator import unavailable_reason

    had_reason = decision.applied != "off" or bool(decision.fallbacks)  # else the reason is "not requested"
    decision.requested = _join(decision.requested, CPU_REUSE)
    if caps.device_type != "cpu":
        why = f"not applied on {caps.device_type}: tensors live in the device allocator, not CPU malloc"
    else:
        why = unavailable_reason()
    if why:
        decision.fallbacks.append(f"{CPU_REUSE}: {why}")
        logger.info("hf_speedup empty_cache: %s: %s", CPU_REUSE, why)
        text = f"{CPU_REUSE}: {why}"
    else:
        decision.settings["cpu_reuse_freed"] = True
        decision.applied = _join(decision.applied, CPU_REUSE)
        text = CPU_REUSE_WHY
    decision.reason = f"{decision.reason}; {text}" if had_reason else text


def _decide_cuda_knobs(ctx: PlanContext) -> Decision:
    s, caps = ctx.config.memory, ctx.caps
    requested = _summary(s.empty_cache_steps, s.expandable_segments)
    settings = {"empty_cache_steps": None, "expandable_segments": False}
    if requested == "off":
        user = getattr(ctx.args, "torch_empty_cache_steps", None) if ctx.args is not None else None
        note = f" (TrainingArguments' own torch_empty_cache_steps={user} is kept)" if user else ""
        return Decision(NAME, requested="off", applied="off", reason="not requested" + note, settings=settings)
    if caps.device_type != "cuda":
        why = (f"not applicable on {caps.device_type}: no CUDA caching allocator (empty_cache and "
               "expandable_segments only act on CUDA memory)")
        logger.info("hf_speedup empty_cache: %s", why)
        return Decision(NAME, requested=requested, applied="off", reason=why, settings=settings,
                        fallbacks=[f"{requested}: {why}"])
    reasons = []
    if s.empty_cache_steps:
        settings["empty_cache_steps"] = s.empty_cache_steps
        reasons.append(f"torch.cuda.empty_cache() every {s.empty_cache_steps} steps: lower reserved memory and "
                       "fragmentation, at some step-time cost")
    if s.expandable_segments:
        settings["expandable_segments"] = True
        reasons.append("expandable_segments: the allocator grows segments instead of caching fixed-size ones "
                       "(less fragmentation); set before CUDA initialises where possible")
    return Decision(NAME, requested=requested, applied=requested, reason="; ".join(reasons), settings=settings)


# --------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    steps = decision.settings.get("empty_cache_steps")
    return {"torch_empty_cache_steps": steps} if steps else {}


def apply(decision: Decision, setup) -> None:
    if decision.settings.get("cpu_reuse_freed"):
        from ..cpu_allocator import reuse_freed_memory

        ok, how = reuse_freed_memory()
        decision.settings["cpu_reuse_how"] = how
        (logger.info if ok else logger.warning)("hf_speedup empty_cache: %s: %s", CPU_REUSE, how)
    if not decision.settings.get("expandable_segments"):
        return
    ok, how = enable_expandable_segments()
    decision.settings["expandable_how"] = how
    (logger.info if ok else logger.warning)("hf_speedup empty_cache: expandable_segments %s", how)


# --------------------------------------------------------------------------------------------- verify
def _expandable_in_force() -> tuple[bool, str]:
    import torch

    from ..compat import get_allocator_settings

    conf = get_allocator_settings()
    if conf is None:  # torch without a getter: the env is the best evidence there is
        conf = next((os.environ[v] for v in ENV_VARS if os.environ.get(v)), "")
        source = "env"
    else:
        source = "torch allocator settings"
    on = "expandable_segments:true" in conf.replace(" ", "").lower()
    text = f"{source}: {conf!r}"
    if on and torch.cuda.is_available():
        backend = torch.cuda.memory.get_allocator_backend()
        text += f", backend {backend}"
        if backend != "native":
            return False, text + " (cudaMallocAsync ignores expandable_segments)"
        segments = torch.cuda.memory_snapshot()
        n_exp = sum(1 for seg in segments if seg.get("is_expandable"))
        text += f", {n_exp}/{len(segments)} reserved segments expandable so far"
    return on, text


def _cpu_reuse_in_force(how: str | None) -> tuple[bool, str]:
    """Probe: a freed 40 MiB block allocated and written again must not fault its pages in again."""
    from ..cpu_allocator import PROBE_BYTES, reallocation_faults

    faults, pages = reallocation_faults()
    on = faults <= pages // 100
    text = (f"{CPU_REUSE} {'on' if on else 'OFF'}: re-allocating a freed {PROBE_BYTES >> 20} MiB block faulted "
            f"{faults}/{pages} pages in again ({how or 'not applied'})")
    return on, text


def verify(decision: Decision, trainer) -> tuple[bool, str]:
    st = decision.settings
    if not (st.get("empty_cache_steps") or st.get("expandable_segments") or st.get("cpu_reuse_freed")):
        return False, decision.reason
    parts, ok = [], True
    if st.get("cpu_reuse_freed"):
        on, text = _cpu_reuse_in_force(st.get("cpu_reuse_how"))
        ok = ok and on
        parts.append(text)
    if st.get("empty_cache_steps"):
        have = getattr(trainer.args, "torch_empty_cache_steps", None)
        ok = ok and have == st["empty_cache_steps"]
        parts.append(f"args.torch_empty_cache_steps={have}")
    if st.get("expandable_segments"):
        on, text = _expandable_in_force()
        ok = ok and on
        parts.append(f"expandable_segments {'on' if on else 'OFF'} ({text})")
        if st.get("expandable_how"):
            parts.append(st["expandable_how"])
    return bool(ok), "; ".join(parts)
