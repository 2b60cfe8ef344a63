"""Asynchronous checkpoints (``crash_safe.asynchronous``): training goes on while the files are written, and every
promise of the staged save still holds: complete or invisible, rotation after the rename, resume bit-identical,
the stock Trainer's files.

Whether a write really ran beside training is read from the writes themselves (the thread that wrote, a step that
ended while a write was held open), never from the configuration.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_speedup import SpeedupTrainer
from hf_speedup.features.crash_safe import files, staging
from hf_speedup.tiny import tiny_llama

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
SAVES = dict(save_strategy="steps", save_steps=2, save_total_limit=2, learning_rate=1e-3)
# the same preset with and without background saves: fp32 on every CPU, so runs compare bit for bit
BACKGROUND = {"base": "auto", "precision": {"dtype": "fp32"}, "crash_safe": {"asynchronous": True}}
SYNCHRONOUS = {"base": "auto", "precision": {"dtype": "fp32"}, "crash_safe": {"asynchronous": False}}


def _trainer(out: Path, make_args, dataset, collator, speedup=BACKGROUND, seed=0, max_steps=6, callbacks=(), **kw):
    args = make_args(output_dir=str(out), max_steps=max_steps, **{**SAVES, **kw})
    trainer = SpeedupTrainer(model=tiny_llama(seed=seed, **SMALL), args=args, train_dataset=dataset,
                             data_collator=collator, callbacks=list(callbacks), speedup=speedup)
    trainer.speedup_callback.print_tables = False
    return trainer


def _losses(trainer) -> dict:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def _checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.iterdir() if "checkpoint" in p.name), key=lambda n: (len(n), n))


class _Writes:
    """Wraps torch.save (the wrapper is what the save's capture defers): which thread wrote which file."""

    def __init__(self, monkeypatch, hold: str | None = None, fail: str | None = None):
        self.threads: dict[str, str] = {}
        self.hold, self.fail = hold, fail
        self.released = threading.Event()
        self.steps_while_held: list[int] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        real = torch.save

        def save(obj, f, *args, **kwargs):
            name = os.path.relpath(os.fspath(f), os.path.dirname(os.path.dirname(os.path.dirname(os.fspath(f)))))
            self.threads[name] = threading.current_thread().name
            with self._lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                if self.fail and name.endswith(self.fail):
                    raise OSError(errno.ENOSPC, "No space left on device")
                if self.hold and name.endswith(self.hold):
                    self.released.wait(timeout=120)  # released by training's next step (a deadlock guard only)
                return real(obj, f, *args, **kwargs)
            finally:
                with self._lock:
                    self.in_flight -= 1

        monkeypatch.setattr(torch, "save", save)

    def callback(self) -> TrainerCallback:
        writes = self

        class ReleaseAfterAStep(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if not writes.released.is_set() and any(writes.hold and k.endswith(writes.hold) for k in writes.threads):
                    writes.steps_while_held.append(state.global_step)
                    writes.released.set()

        return ReleaseAfterAStep()


# ------------------------------------------------------------------------------------------ the mechanism
def test_training_steps_while_the_checkpoint_is_written_and_the_files_are_the_synchronous_ones(
        tmp_path, make_args, dataset, collator, monkeypatch):
    writes = _Writes(monkeypatch, hold=os.path.join("checkpoint-2", "optimizer.pt"))
    background = _trainer(tmp_path / "bg", make_args, dataset, collator, callbacks=[writes.callback()])
    background.train()
    # the optimizer file of step 2 was held open until a training step ended: step 3 ran beside the write
    assert writes.steps_while_held == [3]
    assert writes.threads[os.path.join("_checkpoint-2.staging", "checkpoint-2", "optimizer.pt")].startswith(
        "hf_speedup-save-checkpoint-2")
    facts = background.speedup_status["crash_safe"].facts
    assert facts["saves_background"] == 3 and facts["committed"] == 3 and not facts.get("failed_saves")
    assert facts["writer_niceness"] in {"19", "10", "0"}  # the writer ran at a lowered priority
    assert background.speedup_status["crash_safe"].to_dict()["engaged"] is True

    monkeypatch.undo()
    sync = _trainer(tmp_path / "sync", make_args, dataset, collator, speedup=SYNCHRONOUS)
    sync.train()
    assert _losses(sync) == _losses(background)
    for name in ("checkpoint-4", "checkpoint-6"):
        a, b = tmp_path / "bg" / name, tmp_path / "sync" / name
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        # the state of step 4, not the later state training had reached while the files were written
        ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        oa, ob = torch.load(a / "optimizer.pt"), torch.load(b / "optimizer.pt")
        assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for i in ob["state"] for k in ob["state"][i])
        assert files.problem(str(a)) is None


def test_resume_from_a_background_checkpoint_is_bit_identical(tmp_path, make_args, dataset, collator):
    whole = _trainer(tmp_path / "whole", make_args, dataset, collator)
    whole.train()
    class StopAt4(TrainerCallback):  # a job stopped after step 4 (the save of a stopping run is its last)
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 4

    _trainer(tmp_path / "cut", make_args, dataset, collator, callbacks=[StopAt4()]).train()
    assert _checkpoints(tmp_path / "cut") == ["checkpoint-2", "checkpoint-4"]  # the final save waited for its write
    resumed = _trainer(tmp_path / "cut", make_args, dataset, collator, seed=1)
    resumed.train(resume_from_checkpoint=True)
    assert Path(resumed.speedup_status["crash_safe"].facts["resumed_from"]).name == "checkpoint-4"
    assert {s: l for s, l in _losses(resumed).items() if s > 4} == {s: l for s, l in _losses(whole).items() if s > 4}
    sa, sb = resumed.model.state_dict(), whole.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_one_save_in_flight_and_rotation_after_the_rename(tmp_path, make_args, dataset, collator, monkeypatch):
    writes = _Writes(monkeypatch)
    trainer = _trainer(tmp_path, make_args, dataset, collator, save_steps=1, save_total_limit=1, max_steps=5)
    trainer.train()
    assert writes.most_in_flight == 1  # saves every step, back to back: never two writes at once
    assert _checkpoints(tmp_path) == ["checkpoint-5"]
    facts = trainer.speedup_status["crash_safe"].facts
    assert facts["saves_background"] == 5 and facts["committed"] == 5


def test_a_full_disk_during_the_background_write_keeps_the_previous_checkpoint_and_says_so(
        tmp_path, make_args, dataset, collator, monkeypatch, caplog):
    _Writes(monkeypatch, fail=os.path.join("checkpoint-4", "optimizer.pt"))
    trainer = _trainer(tmp_path, make_args, dataset, collator, save_total_limit=None)
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        trainer.train()  # the run goes on: the next save tries again
    assert _checkpoints(tmp_path) == ["checkpoint-2", "checkpoint-6"]  # no staging folder left, step 2 intact
    assert any("the background save of checkpoint-4 failed (OSError: [Errno 28] No space left on device)" in m
               and "checkpoint-2) is intact" in m for m in caplog.messages)
    status = trainer.speedup_status["crash_safe"]
    assert status.facts["failed_saves"] == [{"step": 4, "error": "OSError: [Errno 28] No space left on device"}]
    entry = status.to_dict()
    assert "1 background save(s) FAILED" in entry["reason"] and entry["settings"]["failed_saves"][0]["step"] == 4


def test_a_callback_that_acts_on_on_save_gets_a_synchronous_save_with_the_reason(tmp_path, make_args, dataset,
                                                                                  collator, monkeypatch):
    from hf_speedup.features.crash_safe import asynchronous

    monkeypatch.setattr(asynchronous, "_cores_kept_busy", lambda caps: None)  # auto on, whatever this CPU is
    seen = []

    class ReadsTheCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(sorted(os.listdir(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))))

    trainer = _trainer(tmp_path, make_args, dataset, collator, callbacks=[ReadsTheCheckpoint()],
                       speedup={**BACKGROUND, "crash_safe": {"asynchronous": "auto"}})
    trainer.train()
    assert all("optimizer.pt" in names for names in seen) and len(seen) == 3
    facts = trainer.speedup_status["crash_safe"].facts
    assert facts["saves_synchronous"] == 3 and "saves_background" not in facts
    assert "ReadsTheCheckpoint act on on_save" in facts["synchronous_saves"][0]


def test_a_file_whose_host_copy_does_not_fit_is_written_synchronously_with_the_reason(
        tmp_path, make_args, dataset, collator, monkeypatch):
    monkeypatch.setattr(staging, "free_host_bytes", lambda: 1000)  # room for the RNG state, not the weights
    writes = _Writes(monkeypatch)
    trainer = _trainer(tmp_path, make_args, dataset, collator, max_steps=2)
    trainer.train()
    assert writes.threads[os.path.join("_checkpoint-2.staging", "checkpoint-2", "optimizer.pt")] == "MainThread"
    notes = trainer.speedup_status["crash_safe"].facts["synchronous_files"]
    assert "optimizer.pt (its host copy needs" in notes[0] and "0.00 GiB of host memory was free" in notes[0]
    assert _checkpoints(tmp_path) == ["checkpoint-2"]


# ------------------------------------------------------------------------------------------ the plan
def test_auto_saves_in_the_background_where_cores_are_idle_and_baseline_never(tiny_model):
    """A GPU host, or a CPU with cores training leaves idle: in the background. A CPU whose every core runs
    training's threads: synchronously, with the reason (``true`` overrides). ``baseline``: synchronously."""
    from conftest import CUDA_H100, fake_caps
    from hf_speedup.plan import plan_for

    def planned(speedup, **caps):
        return plan_for(speedup, fake_caps(**caps), tiny_model)["crash_safe"]

    assert planned("auto", **CUDA_H100).settings.asynchronous is True
    assert "background thread" in planned("auto", **CUDA_H100).reason
    assert planned("auto", cpu_threads=1, cpu_cores=2).settings.asynchronous is True
    busy = planned("auto", cpu_threads=2, cpu_cores=2)
    assert busy.settings.asynchronous is False
    assert "training keeps every core of this CPU busy (2 thread(s) on 2 core(s))" in busy.reason
    assert planned({"base": "auto", "crash_safe": {"asynchronous": True}}, cpu_threads=2,
                   cpu_cores=2).settings.asynchronous is True
    base = planned("baseline", **CUDA_H100)
    assert base.settings.asynchronous is False and "saved synchronously (asynchronous: false)" in base.reason


def test_bad_asynchronous_value_is_one_clear_error():
    from hf_speedup.config import SpeedupConfig, SpeedupConfigError

    with pytest.raises(SpeedupConfigError, match=r"crash_safe\.asynchronous.*'sometimes'.*auto"):
        SpeedupConfig.from_dict({"crash_safe": {"asynchronous": "sometimes"}})


def test_sigterm_with_a_write_pending_drains_it_and_exits_as_today(tmp_path, make_args, dataset, collator,
                                                                   monkeypatch):
    """SIGTERM at step 3 while checkpoint-2's optimizer file is still being written: the interrupt's save of step 3
    waits for it, writes its own, and train() ends with TrainingInterrupted (status 143) and both checkpoints."""
    import signal

    from hf_speedup.features.interrupt import TrainingInterrupted

    writes = _Writes(monkeypatch, hold=os.path.join("checkpoint-2", "optimizer.pt"))

    class SigtermAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                assert not writes.released.is_set()  # checkpoint-2 is still being written
                threading.Timer(0.2, writes.released.set).start()  # the disk finishes it a moment later
                signal.raise_signal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path, make_args, dataset, collator, callbacks=[SigtermAt3()],
                       speedup={**BACKGROUND, "interrupt": {"enabled": "auto"}})
    try:
        with pytest.raises(TrainingInterrupted) as info:
            trainer.train()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (info.value.code, info.value.step) == (143, 3)
    assert _checkpoints(tmp_path) == ["checkpoint-2", "checkpoint-3"]
    assert all(files.problem(str(tmp_path / n)) is None for n in ("checkpoint-2", "checkpoint-3"))
    assert trainer._speedup_background.pending is None  # nothing left in flight when train() ended


def test_the_writer_yields_the_cpu_and_gets_more_of_it_when_a_save_finds_it_unfinished():
    """Niceness 19 first (the cores training leaves idle); a save that had to wait for the write moves the next
    writer to 10; a save that finds the write done moves it back."""
    from hf_speedup.features.crash_safe.background import BackgroundWriter

    writer, seen, gate = BackgroundWriter(), [], threading.Event()

    def work():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        gate.wait(60)

    writer.submit("checkpoint-1", work)
    threading.Timer(0.2, gate.set).start()
    writer.wait(adapt=True)  # the next save came while checkpoint-1 was still being written
    writer.submit("checkpoint-2", work)
    writer.pending.thread.join()  # gate stays set: done before the next save
    writer.wait(adapt=True)
    writer.submit("checkpoint-3", work)
    writer.wait()
    assert seen == [19, 10, 19]


def test_a_direct_save_outside_train_returns_with_its_checkpoint_written(tmp_path, make_args, dataset, collator):
    """A caller of ``_save_checkpoint`` outside ``train()`` (a test suite, a user's own loop) finds the files."""
    trainer = _trainer(tmp_path, make_args, dataset, collator, max_steps=2)
    trainer.train()
    trainer.state.global_step = 7
    trainer.state.max_steps = 0  # nothing says this save finishes a run: only being outside train() does
    trainer.control.should_training_stop = False
    trainer._save_checkpoint(trainer.model, trial=None)
    assert files.problem(str(tmp_path / "checkpoint-7")) is None
    assert trainer._speedup_background.pending is None
