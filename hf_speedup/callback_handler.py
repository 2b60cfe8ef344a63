"""The Trainer's callback handler with hf_speedup's own callbacks kept off its list.

A user who swaps ``Trainer`` for ``SpeedupTrainer`` keeps the callback list they know: ``trainer.callback_handler
.callbacks`` (and ``callback_list``, ``pop_callback``, ``remove_callback`` of a user's class) read as the stock
Trainer's. hf_speedup's callbacks (the report collector, the preemption and profiler callbacks, the compile gate)
run after the listed ones on every event. Our per-step metrics reach only the ``report_to`` trackers' ``on_log``,
so ``state.log_history`` (hence ``trainer_state.json``) and every other callback see the stock logs.
"""

from __future__ import annotations

import copy

from transformers.trainer_callback import CallbackHandler


class SpeedupCallbackHandler(CallbackHandler):
    """``callbacks``: the stock list; ``own``: hf_speedup's, called after them."""

    own: list
    tracker_logs: dict  # metrics for the trackers at the next ``on_log`` (then cleared)

    @classmethod
    def adopt(cls, handler: CallbackHandler) -> "SpeedupCallbackHandler":
        """The trainer's handler (its list, model, optimizer, ...) as one of ours; an already adopted one as is."""
        if isinstance(handler, cls):
            return handler
        new = cls.__new__(cls)
        new.__dict__.update(vars(handler))
        new.own, new.tracker_logs = [], {}
        return new

    def add_own(self, callback) -> None:
        self.own.append(callback)

    def pop_callback(self, callback):
        found = super().pop_callback(callback)
        if found is None and (found := _find(self.own, callback)) is not None:
            self.own.remove(found)
        return found

    def remove_callback(self, callback):
        if (found := _find(self.own, callback)) is not None and _find(self.callbacks, callback) is None:
            self.own.remove(found)
            return
        super().remove_callback(callback)

    def call_event(self, event, args, state, control, **kwargs):
        extra = self.tracker_logs if event == "on_log" else None
        if extra:
            self.tracker_logs = {}
            control = self._call_each(event, args, state, control, extra, **kwargs)
        else:
            control = super().call_event(event, args, state, control, **kwargs)
        return self._call(self.own, event, args, state, control, **kwargs)

    def _call_each(self, event, args, state, control, extra: dict, **kwargs):
        """``on_log`` with our metrics added to the logs the trackers see, in the list's order."""
        trackers = tracker_classes()
        logs = kwargs.pop("logs", None) or {}
        for callback in list(self.callbacks):
            seen = {**logs, **extra} if isinstance(callback, trackers) else logs
            control = self._call([callback], event, args, state, control, logs=seen, **kwargs)
        return control

    def _call(self, callbacks: list, event, args, state, control, **kwargs):
        """The stock ``call_event`` over ``callbacks`` (its arguments stay transformers' own), run on a shallow
        copy of this handler, so that ``callbacks`` still reads as the stock list meanwhile."""
        view = copy.copy(self)
        view.callbacks = list(callbacks)
        return CallbackHandler.call_event(view, event, args, state, control, **kwargs)


def _find(callbacks: list, callback):
    if isinstance(callback, type):
        return next((cb for cb in callbacks if isinstance(cb, callback)), None)
    return next((cb for cb in callbacks if cb is callback), None)


def tracker_classes() -> tuple[type, ...]:
    """The callbacks of transformers' ``report_to`` integrations (W&B, TensorBoard, MLflow, ...)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return tuple(cb for cb in INTEGRATION_TO_CALLBACK.values() if isinstance(cb, type))


def all_callbacks(trainer) -> list:
    """Every callback the trainer calls: the listed ones, then hf_speedup's own."""
    handler = getattr(trainer, "callback_handler", None)
    return [*getattr(handler, "callbacks", ()), *getattr(handler, "own", ())]
