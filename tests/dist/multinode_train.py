"""A run on several "nodes": torchrun (or accelerate launch) launchers on localhost, gloo on CPU processes.
Driven by tests/test_multinode.py and, through examples/slurm/train.sbatch, tests/test_slurm.py.

    torchrun --nnodes 2 --nproc_per_node 2 --node_rank N --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \
        tests/dist/multinode_train.py --out DIR --tag NAME [options]
    python tests/dist/multinode_train.py --out DIR --tag NAME --resume PATH     (one process)

Every rank writes ``DIR/TAG.rank<R>.json``: what it saw on the live objects (mesh, placements, bytes, the fsdp
report entry), the launcher's environment, the losses and how it stopped. ``--dump-state`` makes rank 0 write the
full (gathered) model, optimizer and scheduler state as ``DIR/TAG.saved-<step>.pt`` after each checkpoint and as
``DIR/TAG.loaded-<step>.pt`` right after a resume loaded one, so a test can compare the two bit for bit across
world sizes. ``--crash-at STEP --crash-rank R`` makes rank R SIGKILL itself at the end of that step, in the first
attempt only (torch elastic restarts the group), never inside a save. ``--kill-where REGEX --kill-rank R``
makes rank R SIGKILL itself inside the first write into output_dir whose path matches REGEX, with half of its bytes
on disk (tests/dist/kill_train.py's ``Writes``). ``--marker-at``/``--slow`` as in interrupt_train.py:
``DIR/TAG.ready`` after that step, slower steps from then on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_train as F  # noqa: E402  (the tiny model, the data, the arguments of the FSDP runs)
from dist_common import this_rank, world_size  # noqa: E402

STATE_KEYS = ("model", "optimizer", "scheduler")


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def full_state(trainer) -> dict | None:
    """The whole training state, gathered (collective under FSDP): rank 0 gets it, the others None."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from hf_speedup import compat

    model = trainer.model
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=options),
             "optimizer": get_optimizer_state_dict(model, compat.unwrap_optimizer(trainer.optimizer), options=options),
             "scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else {}}
    if this_rank() != 0:
        return None
    return torch.utils._pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, state)


def build_trainer(ns, out: Path):
    from transformers import TrainerCallback

    from hf_speedup import get_preset

    holder: dict = {}

    class Hands(TrainerCallback):
        """The test's hands on the run: state dumps, a marker and slower steps, a SIGKILL."""

        def __init__(self):
            self.loaded_dumped = False

        def on_step_begin(self, args, state, control, **kwargs):
            resumed = holder["trainer"].speedup_resumed_from
            if ns.dump_state and resumed and not self.loaded_dumped:
                self.loaded_dumped = True
                _dump(holder["trainer"], out / f"{ns.tag}.loaded-{state.global_step}.pt")

        def on_save(self, args, state, control, **kwargs):
            if ns.dump_state:
                _dump(holder["trainer"], out / f"{ns.tag}.saved-{state.global_step}.pt")

        def on_step_end(self, args, state, control, **kwargs):
            if ns.crash_at == state.global_step and this_rank() == ns.crash_rank and _attempt() == 0:
                (out / f"{ns.tag}.crashed").write_text(str(state.global_step))
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a node failure: no handler runs
            if ns.marker_at is not None and state.global_step >= ns.marker_at:
                if state.global_step == ns.marker_at and this_rank() == 0:
                    (out / f"{ns.tag}.ready").write_text(str(os.getpid()))
                time.sleep(ns.slow)

    tok, ds = F.data()
    output_dir = Path(ns.output_dir) if ns.output_dir else out / ns.tag
    args = F.make_args(output_dir, F.GLOBAL_BATCH // world_size(), max_steps=ns.max_steps, save_steps=ns.save_steps)
    config = get_preset("fsdp").replace(fsdp={"strategy": ns.strategy})
    # each rank (and a resumed run) starts from other weights: what it trains with comes from rank 0 or a checkpoint
    model = F.build(seed=this_rank() + (10 if _resume(ns, output_dir) else 0))
    trainer = F.trainer_for(model, args, config, tok, ds)
    trainer.add_callback(Hands())
    trainer.speedup_callback.print_tables = False
    holder["trainer"] = trainer
    return trainer


def _resume(ns, output_dir) -> str | bool | None:
    """``--resume``: a path, or ``auto``: True (the newest checkpoint) where output_dir holds one, as a requeued job
    resumes, else None (a fresh start)."""
    if ns.resume != "auto":
        return None if ns.resume == "no" else ns.resume
    from transformers.trainer_utils import get_last_checkpoint

    return True if os.path.isdir(output_dir) and get_last_checkpoint(str(output_dir)) else None


def _dump(trainer, path: Path) -> None:
    import torch

    state = full_state(trainer)
    if state is not None:
        torch.save(state, path)


def _mesh_facts(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    w = trainer.model.get_input_embeddings().weight
    if not isinstance(w, DTensor):
        return {"mesh": None}
    mesh = w.device_mesh
    return {"mesh": mesh.mesh.tolist(), "mesh_dim_names": list(mesh.mesh_dim_names or ()),
            "embed_placements": str(tuple(w.placements)), "embed_local_shape": list(w.to_local().shape)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default OUT/TAG)")
    p.add_argument("--strategy", default="hybrid_shard")
    p.add_argument("--max-steps", type=int, default=F.STEPS)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--resume", default="no", help="no | auto (the newest checkpoint in output_dir) | a checkpoint")
    p.add_argument("--dump-state", action="store_true")
    p.add_argument("--final-save", action="store_true", help="save_model() at the end; rank 0 reloads it")
    p.add_argument("--marker-at", type=int, default=None)
    p.add_argument("--slow", type=float, default=1.0)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--kill-where", default=None, help="SIGKILL inside the first write whose path matches REGEX")
    p.add_argument("--kill-rank", type=int, default=3)
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    from hf_speedup.features.fsdp.summary import sharding_summary
    from hf_speedup.features.interrupt import TrainingInterrupted

    trainer = build_trainer(ns, out)
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                          "TORCHELASTIC_RESTART_COUNT", "TEST_NODE", "SLURM_NODEID", "SLURM_PROCID")}
    res: dict = {"rank": this_rank(), "env": env, "exit_status": 0}
    resume = _resume(ns, trainer.args.output_dir)
    if ns.kill_where and this_rank() == ns.kill_rank:
        from kill_train import Writes

        Writes(trainer.args.output_dir, kill_where=ns.kill_where).install()
    try:
        trainer.train(resume_from_checkpoint=resume)
    except TrainingInterrupted as exc:
        res.update(exit_status=exc.code, stopped_step=exc.step, checkpoint=exc.checkpoint)
    res.update(losses=F.losses(trainer), global_step=trainer.state.global_step,
               resumed_from=trainer.speedup_resumed_from, summary=sharding_summary(trainer.model),
               fsdp=trainer.speedup_status["fsdp"].to_dict(), interrupt=trainer.speedup_status["interrupt"].to_dict(),
               **_mesh_facts(trainer))
    if ns.final_save and res["exit_status"] == 0:
        _final_save(trainer, out / f"{ns.tag}.final", res)
    (out / f"{ns.tag}.rank{this_rank()}.json").write_text(json.dumps(res, indent=1, default=str))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return res["exit_status"]


def _final_save(trainer, path: Path, res: dict) -> None:
    """``save_model()`` gathers the full model (every rank joins); rank 0 loads it back with ``from_pretrained``."""
    import torch

    trainer.save_model(str(path))
    state = full_state(trainer)
    if state is None:
        return
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    res["final_saved_equal"] = sorted(saved) == sorted(state["model"]) and all(
        torch.equal(saved[k], state["model"][k]) for k in saved)
    res["final_saved_files"] = sorted(os.listdir(path))


if __name__ == "__main__":
    status = main()
    # results are on disk and the group is destroyed: skip interpreter teardown (see fsdp_train.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
