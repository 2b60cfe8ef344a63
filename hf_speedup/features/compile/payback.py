"""``compile.when: pays_back``: compile the blocks only when this run is long enough to earn the cold compile back.

A cold compile is a fixed cost paid in the first step; what it buys is a fraction of every later step. On a short
run the fixed cost wins: on a 2-core Intel Xeon (AVX-512, no AMX), 200 steps of the tiny Llama on ragged rows took
52.9 s with compiled blocks (24.5 s of it compiling) and 32.2 s eager (benchmarks/RESULTS.md). So the regions are
installed at once, the first steps run eager and are timed, and then the gate opens only if

    remaining steps x eager step time x gain  >  compile cost

Either verdict is written into the report and logged. Only devices with measured constants defer: elsewhere (CUDA,
until measured there) and in multi-process runs (ranks timing their own steps could decide differently) the
regions compile from the first step, as ``when: always``.
"""

from __future__ import annotations

import logging
import time

from transformers import TrainerCallback

from ...plan_types import Outcome

logger = logging.getLogger("hf_speedup")

# device type -> (fraction of a step that compiled blocks save, seconds a cold compile of one block kind costs,
# seconds each further static shape costs). CPU, measured with benchmarks/bench_sft.py (fp32 tiny Llama, ragged
# rows): steady 8,412 tokens/s compiled vs 7,564 eager (+11%) on a 2-core Intel Xeon AVX-512, with a cold compile
# of 16-25 s there and 15 s on a 2-core AMD EPYC (AVX2); static shapes bucketed by length compiled 4 graphs in 42 s
# on that EPYC (~9 s for each after the first).
PAYBACK = {"cpu": (0.10, 20.0, 9.0)}
MEASURED_STEPS = 2  # eager steps timed after the first one (which carries one-off costs) before deciding
OPENED_AFTER_STEP = "compile_opened_after_step"  # outcome fact: the global step after which the gate opened
STATIC_SHAPES = 8  # static shapes: a graph per padded length, counted up to dynamo's default recompile_limit


def compile_cost(device_type: str, static_shapes: bool) -> float:
    _, cold, per_shape = PAYBACK[device_type]
    return cold + (STATIC_SHAPES - 1) * per_shape if static_shapes else cold


def compile_cost_text(device_type: str, static_shapes: bool) -> str:
    cost = compile_cost(device_type, static_shapes)
    if static_shapes:
        return (f"the compiles (~{cost:.0f} s: static shapes compile a graph per padded length, counted for "
                f"{STATIC_SHAPES} lengths)")
    return f"a cold compile (~{cost:.0f} s)"


DECLINED = "eager (compile declined: it would not pay back)"  # Outcome.applied after a declined verdict


class CompileGate:
    """Whether the guarded regions of one model run compiled yet; shared by all of them."""

    def __init__(self, open_: bool = True):
        self.open = open_
        self.declined = False
        self.verdict = ""  # why it opened or stays shut (``pays_back``)

    def decide(self, step_seconds: float, remaining: int, gain: float, cost_seconds: float, cost_text: str) -> str:
        saving = gain * step_seconds * remaining
        costs = (f"{remaining} step(s) left at {step_seconds:.3g} s eager: compiled blocks would save ~{saving:.3g} s "
                 f"({gain:.0%} of a step) against {cost_text}")
        if saving > cost_seconds:
            self.open = True
            self.verdict = f"compile.when = pays_back: compiling from the next step: {costs}"
        else:
            self.declined = True
            self.verdict = (f"compile.when = pays_back: not compiled for this run, it would not pay back: {costs}; "
                            "fix: compile.when: always to compile anyway")
        return self.verdict

    def decline(self, why: str) -> str:
        self.declined = True
        self.verdict = f"compile.when = pays_back: not compiled for this run: {why}; fix: compile.when: always"
        return self.verdict

    @property
    def pending(self) -> bool:
        return not self.open and not self.declined

    def reconsider(self) -> None:
        """A new ``train()`` (a longer run, a resume): a declined verdict is taken again; an open gate stays open."""
        if self.declined:
            self.declined, self.verdict = False, ""


class PaybackCallback(TrainerCallback):
    """Times the first eager steps of the run, then opens the gate or declines (once per gate)."""

    def __init__(self, trainer, outcome: Outcome, device_type: str, gate_of, static_shapes: bool = False):
        self.trainer = trainer
        self.outcome = outcome
        self.gain = PAYBACK[device_type][0]
        self.cost = compile_cost(device_type, static_shapes)
        self.cost_text = compile_cost_text(device_type, static_shapes)
        self.gate_of = gate_of  # model -> its CompileGate (a model_init trial brings a new model and gate)
        self.ends: list[float] = []
        self.verdict: str | None = None  # the note this callback added (replaced when train() runs again)
        self._gate: tuple = (None, None)  # (model, its gate): found again only when the trainer's model changes

    def _current_gate(self) -> CompileGate | None:
        model = self.trainer.model
        if self._gate[0] is not model:
            self._gate = (model, self.gate_of(model))
        return self._gate[1]

    def on_train_begin(self, args, state, control, **kwargs):
        self.ends = []
        if self.outcome.applied == DECLINED:
            self.outcome.applied = None  # taken again below
        self._gate = (None, None)
        gate = self._current_gate()
        if gate is not None:
            gate.reconsider()
        if gate is not None and gate.pending and state.max_steps - state.global_step <= MEASURED_STEPS + 1:
            self._settle(gate.decline(f"the run has {state.max_steps - state.global_step} step(s) left, too few to "
                                      "earn back a cold compile"), gate)

    def on_step_end(self, args, state, control, **kwargs):
        gate = self._current_gate()
        if gate is None or not gate.pending:
            return
        self.ends.append(time.perf_counter())
        if len(self.ends) <= MEASURED_STEPS:
            return
        step_seconds = min(b - a for a, b in zip(self.ends, self.ends[1:]))  # noise only adds time
        self._settle(gate.decide(step_seconds, state.max_steps - state.global_step, self.gain, self.cost,
                                 self.cost_text), gate)
        if gate.open:  # the report counts the next step's compile as the cold one, not as recompiling
            self.outcome.facts[OPENED_AFTER_STEP] = state.global_step

    def _settle(self, verdict: str, gate: CompileGate) -> None:
        if self.verdict in self.outcome.notes:
            self.outcome.notes.remove(self.verdict)
        self.verdict = verdict
        self.outcome.notes.append(verdict)
        # a declined compile never reads as applied: the blocks run eager until a later train() reconsiders
        self.outcome.applied = DECLINED if gate.declined else None
        (logger.warning if gate.declined else logger.info)("hf_speedup: %s", verdict)
