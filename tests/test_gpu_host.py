"""The GPU path on a machine without a GPU: this host answers as one with an H100 (tests/fake_gpu.py).

What can be proven before the first real CUDA call is proven here, every run: the plan is made for the device
the Trainer trains on (a GPU host told ``use_cpu`` plans exactly as a CPU host), ``auto``, ``fast``,
``memory`` and ``qlora`` plan and apply as on an H100, no setting is applied after the moment torch reads it,
and no feature is reported engaged for something that fell back. What needs the GPU itself is in the ``gpu``
tests (``pytest -m gpu``, benchmarks/RESULTS.md "GPU plan").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fake_gpu import H100_NAME, FirstCudaCall
from hf_speedup import SpeedupTrainer, plan_for
from hf_speedup.hardware import probe

PRESETS = ("auto", "fast", "memory", "qlora")


def _decisions(plan) -> dict:
    return {name: (d.requested, d.applied, d.reason, d.settings, d.fallbacks) for name, d in plan.decisions.items()}


# ------------------------------------------------------------------------------------------ the device
def test_the_probe_reads_the_device_the_trainer_trains_on(gpu_host, monkeypatch, make_args):
    on_gpu = probe(make_args(use_cpu=False))
    assert (on_gpu.device_type, on_gpu.device, on_gpu.device_name) == ("cuda", "cuda:0", H100_NAME)
    assert on_gpu.tf32 and on_gpu.bf16 and on_gpu.bitsandbytes
    told_cpu = probe(make_args(use_cpu=True))
    assert (told_cpu.device_type, told_cpu.device, told_cpu.device_reason) == (
        "cpu", "cpu", "TrainingArguments.use_cpu=True")
    assert told_cpu.compute_capability is None and not told_cpu.tf32 and not told_cpu.bitsandbytes
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # accelerate launch --cpu
    launched_cpu = probe(make_args(use_cpu=False))
    assert (launched_cpu.device_type, launched_cpu.device_reason) == (
        "cpu", "ACCELERATE_USE_CPU (accelerate launch --cpu)")
    assert probe().device_type == "cpu"  # no arguments (hf-speedup plan): the same variable decides


def test_the_probe_asks_about_the_local_ranks_gpu(gpu_host, monkeypatch, make_args):
    args = make_args(use_cpu=False)
    args.__dict__["_setup_devices"] = torch.device("cuda", 1)  # what rank 1 of a torchrun launch resolves
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert probe().device == "cuda:1" and gpu_host.queried[-1] == 1  # no arguments: the local rank's GPU
    gpu_host.queried.clear()
    assert probe(args).device == "cuda:1" and set(gpu_host.queried) == {1}


def test_stock_arguments_and_the_cli_plan_for_the_device_too(gpu_host, tmp_path, capsys):
    """training_arguments() plans for the arguments' device; hf-speedup plan/estimate --cpu for a CPU run."""
    import json

    from hf_speedup import training_arguments
    from hf_speedup.cli import main

    on_gpu = training_arguments("auto", output_dir=str(tmp_path / "a"), report_to=[])
    assert on_gpu.bf16 is True and on_gpu.tf32 is True
    assert torch.get_float32_matmul_precision() == "high"  # for a stock Trainer's torch_compile too
    on_cpu = training_arguments("auto", output_dir=str(tmp_path / "b"), report_to=[], use_cpu=True)
    assert on_cpu.tf32 is None and on_cpu.dataloader_pin_memory is False
    assert main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"]["applied"] == "bf16+tf32"
    assert main(["plan", "--cpu", "--json"]) == 0
    cpu_plan = json.loads(capsys.readouterr().out)
    assert "tf32: n/a on cpu" in cpu_plan["precision"]["reason"] and cpu_plan["liger"]["applied"] == "off"
    assert main(["estimate", "--cpu", "--seq-len", "64"]) == 0
    assert "on cpu, micro-batch 8 x 64 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("device", ["mps", "hpu"])
def test_another_accelerator_is_planned_for_as_itself_conservatively(device, tiny_model):
    """An Apple GPU (or an accelerator hf_speedup has measured nothing on) is not planned as a CPU, nor as CUDA."""
    from types import SimpleNamespace

    caps = probe(SimpleNamespace(use_cpu=False, device=torch.device(device)))
    assert (caps.device_type, caps.device, caps.device_reason) == (device, device, f"TrainingArguments.device={device}")
    assert not (caps.bf16 or caps.tf32 or caps.bitsandbytes or caps.compile)
    plan = plan_for("fast", caps, tiny_model)
    assert plan["precision"].applied == "fp32" and f"tf32: n/a on {device}" in plan["precision"].reason
    assert plan["compile"].applied == "off" and plan["liger"].applied == "off"
    assert plan["optimizer"].applied == ("adamw_fused" if device == "mps" else "adamw")


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.skipif(torch.cuda.is_available(), reason="compares with this machine as a CPU host")
def test_use_cpu_on_a_gpu_host_plans_exactly_as_on_a_cpu_host(preset, tiny_model, make_args, tf32_restored,
                                                              allocator_restored):
    from fake_gpu import GpuHost, clear_device_caches

    args = make_args(use_cpu=True)
    on_cpu_host = plan_for(preset, probe(args), tiny_model, args)
    with pytest.MonkeyPatch.context() as mp:
        clear_device_caches()
        GpuHost().install(mp)
        args = make_args(use_cpu=True)
        on_gpu_host = plan_for(preset, probe(args), tiny_model, args)
        assert plan_for(preset, None, tiny_model, args).caps == on_gpu_host.caps  # the door probes the same
    clear_device_caches()
    assert on_gpu_host.caps == on_cpu_host.caps
    assert _decisions(on_gpu_host) == _decisions(on_cpu_host)


def test_a_trainer_told_use_cpu_on_a_gpu_host_trains_on_the_cpu_without_touching_cuda(gpu_host, tiny_model, dataset,
                                                                                     collator, make_args):
    """Planned for the CPU, named in the report, and no CUDA call at all: the verification probes (here the
    checkpointing one of ``memory``) fork the RNG of the devices the model is on, not of a GPU it is not on."""
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(use_cpu=True, max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup="memory")
    caps = trainer.speedup_plan.caps
    assert (caps.device_type, caps.device, caps.device_reason) == ("cpu", "cpu", "TrainingArguments.use_cpu=True")
    assert "no CUDA caching allocator" in trainer.speedup_plan["memory"].reason
    trainer.train()
    assert trainer.speedup_status["checkpointing"].engaged is True
    report = trainer.speedup_report.to_dict()
    assert (report["environment"]["device"], report["environment"]["device_reason"]) == (
        "cpu", "TrainingArguments.use_cpu=True")
    assert f"on {caps.device_name} (cpu)" in trainer.speedup_report.table()
    assert gpu_host.events == []  # CUDA never initialised


def test_a_model_id_told_use_cpu_on_a_gpu_host_is_loaded_for_the_cpu(gpu_host, monkeypatch, tmp_path, dataset,
                                                                     collator, make_args):
    """The trainer probes once and plans the load and the training for the same device: ``qlora`` with
    ``use_cpu=True`` on a host with an H100 loads the model id plain (no bitsandbytes config, no device map for a
    GPU), as the CPU training plan wants it (a load planned for the host's GPU would quantize it for CUDA)."""
    import hf_speedup.loading as loading
    from hf_speedup.tiny import tiny_llama

    tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2).save_pretrained(tmp_path / "model")
    loads = []
    real = loading.load_kwargs
    monkeypatch.setattr(loading, "load_kwargs", lambda *a, **kw: loads.append((a[1], real(*a, **kw))) or loads[-1][1])
    trainer = SpeedupTrainer(model=str(tmp_path / "model"), args=make_args(use_cpu=True, max_steps=1),
                             train_dataset=dataset, data_collator=collator, speedup="qlora")
    (load_plan, (_, kwargs)), = loads
    assert load_plan.caps == trainer.speedup_plan.caps and load_plan.caps.device_type == "cpu"
    assert "quantization_config" not in kwargs and "device_map" not in kwargs
    assert load_plan["lora"].settings.quantization is None  # qlora -> lora: no bitsandbytes for the CPU
    assert trainer.speedup_plan["lora"].applied == "lora"
    assert gpu_host.events == []  # CUDA never initialised


# ------------------------------------------------------------------------------------------ as on an H100
def _build(preset, model, dataset, collator, args):
    """SpeedupTrainer.__init__ up to the first real CUDA call (the Trainer moving the model): the half-built
    trainer, and the traceback of that call."""
    trainer = SpeedupTrainer.__new__(SpeedupTrainer)
    with pytest.raises(FirstCudaCall) as first:
        trainer.__init__(model=model, args=args, train_dataset=dataset, data_collator=collator, speedup=preset)
    return trainer, first


def _tf32_readable_as_inductor_reads_it() -> str:
    from torch._inductor.select_algorithm import create_precompile_key

    return create_precompile_key("mm", "inputs", []).rsplit(":", 1)[-1]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_gpu_host_plans_and_applies_as_on_an_h100_up_to_the_first_cuda_call(
        preset, gpu_host, tiny_model, dataset, collator, make_args):
    from hf_speedup.compat import get_allocator_settings

    trainer, first = _build(preset, tiny_model, dataset, collator, make_args(use_cpu=False))
    # the first real CUDA call is the Trainer's own move of the model: nothing hf_speedup plans or applies
    # touches the GPU before it
    frames = [entry.name for entry in first.traceback]
    assert "_move_model_to_device" in frames, frames
    plan = trainer.speedup_plan
    assert (plan.caps.device, plan.caps.device_name) == ("cuda:0", H100_NAME)
    assert plan["precision"].applied == "bf16+tf32" and plan["attention"].applied == "sdpa"
    # TF32: set before any matmul reads it, and readable by inductor after every TrainingArguments the
    # trainer built (transformers' enable_tf32 ran in them, after hf_speedup's switch)
    assert torch.get_float32_matmul_precision() == "high" and _tf32_readable_as_inductor_reads_it() == "high"
    timeline = [what for what, _ in gpu_host.events]
    assert timeline[0] == "cuda-init" and timeline[-1] == "first-cuda-call"
    expandable = plan["memory"].settings.expandable_segments
    assert expandable is (preset in ("memory", "qlora"))
    if expandable:
        # the allocator's env variable was read when CUDA initialised (TrainingArguments, the probe): the
        # setting is applied at run time, before the first allocation, and read back from torch
        assert gpu_host.first("cuda-init") < gpu_host.first("allocator-set") < gpu_host.first("first-cuda-call")
        how = trainer.speedup_outcomes["memory"].facts["expandable_how"]
        assert "before the first CUDA allocation" in how and "exported" not in how
        assert "expandable_segments:True" in get_allocator_settings()
    else:
        assert gpu_host.first("allocator-set") is None
    if preset == "fast":
        # padding-free rows: a dynamic sequence dimension, so the preset's max-autotune compiles in mode default
        settings = plan["compile"].settings
        assert plan["compile"].applied.startswith("blocks") and settings.dynamic is True and settings.mode == "default"
    if preset == "qlora":  # the base is quantized while it loads (load_model); one passed in plain trains LoRA
        from hf_speedup.loading import load_kwargs

        _, load = load_kwargs("base", plan_for("qlora", probe(), None, None))
        quant = load["quantization_config"]
        assert quant.load_in_4bit and quant.bnb_4bit_compute_dtype == torch.bfloat16 == load["dtype"]
        assert plan["lora"].applied == "lora" and plan["lora"].fallbacks[0].startswith("qlora -> lora: the model")
        assert plan["optimizer"].applied == "paged_adamw_8bit"


@pytest.mark.parametrize("preset", PRESETS)
def test_a_gpu_host_reports_nothing_engaged_that_fell_back(preset, gpu_host, monkeypatch, tiny_model, dataset,
                                                          collator, make_args):
    """Past the model move (skipped: the model stays on this CPU), the trainer verifies every feature on the
    live objects: an entry engaged is one that applied, with nothing it had to do differently."""
    from transformers import Trainer

    from hf_speedup.compat import tf32_matmul_state

    monkeypatch.setattr(Trainer, "_move_model_to_device", lambda self, model, device: None)
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(use_cpu=False), train_dataset=dataset,
                             data_collator=collator, speedup=preset)
    for name, state in trainer.speedup_status.items():
        if state.engaged:
            assert state.applied != "off", (name, state.engaged_reason)
            assert not state.outcome.fallbacks, (name, state.outcome.fallbacks)
    precision = trainer.speedup_status["precision"]
    assert precision.engaged is tf32_matmul_state()[0] is True, precision.engaged_reason
    assert _tf32_readable_as_inductor_reads_it() == "high"
    if trainer.speedup_plan["compile"].active:
        compiled = trainer.speedup_status["compile"]
        assert compiled.engaged and "4/4 LlamaDecoderLayer blocks compiled" in compiled.engaged_reason
    memory = trainer.speedup_status["memory"]
    if memory.decision.settings.expandable_segments:
        assert memory.engaged and "expandable_segments on" in memory.engaged_reason
        gpu_host.reserve(2**28, expandable=False)  # a platform where the setting does not take
        trainer.verify_speedup()
        assert memory.engaged is False and "NOT in force" in memory.engaged_reason
    assert dataclasses.asdict(trainer.speedup_plan.caps)["device"] == "cuda:0"
