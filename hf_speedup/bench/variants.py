"""Each bench variant built the way its own documentation says: a preset through SpeedupTrainer, the stock
Trainer (with torch.compile, Liger, peft LoRA or transformers' padding-free ``DataCollatorWithFlattening``),
TRL's SFTTrainer, Unsloth; on the embedded tiny Llama, a
model built from ``--config`` or one loaded from ``--model``. Every trainer class gets the same batch counting."""

from __future__ import annotations

import os

from .meters import StepSplit, TokenMeter
from .options import LORA_REFERENCE, preset_config


def tokenizer_for(opts: dict):
    if opts["model"]:
        from ..loading import load_tokenizer

        tok = load_tokenizer(opts["model"])
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    from ..tiny import char_tokenizer

    return char_tokenizer()


def random_model(opts: dict, device: str):
    """The embedded tiny Llama, or a model built from ``--config`` (random weights, seeded)."""
    import torch

    if opts["model_config"] is None:
        from ..tiny import tiny_llama

        return tiny_llama(seed=opts["seed"])
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(opts["model_config"])
    config = AutoConfig.for_model(sizes.pop("model_type", "llama"), **sizes)
    torch.manual_seed(opts["seed"])
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def build_model(spec: dict, config=None):
    """The variant's model: built from a config, or loaded (the preset's way: ``hf_speedup.load_model``)."""
    opts, device = spec["options"], spec["device"]
    quantized = config is not None and config.lora.enabled and config.lora.quantization and device == "cuda"
    if opts["model"]:
        from ..loading import load_model

        # a peer loads as the stock recipes do for mixed-precision training: fp32 weights (the "baseline" plan),
        # like a preset's full fine-tune and like the random models, not the checkpoint's own (often bf16) dtype
        return load_model(opts["model"], speedup=config if config is not None else "baseline")
    if quantized:  # a 4-bit base is quantized while it loads: save the random model once, then load it
        import torch

        from ..loading import load_model

        path = os.path.join(spec["output"], "base_model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            random_model(opts, device).to(torch.bfloat16).save_pretrained(path)
        return load_model(path, speedup=config)
    return random_model(opts, device)


def peft_adapters(model):
    """The stock way to LoRA: peft with the ``lora`` preset's adapters (every attention/MLP projection)."""
    from peft import LoraConfig, get_peft_model

    from ..model_info import describe_model
    from ..presets import get_preset

    lora = get_preset("lora").lora
    targets = list(describe_model(model).linear_names) or "all-linear"
    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


def training_kwargs(spec: dict) -> dict:
    opts = spec["options"]
    return dict(output_dir=os.path.join(spec["output"], "runs", spec["slug"]),
                per_device_train_batch_size=opts["batch_size"], max_steps=spec["total_steps"],
                learning_rate=opts["learning_rate"], lr_scheduler_type="constant", seed=opts["seed"],
                logging_steps=10**9, save_strategy="no", report_to=[], disable_tqdm=True,
                dataloader_num_workers=0, bf16=spec["bf16"], use_cpu=spec["device"] == "cpu")


def counting(cls, meter: TokenMeter, split: StepSplit | None = None):
    """``cls`` with its batches counted as ``training_step`` receives them and (with ``split``) its wait for data
    timed (the same hooks for every variant)."""

    class Counted(cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            meter.add(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

        def get_batch_samples(self, *args, **kwargs):
            if split is None:
                return super().get_batch_samples(*args, **kwargs)
            with split.clock.phase("data"):
                return super().get_batch_samples(*args, **kwargs)

    Counted.__name__ = Counted.__qualname__ = cls.__name__
    return Counted


def build_trainer(spec: dict, meter: TokenMeter, tok, dataset, split: StepSplit | None = None):
    """The variant's trainer, each run the way its own documentation says."""
    from transformers import Trainer, TrainingArguments

    from ..tiny import causal_lm_collator

    name, kind = spec["variant"], spec["kind"]
    kw = training_kwargs(spec)
    collator = causal_lm_collator(tok)
    if kind == "preset":
        from ..trainer import SpeedupTrainer

        config = preset_config(name)
        model = build_model(spec, config)
        return counting(SpeedupTrainer, meter, split)(model=model, args=TrainingArguments(**kw), train_dataset=dataset,
                                               data_collator=collator, speedup=config)
    if name == "trl-sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**kw, padding_free=True, max_length=None)
        return counting(SFTTrainer, meter, split)(model=build_model(spec), args=args, train_dataset=dataset,
                                           processing_class=tok)
    if name == "unsloth":
        return unsloth_trainer(spec, meter, tok, dataset, kw, split)
    model = build_model(spec)
    if name == LORA_REFERENCE:
        model = peft_adapters(model)
    if name == "stock-flat":  # the stock way to padding-free: each batch one row, position_ids restart per sequence
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening()
    # stock-bf16: the first thing a user tries for speed, bf16=True on the stock Trainer (CPU autocast included)
    extra = {"stock-compile": {"torch_compile": True}, "liger": {"use_liger_kernel": True},
             "stock-bf16": {"bf16": True}}.get(name, {})
    return counting(Trainer, meter, split)(model=model, args=TrainingArguments(**{**kw, **extra}),
                                           train_dataset=dataset, data_collator=collator)


def unsloth_trainer(spec: dict, meter: TokenMeter, tok, dataset, kw: dict, split: StepSplit | None = None):
    """Unsloth as its docs show it: FastLanguageModel + LoRA adapters + TRL's SFTTrainer (CUDA only)."""
    from unsloth import FastLanguageModel  # imported first thing in this process (see runner.boot_code)
    from trl import SFTConfig, SFTTrainer

    from ..presets import get_preset

    opts = spec["options"]
    path = opts["model"]
    if not path:  # a random model: save it once so Unsloth can load it its way
        path = os.path.join(spec["output"], "unsloth_base")
        if not os.path.isfile(os.path.join(path, "config.json")):
            random_model(opts, "cpu").save_pretrained(path)
            tok.save_pretrained(path)
    model, _ = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=opts["seq_len"], dtype=None,
                                                 load_in_4bit=False)
    lora = get_preset("lora").lora
    model = FastLanguageModel.get_peft_model(
        model, r=lora.r, lora_alpha=lora.alpha, lora_dropout=0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth", random_state=opts["seed"])
    args = SFTConfig(**kw, max_length=opts["seq_len"])
    return counting(SFTTrainer, meter, split)(model=model, args=args, train_dataset=dataset, processing_class=tok)
