"""The acceleration report: the verified plan plus measured metrics, as one JSON-serialisable object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .plan import Plan

REPORT_FILE = "speedup_report.json"


@dataclass
class Report:
    plan: Plan
    metrics: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "preset": self.plan.config.name,
            "plan": self.plan.to_dict(),
            "metrics": dict(self.metrics),
            "environment": dict(self.environment),
            "capabilities": self.plan.caps.to_dict(),
            "model": self.plan.model.to_dict() if self.plan.model else None,
            "config": self.plan.config.to_dict(),
        }

    def write(self, output_dir: str | Path) -> Path:
        path = Path(output_dir) / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        return path

    def table(self, width: int = 80) -> str:
        return self.plan.table(width=width)
