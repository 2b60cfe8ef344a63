"""``profile`` feature: a window of steps traced with labelled regions, loadable by TensorBoard and Perfetto."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupConfig, SpeedupConfigError, plan_for
from hf_speedup.features import profile
from hf_speedup.features.profile import ProfilerCallback, Settings, label_module, labelled_modules

from conftest import REPORTED_BASELINE

LABELS = ["hf_speedup/block.0", "hf_speedup/block.1", "hf_speedup/block.2", "hf_speedup/block.3",
          "hf_speedup/loss", "hf_speedup/optimizer_step"]


def trace_files(output_dir) -> list[Path]:
    """Where TensorBoard's profiler plugin looks: <logdir>/<run>/<worker>.<span>.pt.trace.json."""
    return sorted(Path(output_dir, "profile", "train").glob("*.pt.trace.json"))


def profiled_trainer(make_args, tiny_model, dataset, collator, max_steps=5, **window):
    from hf_speedup import SpeedupTrainer

    config = {**REPORTED_BASELINE, "profile": {"enabled": True, "wait": 1, "warmup": 1, "active": 2, **window}}
    return SpeedupTrainer(model=tiny_model, args=make_args(max_steps=max_steps), train_dataset=dataset,
                          data_collator=collator, speedup=config)


def test_window_trace_is_chrome_json_with_the_labels_and_the_report_has_the_top_operators(
        make_args, tiny_model, dataset, collator, capsys):
    trainer = profiled_trainer(make_args, tiny_model, dataset, collator)
    before = trainer.speedup_status["profile"]
    assert before.engaged and "4 labelled blocks, labelled loss, profiler callback registered" in before.engaged_reason
    trainer.train()

    files = trace_files(trainer.args.output_dir)
    assert len(files) == 1
    trace = json.loads(files[0].read_text())  # what Perfetto / chrome://tracing / TensorBoard load
    names = {e.get("name") for e in trace["traceEvents"]}
    assert set(LABELS) <= names
    steps = sorted(n for n in names if n and n.startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # the active steps: the run's steps 3 and 4
    blocks = [e for e in trace["traceEvents"] if e.get("name") == "hf_speedup/block.0" and e.get("ph") == "X"]
    assert len(blocks) == 2 and all(e["dur"] > 0 for e in blocks)  # one forward per profiled step

    report = json.loads(Path(trainer.args.output_dir, "speedup_report.json").read_text())
    section = report["profile"]
    assert section["steps"] == [3, 4] and section["trace_file"] == str(files[0])
    assert section["labels"] == LABELS
    ops = section["top_operators"]
    assert 0 < len(ops) <= 15 and section["sort_by"] == "self_cpu_time_total"
    assert [o["self_cpu_ms"] for o in ops] == sorted((o["self_cpu_ms"] for o in ops), reverse=True)
    assert any(o["name"] in ("aten::mm", "aten::addmm", "aten::bmm") for o in ops)
    assert not any(o["name"].startswith(("hf_speedup/", "ProfilerStep")) for o in ops)
    assert section["memory_snapshot"] == {"engaged": False, "path": None,
                                          "reason": profile.SNAPSHOT_CPU_REASON.format(device="cpu")}
    entry = report["plan"]["profile"]
    assert entry["engaged"] is True and f"trace written: {files[0]}" in entry["reason"]
    assert entry["applied"] == "steps 3-4"
    assert "Self CPU" in capsys.readouterr().out  # the table printed when the window closed


def test_tensorboards_profiler_plugin_reads_the_trace(make_args, tiny_model, dataset, collator):
    """The trace as TensorBoard's PyTorch profiler plugin (torch-tb-profiler) loads it: the file name matches its
    worker pattern and it builds the Overview, Operator and Trace views from it."""
    pytest.importorskip("torch_tb_profiler")
    from torch_tb_profiler import consts
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    trainer = profiled_trainer(make_args, tiny_model, dataset, collator)
    trainer.train()
    (path,) = trace_files(trainer.args.output_dir)
    match = consts.WORKER_PATTERN.match(path.name)
    assert match, path.name
    data = RunProfileData.parse(match.group(1), None, str(path), str(path.parent / "tb_cache"))
    views = [v.display_name for v in RunGenerator(match.group(1), None, data).generate_run_profile().views]
    assert {"Overview", "Operator", "Trace"} <= set(views), views


def test_a_run_shorter_than_the_window_says_so(make_args, tiny_model, dataset, collator):
    trainer = profiled_trainer(make_args, tiny_model, dataset, collator, max_steps=1, wait=2)
    trainer.train()
    state = trainer.speedup_status["profile"]
    assert not state.engaged
    assert "training ended before the profile window (steps 4-5): no trace" in state.engaged_reason
    assert trace_files(trainer.args.output_dir) == [] and trainer.speedup_report.profile is None


def test_labels_do_not_change_the_model_and_are_put_once(tiny_model):
    ids = torch.arange(12).unsqueeze(0)
    want = tiny_model(input_ids=ids).logits
    block = tiny_model.model.layers[0]
    label_module(block, "x")
    label_module(block, "x")
    assert len(block._forward_pre_hooks) == 1 and len(block._forward_hooks) == 1
    assert labelled_modules(tiny_model) == ["x"]
    with torch.profiler.profile() as prof:
        got = tiny_model(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    assert [e.key for e in prof.key_averages() if e.key == "x"] == ["x"]


def test_cuda_memory_snapshot_of_the_window(make_args, tiny_model, dataset, collator, monkeypatch):
    """The snapshot part, with the CUDA allocator history functions faked: recorded over the active steps,
    dumped to a pickle beside the trace, recording switched off. Also: the callback works with the stock Trainer."""
    from transformers import Trainer

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("record", enabled, kw)))

    def dump(path):
        calls.append(("dump", path))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    callback = ProfilerCallback(Settings(enabled=True, wait=1, warmup=0, active=1, memory_snapshot=True,
                                         top_operators=5, device="cpu"))
    trainer = Trainer(model=tiny_model, args=make_args(max_steps=3), train_dataset=dataset, data_collator=collator,
                      callbacks=[callback])
    trainer.train()
    assert [c[0] for c in calls] == ["record", "dump", "record"]
    assert calls[0][2] == {"max_entries": 100_000, "stacks": "python"} and calls[2][1] is None
    path = Path(calls[1][1])
    assert path.parent == Path(trainer.args.output_dir, "profile", "train") and path.suffix == ".pickle"
    assert callback.results["memory_snapshot"]["engaged"] is True
    assert callback.results["memory_snapshot"]["path"] == str(path)
    assert callback.results["steps"] == [2, 2] and len(callback.results["top_operators"]) == 5


def test_a_memory_snapshot_that_failed_to_dump_says_so(tmp_path, monkeypatch):
    """Not "written when the window closes" after the window closed: the dump's error."""
    def dump(path):
        raise RuntimeError("no allocator history")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    callback = ProfilerCallback(Settings(enabled=True, memory_snapshot=True, device="cuda"))
    callback.trace_dir, callback.worker, callback.snapshot_recording, callback.results = tmp_path, "w", True, {}
    callback._end_snapshot()
    entry = callback.results["memory_snapshot"]
    assert entry["engaged"] is False and entry["path"] is None
    assert entry["reason"] == "memory_snapshot: dump failed: RuntimeError('no allocator history')"


def test_decide_snapshot_on_cuda_only():
    cfg = {"base": "baseline", "profile": {"enabled": True}}
    cuda = plan_for(cfg, fake_caps(**CUDA_H100))["profile"]
    assert cuda.settings.memory_snapshot and not cuda.fallbacks and "CUDA memory snapshot" in cuda.reason
    cpu = plan_for(cfg, fake_caps(**CPU_NO_BF16))["profile"]
    assert not cpu.settings.memory_snapshot
    assert cpu.fallbacks == (f"memory_snapshot: {profile.SNAPSHOT_CPU_REASON.format(device='cpu')}",)
    assert cpu.applied == "steps 3-4" and cpu.settings.window == (3, 4)


@pytest.mark.parametrize("preset", ["baseline", "auto", "fast", "memory", "lora"])
def test_off_in_every_preset(preset):
    assert not plan_for(preset, fake_caps(**CPU_NO_BF16))["profile"].active


@pytest.mark.parametrize("field, value, message", [
    ("wait", -1, r"profile.wait = -1 is not allowed; allowed: an integer >= 0"),
    ("active", 0, r"profile.active = 0 is not allowed; allowed: an integer >= 1"),
    ("enabled", "yes", r"profile.enabled = 'yes' is not allowed; allowed: true, false"),
])
def test_bad_profile_config_names_the_field(field, value, message):
    with pytest.raises(SpeedupConfigError, match=message):
        SpeedupConfig.from_dict({"profile": {field: value}})


def test_example_profile_flag(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from finetune import main

    out = tmp_path / "run"
    main(["--profile", "0,1,1", "--max-steps", "3", "--examples", "200", "--batch-size", "4", "--seq-len", "64",
          "--output-dir", str(out), "--logging-steps", "1", "--cpu"])
    report = json.loads((out / "speedup_report.json").read_text())
    assert report["plan"]["profile"]["applied"] == "step 2" and report["profile"]["steps"] == [2, 2]
    assert len(trace_files(out)) == 1
    with pytest.raises(SystemExit):
        main(["--profile", "1,x"])


# ----------------------------------------------------------------------------------- time breakdown
class Event:
    """A profiler event as ``prof.events()`` gives it: name, self and total times (us), parent."""

    def __init__(self, name, self_us, parent=None, device_us=0.0, total_us=None):
        self.name, self.self_cpu_time_total, self.self_device_time_total = name, self_us, device_us
        self.cpu_time_total = total_us if total_us is not None else self_us
        self.cpu_parent = parent


def test_the_classifier_sorts_operators_into_buckets():
    from hf_speedup.features.profile.breakdown import classify

    assert classify("aten::mm") == classify("aten::addmm") == classify("hf_speedup::onednn_mm") == "matmul"
    assert classify("aten::_grouped_mm") == classify("aten::linear") == "matmul"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert classify("hf_speedup::sdpa_varlen") == classify("aten::_softmax") == "attention"
    # the blocked CPU kernel's own GEMMs and copies are attention's time, not matmul's
    assert classify("hf_speedup_cpu::blocked_attention_backward") == "attention"
    assert classify("aten::bmm", ("hf_speedup_cpu::blocked_attention_forward", "hf_speedup::blocked_attention")) \
        == classify("aten::copy_", ("hf_speedup::blocked_attention_backward",)) == "attention"
    assert classify("aten::_log_softmax") == classify("aten::nll_loss_backward") == "loss"
    assert classify("aten::cross_entropy_loss") == "loss"
    assert classify("aten::mul", ("hf_speedup/loss", "ProfilerStep#3")) == "loss"  # inside the labelled loss
    assert classify("aten::mm", ("hf_speedup/loss",)) == "matmul"  # a GEMM stays a GEMM (a chunked head's)
    assert classify("aten::_foreach_mul_") == classify("aten::_fused_adamw_") == "optimizer"
    assert classify("aten::add_", ("Optimizer.step#AdamW.step", "ProfilerStep#3")) == "optimizer"
    assert classify("aten::mm", ("hf_speedup/optimizer_step",)) == "optimizer"
    assert classify("aten::stack", ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",)) == "data"
    assert classify("## Call CompiledFxGraph fabc ##") == "compiled"  # inductor's fused kernels run inside it
    assert classify("CompiledFunction") == classify("Torch-Compiled Region: 0/1") == "overhead"  # its wrappers
    assert classify("aten::mm", ("## Call CompiledFxGraph fabc ##",)) == "matmul"
    assert classify("aten::add") == classify("aten::silu_backward") == classify("aten::copy_") == "elementwise"
    for overhead in ("autograd::engine::evaluate_function: MmBackward0", "MmBackward0", "hf_speedup/block.0",
                     "torch::autograd::AccumulateGrad", "cudaDeviceSynchronize"):
        assert classify(overhead) == "overhead", overhead


def test_the_breakdown_of_synthetic_steps_adds_up_to_the_step():
    from hf_speedup.features.profile.breakdown import BUCKETS, breakdown_lines, time_breakdown

    events = []
    for _ in range(2):  # two profiled steps of 1000 us each
        step = Event("ProfilerStep#3", 50, total_us=1000)
        block = Event("hf_speedup/block.0", 20, step)
        opt = Event("Optimizer.step#AdamW.step", 10, step)
        loader = Event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 5, step)
        events += [step, block, opt, loader, Event("aten::mm", 500, block), Event("aten::add", 40, block),
                   Event("aten::_scaled_dot_product_flash_attention_for_cpu", 100, block),
                   Event("aten::_log_softmax", 60, step), Event("aten::_foreach_add_", 80, opt),
                   Event("aten::stack", 15, loader)]
    split = time_breakdown(events)
    assert split["steps"] == 2 and split["step_ms"] == 1.0
    ms = split["buckets_ms"]
    assert ms == {"matmul": 0.5, "attention": 0.1, "loss": 0.06, "optimizer": 0.09, "data": 0.02, "compiled": 0.0,
                  "elementwise": 0.04, "overhead": 0.19}  # overhead: the steps' and the label's own time
    assert sum(ms.values()) == pytest.approx(split["step_ms"]) and set(ms) == set(BUCKETS)
    assert split["buckets_percent"]["matmul"] == 50.0 and not split["clipped"]
    assert breakdown_lines(split)[0] == "matmul 50.0% (0.5 ms)"
    # a caller's own step clock (the bench's profiled step), and the device's time on CUDA
    timed = time_breakdown([Event("aten::mm", 0, device_us=300), Event("aten::add", 0, device_us=100)], device=True,
                           step_us=800, steps=1)
    assert timed["buckets_ms"]["matmul"] == 0.3 and timed["buckets_ms"]["overhead"] == 0.4
    assert time_breakdown([Event("aten::mm", 10)])["steps"] == 0  # no step range, no clock: no breakdown


def test_a_profiled_run_says_where_its_step_time_goes(make_args, tiny_model, dataset, collator, capsys):
    trainer = profiled_trainer(make_args, tiny_model, dataset, collator)
    trainer.train()
    split = trainer.speedup_report.to_dict()["profile"]["time_breakdown"]
    assert split["steps"] == 2 and split["step_ms"] > 0
    ms = split["buckets_ms"]
    assert ms["matmul"] > 0 and ms["attention"] > 0 and ms["loss"] > 0 and ms["optimizer"] > 0
    assert ms["overhead"] >= 0 and sum(ms.values()) <= split["step_ms"] * 1.001 + 0.01  # rounding
    assert not split["clipped"]
    out = capsys.readouterr().out
    assert "step time by bucket: " in out and "profiled step" in out and "  matmul" in out
