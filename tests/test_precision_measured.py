"""precision.dtype: auto on a CPU without AMX decides by the bf16/fp32 matmul speed measured at the model's shapes
(``caps.measured["precision.bf16_matmul"]``), not by the CPU flag alone; the numerics of bf16 over a loss curve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import BF16_VS_FP32_LOSS_REL, CPU_AMX, CPU_NO_BF16, CUDA_H100, CUDA_V100, fake_caps
from hf_speedup import SpeedupTrainer, get_preset
from hf_speedup import measured as measured_module
from hf_speedup.features import precision
from hf_speedup.features.precision import matmul_speed
from fake_cpu import FAKE_CPU_AMX
from hf_speedup.measured import Measurement
from hf_speedup.model_info import describe_model
from hf_speedup.plan import plan_for as make_plan

KEY = matmul_speed.KEY
FAST = Measurement(2.3, "bf16-autocast/fp32 speed of this model's matmuls at 1024 tokens", "AMD EPYC, 2 threads",
                   cached=True)
SLOW = Measurement(0.8, "bf16-autocast/fp32 speed of this model's matmuls at 1024 tokens", "AMD EPYC, 2 threads")


def plan_for(caps: dict, measured: Measurement | None, args=None, preset="auto", **precision_settings):
    cfg = get_preset(preset)
    if precision_settings:
        cfg = cfg.replace(precision=precision_settings)
    given = {KEY: measured} if measured is not None else {}
    return make_plan(cfg, caps=fake_caps(**caps, measured=given), args=args)["precision"]


# ------------------------------------------------------------------------------------------ the decision
@pytest.mark.parametrize("preset", ["auto", "fast"])
def test_a_measured_fast_bf16_on_a_cpu_without_amx_is_chosen_and_reaches_trainingarguments(preset, make_args):
    d = plan_for(CPU_NO_BF16, FAST, preset=preset)
    assert d.applied == "bf16" and d.fallbacks == ()
    assert "bf16 autocast: matmuls at this model's shapes measured 2.30x fp32" in d.reason
    assert "on AMD EPYC, 2 threads (cached)" in d.reason and "SLOWER" not in d.reason
    assert precision.training_args(d, make_args(use_cpu=False)) == {"bf16": True, "fp16": False, "use_cpu": True}


def test_a_measured_ratio_under_the_threshold_keeps_fp32_and_says_so():
    just_under = Measurement(matmul_speed.THRESHOLD - 0.01, "x", "AMD EPYC")
    for m in (SLOW, just_under):
        d = plan_for(CPU_NO_BF16, m)
        assert d.applied == "fp32"
        assert f"fp32 (no mixed precision): bf16 autocast matmuls at this model's shapes measured {m.value:.2f}x " \
               f"fp32" in d.reason and f"under the {matmul_speed.THRESHOLD}x" in d.reason
        assert precision.training_args(d, None) == {"bf16": False, "fp16": False}


def test_not_measured_decides_from_the_flags_and_says_it_was_not_measured():
    d = plan_for(CPU_NO_BF16, None)
    assert d.applied == "fp32"
    assert "not measured (HF_SPEEDUP_MEASURE=0)" in d.reason  # the suite runs with HF_SPEEDUP_MEASURE=0


def test_amx_picks_bf16_whatever_was_measured():
    d = plan_for(CPU_AMX, SLOW)
    assert d.applied == "bf16" and "native and fast" in d.reason


def test_an_explicit_fp32_wins_over_a_fast_measurement(make_args, monkeypatch):
    assert plan_for(CPU_NO_BF16, FAST, dtype="fp32").applied == "fp32"  # the config's explicit dtype
    from hf_speedup.features.explicit_args import EXPLICIT_ARGS_ATTR

    args = make_args(bf16=False)
    setattr(args, EXPLICIT_ARGS_ATTR, ("bf16",))  # as training_arguments(..., bf16=False) records it
    d = plan_for(CPU_NO_BF16, FAST, args=args)
    assert d.applied == "fp32" and "auto keeps the TrainingArguments' explicit bf16=False over auto's own " \
                                  "choice here (bf16)" in d.reason
    monkeypatch.setenv(precision.LAUNCHER_ENV, "no")  # accelerate launch --mixed_precision no
    d = plan_for(CPU_NO_BF16, FAST)
    assert d.applied == "fp32" and "the launcher's mixed_precision=no" in d.reason


def test_an_explicit_bf16_under_a_slow_measurement_is_warned_with_the_figure():
    d = plan_for(CPU_NO_BF16, SLOW, dtype="bf16")
    assert d.applied == "bf16" and "expected no faster than fp32 here: bf16 autocast matmuls at this model's " \
                                   "shapes measured 0.80x fp32" in d.reason


def test_cuda_ignores_a_cpu_measurement():
    assert plan_for(CUDA_V100, FAST).applied == "fp16"  # no bf16 there, however fast a CPU measured it
    assert plan_for(CUDA_H100, SLOW).applied == "bf16+tf32"


def test_baseline_is_unchanged_by_a_measurement(make_args):
    d = plan_for(CPU_NO_BF16, FAST, preset="baseline")
    assert d.applied == "fp32" and precision.training_args(d, make_args()) == {}


# ------------------------------------------------------------------------------------------ the hook
@pytest.fixture
def measuring(tmp_path, monkeypatch):
    monkeypatch.setenv(measured_module.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(measured_module.MEASURE_ENV, "1")
    monkeypatch.delenv(FAKE_CPU_AMX, raising=False)


def test_the_hook_times_the_models_own_shapes_and_caches_the_figure(measuring, tiny_model):
    info = describe_model(tiny_model)
    caps = fake_caps(**CPU_NO_BF16, cpu_threads=torch.get_num_threads(), torch_version=torch.__version__)
    first = precision.measure(get_preset("auto"), caps, info)[KEY]
    assert isinstance(first.value, float) and first.value > 0 and first.cached is False
    # the block's linears (in x out, how often a step runs them) and the head, hidden 64 -> vocab
    assert "64x128 x8" in first.what and "128x64 x4" in first.what
    assert f"64x{tiny_model.config.vocab_size}" in first.what and "AMD EPYC" in first.where
    again = precision.measure(get_preset("fast"), caps, info)[KEY]
    assert again.cached is True and again.value == first.value and "(cached)" in again.text()


def test_the_hook_measures_only_where_the_figure_can_decide(measuring, tiny_model):
    info, auto = describe_model(tiny_model), get_preset("auto")
    assert precision.measure(auto, fake_caps(**CUDA_H100), info) == {}  # CUDA's flags are right
    assert precision.measure(auto, fake_caps(**CPU_AMX), info) == {}  # AMX: bf16 already
    assert precision.measure(auto.replace(precision={"dtype": "fp32"}), fake_caps(**CPU_NO_BF16), info) == {}
    assert precision.measure(get_preset("baseline"), fake_caps(**CPU_NO_BF16), info) == {}  # keep
    bf16_weights = dataclasses.replace(info, dtype="bfloat16")
    assert precision.measure(auto, fake_caps(**CPU_NO_BF16), bf16_weights) == {}


def test_the_door_puts_the_measurement_into_the_plan(measuring, tiny_model):
    d = make_plan("auto", caps=fake_caps(**CPU_NO_BF16), model=tiny_model)["precision"]
    m = d and make_plan("auto", caps=fake_caps(**CPU_NO_BF16), model=tiny_model).caps.measured[KEY]
    assert m.cached is True  # the second door read the first one's figure back
    assert f"measured {m.value:.2f}x fp32" in d.reason
    assert d.applied == ("bf16" if m.value >= matmul_speed.THRESHOLD else "fp32")


# ------------------------------------------------------------------------------------------ live objects, numerics
def _caps_measuring_fast(monkeypatch):
    from hf_speedup.hardware import probe

    def faked(args=None):
        return dataclasses.replace(probe(args), bf16=False, measured={KEY: FAST})

    monkeypatch.setattr("hf_speedup.trainer.probe", faked)


def _losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def test_fast_trained_in_bf16_by_measurement_stays_within_bf16_tolerance_of_baseline_over_the_curve(
        monkeypatch, tiny_model, dataset, collator, make_args):
    from hf_speedup.tiny import tiny_llama

    steps = 30
    kw = dict(max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1)
    base = SpeedupTrainer(model=tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                           num_key_value_heads=2),
                          args=make_args(**kw), train_dataset=dataset, data_collator=collator, speedup="baseline")
    base.train()
    _caps_measuring_fast(monkeypatch)
    fast = SpeedupTrainer(model=tiny_model, args=make_args(**kw), train_dataset=dataset, data_collator=collator,
                          speedup="fast")
    seen = []  # the projections really compute in bf16 under the run's autocast
    proj = fast.model.model.layers[0].mlp.gate_proj
    handle = proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    fast.train()
    handle.remove()
    status = fast.speedup_status["precision"]
    assert status.applied == "bf16" and status.engaged is True, status.engaged_reason
    assert "measured 2.30x fp32" in status.reason
    assert fast.accelerator.mixed_precision == "bf16" and set(seen) == {torch.bfloat16}
    assert {p.dtype for p in fast.model.parameters()} == {torch.float32}  # autocast: the master weights stay fp32
    got, want = _losses(fast), _losses(base)
    assert len(got) == len(want) == steps and want[-1] < 0.8 * want[0]  # a curve that really moves
    worst = max(abs(g - w) / w for g, w in zip(got, want))
    assert worst <= BF16_VS_FP32_LOSS_REL, (worst, got, want)


@pytest.mark.parametrize("ratio, spread", [(30.0, 0.0), (1.6, 0.4)], ids=["implausible", "halves-disagree"])
def test_an_implausible_or_unsteady_timing_is_neither_used_nor_cached(measuring, tiny_model, monkeypatch, ratio,
                                                                       spread):
    calls = []

    def busy(shapes, tokens=matmul_speed.TOKENS):
        calls.append(1)  # a thread descheduled mid-GEMM, or load that changed while timing, every time
        return ratio, {f"{k}x{n}": ratio for k, n, _ in shapes}, spread

    monkeypatch.setattr(matmul_speed, "bf16_matmul_ratio", busy)
    caps = fake_caps(**CPU_NO_BF16)
    m = precision.measure(get_preset("auto"), caps, describe_model(tiny_model))[KEY]
    assert m.value is None and "too busy to time (not cached)" in m.what and len(calls) == 2  # tried twice
    d = make_plan("auto", caps=fake_caps(**CPU_NO_BF16, measured={KEY: m}))["precision"]
    assert d.applied == "fp32" and "could not be measured" in d.reason
    precision.measure(get_preset("auto"), caps, describe_model(tiny_model))
    assert len(calls) == 4  # nothing was cached: timed again


def test_each_shapes_ratio_is_the_median_of_adjacent_pairs_so_load_between_pairs_cancels(monkeypatch):
    """Pairs of runs timed under changing load: every pair's ratio is 2 whatever the load, so is the figure."""
    loads = iter([1.0, 1.0] + [1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 9.0, 9.0] * 100)

    def run(x, w, grad, bf16):
        return next(loads) * (0.5 if bf16 else 1.0)

    monkeypatch.setattr(matmul_speed, "_run", run)
    monkeypatch.setattr(matmul_speed, "SHAPE_SECONDS", 0.0)
    ratio, each, spread = matmul_speed.bf16_matmul_ratio([(8, 16, 2), (16, 8, 1)], tokens=4)
    assert ratio == pytest.approx(2.0) and each == {"8x16": 2.0, "16x8": 2.0} and spread == pytest.approx(0.0)
