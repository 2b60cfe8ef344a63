"""TensorBoard gets the per-step metrics and the summary through the Trainer's own log path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_speedup import SpeedupTrainer
from hf_speedup.report.schema import PREFIX, SUMMARY_METRICS
from hf_speedup.report import REPORT_FILE

from conftest import REPORTED_BASELINE, fake_matmul_peak

pytest.importorskip("tensorboard")


def test_tensorboard_event_files_hold_the_metrics(tiny_model, dataset, collator, make_args, monkeypatch, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    monkeypatch.setenv("HF_SPEEDUP_PEAK_FLOPS", "1e12")  # so that MFU is a number on this CPU too
    fake_matmul_peak(monkeypatch, tmp_path / "measured")  # and the fraction of the matmul peak
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(report_to=["tensorboard"], max_steps=4, logging_steps=2),
                             train_dataset=dataset, data_collator=collator, speedup=REPORTED_BASELINE)
    trainer.train()
    out = Path(trainer.args.output_dir)
    event_files = list(out.rglob("events.out.tfevents.*"))
    assert event_files, "no TensorBoard event file written"
    acc = EventAccumulator(str(event_files[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    report = json.loads((out / REPORT_FILE).read_text())

    # per logging step: throughput, step time, memory, MFU, recompiles at steps 2 and 4
    for key in ("tokens_per_second", "samples_per_second", "step_time_s", "mfu", "peak_memory_allocated_bytes",
                "peak_memory_reserved_bytes", "recompiles"):
        tag = f"train/{PREFIX}{key}"
        assert tag in tags, key
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps[:2] == [2, 4], (key, steps)
    window_tps = [e.value for e in acc.Scalars(f"train/{PREFIX}tokens_per_second")][:2]
    assert window_tps == pytest.approx([h["tokens_per_second"] for h in report["history"]], rel=1e-6)

    # the end-of-training summary (last value of each tag) equals the JSON report
    for key in SUMMARY_METRICS:
        tag = f"train/{PREFIX}{key}"
        assert tag in tags, key
        assert acc.Scalars(tag)[-1].value == pytest.approx(report["metrics"][key], rel=1e-6), key
    assert 0 < report["metrics"]["mfu"] < 1
