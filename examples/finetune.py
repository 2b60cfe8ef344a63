"""Fine-tune a causal LM with an hf_speedup preset.

Default (no --model): an embedded tiny Llama-style model built from a config, a character tokenizer
built locally and a small arithmetic / string-reversal data set made at run time, so the loss
visibly falls within a minute or two on 2 CPU cores, offline.

    python examples/finetune.py                       # preset "auto"
    python examples/finetune.py --speedup fast        # any preset name or a YAML path
    python examples/finetune.py --trainer sft --speedup fast      # TRL's SFTTrainer on chat data (pip install 'hf_speedup[trl]')
    python examples/finetune.py --model ./my-llama --speedup lora
    python examples/finetune.py --max-steps 10 --profile          # trace of steps 3-4 in outputs/finetune/profile
    python examples/finetune.py --model ./dir --gguf-file model.Q8_0.gguf --speedup lora
    accelerate launch --config_file configs/accelerate/fsdp2_full_shard.yaml examples/finetune.py --speedup fsdp
    sbatch examples/slurm/train.sbatch examples/finetune.py --speedup fsdp --save-steps 50 --resume
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speedup", default="auto", help="preset name (hf-speedup presets) or a SpeedupConfig YAML")
    p.add_argument("--model", help="hub id or local path; default: the embedded tiny Llama")
    p.add_argument("--gguf-file", help="GGUF file name inside --model (a directory or hub repo)")
    p.add_argument("--data-file", help="a text file, one training example per line; default: generated tasks")
    p.add_argument("--output-dir", default="outputs/finetune")
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (full fine-tune of the tiny model), 2e-4 (LoRA)")
    p.add_argument("--examples", type=int, default=4000, help="generated examples (default data only)")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=None, help="a checkpoint every N steps (default: none; a stop "
                                                                   "signal still saves one, see the interrupt feature)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest checkpoint in --output-dir when there is one (a requeued job), "
                        "else start afresh")
    p.add_argument("--report-to", default="none", help="none | wandb | tensorboard | all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="force CPU even where CUDA is present")
    p.add_argument("--trainer", choices=("speedup", "sft"), default="speedup",
                   help="speedup: SpeedupTrainer on plain text rows; sft: hf_speedup.SpeedupSFTTrainer (TRL) on a "
                        "chat-format data set (user/assistant messages) made at run time")
    p.add_argument("--profile", nargs="?", const={}, type=_profile_window, metavar="WAIT,WARMUP,ACTIVE",
                   help="profile a window of steps (default: the config's profile section, 1,1,2): a trace under "
                        "OUTPUT_DIR/profile for TensorBoard/Perfetto, the top operators in the report")
    return p.parse_args(argv)


def _profile_window(text: str) -> dict:
    try:
        wait, warmup, active = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give three integers WAIT,WARMUP,ACTIVE, e.g. 1,1,2") from None
    return {"wait": wait, "warmup": warmup, "active": active}


def build_model_and_tokenizer(ns):
    if not ns.model:
        from hf_speedup.tiny import char_tokenizer, tiny_llama

        return tiny_llama(seed=ns.seed), char_tokenizer()
    from transformers import AutoTokenizer

    from hf_speedup.loading import load_model

    tok_kwargs = {"gguf_file": ns.gguf_file} if ns.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(ns.model, **tok_kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model_kwargs = {"gguf_file": ns.gguf_file} if ns.gguf_file else {}
    return load_model(ns.model, speedup=ns.speedup, **model_kwargs), tokenizer


def _newest_checkpoint(output_dir: str) -> bool | None:
    """True (the Trainer resumes from the newest checkpoint) where output_dir holds one, else None (a fresh start)."""
    from transformers.trainer_utils import get_last_checkpoint

    return True if os.path.isdir(output_dir) and get_last_checkpoint(output_dir) else None


def build_dataset(ns, tokenizer):
    from datasets import Dataset

    from hf_speedup.tiny import make_dataset

    if not ns.data_file:
        return make_dataset(tokenizer, n=ns.examples, seed=ns.seed, pack_to=ns.seq_len)
    with open(ns.data_file) as fh:
        texts = [line.strip() for line in fh if line.strip()]
    enc = tokenizer(texts, truncation=True, max_length=ns.seq_len)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def main(argv=None) -> dict:
    ns = parse_args(argv)
    from transformers import TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.presets import resolve
    from hf_speedup.tiny import causal_lm_collator

    config = resolve(ns.speedup)  # fail on a bad preset before loading anything
    if ns.profile is not None:
        config = config.replace(profile={"enabled": True, **ns.profile})
    model, tokenizer = build_model_and_tokenizer(ns)
    dataset = build_dataset(ns, tokenizer)
    lr = ns.lr if ns.lr is not None else (2e-4 if (config.lora.enabled and ns.model) else 1e-3)
    args = TrainingArguments(
        output_dir=ns.output_dir, per_device_train_batch_size=ns.batch_size, max_steps=ns.max_steps,
        learning_rate=lr, warmup_steps=min(10, ns.max_steps // 10), lr_scheduler_type="cosine",
        logging_steps=ns.logging_steps, save_strategy="steps" if ns.save_steps else "no",
        save_steps=ns.save_steps or 500, report_to=ns.report_to, seed=ns.seed,
        use_cpu=ns.cpu, disable_tqdm=True,
    )
    if ns.trainer == "sft":
        trainer = build_sft_trainer(ns, model, tokenizer, args, config)
    else:
        trainer = SpeedupTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 data_collator=causal_lm_collator(tokenizer), speedup=config)
    trainer.train(resume_from_checkpoint=_newest_checkpoint(ns.output_dir) if ns.resume else None)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    summary = {"preset": config.name, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None,
               "report": os.path.join(ns.output_dir, "speedup_report.json")}
    if trainer.is_world_process_zero():
        print(json.dumps(summary))
    return summary


def build_sft_trainer(ns, model, tokenizer, args, config):
    """TRL's SFTTrainer with speedup=: it tokenizes the chat messages with the tokenizer's chat template and
    builds its own collator; hf_speedup maps the preset onto SFTConfig (padding_free, ...) and wires the rest."""
    from trl import SFTConfig

    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.tiny import CHAT_TEMPLATE, chat_dataset

    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE  # the embedded tokenizer spells "u:question|a:answer|"
    values = {k: v for k, v in args.to_dict().items() if k in SFTConfig.__dataclass_fields__}
    values.update(
        bf16=False,  # SFTConfig defaults to bf16; the precision feature picks bf16 where it is fast here
        max_length=None,  # the generated conversations are short: no truncation, so TRL allows padding-free rows
        hub_token=None,
    )
    sft_args = SFTConfig(**values)
    return SpeedupSFTTrainer(model=model, args=sft_args, train_dataset=chat_dataset(ns.examples, seed=ns.seed),
                             processing_class=tokenizer, speedup=config)


def _end_distributed() -> None:
    """Under torchrun/accelerate launch, tear the process group down while Python is alive (torch's own
    advice): left to the interpreter's exit, gloo more often aborts a process after a successful run."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    _end_distributed()  # after main() returned: the trainer (and its DDP/FSDP wrappers) is released first
