"""The signal side and the loop side of the interrupt feature: handlers that only record a signal, the callback
that turns it into a checkpoint of the current step and a stop, and :class:`TrainingInterrupted`, raised when
``train()`` returns. The feature's decision and verification are in the package's ``__init__``."""

from __future__ import annotations

import logging
import os
import signal
import threading

from transformers import TrainerCallback

from ...plan_types import Decision, Outcome
from .ranks import _RankAgreement

logger = logging.getLogger("hf_speedup")


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


def _handler_name(handler) -> str:
    if handler is None:
        return "a handler set outside Python"
    if handler in (signal.SIG_DFL, signal.SIG_IGN):
        return signal.Handlers(handler).name
    return f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', repr(handler))}"

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
