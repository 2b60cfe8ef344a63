"""What a training run achieved: tokens, FLOPs and MFU, memory, compile statistics.

Pure helpers (unit-tested against hand-computed numbers) plus small readers of torch's own counters.
Nothing here synchronises a device: token counts stay on the device until the caller reads them at a
point where the Trainer synchronises anyway (a logging step).

Definitions (DESIGN.md, "Metric definitions"):

- Tokens: ``attention_mask == 1`` (2-D masks), else the sequences of a padding-free row (``position_ids``
  restarting at 0 and no mask; padding after the last sequence left out), else ``labels != -100``, else
  every input id. Padding is not work. Summed over ranks. Samples are sequences: rows, or each sequence
  of a padding-free row.
- FLOPs per token (dense decoder, PaLM convention, per *non-padding* token)::

      4 * N_frozen + 6 * N_trainable + 12 * L * H * S

  with ``N`` counting matmul weights only (embedding lookups excluded; a tied output head is counted
  once as a matmul), ``N_frozen = 0`` for a full fine-tune (giving the familiar ``6 N + 12 L H S``),
  ``L`` layers, ``H`` the attention width (heads x head_dim, = hidden size for Llama-style models) and
  ``S`` the token-weighted mean sequence length ``sum(L_i^2) / sum(L_i)`` (each token attends over its own
  sequence; the plain mean under-counts ragged batches, and a padding-free row is its sequences). Recomputation by activation checkpointing is *not*
  counted: this is MFU, not HFU.
- MFU = FLOPs per token x tokens/s (all ranks) / (peak dense FLOP/s of the dtype in use x devices).
- Fraction of the matmul peak = the same achieved FLOP/s / (this machine's measured large-GEMM FLOP/s in the
  run's dtype x devices): the step against what the device really delivers, where MFU has no peak (CPUs).

The measurements live in one module per job; this package gathers their names:

- :mod:`.tokens`: tokens and sequences of a batch, counted on the device, summed over ranks;
- :mod:`.flops`: FLOPs per token, MFU, achieved model FLOP/s and its fraction of a peak, the compute dtype;
- :mod:`.matmul_peak`: this machine's matmul peak in the run's dtype (a large GEMM timed once per machine);
- :mod:`.memory_watch`: allocator peaks, the memory estimate, one step's live tensors;
- :mod:`.dynamo_counters`: compile seconds, recompiles, graph breaks, compiled regions;
- :mod:`.step_times`: the steady-state step time, bounded series;
- :mod:`.environment`: versions and the device.
"""

from __future__ import annotations

from .dynamo_counters import compile_events, compile_seconds, compiled_regions, dynamo_diff, dynamo_snapshot
from .environment import environment, package_versions
from .flops import (attention_dims, compute_dtype, flops_per_token, fraction_of_peak, mfu,
                    model_flops_per_second)
from .memory_watch import (LiveTensorStep, MemoryWatch, current_rss_bytes, estimated_peak, memory_measures,
                           memory_snapshot, memory_source, peak_rss_bytes, reset_peak_memory)
from .step_times import BoundedSeries, steady_state_step_time
from .tokens import (COUNTS, IGNORE_INDEX, RANK_FIELDS, TokenCounter, aggregate_ranks, attention_length,
                     batch_counts)

__all__ = [
    "BoundedSeries", "COUNTS", "IGNORE_INDEX", "LiveTensorStep", "MemoryWatch", "RANK_FIELDS", "TokenCounter",
    "aggregate_ranks", "attention_dims", "attention_length", "batch_counts", "compile_events", "compiled_regions",
    "compile_seconds", "compute_dtype", "current_rss_bytes", "dynamo_diff", "dynamo_snapshot", "environment",
    "estimated_peak",
    "flops_per_token", "fraction_of_peak", "memory_measures", "memory_snapshot", "memory_source", "mfu",
    "model_flops_per_second", "package_versions",
    "peak_rss_bytes", "reset_peak_memory", "steady_state_step_time",
]
