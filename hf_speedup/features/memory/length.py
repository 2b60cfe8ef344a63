"""The longest sequence a plan fits in memory, and the attention at length it is asked of before the run.

:func:`longest` searches a length on the estimate itself: the memory model is linear in the length only
piecewise (the loss chunk grows until it is full; eager attention keeps ``heads x length`` scores per token, so
its memory is quadratic in the length), so no slope is extrapolated. ``estimate.longest_sequence`` (``hf-speedup
estimate --max-seq-len``) and :func:`attention_at_length` use it.

:func:`attention_at_length`: where the model's attention is a kernel whose memory is quadratic in the length
(``eager``: the one left for a model without SDPA support, or with Gemma 2's attention-logit softcapping, which
SDPA cannot apply), the plan states the longest row that fits, in the attention entry's reason, with a logged
warning when the known length does not fit; under ``attention.strict`` that is an error, before any model work.
It speaks only where a length is known (``memory.seq_len``, else the arguments' ``max_length`` /
``max_seq_length``), against ``memory.budget`` where one is set, else the device's memory, and says which.
"""

from __future__ import annotations

import logging
from typing import Callable

from ...config import SpeedupConfigError
from ...memory_model import estimate, fmt_bytes
from ...plan_types import Decision, PlanContext

logger = logging.getLogger("hf_speedup")

LIMIT = 1 << 26  # tokens per row searched at most (67M): beyond, the answer is "at least this"
QUADRATIC = {"eager": "the model's matmul-softmax attention keeps heads x length fp32 scores per token in every "
                      "block (and their 16-bit copy under autocast): memory quadratic in the length"}


def longest(fits: Callable[[int], bool], step: int = 1, limit: int = LIMIT) -> tuple[int | None, bool]:
    """(the largest multiple of ``step`` up to ``limit`` that ``fits``, whether ``limit`` still fits): doubling,
    then bisection; (None, False) where ``step`` tokens do not fit already."""
    if not fits(step):
        return None, False
    top = max(1, limit // step)
    low, high = 1, 2
    while high <= top and fits(high * step):
        low, high = high, high * 2
    if high > top:
        if fits(top * step):
            return top * step, True
        high = top
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid)
    return low * step, False


def known_length(ctx: PlanContext) -> tuple[int | None, str]:
    """(tokens per row, where from): ``memory.seq_len``, else the arguments' ``max_length`` / ``max_seq_length``."""
    if ctx.config.memory.seq_len:
        return ctx.config.memory.seq_len, "memory.seq_len"
    for name in ("max_length", "max_seq_length"):
        v = getattr(ctx.args, name, None) if ctx.args is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, f"the arguments' {name}"
    return None, ""


def _budget(ctx: PlanContext) -> tuple[int | None, str]:
    from .budget import budget_bytes

    if ctx.config.memory.budget is not None:
        n, text = budget_bytes(ctx.config.memory.budget, ctx.caps)
        return n, f"memory.budget: {text}"
    device = ctx.caps.memory_bytes
    return (device, f"the memory of {ctx.caps.device_name} ({ctx.caps.device_type})") if device else (None, "")


def attention_at_length(ctx: PlanContext, memory: Decision) -> None:
    """The longest row the plan fits with quadratic attention, in the attention entry (see the module docstring);
    a SpeedupConfigError under ``attention.strict`` where the known length does not fit. ``memory``: the memory
    feature's decision (the micro-batch memory.budget chose)."""
    from .budget import loss_would_chunk, training_setup

    att, info = ctx.decisions.get("attention"), ctx.model
    shape = getattr(info, "shape", None)
    if att is None or shape is None:
        return
    kernel = (att.settings.implementation if att.active else None) or att.settings.previous or shape.attention
    seq, seq_from = known_length(ctx)
    budget, budget_from = _budget(ctx)
    if kernel not in QUADRATIC or seq is None or budget is None:
        return
    fit = getattr(memory.settings, "budget", None)
    micro = (fit.micro_batch if fit is not None and fit.micro_batch else None) or int(
        getattr(ctx.args, "per_device_train_batch_size", 1) or 1)
    effective = micro * int(getattr(ctx.args, "gradient_accumulation_steps", 1) or 1)
    chunked = loss_would_chunk(ctx, ctx.config)
    chunk = getattr(getattr(ctx.config, "loss", None), "chunk_tokens", 1024)

    def at(tokens: int) -> int:
        setup = training_setup(ctx.decisions, shape, ctx.caps, micro_batch=micro, seq_len=tokens,
                               grad_accum=max(1, effective // micro), chunked=chunked, chunk_tokens=chunk)
        return estimate(shape, setup.replace(attention=kernel)).total_bytes

    best, _ = longest(lambda n: at(n) <= budget)
    need = at(seq)
    head = (f"{kernel} attention at length: {QUADRATIC[kernel]}; within {fmt_bytes(budget)} ({budget_from}) at "
            f"micro-batch {micro} the longest row that fits is " + (f"{best:,} tokens" if best else "none") +
            f"; rows of {seq:,} tokens ({seq_from}) are predicted to need {fmt_bytes(need)}")
    if need <= budget:
        ctx.decisions["attention"] = att.replace(reason=f"{att.reason}; {head}: fits")
        return
    ck = ctx.decisions.get("checkpointing")
    every_block = ck is not None and ck.active and getattr(ck.settings, "every_n_blocks", 1) == 1
    fix = (f"rows of at most {best:,} tokens ({seq_from})" if best else "a bigger budget") + \
        ", a model whose attention runs sdpa or flash-attention, " + \
        ("" if every_block else "checkpointing every block, ") + "or more memory"
    if ctx.config.attention.strict:
        raise SpeedupConfigError([
            f"attention.strict = true and the model's attention is {kernel!r} ({att.reason}): {head}, over "
            f"{fmt_bytes(budget)}; allowed: rows of at most {best or 0:,} tokens with this plan and memory; fix: "
            f"{fix}, or attention.strict: false to be warned instead"])
    text = f"{head}: does NOT fit; fix: {fix}"
    logger.warning("hf_speedup attention: %s", text)
    ctx.decisions["attention"] = att.replace(reason=f"{att.reason}; {text}")
