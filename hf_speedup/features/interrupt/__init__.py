"""Preemption-safe training: on SIGTERM / SIGINT / SIGUSR1 finish the optimizer step, save a normal checkpoint
of it, write the report and exit with status 128 + the signal number.

Why: spot instances and cluster schedulers stop jobs with SIGTERM (SLURM can send SIGUSR1 ahead of time with
``#SBATCH --signal=B:USR1@120``); without this a run keeps only what its last ``save_steps`` checkpoint held.

How (the training loop stays the stock one):

- while ``train()`` runs, each configured signal's handler only records the signal (no I/O, no locks);
- :class:`InterruptCallback` looks at ``on_step_end``, after the optimizer step. With several processes the
  ranks first agree (one integer all-reduce, MAX, per optimizer step over gloo: the default group when it is
  gloo, else a gloo side group, so a GPU run adds no device synchronisation), so every rank stops after the
  same step. It then sets ``should_log``, ``should_save`` and ``should_training_stop``: the stock Trainer logs
  the step, writes ``checkpoint-<step>`` into ``output_dir`` (whatever ``save_strategy``, "no" included; a
  save it vetoes, as ``save_strategy="best"`` may, is made at the epoch end that follows) and finishes its
  loop, so the report is written as after any run;
- when ``train()`` returns, the handlers that were there before are back, and :class:`TrainingInterrupted`
  (a ``SystemExit``) is raised: an uncaught one ends the process with 128 + signum (143 for SIGTERM, 130 for
  SIGINT, 138 for SIGUSR1), the status a shell shows for a process ended by that signal, after a normal
  interpreter shutdown (atexit handlers, W&B's finish). ``except Exception`` does not catch it; catch
  ``TrainingInterrupted`` to carry on in the same process (a notebook does: the kernel survives).
- ``trainer.train(resume_from_checkpoint=True)`` resumes from that checkpoint like from any other.

Handlers installed before ``train()`` (yours or a library's) are not lost: they are restored when training
ends, and the Python handler of the signal that stopped the run is called then (after the checkpoint, before
``TrainingInterrupted``). A signal set to ``SIG_IGN``, or held by a handler Python cannot restore (one set
from C), is left alone and reported. A second signal while stopping is only logged; SIGKILL (what schedulers
send after their grace period) still ends the process at once. Under ``torchrun`` the launcher forwards
SIGTERM, SIGINT, SIGHUP and SIGQUIT to the workers and gives them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30 s)
before killing them; SIGUSR1 only when ``TORCHELASTIC_SIGNALS_TO_HANDLE`` names it.

``TrainingArguments.enable_jit_checkpoint=True`` (transformers' own save on SIGTERM, 3 s after it, at the next step
boundary, before the optimizer step included) is the user's choice and wins: SIGTERM is left to it, so one signal
makes one checkpoint, and this feature keeps the other signals. Its save is not agreed across ranks, so with
several processes the plan warns (a fallback in the report).

``auto`` and ``true`` both turn it on; where it cannot work (``train()`` outside the main thread, where
Python cannot install signal handlers) ``auto`` says so in the report, ``true`` also warns. ``baseline``
turns it off: signals keep their default action, as with the stock Trainer.

Engagement rule: ``engaged`` is True iff the callback is registered on the trainer and, while ``train()``
runs, every handled signal's handler read back with ``signal.getsignal`` is this feature's (after training:
whether that held for the last ``train()``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

from transformers import TrainerCallback

from ...callback_handler import all_callbacks
from ...plan_types import OFF, Decision, Outcome, PlanContext

NAME = "interrupt"
APPLIES_TO = "train"
logger = logging.getLogger("hf_speedup")
APPLIED = "save-and-exit"
STOCK_TRAINER = "the stock Trainer keeps the default signal actions"  # what training_arguments() users get


class TrainingInterrupted(SystemExit):
    """Raised by ``train()`` after a handled signal stopped the run and its checkpoint was written.

    ``code`` is 128 + the signal number (what an uncaught one makes the process exit with); ``signal_name``,
    ``step`` and ``checkpoint`` (None when the signal came after the last optimizer step) say what happened.
    """

    def __init__(self, signum: int, step: int | None, checkpoint: str | None):
        super().__init__(128 + signum)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.step = step
        self.checkpoint = checkpoint

    def __reduce__(self):
        return type(self), (self.signum, self.step, self.checkpoint)

    def __str__(self) -> str:
        where = (f"checkpoint of step {self.step} in {self.checkpoint}" if self.checkpoint
                 else "no new checkpoint (it arrived after the last optimizer step)")
        return (f"training stopped by {self.signal_name}: {where}; exit status {self.code}; resume with "
                "trainer.train(resume_from_checkpoint=True)")


@dataclass(frozen=True)
class Settings:
    signals: tuple[str, ...]  # the names handled on this platform, in the configured order
    ranks_agree: bool  # several processes planned: the stop step is agreed at every step end
    left_to_trainer: tuple[str, ...] = ()  # SIGTERM under TrainingArguments.enable_jit_checkpoint: the Trainer's


# --------------------------------------------------------------------------------------------- decide
def decide(ctx: PlanContext) -> Decision:
    s = ctx.config.interrupt
    if s.enabled is False:
        return Decision(NAME, requested=False, applied=OFF, settings=Settings((), False),
                        reason="off: signals keep their default action (SIGTERM ends the run without a checkpoint)")
    names = tuple(n for n in s.signals if hasattr(signal, n))
    fallbacks = tuple(f"{n} does not exist on this platform: not handled" for n in s.signals if n not in names)
    multi = (ctx.caps.world_size or 1) > 1
    jit = tuple(n for n in names if n == "SIGTERM") if getattr(ctx.args, "enable_jit_checkpoint", False) else ()
    names = tuple(n for n in names if n not in jit)
    jit_why = (f"{', '.join(jit)} left to TrainingArguments.enable_jit_checkpoint=True (yours): transformers' JIT "
               "checkpoint saves on it (one save, not two)") if jit else ""
    if jit and multi:
        fallbacks += (f"{jit_why}; but with several processes its save is not agreed across ranks: ranks that get "
                      "SIGTERM (one node's launcher) save alone while the others train on (a sharded save waits for "
                      "them); fix: enable_jit_checkpoint=False (this feature makes every rank save the same step)",)
    for fb in fallbacks:
        logger.warning("hf_speedup interrupt fallback: %s", fb)
    if not names:
        why = jit_why or f"none of {list(s.signals)} exists on this platform"
        return Decision(NAME, requested=s.enabled, applied=OFF, settings=Settings((), False, jit), fallbacks=fallbacks,
                        reason=f"off: {why}")
    codes = ", ".join(f"{128 + int(getattr(signal, n))} for {n}" for n in names)
    reason = (f"on {', '.join(names)}: finish the optimizer step, save checkpoint-<step> into output_dir (whatever "
              f"save_strategy), write the report, then exit 128+signal ({codes})")
    if multi:
        reason += "; the ranks agree on the step to stop at (one integer all-reduce per optimizer step)"
    if jit_why:
        reason += f"; {jit_why}"
    return Decision(NAME, requested=s.enabled, applied=APPLIED, reason=reason,
                    settings=Settings(signals=names, ranks_agree=multi, left_to_trainer=jit), fallbacks=fallbacks)


# --------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    """Nothing TrainingArguments can carry: signal handling needs SpeedupTrainer's ``train()``."""
    return {}


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Nothing before the Trainer exists: the handlers are installed when ``train()`` starts."""


def callbacks(decision: Decision, trainer, outcome: Outcome) -> list:
    return [InterruptCallback(decision, outcome)] if decision.active else []


def during_train(decision: Decision, trainer, outcome: Outcome) -> "armed":
    """The signal handlers, in place while ``train()`` runs."""
    return armed(trainer)


def find_callback(trainer) -> "InterruptCallback | None":
    """The feature's callback as registered on the live trainer (None when off or removed)."""
    return next((cb for cb in all_callbacks(trainer) if isinstance(cb, InterruptCallback)), None)


class armed:
    """``with armed(trainer): trainer's train()``: handlers in place for the run, :class:`TrainingInterrupted`
    raised after it when a signal stopped it. A no-op when the feature is off."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.callback = find_callback(trainer)

    def __enter__(self):
        if self.callback is not None:
            self.callback.install(self.trainer)
        return self.callback

    def __exit__(self, exc_type, exc, tb):
        if self.callback is None:
            return False
        self.callback.restore()
        if exc_type is None:
            self.callback.exit_if_stopped()
        return False


def _handler_name(handler) -> str:
    if handler is None:
        return "a handler set outside Python"
    if handler in (signal.SIG_DFL, signal.SIG_IGN):
        return signal.Handlers(handler).name
    return f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', repr(handler))}"


def default_backend() -> str:
    """The default process group's backend ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...)."""
    import torch.distributed as dist

    return str(dist.get_backend())


class _RankAgreement:
    """MAX of one integer over every rank; CPU tensors only (a gloo group), so no device synchronisation."""

    def __init__(self, group, description: str):
        self.group = group
        self.description = description

    @classmethod
    def create(cls, trainer) -> "_RankAgreement | None":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        backend = default_backend()
        if "gloo" in backend:
            return cls(None, f"default {backend} group")
        cached = getattr(trainer, "_speedup_interrupt_group", None)
        if cached is None:
            cached = dist.new_group(backend="gloo")  # collective: every rank is entering train() here
            trainer._speedup_interrupt_group = cached
        return cls(cached, f"gloo side group (default backend {backend})")

    def max(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


class InterruptCallback(TrainerCallback):
    """Turns a recorded signal into a checkpoint of the current step and a stop; see the module docstring."""

    def __init__(self, decision: Decision, outcome: Outcome):
        self.decision = decision
        self.outcome = outcome
        self._handler = self._record  # one bound method: getsignal() returns this very object while installed
        self.previous: dict[int, object] = {}
        self.armed = False
        self.was_armed = False
        self._reset()

    def _reset(self) -> None:
        self.received: int = 0  # signal number recorded by the handler (0: none)
        self.received_here: set[int] = set()
        self.deliveries = 0
        self.stop_signal = 0  # agreed across ranks
        self.stop_step: int | None = None
        self.checkpoint: str | None = None
        self.saved = False
        self.agreement: _RankAgreement | None = None

    # ------------------------------------------------------------------------------- signal side
    def _record(self, signum, frame) -> None:
        """The signal handler: records, nothing else (the training loop acts at the next step end)."""
        self.received = self.received or signum
        self.received_here.add(signum)
        self.deliveries += 1

    def install(self, trainer) -> None:
        self._reset()
        self.previous = {}
        facts = self.outcome.facts
        for key in ("installed", "left_alone", "previous_handlers", "received", "stopped_at_step", "checkpoint",
                    "exit_status", "agreement"):
            facts.pop(key, None)
        if threading.current_thread() is not threading.main_thread():
            why = ("train() runs outside the main thread, and Python installs signal handlers only in the main "
                   "thread: signals keep their previous behaviour for this run")
            if why not in self.outcome.fallbacks:
                self.outcome.fallbacks.append(why)
            (logger.warning if self.decision.requested is True else logger.info)("hf_speedup interrupt: %s", why)
            self.armed = self.was_armed = False
            return
        left_alone, previous_names = {}, {}
        for name in self.decision.settings.signals:
            signum = int(getattr(signal, name))
            prev = signal.getsignal(signum)
            if prev is signal.SIG_IGN or prev is None:
                left_alone[name] = ("ignored (SIG_IGN): left ignored" if prev is signal.SIG_IGN
                                    else "held by a handler set outside Python, which Python could not restore: "
                                         "left in place")
                continue
            signal.signal(signum, self._handler)
            self.previous[signum] = prev
            if prev not in (signal.SIG_DFL, signal.default_int_handler):
                previous_names[name] = _handler_name(prev)
        for name, why in left_alone.items():
            logger.warning("hf_speedup interrupt: %s %s", name, why)
        for name, handler in previous_names.items():
            logger.info("hf_speedup interrupt: %s had the handler %s; it is called after the checkpoint when %s "
                        "stops the run, and restored when training ends", name, handler, name)
        facts["installed"] = [signal.Signals(s).name for s in self.previous]
        if left_alone:
            facts["left_alone"] = left_alone
        if previous_names:
            facts["previous_handlers"] = previous_names
        try:
            self.agreement = _RankAgreement.create(trainer)
        except BaseException:
            self.restore()  # never leave the handlers behind a failed start: Ctrl-C must stop the process again
            raise
        if self.agreement is not None:
            facts["agreement"] = ("all-reduce (MAX) of one integer per optimizer step over the "
                                  f"{self.agreement.description}")
        if not self.previous:
            why = "no signal could be taken over (all left alone): signals keep their previous behaviour"
            if why not in self.outcome.fallbacks:
                self.outcome.fallbacks.append(why)
            logger.warning("hf_speedup interrupt: %s", why)
        self.armed = self.was_armed = bool(self.previous)

    def restore(self) -> None:
        """Puts back the handlers that were there before ``train()`` (unless someone replaced ours meanwhile)."""
        for signum, prev in self.previous.items():
            current = signal.getsignal(signum)
            if current is self._handler:
                signal.signal(signum, prev)
            else:
                logger.warning("hf_speedup interrupt: the %s handler was replaced during training by %s; left as is",
                               signal.Signals(signum).name, _handler_name(current))
        self.armed = False

    def exit_if_stopped(self) -> None:
        """After ``train()`` returned: raise :class:`TrainingInterrupted` if a signal stopped (or ended) the run."""
        signum = self.stop_signal or self.received
        if not signum:
            return
        if self.stop_step is None:
            logger.warning("hf_speedup interrupt: %s arrived after the last optimizer step: training had finished, "
                           "no extra checkpoint", signal.Signals(signum).name)
        elif self.agreement is not None:
            self.agreement.barrier()  # no rank leaves (and makes the launcher stop the others) while one still saves
        self.outcome.facts.setdefault("exit_status", 128 + signum)
        if self.deliveries > 1:
            logger.warning("hf_speedup interrupt: %d signals arrived while stopping; the first one decided",
                           self.deliveries)
        prev = self.previous.get(signum)
        if signum in self.received_here and callable(prev) and prev is not signal.default_int_handler:
            logger.warning("hf_speedup interrupt: calling the %s handler installed before train() (%s)",
                           signal.Signals(signum).name, _handler_name(prev))
            prev(signum, None)
        exc = TrainingInterrupted(signum, self.stop_step, self.checkpoint)
        logger.warning("hf_speedup interrupt: %s", exc)  # an uncaught SystemExit prints nothing itself
        raise exc

    # ------------------------------------------------------------------------------- loop side
    def on_step_end(self, args, state, control, **kwargs):
        signum = self.received
        if self.agreement is not None:
            signum = self.agreement.max(signum)
        if not signum:
            return
        if self.stop_step is None:
            name = signal.Signals(signum).name
            self.stop_signal, self.stop_step = signum, state.global_step
            self.checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            how = "received" if signum in self.received_here else "received by another rank"
            logger.warning("hf_speedup interrupt: %s %s: saving %s, then exiting with status %d", name, how,
                           self.checkpoint, 128 + signum)
            self.outcome.facts.update(received=name, stopped_at_step=state.global_step, checkpoint=self.checkpoint,
                                      exit_status=128 + signum)
        control.should_log = True
        control.should_save = True
        control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        if self.stop_step is not None and state.global_step == self.stop_step:
            self.saved = True

    def on_epoch_end(self, args, state, control, **kwargs):
        """The loop breaks out of the epoch after the stop step: no epoch-end evaluation or second save of the
        same step; the checkpoint is made here if the step-end save was vetoed (``save_strategy="best"``)."""
        if self.stop_step is None:
            return
        control.should_evaluate = False
        control.should_save = not self.saved


# --------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.active:
        return False, decision.reason
    callback = find_callback(trainer)
    if callback is None:
        return False, "its callback is not registered on the trainer (removed?): signals are not handled"
    if not callback.armed:
        if callback.was_armed:
            return True, "handlers were in place for the last train() and restored when it ended"
        if outcome.fallbacks:
            return False, outcome.fallbacks[-1]
        return False, "callback registered; the signal handlers are installed when train() starts (re-verified then)"
    left_alone = outcome.facts.get("left_alone", {})
    ours, replaced = [], []
    for name in decision.settings.signals:
        if name in left_alone:
            continue
        current = signal.getsignal(int(getattr(signal, name)))
        (ours if current is callback._handler else replaced).append(f"{name}" if current is callback._handler
                                                                    else f"{name} (now {_handler_name(current)})")
    text = f"callback registered; handlers in place for {', '.join(ours) or 'no signal'}"
    if callback.agreement is not None:
        text += f"; ranks agree over the {callback.agreement.description}"
    if left_alone:
        text += "; left alone: " + "; ".join(f"{n} {why}" for n, why in left_alone.items())
    if replaced:
        return False, f"{text}; replaced after train() started: {', '.join(replaced)}"
    return bool(ours), text
