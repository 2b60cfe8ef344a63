"""The experts implementation of a mixture of experts: chosen from the door's timing (faked here), set through
transformers' switch, read back from a probe forward of the live experts modules; every kernel's loss and
gradients equal the loop's in fp32; LoRA on the fused expert weights trains under each kernel."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_AMX, CPU_NO_BF16, CUDA_H100, CUDA_V100, fake_caps

from hf_speedup import SpeedupConfigError, get_preset, plan_for
from hf_speedup.features import Setup, experts
from hf_speedup.measured import Measurement
from hf_speedup.model_info import describe_model
from hf_speedup.model_parts import experts_modules
from hf_speedup.plan_types import Outcome

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
             max_position_embeddings=64, num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0)
MOE = ("qwen3_moe", "olmoe", "mixtral")
CPU_KERNELS = ("batched_mm", "grouped_mm")  # both have a CPU path in torch 2.9+


def build(name: str, seed: int = 0):
    import transformers as T

    config = {"qwen3_moe": lambda: T.Qwen3MoeConfig(**SIZES, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=32),
              "olmoe": lambda: T.OlmoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2),
              "mixtral": lambda: T.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)}[name]()
    cls = {"qwen3_moe": T.Qwen3MoeForCausalLM, "olmoe": T.OlmoeForCausalLM, "mixtral": T.MixtralForCausalLM}[name]
    torch.manual_seed(seed)
    return cls(config)


def timed(**seconds) -> dict:
    return {"experts.kernel": Measurement(value=dict(seconds), what="one MoE layer (faked)", where="test")}


def decide(model, speedup="auto", caps=CPU_NO_BF16, measured=None, **section):
    config = get_preset(speedup).replace(experts=section) if section else speedup
    return plan_for(config, caps=fake_caps(**caps, measured=measured or {}), model=model)["experts"]


class _Trainer:
    def __init__(self, model):
        self.model = model


# ------------------------------------------------------------------------------------------- decisions
def test_auto_takes_the_fastest_measured_kernel_and_quotes_the_timings():
    d = decide(build("qwen3_moe"), measured=timed(eager=0.9, batched_mm=3.0, grouped_mm=0.3))
    assert d.applied == "grouped_mm" and d.settings.measured
    assert d.reason.startswith("grouped_mm: 3.0x the loop's speed; measured eager 900.0 ms, batched_mm 3000.0 ms, "
                               "grouped_mm 300.0 ms (one MoE layer (faked) on test)")


def test_auto_keeps_the_loop_where_it_measured_fastest_or_a_kernel_is_within_noise():
    d = decide(build("olmoe"), measured=timed(eager=0.97, batched_mm=9.6, grouped_mm=5.7))
    assert d.applied == "eager" and "the loop measured fastest; measured eager 970.0 ms" in d.reason
    assert d.reason.endswith("(the model had grouped_mm)")  # transformers' default, replaced
    d = decide(build("olmoe"), measured=timed(eager=1.0, grouped_mm=0.97))
    assert d.applied == "eager" and d.reason.startswith("eager: grouped_mm was within 5% of the loop, which is kept")


def test_a_kernel_that_could_not_be_timed_is_never_chosen():
    d = decide(build("mixtral"), measured=timed(eager=1.0, batched_mm="not timed: it would gather 3.0 GiB"))
    assert d.applied == "eager" and "batched_mm not timed: it would gather 3.0 GiB" in d.reason


def test_unmeasured_auto_takes_the_known_good_default_per_device_and_says_so():
    cpu = decide(build("qwen3_moe"))
    assert cpu.applied == "eager" and not cpu.settings.measured
    assert cpu.reason.startswith("eager: not measured (HF_SPEEDUP_MEASURE=0 or no timing at the door), the "
                                 "known-good default on cpu")
    gpu = decide(build("qwen3_moe"), caps=CUDA_H100)
    assert gpu.applied == "grouped_mm" and "known-good default on CUDA" in gpu.reason
    old = decide(build("qwen3_moe"), caps=CUDA_V100)  # no grouped GEMM below compute capability 8.0
    assert old.applied == "eager"


def test_an_explicit_choice_wins_over_the_measurement():
    d = decide(build("qwen3_moe"), measured=timed(eager=0.5, grouped_mm=2.0), implementation="grouped_mm")
    assert (d.requested, d.applied) == ("grouped_mm", "grouped_mm")
    assert "grouped_mm: asked for" in d.reason and "measured eager 500.0 ms, grouped_mm 2000.0 ms" in d.reason


def test_auto_keeps_an_implementation_the_user_set_on_the_model_and_keep_leaves_it():
    model = build("mixtral")
    model.set_experts_implementation("batched_mm")
    d = decide(model, measured=timed(eager=0.1, batched_mm=1.0))
    assert d.applied == "batched_mm" and "auto: kept batched_mm, set on the model by its user" in d.reason
    baseline = decide(build("mixtral"), "baseline")
    assert baseline.applied == "off" and baseline.reason == "keep: the model's own experts implementation (grouped_mm)"


def test_strict_refuses_a_kernel_that_cannot_run_here():
    with pytest.raises(SpeedupConfigError, match=r"experts\.implementation = 'grouped_mm' cannot run here \(torch\._"
                                                 r"grouped_mm needs compute capability >= 8\.0; this is 7\.0.*\) and "
                                                 r"experts\.strict = true; allowed here: 'eager', 'batched_mm', "
                                                 r"'auto', 'keep'; fix: set experts\.implementation: auto, or "
                                                 r"experts\.strict: false to fall back"):
        decide(build("qwen3_moe"), caps=CUDA_V100, implementation="grouped_mm", strict=True)
    d = decide(build("qwen3_moe"), caps=CUDA_V100, implementation="grouped_mm")  # not strict: falls back, said
    assert d.applied == "eager" and d.fallbacks[0].startswith("grouped_mm -> eager: torch._grouped_mm needs compute")


def test_a_bad_value_names_the_field_the_allowed_values_and_the_fix():
    with pytest.raises(SpeedupConfigError, match=r"experts\.implementation = 'grouped' is not allowed; allowed: "
                                                 r"'auto', 'keep', 'eager', 'batched_mm', 'grouped_mm'; fix: set "
                                                 r"experts\.implementation: 'auto'"):
        get_preset("auto").replace(experts={"implementation": "grouped"})


def test_a_dense_model_is_not_applicable(tiny_model):
    d = decide(tiny_model, implementation="grouped_mm", strict=True)
    assert d.applied == "off" and d.reason == "not applicable: LlamaForCausalLM has no routed experts"


def test_experts_that_do_not_dispatch_through_transformers_cannot_be_switched():
    from hf_speedup.model_info import ModelInfo

    info = ModelInfo(architecture="DbrxForCausalLM", expert_parameters=("ffn.experts.mlp.w1",), routers=("ffn.router",))
    d = plan_for("auto", caps=fake_caps(**CPU_NO_BF16), model=info)["experts"]
    assert d.applied == "off" and "runs its own expert code (no @use_experts_implementation dispatch)" in d.reason
    with pytest.raises(SpeedupConfigError, match=r"experts\.implementation = 'eager' cannot apply: DbrxForCausalLM "
                                                 r"runs its own expert code .* allowed for this model: 'auto', 'keep'"):
        plan_for(get_preset("auto").replace(experts={"implementation": "eager", "strict": True}),
                 caps=fake_caps(**CPU_NO_BF16), model=info)


# ------------------------------------------------------------------------------------------- live model
@pytest.mark.parametrize("kernel", ("eager", *CPU_KERNELS))
def test_apply_sets_the_kernel_and_verify_reads_what_a_forward_dispatches(kernel):
    model = build("qwen3_moe")
    d = decide(model, implementation=kernel)
    experts.apply(d, Setup(model=model, args=None), Outcome())
    assert {m.config._experts_implementation for _, m in experts_modules(model)} == {kernel}
    outcome = Outcome()
    ok, why = experts.verify(d, _Trainer(model), outcome)
    function = "forward" if kernel == "eager" else f"{kernel}_experts_forward"
    assert ok, why
    assert why == (f"2 experts module(s), config._experts_implementation={kernel}; a 4-token forward of "
                   f"model.layers.0.mlp.experts ran {function}")
    model.config._experts_implementation = "batched_mm" if kernel != "batched_mm" else "eager"  # changed behind it
    ok, why = experts.verify(d, _Trainer(model), Outcome())
    assert not ok and f"MISMATCH: planned {kernel}" in why


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("name", MOE)
def test_each_kernel_gives_the_loops_loss_and_gradients_in_fp32(name, kernel):
    x = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = {}
    for impl in ("eager", kernel):
        model = build(name)
        model.set_experts_implementation(impl)
        loss = model(x, labels=x).loss
        loss.backward()
        runs[impl] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(runs[kernel][0], runs["eager"][0], rtol=1e-5, atol=1e-6)
    for n, g in runs["eager"][1].items():
        torch.testing.assert_close(runs[kernel][1][n], g, rtol=1e-4, atol=1e-6, msg=f"{name} {kernel}: {n}")
    assert any("experts" in n and g.abs().sum() > 0 for n, g in runs[kernel][1].items())


@pytest.mark.parametrize("kernel", ("eager", *CPU_KERNELS))
def test_lora_on_the_fused_experts_trains_under_each_kernel(kernel, make_args):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling

    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import char_tokenizer

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(4, 60, (12,), generator=g).tolist()} for _ in range(8)]
    trainer = SpeedupTrainer(model=build("olmoe"), args=make_args(max_steps=2, learning_rate=1e-2),
                             train_dataset=Dataset.from_list(rows),
                             data_collator=DataCollatorForLanguageModeling(char_tokenizer(), mlm=False),
                             speedup=get_preset("lora").replace(experts={"implementation": kernel}))
    trainer.speedup_callback.print_tables = False
    trainer.train()
    plan = trainer.speedup_report.to_dict()["plan"]
    assert plan["experts"]["applied"] == kernel and plan["experts"]["engaged"], plan["experts"]
    assert plan["lora"]["engaged"], plan["lora"]
    assert {m.config._experts_implementation for _, m in experts_modules(trainer.model)} == {kernel}
    adapters = {n: p for n, p in trainer.model.named_parameters() if "experts" in n and "lora_B" in n}
    assert len(adapters) == 4 and all(p.abs().sum() > 0 for p in adapters.values())  # they started at zero


# ------------------------------------------------------------------------------------------- the door
def test_the_door_times_each_kernel_at_the_models_shapes_once(tmp_path, monkeypatch):
    from hf_speedup import measured

    monkeypatch.setenv(measured.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(measured.MEASURE_ENV, "1")
    info = describe_model(build("qwen3_moe"))
    caps = fake_caps(**CPU_NO_BF16)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    first = experts.measure(get_preset("auto"), caps, info)["experts.kernel"]
    assert torch.equal(torch.get_rng_state(), state)  # the timing seeds and draws on a fork: the caller's RNG as it was
    assert set(first.value) == {"eager", "batched_mm", "grouped_mm"}
    assert all(isinstance(v, float) and v > 0 for v in first.value.values())
    assert "hidden 32, expert width 32, 4 experts, top-2, 1024 tokens, fp32" in first.what and not first.cached
    again = experts.measure(get_preset("auto"), caps, info)["experts.kernel"]
    assert again.cached and again.value == first.value
    assert experts.measure(get_preset("baseline"), caps, info) == {}  # keep: nothing to choose, nothing timed
    # the plan in the dtype timed above: with precision auto the door would first time bf16 on this machine, and
    # where that wins (AVX-512 bf16, AMX) the experts would be timed again in bf16
    d = plan_for(get_preset("auto").replace(precision={"dtype": "fp32"}), caps=caps, model=info)["experts"]
    assert d.settings.measured and "(cached)" in d.reason


def test_the_door_times_in_the_dtype_the_plan_will_train_in(caplog):
    """The precision feature's choice: bf16 autocast on a bf16 GPU, an AMX CPU or a CPU whose bf16 measured faster,
    fp32 elsewhere (found on an H200: the door built its context without ``args`` and timed every GPU in fp32)."""
    import logging

    from hf_speedup.features.experts.door import compute_dtype
    from hf_speedup.features.precision.matmul_speed import KEY

    info = describe_model(build("qwen3_moe"))
    bf16_pays = {KEY: Measurement(value=3.0, what="faked", where="test")}
    cases = ((CUDA_H100, {}, torch.bfloat16), (CPU_AMX, {}, torch.bfloat16), (CPU_NO_BF16, bf16_pays, torch.bfloat16),
             (CPU_NO_BF16, {}, torch.float32))
    with caplog.at_level(logging.INFO, logger="hf_speedup"):
        for caps, measured, dtype in cases:
            got = compute_dtype(get_preset("auto"), fake_caps(**caps, measured=measured), info)
            assert got == dtype, (caps["device_name"], measured)
        assert compute_dtype(get_preset("baseline"), fake_caps(**CUDA_H100), info) == torch.float32
    assert "precision undecided" not in caplog.text  # decided by the precision feature, not the fallback



def test_the_experts_door_sees_the_matmul_figure_measured_at_the_same_door(tmp_path, monkeypatch):
    """One door times the matmuls (precision) and then the experts: the experts must be timed in the dtype that
    figure picks. They were timed in fp32 while the run trained in bf16 autocast (a Zen 4 CPU: in bf16 the loop
    beat grouped_mm by 1.5x at a Mixtral shape that fp32 timing gave to grouped_mm)."""
    from hf_speedup import measured
    from hf_speedup.features.experts import timing
    from hf_speedup.features.precision import matmul_speed

    monkeypatch.setenv(measured.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(measured.MEASURE_ENV, "1")
    monkeypatch.setattr(matmul_speed, "bf16_matmul_ratio", lambda shapes, tokens=None: (3.0, {"32x32": 3.0}, 0.0))
    timed = []

    def fake_timing(s, names, device, weights, compute, where):
        timed.append(compute)
        return Measurement(value={"eager": 1.0, "grouped_mm": 2.0}, what="faked", where=where)

    monkeypatch.setattr(timing, "measurement", fake_timing)
    plan = plan_for("fast", caps=fake_caps(**CPU_NO_BF16), model=build("qwen3_moe"))
    assert plan["precision"].applied == "bf16" and timed == [torch.bfloat16]
    assert plan["experts"].applied == "eager"

def test_sharded_experts_are_read_from_the_config_without_a_probe_forward():
    """A forward of one ZeRO-3-partitioned module alone would gather across ranks: verify reads the config only."""
    model = build("mixtral")
    d = decide(model, implementation="grouped_mm")
    experts.apply(d, Setup(model=model, args=None), Outcome())
    module = experts_modules(model)[0][1]
    module.down_proj.ds_id = 7  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    outcome = Outcome()
    ok, why = experts.verify(d, _Trainer(model), outcome)
    assert ok and why.endswith("model.layers.0.mlp.experts's weights are partitioned by DeepSpeed ZeRO-3: read from "
                               "the config, no probe forward")
    assert outcome.facts["dispatch"] == "not probed (partitioned by DeepSpeed ZeRO-3)"
