"""One training process of tests/test_compile_cache.py: the tiny Llama with its blocks compiled by inductor, run in a
process of its own (the test gives each an empty ``TORCHINDUCTOR_CACHE_DIR``), then torch's cache counters and the
compile feature's report entry written as JSON.

    python tests/dist/compile_cache_train.py --out DIR --steps 2 --json cold.json
    python tests/dist/compile_cache_train.py --out DIR --steps 8 --resume --pays-back --json resumed.json

``--pays-back``: ``compile.when: pays_back``, with a gain so large the gate always opens after the timed steps (what is
checked is the compile cost it weighed, not a verdict that depends on how busy the machine is).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pays-back", action="store_true")
    parser.add_argument("--json", required=True)
    a = parser.parse_args()

    from transformers import TrainingArguments

    from hf_speedup import SpeedupTrainer, get_preset
    from hf_speedup.features.compile import payback
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_rows, tiny_llama

    payback.PAYBACK["cpu"] = (1e6, 20.0, 9.0)  # the gate opens whatever the eager steps took
    tokenizer = char_tokenizer()
    model = tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    config = get_preset("baseline").replace(
        compile={"enabled": True, "backend": "inductor", "mode": None, "dynamic": False,
                 "when": "pays_back" if a.pays_back else "always"},
        data={"pad_to_multiple_of": 64})  # one shape: one graph
    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=4, max_steps=a.steps, save_strategy="steps",
                             save_steps=2, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=make_rows(tokenizer, n=256, seed=0, pack_to=64),
                             data_collator=causal_lm_collator(tokenizer), speedup=config)
    trainer.train(resume_from_checkpoint=True if a.resume else None)

    from torch._dynamo.utils import counters

    state = trainer.speedup_status["compile"]
    out = {"engaged": state.engaged, "reason": state.reason, "facts": state.to_dict()["settings"],
           "fxgraph": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"]),
           "unique_graphs": counters["stats"]["unique_graphs"], "global_step": trainer.state.global_step}
    with open(a.json, "w") as fh:
        json.dump(out, fh, default=str)


if __name__ == "__main__":
    main()
