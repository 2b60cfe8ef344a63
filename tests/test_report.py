"""The acceleration report of a real (short, CPU) training run: JSON, metrics, logs, console, no extra syncs."""

from __future__ import annotations

import statistics

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_speedup import SpeedupTrainer, measured
from hf_speedup.report.schema import PREFIX, SUMMARY_METRICS
from hf_speedup.features import FEATURES
from hf_speedup.peak_flops import OVERRIDE_ENV
from hf_speedup.report import REPORT_FILE

from conftest import REPORTED_BASELINE, TrackerLogs, fake_matmul_peak, tracking

DESIGN_FEATURES = {"precision", "compile", "optimizer", "checkpointing", "empty_cache", "lora", "fsdp"}


class RecordingCollator:
    """Wraps a collator and keeps every batch it made (num_workers=0: made in this process)."""

    def __init__(self, inner):
        self.inner = inner
        self.batches = []

    def __call__(self, features):
        batch = self.inner(features)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


def _train(tiny_model, dataset, collator, make_args, callbacks=None, **kw):
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(**kw), train_dataset=dataset, data_collator=collator,
                             speedup=REPORTED_BASELINE, callbacks=callbacks)
    trainer.train()
    return trainer


@pytest.fixture
def tracker():
    """A TrackerLogs registered as the trainers' tracker (as transformers' W&B or TensorBoard callbacks are)."""
    with tracking(TrackerLogs):
        yield TrackerLogs()


def test_report_of_a_training_run(tiny_model, dataset, collator, make_args, capsys, monkeypatch, tracker):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    rec = RecordingCollator(collator)
    trainer = _train(tiny_model, dataset, rec, make_args, max_steps=4, logging_steps=2, callbacks=[tracker])
    report = trainer.speedup_report.to_dict()

    # the same report is on disk and JSON-serialisable
    on_disk = json.loads((Path(trainer.args.output_dir) / REPORT_FILE).read_text())
    assert on_disk == json.loads(json.dumps(report))

    # plan: every feature, with requested / applied / engaged / reason
    assert DESIGN_FEATURES <= set(report["plan"]) and {f.NAME for f in FEATURES} <= set(report["plan"])
    for entry in report["plan"].values():
        assert {"requested", "applied", "engaged", "reason"} <= set(entry)
        assert isinstance(entry["engaged"], bool) and entry["reason"]

    m, x = report["metrics"], report["measurement"]
    assert set(SUMMARY_METRICS) <= set(m)
    # tokens: exactly the non-padding tokens of the 4 batches trained on (the loader fetches one ahead)
    used = rec.batches[:4]
    non_padding = sum(int(b["attention_mask"].sum()) for b in used)
    padded = sum(b["attention_mask"].numel() for b in used)
    assert x["tokens"] == non_padding < padded  # the fixture data has padding, and it is not counted
    assert x["samples"] == 4 * 4 and x["steps"] == 4
    assert x["mean_sequence_length"] == pytest.approx(non_padding / 16)
    # steady state: step 1 excluded; throughput = tokens per step / median steady step time
    assert x["steady_state_steps"] == 3 and x["warmup_steps"] >= 1
    assert m["step_time_s"] > 0
    assert m["tokens_per_second"] == pytest.approx(non_padding / 4 / m["step_time_s"])
    assert m["samples_per_second"] == pytest.approx(4 / m["step_time_s"])
    # MFU is null on a CPU (no peak known), the FLOPs per token are still reported, by the formula
    assert m["mfu"] is None and x["peak_flops_per_device"] is None
    lengths = [int(n) for b in used for n in b["attention_mask"].sum(-1)]
    s = sum(n * n for n in lengths) / sum(lengths)  # each token attends over its own sequence
    assert x["attention_sequence_length"] == pytest.approx(s) and s > non_padding / 16
    assert x["flops_per_token"] == pytest.approx(6 * 180_800 + 12 * 4 * 64 * s)
    # memory: peak RSS on a CPU; parameters of the live model
    assert m["peak_memory_allocated_bytes"] == m["peak_memory_reserved_bytes"] > 10 << 20
    assert x["memory_source"] == "process peak RSS"
    assert m["trainable_parameters"] == m["total_parameters"] == 213_568
    assert m["compile_seconds"] == 0 and m["recompiles"] == 0 and m["graph_breaks"] == 0
    assert m["compiled_regions"] == 0
    # environment: versions and the device
    env = report["environment"]
    for pkg in ("torch", "transformers", "accelerate", "peft", "bitsandbytes"):
        assert pkg in env
    assert env["torch"] == torch.__version__.split("+")[0] or env["torch"] == torch.__version__
    assert env["device_name"] and env["device_type"] == "cpu"

    # history: one entry per logging step, the window numbers add up to the run
    hist = report["history"]
    assert [h["step"] for h in hist] == [2, 4]
    assert sum(h["steps"] for h in hist) == 4
    assert [s[0] for s in report["step_times"]] == [1, 2, 3, 4]
    assert report["step_times"][0][1] > 0
    # the window's step time is steady state, like the summary's: its compile steps are left out
    warm, times = set(x["warmup_global_steps"]), {entry[0]: entry[1] for entry in report["step_times"]}
    assert 1 in warm
    for h, window in zip(hist, ([1, 2], [3, 4])):
        steady = [times[n] for n in window if n not in warm]
        assert h["step_time_s"] == (pytest.approx(statistics.median(steady), abs=1e-5) if steady else None)  # series: 6 digits

    # every logging step's metrics went to the trackers beside the Trainer's log, the summary at the end
    step_logs = [h for h in tracker.logs if "loss" in h]
    assert len(step_logs) == 2
    for h in step_logs:
        for key in ("tokens_per_second", "samples_per_second", "step_time_s", "peak_memory_allocated_bytes",
                    "recompiles"):
            assert PREFIX + key in h
        assert PREFIX + "mfu" not in h  # null values are not sent to trackers
    final = next(h for h in tracker.logs if "train_runtime" in h)
    assert final[PREFIX + "tokens_per_second"] == m["tokens_per_second"]
    assert final[PREFIX + "total_parameters"] == 213_568
    # ... and not to state.log_history (trainer_state.json), which holds the stock Trainer's logs only
    assert not any(k.startswith(PREFIX) for h in trainer.state.log_history for k in h)
    assert [{k: v for k, v in h.items() if not k.startswith(PREFIX)} for h in tracker.logs] == [
        {k: v for k, v in h.items() if k != "step"} for h in trainer.state.log_history]

    # console: plan table at the start, metrics table at the end, all within 80 columns
    out = capsys.readouterr().out
    assert "hf_speedup plan: preset 'baseline'" in out and "hf_speedup metrics:" in out
    start, end = out.index("hf_speedup plan:"), out.index("hf_speedup metrics:")
    assert start < end
    for line in out[start:].splitlines():
        if line.startswith(("{", "hf_speedup report:")):  # the Trainer's own log lines; the file path
            continue
        assert len(line) <= 80, line


def test_mfu_with_a_peak_override(tiny_model, dataset, collator, make_args, monkeypatch, tracker):
    monkeypatch.setenv(OVERRIDE_ENV, "2e12")
    trainer = _train(tiny_model, dataset, collator, make_args, max_steps=3, logging_steps=1, callbacks=[tracker])
    m, x = trainer.speedup_report.to_dict()["metrics"], trainer.speedup_report.measurement
    assert x["peak_flops_per_device"] == 2e12 and x["peak_flops_source"] == "override"
    assert m["mfu"] == pytest.approx(x["flops_per_token"] * m["tokens_per_second"] / 2e12)
    assert 0 < m["mfu"] < 1
    logs = [h for h in tracker.logs if "loss" in h]
    # step 1 compiled (warm-up): no steady-state figure for its window, the whole-run one is there
    assert PREFIX + "mfu" not in logs[0] and logs[0][PREFIX + "whole_run_tokens_per_second"] > 0
    logged = [h[PREFIX + "mfu"] for h in logs[1:]]
    assert len(logged) == 2 and all(v > 0 for v in logged)


def test_the_step_against_a_measured_matmul_peak(tiny_model, dataset, collator, make_args, monkeypatch, tmp_path,
                                                tracker, capsys):
    """With measuring on, the collector times this machine's matmul peak once (here a fake timer) in the run's
    dtype; the report states achieved model FLOP/s and its fraction of that peak in the JSON, the trackers and
    the console; a second run in the same process reads it back, a run in a new process times it again and keeps
    the best figure the machine has shown."""
    from hf_speedup.report.sinks import wandb_summary_items

    timed = fake_matmul_peak(monkeypatch, tmp_path / "cache")
    trainer = _train(tiny_model, dataset, collator, make_args, max_steps=3, logging_steps=1, callbacks=[tracker])
    report = trainer.speedup_report.to_dict()
    m, x = report["metrics"], report["measurement"]
    assert timed == [("cpu", "fp32", 2048)]  # the run's dtype, once
    assert m["model_flops_per_second"] == pytest.approx(x["flops_per_token"] * m["tokens_per_second"])
    assert m["whole_run_model_flops_per_second"] == pytest.approx(
        x["flops_per_token"] * m["whole_run_tokens_per_second"])
    assert m["matmul_peak_flops_per_second"] == 5e9
    assert m["fraction_of_matmul_peak"] == pytest.approx(m["model_flops_per_second"] / 5e9)
    assert x["matmul_peak_dtype"] == "fp32" and "fake GEMM" in x["matmul_peak_source"]
    assert "cached" not in x["matmul_peak_source"] and m["mfu"] is None  # MFU keeps its nominal-peak meaning
    on_disk = json.loads((Path(trainer.args.output_dir) / REPORT_FILE).read_text())["metrics"]
    assert on_disk["fraction_of_matmul_peak"] == m["fraction_of_matmul_peak"]
    final = next(h for h in tracker.logs if "train_runtime" in h)
    for key in ("model_flops_per_second", "matmul_peak_flops_per_second", "fraction_of_matmul_peak"):
        assert final[PREFIX + key] == m[key]
        assert wandb_summary_items(report)[PREFIX + key] == m[key]
    steady = [h for h in tracker.logs if "loss" in h][1:]  # step 1 compiled: no steady figure in its window
    assert steady and all(0 < h[PREFIX + "fraction_of_matmul_peak"] for h in steady)
    out = capsys.readouterr().out
    assert "of matmul peak" in out and "5.00 GFLOP/s" in out

    again = _train(tiny_model, dataset, collator, make_args, max_steps=2)
    assert len(timed) == 1 and again.speedup_report.metrics.matmul_peak_flops_per_second == 5e9
    monkeypatch.setattr(measured, "_CEILINGS_TIMED", {})  # as in a new process
    again = _train(tiny_model, dataset, collator, make_args, max_steps=2)
    assert len(timed) == 2 and again.speedup_report.metrics.matmul_peak_flops_per_second == 5e9
    assert "(cached)" in again.speedup_report.measurement["matmul_peak_source"]


def test_no_matmul_peak_when_measuring_is_off(tiny_model, dataset, collator, make_args, monkeypatch):
    from hf_speedup import measured
    from hf_speedup.report.measure import matmul_peak as module

    monkeypatch.setenv(measured.MEASURE_ENV, "0")
    monkeypatch.setattr(module, "time_matmul_peak", lambda *a: pytest.fail("timed with measuring off"))
    trainer = _train(tiny_model, dataset, collator, make_args, max_steps=2)
    m, x = trainer.speedup_report.to_dict()["metrics"], trainer.speedup_report.measurement
    assert m["model_flops_per_second"] > 0  # achieved FLOP/s needs no peak
    assert m["matmul_peak_flops_per_second"] is None and m["fraction_of_matmul_peak"] is None
    assert x["matmul_peak_source"] == "matmul peak not measured (HF_SPEEDUP_MEASURE=0)"


def test_gradient_accumulation_counts_every_micro_batch(tiny_model, dataset, collator, make_args):
    rec = RecordingCollator(collator)
    trainer = _train(tiny_model, dataset, rec, make_args, max_steps=2, gradient_accumulation_steps=3,
                     logging_steps=1)
    x = trainer.speedup_report.measurement
    assert x["steps"] == 2 and x["samples"] == 2 * 3 * 4
    assert x["tokens"] == sum(int(b["attention_mask"].sum()) for b in rec.batches[:6])


def test_malformed_peak_override_fails_before_training(tiny_model, dataset, collator, make_args, monkeypatch):
    monkeypatch.setenv(OVERRIDE_ENV, "-3")
    with pytest.raises(ValueError, match=OVERRIDE_ENV):
        SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=dataset, data_collator=collator,
                       speedup="baseline")


def test_history_is_bounded(tiny_model, dataset, collator, make_args):
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=12, logging_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup="baseline")
    trainer.speedup_callback.max_history = 4
    trainer.speedup_callback.max_step_times = 5
    trainer.train()
    report = trainer.speedup_report.to_dict()
    assert 2 <= len(report["history"]) <= 4 and report["history"][0]["step"] == 1
    assert 2 <= len(report["step_times"]) <= 5 and report["step_times"][0][0] == 1
    assert report["measurement"]["steps"] == 12  # the summary still covers every step


def test_compiled_blocks_are_counted_and_their_warmup_excluded(tiny_model, dataset, collator, make_args):
    torch._dynamo.reset()
    for layer in tiny_model.model.layers:
        layer.compile(backend="eager")  # dynamo traces (compile time, recompiles) without inductor's C++ build
    trainer = _train(tiny_model, dataset, collator, make_args, max_steps=5, logging_steps=5)
    m, x = trainer.speedup_report.to_dict()["metrics"], trainer.speedup_report.measurement
    assert m["compiled_regions"] == 4
    assert m["compile_seconds"] > 0 and x["dynamo_frames"] >= 1
    compiled_steps = [s for s, _, compiled in trainer.speedup_report.step_times if compiled]
    assert 1 in compiled_steps  # the first step traced the blocks
    assert x["steady_state_steps"] == 5 - x["warmup_steps"]
    assert set(compiled_steps) <= set(x["warmup_global_steps"])
    # recompiles: the packed rows have different lengths, so dynamo sees new shapes after step 1
    assert m["recompiles"] == trainer.speedup_report.history[-1]["recompiles"] >= 0
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- no extra device syncs
_SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def _count_syncs(fn) -> int:
    """Calls of tensor methods that read a value back to the host (each one syncs on an accelerator)."""
    calls = {"n": 0}
    with pytest.MonkeyPatch.context() as mp:
        for name in _SYNC_METHODS:
            orig = getattr(torch.Tensor, name)

            def wrapper(self, *a, __orig=orig, **k):
                calls["n"] += 1
                return __orig(self, *a, **k)

            mp.setattr(torch.Tensor, name, wrapper)
        fn()
    return calls["n"]


def test_reporting_adds_no_per_step_device_reads(dataset, collator, make_args):
    """Extra host reads with reporting on vs off must not grow with the number of steps: the report only
    reads the device at logging steps (where the Trainer already synchronises) and at the end."""
    logging_steps = 2
    def extra(steps: int) -> int:
        out = []
        for report in (True, False):
            from hf_speedup.tiny import tiny_llama

            model = tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2)
            trainer = SpeedupTrainer(model=model, args=make_args(max_steps=steps, logging_steps=logging_steps),
                                     train_dataset=dataset, data_collator=collator, speedup="baseline")
            if not report:
                trainer.remove_callback(trainer.speedup_callback)
                trainer.speedup_callback = None
            out.append(_count_syncs(trainer.train))
        return out[0] - out[1]

    short, long = extra(2), extra(6)
    n_logs_short, n_logs_long = 2 // logging_steps, 6 // logging_steps
    # at most one read per logging step plus one for the final summary; none per step (6 - 2 more steps
    # but only 3 - 1 more logging steps: any per-step read would add at least 4)
    assert long - short <= n_logs_long - n_logs_short
    assert short <= n_logs_short + 1


# --------------------------------------------------------------------------------- multi-process
_WORKER = textwrap.dedent('''
    import json, os, sys
    import torch
    from transformers import TrainingArguments
    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import tiny_llama, char_tokenizer, make_dataset, causal_lm_collator

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    tok = char_tokenizer()
    ds = make_dataset(tok, n=128, seed=0, pack_to=48)
    batches = []
    inner = causal_lm_collator(tok)
    def collate(features):
        b = inner(features)
        batches.append(int(b["attention_mask"].sum()))
        return b
    model = tiny_llama(seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=ds, data_collator=collate,
                             speedup={"base": "baseline", "report": {"path": "auto"}})
    trainer.train()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"batches": batches, "world": trainer.accelerator.num_processes,
                   "measurement": trainer.speedup_report.measurement}, fh)
    # Both ranks are done: leave without interpreter teardown. torch's gloo backend can abort a process
    # (SIGABRT, "terminate called without an active exception") while Python finalises it, rarely and
    # at random, even after destroy_process_group(); the results above are already on disk.
    torch.distributed.barrier()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
''')


@pytest.mark.distributed
def test_two_processes_sum_tokens_over_ranks(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not Path(torchrun).exists():
        pytest.skip("torchrun not found")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    env.pop(OVERRIDE_ENV, None)
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", str(script), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    # each rank trained on its own 3 batches (its loader fetches one ahead); the report sums both ranks
    expected = sum(sum(r["batches"][:3]) for r in ranks)
    report = json.loads((out / REPORT_FILE).read_text())  # written by the main process only
    assert report["measurement"]["tokens"] == expected
    assert report["measurement"]["samples"] == 2 * 3 * 4
    assert report["measurement"]["num_devices"] == 2
    assert ranks[1]["measurement"]["tokens"] == expected  # every rank holds the same aggregate


def test_batches_without_token_tensors_give_unknown_throughput_not_zero(tiny_model, dataset, make_args):
    """A trainer that steps on raw rows (GRPO's prompts, say) and tokenizes inside compute_loss: nothing to count,
    so throughput and MFU are null with the reason, never a 0 tokens/s that reads like a stalled run."""

    class RawRows(SpeedupTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            ids = torch.tensor(inputs["raw"])
            out = model(input_ids=ids, labels=ids)
            return (out.loss, out) if return_outputs else out.loss

    def raw_collator(features):
        width = min(len(f["input_ids"]) for f in features)
        return {"raw": [f["input_ids"][:width] for f in features]}

    trainer = RawRows(model=tiny_model, args=make_args(max_steps=3, logging_steps=1, remove_unused_columns=False),
                      train_dataset=dataset, data_collator=raw_collator, speedup="baseline")
    trainer.train()
    report = trainer.speedup_report.to_dict()
    m, x = report["metrics"], report["measurement"]
    assert x["steps"] == 3 and x["tokens"] == 0
    assert m["tokens_per_second"] is m["whole_run_tokens_per_second"] is m["samples_per_second"] is m["mfu"] is None
    assert x["tokens_note"].startswith("no token counted: the batches the trainer stepped on carried no input_ids")
    assert not any(PREFIX + "tokens_per_second" in h for h in trainer.state.log_history)
