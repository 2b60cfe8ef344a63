"""bf16 / fp16 (+ grad scaling) / fp32 through TrainingArguments; TF32 and cudnn.benchmark on CUDA."""

from __future__ import annotations

from ..plan import Decision, PlanContext

NAME = "precision"


def decide(ctx: PlanContext) -> Decision:
    s, caps = ctx.config.precision, ctx.caps
    return Decision(NAME, requested=s.dtype, applied="fp32", reason="TODO")


def training_args(decision: Decision, args) -> dict:
    return {}


def apply(decision: Decision, setup) -> None:
    pass


def verify(decision: Decision, trainer) -> tuple[bool, str]:
    return False, "TODO"
