"""TrainerCallback that verifies the plan on the real objects and writes the report."""

from __future__ import annotations

import logging

from transformers import TrainerCallback

logger = logging.getLogger("hf_speedup")


class SpeedupCallback(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.verify_speedup()
        if state.is_world_process_zero:
            print(self.trainer.speedup_report.table())
            self.trainer.speedup_report.write(args.output_dir)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.trainer.speedup_report.write(args.output_dir)
