"""The plan's types: what each feature decided (frozen, typed) and what applying and verifying it found.

A :class:`Plan` is fixed once ``build_plan`` returns. What happens afterwards (an apply step that
had to fall back, what verify read off the live objects) is recorded in the feature's
:class:`Outcome`, beside the decision, never in it. The report joins the two.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .config import SpeedupConfig
from .dtypes import short_name
from .hardware import Capabilities
from .model_info import ModelInfo

OFF = "off"  # ``Decision.applied`` of a feature that does nothing
WITHDRAWN = "withdrawn"  # ``Outcome.applied`` of a feature planned, then taken out again by apply or verify

# The order the report shows features in (DESIGN.md's seven, then ours).
REPORT_ORDER = ("precision", "compile", "optimizer", "checkpointing", "memory", "lora", "fsdp", "data")


@dataclass(frozen=True)
class Decision:
    """One feature: what was asked, what will be done (``applied``, a short label) and why.

    ``settings`` is the feature's own frozen dataclass (``features/<name>.py::Settings``): the typed
    parameters its apply step uses.
    """

    feature: str
    requested: Any
    applied: str
    reason: str
    settings: Any = None
    fallbacks: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Whether there is anything to apply: every feature says ``applied="off"`` when there is not."""
        return self.applied != OFF

    def replace(self, **changes: Any) -> "Decision":
        return dataclasses.replace(self, **changes)


@dataclass
class Outcome:
    """What apply did and verify found for one feature, kept apart from the (frozen) decision."""

    applied: str | None = None  # what apply ended up doing where it differs from the plan
    notes: list[str] = field(default_factory=list)  # added to the plan's reason (e.g. how a setting took effect)
    fallbacks: list[str] = field(default_factory=list)  # fallbacks only apply could discover (reported, logged)
    facts: dict = field(default_factory=dict)  # read off the live objects; the report shows them under settings
    engaged: bool | None = None  # None until verified on the real objects
    engaged_reason: str = "not verified yet"
    # what a feature's own hooks hand each other between phases (``prepare`` -> ``attach``); never reported
    handoff: dict = field(default_factory=dict, repr=False)

    def withdraw(self, why: str) -> None:
        """The feature was planned but apply or verify took it out again (a check forward failed, the model
        refused it): it reads as withdrawn, never as applied, with the reason, in every later report."""
        self.applied = WITHDRAWN
        self.facts["withdrawn"] = why
        self.engaged = False

    @property
    def withdrawn(self) -> str | None:
        """Why the feature was withdrawn after planning (None while it stands)."""
        return self.facts.get("withdrawn") if self.applied == WITHDRAWN else None


@dataclass(frozen=True)
class FeatureState:
    """A feature as it stands now: the frozen decision joined with its outcome (what the report shows)."""

    decision: Decision
    outcome: Outcome

    @property
    def feature(self) -> str:
        return self.decision.feature

    @property
    def requested(self) -> Any:
        return self.decision.requested

    @property
    def applied(self) -> str:
        return self.outcome.applied if self.outcome.applied is not None else self.decision.applied

    @property
    def settings(self) -> Any:
        return self.decision.settings

    @property
    def facts(self) -> dict:
        return self.outcome.facts

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return self.decision.fallbacks + tuple(self.outcome.fallbacks)

    @property
    def engaged(self) -> bool | None:
        return self.outcome.engaged

    @property
    def engaged_reason(self) -> str:
        return self.outcome.engaged_reason

    @property
    def reason(self) -> str:
        """The plan's reason, what apply added, and what verify found (a note verify repeats is said once)."""
        verified = self.outcome.engaged_reason or ""
        notes = [n for n in self.outcome.notes if not (self.outcome.engaged is not None and n and n in verified)]
        reason = "; ".join([self.decision.reason, *notes])
        if self.outcome.engaged is not None and verified and verified != reason:
            reason = f"{reason}; verified: {verified}"
        return reason

    def to_dict(self) -> dict:
        """The report's entry: ``requested / applied / engaged / reason / settings / fallbacks``."""
        settings = jsonable(self.settings) if self.settings is not None else {}
        settings.update(jsonable(self.facts))
        return {"requested": jsonable(self.requested), "applied": self.applied, "engaged": bool(self.engaged),
                "reason": self.reason, "settings": settings, "fallbacks": list(self.fallbacks)}


def jsonable(v: Any) -> Any:
    """Plain JSON values: dataclasses as dicts, dtypes by their short names, tuples as lists."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, torch.dtype):
        return short_name(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [jsonable(x) for x in v]
    return str(v)


@dataclass
class PlanContext:
    """What every feature's ``decide`` may read; ``decisions`` holds the features decided earlier."""

    config: SpeedupConfig
    caps: Capabilities
    model: ModelInfo | None
    args: Any | None  # transformers.TrainingArguments (user's) or None
    decisions: dict[str, Decision] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    config: SpeedupConfig
    caps: Capabilities
    model: ModelInfo | None
    decisions: Mapping[str, Decision]

    def __post_init__(self) -> None:
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))

    def __getitem__(self, feature: str) -> Decision:
        return self.decisions[feature]

    def __iter__(self):
        return (self.decisions[k] for k in self.ordered_names())

    def ordered_names(self) -> list[str]:
        known = [k for k in REPORT_ORDER if k in self.decisions]
        return known + [k for k in self.decisions if k not in known]

    def states(self, outcomes: Mapping[str, Outcome] | None = None) -> dict[str, FeatureState]:
        """Every feature joined with its outcome (a fresh, unverified one where none is given), in report order."""
        outcomes = outcomes or {}
        return {k: FeatureState(self.decisions[k], outcomes.get(k) or Outcome()) for k in self.ordered_names()}
