"""The compile cache travels with the run: what a process compiled is saved beside each checkpoint and loaded before
the first compile of a run resumed from it (or of a repeated run pointed at a folder, ``compile.cache_dir``), so a new
process with an empty inductor cache does not compile from cold again.

Why: torch's caches live in ``TORCHINDUCTOR_CACHE_DIR`` (``/tmp`` by default), which a requeued job on another node or
in a fresh container does not have, so every process paid the whole cold compile again.

What is saved: ``compile_cache.bin``, a zip of torch's portable cache artifacts (``torch.compiler.save_cache_artifacts``:
the AOTAutograd and inductor graphs and autotune results; on CUDA the Triton kernels are bundled in them) and, on CPU,
the compiled C++ kernels (``.so``) those graphs load, which torch's artifacts leave out (without them a cache hit still
rebuilds every kernel with the C++ compiler, most of a CPU cold compile). Beside it ``compile_cache.json``: the torch
version, the device, the model's identity (classes, the compiled regions' parameter names, shapes and dtypes,
precision), the compile settings, the zip's sha256 and the compile seconds of the runs that wrote it.

Loaded only where the header matches this run: a cache from another torch version, device, model or compile settings,
and a corrupted one, is ignored with the reason (logged, in the report's compile entry), never an error. Verified by
torch's own counters (``cache_hits``/``cache_misses``: FX-graph and AOTAutograd cache lookups during the run,
``cache_graphs_compiled``: graphs inductor compiled from scratch).

The cache is code (pickles and shared libraries): load only checkpoints you trust, as with any checkpoint's pickles.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field

from transformers import TrainerCallback

from . import cache_files as files
from .regions import guarded_regions

logger = logging.getLogger("hf_speedup")

FILE = "compile_cache.bin"
HEADER = "compile_cache.json"
VERSION = 1
HANDOFF = "compile_cache"  # Outcome.handoff key: this run's CacheState
SAVED_STEP = "compile_cache_saved_step"  # Outcome.handoff key: the step whose checkpoint has the cache
# A compile from the cache as a share of the cold compile recorded with it, until a run that compiled from the cache
# has recorded its own: SmolLM2-135M's blocks under `fast` (inductor, max-autotune, CPU) in a new process with an
# empty inductor cache compiled in 5.7 s from the cache against 40.2 s cold (0.14x; a quiet 2-core Xeon,
# benchmarks/compile_resume.py, RESULTS.md); rounded up, since a machine may first build inductor's precompiled header
CACHED_SHARE = 0.2


@dataclass
class CacheState:
    """One ``train()``'s compile cache: what was loaded (or why not), torch's counters when the run began."""

    loaded: bool = False
    source: str | None = None
    reason: str = ""
    header: dict | None = None
    entries: dict = field(default_factory=dict)
    kernels: list = field(default_factory=list)  # kernel paths restored into the inductor cache directory
    counters: dict = field(default_factory=dict)
    compile_seconds: float = 0.0  # dynamo's compile seconds when the run began
    note: str | None = None  # the note this state added to the outcome


# --------------------------------------------------------------------------------------------- identity
def _compile_of(trainer):
    """(decision, outcome) of an active compile feature on ``trainer`` (None: not a SpeedupTrainer, or off)."""
    plan, outcomes = getattr(trainer, "speedup_plan", None), getattr(trainer, "speedup_outcomes", None)
    if plan is None or outcomes is None:
        return None
    decision, outcome = getattr(plan, "decisions", {}).get("compile"), outcomes.get("compile")
    return (decision, outcome) if decision is not None and outcome is not None and decision.active else None


def identity(trainer, decision, outcome) -> dict:
    """What a cache must have been written for to be of use here."""
    import torch

    caps, s, model = trainer.speedup_plan.caps, decision.settings, trainer.model
    args = trainer.args
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    config = getattr(model, "config", None)
    return {
        "torch": torch.__version__, "device_type": caps.device_type, "device_name": caps.device_name,
        "model": {"class": type(model).__name__, "config": type(config).__name__ if config is not None else None,
                  "regions": _regions_digest(model), "precision": precision},
        "compile": {"backend": s.backend, "mode": s.mode, "dynamic": s.dynamic, "fullgraph": s.fullgraph,
                    "regions": s.regions, "cpu_gemm": outcome.facts.get("cpu_gemm", s.cpu_gemm)},
    }


def _regions_digest(model) -> str:
    """A hash of each compiled region kind's parameters (names, shapes, dtypes, trainable or not)."""
    import torch

    kinds: dict[str, list] = {}
    for region in guarded_regions(model):
        module = getattr(region.eager, "__self__", None)
        params = ([(n, list(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in module.named_parameters()]
                  if isinstance(module, torch.nn.Module) and region.kind != "loss" else [])
        kinds.setdefault(region.kind, params)
    return hashlib.sha256(json.dumps(sorted(kinds.items())).encode()).hexdigest()[:16]


def _mismatch(found: dict, here: dict) -> str | None:
    """Why a cache written for ``found`` is of no use ``here`` (None: it is)."""
    if found.get("torch") != here["torch"]:
        return f"written by torch {found.get('torch')} (this is torch {here['torch']})"
    if (found.get("device_type"), found.get("device_name")) != (here["device_type"], here["device_name"]):
        return (f"written on {found.get('device_type')} {found.get('device_name')!r} (this is {here['device_type']} "
                f"{here['device_name']!r})")
    for part, what in (("model", "another model"), ("compile", "other compile settings")):
        theirs, ours = found.get(part), here[part]
        theirs = theirs if isinstance(theirs, dict) else {}
        if theirs != ours:
            diff = ", ".join(f"{k} {theirs.get(k)!r} here {ours[k]!r}" for k in ours if theirs.get(k) != ours[k])
            return f"written for {what} ({diff or 'other fields'})"
    return None


# --------------------------------------------------------------------------------------------- torch's counters
def cache_counters() -> dict:
    """torch's cache lookups in this process so far (nothing imported when dynamo never ran)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    inductor, aot = counters.get("inductor", {}), counters.get("aot_autograd", {})
    return {"fxgraph_hit": inductor.get("fxgraph_cache_hit", 0), "fxgraph_miss": inductor.get("fxgraph_cache_miss", 0),
            "autograd_hit": aot.get("autograd_cache_hit", 0), "autograd_miss": aot.get("autograd_cache_miss", 0)}


def _compile_seconds() -> float:
    """dynamo's compile seconds in this process so far (frames, with their backend, and lazy backward graphs)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics as times

    return float(sum(times.get("_compile.compile_inner", ())) + sum(times.get("backward._backward_impl", ())))


def refresh(outcome) -> None:
    """The run's cache hits and misses into the compile entry's facts (from torch's counters)."""
    state = outcome.handoff.get(HANDOFF)
    if state is None:
        return
    now = cache_counters()
    delta = {k: now.get(k, 0) - state.counters.get(k, 0) for k in now}
    outcome.facts["cache_hits"] = delta.get("fxgraph_hit", 0) + delta.get("autograd_hit", 0)
    outcome.facts["cache_misses"] = delta.get("fxgraph_miss", 0) + delta.get("autograd_miss", 0)
    outcome.facts["cache_graphs_compiled"] = delta.get("fxgraph_miss", 0)  # inductor graphs compiled from scratch
    # this train()'s own (the report's compile_seconds counts the whole run, the runs before a resume included)
    outcome.facts["compile_seconds_this_process"] = round(_compile_seconds() - state.compile_seconds, 3)


def cached_cost(outcome) -> tuple[float, str] | None:
    """(seconds, text) a compile costs with the cache this run loaded (None: none loaded), for ``pays_back``."""
    state = outcome.handoff.get(HANDOFF)
    if state is None or not state.loaded:
        return None
    header = state.header or {}
    measured, cold = header.get("cached_compile_seconds"), header.get("cold_compile_seconds")
    if isinstance(measured, (int, float)):
        return float(measured), (f"a compile from the compile cache loaded from {state.source} (~{measured:.3g} s, "
                                 "measured by a run that compiled from it)")
    if isinstance(cold, (int, float)):
        cost = cold * CACHED_SHARE
        return cost, (f"a compile from the compile cache loaded from {state.source} (~{cost:.3g} s: estimated as "
                      f"{CACHED_SHARE:.0%} of the {cold:.3g} s cold compile recorded with it)")
    return None


# --------------------------------------------------------------------------------------------- save
def write_into(trainer, folder: str, final: str | None = None) -> dict | None:
    """Save this process's compile cache into ``folder`` (a checkpoint being written, renamed to ``final`` once
    complete), atomically; the facts for the report (``path``: ``final``, ``bytes``, ``entries``, ``step``), or None
    where there is nothing to save (compile off, ``compile.cache_dir: none``, not the saving process, nothing
    compiled). Never raises: a save goes on without it."""
    found = _compile_of(trainer)
    if found is None or found[0].settings.cache_dir == "none" or not trainer.args.should_save:
        return None
    facts = _save(trainer, *found, folder, "cache_saved")
    if facts is not None and final is not None:
        facts["path"] = final
    if facts is not None:
        found[1].handoff[SAVED_STEP] = trainer.state.global_step
    return facts


def _save(trainer, decision, outcome, folder: str, fact: str) -> dict | None:
    """Write the cache into ``folder``; its facts (or the error) under ``outcome.facts[fact]``."""
    state = outcome.handoff.get(HANDOFF) or CacheState()
    try:
        packed = files.pack(state.kernels)
        if packed is None:
            facts = _copy_loaded(state, folder, trainer.state.global_step)
            if facts is not None:
                outcome.facts[fact] = facts
            return facts
        data, entries = packed
        header = {"version": VERSION, **identity(trainer, decision, outcome), "sha256": hashlib.sha256(data).hexdigest(),
                  "bytes": len(data), "entries": entries, "step": trainer.state.global_step,
                  **_compile_figures(state)}
        os.makedirs(folder, exist_ok=True)
        files.write_atomically(os.path.join(folder, FILE), data)
        files.write_atomically(os.path.join(folder, HEADER), json.dumps(header, indent=1).encode())
    except Exception as exc:  # a checkpoint must never fail for its compile cache
        logger.warning("hf_speedup: compile cache not saved into %s (%s: %s); a resume from it compiles cold",
                       folder, type(exc).__name__, exc)
        outcome.facts[fact] = {"path": folder, "error": f"{type(exc).__name__}: {exc}"[:300]}
        return None
    facts = {"path": folder, "bytes": len(data), "entries": entries, "step": trainer.state.global_step}
    outcome.facts[fact] = facts
    return facts


def _copy_loaded(state: CacheState, folder: str, step: int) -> dict | None:
    """Nothing compiled in this process (``pays_back`` declined, say): the cache it loaded goes on to ``folder``."""
    if not state.loaded or state.source is None or os.path.normpath(state.source) == os.path.normpath(folder):
        return None
    os.makedirs(folder, exist_ok=True)
    for name in (FILE, HEADER):  # the header last: it names the zip's checksum
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
        shutil.copyfile(os.path.join(state.source, name), tmp)
        os.replace(tmp, os.path.join(folder, name))
    return {"path": folder, "bytes": os.path.getsize(os.path.join(folder, FILE)), "entries": state.entries,
            "step": step, "copied_from": state.source}


def _compile_figures(state: CacheState) -> dict:
    """The compile seconds a resume's ``pays_back`` weighs: this run's, as the cold figure where inductor compiled a
    graph from scratch, as the cached one where every graph came from a cache; the other carried over from the header
    the run loaded."""
    seconds = round(_compile_seconds() - state.compile_seconds, 3)
    carried = state.header or {}
    counts = cache_counters()
    misses = counts.get("fxgraph_miss", 0) - state.counters.get("fxgraph_miss", 0)
    hits = counts.get("fxgraph_hit", 0) - state.counters.get("fxgraph_hit", 0)
    return {"cold_compile_seconds": seconds if misses > 0 else carried.get("cold_compile_seconds"),
            "cached_compile_seconds": seconds if hits > 0 and misses == 0 else carried.get("cached_compile_seconds")}


# --------------------------------------------------------------------------------------------- load
def load_for_run(trainer, decision, outcome) -> CacheState:
    """Before the run's first compile: the cache of the checkpoint it resumes from, else of ``compile.cache_dir``'s
    folder, loaded into torch's caches where it matches this run; why not otherwise (a note and a warning)."""
    previous = outcome.handoff.get(HANDOFF)
    if previous is not None and previous.note in outcome.notes:
        outcome.notes.remove(previous.note)
    state = CacheState(counters=cache_counters(), compile_seconds=_compile_seconds())
    outcome.handoff[HANDOFF] = state
    setting = decision.settings.cache_dir
    resumed = getattr(trainer, "speedup_resumed_from", None)
    folders = [f for f in (resumed, None if setting in ("auto", "none") else setting) if f]
    if setting == "none":
        state.reason = "compile.cache_dir = none: no compile cache loaded or saved"
    elif not folders:
        state.reason = ("a fresh run: no compile cache to load (a resumed run loads the one saved in its checkpoint; "
                        "compile.cache_dir: <folder> reuses one across runs)")
    else:
        here, reasons = identity(trainer, decision, outcome), []
        for folder in folders:
            if _load_from(_cache_folder(str(folder)), here, state):
                break
            reasons.append(state.reason)
        else:
            state.reason = "; ".join(reasons)
    outcome.facts.update(cache_loaded=state.loaded, cache_source=state.source, cache_reason=state.reason,
                         cache_entries=state.entries or None)
    if state.loaded or (folders and setting != "none"):
        state.note = state.reason
        outcome.notes.append(state.note)
    (logger.warning if " ignored: " in state.reason else logger.info)("hf_speedup: %s", state.reason)
    return state


def _cache_folder(folder: str) -> str:
    """``folder`` itself where it holds a cache; else its newest ``checkpoint-N`` that does (a run's output_dir)."""
    if os.path.isfile(os.path.join(folder, HEADER)):
        return folder
    found = [(int(m.group(1)), path) for path in glob.glob(os.path.join(glob.escape(folder), "checkpoint-*"))
             if (m := re.search(r"checkpoint-(\d+)$", path)) and os.path.isfile(os.path.join(path, HEADER))]
    return max(found)[1] if found else folder


def _load_from(folder: str, here: dict, state: CacheState) -> bool:
    """Load ``folder``'s cache into torch's caches if it is of use here; the reason either way into ``state``."""
    header_path = os.path.join(folder, HEADER)
    if not os.path.isfile(header_path):
        state.reason = f"no compile cache in {folder} ({HEADER} not there): the blocks compile cold"
        return False

    def ignored(why: str) -> bool:
        state.reason = f"compile cache in {folder} ignored: {why}; the blocks compile cold"
        return False

    try:
        with open(header_path, "rb") as fh:
            header = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        return ignored(f"{HEADER} is corrupted ({type(exc).__name__}: {exc})")
    if not isinstance(header, dict) or header.get("version") != VERSION:
        found = header.get("version") if isinstance(header, dict) else type(header).__name__
        return ignored(f"{HEADER} is corrupted or of another format (version {found!r}, expected {VERSION})")
    if why := _mismatch(header, here):
        return ignored(why)
    try:
        with open(os.path.join(folder, FILE), "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return ignored(f"{FILE} is corrupted or missing ({type(exc).__name__}: {exc})")
    if len(data) != header.get("bytes") or hashlib.sha256(data).hexdigest() != header.get("sha256"):
        return ignored(f"{FILE} is corrupted ({len(data)} bytes, its checksum differs from the one {HEADER} recorded)")
    try:
        unpacked = files.unpack(data)
    except Exception as exc:  # a bad zip, a bad pickle: never a crash
        return ignored(f"{FILE} is corrupted ({type(exc).__name__}: {exc})"[:400])
    if unpacked is None:
        return ignored(f"{FILE} is corrupted (torch could not read its cache artifacts)")
    entries, state.kernels = unpacked
    state.loaded, state.source, state.header, state.entries = True, folder, header, entries
    kinds = ", ".join(f"{n} {kind}" for kind, n in entries.items())
    state.reason = (f"compile cache loaded from {folder} ({kinds}; {len(data) / 1e6:.1f} MB, written at step "
                    f"{header.get('step')}): graphs found there are not compiled again")
    return True


# --------------------------------------------------------------------------------------------- callback
class CompileCacheCallback(TrainerCallback):
    """Loads the cache at train begin (before the first forward); saves it where the staged checkpoint save has not
    (``crash_safe`` off) and into ``compile.cache_dir``'s folder."""

    def __init__(self, trainer, decision, outcome):
        self.trainer, self.decision, self.outcome = trainer, decision, outcome

    def on_train_begin(self, args, state, control, **kwargs):
        try:
            load_for_run(self.trainer, self.decision, self.outcome)
        except Exception as exc:  # the cache must never stop a run
            self.outcome.facts.update(cache_loaded=False, cache_reason=f"compile cache not loaded: {exc!r}"[:400])
            logger.warning("hf_speedup: compile cache not loaded (%r); the blocks compile cold", exc)

    def on_save(self, args, state, control, **kwargs):
        refresh(self.outcome)
        if self.outcome.handoff.get(SAVED_STEP) != state.global_step:  # the staged save did not write it
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(folder):
                write_into(self.trainer, folder)
        self._into_users_folder()

    def on_train_end(self, args, state, control, **kwargs):
        refresh(self.outcome)
        self._into_users_folder()

    def _into_users_folder(self) -> None:
        folder = self.decision.settings.cache_dir
        if folder in ("auto", "none") or not self.trainer.args.should_save:
            return
        if os.path.isfile(os.path.join(folder, "trainer_state.json")):
            return  # another run's checkpoint: read from, never written into
        _save(self.trainer, self.decision, self.outcome, folder, "cache_saved_to_folder")
