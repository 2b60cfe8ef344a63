"""SpeedupConfig: what the user asks for, validated in one pass before any model work.

Every field accepts ``"auto"`` where a sensible machine-dependent choice exists; the plan
(:mod:`hf_speedup.plan`) turns requests into concrete decisions with reasons.

The sections (one dataclass per feature) are in :mod:`.sections`, the field checks and their messages in
:mod:`.validate`; every name stays importable from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sections import (AUTO, INTERRUPT_SIGNALS, SECTIONS, AttentionSettings, CheckpointingSettings, CompileSettings,
                       CrashSafeSettings, DataSettings, DeepSpeedSettings, ExpertsSettings, FsdpSettings,
                       InterruptSettings, LigerSettings, LoraSettings, LossSettings, MemorySettings, OptimizerSettings, PrecisionSettings,
                       ProfileSettings, ReportSettings, SequenceParallelSettings, TiledMlpSettings)
from .validate import (BOOLS, CHOICES, NON_NEGATIVE_INTS, OPTIONAL_BOOLS, OPTIONAL_NON_NEGATIVE_INTS,
                       OPTIONAL_POSITIVE_INTS, POSITIVE_INTS, SpeedupConfigError, _check_field, _fmt, _unknown,
                       budget_problem, parse_size, report_path_problem)

__all__ = [
    "AUTO", "AttentionSettings", "BOOLS", "CHOICES", "CheckpointingSettings", "CompileSettings", "CrashSafeSettings", "DeepSpeedSettings",
    "DataSettings", "ExpertsSettings", "FsdpSettings", "INTERRUPT_SIGNALS", "InterruptSettings", "LigerSettings", "LoraSettings",
    "LossSettings", "MemorySettings", "NON_NEGATIVE_INTS", "OPTIONAL_BOOLS", "OPTIONAL_NON_NEGATIVE_INTS",
    "OPTIONAL_POSITIVE_INTS", "OptimizerSettings", "POSITIVE_INTS", "PrecisionSettings", "ProfileSettings",
    "ReportSettings", "SECTIONS", "SequenceParallelSettings", "TiledMlpSettings", "SpeedupConfig", "SpeedupConfigError", "budget_problem", "dotted_keys",
    "parse_size", "report_path_problem",
]


@dataclass
class SpeedupConfig:
    """The whole request: one sub-config per feature. ``name`` records the preset it came from."""

    name: str = "custom"
    description: str = ""
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    compile: CompileSettings = field(default_factory=CompileSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    checkpointing: CheckpointingSettings = field(default_factory=CheckpointingSettings)
    tiled_mlp: TiledMlpSettings = field(default_factory=TiledMlpSettings)
    sequence_parallel: SequenceParallelSettings = field(default_factory=SequenceParallelSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    fsdp: FsdpSettings = field(default_factory=FsdpSettings)
    data: DataSettings = field(default_factory=DataSettings)
    attention: AttentionSettings = field(default_factory=AttentionSettings)
    experts: ExpertsSettings = field(default_factory=ExpertsSettings)
    liger: LigerSettings = field(default_factory=LigerSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    interrupt: InterruptSettings = field(default_factory=InterruptSettings)
    report: ReportSettings = field(default_factory=ReportSettings)
    crash_safe: CrashSafeSettings = field(default_factory=CrashSafeSettings)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)

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
