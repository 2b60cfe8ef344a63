"""memory.budget: the plan fits the step into a budget in the issue's order, says so, and never turns LoRA on."""

from __future__ import annotations

import pytest
import torch

from hf_speedup import SpeedupConfig, plan_for, estimate_memory
from hf_speedup.config import SpeedupConfigError
from hf_speedup.features import memory

from conftest import CPU_AMX, CPU_NO_BF16, CUDA_H100, fake_caps

H100 = fake_caps(**CUDA_H100, memory_bytes=85_000_000_000)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)
ORDER = ["as planned", "checkpointing every 4 blocks", "checkpointing every 3 blocks", "checkpointing every 2 blocks",
         "checkpointing every block", "+ 8-bit AdamW states", "+ chunked cross-entropy"]


@pytest.fixture(scope="module")
def llama3_8b_bf16():
    """A Llama-3-8B-sized model described on the meta device, weights in bf16 (as from_pretrained loads it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_speedup.model_info import describe_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA3_8B), dtype=torch.bfloat16)
    return describe_model(model)


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], **kw)


def _plan(info, budget, args, caps=H100, **memory_fields):
    return plan_for({"memory": {"budget": budget, "seq_len": 2048, **memory_fields}}, caps, info, args)


# ---------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("value", ["lots", -3, "12 parsecs", [80]])
def test_a_bad_budget_is_one_clear_error(value):
    with pytest.raises(SpeedupConfigError, match=r"memory\.budget = .* is not allowed; allowed: null, 'auto' "
                                                 r".*a size such as '24GB'.*fix: e.g\. memory\.budget: 24GB"):
        SpeedupConfig.from_dict({"memory": {"budget": value}})


@pytest.mark.parametrize("value", ["auto", "24GB", "80 GiB", 24_000_000_000, 0.9, None])
def test_budget_values_that_are_allowed(value):
    assert SpeedupConfig.from_dict({"memory": {"budget": value}}).memory.budget == value


def test_the_budget_needs_a_sequence_length(tmp_path, llama3_8b_bf16):
    with pytest.raises(SpeedupConfigError, match=r"needs the sequence length.*memory\.seq_len = None.*fix: set "
                                                 r"memory\.seq_len"):
        plan_for({"memory": {"budget": "80GB"}}, H100, llama3_8b_bf16, _args(tmp_path))
    args = _args(tmp_path)
    args.max_length = 2048  # TRL's SFTConfig has one
    plan = plan_for({"memory": {"budget": "80GB"}}, H100, llama3_8b_bf16, args)
    assert plan["memory"].settings.budget.seq_len == 2048


def test_auto_and_fractions_read_the_device(tmp_path, llama3_8b_bf16):
    from hf_speedup.features.memory.budget import budget_bytes

    assert budget_bytes(0.5, H100) == (42_500_000_000, "0.5 of 79.16 GiB on NVIDIA H100 80GB HBM3 (cuda)")
    assert budget_bytes("24GB", H100)[0] == 24_000_000_000 and budget_bytes("24GiB", H100)[0] == 24 * 1024 ** 3
    fit = _plan(llama3_8b_bf16, "auto", _args(tmp_path, per_device_train_batch_size=1)).decisions["memory"]
    assert fit.settings.budget.budget_bytes == 85_000_000_000
    assert "auto: all of 79.16 GiB on NVIDIA H100" in fit.settings.budget.budget_text
    unknown = fake_caps(**CPU_NO_BF16)  # memory_bytes None: the budget is not checked, and the plan says so
    plan = _plan(llama3_8b_bf16, "auto", _args(tmp_path), caps=unknown)
    assert plan["memory"].settings.budget is None and "memory.budget not checked" in plan["memory"].fallbacks[0]


# ---------------------------------------------------------------------------------- 8B at 80, 24, 8 GB
def test_8b_at_80gb_keeps_the_effective_batch_and_says_what_it_chose(tmp_path, llama3_8b_bf16):
    args = _args(tmp_path, per_device_train_batch_size=8)
    plan = _plan(llama3_8b_bf16, "80GB", args)
    fit = plan["memory"].settings.budget
    assert fit.changed and fit.predicted_bytes <= fit.budget_bytes == 80_000_000_000
    tried = [s for s in fit.steps if not s.skipped]
    assert all(not s.fits for s in tried[:-1]) and tried[-1].fits  # the first that fits is taken
    levels = list(dict.fromkeys(s.level for s in fit.steps))
    assert levels == [lvl for lvl in ORDER if lvl in levels]  # the order
    assert levels[0] == "as planned" and [s.micro_batch for s in fit.steps[:4]] == [8, 4, 2, 1]
    # the micro-batch and the accumulation go through TrainingArguments; the effective batch is kept
    over = memory.training_args(plan["memory"], args)
    assert over["per_device_train_batch_size"] * over["gradient_accumulation_steps"] == 8
    assert plan["checkpointing"].active and plan["checkpointing"].reason.startswith("set by memory.budget")
    assert not plan["lora"].active
    reason = plan["memory"].reason
    assert "memory.budget 74.51 GiB" in reason and f"chose {fit.steps[-1].label}" in reason
    assert all(f"{s.micro_batch}x{s.grad_accum}" in reason for s in tried if s.grad_accum > 1)
    assert plan.config.checkpointing.enabled is False  # the user's request is kept as it was


def test_8b_at_24gb_only_lora_would_fit_and_the_error_says_so(tmp_path, llama3_8b_bf16):
    plan_args = _args(tmp_path, per_device_train_batch_size=8)
    with pytest.raises(SpeedupConfigError) as err:
        _plan(llama3_8b_bf16, "24GB", plan_args)
    text = str(err.value)
    assert "no configuration hf_speedup may choose is predicted to fit" in text
    assert "+ chunked cross-entropy, micro-batch 1 x 8 accumulation" in text  # the leanest it tried
    assert "LoRA (lora.enabled: true): " in text and ", fits;" in text
    assert "never switches to adapters behind your back" in text


def test_the_lora_alternative_loads_its_base_in_the_plans_precision(tmp_path):
    """load_model loads a frozen base in the precision feature's dtype: an AMX CPU told fp32 keeps an fp32 base, and
    a CPU whose bf16 was chosen by measurement (no AMX flag) gets a bf16 one; the error's figure follows the plan."""
    import re

    from hf_speedup.measured import Measurement
    from hf_speedup.model_info import describe_model
    from hf_speedup.tiny import tiny_llama

    info = describe_model(tiny_llama(seed=0))
    fast_bf16 = {"precision.bf16_matmul": Measurement(value=3.0, what="faked", where="test")}

    def lora_figure(caps, dtype):
        with pytest.raises(SpeedupConfigError) as err:
            plan_for({"memory": {"budget": "1MB", "seq_len": 512}, "precision": {"dtype": dtype}}, caps, info,
                     _args(tmp_path, per_device_train_batch_size=8, use_cpu=True))
        return float(re.search(r"LoRA \(lora\.enabled: true\): ([0-9.]+) MiB", str(err.value)).group(1))

    amx = fake_caps(**CPU_AMX, memory_bytes=1 << 30)
    assert lora_figure(amx, "fp32") > lora_figure(amx, "bf16")
    measured = fake_caps(**CPU_NO_BF16, memory_bytes=1 << 30, measured=fast_bf16)
    assert lora_figure(measured, "auto") == lora_figure(amx, "bf16")


def test_8b_at_8gb_not_even_qlora_fits(tmp_path, llama3_8b_bf16):
    with pytest.raises(SpeedupConfigError, match=r"LoRA \(lora\.enabled: true\): [0-9.]+ GiB, over as well; QLoRA "
                                                 r".*[0-9.]+ GiB, over as well"):
        _plan(llama3_8b_bf16, "8GB", _args(tmp_path, per_device_train_batch_size=8))


def test_with_lora_asked_for_the_budget_fits_the_adapters(tmp_path, llama3_8b_bf16):
    """LoRA the user turned on is kept and fitted like anything else (here at 24 GB)."""
    plan = plan_for({"lora": {"enabled": True}, "memory": {"budget": "24GB", "seq_len": 2048}}, H100,
                      llama3_8b_bf16, _args(tmp_path, per_device_train_batch_size=8))
    fit = plan["memory"].settings.budget
    assert plan["lora"].active and fit.predicted_bytes <= 24_000_000_000


def test_a_budget_that_fits_changes_nothing(tmp_path, llama3_8b_bf16):
    args = _args(tmp_path, per_device_train_batch_size=1)
    plan = _plan(llama3_8b_bf16, "1TB", args)
    fit = plan["memory"].settings.budget
    assert not fit.changed and "fits as planned" in plan["memory"].reason
    assert memory.training_args(plan["memory"], args) == {} and not plan["checkpointing"].active


# ------------------------------------------------------------------------------- the last step: chunked
def test_chunked_loss_is_the_last_step_and_8bit_is_skipped_where_it_cannot_run(tmp_path):
    """A big vocabulary on a CPU: 8-bit AdamW cannot run (skipped, said), so the chunked loss is what fits."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_speedup.model_info import describe_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                             num_attention_heads=4, vocab_size=65536))
    info = describe_model(model)
    cpu = fake_caps(**CPU_NO_BF16, memory_bytes=16 * 1024 ** 3)
    args = _args(tmp_path, per_device_train_batch_size=8, use_cpu=True)
    base = {"precision": {"dtype": "fp32"}}
    leanest_stock = estimate_memory(model, speedup={**base, "checkpointing": {"enabled": True}}, batch_size=1,
                                    seq_len=512, gradient_accumulation_steps=8, caps=cpu).total_bytes
    plan = plan_for({**base, "memory": {"budget": leanest_stock - 1, "seq_len": 512}}, cpu, info, args)
    fit = plan["memory"].settings.budget
    assert fit.steps[-1].level == "+ chunked cross-entropy" and fit.steps[-1].fits
    skipped = [s for s in fit.steps if s.skipped]
    assert [s.level for s in skipped] == ["+ 8-bit AdamW states"] and "CUDA" in skipped[0].skipped
    assert plan["loss"].active and plan["loss"].settings.chunked
    assert plan["checkpointing"].settings.every_n_blocks == 1 and plan["optimizer"].applied == "adamw_fused"

    # an explicit loss.chunked: false is the user's choice: the budget does not turn it on, it says nothing fits
    with pytest.raises(SpeedupConfigError, match=r"memory.budget = .* no configuration hf_speedup may choose"):
        plan_for({**base, "loss": {"chunked": False}, "memory": {"budget": leanest_stock - 1, "seq_len": 512}},
                   cpu, info, args)


# ------------------------------------------------------------------------------------- a real trainer
def test_trainer_takes_the_budgets_micro_batch_and_reports_it(tmp_path, tokenizer, dataset, collator):
    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import tiny_llama

    speedup = {"precision": {"dtype": "fp32"}}
    model = tiny_llama(seed=0)
    at4x2 = estimate_memory(model, speedup=speedup, batch_size=4, seq_len=64, gradient_accumulation_steps=2)
    at8 = estimate_memory(model, speedup=speedup, batch_size=8, seq_len=64)
    assert at4x2.total_bytes < at8.total_bytes
    budget = at4x2.total_bytes + 1
    args = _args(tmp_path, per_device_train_batch_size=8, max_steps=2, use_cpu=True, save_strategy="no",
                 disable_tqdm=True, logging_steps=1)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                             speedup={**speedup, "memory": {"budget": budget, "seq_len": 64}})
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)  # the user's: untouched
    state = trainer.speedup_status["memory"]
    assert state.engaged, state.engaged_reason
    assert "micro-batch 8 x 1 accumulation -> 4 x 2" in state.reason
    trainer.train()
    entry = trainer.speedup_report.to_dict()["plan"]["memory"]
    assert entry["settings"]["budget"]["micro_batch"] == 4 and entry["engaged"] is True


@pytest.mark.parametrize("kind", ["AMX CPU, bf16 by its flag", "CPU without AMX, bf16 by measurement"])
def test_the_estimators_budget_sizes_a_lora_base_in_the_precision_the_plan_chose(kind):
    """estimate_memory from a config loads a LoRA base as load_model does, in the plan's precision (bf16 here,
    chosen by the AMX flag or by a measurement): memory.budget sizes that model too, so a budget the estimate fits
    changes nothing (it used to size the base in the meta model's fp32 and shrink the micro-batch for nothing)."""
    from hf_speedup import estimate_memory
    from hf_speedup.measured import Measurement
    from hf_speedup.tiny import tiny_llama_config

    fast_bf16 = {"precision.bf16_matmul": Measurement(value=3.0, what="faked", where="test")}
    caps = (fake_caps(**CPU_AMX, memory_bytes=1 << 34) if kind.startswith("AMX") else
            fake_caps(**CPU_NO_BF16, memory_bytes=1 << 34, measured=fast_bf16))
    lora = {"lora": {"enabled": True}}
    planned = estimate_memory(tiny_llama_config(), speedup=lora, batch_size=8, seq_len=512, caps=caps)
    assert planned.setup.weight_bytes == 2 and planned.setup.compute_bytes == 2  # a bf16 base, bf16 autocast
    budget = int(planned.total_bytes * 1.02)
    fitted = estimate_memory(tiny_llama_config(), speedup={**lora, "memory": {"budget": budget}}, batch_size=8,
                             seq_len=512, caps=caps)
    assert fitted.plan_changes == () and fitted.total_bytes == planned.total_bytes <= budget
