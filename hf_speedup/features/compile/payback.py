"""``compile.when: pays_back``: compile the blocks only when this run is long enough to earn the cold compile back.

A cold compile is a fixed cost paid in the first step; what it buys is a fraction of every later step. On a short
run the fixed cost wins: on a 2-core Intel Xeon (AVX-512, no AMX), 200 steps of the tiny Llama on ragged rows took
52.9 s with compiled blocks (24.5 s of it compiling) and 32.2 s eager (benchmarks/RESULTS.md). So the regions are
installed at once, the first steps run eager and are timed, and then the gate opens only if

    remaining steps x eager step time x gain  >  compile cost

Either verdict is written into the report and logged. Only devices with measured constants defer: elsewhere (CUDA,
until measured there) and in multi-process runs (ranks timing their own steps could decide differently) the
regions compile from the first step, as ``when: always``.

The gain and the cold compile's cost: ``PAYBACK`` holds constants fitted on ``SOURCE``. A run whose gate opened
measures both on this machine as it goes (the cold step against the eager steps timed before it, then
``COMPILED_STEPS`` compiled steps), and records them (:func:`hf_speedup.measured.record`, keyed by machine, model
shape and compile settings); a later plan for the same machine and model reads them back at the door (``measure``)
and decides by them, saying so ("gain 13% and compile 17 s measured on this machine (cached)").

A run that loaded a compile cache (``cache.py``: a resume, or ``compile.cache_dir``) weighs a compile from that cache
instead: what a run that compiled from it recorded in its header, else a share of the cold compile recorded there.
"""

from __future__ import annotations

import logging
import time

from transformers import TrainerCallback

from ...measured import Measurement, lookup, measuring_enabled, record
from ...plan_types import Outcome

logger = logging.getLogger("hf_speedup")

# device type -> (fraction of a step that compiled blocks save, seconds a cold compile of one block kind costs,
# seconds each further static shape costs). CPU, measured with benchmarks/bench_sft.py (fp32 tiny Llama, ragged
# rows): steady 8,412 tokens/s compiled vs 7,564 eager (+11%) on a 2-core Intel Xeon AVX-512, with a cold compile
# of 16-25 s there and 15 s on a 2-core AMD EPYC (AVX2); static shapes bucketed by length compiled 4 graphs in 42 s
# on that EPYC (~9 s for each after the first).
PAYBACK = {"cpu": (0.10, 20.0, 9.0)}
SOURCE = "a 2-core Intel Xeon (AVX-512) and a 2-core AMD EPYC (AVX2), benchmarks/RESULTS.md"  # where PAYBACK came from
KEY = "compile.payback"  # Capabilities.measured key: Measurement({"gain": fraction, "compile_s": seconds})
MEASURED_STEPS = 2  # eager steps timed after the first one (which carries one-off costs) before deciding
COMPILED_STEPS = 2  # compiled steps timed after the cold one before the run's own gain and compile are recorded
OPENED_AFTER_STEP = "compile_opened_after_step"  # outcome fact: the global step after which the gate opened
STATIC_SHAPES = 8  # static shapes: a graph per padded length, counted up to dynamo's default recompile_limit


def figures(caps) -> tuple[float, float, float, str]:
    """(gain, cold compile seconds, seconds per further static shape, where they came from) for ``caps``' device:
    this machine's own figures for this model where a run recorded them, else the constants."""
    gain, cold, per_shape = PAYBACK[caps.device_type]
    m = caps.measured.get(KEY)
    if m is not None:
        return (float(m.value["gain"]), float(m.value["compile_s"]), per_shape,
                f"gain {m.value['gain']:.0%} and compile {m.value['compile_s']:.0f} s {m.text()}")
    return gain, cold, per_shape, f"constants measured on {SOURCE}"


def compile_cost(caps, static_shapes: bool) -> float:
    _, cold, per_shape, _ = figures(caps)
    return cold + (STATIC_SHAPES - 1) * per_shape if static_shapes else cold


def compile_cost_text(caps, static_shapes: bool) -> str:
    cost = compile_cost(caps, static_shapes)
    if static_shapes:
        return (f"the compiles (~{cost:.0f} s: static shapes compile a graph per padded length, counted for "
                f"{STATIC_SHAPES} lengths)")
    return f"a cold compile (~{cost:.0f} s)"


def payback_key(caps, model, cfg) -> dict | None:
    """What a run's gain and compile time depend on: machine, model shape, the compile section as asked (the door
    reads it before any decision; None: no model)."""
    if model is None:
        return None
    shape = getattr(model, "shape", None)
    dims = [model.hidden_size, getattr(shape, "intermediate_size", None), model.num_blocks, model.vocab_size]
    return {"machine": caps.device_name, "threads": caps.cpu_threads, "torch": caps.torch_version,
            "model": [model.architecture, *dims], "block": model.block_class, "backend": cfg.backend,
            "mode": cfg.mode, "dynamic": cfg.dynamic, "regions": cfg.regions}


def measure(config, caps, model) -> dict:
    """The ``measure`` hook: what an earlier ``pays_back`` run on this machine recorded for this model (nothing is
    timed here: the figures come from runs, :meth:`PaybackCallback.on_step_end`)."""
    cfg = config.compile
    if cfg.enabled is False or cfg.when != "pays_back" or caps.device_type not in PAYBACK or caps.distributed:
        return {}
    key = payback_key(caps, model, cfg)
    found = lookup(KEY, key) if key is not None else None
    return {KEY: found} if found is not None else {}


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

    def __init__(self, trainer, outcome: Outcome, caps, gate_of, static_shapes: bool = False, key: dict | None = None,
                 cached_cost=None):
        self.trainer = trainer
        self.outcome = outcome
        self.gain, _, _, self.source = figures(caps)
        self.cold = (compile_cost(caps, static_shapes), compile_cost_text(caps, static_shapes) + f" ({self.source})")
        self.cost, self.cost_text = self.cold
        # outcome -> (seconds, text) of a compile from the compile cache this run loaded, or None (cache.cached_cost)
        self.cached_cost = cached_cost
        self.from_cache = False  # this run loaded a compile cache: its compile costs what the cache says, not a cold one
        self.gate_of = gate_of  # model -> its CompileGate (a model_init trial brings a new model and gate)
        self.key = key  # where this machine's own gain and compile time are recorded (None: not recorded)
        self.where = f"{caps.device_name}, {caps.cpu_threads} threads, torch {caps.torch_version}"
        self.ends: list[float] = []
        self.eager_step = 0.0  # the eager step time the verdict used
        self.after_open: list[float] = []  # step ends from the opening step on: the cold step, then compiled ones
        self.verdict: str | None = None  # the note this callback added (replaced when train() runs again)
        self._gate: tuple = (None, None)  # (model, its gate): found again only when the trainer's model changes

    def _current_gate(self) -> CompileGate | None:
        model = self.trainer.model
        if self._gate[0] is not model:
            self._gate = (model, self.gate_of(model))
        return self._gate[1]

    def on_train_begin(self, args, state, control, **kwargs):
        self.ends, self.after_open = [], []
        self._weigh_cache()
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
        if gate is not None and self.after_open:
            self._time_compiled(gate)
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
            self.eager_step, self.after_open = step_seconds, [self.ends[-1]]

    def _weigh_cache(self) -> None:
        """The compile's cost for this run: a cold compile's, or what the compile cache loaded at train begin (the
        cache's callback runs first) says a compile from it costs."""
        cached = self.cached_cost(self.outcome) if self.cached_cost is not None else None
        self.from_cache = cached is not None
        self.cost, self.cost_text = cached if cached is not None else self.cold
        self.outcome.facts["payback_compile_cost_s"] = round(self.cost, 3)

    def _time_compiled(self, gate: CompileGate) -> None:
        """After the gate opened: the cold step, then ``COMPILED_STEPS`` compiled ones; then this machine's gain and
        cold compile for this model are recorded for later plans (where measuring is on)."""
        self.after_open.append(time.perf_counter())
        if len(self.after_open) < COMPILED_STEPS + 2 or not gate.open:
            return
        ends, self.after_open = self.after_open, []
        cold, compiled = ends[1] - ends[0], min(b - a for a, b in zip(ends[1:], ends[2:]))
        gain, compile_s = 1.0 - compiled / self.eager_step, max(0.0, cold - compiled)
        note = (f"compiled blocks measured in this run: compiled steps {compiled:.3g} s against "
                f"{self.eager_step:.3g} s eager (gain {gain:.0%}), cold compile {compile_s:.3g} s")
        self.outcome.facts["payback_measured"] = {"gain": round(gain, 4), "compile_s": round(compile_s, 2),
                                                  "eager_step_s": self.eager_step, "compiled_step_s": compiled}
        if self.from_cache:  # not this machine's cold compile: the cache's header keeps it for the next resume
            note += " (compiled from the loaded compile cache: not recorded as this machine's cold compile)"
        elif self.key is not None and measuring_enabled():
            record(KEY, self.key, Measurement({"gain": round(gain, 4), "compile_s": round(compile_s, 2)},
                                              "measured on this machine", self.where))
            note += "; recorded for later plans of this model on this machine"
        self.outcome.notes.append(note)
        logger.info("hf_speedup: %s", note)

    def _settle(self, verdict: str, gate: CompileGate) -> None:
        if self.verdict in self.outcome.notes:
            self.outcome.notes.remove(self.verdict)
        self.verdict = verdict
        self.outcome.notes.append(verdict)
        # a declined compile never reads as applied: the blocks run eager until a later train() reconsiders
        self.outcome.applied = DECLINED if gate.declined else None
        (logger.warning if gate.declined else logger.info)("hf_speedup: %s", verdict)
