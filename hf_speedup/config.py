"""SpeedupConfig: what the user asks for, validated in one pass before any model work.

Every field accepts ``"auto"`` where a sensible machine-dependent choice exists; the plan
(:mod:`hf_speedup.plan`) turns requests into concrete decisions with reasons.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AUTO = "auto"


class SpeedupConfigError(ValueError):
    """Every problem of a configuration, gathered into one message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid hf_speedup configuration ({len(self.problems)} problem(s)):\n{lines}")


@dataclass
class PrecisionSettings:
    """Compute dtype. ``auto`` picks bf16 only where the hardware runs it natively."""

    dtype: str = AUTO  # auto | keep (the TrainingArguments' own) | bf16 | fp16 | fp32
    tf32: Any = AUTO  # auto | keep | true | false (CUDA matmul/cudnn TF32)
    strict: bool = False  # raise instead of falling back when ``dtype`` cannot run here


@dataclass
class CompileSettings:
    """Regional torch.compile of the repeated decoder block (not the whole model)."""

    enabled: Any = False  # auto | true | false
    backend: str = "inductor"
    mode: str | None = None  # None | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    dynamic: bool | None = None  # None lets dynamo decide; False pins static shapes
    fullgraph: bool = False
    regions: str = "blocks"  # blocks | blocks+head (also compiles final norm + lm_head + loss)


@dataclass
class OptimizerSettings:
    """AdamW variant; falls back 8-bit -> fused -> plain unless ``strict``."""

    name: str = AUTO  # auto | keep (TrainingArguments.optim) | adamw | adamw_fused | adamw_8bit | paged_adamw_8bit
    strict: bool = False


@dataclass
class CheckpointingSettings:
    """Non-reentrant activation checkpointing, optionally on every N-th block only."""

    enabled: Any = False  # auto | true | false
    every_n_blocks: int = 1


@dataclass
class MemorySettings:
    """Allocator knobs: CUDA ones (no-ops on CPU, reported) and the CPU malloc one (CPU training only)."""

    empty_cache_steps: int | None = None
    expandable_segments: bool = False
    cpu_reuse_freed: bool = False  # glibc keeps freed blocks mapped: no page faults per step on CPU


@dataclass
class LoraSettings:
    """peft LoRA; ``quantization='4bit'`` makes it QLoRA (bitsandbytes, CUDA only)."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: Any = AUTO  # auto | all-linear | [names]
    quantization: str | None = None  # None | 4bit | 8bit
    strict: bool = False  # raise instead of QLoRA -> LoRA fallback


@dataclass
class FsdpSettings:
    """PyTorch FSDP sharding of the decoder blocks."""

    enabled: bool = False
    version: int = 2  # 1 | 2
    strategy: str = "full_shard"  # full_shard | shard_grad_op | hybrid_shard | no_shard
    cpu_offload: bool = False
    state_dict_type: str = "sharded"  # sharded | full
    cpu_ram_efficient_loading: bool = True


@dataclass
class DataSettings:
    """Input pipeline: stable shapes (fewer recompiles) and loader workers."""

    pad_to_multiple_of: int | None = None
    num_workers: int | None = None  # None keeps the user's TrainingArguments value
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    drop_last: bool | None = None  # True: no odd-sized last batch (static-shape compile would recompile for it)


SECTIONS: dict[str, type] = {
    "precision": PrecisionSettings,
    "compile": CompileSettings,
    "optimizer": OptimizerSettings,
    "checkpointing": CheckpointingSettings,
    "memory": MemorySettings,
    "lora": LoraSettings,
    "fsdp": FsdpSettings,
    "data": DataSettings,
}

# field -> (allowed values, example fix). Fields not listed are checked by type only.
CHOICES: dict[str, tuple[tuple, Any]] = {
    "precision.dtype": ((AUTO, "keep", "bf16", "fp16", "fp32"), AUTO),
    "precision.tf32": ((AUTO, "keep", True, False), AUTO),
    "compile.enabled": ((AUTO, True, False), True),
    "compile.backend": (("inductor", "aot_eager", "eager", "cudagraphs"), "inductor"),
    "compile.mode": ((None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"), None),
    "compile.dynamic": ((None, True, False), None),
    "compile.regions": (("blocks", "blocks+head"), "blocks"),
    "optimizer.name": ((AUTO, "keep", "adamw", "adamw_fused", "adamw_8bit", "paged_adamw_8bit"), AUTO),
    "checkpointing.enabled": ((AUTO, True, False), True),
    "lora.quantization": ((None, "4bit", "8bit"), None),
    "fsdp.version": ((1, 2), 2),
    "fsdp.strategy": (("full_shard", "shard_grad_op", "hybrid_shard", "no_shard"), "full_shard"),
    "fsdp.state_dict_type": (("sharded", "full"), "sharded"),
}

POSITIVE_INTS = {"checkpointing.every_n_blocks", "lora.r", "lora.alpha"}
OPTIONAL_POSITIVE_INTS = {"memory.empty_cache_steps", "data.pad_to_multiple_of", "data.prefetch_factor"}
OPTIONAL_NON_NEGATIVE_INTS = {"data.num_workers"}
BOOLS = {
    "precision.strict", "compile.fullgraph", "optimizer.strict", "memory.expandable_segments",
    "memory.cpu_reuse_freed", "lora.enabled", "lora.strict", "fsdp.enabled", "fsdp.cpu_offload",
    "fsdp.cpu_ram_efficient_loading",
}
OPTIONAL_BOOLS = {"data.pin_memory", "data.persistent_workers", "data.drop_last"}


def _fmt(values) -> str:
    return ", ".join(repr(v) for v in values)


@dataclass
class SpeedupConfig:
    """The whole request: one sub-config per feature. ``name`` records the preset it came from."""

    name: str = "custom"
    description: str = ""
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    compile: CompileSettings = field(default_factory=CompileSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    checkpointing: CheckpointingSettings = field(default_factory=CheckpointingSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    fsdp: FsdpSettings = field(default_factory=FsdpSettings)
    data: DataSettings = field(default_factory=DataSettings)

    # ----------------------------------------------------------------- validation
    def problems(self) -> list[str]:
        """Every problem, each naming the field, the value, the allowed values and the fix."""
        out: list[str] = []
        for section in SECTIONS:
            sub = getattr(self, section)
            for f in dataclasses.fields(sub):
                key = f"{section}.{f.name}"
                out.extend(_check_field(key, getattr(sub, f.name)))
        out.extend(self._cross_problems())
        return out

    def _cross_problems(self) -> list[str]:
        out = []
        if self.lora.quantization and not self.lora.enabled:
            out.append(
                f"lora.quantization = {self.lora.quantization!r} needs lora.enabled = true "
                "(a quantized base can only be fine-tuned through adapters); fix: set lora.enabled: true "
                "or lora.quantization: null"
            )
        tm = self.lora.target_modules
        if not (tm in (AUTO, "all-linear") or (isinstance(tm, (list, tuple)) and tm and all(isinstance(t, str) for t in tm))):
            out.append(
                f"lora.target_modules = {tm!r} is not allowed; allowed: 'auto', 'all-linear' or a non-empty list of "
                "module names; fix: e.g. lora.target_modules: [q_proj, v_proj]"
            )
        if not isinstance(self.lora.dropout, (int, float)) or isinstance(self.lora.dropout, bool) or not 0 <= self.lora.dropout < 1:
            out.append(
                f"lora.dropout = {self.lora.dropout!r} is not allowed; allowed: a number in [0, 1); fix: e.g. lora.dropout: 0.05"
            )
        return out

    def validate(self) -> "SpeedupConfig":
        problems = self.problems()
        if problems:
            raise SpeedupConfigError(problems)
        return self

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, validate: bool = True) -> "SpeedupConfig":
        """Build from nested dicts; unknown keys are problems too (typos must not be ignored)."""
        problems: list[str] = []
        if not isinstance(data, dict):
            raise SpeedupConfigError([f"config = {data!r} is not a mapping; fix: give a mapping of sections such as compile:, optimizer:"])
        top_allowed = ["name", "description", "base", *SECTIONS]
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "base":
                continue  # resolved by presets.resolve (a preset to start from)
            if key not in top_allowed:
                problems.append(_unknown(key, top_allowed))
                continue
            if key in SECTIONS:
                sub_cls = SECTIONS[key]
                names = [f.name for f in dataclasses.fields(sub_cls)]
                if value is None:
                    value = {}
                if not isinstance(value, dict):
                    problems.append(f"{key} = {value!r} is not a mapping; allowed keys: {', '.join(names)}; fix: e.g. {key}: {{{names[0]}: ...}}")
                    continue
                good = {}
                for k, v in value.items():
                    if k not in names:
                        problems.append(_unknown(f"{key}.{k}", [f"{key}.{n}" for n in names]))
                    else:
                        good[k] = v
                kwargs[key] = sub_cls(**good)
            else:
                kwargs[key] = value
        cfg = cls(**kwargs)
        if validate:
            problems.extend(cfg.problems())
        if problems:
            raise SpeedupConfigError(problems)
        return cfg

    def to_yaml(self, path: str | Path | None = None) -> str:
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def replace(self, **sections: dict) -> "SpeedupConfig":
        """Copy with some sections updated, e.g. ``cfg.replace(compile={"backend": "eager"})``."""
        data = self.to_dict()
        for key, value in sections.items():
            if key in SECTIONS and isinstance(value, dict):
                data[key].update(value)
            else:
                data[key] = value
        return SpeedupConfig.from_dict(data)


def _unknown(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(allowed)}"
    return f"{key} is not a known setting; allowed: {', '.join(allowed)}; fix: remove it or rename it ({hint})"


def _check_field(key: str, value: Any) -> list[str]:
    if key in CHOICES:
        allowed, example = CHOICES[key]
        # bool is an int subclass: compare with type so that 1 != True is enforced for versions
        if not any(value == a and type(value) is type(a) for a in allowed):
            return [f"{key} = {value!r} is not allowed; allowed: {_fmt(allowed)}; fix: set {key}: {example!r}"]
        return []
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key in POSITIVE_INTS and not (is_int and value > 0):
        return [f"{key} = {value!r} is not allowed; allowed: an integer >= 1; fix: e.g. {key}: 1"]
    if key in OPTIONAL_POSITIVE_INTS and not (value is None or (is_int and value > 0)):
        return [f"{key} = {value!r} is not allowed; allowed: null or an integer >= 1; fix: e.g. {key}: 8, or null to disable"]
    if key in OPTIONAL_NON_NEGATIVE_INTS and not (value is None or (is_int and value >= 0)):
        return [f"{key} = {value!r} is not allowed; allowed: null or an integer >= 0; fix: e.g. {key}: 2, or null to keep TrainingArguments"]
    if key in BOOLS and not isinstance(value, bool):
        return [f"{key} = {value!r} is not allowed; allowed: true, false; fix: set {key}: true or false"]
    if key in OPTIONAL_BOOLS and not (value is None or isinstance(value, bool)):
        return [f"{key} = {value!r} is not allowed; allowed: null, true, false; fix: set {key}: null to keep TrainingArguments"]
    return []
