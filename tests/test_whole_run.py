"""Honest throughput: whole-run figures (wall clock, compiles and recompiles included) and the seconds spent
compiling and recompiling beside the steady-state ones, in the JSON, the console table and the trackers."""

from __future__ import annotations

import pytest

from conftest import TrackerLogs, tracking
from hf_speedup import SpeedupTrainer, get_preset
from hf_speedup.report.console import compare_table, fmt_num, metrics_table


@pytest.fixture(scope="module")
def recompiling_run(tmp_path_factory):
    """Static-shape compile on rows of changing length: the first step compiles, later ones recompile."""
    import torch
    from transformers import TrainingArguments

    torch._dynamo.reset()  # graphs an earlier test compiled for these shapes would be reused: no recompile to see

    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset, tiny_llama

    tok = char_tokenizer()
    cfg = get_preset("fast").replace(compile={"backend": "eager", "dynamic": False, "when": "always"},
                                     data={"padding_free": False, "pad_to_multiple_of": None, "drop_last": None})
    args = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("run")), per_device_train_batch_size=4,
                             max_steps=6, logging_steps=2, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    model = tiny_llama(seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2)
    tracker = TrackerLogs()
    with tracking(TrackerLogs):
        trainer = SpeedupTrainer(model=model, args=args, train_dataset=make_dataset(tok, n=64, seed=3),
                                 data_collator=causal_lm_collator(tok), speedup=cfg, callbacks=[tracker])
        trainer.train()
    trainer.tracker = tracker
    return trainer


def test_whole_run_figures_sit_beside_the_steady_ones(recompiling_run):
    report = recompiling_run.speedup_report.to_dict()
    m, x = report["metrics"], report["measurement"]
    assert m["recompiles"] >= 1 and m["compile_seconds"] > 0
    assert 0 < m["recompile_seconds"] < m["compile_seconds"]  # the first step's compile is not a recompile
    stepped = sum(seconds for _, seconds, _ in report["step_times"])
    assert m["whole_run_seconds"] >= stepped * 0.999  # every step's wall clock, compiling ones too
    assert m["whole_run_tokens_per_second"] == pytest.approx(x["tokens"] / m["whole_run_seconds"], rel=1e-4)
    assert m["whole_run_samples_per_second"] == pytest.approx(x["samples"] / m["whole_run_seconds"], rel=1e-4)
    steady_wall = x["steps"] * m["step_time_s"]  # what the steady figure assumes every step took
    assert m["tokens_per_second"] == pytest.approx(x["tokens"] / steady_wall)


def test_console_says_which_figure_it_shows(recompiling_run):
    report = recompiling_run.speedup_report.to_dict()
    table = metrics_table(report, width=100)
    steady = next(line for line in table.splitlines() if line.startswith("tokens/s steady"))
    whole = next(line for line in table.splitlines() if line.startswith("tokens/s whole run"))
    assert fmt_num(report["metrics"]["tokens_per_second"]) in steady
    assert fmt_num(report["metrics"]["whole_run_tokens_per_second"]) in whole
    flat = " ".join(table.split())
    assert "steady state: median step, compiling steps left out" in flat
    assert "compiles and recompiles included" in flat
    assert "recompile time" in table
    side = compare_table([report, report], ["a", "b"], width=100)
    assert "tokens/s whole" in side and "whole vs first" in side


def test_trackers_get_whole_run_and_compile_seconds(recompiling_run):
    logs = recompiling_run.tracker.logs
    steps = [e for e in logs if "loss" in e]
    final = next(e for e in logs if "train_runtime" in e)
    assert all("hf_speedup/whole_run_tokens_per_second" in e and "hf_speedup/compile_seconds" in e for e in steps)
    for key in ("whole_run_tokens_per_second", "whole_run_seconds", "recompile_seconds", "tokens_per_second"):
        assert final[f"hf_speedup/{key}"] == recompiling_run.speedup_report.to_dict()["metrics"][key]
