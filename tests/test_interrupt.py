"""Preemption: a handled signal ends train() with a checkpoint of the current step, the report and exit 128+signal;
a resume from that checkpoint continues with the uninterrupted run's losses, bit for bit (one process here;
two in tests/test_interrupt_distributed.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import TrainerCallback

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup.callback_handler import all_callbacks
from hf_speedup import SpeedupConfigError, SpeedupTrainer, plan_for, get_preset, list_presets
from hf_speedup.features import interrupt
from hf_speedup.features.interrupt import InterruptCallback, TrainingInterrupted
from hf_speedup.report.carry import STATE_FILE
from hf_speedup.tiny import tiny_llama

from conftest import REPORTED_BASELINE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "interrupt_train.py"
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
HANDLED = ("SIGTERM", "SIGINT", "SIGUSR1")
# the feature alone on the stock Trainer's setup (fast, and independent of what other features do to a step)
INTERRUPT_ONLY = {**REPORTED_BASELINE, "name": "interrupt-only", "interrupt": {"enabled": "auto"}}


class _Raise(TrainerCallback):
    """Delivers a signal to this process at the end of one step (or at train end); records what it sees."""

    def __init__(self, signum=signal.SIGTERM, step=None, at_train_end=False, trainer=None):
        self.signum, self.step, self.at_train_end, self.trainer = signum, step, at_train_end, trainer
        self.during: dict = {}
        self.verified = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.during = {n: signal.getsignal(getattr(signal, n)) for n in HANDLED}
            if self.trainer is not None:
                self.verified = interrupt.verify(self.trainer.speedup_plan["interrupt"], self.trainer,
                                                 self.trainer.speedup_outcomes["interrupt"])
        if state.global_step == self.step:
            signal.raise_signal(self.signum)

    def on_train_end(self, args, state, control, **kwargs):
        if self.at_train_end:
            signal.raise_signal(self.signum)


def _losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def _trainer(make_args, dataset, collator, out, *, speedup=INTERRUPT_ONLY, seed=0, callbacks=(), **kw):
    args = make_args(output_dir=str(out), **{"max_steps": 6, "learning_rate": 1e-3, **kw})
    trainer = SpeedupTrainer(model=tiny_llama(seed=seed, **SMALL), args=args, train_dataset=dataset,
                             data_collator=collator, speedup=speedup, callbacks=list(callbacks))
    trainer.speedup_callback.print_tables = False
    return trainer


@pytest.fixture
def own_handlers():
    """The handlers as they were before the test, put back after it whatever happens. A signal the test process
    inherited ignored (pytest started in the background by a shell, or under nohup: SIGINT is SIG_IGN there) starts
    at its default: these tests are about a run whose signals are at their defaults (ignored ones are left alone,
    and a test of that sets SIG_IGN itself)."""
    before = {n: signal.getsignal(getattr(signal, n)) for n in HANDLED}
    for n, h in before.items():
        if h is signal.SIG_IGN:
            signal.signal(getattr(signal, n), signal.default_int_handler if n == "SIGINT" else signal.SIG_DFL)
    yield before
    for n, h in before.items():
        signal.signal(getattr(signal, n), h)


# ------------------------------------------------------------------------------------------ plan and config
def test_every_preset_but_baseline_handles_the_three_signals(tiny_model):
    for name in list_presets():
        for caps in (fake_caps(**CPU_NO_BF16), fake_caps(**CUDA_H100, world_size=2)):
            d = plan_for(name, caps, tiny_model)["interrupt"]
            if name == "baseline":
                assert not d.active and "default action" in d.reason
                continue
            assert d.applied == "save-and-exit" and d.settings.signals == HANDLED, name
            assert "143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1" in d.reason
            assert d.settings.ranks_agree is (caps.world_size == 2)
            assert ("ranks agree" in d.reason) is (caps.world_size == 2)


def test_bad_interrupt_config_is_one_clear_error():
    with pytest.raises(SpeedupConfigError, match=(
            r"interrupt\.enabled = 'yes' is not allowed; allowed: 'auto', True, False; fix: set interrupt\.enabled: "
            r"'auto'\n.*interrupt\.signals = \['SIGKILL', 'SIGTERM'\] is not allowed; allowed: a non-empty list of "
            r"distinct names from 'SIGTERM', 'SIGINT', 'SIGUSR1', 'SIGUSR2', 'SIGHUP', 'SIGXCPU'; fix: e\.g\. "
            r"interrupt\.signals: \[SIGTERM, SIGINT, SIGUSR1\]")):
        get_preset("auto").replace(interrupt={"enabled": "yes", "signals": ["SIGKILL", "SIGTERM"]})
    for bad in ([], ["SIGTERM", "SIGTERM"], "SIGTERM"):
        with pytest.raises(SpeedupConfigError, match=r"interrupt\.signals = .* is not allowed"):
            get_preset("auto").replace(interrupt={"signals": bad})


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.slow
def test_sigterm_without_any_checkpoint_saves_the_step_and_resume_is_bitwise(
        cpu_kind, make_args, dataset, collator, tmp_path, own_handlers):
    reference = _trainer(make_args, dataset, collator, tmp_path / "reference", speedup="auto", max_steps=4)
    reference.train()
    ref_report = json.loads((tmp_path / "reference" / "speedup_report.json").read_text())

    out = tmp_path / "run"
    probe = _Raise(step=2)
    trainer = _trainer(make_args, dataset, collator, out, speedup="auto", max_steps=4, callbacks=[probe])
    assert trainer.args.save_strategy == "no"
    probe.trainer = trainer
    assert trainer.speedup_status["interrupt"].engaged is False  # not armed before train()
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    exc = info.value
    assert (exc.code, exc.signal_name, exc.step, exc.checkpoint) == (143, "SIGTERM", 2, str(out / "checkpoint-2"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    ckpt = out / "checkpoint-2"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            STATE_FILE} <= {p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 2
    assert _losses(trainer) == {s: l for s, l in _losses(reference).items() if s <= 2}

    # while training, the live handlers were the feature's; afterwards the previous ones are back
    handler = next(cb for cb in all_callbacks(trainer) if isinstance(cb, InterruptCallback))._handler
    assert probe.during == {n: handler for n in HANDLED}
    assert probe.verified == (True, "callback registered; handlers in place for SIGTERM, SIGINT, SIGUSR1")
    assert {n: signal.getsignal(getattr(signal, n)) for n in HANDLED} == own_handlers

    report = json.loads((out / "speedup_report.json").read_text())
    entry = report["plan"]["interrupt"]
    assert entry["engaged"] is True and entry["applied"] == "save-and-exit"
    assert {k: entry["settings"][k] for k in ("received", "stopped_at_step", "checkpoint", "exit_status")} == \
        {"received": "SIGTERM", "stopped_at_step": 2, "checkpoint": str(ckpt), "exit_status": 143}
    assert report["measurement"]["steps"] == 2

    # as if the first segment had spent 2.5 s recompiling: the whole run's figure must carry it
    carried = json.loads((ckpt / STATE_FILE).read_text())
    assert carried["recompile_seconds"] == 0.0  # auto on CPU compiles nothing
    (ckpt / STATE_FILE).write_text(json.dumps({**carried, "recompile_seconds": 2.5}))

    # resume into a model initialised differently: every weight must come from the checkpoint
    resumed = _trainer(make_args, dataset, collator, out, speedup="auto", max_steps=4, seed=1)
    resumed.train(resume_from_checkpoint=True)
    assert _losses(resumed) == _losses(reference)  # bitwise: steps 3 and 4 included
    final = json.loads((out / "speedup_report.json").read_text())
    m, ref_m = final["measurement"], ref_report["measurement"]
    assert (m["steps"], m["tokens"], m["samples"]) == (ref_m["steps"], ref_m["tokens"], ref_m["samples"]) == \
        (4, ref_m["tokens"], ref_m["samples"])
    assert (m["train_runs"], m["resumed_from"]) == (2, str(ckpt))
    assert [s[0] for s in final["step_times"]] == [1, 2, 3, 4]
    assert final["metrics"]["recompiles"] == ref_report["metrics"]["recompiles"]
    assert final["metrics"]["recompile_seconds"] == 2.5  # carried over, plus none in the resumed segment


@pytest.mark.parametrize("name, status", [("SIGINT", 130), ("SIGUSR1", 138)])
def test_sigint_and_sigusr1_stop_the_same_way(name, status, make_args, dataset, collator, tmp_path, own_handlers):
    trainer = _trainer(make_args, dataset, collator, tmp_path, max_steps=3,
                       callbacks=[_Raise(getattr(signal, name), 1)])
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    assert (info.value.code, info.value.signal_name, info.value.step) == (status, name, 1)
    assert (tmp_path / "checkpoint-1" / "trainer_state.json").is_file()


def test_a_vetoed_save_is_made_at_the_epoch_end(make_args, dataset, collator, tmp_path, own_handlers):
    """save_strategy="best" sets should_save from the metric after an evaluation; a stop still checkpoints."""
    split = dataset.train_test_split(test_size=8, seed=0)
    args = dict(max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="best", metric_for_best_model="loss",
                greater_is_better=True, per_device_eval_batch_size=4)  # the loss falls: step 4 is no new best
    trainer = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL),
                             args=make_args(output_dir=str(tmp_path), learning_rate=1e-3, **args),
                             train_dataset=split["train"], eval_dataset=split["test"], data_collator=collator,
                             speedup=INTERRUPT_ONLY, callbacks=[_Raise(step=4)])
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    evals = [e["step"] for e in trainer.state.log_history if "eval_loss" in e]
    assert evals == [2, 4]  # no extra evaluation at the interrupted epoch's end


def test_a_users_handler_is_chained_after_the_checkpoint_and_restored(make_args, dataset, collator, tmp_path,
                                                                      own_handlers):
    calls = []

    def users_handler(signum, frame):
        calls.append((signum, (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()))

    signal.signal(signal.SIGUSR1, users_handler)
    trainer = _trainer(make_args, dataset, collator, tmp_path, max_steps=4,
                       callbacks=[_Raise(signal.SIGUSR1, 2)])
    with pytest.raises(TrainingInterrupted, match="SIGUSR1"):
        trainer.train()
    assert calls == [(signal.SIGUSR1, True)]  # once, and only after the checkpoint existed
    assert signal.getsignal(signal.SIGUSR1) is users_handler
    facts = trainer.speedup_status["interrupt"].facts
    assert facts["previous_handlers"] == {"SIGUSR1": f"{__name__}.{users_handler.__qualname__}"}


def test_an_ignored_signal_stays_ignored_and_a_yaml_choice_of_signals_holds(make_args, dataset, collator, tmp_path,
                                                                            own_handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    probe = _Raise()
    cfg = {**INTERRUPT_ONLY, "interrupt": {"enabled": True, "signals": ["SIGTERM", "SIGINT"]}}
    trainer = _trainer(make_args, dataset, collator, tmp_path, max_steps=2, speedup=cfg, callbacks=[probe])
    trainer.train()  # no signal: an ordinary run
    handler = next(cb for cb in all_callbacks(trainer) if isinstance(cb, InterruptCallback))._handler
    assert probe.during == {"SIGTERM": handler, "SIGINT": signal.SIG_IGN, "SIGUSR1": own_handlers["SIGUSR1"]}
    state = trainer.speedup_status["interrupt"]
    assert state.engaged is True and state.facts["installed"] == ["SIGTERM"]
    assert state.facts["left_alone"] == {"SIGINT": "ignored (SIG_IGN): left ignored"}
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_baseline_installs_nothing(make_args, dataset, collator, tmp_path, own_handlers):
    probe = _Raise()
    trainer = _trainer(make_args, dataset, collator, tmp_path, max_steps=2, speedup="baseline", callbacks=[probe])
    trainer.train()
    assert probe.during == own_handlers
    assert not any(isinstance(cb, InterruptCallback) for cb in trainer.callback_handler.callbacks)
    entry = trainer.speedup_report.to_dict()["plan"]["interrupt"]
    assert entry["engaged"] is False and entry["applied"] == "off"


def test_train_outside_the_main_thread_is_a_reported_fallback(make_args, dataset, collator, tmp_path, own_handlers):
    trainer = _trainer(make_args, dataset, collator, tmp_path, max_steps=2)
    errors = []
    worker = threading.Thread(target=lambda: _record_errors(trainer.train, errors))
    worker.start()
    worker.join()
    assert errors == []  # the run itself is unaffected
    state = trainer.speedup_status["interrupt"]
    assert state.engaged is False and "outside the main thread" in state.engaged_reason
    assert any("outside the main thread" in fb for fb in state.fallbacks)


def _record_errors(fn, errors):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)


def test_a_signal_after_the_last_step_still_ends_the_process(make_args, dataset, collator, tmp_path, own_handlers):
    trainer = _trainer(make_args, dataset, collator, tmp_path, max_steps=2,
                       callbacks=[_Raise(at_train_end=True)])
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    assert (info.value.code, info.value.step, info.value.checkpoint) == (143, None, None)
    assert "arrived after the last optimizer step" in str(info.value)
    assert not list(tmp_path.glob("checkpoint-*"))


# ------------------------------------------------------------------------------------------ a real process
@pytest.mark.slow
def test_sigterm_from_outside_ends_the_process_with_143_and_a_checkpoint(tmp_path):
    """As a scheduler does it: SIGTERM to a running script whose train() does not catch anything."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    config = tmp_path / "interrupt_only.yaml"
    config.write_text("base: baseline\ninterrupt:\n  enabled: true\n  signals: [SIGTERM]\n")
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--tag", "ext", "--max-steps", "40",
           "--marker-at", "2", "--slow", "0.5", "--uncaught", "--preset", str(config)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = tmp_path / "ext.ready"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()[0][-4000:] if proc.poll() is not None else "no marker"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output[-4000:]
    res = json.loads((tmp_path / "ext.rank0.json").read_text())
    step = res["stopped_step"]
    assert 2 <= step < 40 and res["global_step"] == step
    assert sorted(p.name for p in (tmp_path / "ext").glob("checkpoint-*")) == [f"checkpoint-{step}"]
    assert f"training stopped by SIGTERM: checkpoint of step {step} in " in output

    resumed = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--tag", "ext", "--max-steps",
                              str(step + 2), "--resume", "--preset", str(config)], cwd=ROOT, env=env,
                             capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    after = json.loads((tmp_path / "ext.rank0.json").read_text())
    assert after["global_step"] == step + 2 and sorted(map(int, after["losses"]))[-2:] == [step + 1, step + 2]


def test_the_stock_trainer_path_says_it_cannot_carry_it(tmp_path, caplog):
    from hf_speedup import training_arguments

    with caplog.at_level("WARNING", logger="hf_speedup"):
        training_arguments("auto", output_dir=str(tmp_path), use_cpu=True)
    assert "interrupt='save-and-exit' needs SpeedupTrainer's train()" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_speedup"):
        training_arguments("baseline", output_dir=str(tmp_path), use_cpu=True)
    assert "interrupt" not in caplog.text


def test_a_checkpoint_without_carried_counters_resumes_and_says_so(make_args, dataset, collator, tmp_path,
                                                                   own_handlers):
    first = _trainer(make_args, dataset, collator, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    (tmp_path / "checkpoint-2" / STATE_FILE).unlink()  # as a checkpoint of the stock Trainer has none
    resumed = _trainer(make_args, dataset, collator, tmp_path, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    m = json.loads((tmp_path / "speedup_report.json").read_text())["measurement"]
    assert (m["steps"], m["train_runs"], m["resumed_from"]) == (1, 1, str(tmp_path / "checkpoint-2"))
    assert m["resume_counters"].startswith(f"{STATE_FILE} not in ") and "counts from this resume on" in \
        m["resume_counters"]


def test_unreadable_carried_counters_are_a_warning_not_an_error(tmp_path, caplog):
    from hf_speedup.report import carry

    (tmp_path / STATE_FILE).write_text('{"version": 99}')
    with caplog.at_level("WARNING", logger="hf_speedup"):
        carried, note = carry.read(tmp_path)
    assert carried is None and "version 99, expected 1" in note and "unreadable" in caplog.text
    saved = carry.Carried(global_step=4, segments=1, steps=4, tokens=100)
    assert carry.write(saved, tmp_path) == tmp_path / STATE_FILE
    assert carry.read(tmp_path)[0] == saved


def test_a_failed_start_puts_the_previous_handlers_back(make_args, dataset, collator, tmp_path, own_handlers,
                                                        monkeypatch):
    """If setting up the ranks' agreement fails when train() starts, the error goes up and Ctrl-C works again."""
    trainer = _trainer(make_args, dataset, collator, tmp_path, max_steps=1)

    def broken(cls, trainer):
        raise RuntimeError("gloo is not available")

    monkeypatch.setattr(interrupt.ranks._RankAgreement, "create", classmethod(broken))
    with pytest.raises(RuntimeError, match="gloo is not available"):
        trainer.train()
    assert {n: signal.getsignal(getattr(signal, n)) for n in HANDLED} == own_handlers


# ------------------------------------------------------------------------------------------ transformers' JIT save
class _SigtermThenSlow(TrainerCallback):
    """SIGTERM at the end of step 2, then slow steps: transformers' JIT checkpoint acts 3 s after the signal.
    Records the saves the Trainer announces (``on_save``)."""

    def __init__(self):
        self.during: dict = {}
        self.saves: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.during = {n: signal.getsignal(getattr(signal, n)) for n in HANDLED}
            signal.raise_signal(signal.SIGTERM)
        if state.global_step >= 2:
            time.sleep(0.5)

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)


def test_enable_jit_checkpoint_keeps_sigterm_and_one_signal_makes_one_checkpoint(make_args, dataset, collator,
                                                                                  tmp_path, own_handlers):
    """The user's TrainingArguments.enable_jit_checkpoint=True wins for SIGTERM: transformers saves (once), the run
    ends normally; SIGINT and SIGUSR1 stay this feature's. (Before, the feature took SIGTERM over the JIT handler.)"""
    probe = _SigtermThenSlow()
    trainer = _trainer(make_args, dataset, collator, tmp_path / "run", callbacks=[probe], max_steps=30,
                       enable_jit_checkpoint=True)
    entry = trainer.speedup_status["interrupt"]
    assert entry.settings.signals == ("SIGINT", "SIGUSR1") and entry.settings.left_to_trainer == ("SIGTERM",)
    assert "SIGTERM left to TrainingArguments.enable_jit_checkpoint=True (yours)" in entry.decision.reason
    trainer.train()  # no TrainingInterrupted: transformers' JIT checkpoint stopped the run
    handler = interrupt.find_callback(trainer)._handler
    assert probe.during["SIGUSR1"] is handler and probe.during["SIGINT"] is handler
    assert probe.during["SIGTERM"] is not handler  # transformers' JIT handler
    step = trainer.state.global_step
    assert 2 < step < 30 and probe.saves == []  # no save of the Trainer's own (JIT calls _save_checkpoint)
    # one checkpoint: of the stop step, or of the one before when JIT saved ahead of the last optimizer step
    saved = [p.name for p in (tmp_path / "run").glob("checkpoint-*")]
    assert saved in ([f"checkpoint-{step}"], [f"checkpoint-{step - 1}"]), (saved, step)


def test_enable_jit_checkpoint_with_several_processes_is_a_reported_fallback(tiny_model, tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), enable_jit_checkpoint=True, use_cpu=True, report_to=[])
    d = plan_for("auto", fake_caps(**CUDA_H100, world_size=2), tiny_model, args)["interrupt"]
    assert d.settings.signals == ("SIGINT", "SIGUSR1")
    assert any("not agreed across ranks" in f and "fix: enable_jit_checkpoint=False" in f for f in d.fallbacks)
