"""Goodput: the whole run's wall clock (process start to the end of training) split into set-up, compile, productive
steps, blocked by saves, evaluation, waiting for data and other, in the JSON, the console, the trackers, across a
resume and in ``hf-speedup bench``'s whole-run columns. Only sums, lower bounds and zeros are asserted: nothing here
depends on how fast this machine is."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import TrackerLogs, tracking
from hf_speedup import SpeedupTrainer
from hf_speedup.report import goodput as G
from hf_speedup.report.carry import STATE_FILE
from hf_speedup.report.console import compare_table, fmt_pct, metrics_table

SLEEP = 0.01  # seconds each training row's __getitem__ sleeps
BATCH, STEPS = 4, 4
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
FLAT = ("setup_seconds", "compile_seconds", "productive_step_seconds", "save_blocked_seconds", "eval_seconds",
        "data_wait_seconds", "other_seconds")


class SlowRows:
    """A map-style dataset whose every row takes ``SLEEP`` seconds to fetch."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        time.sleep(SLEEP)
        return self.rows[i]


def _rows(tokenizer, n, seed):
    from hf_speedup.tiny import make_rows

    data = make_rows(tokenizer, n=n, seed=seed, pack_to=64)
    return [data[i] for i in range(len(data))]


def _run(tokenizer, out, *, evaluate: bool, save: bool, resume=None, callbacks=()):
    from transformers import TrainingArguments

    from hf_speedup.tiny import causal_lm_collator, tiny_llama

    extra = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4) if evaluate else {}
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                             save_strategy="steps" if save else "no", save_steps=2, **extra)
    trainer = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=args,
                             train_dataset=SlowRows(_rows(tokenizer, 32, 0)),
                             eval_dataset=_rows(tokenizer, 8, 1) if evaluate else None,
                             data_collator=causal_lm_collator(tokenizer), callbacks=list(callbacks),
                             speedup={"base": "auto", "report": {"console": False}})
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def full_run(tokenizer, tmp_path_factory):
    """Evaluation and a checkpoint every 2 steps, a slow data set; the trackers' logs kept."""
    tracker = TrackerLogs()
    # the first train() of a process, whatever ran before it in this one (the whole suite runs in one process)
    with tracking(TrackerLogs), pytest.MonkeyPatch.context() as mp:
        mp.setattr(G, "_last_run_end", None)
        trainer = _run(tokenizer, tmp_path_factory.mktemp("full"), evaluate=True, save=True, callbacks=[tracker])
    trainer.tracker = tracker
    return trainer


def _split(trainer) -> tuple[dict, dict, dict]:
    report = trainer.speedup_report.to_dict()
    return report["metrics"], report["measurement"]["time_split"], report


def _sums_to_wall(parts: dict) -> None:
    assert set(parts) == {*G.PARTS, "wall_seconds"}
    assert all(parts[k] >= 0 for k in G.PARTS)
    assert sum(parts[k] for k in G.PARTS) == pytest.approx(parts["wall_seconds"], abs=1e-5)


def test_the_parts_sum_to_the_wall_clock(full_run):
    m, split, _ = _split(full_run)
    _sums_to_wall(split["run"])
    assert split["run"] == split["this_process"]  # a fresh run: the run is this process
    # the flat metrics are the same parts (compile: the report's compile_seconds)
    assert sum(m[k] for k in FLAT) == pytest.approx(m["wall_clock_seconds"], abs=1e-4)
    assert m["compile_seconds"] == pytest.approx(split["run"]["compile"], abs=1e-4)
    # the training loop's parts are the loop's wall clock, measured apart from process start
    loop = m["wall_clock_seconds"] - m["setup_seconds"]
    assert loop == pytest.approx(m["whole_run_seconds"], abs=0.05 * m["whole_run_seconds"] + 0.05)
    assert "process start" in split["covers"]


def test_goodput_is_the_productive_share(full_run):
    m, split, _ = _split(full_run)
    assert 0 < m["goodput"] <= 1
    assert m["goodput"] == pytest.approx(m["productive_step_seconds"] / m["wall_clock_seconds"], abs=1e-6)
    assert split["goodput_this_process"] == m["goodput"]


def test_evaluation_saves_and_data_wait_are_timed(full_run):
    m, _, _ = _split(full_run)
    assert m["eval_seconds"] > 0 and m["save_blocked_seconds"] > 0
    # every row of the STEPS x BATCH trained on slept SLEEP seconds inside the trainer's get_batch_samples
    assert m["data_wait_seconds"] >= STEPS * BATCH * SLEEP


def test_no_evaluation_and_no_saves_count_zero(tokenizer, tmp_path):
    trainer = _run(tokenizer, tmp_path, evaluate=False, save=False)
    m, split, _ = _split(trainer)
    _sums_to_wall(split["run"])
    assert m["eval_seconds"] == 0.0 and m["save_blocked_seconds"] == 0.0
    assert m["data_wait_seconds"] >= STEPS * BATCH * SLEEP
    assert 0 < m["goodput"] <= 1
    assert trainer.evaluate(eval_dataset=_rows(tokenizer, 8, 1))  # evaluation outside train(): not in the clock
    assert trainer.speedup_report.to_dict()["metrics"]["eval_seconds"] == 0.0


def test_trackers_get_goodput_in_the_summary(full_run):
    final = next(e for e in full_run.tracker.logs if "train_runtime" in e)
    metrics = full_run.speedup_report.to_dict()["metrics"]
    for key in ("goodput", "wall_clock_seconds", *FLAT):
        assert final[f"hf_speedup/{key}"] == metrics[key]


def test_console_shows_the_goodput_line(full_run):
    m, _, report = _split(full_run)
    table = metrics_table(report, width=80)
    assert all(len(line) <= 80 for line in table.splitlines())
    line = next(line for line in table.splitlines() if line.startswith("goodput "))
    assert fmt_pct(m["goodput"]) in line
    flat = " ".join(table.split())
    assert "productive step time / wall clock from process start" in flat
    assert "run wall clock" in table and all(f"{p} " in flat for p in ("set-up", "saves", "eval", "data", "other"))
    side = compare_table([report, report], ["a", "b"], width=80)
    assert "goodput" in side and "saves blocked" in side


def test_a_resume_carries_the_split(full_run, tokenizer, tmp_path):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(Path(full_run.args.output_dir) / "checkpoint-2", ckpt)
    carried = json.loads((ckpt / STATE_FILE).read_text())
    assert carried["time_split_runs"] == 1
    _sums_to_wall(carried["time_split"])
    assert carried["time_split"]["save"] > 0  # the checkpoint's own save, up to the moment its counters were written

    resumed = _run(tokenizer, tmp_path / "resumed", evaluate=True, save=True, resume=str(ckpt))
    m, split, report = _split(resumed)
    assert report["measurement"]["train_runs"] == 2 and split["runs_covered"] == 2
    assert split["covers"].startswith("the run: 2 train() runs")
    _sums_to_wall(split["run"])
    _sums_to_wall(split["this_process"])
    assert split["run"] == pytest.approx(G.combine(carried["time_split"], split["this_process"]), abs=1e-5)
    assert m["wall_clock_seconds"] == split["run"]["wall_seconds"]
    assert m["goodput"] == pytest.approx(split["run"]["steps"] / split["run"]["wall_seconds"], abs=1e-6)
    assert split["goodput_this_process"] == G.goodput(split["this_process"])
    assert "all 2 train() runs" in " ".join(metrics_table(report).split())

    # a checkpoint from before the split (an older version): the run's figures cover this process only
    (ckpt / STATE_FILE).write_text(json.dumps({k: v for k, v in carried.items()
                                               if k not in ("time_split", "time_split_runs")}))
    older = _run(tokenizer, tmp_path / "older", evaluate=False, save=False, resume=str(ckpt))
    m, split, report = _split(older)
    assert report["measurement"]["train_runs"] == 2 and split["runs_covered"] == 1
    assert split["covers"].startswith("this process only")
    assert split["run"] == split["this_process"] and m["goodput"] == split["goodput_this_process"]


# ------------------------------------------------------------------------------------------------ bench
def test_bench_worker_splits_its_timed_steps(tokenizer, tmp_path):
    """The bench's own hooks on the stock Trainer: each timed step's wait for data and its save."""
    from transformers import Trainer, TrainingArguments

    from hf_speedup.bench.meters import MemoryProbe, StepSplit, TokenMeter
    from hf_speedup.bench.results import whole_run_split
    from hf_speedup.bench.variants import counting
    from hf_speedup.bench.worker import bench_callback
    from hf_speedup.tiny import causal_lm_collator, tiny_llama

    class Clock:  # the lock step without a parent: the next "go" comes at once
        def ready(self):
            self.go = time.perf_counter()

        def stop(self):
            return time.perf_counter() - self.go, 0

        def report(self, step, seconds, faults):
            self.go = time.perf_counter()

    meter, split, clock = TokenMeter(), StepSplit(), Clock()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=STEPS,
                             report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                             save_strategy="steps", save_steps=2, logging_steps=10**9)
    trainer = counting(Trainer, meter, split)(model=tiny_llama(seed=0, **SMALL), args=args,
                                              train_dataset=SlowRows(_rows(tokenizer, 32, 0)),
                                              data_collator=causal_lm_collator(tokenizer))
    trainer.add_callback(bench_callback(clock, meter, MemoryProbe(), set(), None, "cpu", split=split))
    trainer.train()
    steps = split.per_step()
    assert all(len(v) == STEPS for v in steps.values())
    assert sum(steps["data"]) >= STEPS * BATCH * SLEEP  # every row trained on was fetched inside a timed step
    # the save after step 2 falls in step 3's window (after the parent's "go"); none before any save
    assert steps["save"][0] == steps["save"][1] == 0.0 and steps["save"][2] > 0
    out = whole_run_split(steps, [1.0] * STEPS, 10.0)
    assert out["save_blocked_s"] == pytest.approx(sum(steps["save"]))
    assert 0 < out["goodput"] <= 1


def test_bench_results_have_the_whole_run_columns():
    from hf_speedup.bench.options import BenchOptions
    from hf_speedup.bench.results import COLUMNS, markdown_table, summarize, table_rows

    opts = BenchOptions(steps=4, warmup=1, batch_size=2)
    base = dict(loss=2.0, matmul_trainable=1000, matmul_frozen=0, layers=2, attention_width=8, peak_flops=None,
                peak_rss_bytes=2**20, peak_memory_bytes=2**20, tokens=[10] * 4)
    split = {"data": [0.1, 0.1, 0.1, 0.1], "save": [0.0, 0.0, 0.5, 0.0], "compile": [1.0, 0.0, 0.0, 0.0]}
    rows = {"stock": {"name": "stock", "kind": "peer", "status": "ok", "seconds": [2.0, 1.0, 1.5, 1.0],
                      "faults": [0] * 4, "setup_s": 4.5, "result": {**base, "step_split": split}},
            "custom": {"name": "custom", "kind": "custom", "status": "ok", "seconds": [1.0] * 4, "faults": [0] * 4,
                       "setup_s": 1.0, "result": dict(base)}}
    entries = {e["name"]: e for e in summarize(rows, opts)}
    m = entries["stock"]["metrics"]
    assert m["whole_run_s"] == pytest.approx(10.0)
    assert m["productive_step_s"] == pytest.approx(5.5 - 0.4 - 0.5 - 1.0)
    assert m["goodput"] == pytest.approx(3.6 / 10.0) and m["save_blocked_s"] == pytest.approx(0.5)
    assert entries["custom"]["metrics"].get("goodput") is None  # not split: an empty cell, not a guess
    i, j = COLUMNS.index("goodput"), COLUMNS.index("save-blocked s")
    assert COLUMNS[i - 2:j + 1] == ("whole run s", "whole-run tokens/s", "goodput", "save-blocked s")
    cells = table_rows([entries["stock"], entries["custom"]])
    assert (cells[0][i], cells[0][j]) == ("36.0%", "0.50") and (cells[1][i], cells[1][j]) == ("", "")
    assert all(line.count("|") == len(COLUMNS) + 1 for line in markdown_table(list(entries.values())).splitlines())
