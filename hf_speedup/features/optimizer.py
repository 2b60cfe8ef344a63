"""AdamW variant through ``TrainingArguments.optim``: the stock Trainer builds it, we choose and verify.

Fallback chain: 8-bit / paged 8-bit AdamW (bitsandbytes, CUDA) -> fused AdamW (torch, CPU and CUDA)
-> AdamW; with ``optimizer.strict`` a choice that cannot run here is a :class:`SpeedupConfigError`.
``auto`` picks fused AdamW (same update as AdamW, one kernel for all parameters). An ``optim`` the user set in
TrainingArguments wins over every preset (``keep``), and is refused up front where it conflicts with the user's own
``optimizer.name`` or cannot run (a bitsandbytes optimizer under FSDP2).

Engagement rule: ``engaged`` is True iff ``trainer.optimizer`` (unwrapped from accelerate) really is
the fused or 8-bit optimizer the decision stands for. Plain AdamW accelerates nothing and is reported
``engaged: false`` ("plain AdamW in force as planned"). Before the Trainer creates its optimizer (at
train start) verify says "not created yet"; the callback re-verifies at train begin.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..compat import unwrap_optimizer
from ..config import SpeedupConfigError
from ..plan_types import Decision, Outcome, PlanContext
from .deepspeed import adapted, engine, zero_stage
from .explicit_args import users_choice
from .fallback import walk_chain

NAME = "optimizer"
logger = logging.getLogger("hf_speedup")

# our name -> TrainingArguments.optim
TO_HF = {
    "adamw": "adamw_torch",
    "adamw_fused": "adamw_torch_fused",
    "adamw_8bit": "adamw_bnb_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
}
FROM_HF = {v: k for k, v in TO_HF.items()} | {"adamw_8bit": "adamw_8bit"}  # both bnb spellings
CHAIN_TAIL = ("adamw_fused", "adamw")
# what verify must find for each choice
KIND = {"adamw": "plain", "adamw_fused": "fused", "adamw_8bit": "8bit", "paged_adamw_8bit": "paged_8bit"}


@dataclass(frozen=True)
class Settings:
    optim: str  # TrainingArguments.optim the stock Trainer builds the optimizer from
    keep: bool  # the TrainingArguments' own choice stays


# --------------------------------------------------------------------------------------------- decide
def args_optim(args) -> str | None:
    """``TrainingArguments.optim`` as a plain string (it may be an ``OptimizerNames`` enum)."""
    if args is None:
        return None
    value = getattr(args, "optim", None)
    return str(getattr(value, "value", value)) if value is not None else None


def _default_optim() -> str:
    """What a fresh TrainingArguments uses (adamw_torch_fused with torch >= 2.8 in transformers 5)."""
    import dataclasses

    from transformers import TrainingArguments

    field = next(f for f in dataclasses.fields(TrainingArguments) if f.name == "optim")
    return str(getattr(field.default, "value", field.default))


FSDP2_8BIT = ("bitsandbytes' 8-bit optimizer state does not take FSDP2's sharded parameters (its update kernel "
              "gets mixed torch.Tensor and DTensor arguments)")


def runnable(name: str, caps, fsdp2: bool = False) -> tuple[bool, str]:
    if name in ("adamw_8bit", "paged_adamw_8bit"):
        if fsdp2:
            return False, FSDP2_8BIT
        return caps.bitsandbytes, caps.bitsandbytes_reason or "bitsandbytes is not usable here"
    if name == "adamw_fused":
        return caps.fused_adamw, f"torch has no fused AdamW for {caps.device_type} here"
    return True, ""


def _walk_chain(wanted: str, caps, strict: bool, fsdp2: bool = False) -> tuple[str, list[str]]:
    chain = CHAIN_TAIL[CHAIN_TAIL.index(wanted):] if wanted in CHAIN_TAIL else (wanted, *CHAIN_TAIL)

    def strict_error(name: str, why: str) -> SpeedupConfigError:
        allowed = [n for n in TO_HF if runnable(n, caps, fsdp2)[0]] + ["auto", "keep"]
        return SpeedupConfigError([
            f"optimizer.name = {name!r} cannot run on this machine ({why}) and optimizer.strict = true; "
            f"allowed here: {', '.join(repr(a) for a in allowed)}; fix: set optimizer.name: auto (or one of the "
            "allowed values), or optimizer.strict: false to fall back along 8-bit -> fused -> AdamW"
        ])

    return walk_chain(chain, lambda name: runnable(name, caps, fsdp2), strict_error if strict else None)


def _resolve(s, caps, user: str | None, fsdp2: bool = False) -> tuple[str, str, str, list[str], bool]:
    """(our name or the user's raw optim, TrainingArguments.optim, reason, fallbacks, keep the args as they are)
    where the user set no optim of their own (``user`` is the arguments' default then)."""
    if s.name == "keep":
        raw = user or _default_optim()
        return FROM_HF.get(raw, raw), raw, f"keep: TrainingArguments' optim={raw!r}", [], True
    if s.name == "auto":
        name, fallbacks = _walk_chain("adamw_fused", caps, s.strict, fsdp2)
        reason = _why(name, caps) if not fallbacks else f"auto: adamw_fused cannot run here -> {name}"
        return name, TO_HF[name], reason, fallbacks, False
    name, fallbacks = _walk_chain(s.name, caps, s.strict, fsdp2)
    reason = f"{name} as requested: {_why(name, caps)}" if name == s.name else f"{s.name} cannot run here -> {name}"
    return name, TO_HF[name], reason, fallbacks, False


def _why(name: str, caps) -> str:
    return {
        "adamw_fused": f"fused AdamW: one kernel updates every parameter on {caps.device_type} (same math as AdamW)",
        "adamw": "plain AdamW (foreach)",
        "adamw_8bit": "bitsandbytes 8-bit AdamW: optimizer state in 8 bits (~75% less state memory)",
        "paged_adamw_8bit": ("bitsandbytes paged 8-bit AdamW: 8-bit state in CUDA unified memory that pages to "
                             "host under pressure instead of OOM"),
    }[name]


def shards_with_fsdp2(ctx: PlanContext) -> bool:
    fsdp = ctx.decisions.get("fsdp")
    return bool(fsdp is not None and fsdp.active and getattr(fsdp.settings, "version", None) == 2)


BNB_OPTIMS = ("bnb", "8bit")  # TrainingArguments.optim names of bitsandbytes optimizers contain one of these


def _users_optim(ctx: PlanContext) -> tuple[str, str, str, list[str], bool] | None:
    """The resolution for an optim the user set in TrainingArguments (None where they set none): it wins over a
    preset's ``optimizer.name``; it conflicts with one their own config sets; under FSDP2 a bitsandbytes one
    cannot run. Both are refused now, before any heavy work."""
    explicit, value = users_choice(ctx.args, "optim")
    user = args_optim(ctx.args)
    s = ctx.config.optimizer
    if not explicit or s.name == "keep":
        return None
    problems = []
    ours = "optimizer.name" in ctx.config.explicit_fields() and s.name != "auto"
    if ours and TO_HF.get(s.name) != user and FROM_HF.get(user) != s.name:
        problems.append(
            f"optimizer.name = {s.name!r} (your config) and TrainingArguments.optim = {user!r} ask for different "
            f"optimizers; allowed: one choice; fix: drop optim from TrainingArguments, or set optimizer.name: keep "
            "(or auto) to train with it")
    if shards_with_fsdp2(ctx) and any(tag in user for tag in BNB_OPTIMS):
        problems.append(
            f"TrainingArguments.optim = {user!r} cannot run under FSDP2: {FSDP2_8BIT}; allowed: a torch optimizer "
            "(adamw_torch_fused, adamw_torch, ...); fix: drop optim from TrainingArguments (the preset picks fused "
            "AdamW), or shard with fsdp.version: 1")
    if problems:
        raise SpeedupConfigError(problems)
    preset = f"the preset's optimizer.name={s.name!r}" if s.name != "auto" else "auto's choice"
    return (FROM_HF.get(user, user), user, f"kept your TrainingArguments.optim={user!r} over {preset} (an explicit "
            "TrainingArguments choice wins over a preset)", [], True)


def decide(ctx: PlanContext) -> Decision:
    s, caps = ctx.config.optimizer, ctx.caps
    if (deepspeeds := engine(ctx)).optimizer and zero_stage(ctx) is not None:
        return Decision(NAME, requested=s.name, applied=f"deepspeed:{deepspeeds.optimizer}",
                        reason=f"the DeepSpeed config's own optimizer ({deepspeeds.optimizer}) steps: "
                               f"{deepspeeds.source} is an explicit choice, the preset's optimizer is not planned",
                        settings=Settings(optim=args_optim(ctx.args) or _default_optim(), keep=True))
    users = _users_optim(ctx)
    resolved = users or _resolve(s, caps, args_optim(ctx.args), shards_with_fsdp2(ctx))
    if zero_stage(ctx) is not None and any(tag in resolved[1] for tag in BNB_OPTIMS):
        resolved = _under_zero(ctx, resolved, users is not None)
    applied, hf_name, reason, fallbacks, keep = resolved
    if hf_name in ("adamw_bnb_8bit", "paged_adamw_8bit"):
        reason += "; embeddings keep 32-bit state (transformers registers that override)"
    for fb in fallbacks:
        logger.warning("hf_speedup optimizer fallback: %s", fb)
    return Decision(NAME, requested=s.name, applied=applied, reason=reason,
                    settings=Settings(optim=hf_name, keep=keep), fallbacks=tuple(fallbacks))


ZERO_8BIT = ("ZeRO flattens the parameters into partitions it steps itself, and already splits the optimizer state "
             "across processes: bitsandbytes' 8-bit state (and the 32-bit override transformers registers for the "
             "embeddings by parameter) has no place there")


def _under_zero(ctx: PlanContext, resolved: tuple, users: bool) -> tuple:
    """A bitsandbytes 8-bit optimizer under ZeRO: the user's own is refused with the fix; a preset's gives way to
    fused AdamW (where it runs), stated."""
    if users:
        raise SpeedupConfigError([f"TrainingArguments.optim = {resolved[1]!r} under DeepSpeed ZeRO: {ZERO_8BIT}; "
                                  "allowed: a torch optimizer, or an optimizer block in the DeepSpeed config; fix: "
                                  "drop optim from TrainingArguments (the preset picks fused AdamW)"])
    why = adapted(ctx, "optimizer.name", ctx.config.optimizer.name, ZERO_8BIT, "optimizer.name: adamw_fused")
    name, fallbacks = _walk_chain("adamw_fused", ctx.caps, False, shards_with_fsdp2(ctx))
    return name, TO_HF[name], f"{why} -> {name}: {_why(name, ctx.caps)}", [why, *fallbacks], False


# --------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    """``optim`` for the stock Trainer's own optimizer factory; nothing when keeping the user's."""
    if decision.settings.keep:
        return {}
    return {"optim": decision.settings.optim}


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Nothing to do before the Trainer exists: it builds the optimizer from ``args.optim``."""


# --------------------------------------------------------------------------------------------- verify
def describe(opt) -> tuple[str, str]:
    """(kind, text) of a live optimizer: kind in fused | plain | 8bit | paged_8bit | other."""
    import torch

    cls = type(opt)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__.startswith("bitsandbytes"):
        bits = getattr(getattr(opt, "args", None), "optim_bits", None)
        if bits is None:
            bits = 8 if "8bit" in cls.__name__ else 32
        paged = bool(getattr(opt, "is_paged", False))
        text = f"{name}(optim_bits={bits}, is_paged={paged})" + _state_note(opt)
        if bits != 8:
            return "other", text
        if paged and _on_cpu(opt):
            return "8bit", text + " - paging is CUDA-only: bitsandbytes keeps CPU state unpaged"
        return ("paged_8bit" if paged else "8bit"), text
    if isinstance(opt, torch.optim.AdamW) or cls.__name__ == "AdamW":
        group = opt.param_groups[0] if opt.param_groups else {}
        fused = bool(group.get("fused", opt.defaults.get("fused")))
        foreach = group.get("foreach", opt.defaults.get("foreach"))
        return ("fused" if fused else "plain"), f"{name}(fused={fused}, foreach={foreach})"
    return "other", name


def _on_cpu(opt) -> bool:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device.type == "cpu"
    return False


def _state_note(opt) -> str:
    import torch

    states = [s for s in opt.state.values() if "state1" in s]
    if not states:
        return ", state not created yet"
    n8 = sum(1 for s in states if s["state1"].dtype == torch.uint8)
    return f", {n8}/{len(states)} parameter states in 8 bits"


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if getattr(trainer, "optimizer", None) is None:
        return False, "optimizer not created yet (the Trainer builds it at train start; re-verified then)"
    kind, text = describe(unwrap_optimizer(trainer.optimizer))
    if decision.applied.startswith("deepspeed:"):  # the DeepSpeed config's optimizer: whatever class it made
        return bool(getattr(trainer, "is_deepspeed_enabled", False)), f"DeepSpeed steps {text}"
    want = KIND.get(decision.applied)
    if decision.settings.keep or want is None:
        return kind in ("fused", "8bit", "paged_8bit"), f"{text} in force (the TrainingArguments' own choice)"
    if kind != want:
        logger.warning("hf_speedup optimizer: planned %s but found %s", decision.applied, text)
        return False, f"MISMATCH: planned {decision.applied}, found {text}"
    if kind == "plain":
        return False, f"plain AdamW in force as planned: {text}"
    return True, text
