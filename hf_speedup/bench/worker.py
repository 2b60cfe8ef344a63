"""One variant in its own fresh process: build it, then run one optimizer step per "go" from the parent.

Its own process, so process-wide settings (the CPU allocator, compile caches, CUDA memory) belong to
the variant that asked for them, and its cold start is real. Messages to the parent are JSON lines on
a pipe (``ready``, ``step``, ``done`` or ``error``); the parent's "go" / "finish" arrive on stdin.
A step's time runs from the "go" to the end of ``on_step_end`` (after a device synchronisation): the
rest of the previous loop iteration, fetching and collating the batch, forward, backward, optimizer.

    python -m hf_speedup.bench.worker SPEC.json FD      (started by hf_speedup.bench.runner)
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from types import SimpleNamespace

from .data import as_dataset, make_rows
from .meters import MemoryProbe, StepProfiler, StepSplit, TokenMeter
from .variants import build_trainer, random_model, tokenizer_for


class Channel:
    """JSON lines to the parent on ``fd``; the parent's words on stdin."""

    def __init__(self, fd: int):
        self.out = os.fdopen(fd, "w", buffering=1)

    def send(self, **message) -> None:
        self.out.write(json.dumps(message, default=str) + "\n")
        self.out.flush()

    def recv(self, expected: str) -> None:
        line = sys.stdin.readline().strip()
        if line != expected:
            raise RuntimeError(f"expected {expected!r} from the bench parent, got {line!r}")


class Clock:
    """Times each step from the parent's "go" and waits for the next one (the lock step)."""

    def __init__(self, chan: Channel, device: str, total_steps: int):
        import torch

        self.chan, self.total = chan, total_steps
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.go = 0.0
        self.faults = 0

    def ready(self) -> None:
        self.chan.send(event="ready")
        self.wait()

    def wait(self) -> None:
        self.chan.recv("go")
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.go = time.perf_counter()

    def stop(self) -> tuple[float, int]:
        self.sync()
        return time.perf_counter() - self.go, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults

    def report(self, step: int, seconds: float, faults: int) -> None:
        self.chan.send(event="step", step=step, seconds=seconds, faults=faults)
        if step < self.total:
            self.wait()
        else:  # nothing of the wrap-up runs while another variant's step is timed
            self.chan.recv("finish")


def bench_callback(clock: Clock, meter: TokenMeter, memory: MemoryProbe, loss_steps: set[int],
                   track_at: int | None, device: str, profiler: StepProfiler | None = None,
                   profile_at: int | None = None, split: StepSplit | None = None):
    """The TrainerCallback of the lock step; added last, so every other callback's work is inside the step.
    ``split``: what of each timed step waited for data, was blocked by a save or compiled."""
    from transformers import TrainerCallback

    class BenchCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if device == "cuda":
                import torch

                torch.cuda.reset_peak_memory_stats()
            clock.ready()
            if split is not None:
                split.begin()

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if track_at is not None and state.global_step == track_at:
                memory.start(model, optimizer)

        def on_step_end(self, args, state, control, **kw):
            seconds, faults = clock.stop()
            meter.close_step()
            if split is not None:
                split.close_step()
            if track_at is not None and state.global_step == track_at + 1:
                memory.stop()
            if profile_at is not None and state.global_step == profile_at:
                profiler.stop(seconds)
            if state.global_step in loss_steps:
                control.should_log = True
            clock.report(state.global_step, seconds, faults)
            if split is not None:
                split.clock.mark()  # after the "go": a save of this step is timed from here
            if profile_at is not None and state.global_step == profile_at - 1:
                profiler.start()  # the parent's "go" for the profiled step has come: from here on it is timed

        def on_log(self, args, state, control, **kw):
            if split is not None:
                split.clock.mark()  # the log before a save is not the save

        def on_save(self, args, state, control, **kw):
            if split is not None:
                split.clock.saved()  # the trainer's _save_checkpoint has just returned

    return BenchCallback()


# ------------------------------------------------------------------------------------------- running
def load_factory(target: str):
    """``'path/to/file.py:factory'`` -> the factory function of a custom variant."""
    import importlib.util

    path, _, attr = target.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(f"hf_speedup_bench_custom_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module_spec.loader.exec_module(module)
    return getattr(module, attr)


def run_custom(spec: dict, chan: Channel, clock: Clock, tok, rows, dataset) -> dict:
    """A custom variant: ``factory(ctx)`` returns a runner whose ``step()`` is one lock-step and whose
    ``info(skip=warmup)`` is a dict of notes for the report."""
    from ..tiny import causal_lm_collator

    opts = spec["options"]
    ctx = SimpleNamespace(model=random_model(opts, spec["device"]), rows=rows, dataset=dataset,
                          collator=causal_lm_collator(tok), batch_size=opts["batch_size"], seq_len=opts["seq_len"],
                          device=spec["device"], warmup=spec["warmup"])
    runner = load_factory(spec["custom"])(ctx)
    clock.ready()
    for step in range(1, spec["total_steps"] + 1):
        runner.step()
        seconds, faults = clock.stop()
        clock.report(step, seconds, faults)
    return {"trainer_class": "custom", "info": runner.info(skip=spec["warmup"]),
            "peak_rss_bytes": peak_rss_bytes()}


def peak_rss_bytes() -> int:
    from ..report.measure import peak_rss_bytes as peak

    return peak()


def summarize_trainer(spec: dict, trainer, meter: TokenMeter, memory: MemoryProbe,
                      split: StepSplit | None = None) -> dict:
    """What the parent needs from this process once training is over."""
    import torch

    from ..hardware import cpu_name
    from ..model_info import parameter_counts
    from ..peak_flops import resolve_peak_flops
    from ..report.measure import attention_dims, compute_dtype, dynamo_snapshot
    from ..report.measure.matmul_peak import matmul_peak

    device = spec["device"]
    out: dict = {"trainer_class": type(trainer).__name__, "tokens": meter.per_step(),
                 "attention_length": meter.attention_length()}
    if split is not None:
        out["step_split"] = split.per_step()
    if device == "cuda":
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
        out["peak_memory_source"] = "CUDA max_memory_allocated"
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        out["device_name"] = torch.cuda.get_device_name()
    else:
        out["peak_memory_bytes"] = memory.peak_bytes
        out["peak_memory_source"] = memory.error or "live tensor bytes of one tracked step (MemTracker, eager)"
        out["memory_breakdown"] = memory.breakdown
    out["peak_rss_bytes"] = peak_rss_bytes()
    n = spec["options"]["steps"]
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h}
    out["loss"] = losses.get(n)
    model = trainer.model
    counts = parameter_counts(model)
    layers, width = attention_dims(model)
    dtype = compute_dtype(trainer.args, model, device)
    peak, peak_source = resolve_peak_flops(device, out.get("device_name"), dtype)
    # this machine's own GEMM ceiling in the variant's dtype: timed here, after every timed step of every variant
    # (the parent finishes one worker at a time), once per machine (cached)
    matmul, matmul_source = matmul_peak(device, out.get("device_name") or cpu_name(), dtype)
    out.update(matmul_trainable=counts.matmul_trainable, matmul_frozen=counts.matmul_frozen,
               trainable_parameters=counts.trainable, total_parameters=counts.total, layers=layers,
               attention_width=width, compute_dtype=dtype, peak_flops=peak, peak_flops_source=peak_source,
               matmul_peak_flops=matmul, matmul_peak_source=matmul_source, compile=dynamo_snapshot())
    report = getattr(trainer, "speedup_report", None)
    if report is not None:
        plan = report.to_dict()["plan"]
        out["plan"] = {k: {"applied": v.get("applied"), "engaged": v.get("engaged"), "reason": v.get("reason"),
                           "fallbacks": list(v.get("fallbacks") or [])} for k, v in plan.items()}
    return out


def run(spec: dict, chan: Channel) -> dict:
    opts = spec["options"]
    if opts["threads"]:
        import torch

        torch.set_num_threads(opts["threads"])
    tok = tokenizer_for(opts)
    data = spec.get("rows_file") or opts["data"]  # rows the parent made once (docs-chat), else made here
    rows = make_rows(tok, data, opts["batch_size"] * spec["total_steps"], opts["seq_len"], opts["seed"])
    # TRL wants a datasets.Dataset; the Trainer takes the list as it is (same sampler order: it depends on the
    # length and the seed only), so a GPU image without `datasets` runs every other variant
    dataset = as_dataset(rows) if spec["variant"] in ("trl-sft", "unsloth") else rows
    clock = Clock(chan, spec["device"], spec["total_steps"])
    if spec["kind"] == "custom":
        return run_custom(spec, chan, clock, tok, rows, dataset)
    meter, memory, profiler, split = TokenMeter(), MemoryProbe(), StepProfiler(spec["device"]), StepSplit()
    trainer = build_trainer(spec, meter, tok, dataset, split)
    n, window = opts["steps"], spec["loss_window"]
    track_at = n if spec["track_memory"] else None
    profile_at = spec["total_steps"] if spec.get("breakdown") else None  # the last step, after the tracked one
    trainer.add_callback(bench_callback(clock, meter, memory, {n - window, n} - {0}, track_at, spec["device"],
                                        profiler, profile_at, split))
    trainer.train()
    out = summarize_trainer(spec, trainer, meter, memory, split)
    if profile_at is not None:
        out["time_breakdown"] = profiler.breakdown or {"steps": 0, "reason": profiler.error or "not profiled"}
    return out


def main(argv: list[str]) -> None:
    spec_path, fd = argv[0], int(argv[1])
    chan = Channel(fd)
    with open(spec_path) as fh:
        spec = json.load(fh)
    try:
        result = run(spec, chan)
    except BaseException as exc:  # noqa: BLE001 - the parent shows it as the variant's row
        traceback.print_exc()
        chan.send(event="error", error=f"{type(exc).__name__}: {exc}".strip()[:1500])
        sys.stdout.flush()
        os._exit(1)
    chan.send(event="done", result=result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # leave without interpreter teardown (compile worker pools, gloo threads)


if __name__ == "__main__":
    main(sys.argv[1:])
