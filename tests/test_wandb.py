"""A real W&B offline run, read back with W&B's own reader (``wandb leet inspect --summary --json``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_speedup import SpeedupTrainer
from hf_speedup.report.schema import PREFIX, STEP_METRICS, SUMMARY_METRICS
from hf_speedup.report import REPORT_FILE

from conftest import REPORTED_BASELINE, fake_matmul_peak

wandb = pytest.importorskip("wandb")


def _wandb_cli() -> str:
    exe = shutil.which("wandb") or str(Path(sys.executable).parent / "wandb")
    if not Path(exe).exists():
        pytest.skip("the wandb command is not installed")
    return exe


def _inspect(run_dir: Path) -> dict:
    proc = subprocess.run([_wandb_cli(), "leet", "inspect", "--summary", "--json", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _history(run_dir: Path) -> list[dict]:
    """The run's history records, as W&B's reader prints them (one JSON record per line)."""
    proc = subprocess.run([_wandb_cli(), "leet", "inspect", "--json", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = []
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        if rec.get("type") == "history":
            rows.append(rec)
    return rows


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    # wandb keeps the settings of its first setup (run directory included) in a process-wide singleton:
    # tear it down so this test's environment is the one read, and leave none behind for the next test
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "hf_speedup_tests")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("HF_SPEEDUP_PEAK_FLOPS", raising=False)
    yield tmp_path
    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()


def test_wandb_run_has_plan_config_and_metric_summary(offline_wandb, tiny_model, dataset, collator, make_args,
                                                      monkeypatch, tmp_path):
    fake_matmul_peak(monkeypatch, tmp_path / "measured")  # so the fraction of the matmul peak is a number too
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(report_to=["wandb"], max_steps=4, logging_steps=2,
                                                               run_name="report-test"),
                             train_dataset=dataset, data_collator=collator, speedup=REPORTED_BASELINE)
    trainer.train()
    wandb.finish()

    runs = sorted((offline_wandb / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run = _inspect(runs[0])
    assert run["state"] == "finished" and run["exit_code"] == 0
    report = json.loads((Path(trainer.args.output_dir) / REPORT_FILE).read_text())
    config, summary = run["config"], run["summary"]

    # the plan: every feature, every field, equal to the JSON report
    assert config[PREFIX + "preset"] == "baseline"
    for feature, entry in report["plan"].items():
        for field in ("requested", "applied", "engaged", "reason", "fallbacks"):
            assert config[f"{PREFIX}{feature}/{field}"] == entry[field], (feature, field)

    # the metrics: in the summary under hf_speedup/<metric>, equal to the JSON report (nulls are absent)
    for key in SUMMARY_METRICS:
        value = report["metrics"][key]
        if value is None:
            assert PREFIX + key not in summary
        else:
            assert summary[PREFIX + key] == pytest.approx(value, rel=1e-12), key
    assert report["metrics"]["mfu"] is None  # CPU: unknown peak -> null, not a made-up number
    assert summary[PREFIX + "trainable_parameters"] == 213_568

    # logged during training: in each logging step's history row, beside the Trainer's train/loss, the step
    # metrics under hf_speedup/<metric> (not under the train/ the Trainer's W&B callback gives its own logs)
    rows = [r for r in _history(runs[0]) if "train/loss" in json.dumps(r)]
    assert len(rows) >= 2
    text = json.dumps(rows)
    for key in STEP_METRICS:
        if key != "mfu":
            assert f'"{PREFIX}{key}"' in text, key
    assert "train/hf_speedup" not in json.dumps(_history(runs[0]))


def test_no_wandb_run_no_wandb_calls(tiny_model, dataset, collator, make_args, tmp_path, monkeypatch):
    """report_to=[] and no active run: nothing is sent to W&B, the JSON report is still written."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert wandb.run is None
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup=REPORTED_BASELINE)
    trainer.train()
    assert wandb.run is None and not (tmp_path / "wandb").exists()
    assert (Path(trainer.args.output_dir) / REPORT_FILE).is_file()
