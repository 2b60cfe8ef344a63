"""build_plan: turn a request + capabilities + model description into decisions with reasons.

Pure: it reads, never changes, the model and touches no GPU. Each feature module decides for
itself (``features/<name>.py::decide``); this module only orders them and collects the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import SpeedupConfig
from .hardware import Capabilities
from .model_info import ModelInfo

# The order the report shows features in (DESIGN.md names these seven, `data` is ours).
REPORT_ORDER = ("precision", "compile", "optimizer", "checkpointing", "empty_cache", "lora", "fsdp", "data")


@dataclass
class Decision:
    """One feature: what was asked, what will be done and why; ``engaged`` is filled by verify."""

    feature: str
    requested: Any
    applied: Any
    reason: str
    settings: dict = field(default_factory=dict)  # concrete parameters the apply step uses
    fallbacks: list = field(default_factory=list)  # e.g. ["adamw_8bit: bitsandbytes needs CUDA"]
    engaged: bool | None = None  # None until verified on the real objects
    engaged_reason: str = "not verified yet"

    @property
    def active(self) -> bool:
        """Whether the apply step has anything to do (``applied`` is not off)."""
        return self.applied not in (None, False, "off", "none", "fp32-default")

    def to_dict(self) -> dict:
        return {
            "requested": _jsonable(self.requested),
            "applied": _jsonable(self.applied),
            "engaged": bool(self.engaged),
            "reason": self.reason if self.engaged is None else _join(self.reason, self.engaged_reason),
            "settings": _jsonable(self.settings),
            "fallbacks": list(self.fallbacks),
        }


def _join(plan_reason: str, verify_reason: str) -> str:
    if not verify_reason or verify_reason == plan_reason:
        return plan_reason
    return f"{plan_reason}; verified: {verify_reason}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x) for x in v]
    return str(v)


@dataclass
class PlanContext:
    """What every feature's ``decide`` may read; ``decisions`` holds the features decided earlier."""

    config: SpeedupConfig
    caps: Capabilities
    model: ModelInfo | None
    args: Any | None  # transformers.TrainingArguments (user's) or None
    decisions: dict[str, Decision] = field(default_factory=dict)


@dataclass
class Plan:
    config: SpeedupConfig
    caps: Capabilities
    model: ModelInfo | None
    decisions: dict[str, Decision]

    def __getitem__(self, feature: str) -> Decision:
        return self.decisions[feature]

    def __iter__(self):
        return (self.decisions[k] for k in self.ordered_names())

    def ordered_names(self) -> list[str]:
        known = [k for k in REPORT_ORDER if k in self.decisions]
        return known + [k for k in self.decisions if k not in known]

    def to_dict(self) -> dict:
        return {k: self.decisions[k].to_dict() for k in self.ordered_names()}

    def table(self, width: int = 80) -> str:
        from .console import plan_table

        return plan_table(self, width=width)


def resolve_config(speedup: Any) -> SpeedupConfig:
    """A preset name, a YAML path, a dict or a SpeedupConfig -> validated SpeedupConfig."""
    from .presets import resolve

    return resolve(speedup)


def build_plan(config: Any = "auto", caps: Capabilities | None = None, model: Any = None, args: Any = None) -> Plan:
    """Decide every feature. ``model`` may be an ``nn.Module`` or a :class:`ModelInfo`."""
    from .features import FEATURES
    from .hardware import probe
    from .model_info import describe_model

    cfg = resolve_config(config)
    caps = caps if caps is not None else probe()
    info = model if (model is None or isinstance(model, ModelInfo)) else describe_model(model)
    ctx = PlanContext(config=cfg, caps=caps, model=info, args=args)
    for feature in FEATURES:
        ctx.decisions[feature.NAME] = feature.decide(ctx)
    return Plan(config=cfg, caps=caps, model=info, decisions=ctx.decisions)
