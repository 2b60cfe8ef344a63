"""The main job: examples/finetune.py on the embedded default, under python and accelerate launch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "finetune.py"
ENV = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _summary(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith('{"preset"')][-1])


def test_example_loss_falls_and_report_is_written(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--speedup", "auto", "--max-steps", "40", "--batch-size", "8",
         "--seq-len", "64", "--examples", "800", "--logging-steps", "5", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    s = _summary(out.stdout)
    assert s["last_loss"] < s["first_loss"] - 1.0, s
    report = json.loads((tmp_path / "speedup_report.json").read_text())
    assert report["preset"] == "auto" and "compile" in report["plan"]


def test_example_rejects_bad_preset_before_loading(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--speedup", "turbo", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode != 0
    assert "speedup = 'turbo' is not a known preset" in out.stderr


@pytest.mark.distributed
def test_example_runs_under_accelerate_launch(tmp_path):
    out = subprocess.run(
        ["accelerate", "launch", "--num_processes", "1", "--cpu", "--mixed_precision", "no", str(SCRIPT),
         "--speedup", "lora", "--max-steps", "3", "--seq-len", "64", "--examples", "200", "--logging-steps", "1",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _summary(out.stdout)["preset"] == "lora"
    report = json.loads((tmp_path / "speedup_report.json").read_text())
    assert report["plan"]["lora"]["engaged"] is True, report["plan"]["lora"]
