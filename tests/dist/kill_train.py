"""A training run killed with SIGKILL inside one file write of a checkpoint, then resumed; driven by
tests/test_crash_safe.py, tests/test_crash_safe_distributed.py and benchmarks/kill_trials.py.

    python tests/dist/kill_train.py --out DIR --tag NAME [--preset P] [--kill-at K | --kill-where REGEX] [--resume]
    python tests/dist/kill_train.py --sweep --out DIR --presets baseline,auto --save-step 4
    torchrun --standalone --nproc_per_node 2 tests/dist/kill_train.py --preset fsdp --kill-rank 1 ...

The run: the tiny Llama, ``save_steps=2``, ``save_total_limit=2``, 8 steps (checkpoints 2, 4, 6, 8; the save
of step 6 rotates checkpoint-2 away). ``--sigterm-at STEP`` sends SIGTERM to the process at the end of that
step (the interrupt feature then saves ``checkpoint-STEP``). Every write into ``output_dir`` is counted
(``torch.save``, safetensors' ``save_file``, ``open`` for writing, ``os.rename``/``os.replace``,
``shutil.rmtree``); at the K-th (or the first whose path relative to ``output_dir`` matches REGEX) the process
writes half of the bytes (removes half of the files, for ``rmtree``; nothing, for a rename) and sends itself
SIGKILL. ``--resume`` resumes as a requeued job does: ``train(resume_from_checkpoint=True)`` when
``get_last_checkpoint(output_dir)`` finds a checkpoint, else from scratch. Every rank writes
``DIR/TAG.rank<R>.json``: losses, a digest of the final weights, the ``crash_safe`` report entry, the
writes it counted, or the exception a resume died of.

``--sweep`` imports torch and transformers once and forks one process per run (each a fresh training process,
so a SIGKILL ends a real run): an uninterrupted run per preset that records its writes, then for each kill
point a run killed there and a resume of its output folder. ``--points``: ``all`` (every write of the save of
``--save-step`` and of the rotation after it), ``named`` (one write per kind of file), ``sigterm`` (inside the
interrupt feature's checkpoint); ``--random-kills N`` adds N runs SIGKILLed from outside after a random delay,
as a scheduler or the OOM killer does. ``DIR/sweep.json`` lists each kill point with how the resume ended.
"""

from __future__ import annotations

import argparse
import builtins
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from dist_common import GLOBAL_BATCH, MODEL, this_rank, world_size  # first: this checkout importable, the environment

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per run: the sweep forks many

PRESETS = {  # name -> speedup=; fast keeps compile.when: pays_back, which declines on a 6-step run
    "baseline": "baseline", "auto": "auto", "lora": "lora", "fast": "fast", "fsdp": "fsdp",
    "fast-eager": {"base": "fast", "compile": {"backend": "eager", "when": "always"}},
}


# ------------------------------------------------------------------------------------------ the kill
class Writes:
    """Counts the writes into ``root``; kills this process inside the one it was told to (see the docstring)."""

    def __init__(self, root: str, kill_at: int | None = None, kill_where: str | None = None):
        self.root = os.path.abspath(root) + os.sep
        self.kill_at = kill_at
        self.kill_where = re.compile(kill_where) if kill_where else None
        self.log: list[list] = []  # [index, kind, path relative to root]
        self.threads: list[str] = []  # the thread of each write (a background save writes on its own thread)
        self.saved: dict = {}

    def _rel(self, path) -> str | None:
        if isinstance(path, (str, os.PathLike)):
            full = os.path.abspath(os.fspath(path))
            if full.startswith(self.root):
                return full[len(self.root):]
        return None

    def _due(self, kind: str, rel: str) -> bool:
        self.log.append([len(self.log) + 1, kind, rel])
        self.threads.append(threading.current_thread().name)
        if self.kill_at is not None:
            return len(self.log) == self.kill_at
        return self.kill_where is not None and self.kill_where.search(rel) is not None

    @staticmethod
    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached

    def _half(self, path, data: bytes) -> None:
        with self.saved["open"](path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        self.die()

    def install(self) -> None:
        import safetensors.torch
        import torch

        s = self.saved
        s.update(torch_save=torch.save, st_save=safetensors.torch.save_file, open=builtins.open,
                 rename=os.rename, replace=os.replace, rmtree=shutil.rmtree)

        def torch_save(obj, f, *args, **kwargs):
            rel = self._rel(f)
            if rel is not None and self._due("torch.save", rel):
                buf = io.BytesIO()
                s["torch_save"](obj, buf, *args, **kwargs)
                self._half(f, buf.getvalue())
            return s["torch_save"](obj, f, *args, **kwargs)

        def save_file(tensors, filename, metadata=None):
            rel = self._rel(filename)
            if rel is not None and self._due("safetensors", rel):
                self._half(filename, safetensors.torch.save(tensors, metadata=metadata))
            return s["st_save"](tensors, filename, metadata=metadata)

        def open_(file, mode="r", *args, **kwargs):
            rel = self._rel(file) if any(c in mode for c in "wxa") else None
            f = s["open"](file, mode, *args, **kwargs)
            if rel is not None and self._due("open", rel):
                return _HalfWriter(f, self)
            return f

        def renamer(name):
            def rename(src, dst, *args, **kwargs):
                rel = self._rel(src)
                if rel is not None and self._due(name, rel):
                    self.die()
                return s[name](src, dst, *args, **kwargs)
            return rename

        def rmtree(path, *args, **kwargs):
            rel = self._rel(path)
            if rel is not None and self._due("rmtree", rel):
                files = sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
                for p in files[: (len(files) + 1) // 2]:
                    os.remove(p)
                self.die()
            return s["rmtree"](path, *args, **kwargs)

        torch.save = torch_save
        safetensors.torch.save_file = save_file
        for module in ("transformers.modeling_utils", "peft.peft_model"):
            mod = sys.modules.get(module)
            if mod is not None and hasattr(mod, "safe_save_file"):
                mod.safe_save_file = save_file
        builtins.open = io.open = open_
        os.rename, os.replace, shutil.rmtree = renamer("rename"), renamer("replace"), rmtree

    def uninstall(self) -> None:
        import safetensors.torch
        import torch

        s = self.saved
        torch.save, safetensors.torch.save_file = s["torch_save"], s["st_save"]
        for module in ("transformers.modeling_utils", "peft.peft_model"):
            mod = sys.modules.get(module)
            if mod is not None and hasattr(mod, "safe_save_file"):
                mod.safe_save_file = s["st_save"]
        builtins.open = io.open = s["open"]
        os.rename, os.replace, shutil.rmtree = s["rename"], s["replace"], s["rmtree"]


class _HalfWriter:
    """A file opened for writing whose first ``write`` stores half of its data, then SIGKILL."""

    def __init__(self, f, writes: Writes):
        self._f, self._writes = f, writes

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        self._writes.die()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


# ------------------------------------------------------------------------------------------ the run
def _speedup(ns):
    """The preset, with background saves forced on (``--async-save``: several processes share the cores, where
    ``auto`` saves synchronously)."""
    preset = PRESETS.get(ns.preset, ns.preset)
    return {"base": preset, "crash_safe": {"asynchronous": True}} if ns.async_save else preset


def build_trainer(ns, out_dir: Path, from_checkpoint: bool = False):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset, tiny_llama

    class Sigterm(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == ns.sigterm_at and this_rank() == ns.kill_rank:
                os.kill(os.getpid(), signal.SIGTERM)

    tok = char_tokenizer()
    ds = make_dataset(tok, n=256, seed=0, pack_to=64)
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=GLOBAL_BATCH // world_size(),
                             max_steps=ns.max_steps, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
                             save_strategy="steps", save_steps=ns.save_steps, save_total_limit=ns.save_total_limit,
                             seed=0, dataloader_num_workers=0, disable_tqdm=True, deepspeed=ns.deepspeed)
    # a resumed run starts from other weights (LoRA: the same base, other adapters): they must come from the
    # checkpoint; a requeued job that finds no checkpoint starts afresh, as the first run did
    lora = "lora" in ns.preset
    model = tiny_llama(seed=1 if from_checkpoint and not lora else 0, **MODEL)
    if ns.trainer == "stock":
        return Trainer(model=model, args=args, train_dataset=ds, data_collator=causal_lm_collator(tok),
                       callbacks=[Sigterm()])
    from hf_speedup import SpeedupTrainer

    trainer = SpeedupTrainer(model=model, args=args, train_dataset=ds, data_collator=causal_lm_collator(tok),
                             callbacks=[Sigterm()], speedup=_speedup(ns))
    trainer.speedup_callback.print_tables = False
    return trainer


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        full = getattr(t, "full_tensor", None)  # a DTensor (FSDP): every rank digests the whole tensor
        t = (full() if full is not None else t).detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def run(ns) -> int:
    """One training run (a torchrun rank, or a process the sweep forked); writes its result file."""
    from transformers.trainer_utils import get_last_checkpoint

    out = Path(ns.out)
    out_dir = Path(ns.output_dir or out / ns.tag)
    res: dict = {"rank": this_rank(), "tag": ns.tag, "preset": ns.preset, "trainer": ns.trainer, "error": None}
    writes = Writes(str(out_dir), ns.kill_at if this_rank() == ns.kill_rank else None,
                    ns.kill_where if this_rank() == ns.kill_rank else None)
    trainer = None
    try:
        resume = None
        if ns.resume and out_dir.is_dir() and get_last_checkpoint(str(out_dir)) is not None:
            resume = True
        res["resume_asked"] = resume
        trainer = build_trainer(ns, out_dir, from_checkpoint=bool(resume))
        if ns.kill_at is not None or ns.kill_where or ns.record:
            writes.install()
        try:
            trainer.train(resume_from_checkpoint=resume)
        except SystemExit as exc:  # the interrupt feature's TrainingInterrupted
            res["exit_status"] = exc.code
        if writes.saved:
            writes.uninstall()
        res["digest"] = weights_digest(trainer.model)
    except Exception as exc:  # a resume that fails: what the requeued job would die of
        if writes.saved:
            writes.uninstall()
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    if trainer is not None:
        res["losses"] = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        res["global_step"] = trainer.state.global_step
    res["writes"] = writes.log
    res["write_threads"] = writes.threads
    status = getattr(trainer, "speedup_status", None)
    if status is not None and "crash_safe" in status:
        res["crash_safe"] = status["crash_safe"].to_dict()
    res["files"] = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")) if out_dir.is_dir() else []
    (out / f"{ns.tag}.rank{this_rank()}.json").write_text(json.dumps(res, indent=1, default=str))
    import torch.distributed as dist

    if dist.is_initialized() and not res["error"]:
        dist.barrier()
        dist.destroy_process_group()
    return 1 if res["error"] else 0


# ------------------------------------------------------------------------------------------ the sweep
def _fork(ns, kill_after: float | None = None) -> int:
    """Runs ``run(ns)`` in a forked child (SIGKILLed after ``kill_after`` seconds if given); its wait status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = run(ns)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    if kill_after is not None:
        deadline = time.monotonic() + kill_after
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def _incomplete(folder: Path) -> list[str]:
    """What a kill left that a resume must not pick: staging folders, checkpoint-N without a readable state."""
    out = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if re.match(r"^_checkpoint-\d+\.staging$", p.name):
            out.append(p.name)
        elif re.match(r"^checkpoint-\d+$", p.name):
            try:
                json.loads((p / "trainer_state.json").read_text())
            except (OSError, ValueError):
                out.append(p.name)
    return out


def _read(out: Path, tag: str) -> dict:
    path = out / f"{tag}.rank0.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _kill_points(writes: list, save_step: int, save_steps: int) -> list[list]:
    """The writes of the save of ``save_step`` (up to the first write of the next save) and of the rotation
    the next save makes (the checkpoint ``save_total_limit`` drops)."""
    here = re.compile(rf"(^|[/_])checkpoint-{save_step}(\D|$)")
    nxt = re.compile(rf"(^|[/_])checkpoint-{save_step + save_steps}(\D|$)")
    dropped = re.compile(rf"(^|[/_])checkpoint-{save_step - save_steps}(\D|$)")
    first = next(i for i, w in enumerate(writes) if here.search(w[2]))
    end = next((i for i, w in enumerate(writes) if i > first and nxt.search(w[2])), len(writes))
    window = writes[first:end]
    rotation = [w for w in writes[end:] if w[1] in ("rename", "rmtree", "replace") and dropped.search(w[2])]
    return window + rotation


NAMED = {  # one kill point per kind of file a checkpoint holds, and per step of the commit and the rotation
    "model": r"(model\.safetensors|adapter_model\.safetensors|pytorch_model_fsdp)",
    "optimizer": r"(optimizer\.pt|optimizer_0)", "scheduler": r"scheduler\.pt", "rng": r"rng_state",
    "trainer_state": r"trainer_state\.json", "commit": r"^_checkpoint-\d+\.staging/checkpoint-\d+$",
    "rotation_rename": r"^checkpoint-\d+$", "rotation_delete": r"^(_checkpoint-\d+\.deleting|checkpoint-\d+)$",
}


def _named(points: list[list]) -> list[list]:
    """The first write of each kind in ``NAMED`` (renames and deletions by what they do)."""
    out = []
    for kind, pattern in NAMED.items():
        for w in points:
            wanted = {"commit": ("rename",), "rotation_rename": ("rename",), "rotation_delete": ("rmtree",)}.get(
                kind, ("torch.save", "safetensors", "open"))
            if w[1] in wanted and re.search(pattern, w[2]) and w not in out:
                out.append(w)
                break
    return out


def sweep(ns) -> int:
    import peft  # noqa: F401  (imported once, before the forks: each run pays only for its training)
    from transformers import LlamaForCausalLM, Trainer  # noqa: F401

    from hf_speedup import SpeedupTrainer, plan_for  # noqa: F401
    from hf_speedup.tiny import tiny_llama

    import gc

    plan_for("baseline", model=tiny_llama(seed=0, **MODEL))  # transformers' lazy modules, loaded once
    gc.freeze()  # what is loaded now is never collected in the runs (the Trainer's gc.collect stays short)

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    rng = random.Random(ns.seed)
    for preset in ns.presets.split(","):
        base = argparse.Namespace(**{**vars(ns), "preset": preset, "kill_at": None, "kill_where": None, "resume": False, "sigterm_at": None,
                                     "output_dir": None, "record": True})
        full_tag = f"{preset}-{ns.trainer}-full"
        started = time.monotonic()
        _fork(argparse.Namespace(**{**vars(base), "tag": full_tag}))
        duration = time.monotonic() - started  # random kills land within an uninterrupted run's length
        full = _read(out, full_tag)
        if full.get("error") or "digest" not in full:
            rows.append({"preset": preset, "point": "uninterrupted", "error": full.get("error", "no result")})
            continue
        kinds = set(ns.points.split(","))
        writes = _kill_points(full["writes"], ns.save_step, ns.save_steps)
        points = [(f"w{w[0]}", w, None) for w in writes] if "all" in kinds else []
        points += [(f"w{w[0]}", w, None) for w in _named(writes)] if "named" in kinds else []
        points += [("sigterm", None, None)] if "sigterm" in kinds and ns.sigterm_at else []
        points += [(f"t{i}", None, rng.uniform(ns.min_delay, ns.max_delay or duration))
                   for i in range(ns.random_kills)]
        for name, write, delay in points:
            tag = f"{preset}-{ns.trainer}-{name}"
            target = out / tag
            shutil.rmtree(target, ignore_errors=True)
            killed = argparse.Namespace(**{**vars(base), "tag": tag + "-killed", "output_dir": str(target),
                                           "record": False, "kill_at": write[0] if write else None})
            if name == "sigterm":  # SIGTERM at the end of a step, SIGKILL inside the interrupt feature's save
                killed.sigterm_at, killed.kill_where = ns.sigterm_at, rf"checkpoint-{ns.sigterm_at}/optimizer"
            status = _fork(killed, kill_after=delay)
            killed_by = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            left = sorted(str(p.relative_to(target)) for p in target.rglob("*")) if target.is_dir() else []
            incomplete = _incomplete(target)
            resumed_tag = tag + "-resumed"
            _fork(argparse.Namespace(**{**vars(base), "tag": resumed_tag, "output_dir": str(target), "record": False,
                                        "resume": True}))
            res = _read(out, resumed_tag)
            entry = (res.get("crash_safe") or {}).get("settings", {})
            rows.append({
                "preset": preset, "trainer": ns.trainer, "point": name,
                "write": write, "delay_s": round(delay, 3) if delay else None,
                "thread": full["write_threads"][write[0] - 1] if write else None,
                "killed_by": signal.Signals(killed_by).name if killed_by else None,
                "left_on_disk": left[:200],
                "incomplete_left": incomplete,
                "resume_asked": res.get("resume_asked"),
                "resumed_from": entry.get("resumed_from"),
                "set_aside": entry.get("set_aside"),
                "error": res.get("error", "no result"),
                "same_weights": res.get("digest") == full["digest"],
                "same_losses": res.get("losses") == full["losses"],
                "after_resume": sorted({f.split("/")[0] for f in res.get("files", [])}),
                "uninterrupted": sorted({f.split("/")[0] for f in full.get("files", [])}),
            })
            if not ns.keep:
                shutil.rmtree(target, ignore_errors=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="run")
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default OUT/TAG)")
    p.add_argument("--trainer", choices=("speedup", "stock"), default="speedup")
    p.add_argument("--preset", default="baseline")
    p.add_argument("--async-save", action="store_true", help="crash_safe.asynchronous: true on top of the preset")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL inside the K-th write into output_dir")
    p.add_argument("--kill-where", default=None, help="SIGKILL inside the first write whose path matches REGEX")
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed config: train under it (its per-rank checkpoints)")
    p.add_argument("--record", action="store_true", help="count the writes (no kill)")
    p.add_argument("--sigterm-at", type=int, default=None, help="SIGTERM to itself at the end of this step")
    p.add_argument("--points", default="all",
                   help="sweep, comma-separated: all (every write of the save and the rotation), named (one per kind "
                        "of file), sigterm (SIGKILL inside the checkpoint the interrupt feature makes on --sigterm-at)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--presets", default="baseline")
    p.add_argument("--save-step", type=int, default=4, help="sweep: kill inside each write of this step's save")
    p.add_argument("--random-kills", type=int, default=0, help="sweep: also N kills after random delays")
    p.add_argument("--min-delay", type=float, default=0.5)
    p.add_argument("--max-delay", type=float, default=None, help="default: the uninterrupted run's duration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="sweep: keep each point's output folder")
    ns = p.parse_args(argv)
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    return sweep(ns) if ns.sweep else run(ns)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip interpreter teardown (see tests/dist/interrupt_train.py)
