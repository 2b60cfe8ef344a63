"""Sequence parallelism on several GPUs: every row's tokens split over a group of ranks, so a sequence too long for
one device trains on several. Asked for the way accelerate and transformers take it, never by a preset:
``TrainingArguments.parallelism_config`` (an accelerate ``ParallelismConfig``) or the ``parallelism_config``
section of an ``accelerate launch`` config (its ``PARALLELISM_CONFIG_*`` environment):

- ``cp_size > 1`` (backend ``torch``): torch's context parallelism inside accelerate's FSDP2 (ring attention over
  SDPA; rows keep one causal mask each, so no packed or padding-free rows);
- ``sp_size > 1`` (backend ``deepspeed``): DeepSpeed's Ulysses (ALST): attention heads split over the ranks, so the
  heads must divide among them; needs a DeepSpeed engine.

This feature plans it: it names the layout and what each rank then holds, makes ``data`` keep rows unpacked and
``attention`` pick a kernel the backend takes, and refuses, before any model work and with the fix, every
combination that cannot run: no FSDP2 under ``cp``, no DeepSpeed under ``sp``, both at once, CPU processes, a kernel
or packing the user chose that the backend cannot take, heads that do not divide. It applies nothing itself:
accelerate and the Trainer split the rows. Not run on GPUs by this project yet (docs/features/long-context.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import SpeedupConfigError
from ..plan_types import OFF, Decision, Outcome, PlanContext
from .deepspeed import zero_stage

NAME = "sequence_parallel"
CP_KERNELS = ("sdpa",)  # torch's context parallelism replaces SDPA's calls (transformers checks it)
SP_KERNELS = ("flash_attention_3", "flash_attention_2", "sdpa")  # Ulysses wraps these (accelerate's allowed list)


@dataclass(frozen=True)
class Settings:
    kind: str | None = None  # context (torch, FSDP2) | ulysses (DeepSpeed) | None
    degree: int = 1  # ranks each row is split over
    source: str = ""  # where the request came from


def requested(args) -> tuple[int, int, str]:
    """(cp_size, sp_size, where they came from) of the TrainingArguments' ParallelismConfig, else the launcher's."""
    pc = getattr(args, "parallelism_config", None) if args is not None else None
    if pc is not None:
        return int(getattr(pc, "cp_size", 1) or 1), int(getattr(pc, "sp_size", 1) or 1), \
            "TrainingArguments.parallelism_config"
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() in ("1", "true", "yes"):
        try:
            cp = int(os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1"))
            sp = int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1"))
        except ValueError:
            return 1, 1, ""
        return cp, sp, "the accelerate launch config's parallelism_config"
    return 1, 1, ""


def active_kind(ctx: PlanContext) -> str | None:
    """What ``data`` and ``attention`` adapt to: 'context', 'ulysses' or None."""
    decision = ctx.decisions.get(NAME)
    return decision.settings.kind if decision is not None and decision.active else None


def allowed_kernels(ctx: PlanContext) -> tuple[str, ...] | None:
    kind = active_kind(ctx)
    return CP_KERNELS if kind == "context" else SP_KERNELS if kind == "ulysses" else None


def decide(ctx: PlanContext) -> Decision:
    cp, sp, source = requested(ctx.args)
    asked = {"cp_size": cp, "sp_size": sp}
    if cp <= 1 and sp <= 1:
        return Decision(NAME, asked, OFF, settings=Settings(),
                        reason="not asked for (parallelism_config with cp_size or sp_size > 1, several GPUs)")
    if ctx.config.sequence_parallel.enabled is False:
        return Decision(NAME, asked, OFF, settings=Settings(source=source),
                        reason=f"{source} asks for cp_size={cp}, sp_size={sp}; sequence_parallel.enabled: false leaves "
                               "it to accelerate and the Trainer, unplanned and unchecked")
    problems = _problems(ctx, cp, sp, source)
    if problems:
        raise SpeedupConfigError(problems)
    if cp > 1:
        return Decision(NAME, asked, f"context x{cp}", settings=Settings("context", cp, source),
                        reason=f"context parallelism over {cp} ranks ({source}; torch's, inside FSDP2): each rank "
                               f"holds 1/{cp} of every row's tokens and its activations; attention runs as SDPA "
                               "(ring attention), rows stay unpacked; not run on GPUs by hf_speedup yet")
    return Decision(NAME, asked, f"ulysses x{sp}", settings=Settings("ulysses", sp, source),
                    reason=f"DeepSpeed Ulysses over {sp} ranks ({source}): each rank holds 1/{sp} of every row's "
                           f"tokens, and 1/{sp} of the attention heads while attention runs; rows stay unpacked; "
                           "not run on GPUs by hf_speedup yet")


def _problems(ctx: PlanContext, cp: int, sp: int, source: str) -> list[str]:
    cfg, out = ctx.config, []
    where = f"{source} asks for cp_size={cp}, sp_size={sp}"
    if cp > 1 and sp > 1:
        out.append(f"{where}: one of them at a time (accelerate refuses both); allowed: cp_size > 1 (FSDP2) or "
                   "sp_size > 1 (DeepSpeed); fix: set parallelism_config_sp_size: 1 or parallelism_config_cp_size: 1")
    if ctx.caps.device_type != "cuda":
        out.append(f"{where} on {ctx.caps.device_type} processes: sequence parallelism runs on CUDA GPUs (NCCL, "
                   "FSDP2's or DeepSpeed's accelerator path); allowed here: cp_size 1 and sp_size 1; fix: drop them "
                   "from the parallelism_config, or launch on GPUs")
    fsdp = ctx.decisions.get("fsdp")
    fsdp2 = fsdp is not None and fsdp.active and getattr(fsdp.settings, "version", 2) == 2
    if cp > 1 and not fsdp2:
        out.append(f"{where}: context parallelism runs inside accelerate's FSDP2, and this plan has no FSDP2 "
                   f"({fsdp.reason if fsdp is not None else 'no fsdp decision'}); allowed: FSDP2 with cp_size > 1; "
                   "fix: speedup={'base': 'long', 'fsdp': {'enabled': True}} (or launch with "
                   "configs/accelerate/long_context_parallel.yaml)")
    if cp > 1 and zero_stage(ctx) is not None:
        out.append(f"{where}: context parallelism is FSDP2's, and the run uses DeepSpeed; allowed: sp_size with "
                   "DeepSpeed (Ulysses) or cp_size with FSDP2; fix: set parallelism_config_sp_size instead of cp_size, "
                   "or drop the DeepSpeed config")
    if sp > 1 and zero_stage(ctx) is None:
        out.append(f"{where}: Ulysses (sp_backend deepspeed) needs a DeepSpeed engine and the run has none; allowed: "
                   "a DeepSpeed config with sp_size > 1, or cp_size with FSDP2; fix: pass TrainingArguments.deepspeed"
                   " (e.g. configs/deepspeed/zero3.json), or use cp_size")
    kernels = CP_KERNELS if cp > 1 else SP_KERNELS
    impl = cfg.attention.implementation
    if impl not in ("auto", "keep") + kernels:
        out.append(f"attention.implementation = {impl!r} cannot run under {where}; allowed: 'auto', "
                   f"{', '.join(repr(k) for k in kernels)}; fix: attention.implementation: auto")
    if cfg.data.padding_free is True or cfg.data.packing:
        field = "data.padding_free" if cfg.data.padding_free is True else "data.packing"
        out.append(f"{field} = true cannot run under {where}: the rows are split by position over the ranks, each "
                   f"keeping one causal mask; allowed: {field}: auto or false; fix: {field}: false")
    info = ctx.model
    if sp > 1 and info is not None and info.shape is not None:
        heads, kv = info.shape.num_heads, info.shape.num_kv_heads
        if heads % sp or (kv % sp and sp % kv):
            out.append(f"{where}: Ulysses splits the attention heads over the ranks, and {info.architecture} has "
                       f"{heads} query and {kv} key/value heads; allowed: sp_size dividing {heads} (key/value heads "
                       f"divisible by it, or dividing it); fix: parallelism_config_sp_size: "
                       f"{_largest_divisor(heads, kv, sp)}")
    return out


def _largest_divisor(heads: int, kv: int, upto: int) -> int:
    return max(d for d in range(1, upto + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0))


def training_args(decision: Decision, args) -> dict:
    return {}


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    return None  # accelerate and the Trainer split the rows


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.active:
        return False, "off"
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    size = getattr(pc, "cp_size" if decision.settings.kind == "context" else "sp_size", 1) if pc is not None else 1
    if size != decision.settings.degree:
        return False, f"the Trainer's accelerator has no {decision.settings.kind} parallelism of {decision.settings.degree}"
    return True, f"the Trainer's accelerator splits each row over {size} ranks ({decision.settings.kind})"
