"""``verify``: the live model's blocks run compiled regions (not fallen back, not stuck at dynamo's recompile
limit, actually called by the training steps), or the reason they do not.
"""

from __future__ import annotations

from ... import compat
from ...plan_types import Decision, Outcome
from ..probe import steps_trained
from .cache import refresh
from .cpu_gemm import cpu_gemm_summary
from .payback import MEASURED_STEPS
from .regions import HEAD_REGIONS, guarded_regions


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    """Each block of the live model runs a compiled (not fallen back) region."""
    if not decision.active:
        return False, decision.reason
    refresh(outcome)  # the run's compile cache hits and misses, from torch's counters
    s = decision.settings
    regions = guarded_regions(trainer.model)
    blocks = [r for r in regions if r.kind not in HEAD_REGIONS]
    gate = regions[0].gate if regions else None
    if gate is not None and not gate.open:
        ready = f"{len(blocks)}/{s.num_blocks} {s.block_class} blocks ready to compile"
        return False, f"{ready}; {gate.verdict}" if gate.declined else (
            f"{ready}, not compiling yet: compile.when = pays_back decides after the first {MEASURED_STEPS + 1} steps")
    fallen = [r for r in regions if r.fallback_reason]
    ok = [r for r in blocks if r.fallback_reason is None]
    how = f"{s.backend}, {s.mode or 'default'}"
    text = f"{len(ok)}/{s.num_blocks} {s.block_class} blocks compiled ({how})"
    head = [r.kind for r in regions if r.kind in HEAD_REGIONS and r.fallback_reason is None]
    if head:
        text += f" + {', '.join(head)}"
    if fallen:
        text += "; fell back to eager: " + "; ".join(f"{r.label}: {r.fallback_reason}" for r in fallen)
    if outcome.facts.get("cpu_gemm", s.cpu_gemm) == "autotune":
        text += f"; {cpu_gemm_summary()}"
    limit = _recompile_limit()
    per_kind: dict[str, int] = {}
    for r in regions:
        per_kind[r.kind] = per_kind.get(r.kind, 0) + r.compiles
    hot = sorted(k for k, n in per_kind.items() if limit and n >= limit)
    if hot:
        fix = ("set compile.dynamic: null (or true), so that new lengths share a graph" if s.dynamic is False else
               "pad batches to a multiple (data.pad_to_multiple_of) or set compile.dynamic: true")
        text += (f"; NOT ENGAGED for new shapes: {', '.join(hot)} hit torch._dynamo recompile_limit={limit}, every "
                 f"new shape after that runs eager; fix: {fix}")
    steps = steps_trained(trainer, outcome)
    idle = steps > 0 and not any(r.calls for r in blocks)
    if idle:
        text += (f"; but no block forward of {steps} training step(s) ran compiled code (the blocks are called "
                 "another way, e.g. inside a torch.compile of the whole model, which traces through them)")
    return bool(ok) and len(ok) == s.num_blocks and not fallen and not hot and not idle, text


def _recompile_limit() -> int | None:
    return compat.dynamo_recompile_limit()
