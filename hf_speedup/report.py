"""The acceleration report: the verified plan plus measured metrics, as one JSON-serialisable object.

``to_dict()`` sections:

- ``plan``: per feature ``requested / applied / engaged / reason`` (engaged verified on the live objects);
- ``metrics``: the steady-state numbers of DESIGN.md (null until training ran; ``mfu`` null where the
  peak FLOP/s is unknown);
- ``measurement``: how the metrics were obtained (steps, tokens, FLOPs per token, peak used, dtype ...);
- ``environment``: package versions and the device;
- ``history``: one entry per logging step (throughput, step time, memory), bounded in length;
- ``step_times``: ``[global_step, seconds, compiled]`` per optimizer step, bounded in length;
- ``capabilities``, ``model``, ``config``: what the plan was built from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .plan import Plan

REPORT_FILE = "speedup_report.json"
REPORT_VERSION = 1


@dataclass
class Report:
    plan: Plan
    metrics: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    measurement: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    step_times: list = field(default_factory=list)

    def to_dict(self) -> dict:
        from .callback import SUMMARY_METRICS

        metrics = {k: None for k in SUMMARY_METRICS}
        metrics.update(self.metrics)
        return {
            "report_version": REPORT_VERSION,
            "preset": self.plan.config.name,
            "plan": self.plan.to_dict(),
            "metrics": metrics,
            "measurement": dict(self.measurement),
            "environment": dict(self.environment),
            "history": list(self.history),
            "step_times": list(self.step_times),
            "capabilities": self.plan.caps.to_dict(),
            "model": self.plan.model.to_dict() if self.plan.model else None,
            "config": self.plan.config.to_dict(),
        }

    def write(self, output_dir: str | Path) -> Path:
        """Write ``<output_dir>/speedup_report.json`` atomically (readers never see half a file)."""
        path = Path(output_dir) / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        os.replace(tmp, path)
        return path

    def table(self, width: int = 80, max_reason_lines: int | None = 3) -> str:
        """The plan as a table (what is printed when training starts); reasons capped at a few lines."""
        from .console import plan_table

        return plan_table(self.plan, width=width, max_reason_lines=max_reason_lines)

    def metrics_table(self, width: int = 80) -> str:
        """The measured metrics as a table (what is printed when training ends)."""
        from .console import metrics_table

        return metrics_table(self.to_dict(), width=width)


def load_report(path: str | Path) -> dict:
    """A report dict from a ``speedup_report.json`` file or a run directory that holds one
    (directly, or below it: the newest one wins)."""
    p = Path(path)
    if p.is_dir():
        direct = p / REPORT_FILE
        if direct.is_file():
            p = direct
        else:
            found = sorted(p.rglob(REPORT_FILE), key=lambda q: q.stat().st_mtime)
            if not found:
                raise FileNotFoundError(f"no {REPORT_FILE} in {path} (nor below it); pass a training output_dir "
                                        f"or the JSON file itself")
            p = found[-1]
    elif not p.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a training output_dir or a {REPORT_FILE}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or "plan" not in data:
        raise ValueError(f"{p} is not an hf_speedup report (no 'plan' section)")
    data.setdefault("_path", str(p))
    return data
