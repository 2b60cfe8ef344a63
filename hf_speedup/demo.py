"""``hf-speedup demo``: fine-tune the embedded tiny Llama with a preset, from an installed wheel.

Everything is made here (model from a config, character tokenizer, arithmetic/reversal data), so it runs
offline in a minute on a CPU. ``examples/finetune.py`` is the full example (any model, data file, launchers).
"""

from __future__ import annotations

from .tiny import causal_lm_collator, char_tokenizer, make_dataset, tiny_llama
from .trainer import SpeedupTrainer


def run_demo(preset: str = "auto", max_steps: int = 60, output_dir: str = "outputs/demo") -> SpeedupTrainer:
    """Train and return the trainer; its plan, metrics and falling loss are printed as it goes."""
    from transformers import TrainingArguments

    tokenizer = char_tokenizer()
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, max_steps=max_steps,
                             learning_rate=1e-3, warmup_steps=min(10, max_steps // 10), logging_steps=10,
                             save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    trainer = SpeedupTrainer(model=tiny_llama(seed=0), args=args, processing_class=tokenizer,
                             train_dataset=make_dataset(tokenizer, n=2000, seed=0, pack_to=128),
                             data_collator=causal_lm_collator(tokenizer), speedup=preset)
    trainer.train()
    return trainer
