"""precision: the bf16 -> fp16 -> fp32 chain per machine, strict errors, and what really runs."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_AMX, CPU_NO_BF16, CUDA_H100, CUDA_V100, fake_caps
from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset
from hf_speedup.plan import plan_for as make_plan
from hf_speedup.features import precision
from hf_speedup.plan_types import Outcome

NO_AMX_REASON = "CPU has avx512_bf16 but no AMX: whether bf16 autocast beats fp32 depends on the model's shapes"


def plan_for(caps: dict, args=None, **precision_settings):
    cfg = get_preset("baseline").replace(precision={"dtype": "auto", "tf32": "auto", **precision_settings})
    return make_plan(cfg, caps=fake_caps(**caps), args=args)["precision"]


# ------------------------------------------------------------------------------------------ plan
def test_auto_on_h100_is_bf16_with_tf32_and_cudnn_benchmark(make_args):
    d = plan_for(CUDA_H100, args=make_args())
    assert d.applied == "bf16+tf32" and d.fallbacks == ()
    assert d.settings.cudnn_benchmark is True
    assert precision.training_args(d, make_args()) == {"bf16": True, "fp16": False, "tf32": True}


def test_auto_on_v100_is_fp16_with_grad_scaling():
    d = plan_for(CUDA_V100)
    assert d.applied == "fp16" and d.settings.grad_scaling is True
    assert d.settings.tf32 is None and "no TF32" not in str(d.fallbacks)  # auto: not a fallback, just n/a
    assert "no bf16" in d.reason and "loss scaling" in d.reason
    assert precision.training_args(d, None) == {"bf16": False, "fp16": True}


def test_explicit_bf16_on_v100_falls_back_to_fp16_and_says_so():
    d = plan_for(CUDA_V100, dtype="bf16")
    assert d.applied == "fp16"
    assert len(d.fallbacks) == 1 and d.fallbacks[0].startswith("bf16: no bf16 on Tesla V100")
    assert "bf16 cannot run here -> fp16" in d.reason


def test_strict_bf16_on_v100_is_a_config_error_naming_field_value_allowed_and_fix():
    with pytest.raises(SpeedupConfigError, match=r"precision\.dtype = 'bf16' cannot run on this machine .*"
                                                 r"allowed here: 'fp16', 'fp32', 'auto'; fix: set precision\.dtype"):
        plan_for(CUDA_V100, dtype="bf16", strict=True)


def test_auto_on_cpu_without_amx_stays_fp32():
    d = plan_for({**CPU_NO_BF16, "bf16_reason": NO_AMX_REASON})
    assert d.applied == "fp32" and d.fallbacks == ()
    assert NO_AMX_REASON in d.reason and "tf32: n/a on cpu" in d.reason
    assert precision.training_args(d, None) == {"bf16": False, "fp16": False}  # explicit, never tf32 on CPU


def test_auto_on_amx_cpu_picks_bf16_and_tells_trainingarguments_it_is_a_cpu_run(make_args):
    d = plan_for(CPU_AMX)
    assert d.applied == "bf16"
    assert precision.training_args(d, make_args(use_cpu=False)) == {"bf16": True, "fp16": False, "use_cpu": True}
    assert "use_cpu" not in precision.training_args(d, make_args(use_cpu=True))


def test_explicit_bf16_on_slow_bf16_cpu_is_applied_with_a_warning_in_the_reason():
    d = plan_for({**CPU_NO_BF16, "bf16_reason": NO_AMX_REASON}, dtype="bf16")
    assert d.applied == "bf16" and d.fallbacks == ()
    assert "expected SLOWER than fp32 here" in d.reason


def test_fp16_on_cpu_falls_back_to_fp32_or_errors_when_strict():
    d = plan_for(CPU_NO_BF16, dtype="fp16")
    assert d.applied == "fp32" and d.fallbacks[0].startswith("fp16: fp16 autocast is not available on CPU")
    with pytest.raises(SpeedupConfigError, match=r"precision\.dtype = 'fp16' cannot run"):
        plan_for(CPU_NO_BF16, dtype="fp16", strict=True)


def test_tf32_requests_that_cannot_run_fall_back_or_error():
    on_cpu = plan_for(CPU_NO_BF16, tf32=True)
    assert on_cpu.settings.tf32 is None and any("tf32" in f for f in on_cpu.fallbacks)
    assert "tf32" not in precision.training_args(on_cpu, None)  # TrainingArguments would raise on CPU
    on_v100 = plan_for(CUDA_V100, tf32=True)
    assert on_v100.settings.tf32 is None and "no TF32" in on_v100.fallbacks[0]
    with pytest.raises(SpeedupConfigError, match=r"precision\.tf32 = True cannot run"):
        plan_for(CUDA_V100, tf32=True, strict=True)
    assert plan_for(CUDA_H100, tf32=False).settings.tf32 is False


def test_keep_leaves_trainingarguments_untouched(make_args):
    for args in (make_args(), make_args(bf16=True)):
        d = make_plan("baseline", caps=fake_caps(**CUDA_H100), args=args)["precision"]
        assert d.applied == ("bf16" if args.bf16 else "fp32")
        assert precision.training_args(d, args) == {}
        assert d.settings.cudnn_benchmark is False  # baseline: no global torch flags either


def test_auto_keeps_the_users_explicit_fp16_but_an_explicit_dtype_overrides_it(make_args):
    args = make_args(use_cpu=False)
    args.fp16 = True  # as if set on a GPU machine (TrainingArguments refuses fp16 construction-time checks on CPU)
    kept = plan_for(CUDA_H100, args=args)
    assert kept.applied.startswith("fp16") and "auto keeps the TrainingArguments' explicit fp16=True" in kept.reason
    assert "bf16 would be preferable" in kept.reason
    overridden = plan_for(CUDA_H100, args=args, dtype="bf16")
    assert overridden.applied.startswith("bf16") and "overrides TrainingArguments' fp16" in overridden.reason
    assert precision.training_args(overridden, args)["fp16"] is False


def test_auto_with_an_args_dtype_that_cannot_run_falls_back_or_names_the_args_flag(make_args):
    args = make_args(bf16=True)  # e.g. a config written for an A100, run on a V100
    d = plan_for(CUDA_V100, args=args)
    assert d.applied == "fp16" and d.fallbacks[0].startswith("bf16: no bf16")
    with pytest.raises(SpeedupConfigError, match=r"TrainingArguments\.bf16 = True cannot run .*fix: set bf16=False"):
        plan_for(CUDA_V100, args=args, strict=True)


def test_multi_process_decides_the_same_as_one_process():
    one = plan_for(CUDA_H100)
    two = plan_for({**CUDA_H100, "world_size": 2, "rank": 1, "local_rank": 1})
    assert (one.applied, one.settings) == (two.applied, two.settings)


def test_strict_error_is_raised_by_the_trainer_before_any_model_work(monkeypatch, tiny_model, dataset, make_args):
    monkeypatch.setattr("hf_speedup.trainer.probe", lambda args=None: fake_caps(**CUDA_V100))
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    cfg = get_preset("baseline").replace(precision={"dtype": "bf16", "strict": True})
    with pytest.raises(SpeedupConfigError, match="precision.strict = true"):
        SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=dataset, speedup=cfg)
    assert all(torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())


# ------------------------------------------------------------------------------------------ real objects
def _train(cfg, tiny_model, dataset, collator, make_args, steps=2):
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=steps), train_dataset=dataset,
                             data_collator=collator, speedup=cfg)
    trainer.train()
    return trainer


def test_auto_on_this_cpu_runs_what_it_planned(tiny_model, dataset, collator, make_args):
    from hf_speedup.hardware import probe

    trainer = _train("auto", tiny_model, dataset, collator, make_args)
    d = trainer.speedup_status["precision"]
    if probe().bf16:  # an AMX CPU: bf16 must be chosen and active
        assert d.applied == "bf16" and d.engaged is True
        assert trainer.accelerator.mixed_precision == "bf16"
    else:  # this CI CPU (no AMX): fp32, honestly reported as nothing accelerated
        assert d.applied == "fp32" and d.engaged is False
        assert "fp32 (no mixed precision) in force as planned" in d.engaged_reason
        assert trainer.accelerator.mixed_precision == "no"
        assert not hasattr(trainer.model, "_original_forward")  # no autocast wrapper on forward


def test_bf16_on_an_amx_cpu_really_autocasts(monkeypatch, tiny_model, dataset, collator, make_args):
    monkeypatch.setattr("hf_speedup.trainer.probe", lambda args=None: fake_caps(**CPU_AMX))
    cfg = get_preset("baseline").replace(precision={"dtype": "auto"})
    trainer = _train(cfg, tiny_model, dataset, collator, make_args)
    d = trainer.speedup_status["precision"]
    assert d.applied == "bf16" and d.engaged is True, d.engaged_reason
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.native_amp
    assert hasattr(trainer.model, "_original_forward")  # accelerate wrapped forward in autocast
    seen = []  # the wrapped forward really computes the projections in bf16
    proj = trainer.model.model.layers[0].self_attn.q_proj
    handle = proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.no_grad():
        trainer.model(input_ids=torch.tensor([dataset[0]["input_ids"]]))
    handle.remove()
    assert seen == [torch.bfloat16]


def test_verify_reports_a_mismatch_when_the_plan_is_not_in_force(tiny_model, dataset, collator, make_args):
    trainer = _train("baseline", tiny_model, dataset, collator, make_args, steps=1)
    planned_bf16 = make_plan(get_preset("baseline").replace(precision={"dtype": "bf16"}),
                              caps=fake_caps(**CPU_AMX))["precision"]
    engaged, reason = precision.verify(planned_bf16, trainer, Outcome())
    assert engaged is False and "MISMATCH: planned bf16, in force fp32" in reason


def _probe_a_gpu(monkeypatch, capability, hip):
    """probe() on a GPU we are not on: torch.cuda answers as that GPU would, torch.version as its build."""
    from types import SimpleNamespace

    from hf_speedup.hardware import probe

    for name, value in {"is_available": True, "device_count": 1, "get_device_name": "gpu", "is_bf16_supported": True,
                        "get_device_capability": capability,
                        "get_device_properties": SimpleNamespace(total_memory=192 << 30)}.items():
        monkeypatch.setattr(torch.cuda, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    return probe()


def test_an_amd_gpu_gets_no_tf32_though_its_capability_number_is_high(monkeypatch):
    """ROCm reports MI300 as 9.4, yet transformers refuses tf32 there (TrainingArguments would raise)."""
    mi300 = _probe_a_gpu(monkeypatch, (9, 4), hip="6.2.0")
    assert mi300.device_type == "cuda" and mi300.rocm and mi300.bf16 and not mi300.tf32
    d = make_plan(get_preset("baseline").replace(precision={"dtype": "auto", "tf32": True}), caps=mi300)["precision"]
    assert d.settings.tf32 is None and "tf32" not in precision.training_args(d, None)
    assert d.fallbacks == ("tf32: gpu is an AMD GPU (ROCm), where transformers allows no TF32",)
    h100 = _probe_a_gpu(monkeypatch, (9, 0), hip=None)
    assert h100.tf32 and not h100.rocm


def test_tf32_is_set_even_where_transformers_cached_the_value(tf32_restored):
    """transformers' enable_tf32 is cached per value: True, False, True leaves it off. apply sets it anyway."""
    from transformers.utils.import_utils import enable_tf32

    from hf_speedup.compat import tf32_matmul_enabled

    d = plan_for(CUDA_H100)
    assert d.settings.tf32 is True
    enable_tf32.cache_clear()
    enable_tf32(True), enable_tf32(False), enable_tf32(True)  # what three TrainingArguments in one process do
    enable_tf32.cache_clear()
    assert tf32_matmul_enabled() is False
    precision.apply(d, None, Outcome())
    assert tf32_matmul_enabled() is True


def test_tf32_on_is_read_the_way_inductor_reads_it(tf32_restored):
    """transformers' enable_tf32 (TrainingArguments' tf32, torch_compile) sets torch's new fp32_precision API
    alone, after which torch.get_float32_matmul_precision() raises; inductor calls it for every GEMM it
    autotunes under max-autotune on CUDA, and the guarded blocks then ran eager. After hf_speedup's switch
    both API generations answer, whichever of the two set TF32 first or last."""
    from transformers.utils.import_utils import enable_tf32
    from torch._inductor.select_algorithm import create_precompile_key

    d = plan_for(CUDA_H100)
    set_by_transformers = getattr(enable_tf32, "__wrapped__", enable_tf32)
    set_by_transformers(True)  # TrainingArguments(tf32=True) built on an Ampere+ GPU
    precision.apply(d, None, Outcome())
    assert torch.get_float32_matmul_precision() == "high"
    assert create_precompile_key("mm", "inputs", []) == "mm:inputs:high"  # inductor's own read
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == "none"  # the CPU's oneDNN is not this switch's
    set_by_transformers(True)  # the trainer's own TrainingArguments copy, built after apply
    assert torch.get_float32_matmul_precision() == "high"
    off = plan_for(CUDA_H100, tf32=False)
    precision.apply(off, None, Outcome())
    set_by_transformers(False)
    assert torch.get_float32_matmul_precision() == "highest" and torch.backends.cuda.matmul.allow_tf32 is False


def test_verify_reports_tf32_that_inductor_cannot_read_as_not_engaged(tf32_restored, tiny_model, make_args):
    """TF32 set through torch's new API alone reads as on there, but inductor's read raises: not engaged."""
    from types import SimpleNamespace

    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("torch < 2.9 has one TF32 API")
    d = plan_for(CUDA_H100)
    torch.backends.fp32_precision = "tf32"  # what transformers' enable_tf32 does on torch >= 2.9
    trainer = SimpleNamespace(model=tiny_model, accelerator=SimpleNamespace(mixed_precision="bf16", native_amp=True))
    engaged, reason = precision.verify(d, trainer, Outcome())
    assert engaged is False and "MISMATCH: planned tf32=True" in reason
    assert "torch.get_float32_matmul_precision() raises" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_auto_engages_bf16_or_fp16_and_tf32(tiny_model, dataset, collator, make_args):
    from hf_speedup.compat import tf32_matmul_enabled
    from hf_speedup.hardware import probe

    caps = probe()
    trainer = _train("auto", tiny_model, dataset, collator, lambda **kw: make_args(use_cpu=False, **kw))
    d = trainer.speedup_status["precision"]
    assert d.engaged is True, d.engaged_reason
    assert trainer.accelerator.mixed_precision == ("bf16" if caps.bf16 else "fp16")
    if not caps.bf16:
        assert trainer.accelerator.scaler is not None
    assert tf32_matmul_enabled() is bool(caps.tf32)
    assert torch.get_float32_matmul_precision() == ("high" if caps.tf32 else "highest")  # as inductor reads it
    assert torch.backends.cudnn.benchmark is True
