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

from ..report.measure import attention_length, batch_counts
from .data import as_dataset, make_rows
from .options import LORA_REFERENCE, preset_config


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


class TokenMeter:
    """Non-padding tokens per optimizer step, as the trainer's ``training_step`` receives its batches."""

    def __init__(self) -> None:
        self.current: list = []
        self.steps: list[list] = []

    def add(self, inputs) -> None:
        self.current.append(batch_counts(inputs))  # the report's own counting, on the device (no sync)

    def close_step(self) -> None:
        self.steps.append(self.current)
        self.current = []

    def per_step(self) -> list[int]:
        return [int(sum(int(x[0]) for x in parts)) for parts in self.steps]

    def attention_length(self) -> float | None:
        """S of the FLOPs formula over every step: sum(L_i^2) / sum(L_i) of the sequences trained on."""
        counts = [x for parts in self.steps for x in parts]
        return attention_length(sum(int(x[2]) for x in counts), sum(int(x[3]) for x in counts)) if counts else None


class _NoHook:
    def remove(self) -> None:
        pass


class MemoryProbe:
    """CPU: live tensor bytes of one step as torch's MemTracker counts them (parameters, gradients,
    optimizer state, activations, temporaries). Under its dispatch mode torch.compile steps aside, so the
    tracked step runs eager: compiled variants show their eager footprint."""

    def __init__(self) -> None:
        self.tracker = None
        self.peak_bytes: int | None = None
        self.breakdown: dict = {}
        self.error: str | None = None

    def start(self, model, optimizer) -> None:
        try:
            from torch.distributed._tools.mem_tracker import MemTracker

            from ..compat import unwrap_optimizer

            self.tracker = MemTracker()
            # MemTracker puts a gradient hook on every parameter, which torch refuses for frozen ones (LoRA's
            # base): mark those as hooked already, with a handle that removes nothing.
            for param in model.parameters():
                if not param.requires_grad:
                    self.tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
            self.tracker.track_external(model, unwrap_optimizer(optimizer) if optimizer is not None else None)
            self.tracker.__enter__()
        except Exception as exc:  # the measurement must never break the benchmark; say why instead
            self.tracker, self.error = None, f"MemTracker could not start: {exc!r}"

    def stop(self) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.__exit__(None, None, None)
            peak = self.tracker.get_tracker_snapshot("peak")
            self.peak_bytes = int(sum(v.get("Total", 0) for v in peak.values()))
            for per_device in peak.values():
                for key, value in per_device.items():
                    name = str(getattr(key, "name", key)).lower()
                    if name != "total":
                        self.breakdown[name] = self.breakdown.get(name, 0) + int(value)
        except Exception as exc:
            self.error = f"MemTracker failed: {exc!r}"
        self.tracker = None


def bench_callback(clock: Clock, meter: TokenMeter, memory: MemoryProbe, loss_steps: set[int],
                   track_at: int | None, device: str):
    """The TrainerCallback of the lock step; added last, so every other callback's work is inside the step."""
    from transformers import TrainerCallback

    class BenchCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if device == "cuda":
                import torch

                torch.cuda.reset_peak_memory_stats()
            clock.ready()

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if track_at is not None and state.global_step == track_at:
                memory.start(model, optimizer)

        def on_step_end(self, args, state, control, **kw):
            seconds, faults = clock.stop()
            meter.close_step()
            if track_at is not None and state.global_step == track_at + 1:
                memory.stop()
            if state.global_step in loss_steps:
                control.should_log = True
            clock.report(state.global_step, seconds, faults)

    return BenchCallback()


# ------------------------------------------------------------------------------------------- building
def tokenizer_for(opts: dict):
    if opts["model"]:
        from ..loading import load_tokenizer

        tok = load_tokenizer(opts["model"])
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    from ..tiny import char_tokenizer

    return char_tokenizer()


def random_model(opts: dict, device: str):
    """The embedded tiny Llama, or a model built from ``--config`` (random weights, seeded)."""
    import torch

    if opts["model_config"] is None:
        from ..tiny import tiny_llama

        return tiny_llama(seed=opts["seed"])
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(opts["model_config"])
    config = AutoConfig.for_model(sizes.pop("model_type", "llama"), **sizes)
    torch.manual_seed(opts["seed"])
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def build_model(spec: dict, config=None):
    """The variant's model: built from a config, or loaded (the preset's way: ``hf_speedup.load_model``)."""
    opts, device = spec["options"], spec["device"]
    quantized = config is not None and config.lora.enabled and config.lora.quantization and device == "cuda"
    if opts["model"]:
        from ..loading import load_model

        # a peer loads as the stock recipes do for mixed-precision training: fp32 weights (the "baseline" plan),
        # like a preset's full fine-tune and like the random models, not the checkpoint's own (often bf16) dtype
        return load_model(opts["model"], speedup=config if config is not None else "baseline")
    if quantized:  # a 4-bit base is quantized while it loads: save the random model once, then load it
        import torch

        from ..loading import load_model

        path = os.path.join(spec["output"], "base_model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            random_model(opts, device).to(torch.bfloat16).save_pretrained(path)
        return load_model(path, speedup=config)
    return random_model(opts, device)


def peft_adapters(model):
    """The stock way to LoRA: peft with the ``lora`` preset's adapters (every attention/MLP projection)."""
    from peft import LoraConfig, get_peft_model

    from ..model_info import describe_model
    from ..presets import get_preset

    lora = get_preset("lora").lora
    targets = list(describe_model(model).linear_names) or "all-linear"
    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


def training_kwargs(spec: dict) -> dict:
    opts = spec["options"]
    return dict(output_dir=os.path.join(spec["output"], "runs", spec["slug"]),
                per_device_train_batch_size=opts["batch_size"], max_steps=spec["total_steps"],
                learning_rate=opts["learning_rate"], lr_scheduler_type="constant", seed=opts["seed"],
                logging_steps=10**9, save_strategy="no", report_to=[], disable_tqdm=True,
                dataloader_num_workers=0, bf16=spec["bf16"], use_cpu=spec["device"] == "cpu")


def counting(cls, meter: TokenMeter):
    """``cls`` with its batches counted as ``training_step`` receives them (the same hook for every variant)."""

    class Counted(cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            meter.add(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    Counted.__name__ = Counted.__qualname__ = cls.__name__
    return Counted


def build_trainer(spec: dict, meter: TokenMeter, tok, dataset):
    """The variant's trainer, each run the way its own documentation says."""
    from transformers import Trainer, TrainingArguments

    from ..tiny import causal_lm_collator

    name, kind = spec["variant"], spec["kind"]
    kw = training_kwargs(spec)
    collator = causal_lm_collator(tok)
    if kind == "preset":
        from ..trainer import SpeedupTrainer

        config = preset_config(name)
        model = build_model(spec, config)
        return counting(SpeedupTrainer, meter)(model=model, args=TrainingArguments(**kw), train_dataset=dataset,
                                               data_collator=collator, speedup=config)
    if name == "trl-sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**kw, padding_free=True, max_length=None)
        return counting(SFTTrainer, meter)(model=build_model(spec), args=args, train_dataset=dataset,
                                           processing_class=tok)
    if name == "unsloth":
        return unsloth_trainer(spec, meter, tok, dataset, kw)
    model = build_model(spec)
    if name == LORA_REFERENCE:
        model = peft_adapters(model)
    extra = {"stock-compile": {"torch_compile": True}, "liger": {"use_liger_kernel": True}}.get(name, {})
    return counting(Trainer, meter)(model=model, args=TrainingArguments(**kw, **extra), train_dataset=dataset,
                                    data_collator=collator)


def unsloth_trainer(spec: dict, meter: TokenMeter, tok, dataset, kw: dict):
    """Unsloth as its docs show it: FastLanguageModel + LoRA adapters + TRL's SFTTrainer (CUDA only)."""
    from unsloth import FastLanguageModel  # imported first thing in this process (see runner.boot_code)
    from trl import SFTConfig, SFTTrainer

    from ..presets import get_preset

    opts = spec["options"]
    path = opts["model"]
    if not path:  # a random model: save it once so Unsloth can load it its way
        path = os.path.join(spec["output"], "unsloth_base")
        if not os.path.isfile(os.path.join(path, "config.json")):
            random_model(opts, "cpu").save_pretrained(path)
            tok.save_pretrained(path)
    model, _ = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=opts["seq_len"], dtype=None,
                                                 load_in_4bit=False)
    lora = get_preset("lora").lora
    model = FastLanguageModel.get_peft_model(
        model, r=lora.r, lora_alpha=lora.alpha, lora_dropout=0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth", random_state=opts["seed"])
    args = SFTConfig(**kw, max_length=opts["seq_len"])
    return counting(SFTTrainer, meter)(model=model, args=args, train_dataset=dataset, processing_class=tok)


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


def summarize_trainer(spec: dict, trainer, meter: TokenMeter, memory: MemoryProbe) -> dict:
    """What the parent needs from this process once training is over."""
    import torch

    from ..model_info import parameter_counts
    from ..peak_flops import resolve_peak_flops
    from ..report.measure import attention_dims, compute_dtype, dynamo_snapshot

    device = spec["device"]
    out: dict = {"trainer_class": type(trainer).__name__, "tokens": meter.per_step(),
                 "attention_length": meter.attention_length()}
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
    out.update(matmul_trainable=counts.matmul_trainable, matmul_frozen=counts.matmul_frozen,
               trainable_parameters=counts.trainable, total_parameters=counts.total, layers=layers,
               attention_width=width, compute_dtype=dtype, peak_flops=peak, peak_flops_source=peak_source,
               compile=dynamo_snapshot())
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
    rows = make_rows(tok, opts["data"], opts["batch_size"] * spec["total_steps"], opts["seq_len"], opts["seed"])
    # TRL wants a datasets.Dataset; the Trainer takes the list as it is (same sampler order: it depends on the
    # length and the seed only), so a GPU image without `datasets` runs every other variant
    dataset = as_dataset(rows) if spec["variant"] in ("trl-sft", "unsloth") else rows
    clock = Clock(chan, spec["device"], spec["total_steps"])
    if spec["kind"] == "custom":
        return run_custom(spec, chan, clock, tok, rows, dataset)
    meter, memory = TokenMeter(), MemoryProbe()
    trainer = build_trainer(spec, meter, tok, dataset)
    n, window = opts["steps"], spec["loss_window"]
    track_at = n if spec["track_memory"] else None
    trainer.add_callback(bench_callback(clock, meter, memory, {n - window, n} - {0}, track_at, spec["device"]))
    trainer.train()
    return summarize_trainer(spec, trainer, meter, memory)


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
