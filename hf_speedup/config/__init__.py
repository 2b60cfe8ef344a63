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
    when: str = "always"  # always | pays_back: the first steps run eager, compile only if the run earns it back


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
    activation_offloading: Any = False  # auto | true | false: TRL's SFTConfig.activation_offloading (CUDA)
    # The plan fits the step into this: bytes, a size ('24GB', '80GiB'), a fraction of the device's memory
    # (0.9) or auto (all of it); null: no budget. See features/memory_budget.py.
    budget: Any = None
    seq_len: int | None = None  # the longest batch row, for the budget (else the arguments' max_length)
    track_live_tensors: bool = False  # report: one step's peak of live tensor bytes (torch's MemTracker)


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
    padding_free: Any = False  # auto | true | false: a batch becomes one row of its sequences, no padding
    packing: bool | None = None  # TRL's SFTConfig.packing (several examples per row); None keeps the trainer's


@dataclass
class LossSettings:
    """Causal-LM loss: chunked cross-entropy never holds the full tokens x vocab logits (or their gradient)."""

    chunked: Any = AUTO  # auto (the memory budget decides) | true | false
    chunk_tokens: int = 1024  # tokens per chunk: one chunk's fp32 logits are chunk_tokens x vocab x 4 bytes


@dataclass
class ProfileSettings:
    """torch.profiler over a window of steps: a trace for TensorBoard/Perfetto, top operators in the report."""

    enabled: bool = False
    wait: int = 1  # steps not profiled first (the first step allocates, compiles)
    warmup: int = 1  # profiled but discarded (profiler start-up)
    active: int = 2  # steps recorded into the trace
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    memory_snapshot: bool = True  # CUDA only: allocator history of the window -> pickle for PyTorch's memory viewer
    top_operators: int = 15  # rows of the top-operators table in the report


# Signals a preemption handler may take (SIGKILL/SIGSTOP cannot be caught; SIGQUIT keeps its core dump).
INTERRUPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")


@dataclass
class InterruptSettings:
    """Preemption: on these signals finish the optimizer step, save a checkpoint of it, exit 128 + signal."""

    enabled: Any = AUTO  # auto | true | false
    signals: list = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])


@dataclass
class CrashSafeSettings:
    """Checkpoints written in a staging folder and renamed into place when complete; resume skips incomplete ones."""

    enabled: bool = True  # false: in place, as the stock Trainer writes them (file systems without atomic rename)


@dataclass
class AttentionSettings:
    """The attention kernel (``config._attn_implementation``), chosen per device, dtype and packing."""

    implementation: str = AUTO  # auto | keep | sdpa | sdpa_varlen | eager | flash_attention_2 | flash_attention_3 | flex_attention
    strict: bool = False  # raise instead of falling back when the kernel asked for cannot run here


@dataclass
class LigerSettings:
    """Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) via TrainingArguments.use_liger_kernel."""

    enabled: Any = False  # auto (CUDA + liger-kernel installed) | true | false


@dataclass
class ReportSettings:
    """Where the report goes (what it measures does not change): a JSON file, the ``report_to`` trackers, the
    console. ``baseline`` turns all three off, so the run leaves ``output_dir``, the logs and stdout as the stock
    Trainer does; the report stays in ``trainer.speedup_report``."""

    # auto: <output_dir>/speedup_report.json (and the counters a resume carries, inside each checkpoint);
    # a path: the JSON there (a directory: speedup_report.json inside it); null: no file at all
    path: Any = AUTO
    trackers: bool = True  # plan and metrics to the report_to trackers (W&B, TensorBoard, ...)
    console: bool = True  # plan and metrics tables printed by the main process


SECTIONS: dict[str, type] = {
    "precision": PrecisionSettings,
    "compile": CompileSettings,
    "optimizer": OptimizerSettings,
    "checkpointing": CheckpointingSettings,
    "memory": MemorySettings,
    "lora": LoraSettings,
    "fsdp": FsdpSettings,
    "data": DataSettings,
    "attention": AttentionSettings,
    "liger": LigerSettings,
    "loss": LossSettings,
    "profile": ProfileSettings,
    "interrupt": InterruptSettings,
    "report": ReportSettings,
    "crash_safe": CrashSafeSettings,
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
    "compile.when": (("always", "pays_back"), "pays_back"),
    "optimizer.name": ((AUTO, "keep", "adamw", "adamw_fused", "adamw_8bit", "paged_adamw_8bit"), AUTO),
    "checkpointing.enabled": ((AUTO, True, False), True),
    "lora.quantization": ((None, "4bit", "8bit"), None),
    "fsdp.version": ((1, 2), 2),
    "fsdp.strategy": (("full_shard", "shard_grad_op", "hybrid_shard", "no_shard"), "full_shard"),
    "fsdp.state_dict_type": (("sharded", "full"), "sharded"),
    "data.padding_free": ((AUTO, True, False), AUTO),
    "attention.implementation": ((AUTO, "keep", "sdpa", "sdpa_varlen", "eager", "flash_attention_2",
                                  "flash_attention_3", "flex_attention"), AUTO),
    "liger.enabled": ((AUTO, True, False), AUTO),
    "memory.activation_offloading": ((AUTO, True, False), AUTO),
    "loss.chunked": ((AUTO, True, False), True),
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
    "profile.with_stack", "profile.memory_snapshot", "attention.strict", "report.trackers", "report.console",
    "crash_safe.enabled",
}
OPTIONAL_BOOLS = {"data.pin_memory", "data.persistent_workers", "data.drop_last", "data.packing"}


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
    attention: AttentionSettings = field(default_factory=AttentionSettings)
    liger: LigerSettings = field(default_factory=LigerSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    interrupt: InterruptSettings = field(default_factory=InterruptSettings)
    report: ReportSettings = field(default_factory=ReportSettings)
    crash_safe: CrashSafeSettings = field(default_factory=CrashSafeSettings)

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
        sig = self.interrupt.signals
        if not (isinstance(sig, (list, tuple)) and sig and all(isinstance(n, str) and n in INTERRUPT_SIGNALS for n in sig)
                and len(set(sig)) == len(sig)):
            out.append(
                f"interrupt.signals = {sig!r} is not allowed; allowed: a non-empty list of distinct names from "
                f"{_fmt(INTERRUPT_SIGNALS)}; fix: e.g. interrupt.signals: [SIGTERM, SIGINT, SIGUSR1], or "
                "interrupt.enabled: false to handle none"
            )
        return out

    def explicit_fields(self) -> frozenset[str]:
        """The ``section.field`` names the user chose, as opposed to values a preset (or the defaults) filled in: a
        preset's own choices yield to the user's explicit TrainingArguments, the user's own config fields do not.
        Recorded by :func:`~hf_speedup.presets.resolve`; a SpeedupConfig built by hand counts every field that
        differs from the defaults."""
        recorded = getattr(self, "_explicit", None)
        if recorded is not None:
            return recorded
        default = SpeedupConfig()
        return frozenset(f"{section}.{f.name}" for section in SECTIONS for f in dataclasses.fields(SECTIONS[section])
                         if getattr(getattr(self, section), f.name) != getattr(getattr(default, section), f.name))

    def with_explicit_fields(self, names) -> "SpeedupConfig":
        """This config, recording ``names`` as the fields the user chose (see :meth:`explicit_fields`)."""
        self._explicit = frozenset(names)
        return self

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
        return cfg.with_explicit_fields(dotted_keys(data))

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
        return SpeedupConfig.from_dict(data).with_explicit_fields(self.explicit_fields() | dotted_keys(sections))


def dotted_keys(data: dict) -> frozenset[str]:
    """``section.field`` for every field a config mapping sets."""
    return frozenset(f"{section}.{name}" for section, fields in data.items()
                     if section in SECTIONS and isinstance(fields, dict) for name in fields)


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


def _check_field(key: str, value: Any) -> list[str]:
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
