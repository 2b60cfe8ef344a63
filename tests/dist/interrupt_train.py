"""A training run that a signal stops, driven by tests/test_interrupt.py (one process) and
tests/test_interrupt_distributed.py (``torchrun --nproc_per_node 2``, gloo on CPU).

    python tests/dist/interrupt_train.py --out DIR --tag NAME [--kill-at STEP] [--resume]
    torchrun --standalone --nproc_per_node 2 tests/dist/interrupt_train.py --out DIR --tag NAME --preset fsdp ...

``--kill-at STEP`` makes rank ``--kill-rank`` send SIGTERM to itself at the end of that step (the other ranks get
no signal: they must stop at the same step all the same). ``--marker-at STEP`` writes ``DIR/TAG.ready`` after
that step and from then on makes every step last ``--slow`` seconds more, so that a signal sent from outside
(to this process, or to torchrun) lands while training runs. Every rank writes ``DIR/TAG.rank<R>.json``: the
logged losses, where it stopped, the interrupt feature's report entry and the exit status it leaves with.
With ``--uncaught`` (one process) ``TrainingInterrupted`` is not caught: the interpreter exits as a user's
script would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from dist_common import GLOBAL_BATCH, MODEL, this_rank, world_size  # first: this checkout importable, the environment


def build_trainer(ns, out_dir: Path):
    from transformers import TrainerCallback, TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset, tiny_llama

    class Signals(TrainerCallback):
        """The test's hand on the run: a self-sent SIGTERM at one step, or a marker and slower steps."""

        def on_step_end(self, args, state, control, **kwargs):
            if ns.kill_at == state.global_step and this_rank() == ns.kill_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            if ns.marker_at is not None and state.global_step >= ns.marker_at:
                if state.global_step == ns.marker_at and this_rank() == 0:
                    (Path(ns.out) / f"{ns.tag}.ready").write_text(str(os.getpid()))
                time.sleep(ns.slow)

    tok = char_tokenizer()
    ds = make_dataset(tok, n=256, seed=0, pack_to=64)
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=GLOBAL_BATCH // world_size(),
                             max_steps=ns.max_steps, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True,
                             hub_token=ns.hub_token)
    # a resumed run starts from other weights: everything it trains with must come from the checkpoint
    model = tiny_llama(seed=1 if ns.resume else 0, **MODEL)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=ds, data_collator=causal_lm_collator(tok),
                             callbacks=[Signals()], speedup=ns.preset)
    trainer.speedup_callback.print_tables = False
    return trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default OUT/TAG)")
    p.add_argument("--preset", default="auto")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--marker-at", type=int, default=None)
    p.add_argument("--slow", type=float, default=0.2)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--uncaught", action="store_true")
    p.add_argument("--hub-token", default=None, help="planted: it must not reach any file")
    p.add_argument("--as-if-nccl", action="store_true",
                   help="make the feature see a non-gloo default group: the ranks agree over a gloo side group")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    from hf_speedup.features.interrupt import TrainingInterrupted, ranks

    if ns.as_if_nccl:
        ranks.default_backend = lambda: "nccl"  # where _RankAgreement.create looks it up

    trainer = build_trainer(ns, Path(ns.output_dir or out / ns.tag))
    res: dict = {"rank": this_rank(), "world_size": world_size(), "exit_status": 0}

    def record() -> None:
        res["losses"] = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        res["global_step"] = trainer.state.global_step
        res["interrupt"] = trainer.speedup_status["interrupt"].to_dict()
        res["sigterm_after"] = str(signal.getsignal(signal.SIGTERM))
        (out / f"{ns.tag}.rank{this_rank()}.json").write_text(json.dumps(res, indent=1, default=str))

    try:
        trainer.train(resume_from_checkpoint=True if ns.resume else None)
    except TrainingInterrupted as exc:
        res.update(exit_status=exc.code, stopped_step=exc.step, checkpoint=exc.checkpoint, message=str(exc))
        if ns.uncaught:
            record()
            raise
    record()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return res["exit_status"]


if __name__ == "__main__":
    status = main()
    # results are on disk and the group is destroyed: skip interpreter teardown, where torch's gloo backend
    # can still abort a finished process now and then (SIGABRT, "terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
