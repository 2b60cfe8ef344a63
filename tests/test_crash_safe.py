"""Crash-safe checkpoints: a kill or a full disk at any moment of a save never leaves a checkpoint that resume
picks and fails on; resume takes the newest complete checkpoint and sets incomplete ones aside (reported).

The kill tests run tests/dist/kill_train.py: one process imports torch once and forks a fresh training run per
kill point, which sends itself SIGKILL inside one write (half the bytes on disk); another run then resumes its
output folder as a requeued job does and must end with the uninterrupted run's weights and losses, bit for bit.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainerCallback

from distributed_helpers import launch_env
from hf_speedup import SpeedupTrainer
from hf_speedup.features.crash_safe import CrashSafeMixin, files, resolve_resume
from hf_speedup.tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "kill_train.py"
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
SAVES = dict(save_strategy="steps", save_steps=2, save_total_limit=2, learning_rate=1e-3)


def _sweep(out: Path, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--sweep", "--out", str(out), *args], cwd=ROOT,
                          env=launch_env(), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / "sweep.json").read_text())


def _check_sweep(rows: list[dict]) -> None:
    """Every kill point: really SIGKILLed, resumed without an error from the checkpoint complete at that moment,
    ended equal to the uninterrupted run; what an unfinished save left was set aside, not resumed from."""
    assert rows and not [r for r in rows if r["point"] == "uninterrupted"], rows
    for r in rows:
        where = f"{r['preset']} {r['point']} {r['write']}"
        assert r["killed_by"] == "SIGKILL", where
        assert r["error"] is None, f"{where}: {r['error']}"
        assert r["same_weights"] and r["same_losses"], where
        kind, path = (r["write"] or [None, None, "checkpoint-3"])[1:]
        if path.startswith("_checkpoint-") and ".staging" in path or r["point"] == "sigterm":
            # killed before the rename: the checkpoint being written never became checkpoint-N
            assert Path(r["resumed_from"]).name == "checkpoint-2", where
            assert len(r["set_aside"]) == 1, where
            moved = Path(r["set_aside"][0]["moved_to"])
            assert moved.parent.name == files.INCOMPLETE_DIR and moved.name.startswith(
                "checkpoint-3." if r["point"] == "sigterm" else "checkpoint-4."), where
        else:  # after the rename (the report's files, the rotation at step 6): the newest checkpoint is complete
            assert Path(r["resumed_from"]).name in ("checkpoint-4", "checkpoint-6"), where
            assert not r["set_aside"], where
        # after the resume: the uninterrupted run's folders, no staging or half-deleted leftovers (a hidden file:
        # the report's temporary file, when the kill came inside its write)
        assert [p for p in r["after_resume"] if p != files.INCOMPLETE_DIR and not p.startswith(".")] == [
            p for p in r["uninterrupted"] if not p.startswith(".")], where


def test_a_sigkill_inside_any_write_of_a_save_or_rotation_resumes_to_the_uninterrupted_run(tmp_path):
    """``baseline`` (the stock Trainer's numerics): every write of the save of step 4 (config, weights, training
    args, optimizer, scheduler, RNG state, trainer state, the rename, the report's files) and of the rotation
    at step 6 (the rename away, the deletion)."""
    rows = _sweep(tmp_path, "--presets", "baseline", "--points", "all")
    names = {(r["write"][1], Path(r["write"][2]).name) for r in rows}
    for wanted in [("safetensors", "model.safetensors"), ("torch.save", "optimizer.pt"), ("torch.save", "scheduler.pt"),
                   ("torch.save", "rng_state.pth"), ("open", "trainer_state.json"), ("open", "config.json"),
                   ("rename", "checkpoint-4"), ("rename", "checkpoint-2"), ("rmtree", "_checkpoint-2.deleting")]:
        assert wanted in names, (wanted, sorted(names))
    _check_sweep(rows)


@pytest.mark.slow
def test_a_sigkill_inside_each_kind_of_write_resumes_under_the_other_presets(tmp_path):
    """``auto``, ``lora`` (adapter files) and ``fast``: the model, optimizer, scheduler, RNG and trainer-state
    writes, the rename, the rotation; and a SIGKILL inside the checkpoint the interrupt feature makes on SIGTERM.
    Their saves are asynchronous: a SIGKILL inside the writer thread's files leaves no checkpoint resume picks."""
    rows = _sweep(tmp_path, "--presets", "auto,lora,fast", "--points", "named,sigterm", "--sigterm-at", "3")
    assert {r["preset"] for r in rows} == {"auto", "lora", "fast"}
    assert len([r for r in rows if r["point"] == "sigterm"]) == 3
    assert any(r["write"] and r["write"][2].endswith("adapter_model.safetensors") for r in rows if r["preset"] == "lora")
    # these presets save in the background: the kills inside tensor files and the rename hit the writer thread
    background = {(r["preset"], r["write"][1]) for r in rows
                  if r["write"] and r["thread"].startswith("hf_speedup-save")}
    assert {("auto", "torch.save"), ("auto", "rename"), ("lora", "safetensors"), ("fast", "torch.save")} <= background
    _check_sweep(rows)


# ------------------------------------------------------------------------------------------ in one process
def _trainer(out: Path, make_args, dataset, collator, speedup="baseline", seed=0, max_steps=6, stock=False,
             callbacks=(), eval_dataset=None, **kw):
    args = make_args(output_dir=str(out), max_steps=max_steps, **{**SAVES, **kw})
    model = tiny_llama(seed=seed, **SMALL)
    common = dict(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset, data_collator=collator,
                  callbacks=list(callbacks))
    if stock:
        return Trainer(**common)
    trainer = SpeedupTrainer(**common, speedup=speedup)
    trainer.speedup_callback.print_tables = False
    return trainer


def _losses(trainer) -> dict:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def _same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def reference(tmp_path, make_args, dataset, collator):
    trainer = _trainer(tmp_path / "reference", make_args, dataset, collator)
    trainer.train()
    return trainer


@pytest.fixture
def full_disk(monkeypatch):
    """torch.save fails with ENOSPC on checkpoint-4's optimizer.pt; ``undo()`` frees the disk again."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith(os.path.join("checkpoint-4", "optimizer.pt")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return SimpleNamespace(undo=lambda: monkeypatch.setattr(torch, "save", real_save))


def test_a_full_disk_during_a_save_frees_the_staging_folder_and_the_next_resume_works(
        tmp_path, make_args, dataset, collator, reference, full_disk):
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left on device"):
        _trainer(out, make_args, dataset, collator).train()
    full_disk.undo()
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]  # staging removed
    resumed = _trainer(out, make_args, dataset, collator, seed=1)
    resumed.train(resume_from_checkpoint=True)
    assert Path(resumed.speedup_status["crash_safe"].facts["resumed_from"]).name == "checkpoint-2"
    assert _losses(resumed) == _losses(reference) and _same_weights(resumed, reference)


def test_off_writes_in_place_as_the_stock_trainer_does(tmp_path, make_args, dataset, collator, full_disk):
    """``crash_safe.enabled: false``: the same full disk leaves a half-written checkpoint-4 behind."""
    trainer = _trainer(tmp_path, make_args, dataset, collator,
                       speedup={"base": "baseline", "crash_safe": {"enabled": False}})
    assert trainer.speedup_status["crash_safe"].to_dict()["engaged"] is False
    with pytest.raises(OSError, match="No space left on device"):
        trainer.train()
    assert files.problem(str(tmp_path / "checkpoint-4")).startswith("trainer_state.json is missing")


@pytest.mark.parametrize("crash_safe", [True, False])
def test_the_reports_counters_are_in_the_checkpoint_before_it_is_in_place(
        tmp_path, make_args, dataset, collator, monkeypatch, crash_safe):
    """A kill right after the rename must not leave a checkpoint-N without hf_speedup_state.json (its resume
    would restart the report's counts): under crash_safe it is written into the staging folder, once; without
    crash_safe the collector writes it into the Trainer's folder at on_save, as before."""
    from hf_speedup.report.carry import STATE_FILE

    seen, real_commit = {}, files.commit

    def commit(root, name, run_dir):
        seen[name] = (Path(root) / name / STATE_FILE).is_file()
        return real_commit(root, name, run_dir)

    monkeypatch.setattr(files, "commit", commit)
    trainer = _trainer(tmp_path, make_args, dataset, collator,
                       speedup={"base": "baseline", "report": {"path": "auto"}, "crash_safe": {"enabled": crash_safe}})
    writes = []
    real_carry = trainer.speedup_callback.carry_into
    monkeypatch.setattr(trainer.speedup_callback, "carry_into", lambda ckpt: (writes.append(Path(ckpt)),
                                                                               real_carry(ckpt))[1])
    trainer.train()
    if crash_safe:
        assert seen == {"checkpoint-2": True, "checkpoint-4": True, "checkpoint-6": True}
        assert [p.relative_to(tmp_path).parts[0] for p in writes] == [
            "_checkpoint-2.staging", "_checkpoint-4.staging", "_checkpoint-6.staging"]
    else:
        assert seen == {} and writes == [tmp_path / f"checkpoint-{n}" for n in (2, 4, 6)]
    carried = json.loads((tmp_path / "checkpoint-6" / STATE_FILE).read_text())
    assert carried["global_step"] == 6 and carried["steps"] == 6


def test_a_broken_checkpoint_the_stock_trainer_left_is_set_aside_and_reported(
        tmp_path, make_args, dataset, collator, reference, caplog):
    """The stock Trainer killed while writing trainer_state.json of its last checkpoint (truncated JSON):
    ``baseline`` resumes from the one before (the stock Trainer dies on JSONDecodeError) and ends as the
    uninterrupted run."""
    out = tmp_path / "run"
    _trainer(out, make_args, dataset, collator, stock=True).train()
    state = out / "checkpoint-6" / "trainer_state.json"
    state.write_text(state.read_text()[:100])
    with pytest.raises(json.JSONDecodeError):
        _trainer(out, make_args, dataset, collator, stock=True).train(resume_from_checkpoint=True)
    resumed = _trainer(out, make_args, dataset, collator, seed=1)
    with caplog.at_level("WARNING", logger="hf_speedup"):
        resumed.train(resume_from_checkpoint=True)
    entry = resumed.speedup_status["crash_safe"].to_dict()
    assert entry["engaged"] is True
    assert Path(entry["settings"]["resumed_from"]).name == "checkpoint-4"
    [moved] = entry["settings"]["set_aside"]
    assert Path(moved["checkpoint"]).name == "checkpoint-6" and "trainer_state.json is unreadable" in moved["reason"]
    assert Path(moved["moved_to"]).parent == out / files.INCOMPLETE_DIR and Path(moved["moved_to"]).is_dir()
    assert "checkpoint-6 is incomplete" in caplog.text and files.INCOMPLETE_DIR in caplog.text
    report = resumed.speedup_report.to_dict()  # baseline keeps its report in memory (no file in output_dir)
    assert report["plan"]["crash_safe"]["settings"]["set_aside"] == entry["settings"]["set_aside"]
    assert _losses(resumed) == _losses(reference) and _same_weights(resumed, reference)


@pytest.fixture(scope="module")
def complete_checkpoint(tmp_path_factory, dataset, tokenizer):
    """One complete checkpoint written by the stock Trainer (every break below starts from a copy of it)."""
    from transformers import TrainingArguments

    from hf_speedup.tiny import causal_lm_collator

    out = tmp_path_factory.mktemp("complete")
    args = TrainingArguments(output_dir=str(out), max_steps=1, save_strategy="steps", save_steps=1, report_to=[],
                             use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True)
    Trainer(model=tiny_llama(seed=0, **SMALL), args=args, train_dataset=dataset,
            data_collator=causal_lm_collator(tokenizer)).train()
    return out / "checkpoint-1"


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


BREAKS = {  # how a kill leaves a file -> the reason problem() gives
    "no trainer_state.json": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "truncated trainer_state.json": (lambda c: _truncate(c / "trainer_state.json"),
                                     "trainer_state.json is unreadable (JSONDecodeError"),
    "empty config.json": (lambda c: (c / "config.json").write_bytes(b""), "config.json is empty"),
    "truncated optimizer.pt": (lambda c: _truncate(c / "optimizer.pt"), "optimizer.pt is truncated"),
    "truncated rng_state.pth": (lambda c: _truncate(c / "rng_state.pth", 0.9), "rng_state.pth is truncated"),
    "truncated model.safetensors": (lambda c: _truncate(c / "model.safetensors", 0.9),
                                    "model.safetensors is truncated"),
    "JIT sentinel": (lambda c: (c / files.JIT_SENTINEL).write_text("in progress"),
                     "JIT checkpoint did not finish"),
    "DCP shards without .metadata": (lambda c: ((c / "pytorch_model_fsdp_0").mkdir(),
                                                (c / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"x")),
                                     "pytorch_model_fsdp_0/ holds shards but no .metadata"),
}


def test_a_complete_checkpoint_has_no_problem(complete_checkpoint):
    assert files.problem(str(complete_checkpoint)) is None


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_way_a_kill_breaks_a_checkpoint_is_named(name, complete_checkpoint, tmp_path):
    broken = tmp_path / "checkpoint-1"
    shutil.copytree(complete_checkpoint, broken)
    make_broken, reason = BREAKS[name]
    make_broken(broken)
    assert reason in files.problem(str(broken))


def test_an_explicit_incomplete_checkpoint_falls_back_to_the_newest_complete_earlier_one(
        tmp_path, make_args, dataset, collator, caplog):
    out = tmp_path / "run"
    _trainer(out, make_args, dataset, collator, max_steps=6, save_total_limit=None).train()
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    resumed = _trainer(out, make_args, dataset, collator, max_steps=6, save_total_limit=None)
    with caplog.at_level("WARNING", logger="hf_speedup"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    facts = resumed.speedup_status["crash_safe"].facts
    assert Path(facts["resumed_from"]).name == "checkpoint-2"  # not checkpoint-6: newer than the one asked for
    assert [Path(m["checkpoint"]).name for m in facts["set_aside"]] == ["checkpoint-4"]
    assert "resuming from" in caplog.text and "checkpoint-2" in caplog.text


def test_an_incomplete_folder_of_the_users_naming_is_refused_not_moved(tmp_path, make_args, dataset, collator,
                                                                       complete_checkpoint):
    mine = tmp_path / "my-best-run"
    shutil.copytree(complete_checkpoint, mine)
    (mine / "optimizer.pt").write_bytes(b"")
    trainer = _trainer(tmp_path / "run", make_args, dataset, collator)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint = .*my-best-run.* is incomplete: optimizer.pt is "
                                         r"empty .* fix: pass another checkpoint"):
        trainer.train(resume_from_checkpoint=str(mine))
    assert mine.is_dir()


def test_without_any_complete_checkpoint_resume_names_what_it_set_aside(tmp_path, make_args, dataset, collator):
    out = tmp_path / "run"
    staged = Path(files.staging_root(str(out), 2)) / "checkpoint-2"
    staged.mkdir(parents=True)
    (staged / "config.json").write_text("{")
    trainer = _trainer(out, make_args, dataset, collator)
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory .*set aside into .*"
                                         r"_incomplete_checkpoints.*its save did not finish.*fix: start without "
                                         r"resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    assert [p.name.split(".")[0] for p in (out / files.INCOMPLETE_DIR).iterdir()] == ["checkpoint-2"]
    assert not Path(files.staging_root(str(out), 2)).exists()


def test_rotation_keeps_the_checkpoint_just_written_where_the_stock_order_would_drop_it(
        tmp_path, make_args, dataset, collator):
    """mtimes within a second: the Trainer's rotation orders by step number, so checkpoint-8 (left by an earlier,
    longer run) counts as the most recent and the stock rotation with save_total_limit=1 deletes checkpoint-4,
    just written by a run resumed from checkpoint-2. Ours keeps it (and deletes by renaming first)."""
    from transformers.trainer_utils import rotate_checkpoints

    def layout(root: Path) -> Path:
        for step in (2, 4, 8):
            (root / f"checkpoint-{step}").mkdir(parents=True)
            (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
            os.utime(root / f"checkpoint-{step}", (1_000_000, 1_000_000))
        return root

    stock = layout(tmp_path / "stock")
    rotate_checkpoints(str(stock), save_total_limit=1, use_mtime=True)
    assert sorted(p.name for p in stock.iterdir()) == ["checkpoint-8"]  # the one just written is gone
    ours = layout(tmp_path / "ours")
    trainer = _trainer(ours, make_args, dataset, collator, save_total_limit=1)
    assert isinstance(trainer, CrashSafeMixin)
    trainer._speedup_rotate(str(ours), keep=str(ours / "checkpoint-4"))
    assert sorted(p.name for p in ours.iterdir()) == ["checkpoint-4", "checkpoint-8"]


def test_baseline_leaves_the_stock_trainers_files_and_best_checkpoint(tmp_path, make_args, dataset, collator):
    """Same folders, files and trainer_state.json (best_model_checkpoint: the final path, never the staging one)
    as the stock Trainer, with evaluation, the best checkpoint kept and rotation; the checkpoints load with
    ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    kw = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
              greater_is_better=True, save_total_limit=1, max_steps=6)  # the best is the first checkpoint
    runs = {}
    for name, stock in (("stock", True), ("baseline", False)):
        out = tmp_path / name
        trainer = _trainer(out, make_args, dataset, collator, stock=stock, eval_dataset=dataset.select(range(8)), **kw)
        trainer.train()
        states = {p.parent.name: json.loads(p.read_text()) for p in out.glob("checkpoint-*/trainer_state.json")}
        listing = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                         if p.name not in ("speedup_report.json", "hf_speedup_state.json"))
        runs[name] = (trainer, listing, states)
    (stock, stock_files, stock_states), (ours, our_files, our_states) = runs["stock"], runs["baseline"]
    assert our_files == stock_files
    assert Path(ours.state.best_model_checkpoint) == tmp_path / "baseline" / "checkpoint-2"
    for name, state in our_states.items():
        theirs = stock_states[name]
        assert Path(state["best_model_checkpoint"]).name == Path(theirs["best_model_checkpoint"]).name
        assert Path(state["best_model_checkpoint"]).parent == tmp_path / "baseline"
        assert _untimed(state["log_history"]) == _untimed(theirs["log_history"])
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "baseline" / name)
        assert loaded.config.hidden_size == SMALL["hidden_size"]


def _untimed(history: list[dict]) -> list[dict]:
    """Without the timings (and the report's metrics, which reach the trackers through ``log``)."""
    return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k
             and not k.startswith("hf_speedup/")} for e in history]


def test_transformers_jit_checkpoint_goes_through_the_staged_save(tmp_path, make_args, dataset, collator):
    """``enable_jit_checkpoint``: transformers makes checkpoint-N holding its sentinel, then calls
    ``_save_checkpoint``; the committed folder replaces it, complete and without the sentinel."""

    class RequestJit(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                jit = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "JITCheckpointCallback")
                jit.jit_manager.is_checkpoint_requested = True

    trainer = _trainer(tmp_path, make_args, dataset, collator, max_steps=6, save_strategy="no",
                       enable_jit_checkpoint=True, callbacks=[RequestJit()])
    trainer.train()
    [checkpoint] = tmp_path.glob("*checkpoint*")  # no staging folder left
    assert files.step_of(str(checkpoint)) == 3 and files.problem(str(checkpoint)) is None
    assert not (checkpoint / files.JIT_SENTINEL).exists()


def test_a_second_saving_process_on_a_shared_file_system_finds_the_commit_done(tmp_path):
    """``save_on_each_node`` with a shared file system: every node's saving process commits the same folder;
    the first renames it, the next ones leave it (they must not move the fresh checkpoint away as a stale one)."""
    root = Path(files.staging_root(str(tmp_path), 4))
    (root / "checkpoint-4").mkdir(parents=True)
    (root / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert files.commit(str(root), "checkpoint-4", str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert files.commit(str(root), "checkpoint-4", str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").is_file()


class _SharedDisk:
    """Two saving processes (``save_on_each_node``: each node's main process) on one shared file system, as two
    threads, each with its own trainer (:class:`_Node`). Their barriers are one ``threading.Barrier``. A thread at a
    ``meet`` point waits there until the other one is at a meet point too, waits at a barrier or is done: where the
    code lets both look at a folder before either changes it, they do."""

    def __init__(self):
        self.cond = threading.Condition()
        self.state = {0: "running", 1: "running"}  # per node: running | meet | barrier | done
        self.generation = 0
        self.barrier = threading.Barrier(2, action=self._all_running, timeout=30)

    def _set(self, node: int, state: str) -> None:
        with self.cond:
            self.state[node] = state
            self.cond.notify_all()

    def _all_running(self) -> None:
        with self.cond:
            self.state = dict.fromkeys(self.state, "running")

    def wait(self, node: int) -> None:
        self._set(node, "barrier")
        self.barrier.wait()

    def meet(self, node: int) -> None:
        with self.cond:
            self.state[node], generation = "meet", self.generation
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.generation != generation or "running" not in self.state.values(), 30)
            if self.generation == generation:  # the last to park releases every thread at a meet point
                self.generation += 1
                self.state = {k: "running" if v == "meet" else v for k, v in self.state.items()}
                self.cond.notify_all()

    def side_by_side(self, *calls) -> dict[int, BaseException]:
        errors: dict[int, BaseException] = {}

        def run(node, call):
            try:
                call()
            except BaseException as exc:  # noqa: BLE001  (what the test reports)
                errors[node] = exc
                self.barrier.abort()  # the other thread's barrier fails instead of waiting for this one
            finally:
                self._set(node, "done")

        threads = [threading.Thread(target=run, args=(n, c), name=f"node{n}") for n, c in enumerate(calls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return errors


class _Saver:
    """What the staged save calls of the Trainer: it writes checkpoint-N into the output folder it is given."""

    def _get_output_dir(self, trial):
        return self.args.output_dir

    def _save_checkpoint(self, model, trial):
        folder = Path(self._get_output_dir(trial)) / files.checkpoint_name(self.state.global_step)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / files.TRAINER_STATE).write_text(json.dumps({"global_step": self.state.global_step}))


class _Node(CrashSafeMixin, _Saver):
    """One node's main process of a 2 nodes x 2 processes run with ``save_on_each_node`` (it saves)."""

    def __init__(self, disk: _SharedDisk, node: int, run_dir: Path, step: int):
        from accelerate.state import PartialState

        from hf_speedup import get_preset
        from hf_speedup.features import crash_safe
        from hf_speedup.plan_types import Outcome

        self.args = SimpleNamespace(output_dir=str(run_dir), should_save=True, save_on_each_node=True, world_size=4,
                                    process_index=2 * node, save_total_limit=None, save_strategy="steps")
        self.state = SimpleNamespace(global_step=step, best_model_checkpoint=None, best_global_step=None)
        self.speedup_plan = SimpleNamespace(decisions={
            "crash_safe": crash_safe.decide(SimpleNamespace(config=get_preset("baseline")))})
        self.speedup_outcomes = {"crash_safe": Outcome()}

        class Accelerator:  # barriers over the shared disk, accelerate's own main_process_first ordering
            is_main_process = node == 0

            def wait_for_everyone(self):
                disk.wait(node)

            @contextlib.contextmanager
            def main_process_first(self):
                yield from PartialState._goes_first(self, self.is_main_process)

        self.accelerator = Accelerator()


def _meet_before(monkeypatch, disk: _SharedDisk, *names: str) -> None:
    for name in names:
        real = getattr(files, name)

        def meeting(*args, _real=real, **kwargs):
            disk.meet(int(threading.current_thread().name[-1]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(files, name, meeting)


def test_save_on_each_node_on_a_shared_file_system_replaces_a_checkpoint_of_the_same_step_once(tmp_path,
                                                                                                monkeypatch):
    """Both nodes' saving processes re-save step 4 (a run started again in its output_dir, or resumed from an
    earlier checkpoint) and both see the old checkpoint-4 before either replaces it: side by side, one fails on the
    rename the other made (FileNotFoundError, the job stops) or deletes the checkpoint the other has just renamed
    into place. The main process commits first, the other finds it done: one new checkpoint-4."""
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / files.TRAINER_STATE).write_text(json.dumps({"global_step": 4, "stale": True}))
    disk = _SharedDisk()
    nodes = [_Node(disk, n, tmp_path, step=4) for n in (0, 1)]
    _meet_before(monkeypatch, disk, "remove")
    errors = disk.side_by_side(*(lambda n=n: n._save_checkpoint(None, None) for n in nodes))
    assert errors == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]  # no staging or deleting leftovers
    assert json.loads((tmp_path / "checkpoint-4" / files.TRAINER_STATE).read_text()) == {"global_step": 4}
    for n in nodes:
        assert n.speedup_outcomes["crash_safe"].facts["last_committed"] == str(tmp_path / "checkpoint-4")


def test_save_on_each_node_on_a_shared_file_system_sets_an_unfinished_save_aside_once_and_reports_it(
        tmp_path, monkeypatch):
    """A requeued job resumes: both nodes' saving processes find the staging folder of the save a kill stopped;
    side by side, the second one to rename it fails (FileNotFoundError: the job stops again). The main process
    sets it aside first (so its report says so), the other finds nothing left to move."""
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / files.TRAINER_STATE).write_text(json.dumps({"global_step": 2}))
    staged = Path(files.staging_root(str(tmp_path), 4)) / "checkpoint-4"
    staged.mkdir(parents=True)
    (staged / "config.json").write_text("{}")  # trainer_state.json never written
    disk = _SharedDisk()
    nodes = [_Node(disk, n, tmp_path, step=0) for n in (0, 1)]
    _meet_before(monkeypatch, disk, "set_aside")
    chosen = {}
    errors = disk.side_by_side(*(lambda n=n: chosen.__setitem__(n.args.process_index, resolve_resume(n, True))
                                 for n in nodes))
    assert errors == {}
    assert chosen == {0: str(tmp_path / "checkpoint-2"), 2: str(tmp_path / "checkpoint-2")}
    [moved] = (tmp_path / files.INCOMPLETE_DIR).iterdir()
    assert moved.name.startswith("checkpoint-4.") and (moved / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [files.INCOMPLETE_DIR, "checkpoint-2"]
    main_report = nodes[0].speedup_outcomes["crash_safe"].facts
    assert [m["moved_to"] for m in main_report["set_aside"]] == [str(moved)]
    assert "set_aside" not in nodes[1].speedup_outcomes["crash_safe"].facts


def test_a_hub_push_of_the_checkpoint_reads_it_from_its_final_folder(tmp_path, make_args, dataset, collator,
                                                                      monkeypatch):
    """transformers uploads the checkpoint in the background: it is handed the renamed, complete folder, not
    the staging one that the rename empties."""
    pushed = []
    monkeypatch.setattr(Trainer, "_push_from_checkpoint",
                        lambda self, folder: pushed.append((folder, files.problem(folder))))
    trainer = _trainer(tmp_path, make_args, dataset, collator, max_steps=1, save_strategy="no")
    trainer.train()
    trainer.args.push_to_hub = True  # after the Trainer is built: no hub repository is created
    trainer._save_checkpoint(trainer.model, trial=None)
    assert pushed == [(str(tmp_path / "checkpoint-1"), None)]


def _mixtral(seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                        num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0)
    return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("speedup", ["baseline", "auto"])
def test_a_mixture_of_experts_resumes_its_expert_weights(speedup, tmp_path, make_args, dataset, collator):
    """The Trainer writes a checkpoint's experts in transformers' original per-expert layout and loads it back
    without converting it: a resumed Mixtral kept its fresh expert and router weights (a warning only). The checkpoint
    stays as written; the resume loads what the Trainer's load left out through from_pretrained and ends with the
    uninterrupted run's weights and losses."""
    config = {"base": speedup, "precision": {"dtype": "fp32"}}

    def run(out, seed, **kw):
        args = make_args(output_dir=str(out), max_steps=4, **SAVES)
        trainer = SpeedupTrainer(model=_mixtral(seed), args=args, train_dataset=dataset, data_collator=collator,
                                 speedup=config)
        trainer.speedup_callback.print_tables = False
        trainer.train(**kw)
        return trainer

    whole = run(tmp_path / "whole", seed=0)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "whole" / "checkpoint-2" / "model.safetensors"), "pt") as f:
        assert not any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())  # the original layout, as stock
    shutil.rmtree(tmp_path / "whole" / "checkpoint-4")
    resumed = run(tmp_path / "whole", seed=1, resume_from_checkpoint=True)  # other initial weights: all from disk
    assert _same_weights(whole, resumed)
    assert "loaded through from_pretrained" in resumed.speedup_report.to_dict()["plan"]["crash_safe"]["reason"]
    assert _losses(resumed) == _losses(whole)  # steps 1-2 from the checkpoint's state, 3-4 trained again
    reloaded = type(whole.model).from_pretrained(str(tmp_path / "whole" / "checkpoint-4"))
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), whole.model.state_dict().values()))


def test_a_finished_run_requeued_trains_no_further_step(tmp_path, make_args, dataset, collator):
    """A job killed after its last save (or a SIGTERM after its last step) is requeued with resume=True: the stock
    Trainer trained a step past max_steps; the run is left as it finished."""
    done = _trainer(tmp_path / "run", make_args, dataset, collator, max_steps=4, lr_scheduler_type="constant")
    done.train()
    before = {k: v.clone() for k, v in done.model.state_dict().items()}
    again = _trainer(tmp_path / "run", make_args, dataset, collator, max_steps=4, seed=1,
                     lr_scheduler_type="constant")
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 4 and not [e for e in again.state.log_history if e.get("step", 0) > 4]
    assert all(torch.equal(before[k], v) for k, v in again.model.state_dict().items())
    assert not (tmp_path / "run" / "checkpoint-5").exists()


def test_a_stock_trainers_mixture_of_experts_checkpoint_resumes_with_its_expert_weights(tmp_path, make_args, dataset,
                                                                                         collator):
    """A checkpoint the stock Trainer wrote (experts in the original per-expert layout) resumed by SpeedupTrainer:
    the weights the Trainer's load leaves out are converted through from_pretrained, said in the report."""
    def args(out):
        return make_args(output_dir=str(out), max_steps=4, **SAVES)

    stock = Trainer(model=_mixtral(0), args=args(tmp_path / "stock"), train_dataset=dataset, data_collator=collator)
    stock.train()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "stock" / "checkpoint-2" / "model.safetensors"), "pt") as f:
        assert not any(k.endswith("experts.gate_up_proj") for k in f.keys())  # the original layout
    shutil.rmtree(tmp_path / "stock" / "checkpoint-4")
    resumed = SpeedupTrainer(model=_mixtral(1), args=args(tmp_path / "stock"), train_dataset=dataset,
                             data_collator=collator, speedup="baseline")
    resumed.train(resume_from_checkpoint=True)
    assert _same_weights(stock, resumed) and _losses(resumed) == _losses(stock)
    notes = resumed.speedup_report.to_dict()["plan"]["crash_safe"]["reason"]
    assert "under their original names" in notes and "loaded through from_pretrained" in notes
