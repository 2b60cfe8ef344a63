"""TODO."""

from __future__ import annotations

from ..plan import Decision, PlanContext

NAME = "fsdp"


def decide(ctx: PlanContext) -> Decision:
    return Decision(NAME, requested=None, applied="off", reason="TODO")


def training_args(decision: Decision, args) -> dict:
    return {}


def apply(decision: Decision, setup) -> None:
    pass


def verify(decision: Decision, trainer) -> tuple[bool, str]:
    return False, "TODO"
