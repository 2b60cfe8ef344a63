"""Validation of a SpeedupConfig's fields: the allowed values, the type checks and the messages that name the
field, the value, what is allowed and the fix. Every problem is gathered before one :class:`SpeedupConfigError`
is raised, so a user fixes a configuration in one pass."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from .sections import AUTO


class SpeedupConfigError(ValueError):
    """Every problem of a configuration, gathered into one message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid hf_speedup configuration ({len(self.problems)} problem(s)):\n{lines}")


# field -> (allowed values, example fix). Fields not listed are checked by type only.
CHOICES: dict[str, tuple[tuple, Any]] = {
    "precision.dtype": ((AUTO, "keep", "bf16", "fp16", "fp32"), AUTO),
    "precision.tf32": ((AUTO, "keep", True, False), AUTO),
    "compile.enabled": ((AUTO, True, False), True),
    "compile.backend": (("inductor", "aot_eager", "eager", "cudagraphs"), "inductor"),
    "compile.mode": ((None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"), None),
    "compile.dynamic": ((None, True, False), None),
    "compile.regions": (("blocks", "blocks+head"), "blocks"),
    "compile.when": (("always", "pays_back"), "pays_back"),
    "optimizer.name": ((AUTO, "keep", "adamw", "adamw_fused", "adamw_8bit", "paged_adamw_8bit"), AUTO),
    "checkpointing.enabled": ((AUTO, True, False), True),
    "checkpointing.offload": ((AUTO, True, False), AUTO),
    "tiled_mlp.enabled": ((AUTO, True, False), True),
    "crash_safe.asynchronous": ((AUTO, True, False), True),
    "sequence_parallel.enabled": ((AUTO, False), AUTO),
    "lora.quantization": ((None, "4bit", "8bit"), None),
    "fsdp.version": ((1, 2), 2),
    "fsdp.strategy": (("full_shard", "shard_grad_op", "hybrid_shard", "no_shard"), "full_shard"),
    "fsdp.state_dict_type": (("sharded", "full"), "sharded"),
    "data.padding_free": ((AUTO, True, False), AUTO),
    "attention.implementation": ((AUTO, "keep", "sdpa", "sdpa_varlen", "blocked", "eager", "flash_attention_2",
                                  "flash_attention_3", "flex_attention"), AUTO),
    "experts.implementation": ((AUTO, "keep", "eager", "batched_mm", "grouped_mm"), AUTO),
    "liger.enabled": ((AUTO, True, False), AUTO),
    "memory.activation_offloading": ((AUTO, True, False), AUTO),
    "loss.chunked": ((AUTO, True, False), True),
    "loss.scaling": ((AUTO, "stock"), AUTO),
    "interrupt.enabled": ((AUTO, True, False), AUTO),
}

POSITIVE_INTS = {"checkpointing.every_n_blocks", "lora.r", "lora.alpha", "loss.chunk_tokens", "profile.active",
                 "profile.top_operators"}
NON_NEGATIVE_INTS = {"profile.wait", "profile.warmup"}
OPTIONAL_POSITIVE_INTS = {"memory.empty_cache_steps", "memory.seq_len", "data.pad_to_multiple_of", "data.prefetch_factor"}
OPTIONAL_NON_NEGATIVE_INTS = {"data.num_workers"}
BOOLS = {
    "memory.track_live_tensors",
    "precision.strict", "compile.fullgraph", "optimizer.strict", "memory.expandable_segments",
    "memory.cpu_reuse_freed", "lora.enabled", "lora.strict", "fsdp.enabled", "fsdp.cpu_offload",
    "fsdp.cpu_ram_efficient_loading", "profile.enabled", "profile.record_shapes", "profile.profile_memory",
    "profile.with_stack", "profile.memory_snapshot", "attention.strict", "experts.strict", "report.trackers", "report.console",
    "crash_safe.enabled", "deepspeed.strict",
}
OPTIONAL_BOOLS = {"data.pin_memory", "data.persistent_workers", "data.drop_last", "data.packing"}


def _fmt(values) -> str:
    return ", ".join(repr(v) for v in values)


def _unknown(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(allowed)}"
    return f"{key} is not a known setting; allowed: {', '.join(allowed)}; fix: remove it or rename it ({hint})"


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any) -> int | None:
    """Bytes of a size such as ``24GB`` (decimal), ``80 GiB`` (binary) or ``1.5e9``; None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, (int, float)):
        return int(value) if value >= 1 else None
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    try:
        amount = float(number)
    except ValueError:
        return None
    if unit not in _SIZE_UNITS or amount <= 0 or (unit == "" and amount < 1):
        return None
    return int(amount * _SIZE_UNITS[unit])


def budget_problem(value: Any) -> str | None:
    """Why ``memory.budget`` is not allowed (None when it is)."""
    if value is None or value == AUTO:
        return None
    if isinstance(value, float) and 0 < value <= 1:
        return None  # a fraction of the device's memory
    if parse_size(value) is not None:
        return None
    return (f"memory.budget = {value!r} is not allowed; allowed: null, 'auto' (the device's memory), a number of "
            "bytes, a size such as '24GB' or '80GiB', or a fraction of the device's memory in (0, 1]; "
            "fix: e.g. memory.budget: 24GB")


def report_path_problem(value: Any) -> str | None:
    """Why ``report.path`` is not allowed (None when it is)."""
    if value is None or value == AUTO or (isinstance(value, (str, Path)) and str(value).strip()):
        return None
    return (f"report.path = {value!r} is not allowed; allowed: 'auto' (<output_dir>/speedup_report.json), null (no "
            "file) or a file or directory path; fix: e.g. report.path: runs/speedup_report.json")


def cache_dir_problem(value: Any) -> str | None:
    """Why ``compile.cache_dir`` is not allowed (None when it is)."""
    if value is None or value in (AUTO, "none") or (isinstance(value, (str, Path)) and str(value).strip()):
        return None
    return (f"compile.cache_dir = {value!r} is not allowed; allowed: 'auto' (the compile cache saved beside each "
            "checkpoint, loaded on resume), 'none' (no compile cache) or a folder path (also loaded from and saved to "
            "there, for repeated runs); fix: e.g. compile.cache_dir: auto")


def _check_field(key: str, value: Any) -> list[str]:
    if key == "compile.cache_dir":
        problem = cache_dir_problem(value)
        return [problem] if problem else []
    if key == "tiled_mlp.tile_tokens":
        if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return []
        return [f"{key} = {value!r} is not allowed; allowed: 'auto' or an integer >= 1 (tokens per tile); "
                f"fix: e.g. {key}: auto"]
    if key == "report.path":
        problem = report_path_problem(value)
        return [problem] if problem else []
    if key == "memory.budget":
        problem = budget_problem(value)
        return [problem] if problem else []
    if key in CHOICES:
        allowed, example = CHOICES[key]
        # bool is an int subclass: compare with type so that 1 != True is enforced for versions
        if not any(value == a and type(value) is type(a) for a in allowed):
            return [f"{key} = {value!r} is not allowed; allowed: {_fmt(allowed)}; fix: set {key}: {example!r}"]
        return []
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key in POSITIVE_INTS and not (is_int and value > 0):
        return [f"{key} = {value!r} is not allowed; allowed: an integer >= 1; fix: e.g. {key}: 1"]
    if key in NON_NEGATIVE_INTS and not (is_int and value >= 0):
        return [f"{key} = {value!r} is not allowed; allowed: an integer >= 0; fix: e.g. {key}: 1"]
    if key in OPTIONAL_POSITIVE_INTS and not (value is None or (is_int and value > 0)):
        return [f"{key} = {value!r} is not allowed; allowed: null or an integer >= 1; fix: e.g. {key}: 8, or null to disable"]
    if key in OPTIONAL_NON_NEGATIVE_INTS and not (value is None or (is_int and value >= 0)):
        return [f"{key} = {value!r} is not allowed; allowed: null or an integer >= 0; fix: e.g. {key}: 2, or null to keep TrainingArguments"]
    if key in BOOLS and not isinstance(value, bool):
        return [f"{key} = {value!r} is not allowed; allowed: true, false; fix: set {key}: true or false"]
    if key in OPTIONAL_BOOLS and not (value is None or isinstance(value, bool)):
        return [f"{key} = {value!r} is not allowed; allowed: null, true, false; fix: set {key}: null to keep TrainingArguments"]
    return []
