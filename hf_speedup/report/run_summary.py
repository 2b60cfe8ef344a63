"""The end-of-train report: the whole run's totals (this ``train()`` plus what a resume carried from its
checkpoint) and, from them, the summary metrics and the ``measurement`` section that says how each was taken.
Kept apart from the collector's hooks: this is the arithmetic of the report, the hooks only gather its inputs."""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..model_info import ParamCounts
from . import carry
from . import goodput as G
from . import measure as M
from .model_facts import ModelFacts
from .schema import Metrics
from .step_clock import StepClock


def run_totals(carried: carry.Carried, clock: StepClock, history: M.BoundedSeries, agg: dict, global_step: int,
               max_history: int, max_step_times: int, bounded: bool = False,
               split: dict | None = None) -> carry.Carried:
    """This run's counts plus those carried over from the checkpoint it resumed from (``bounded``: the
    lists thinned to the collector's limits, as written into a checkpoint; ``split``: this process's wall clock
    in :data:`~.goodput.PARTS`, added to the carried one where the checkpoint had one for every earlier run)."""
    c = carried
    whole = c.time_split_runs == c.segments  # every earlier run's split was carried (none before a fresh run)
    time_split = (G.combine(c.time_split if whole else {}, split) if split is not None else dict(c.time_split))
    split_runs = ((c.time_split_runs if whole else 0) + 1) if split is not None else c.time_split_runs
    dyn = clock.compile_diff()
    first = clock.first_step_compile_seconds  # the cold compile; what came after it is recompiling
    recompiled = max(0.0, dyn["compile_seconds"] - first) if first is not None else 0.0
    steady = c.steady_step_times + clock.steady()
    history, series = c.history + list(history.items), c.step_times + list(clock.series.items)
    if bounded:
        steady = thin(steady, max_step_times)
    return carry.Carried(
        global_step=global_step, segments=c.segments + 1,
        steps=c.steps + len(clock.times), warmup_steps=c.warmup_steps + len(clock.warmup),
        tokens=c.tokens + agg["tokens"], samples=c.samples + agg["samples"],
        attended_tokens=c.attended_tokens + agg["attended_tokens"],
        attended_squares=c.attended_squares + agg["attended_squares"],
        wall_seconds=c.wall_seconds + (time.perf_counter() - clock.t_begin),
        compile_seconds=c.compile_seconds + dyn["compile_seconds"], recompiles=c.recompiles + dyn["recompiles"],
        recompile_seconds=round(c.recompile_seconds + recompiled, 6),
        graph_breaks=c.graph_breaks + dyn["graph_breaks"], dynamo_frames=c.dynamo_frames + dyn["frames"],
        warmup_global_steps=(c.warmup_global_steps + clock.warmup_global)[:64], steady_step_times=steady,
        history=thin(history, max_history), step_times=thin(series, max_step_times),
        time_split=time_split, time_split_runs=split_runs)


def summarize(total: carry.Carried, agg: dict, clock: StepClock, facts: ModelFacts, devices: int, trainer: Any,
              memory: M.MemoryWatch, resumed_from: str | None, carry_note: str | None, split: dict | None = None,
              origin: str | None = None) -> tuple[Metrics, dict]:
    """(the summary metrics, the ``measurement`` section) of the whole run ``total``; ``agg`` has every rank's
    memory peaks; ``split``: this process's wall clock in :data:`~.goodput.PARTS`, from ``origin``."""
    steps = total.steps
    if total.steady_step_times:
        step_time, steady = float(statistics.median(total.steady_step_times)), total.steps - total.warmup_steps
    else:
        step_time, steady = M.steady_state_step_time(clock.times, clock.warmup)
    tokens, samples = total.tokens, total.samples
    # none counted (batches without token tensors, e.g. GRPO's raw prompts): unknown, not zero
    tps = (tokens / steps) / step_time if steps and step_time and tokens else None
    sps = (samples / steps) / step_time if steps and step_time and samples else None
    fpt = facts.flops_per_token(total.attended_tokens, total.attended_squares)
    params = facts.params or ParamCounts(0, 0, 0, 0, 0)
    wall = total.wall_seconds
    achieved = M.model_flops_per_second(tps, fpt)
    metrics = Metrics(**{
        "tokens_per_second": tps,
        "samples_per_second": sps,
        "step_time_s": step_time,
        "whole_run_tokens_per_second": tokens / wall if wall and tokens else None,
        "whole_run_samples_per_second": samples / wall if wall and samples else None,
        "whole_run_seconds": round(wall, 4) if wall else None,
        "mfu": M.mfu(tps, fpt, facts.peak_flops, devices),
        "model_flops_per_second": achieved,
        "whole_run_model_flops_per_second": M.model_flops_per_second(tokens / wall if wall and tokens else None, fpt),
        "matmul_peak_flops_per_second": facts.matmul_peak,
        "fraction_of_matmul_peak": M.fraction_of_peak(achieved, facts.matmul_peak, devices),
        "peak_memory_allocated_bytes": agg["peak_memory_allocated_bytes"],
        "peak_memory_reserved_bytes": agg["peak_memory_reserved_bytes"],
        "compile_seconds": round(total.compile_seconds, 6),
        "recompile_seconds": total.recompile_seconds if clock.first_step_compile_seconds is not None else None,
        "recompiles": total.recompiles,
        "graph_breaks": total.graph_breaks,
        "compiled_regions": M.compiled_regions(getattr(trainer, "model_wrapped", None), trainer.model),
        "trainable_parameters": params.trainable,
        "total_parameters": params.total,
        **goodput_metrics(total.time_split),
    })
    metrics.estimated_peak_bytes, memory_entries = memory.summary(tokens, int(getattr(trainer.args,
                                                                  "gradient_accumulation_steps", 1) or 1),
                                                                  facts.device_type)
    measurement = {
        "steps": steps,
        "steady_state_steps": steady,
        "warmup_steps": total.warmup_steps,
        "warmup_global_steps": total.warmup_global_steps,  # the first 64
        "step_time_statistic": "median of steady-state steps (first step and steps that compiled excluded)",
        "tokens": tokens,
        "samples": samples,
        "tokens_note": None if tokens or not steps else (
            "no token counted: the batches the trainer stepped on carried no input_ids, attention_mask, "
            "position_ids or labels tensors (e.g. GRPO's raw prompts), so throughput and MFU are unknown"),
        "mean_sequence_length": tokens / samples if samples else None,
        "attention_sequence_length": M.attention_length(total.attended_tokens, total.attended_squares),
        "flops_per_token": fpt,
        "flops_formula": ("4*N_frozen + 6*N_trainable + 12*L*H*S (non-embedding matmul weights; S = "
                          "attention_sequence_length = sum(L_i^2)/sum(L_i) over sequences; recomputation not "
                          "counted)"),
        "matmul_parameters_trainable": params.matmul_trainable,
        "matmul_parameters_frozen": params.matmul_frozen,
        "embedding_parameters": params.embedding,
        "num_layers": facts.layers,
        "attention_width": facts.attention_width,
        "compute_dtype": facts.dtype,
        "peak_flops_per_device": facts.peak_flops,
        "peak_flops_source": facts.peak_source,
        "matmul_peak_dtype": facts.dtype,
        "matmul_peak_source": facts.matmul_peak_source,
        "num_devices": devices,
        "memory_source": M.memory_source(facts.device_type),
        "wall_seconds": round(total.wall_seconds, 4),
        "dynamo_frames": total.dynamo_frames,
        "train_runs": total.segments,  # > 1: resumed; the counts above cover every run since step 0
        "resumed_from": resumed_from,
        "resume_counters": carry_note,
        "time_split": time_split_entry(total, split, origin),
        **memory_entries,
    }
    return metrics, measurement


def goodput_metrics(parts: dict) -> dict:
    """The summary's goodput figures from the run's wall-clock parts (none without a split)."""
    if not parts:
        return {}
    return {"goodput": G.goodput(parts), "wall_clock_seconds": parts["wall_seconds"],
            "setup_seconds": parts["setup"], "productive_step_seconds": parts["steps"],
            "save_blocked_seconds": parts["save"], "eval_seconds": parts["eval"], "data_wait_seconds": parts["data"],
            "other_seconds": parts["other"]}


def time_split_entry(total: carry.Carried, split: dict | None, origin: str | None) -> dict | None:
    """``measurement.time_split``: the run's parts and this process's, with what each covers."""
    if split is None:
        return None
    if total.segments == 1:
        covers = f"this process: from its {origin} to the end of training"
    elif total.time_split_runs == total.segments:
        covers = (f"the run: {total.segments} train() runs, each earlier one from its process start to the "
                  f"checkpoint the next resumed from (work after that checkpoint and the time between processes are "
                  f"not in it), this one from its {origin} to the end of training")
    else:
        covers = (f"this process only (from its {origin}): the checkpoint it resumed from carried no time split for "
                  f"every earlier run")
    return {"run": dict(total.time_split), "this_process": dict(split), "goodput_this_process": G.goodput(split),
            "runs_covered": total.time_split_runs, "covers": covers,
            "definition": "goodput = steps / wall_seconds; the parts sum to wall_seconds: " + ", ".join(G.PARTS)}


def thin(items: list, limit: int) -> list:
    """At most ``limit`` items spread over the whole series (first kept), as :class:`~.measure.BoundedSeries` does."""
    while len(items) > max(2, limit):
        items = items[::2]
    return items
