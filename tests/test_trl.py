"""TRL: SpeedupSFTTrainer (and SpeedupMixin on any SFTTrainer subclass) keeps TRL's collator, data preparation
and packing, accepts peft_config (the user's LoRA wins and shows as engaged), maps presets onto SFTConfig
fields; sft_config() returns a stock SFTConfig."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps  # noqa: E402
from hf_speedup import SpeedupMixin, plan_for, get_preset, sft_config  # noqa: E402
from hf_speedup.features import data, memory  # noqa: E402


@pytest.fixture(scope="module")
def chat():
    from hf_speedup.tiny import chat_dataset, chat_tokenizer

    return chat_dataset(48, seed=0), chat_tokenizer()


def small_llama():
    from hf_speedup.tiny import tiny_llama

    return tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def sft_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=8, max_steps=3, logging_steps=1,
                report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
                dataloader_num_workers=0, max_length=None, learning_rate=1e-3)
    base.update(kw)
    return trl.SFTConfig(**base)


def eager_preset(name: str):
    """The preset with compile wiring only: the eager backend, compiled from the first step of these short runs."""
    return get_preset(name).replace(compile={"backend": "eager", "when": "always"})


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_speedup_sft_trainer_is_exported_and_is_an_sft_trainer():
    from hf_speedup import SpeedupSFTTrainer

    assert issubclass(SpeedupSFTTrainer, trl.SFTTrainer) and issubclass(SpeedupSFTTrainer, SpeedupMixin)


def test_fast_trains_with_trls_own_padding_free_collator(tmp_path, chat):
    from hf_speedup import SpeedupSFTTrainer

    ds, tok = chat
    trainer = SpeedupSFTTrainer(model=small_llama(), args=sft_args(tmp_path, max_steps=6), train_dataset=ds,
                                processing_class=tok, speedup=eager_preset("fast"))
    collator = trainer.data_collator
    assert type(collator).__module__.startswith("trl.") and collator.padding_free is True  # TRL's, not ours
    assert trainer.args.padding_free is True and "input_ids" in trainer.train_dataset.column_names  # TRL prepared it
    assert trainer.model.config._attn_implementation == "sdpa_varlen"
    trainer.train()
    report = trainer.speedup_report.to_dict()
    for feature in ("data", "attention", "compile"):
        assert report["plan"][feature]["engaged"], report["plan"][feature]
    assert "SFTConfig.padding_free=True" in report["plan"]["data"]["reason"]
    assert len(trainer.train_dataset) == 48  # 6 steps x 8 rows: one epoch, every row once
    assert report["measurement"]["tokens"] == sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert all(loss == loss for loss in losses(trainer))


def test_mixin_on_sft_trainer_keeps_its_collator_when_trl_refuses_padding_free(tmp_path, chat):
    """SFTConfig's default max_length=1024 without packing: TRL refuses padding_free. hf_speedup must neither
    ask for it nor build a DataCollatorWithPadding (SFTTrainer would then crash at the first batch)."""

    class MyTrainer(SpeedupMixin, trl.SFTTrainer):
        pass

    ds, tok = chat
    trainer = MyTrainer(model=small_llama(), args=sft_args(tmp_path, max_length=1024), train_dataset=ds,
                        processing_class=tok, speedup="auto")
    assert type(trainer.data_collator).__module__.startswith("trl.") and not trainer.data_collator.padding_free
    assert trainer.data_collator.pad_to_multiple_of == 8  # the preset's padding, passed as SFTConfig.pad_to_multiple_of
    assert any("TRL refuses padding_free" in f for f in trainer.speedup_status["data"].fallbacks)
    trainer.train()
    assert len(losses(trainer)) == 3


def test_user_peft_config_wins_over_the_lora_preset_and_shows_engaged(tmp_path, chat):
    from peft import LoraConfig

    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.features.lora import lora_layers

    ds, tok = chat
    user = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = SpeedupSFTTrainer(model=small_llama(), args=sft_args(tmp_path), train_dataset=ds, processing_class=tok,
                                peft_config=user, speedup="lora")
    layers = lora_layers(trainer.model)
    assert sorted({n.split(".")[-1] for n in layers}) == ["q_proj", "v_proj"]  # not the preset's 7 projections
    assert all(m.r["default"] == 4 for m in layers.values())
    state = trainer.speedup_status["lora"]
    assert state.engaged and "the trainer's peft_config LoraConfig(r=4" in state.reason
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert any((after[n] - p).abs().max() > 0 for n, p in before.items())  # the adapters trained


def test_a_user_collator_is_flattened_by_hf_speedup_not_handed_to_trls_padding_free(tmp_path, chat):
    """TRL refuses padding_free with a custom collator; hf_speedup flattens the user's one and leaves TRL's off."""
    from transformers import DataCollatorForLanguageModeling

    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.features.data.padding_free import PaddingFreeCollator

    ds, tok = chat
    trainer = SpeedupSFTTrainer(model=small_llama(), args=sft_args(tmp_path), train_dataset=ds, processing_class=tok,
                                data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                                speedup=eager_preset("fast"))
    assert isinstance(trainer.data_collator, PaddingFreeCollator) and trainer.args.padding_free is False
    assert trainer.speedup_status["data"].engaged
    trainer.train()


def test_sft_config_returns_a_stock_sft_config_with_the_presets_fields(caplog):
    fast = sft_config("fast", output_dir="out", use_cpu=True, bf16=False, max_length=None)
    assert isinstance(fast, trl.SFTConfig) and fast.padding_free is True and fast.optim == "adamw_torch_fused"
    baseline = sft_config("baseline", output_dir="out", use_cpu=True, bf16=False, max_length=None)
    assert baseline.padding_free is False and baseline.optim == trl.SFTConfig(output_dir="o", use_cpu=True).optim
    with caplog.at_level("WARNING", logger="hf_speedup"):
        default_length = sft_config("fast", output_dir="out", use_cpu=True, bf16=False)
    assert default_length.padding_free is False and default_length.pad_to_multiple_of == 64
    assert "TRL refuses padding_free there" in caplog.text


def test_presets_map_onto_sft_config_fields(tmp_path):
    args = sft_args(tmp_path)
    cpu = plan_for("fast", caps=fake_caps(**CPU_NO_BF16), args=args)
    assert data.training_args(cpu["data"], args)["padding_free"] is True
    packing = get_preset("auto").replace(data={"packing": True})
    assert data.training_args(plan_for(packing, args=args)["data"], args)["packing"] is True
    cuda = plan_for("memory", caps=fake_caps(**CUDA_H100), args=args)
    assert memory.training_args(cuda["memory"], args)["activation_offloading"] is True
    plain = plan_for("memory", caps=fake_caps(**CUDA_H100))
    assert "activation_offloading" not in memory.training_args(plain["memory"], None)
    on_cpu = plan_for("memory", caps=fake_caps(**CPU_NO_BF16), args=args)
    assert "activation_offloading" not in memory.training_args(on_cpu["memory"], args)


@pytest.mark.slow  # a subprocess run of 30 steps
def test_example_trains_sft_on_generated_chat_data(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "finetune.py"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(script), "--trainer", "sft", "--speedup", "auto", "--max-steps", "30",
                          "--examples", "400", "--logging-steps", "10", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads([line for line in out.stdout.splitlines() if line.startswith('{"preset"')][-1])
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary
    plan = json.loads((tmp_path / "speedup_report.json").read_text())["plan"]
    assert plan["data"]["engaged"] and "SFTConfig.padding_free=True" in plan["data"]["reason"]
    assert plan["attention"]["applied"] == "sdpa_varlen" and plan["attention"]["engaged"]


def test_a_model_id_is_loaded_before_planning(tmp_path, chat):
    """TRL trainers take a model id; hf_speedup loads it first (with SFTConfig.model_init_kwargs), so the plan
    and the features work on the real model."""
    from hf_speedup import SpeedupSFTTrainer

    ds, tok = chat
    small_llama().save_pretrained(tmp_path / "model")
    trainer = SpeedupSFTTrainer(model=str(tmp_path / "model"), args=sft_args(tmp_path, max_steps=1), train_dataset=ds,
                                processing_class=tok, speedup="auto")
    assert trainer.speedup_plan.model.architecture == "LlamaForCausalLM"
    assert trainer.model.config._attn_implementation == "sdpa_varlen" and trainer.speedup_status["attention"].engaged


def test_mixin_gives_a_dpo_trainer_speedup_and_keeps_its_preference_collator(tmp_path):
    """Not only SFT: any Trainer subclass with its own __init__ (here TRL's DPOTrainer, which also takes a
    ref_model) gets speedup=; its own collator and data preparation stay, and the LoRA preset engages."""
    import copy

    from datasets import Dataset

    from hf_speedup.features.lora import lora_layers
    from hf_speedup.tiny import chat_tokenizer

    class MyDPOTrainer(SpeedupMixin, trl.DPOTrainer):
        pass

    rows = Dataset.from_list([{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
                              for i in range(32)])
    args = trl.DPOConfig(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=8, max_steps=2,
                         logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                         disable_tqdm=True, dataloader_num_workers=0)
    model = small_llama()
    trainer = MyDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=rows,
                           processing_class=chat_tokenizer(), speedup=eager_preset("lora"))
    assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"  # TRL's own
    assert lora_layers(trainer.model) and trainer.speedup_status["lora"].engaged
    trainer.train()
    assert len(losses(trainer)) == 2 and all(loss == loss for loss in losses(trainer))


def test_explicit_choices_of_training_arguments_survive_the_sft_config_conversion(tmp_path, chat):
    """training_arguments(..., dataloader_drop_last=False) records the caller's choice; SpeedupSFTTrainer
    converts the TrainingArguments to an SFTConfig and must keep that record (the fast preset wants True)."""
    from hf_speedup import SpeedupSFTTrainer, training_arguments

    ds, tok = chat
    args = training_arguments("baseline", output_dir=str(tmp_path / "o"), use_cpu=True, max_steps=1, report_to=[],
                              per_device_train_batch_size=8, dataloader_drop_last=False, save_strategy="no")
    trainer = SpeedupSFTTrainer(model=small_llama(), args=args, train_dataset=ds, processing_class=tok,
                                speedup={"base": "fast", "compile": {"enabled": False},
                                         "data": {"padding_free": False}})
    assert trainer.args.dataloader_drop_last is False
    assert "kept your TrainingArguments.dataloader_drop_last=False" in trainer.speedup_status["data"].reason


# ---- regressions: a model id with quantization_config, GRPO-style configs, no args, DPO + peft_config, cloned templates


def preference_rows():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
                              for i in range(32)])


def dpo_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=8, max_steps=1, logging_steps=1,
                report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
                dataloader_num_workers=0, gradient_checkpointing=False)
    base.update(kw)
    return trl.DPOConfig(**base)


def test_quantization_config_loads_a_model_id_in_4bit(tmp_path, chat):
    """TRL loads a model id with the trainer's quantization_config (QLoRA); hf_speedup loads the model first and
    must pass it on (and not hand it to the trainer a second time, which would warn it is ignored)."""
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from hf_speedup import SpeedupSFTTrainer

    ds, tok = chat
    small_llama().save_pretrained(tmp_path / "model")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    trainer = SpeedupSFTTrainer(model=str(tmp_path / "model"), args=sft_args(tmp_path, max_steps=1), train_dataset=ds,
                                processing_class=tok, quantization_config=quant, speedup="baseline",
                                peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer.train()
    base = trainer.model.get_base_model()
    assert base.is_loaded_in_4bit
    layer = base.model.layers[0]
    assert type(layer.self_attn.k_proj).__name__ == "Linear4bit"  # not adapted: the plain 4-bit base layer
    assert type(layer.self_attn.q_proj.get_base_layer()).__name__ == "Linear4bit"


def test_quantization_config_in_model_init_kwargs_too_is_refused(tmp_path, chat):
    from transformers import BitsAndBytesConfig

    from hf_speedup import SpeedupSFTTrainer

    ds, tok = chat
    quant = BitsAndBytesConfig(load_in_4bit=True)
    with pytest.raises(ValueError, match="quantization_config is set both"):
        SpeedupSFTTrainer(model=str(tmp_path / "never_loaded"), train_dataset=ds, processing_class=tok,
                          args=sft_args(tmp_path, model_init_kwargs={"quantization_config": quant}),
                          quantization_config=quant, speedup="baseline")


def test_replace_args_keeps_grpo_and_rloo_generation_batch_fields():
    """GRPOConfig/RLOOConfig fill generation_batch_size from steps_per_generation (or the reverse) and refuse both
    set: a rebuilt copy must keep the values, whichever the caller (or an override) set."""
    from hf_speedup.compat import replace_args

    for config_cls in (trl.GRPOConfig, trl.RLOOConfig):
        common = dict(output_dir="o", use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=2)
        by_steps = config_cls(**common, steps_per_generation=3)
        copy = replace_args(by_steps, {"optim": "adamw_torch"})
        assert (copy.optim, copy.steps_per_generation, copy.generation_batch_size) == ("adamw_torch", 3, 12)
        by_size = config_cls(**common, generation_batch_size=8)
        copy = replace_args(by_size, {"optim": "adamw_torch"})
        assert (copy.steps_per_generation, copy.generation_batch_size) == (2, 8)
        assert replace_args(by_size, {"generation_batch_size": 16}).steps_per_generation == 4  # re-derived
        assert replace_args(by_size, {"steps_per_generation": 1}).generation_batch_size == 4


def test_mixin_on_grpo_trainer_trains_with_the_auto_preset(tmp_path):
    from datasets import Dataset

    from hf_speedup.tiny import chat_tokenizer

    class MyGRPOTrainer(SpeedupMixin, trl.GRPOTrainer):
        pass

    def reward(completions, **kw):
        return [float(len(c)) for c in completions]

    args = trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=4, max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                          bf16=False, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                          gradient_checkpointing=False)
    trainer = MyGRPOTrainer(model=small_llama(), reward_funcs=reward, args=args, processing_class=chat_tokenizer(),
                            train_dataset=Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(16)]),
                            speedup="auto")
    assert (trainer.args.generation_batch_size, trainer.args.steps_per_generation) == (4, 1)
    trainer.train()
    assert trainer.state.global_step == 2 and len(losses(trainer)) == 2


def test_without_args_a_trl_trainer_gets_its_own_config_class_and_defaults(tmp_path, chat, monkeypatch):
    """Given no args, TRL trainers build their own config (SFTConfig("<model>-SFT"), DPOConfig(...)): the mixin must
    plan with the same class, its defaults and fields (DPO reads model_init_kwargs), not a plain TrainingArguments."""
    from hf_speedup.tiny import chat_tokenizer

    class MySFTTrainer(SpeedupMixin, trl.SFTTrainer):
        pass

    class MyDPOTrainer(SpeedupMixin, trl.DPOTrainer):
        pass

    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    ds, tok = chat
    sft = MySFTTrainer(model=small_llama(), train_dataset=ds, processing_class=tok, speedup="baseline")
    defaults = trl.SFTConfig(output_dir="x", use_cpu=True)
    assert type(sft.args) is trl.SFTConfig
    for field in ("learning_rate", "logging_steps", "gradient_checkpointing", "max_length"):
        assert getattr(sft.args, field) == getattr(defaults, field), field
    small_llama().save_pretrained(tmp_path / "tiny")
    dpo = MyDPOTrainer(model=str(tmp_path / "tiny"), train_dataset=preference_rows(), processing_class=chat_tokenizer(),
                       speedup="baseline")
    assert type(dpo.args) is trl.DPOConfig and dpo.args.output_dir == "tiny-DPO"
    assert dpo.args.learning_rate == trl.DPOConfig(output_dir="x", use_cpu=True).learning_rate


def test_dpo_with_peft_config_has_only_the_users_adapter(tmp_path):
    """Stock DPOTrainer with peft_config trains one adapter and scores the reference with adapters disabled; the
    mixin wraps the model before DPOTrainer runs, which then took it for a pretrained adapter and added a frozen
    'ref' copy (parameters, compute, saved with the model)."""
    from peft import LoraConfig

    from hf_speedup.tiny import chat_tokenizer

    class MyDPOTrainer(SpeedupMixin, trl.DPOTrainer):
        pass

    user = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MyDPOTrainer(model=small_llama(), args=dpo_args(tmp_path), train_dataset=preference_rows(),
                           processing_class=chat_tokenizer(), peft_config=user, speedup="lora")
    assert list(trainer.model.peft_config) == ["default"]
    assert not [n for n, _ in trainer.model.named_parameters() if ".ref." in n]
    state = trainer.speedup_status["lora"]
    assert state.engaged and "the trainer's peft_config LoraConfig(r=4" in state.reason
    preset_only = MyDPOTrainer(model=small_llama(), args=dpo_args(tmp_path), train_dataset=preference_rows(),
                               processing_class=chat_tokenizer(), speedup=eager_preset("lora"))
    assert list(preset_only.model.peft_config) == ["default"] and preset_only.speedup_status["lora"].engaged
    trainer.train()
    assert len(losses(trainer)) == 1 and all(loss == loss for loss in losses(trainer))


def test_chat_template_clone_with_peft_config_keeps_the_new_tokens_trainable(tmp_path, chat):
    """TRL clones chat_template_path's tokenizer before applying peft_config and makes the tokens it adds trainable
    (trainable_token_indices + lm_head in modules_to_save); hf_speedup applies peft_config early, so it must too."""
    from peft import LoraConfig

    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.tiny import chat_tokenizer

    source = chat_tokenizer()
    source.add_special_tokens({"additional_special_tokens": ["<|newturn|>"]})
    source.save_pretrained(tmp_path / "source")
    ds, _ = chat
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = sft_args(tmp_path, max_steps=1, chat_template_path=str(tmp_path / "source"), gradient_checkpointing=False)
    built = {}
    for cls, kw in ((trl.SFTTrainer, {}), (SpeedupSFTTrainer, {"speedup": "baseline"})):
        trainer = cls(model=small_llama(), args=args, train_dataset=ds, processing_class=chat_tokenizer(),
                      peft_config=lora, **kw)
        config = trainer.model.peft_config["default"]
        trainable = sorted(n for n, p in trainer.model.named_parameters()
                           if p.requires_grad and ("embed" in n or "lm_head" in n))
        built[cls] = (config.trainable_token_indices, config.modules_to_save, trainable,
                      len(trainer.processing_class), trainer.model.get_input_embeddings().weight.shape)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")  # TRL edits its own
    assert built[SpeedupSFTTrainer] == built[trl.SFTTrainer]
    indices, modules, trainable, *_ = built[SpeedupSFTTrainer]
    assert indices["embed_tokens"] and modules == ["lm_head"] and len(trainable) == 2
    assert "chat template" in trainer.speedup_status["lora"].reason


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a bf16 GPU TRL's default bf16=True stands")
def test_sft_config_on_a_cpu_machine_is_built_without_trls_bf16_default(tmp_path):
    """TRL's SFTConfig defaults to bf16=True, which a machine without a bf16 GPU refuses: the plan picks the dtype."""
    from hf_speedup import sft_config

    args = sft_config("fast", output_dir=str(tmp_path))
    assert args.bf16 is False and args.fp16 is False
    with pytest.raises(ValueError, match="bf16"):  # the user's own explicit choice is still TRL's to judge
        sft_config("fast", output_dir=str(tmp_path), bf16=True)
