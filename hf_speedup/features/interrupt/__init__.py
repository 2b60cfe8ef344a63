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

Here: the decision, the wiring into ``train()`` and the verification; the handlers, the callback and
:class:`TrainingInterrupted` are in ``callback.py``, the ranks' agreement in ``ranks.py``.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from ...callback_handler import all_callbacks
from ...plan_types import OFF, Decision, Outcome, PlanContext
from .callback import InterruptCallback, TrainingInterrupted, _handler_name

__all__ = ["APPLIED", "APPLIES_TO", "NAME", "STOCK_TRAINER", "InterruptCallback", "Settings", "TrainingInterrupted",
           "apply", "armed", "callbacks", "decide", "during_train", "find_callback", "training_args", "verify"]

NAME = "interrupt"
APPLIES_TO = "train"
logger = logging.getLogger("hf_speedup")
APPLIED = "save-and-exit"
STOCK_TRAINER = "the stock Trainer keeps the default signal actions"  # what training_arguments() users get


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
