"""Where a report goes: a JSON file (``report.path``, by default ``<output_dir>/speedup_report.json``), the W&B
run, the console.

Reporting never ends a training run: a sink that fails logs a warning and the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .console import metrics_table
from .schema import PLAN_FIELDS, PREFIX, REPORT_FILE, Report

logger = logging.getLogger("hf_speedup")


def write_json_atomically(path: Path, data: Any, consequence: str, indent: int | None = None) -> Path | None:
    """``path`` holds the whole JSON or is left as it was (readers never see half a file). A report must
    never end a run: on failure (read-only directory, disk full) a warning saying ``consequence``, the
    partial file removed, and None."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=indent, default=str))
        os.replace(tmp, path)
        return path
    except OSError as exc:
        logger.warning("hf_speedup: could not write %s (%s); %s", path, exc, consequence)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return None


def report_file(setting: Any, output_dir: str | Path) -> Path | None:
    """Where ``report.path`` puts the JSON: ``auto`` -> ``<output_dir>/speedup_report.json``; a directory (existing,
    or written with a trailing slash) -> ``speedup_report.json`` inside it; None -> not written."""
    if setting is None:
        return None
    if setting == "auto":
        return Path(output_dir) / REPORT_FILE
    text = str(setting)
    path = Path(text).expanduser()
    return path / REPORT_FILE if path.is_dir() or text.endswith(("/", os.sep)) else path


def write_json(report: Report, path: str | Path) -> Path | None:
    """The report at ``path``, atomically; None (and a warning) where it cannot be written."""
    return write_json_atomically(Path(path), report.to_dict(),
                                 "training goes on, the report stays in trainer.speedup_report", indent=2)


def wandb_config_items(report: dict) -> dict:
    """``hf_speedup/<feature>/<field>`` for the plan (plus preset and device) — the W&B config keys."""
    out: dict[str, Any] = {PREFIX + "preset": report.get("preset")}
    env = report.get("environment") or {}
    if env.get("device_name"):
        out[PREFIX + "device_name"] = env["device_name"]
    for feature, entry in (report.get("plan") or {}).items():
        for field in PLAN_FIELDS:
            if field in entry:
                out[f"{PREFIX}{feature}/{field}"] = entry[field]
    return out


def wandb_summary_items(report: dict) -> dict:
    """``hf_speedup/<metric>`` for every known metric of the report (W&B drops nulls, so do we)."""
    return {PREFIX + k: v for k, v in (report.get("metrics") or {}).items() if v is not None}


def _wandb_run():
    """The active W&B run, without importing wandb when nobody else did."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


def route_wandb_metrics(callbacks) -> None:
    """Our metrics under their own ``hf_speedup/<metric>`` keys in W&B's history, not ``train/hf_speedup/...``.

    transformers' W&B callback files every training log under ``train/``. Ours are taken out of what it sees
    and logged uncommitted just before it, so they land in the same history row. The end-of-run values go to
    the run summary only (``to_wandb``), not into the per-step series as a last point. Other trackers still get
    everything through the Trainer's own logging.
    """
    for callback in callbacks:
        if type(callback).__name__ != "WandbCallback" or getattr(callback.on_log, "_hf_speedup", False):
            continue

        def on_log(args, state, control, model=None, logs=None, _original=callback.on_log, _cb=callback, **kw):
            ours = {k: v for k, v in (logs or {}).items() if k.startswith(PREFIX)}
            if ours:
                logs = {k: v for k, v in logs.items() if not k.startswith(PREFIX)}
                if "train_runtime" not in logs and _cb._wandb is not None and state.is_world_process_zero:
                    try:
                        if not _cb._initialized:
                            _cb.setup(args, state, model)
                        _cb._wandb.log(ours, commit=False)
                    except Exception as exc:  # a tracker hiccup must not end a training run
                        logger.warning("hf_speedup: could not log to the W&B run: %r", exc)
            return _original(args, state, control, model=model, logs=logs, **kw)

        on_log._hf_speedup = True
        callback.on_log = on_log


def to_wandb(report: dict, summary: bool) -> None:
    """The plan into the active W&B run's config; with ``summary`` the metrics into its summary too."""
    run = _wandb_run()
    if run is None:
        return
    try:
        run.config.update(wandb_config_items(report), allow_val_change=True)
        if summary:
            run.summary.update(wandb_summary_items(report))
    except Exception as exc:  # a tracker hiccup must not end a training run
        logger.warning("hf_speedup: could not update the W&B run: %r", exc)


def print_plan(report: Report) -> None:
    print(report.table(), flush=True)


def print_metrics(report: Report, path: Path | None) -> None:
    print(metrics_table(report.to_dict()), flush=True)
    print(f"hf_speedup report: {path if path is not None else '(not written: see the warning above)'}", flush=True)
