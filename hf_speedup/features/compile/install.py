"""What ``apply`` installs: every block (and optionally the head) compiled in place as a guarded region, with the
torch.compile arguments of the decision and the CPU GEMM choice settled at run time; and, for
``compile.when: pays_back``, the callback that opens the regions' gate.
"""

from __future__ import annotations

import logging

from ...blocks import find_blocks
from ...plan_types import Decision, Outcome
from .cache import CompileCacheCallback, cached_cost
from .cpu_gemm import cpu_gemm_pass, onednn_fp32_ok
from .payback import CompileGate, PaybackCallback, payback_key
from .regions import _compile_head, compile_module, gate_of

logger = logging.getLogger("hf_speedup")


# --------------------------------------------------------------------------------------------- apply
def compile_kwargs_of(decision: Decision, cpu_gemm: str | None = None) -> dict:
    """torch.compile arguments; the CPU GEMM pass needs ``options`` (torch forbids ``mode`` with them).

    ``cpu_gemm`` is what :func:`settle_cpu_gemm` found at apply time (default: the plan's choice)."""
    s = decision.settings
    kw = dict(backend=s.backend, dynamic=s.dynamic, fullgraph=s.fullgraph)
    if s.backend == "inductor" and s.mode is not None:
        kw["mode"] = s.mode
    if (cpu_gemm or s.cpu_gemm) == "autotune":
        import torch._inductor

        options = dict(torch._inductor.list_mode_options(s.mode or "default", s.dynamic))
        options["post_grad_custom_post_pass"] = cpu_gemm_pass()
        kw.pop("mode", None)
        kw["options"] = options
    return kw


def settle_cpu_gemm(decision: Decision, outcome: Outcome) -> str:
    """The CPU GEMM choice in force: the autotune stays only where oneDNN can be routed to and computes
    true fp32 here (checked at run time); otherwise a recorded fallback to the default BLAS."""
    if decision.settings.cpu_gemm != "autotune":
        return decision.settings.cpu_gemm
    ok, why = onednn_fp32_ok()
    cpu_gemm = "autotune" if ok else "default"
    outcome.facts["cpu_gemm"] = cpu_gemm
    if not ok:
        outcome.fallbacks.append(f"cpu_gemm: {why}; GEMMs stay on the default BLAS")
        logger.info("hf_speedup: CPU GEMM autotune off: %s", why)
    return cpu_gemm


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Compile every block in place (and the head when ``regions='blocks+head'``)."""
    if not decision.active:
        return
    kwargs = compile_kwargs_of(decision, settle_cpu_gemm(decision, outcome))
    gate = CompileGate(open_=decision.settings.when == "always")  # pays_back: PaybackCallback opens it, or not
    blocks = find_blocks(setup.model)
    for i, block in enumerate(blocks):
        compile_module(block, type(block).__name__, f"{type(block).__name__}[{i}]", kwargs, gate)
    head = _compile_head(setup.model, kwargs, gate) if decision.settings.regions == "blocks+head" else []
    outcome.facts["compiled_head"] = head
    logger.info("hf_speedup: compiled %d %s block(s)%s in place (%s)", len(blocks), decision.settings.block_class,
                f" + {', '.join(head)}" if head else "", ", ".join(f"{k}={v}" for k, v in kwargs.items()))


def callbacks(decision: Decision, trainer, outcome: Outcome) -> list:
    """The compile cache's (loaded at train begin, before ``pays_back`` weighs the compile's cost, and saved with the
    checkpoints); ``pays_back``: the callback that times the first steps and opens the regions' gate, or declines."""
    if not decision.active:
        return []
    out: list = [CompileCacheCallback(trainer, decision, outcome)]
    if decision.settings.when == "pays_back":
        plan = trainer.speedup_plan
        out.append(PaybackCallback(trainer, outcome, plan.caps, gate_of,
                                   static_shapes=decision.settings.dynamic is not True,
                                   key=payback_key(plan.caps, plan.model, plan.config.compile),
                                   cached_cost=cached_cost))
    return out
