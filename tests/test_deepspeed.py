"""DeepSpeed ZeRO as the user configured it: named in the plan, the plan adapted to it (or refused with the fix),
verified on the engine. Planned here on this machine or a faked one; trained on two processes in
test_deepspeed_distributed.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupConfigError, get_preset
from hf_speedup.features import deepspeed
from hf_speedup.plan import plan_for

pytest.importorskip("deepspeed")  # TrainingArguments(deepspeed=...) needs it (the [all] extra installs it)

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"


def ds_args(make_args, config, **kw):
    """TrainingArguments carrying a DeepSpeed config (a dict or a path), as a user passes it."""
    return make_args(deepspeed=str(config) if isinstance(config, Path) else config, **kw)


def zero(stage: int, **more) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto", **more}


@pytest.mark.parametrize("name, applied", [("zero2", "zero-2"), ("zero3", "zero-3"), ("zero3_offload", "zero-3+offload")])
def test_each_shipped_config_is_read_and_named(name, applied, make_args, tiny_model):
    path = CONFIGS / f"{name}.json"
    config = json.loads(path.read_text())
    d = plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, ds_args(make_args, path))["deepspeed"]
    assert d.applied == applied and d.settings.stage == config["zero_optimization"]["stage"]
    assert d.reason.startswith(f"TrainingArguments.deepspeed ({path}): ZeRO stage {d.settings.stage}")
    assert ("cpu" in d.reason) == name.endswith("offload") == d.settings.offloaded


def test_without_deepspeed_the_entry_says_so(make_args, tiny_model):
    d = plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, make_args())["deepspeed"]
    assert d.applied == "off" and "no TrainingArguments.deepspeed" in d.reason


def test_an_accelerate_deepspeed_launch_is_read_from_its_environment(monkeypatch, make_args, tiny_model):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(CONFIGS / "zero3_offload.json"))
    d = plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, make_args())["deepspeed"]
    assert d.applied == "zero-3+offload" and d.reason.startswith("accelerate launch (")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, make_args())["deepspeed"].applied == "zero-2"


@pytest.mark.parametrize("stage, compiled", [(2, True), (3, False)])
def test_regional_compile_runs_under_zero2_and_stays_off_under_zero3(stage, compiled, make_args, tiny_model):
    plan = plan_for("fast", fake_caps(**CPU_NO_BF16), tiny_model, ds_args(make_args, zero(stage)))
    assert plan["compile"].active is compiled
    if not compiled:
        assert "ZeRO-3 gathers each block's parameters in module hooks" in plan["compile"].reason
        assert plan["compile"].fallbacks  # fast asked for compile explicitly: a reported fallback


def test_strict_refuses_what_it_would_adapt(make_args, tiny_model):
    cfg = get_preset("fast").replace(deepspeed={"strict": True})
    with pytest.raises(SpeedupConfigError, match=r"compile.enabled = True under DeepSpeed .*fix: compile.enabled: "
                                                  r"false, or ZeRO stage 2, or deepspeed.strict: false"):
        plan_for(cfg, fake_caps(**CPU_NO_BF16), tiny_model, ds_args(make_args, zero(3)))


def test_the_configs_own_optimizer_steps_and_the_plan_says_so(make_args, tiny_model):
    args = ds_args(make_args, zero(2, optimizer={"type": "AdamW", "params": {"lr": "auto"}}))
    plan = plan_for("fast", fake_caps(**CPU_NO_BF16), tiny_model, args)
    d = plan["optimizer"]
    assert d.applied == "deepspeed:AdamW" and "the DeepSpeed config's own optimizer (AdamW) steps" in d.reason
    from hf_speedup.features import optimizer

    assert optimizer.training_args(d, args) == {}  # no optim override: DeepSpeed's optimizer is the one


def test_a_presets_8bit_optimizer_gives_way_under_zero_and_the_users_own_is_refused(make_args, tiny_model):
    caps = fake_caps(**CUDA_H100)
    d = plan_for("memory", caps, tiny_model, ds_args(make_args, zero(2)))["optimizer"]
    assert d.applied == "adamw_fused" and d.settings.optim == "adamw_torch_fused"
    assert "optimizer.name='paged_adamw_8bit' -> adapted to DeepSpeed: ZeRO flattens" in d.fallbacks[0]
    assert plan_for("memory", caps, tiny_model, make_args())["optimizer"].applied == "paged_adamw_8bit"  # no DS
    with pytest.raises(SpeedupConfigError, match=r"TrainingArguments.optim = 'paged_adamw_8bit' under DeepSpeed "
                                                  r"ZeRO: .*fix: drop optim from TrainingArguments"):
        plan_for("auto", caps, tiny_model, ds_args(make_args, zero(2), optim="paged_adamw_8bit"))


def test_precision_follows_an_explicit_bf16_block(make_args, tiny_model):
    """auto plans fp32 on a CPU without fast bf16; the DeepSpeed config enabling bf16 explicitly wins (transformers
    refuses arguments that disagree with it)."""
    caps = fake_caps(**CPU_NO_BF16)
    assert plan_for("auto", caps, tiny_model, ds_args(make_args, zero(2)))["precision"].applied == "fp32"
    d = plan_for("auto", caps, tiny_model, ds_args(make_args, zero(2, bf16={"enabled": True})))["precision"]
    assert d.applied.startswith("bf16") and "the DeepSpeed config enables bf16 explicitly" in d.reason


def test_fsdp_and_deepspeed_together_are_refused_up_front(make_args, tiny_model):
    with pytest.raises(SpeedupConfigError, match=r"fsdp.enabled = True with a DeepSpeed config .*allowed: one "
                                                  r"sharding engine; fix: a preset without FSDP"):
        plan_for("fsdp", fake_caps(**CUDA_H100), tiny_model, ds_args(make_args, zero(3)))


def test_several_cpu_processes_without_use_cpu_are_refused_with_the_fix(monkeypatch, make_args, tiny_model):
    args = ds_args(make_args, zero(2))
    monkeypatch.setattr(args, "use_cpu", False, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SpeedupConfigError, match=r"TrainingArguments.use_cpu = False on 2 CPU processes "
                                                  r"\(WORLD_SIZE=2\): .*fix: TrainingArguments\(use_cpu=True"):
        plan_for("auto", fake_caps(**CPU_NO_BF16, world_size=2), tiny_model, args)


def _engine(stage: int, params):
    module = SimpleNamespace(parameters=lambda: iter(params))
    opt = SimpleNamespace(optimizer=SimpleNamespace())
    return SimpleNamespace(zero_optimization_stage=lambda: stage, optimizer=opt, world_size=2, module=module)


def test_verify_reads_the_engine_not_the_config(make_args, tiny_model):
    from hf_speedup.plan_types import Outcome

    d = plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, ds_args(make_args, zero(3)))["deepspeed"]
    assert deepspeed.verify(d, SimpleNamespace(is_deepspeed_enabled=False), Outcome())[0] is False
    before = deepspeed.verify(d, SimpleNamespace(is_deepspeed_enabled=True, model_wrapped=tiny_model), Outcome())
    assert before == (False, "the DeepSpeed engine is built when train() starts: verified then")
    partitioned, plain = SimpleNamespace(ds_id=0), SimpleNamespace()
    ok, why = deepspeed.verify(d, SimpleNamespace(is_deepspeed_enabled=True,
                                                  model_wrapped=_engine(3, [partitioned, partitioned])), Outcome())
    assert ok and "ZeRO stage 3 on 2 process(es)" in why and "2/2 parameters partitioned" in why
    ok, why = deepspeed.verify(d, SimpleNamespace(is_deepspeed_enabled=True,
                                                  model_wrapped=_engine(3, [partitioned, plain])), Outcome())
    assert not ok and "only 1/2 parameters partitioned" in why
    ok, why = deepspeed.verify(d, SimpleNamespace(is_deepspeed_enabled=True, model_wrapped=_engine(2, [])), Outcome())
    assert not ok and why.startswith("MISMATCH: planned ZeRO stage 3")


def _accelerate_launch_env(path: Path, monkeypatch) -> dict:
    """``accelerate launch --config_file path train.py`` as accelerate turns it into each process's environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_deepspeed and not args.cpu
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as accelerate's launcher
    args.main_process_port = 0
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    return env


@pytest.mark.parametrize("name, applied", [("zero2", "zero-2"), ("zero3", "zero-3"), ("zero3_offload", "zero-3+offload")])
def test_each_shipped_accelerate_file_launches_its_deepspeed_config(name, applied, monkeypatch, make_args, tiny_model):
    """From the repository root, as the files say: accelerate's own loader and launcher read them, and the plan of a
    process they start names the DeepSpeed config they point at."""
    from accelerate.commands.config.config_args import load_config_from_file

    monkeypatch.chdir(CONFIGS.parents[1])
    path = CONFIGS / f"accelerate_{name}.yaml"
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value == "DEEPSPEED"
    assert cfg.deepspeed_config["deepspeed_config_file"] == f"configs/deepspeed/{name}.json"
    env = _accelerate_launch_env(path, monkeypatch)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    d = plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, make_args())["deepspeed"]
    assert d.applied == applied and d.reason.startswith(f"accelerate launch (configs/deepspeed/{name}.json)")


def test_the_shipped_deepspeed_files_are_exactly_these():
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted(
        [f"{n}.json" for n in ("zero2", "zero3", "zero3_offload")]
        + [f"accelerate_{n}.yaml" for n in ("zero2", "zero3", "zero3_offload")])


def test_the_estimate_splits_per_rank_memory_by_zero_stage(make_args, tiny_model):
    """ZeRO-2 splits gradients and optimizer state over the ranks, ZeRO-3 the weights too, ZeRO-3 with both offloads
    keeps none of them on the device; the estimate says how it modelled the config."""
    from hf_speedup import estimate_memory

    def est(name):
        args = make_args(deepspeed=str(CONFIGS / f"{name}.json")) if name else None
        # blocks eager throughout: ZeRO-3 turns compile off, and compiled blocks keep fewer activations
        eager = get_preset("auto").replace(compile={"enabled": False})
        return estimate_memory(tiny_model, speedup=eager, batch_size=4, seq_len=128, world_size=4,
                               caps=fake_caps(**CUDA_H100, world_size=4), args=args)

    alone, z2, z3, off = (est(n) for n in (None, "zero2", "zero3", "zero3_offload"))
    part = {k: {i: e.breakdown[i] for i in ("weights", "optimizer_states")} for k, e in
            (("alone", alone), ("z2", z2), ("z3", z3), ("off", off))}
    assert part["z2"]["weights"] == part["alone"]["weights"]
    assert part["z2"]["optimizer_states"] == pytest.approx(part["alone"]["optimizer_states"] / 4)
    assert part["z3"]["weights"] == pytest.approx(part["alone"]["weights"] / 4)
    assert part["off"] == {"weights": 0, "optimizer_states": 0}
    assert alone.total_bytes > z2.total_bytes > z3.total_bytes > off.total_bytes
    assert "DeepSpeed ZeRO-3: weights, gradients and optimizer state split over 4 ranks" in z3.notes
    assert not any("ZeRO" in n for n in alone.notes)


def test_the_cli_estimates_a_deepspeed_config(capsys):
    from hf_speedup.cli import main

    assert main(["estimate", "--tiny", "--seq-len", "64", "--world-size", "4", "--deepspeed",
                 str(CONFIGS / "zero2.json")]) == 0
    assert "note: DeepSpeed ZeRO-2: gradients and optimizer state split over 4 ranks" in capsys.readouterr().out
    assert main(["estimate", "--tiny", "--seq-len", "64", "--deepspeed", "missing.json"]) == 2
    assert "estimate --deepspeed 'missing.json': no such file; fix:" in capsys.readouterr().err


def test_memory_budget_keeps_a_batch_the_deepspeed_config_fixes(tmp_path):
    """memory.budget trades micro-batch for accumulation through TrainingArguments; where the DeepSpeed config sets
    the batch itself (no "auto") transformers would refuse the changed arguments, so the budget keeps the user's
    micro-batch and reaches the budget by its other levels."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from hf_speedup.model_info import describe_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=1024, intermediate_size=4096,
                                                             num_hidden_layers=8, num_attention_heads=8,
                                                             num_key_value_heads=8, vocab_size=32000))
    info = describe_model(model)
    caps = fake_caps(**CUDA_H100, memory_bytes=85_000_000_000)

    def fit(batch, budget):
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=8,
                                 deepspeed=zero(2, **batch))
        return plan_for({"memory": {"budget": budget, "seq_len": 2048}}, caps, info, args)["memory"].settings.budget

    free = fit({"train_micro_batch_size_per_gpu": "auto"}, "5GB")
    assert free.micro_batch is not None and free.micro_batch < 8  # "auto": the budget may split the batch
    with pytest.raises(SpeedupConfigError, match=r"memory.budget = '5GB' .* micro-batch 8, needs"):
        fit({"train_micro_batch_size_per_gpu": 8}, "5GB")  # nothing at the fixed batch fits: refused, as ever
    fixed = fit({"train_micro_batch_size_per_gpu": 8}, "10GB")
    assert fixed.changed and fixed.micro_batch is None  # fitted by its other levels, the batch kept
    tried = [s for s in fixed.steps if not s.skipped]
    assert {s.micro_batch for s in tried} == {8}
    skipped = {s.level: s.skipped for s in fixed.steps if s.skipped}
    assert "under DeepSpeed ZeRO-2" in skipped.get("+ 8-bit AdamW states", "")  # not tried where it cannot run


def test_deepspeeds_engine_saves_synchronously_and_the_plan_says_why(make_args, tiny_model):
    """Its engine writes its own checkpoint (files, barriers, ``latest``): no background save, stated; an explicit
    ``asynchronous: true`` is a named fallback."""
    d = plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, ds_args(make_args, zero(2)))["crash_safe"]
    assert d.settings.asynchronous is False and "DeepSpeed's engine writes its own checkpoint" in d.reason
    assert d.fallbacks == ()
    cfg = {"base": "auto", "crash_safe": {"asynchronous": True}}
    forced = plan_for(cfg, fake_caps(**CPU_NO_BF16), tiny_model, ds_args(make_args, zero(3)))["crash_safe"]
    assert forced.settings.asynchronous is False
    assert forced.fallbacks and forced.fallbacks[0].startswith("crash_safe.asynchronous: true -> synchronous")
    assert plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model, make_args())["crash_safe"].settings.asynchronous
