"""Every bad input, one table: each gets ONE clear error naming the field, the value, the allowed values and
the fix, raised before any training work; on the command line one line on stderr and exit status 2.

A row is (id, what to run, the message it must give). Old cases (config validation, strict fallbacks) and
new ones (launch environment, output directory, training data, model_init, CLI files) side by side, so a
message that regresses to a raw traceback shows up here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
from torch import nn

from conftest import CPU_NO_BF16, CUDA_H100, CUDA_V100, fake_caps
from hf_speedup import SpeedupConfig, SpeedupConfigError, SpeedupTrainer, plan_for, training_arguments
from hf_speedup.cli import main
from hf_speedup.config import CompileSettings
from hf_speedup.presets import resolve
from hf_speedup.tiny import tiny_llama

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_MIXED_PRECISION")


@dataclass
class Ctx:
    """What a row may use: a scratch directory, argument and data factories, and monkeypatch."""

    tmp: Path
    make_args: Callable
    tokenizer: Any
    dataset: Any
    collator: Any
    monkeypatch: Any

    def model(self):
        return tiny_llama(seed=0, **SMALL)

    def trainer(self, speedup: Any = "auto", *, model=None, args=None, dataset=None, collator: Any = "fixture", **kw):
        """A SpeedupTrainer on the tiny model and data; ``collator=None`` leaves the Trainer's default."""
        return SpeedupTrainer(model=model if model is not None else self.model(),
                              args=args if args is not None else self.make_args(),
                              train_dataset=self.dataset if dataset is None else dataset,
                              data_collator=self.collator if isinstance(collator, str) else collator, speedup=speedup,
                              **kw)

    def file(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path

    def rows(self, input_ids, labels=None):
        from datasets import Dataset

        data = {"input_ids": input_ids, "attention_mask": [[1] * len(r) for r in input_ids]}
        if labels is not None:
            data["labels"] = labels
        return Dataset.from_dict(data)

    def env(self, **values):
        for k, v in values.items():
            self.monkeypatch.setenv(k, v)


@dataclass
class Case:
    id: str
    run: Callable[[Ctx], Any]
    match: str
    exc: type = SpeedupConfigError


@dataclass
class Cli:
    id: str
    argv: Callable[[Ctx], list[str]]
    match: str
    extra: dict = field(default_factory=dict)


def cfg(**sections):
    return resolve({"base": "baseline", **sections})


def plan(speedup, caps=CPU_NO_BF16, **kw):
    return plan_for(speedup, caps=fake_caps(**caps), **kw)


def _no_launch_env(ctx: Ctx, world: str = "2"):
    args = ctx.make_args()  # built before WORLD_SIZE appears: TrainingArguments would start torch.distributed
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        ctx.monkeypatch.delenv(var, raising=False)
    ctx.env(WORLD_SIZE=world)
    return args


def _read_only(ctx: Ctx):
    """A directory that refuses writes, for any user (root ignores file modes)."""
    import tempfile

    def refuse(*a, **kw):
        raise PermissionError(13, "Permission denied")

    ctx.monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    return ctx.make_args(output_dir=str(ctx.tmp / "ro" / "out"))


class _NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 8)

    def forward(self, input_ids=None, **kw):
        return {"loss": self.embed(input_ids).float().mean()}


CHOICE = r"is not allowed; allowed: "
CASES = [
    # ---------------------------------------------------------------- speedup= itself
    Case("preset-unknown", lambda c: resolve("warp"),
         r"speedup = 'warp' is not a known preset; allowed: baseline, auto, fast, .*fix: e\.g\. speedup='auto'"),
    Case("speedup-none", lambda c: c.trainer(speedup=None),
         r"speedup = None is not allowed; allowed: a preset name \(baseline, .*\), a SpeedupConfig, a dict or a "
         r"\.yaml path; fix: leave speedup out for the default 'auto', or speedup='baseline' for the stock Trainer"),
    Case("speedup-type", lambda c: resolve(42),
         r"speedup = 42 has type int; allowed: a preset name .*fix: e\.g\. speedup='auto'"),
    Case("config-object-validated", lambda c: c.trainer(speedup=SpeedupConfig(compile=CompileSettings(backend="tvm"))),
         r"compile\.backend = 'tvm' " + CHOICE + r"'inductor', 'aot_eager', 'eager', 'cudagraphs'; fix: set "
         r"compile\.backend: 'inductor'"),
    # ---------------------------------------------------------------- config fields
    Case("unknown-section", lambda c: resolve({"compil": {}}),
         r"compil is not a known setting; allowed: name, description, base, precision, .*fix: remove it or rename "
         r"it \(did you mean 'compile'\?\)"),
    Case("unknown-field", lambda c: resolve({"compile": {"enabeld": True}}),
         r"compile\.enabeld is not a known setting; allowed: compile\.enabled, .*did you mean 'compile\.enabled'\?"),
    Case("section-not-mapping", lambda c: resolve({"compile": 5}),
         r"compile = 5 is not a mapping; allowed keys: enabled, backend, .*; fix: e\.g\. compile: \{enabled: \.\.\.\}"),
    Case("config-not-mapping", lambda c: SpeedupConfig.from_dict(["compile"]),
         r"config = \['compile'\] is not a mapping; fix: give a mapping of sections"),
    Case("compile-enabled", lambda c: cfg(compile={"enabled": "yes"}),
         r"compile\.enabled = 'yes' " + CHOICE + r"'auto', True, False; fix: set compile\.enabled: True"),
    Case("compile-backend", lambda c: cfg(compile={"backend": "tvm"}),
         r"compile\.backend = 'tvm' " + CHOICE + r"'inductor', 'aot_eager', 'eager', 'cudagraphs'"),
    Case("compile-mode", lambda c: cfg(compile={"mode": "fastest"}),
         r"compile\.mode = 'fastest' " + CHOICE + r"None, 'default', 'reduce-overhead', 'max-autotune'"),
    Case("compile-regions", lambda c: cfg(compile={"regions": "all"}),
         r"compile\.regions = 'all' " + CHOICE + r"'blocks', 'blocks\+head'; fix: set compile\.regions: 'blocks'"),
    Case("compile-dynamic", lambda c: cfg(compile={"dynamic": "no"}),
         r"compile\.dynamic = 'no' " + CHOICE + r"None, True, False"),
    Case("precision-dtype", lambda c: cfg(precision={"dtype": "fp8"}),
         r"precision\.dtype = 'fp8' " + CHOICE + r"'auto', 'keep', 'bf16', 'fp16', 'fp32'; fix: set precision\.dtype: 'auto'"),
    Case("precision-tf32", lambda c: cfg(precision={"tf32": "maybe"}),
         r"precision\.tf32 = 'maybe' " + CHOICE + r"'auto', 'keep', True, False"),
    Case("precision-strict-type", lambda c: cfg(precision={"strict": "yes"}),
         r"precision\.strict = 'yes' " + CHOICE + r"true, false; fix: set precision\.strict: true or false"),
    Case("optimizer-name", lambda c: cfg(optimizer={"name": "sgd"}),
         r"optimizer\.name = 'sgd' " + CHOICE + r"'auto', 'keep', 'adamw', 'adamw_fused', 'adamw_8bit', 'paged_adamw_8bit'"),
    Case("checkpointing-every-n", lambda c: cfg(checkpointing={"every_n_blocks": 0}),
         r"checkpointing\.every_n_blocks = 0 " + CHOICE + r"an integer >= 1; fix: e\.g\. checkpointing\.every_n_blocks: 1"),
    Case("lora-r", lambda c: cfg(lora={"r": 0}), r"lora\.r = 0 " + CHOICE + r"an integer >= 1"),
    Case("lora-alpha-text", lambda c: cfg(lora={"alpha": "32"}), r"lora\.alpha = '32' " + CHOICE + r"an integer >= 1"),
    Case("lora-dropout", lambda c: cfg(lora={"dropout": 1.5}),
         r"lora\.dropout = 1\.5 " + CHOICE + r"a number in \[0, 1\); fix: e\.g\. lora\.dropout: 0\.05"),
    Case("lora-targets-empty", lambda c: cfg(lora={"target_modules": []}),
         r"lora\.target_modules = \[\] " + CHOICE + r"'auto', 'all-linear' or a non-empty list of module names; fix: "
         r"e\.g\. lora\.target_modules: \[q_proj, v_proj\]"),
    Case("lora-quantization", lambda c: cfg(lora={"quantization": "3bit"}),
         r"lora\.quantization = '3bit' " + CHOICE + r"None, '4bit', '8bit'"),
    Case("lora-quantization-needs-lora", lambda c: cfg(lora={"quantization": "4bit"}),
         r"lora\.quantization = '4bit' needs lora\.enabled = true .*fix: set lora\.enabled: true or lora\.quantization: null"),
    Case("fsdp-version", lambda c: cfg(fsdp={"version": 3}), r"fsdp\.version = 3 " + CHOICE + r"1, 2; fix: set fsdp\.version: 2"),
    Case("fsdp-version-bool", lambda c: cfg(fsdp={"version": True}), r"fsdp\.version = True " + CHOICE + r"1, 2"),
    Case("fsdp-strategy", lambda c: cfg(fsdp={"strategy": "ddp"}),
         r"fsdp\.strategy = 'ddp' " + CHOICE + r"'full_shard', 'shard_grad_op', 'hybrid_shard', 'no_shard'"),
    Case("fsdp-state-dict", lambda c: cfg(fsdp={"state_dict_type": "local"}),
         r"fsdp\.state_dict_type = 'local' " + CHOICE + r"'sharded', 'full'"),
    Case("memory-empty-cache", lambda c: cfg(memory={"empty_cache_steps": 0}),
         r"memory\.empty_cache_steps = 0 " + CHOICE + r"null or an integer >= 1; fix: e\.g\. memory\.empty_cache_steps: "
         r"8, or null to disable"),
    Case("memory-cpu-reuse", lambda c: cfg(memory={"cpu_reuse_freed": "yes"}),
         r"memory\.cpu_reuse_freed = 'yes' " + CHOICE + r"true, false"),
    Case("data-pad", lambda c: cfg(data={"pad_to_multiple_of": -8}),
         r"data\.pad_to_multiple_of = -8 " + CHOICE + r"null or an integer >= 1"),
    Case("data-workers", lambda c: cfg(data={"num_workers": -1}),
         r"data\.num_workers = -1 " + CHOICE + r"null or an integer >= 0; fix: e\.g\. data\.num_workers: 2, or null to "
         r"keep TrainingArguments"),
    Case("data-drop-last", lambda c: cfg(data={"drop_last": "yes"}),
         r"data\.drop_last = 'yes' " + CHOICE + r"null, true, false; fix: set data\.drop_last: null to keep TrainingArguments"),
    Case("every-problem-at-once", lambda c: cfg(compile={"backend": "tvm"}, lora={"r": 0}, data={"num_workers": -1}),
         r"\(3 problem\(s\)\):\n  - compile\.backend = 'tvm' .*\n  - lora\.r = 0 .*\n  - data\.num_workers = -1 "),
    # ---------------------------------------------------------------- base: and YAML files
    Case("base-unknown-dict", lambda c: resolve({"base": "no-such", "lora": {"r": 8}}),
         r"base = 'no-such' is not a known preset; allowed: baseline, auto, .*; fix: name the preset to start from, "
         r"e\.g\. base: fast, or drop base:"),
    Case("base-unknown-yaml", lambda c: resolve(c.file("mine.yaml", "base: nope\nlora: {r: 8}\n")),
         r"base = 'nope' \(in .*mine\.yaml\) is not a known preset; allowed: baseline, "),
    Case("base-merged-then-validated", lambda c: resolve({"base": "fast", "compile": {"mode": "turbo"}}),
         r"compile\.mode = 'turbo' " + CHOICE),
    Case("yaml-syntax", lambda c: resolve(c.file("broken.yaml", "compile:\n  enabled: [true\nlora: {}\n")),
         r"broken\.yaml: line \d+, column \d+: not valid YAML \(.*\); fix: correct the YAML syntax there"),
    Case("yaml-not-mapping", lambda c: resolve(c.file("list.yaml", "- compile\n- lora\n")),
         r"list\.yaml: the YAML is a list, not a mapping; fix: write sections such as 'compile:' at the top level"),
    Case("yaml-missing", lambda c: resolve(str(c.tmp / "nope.yaml")),
         r"speedup = '.*nope\.yaml': no such file; fix: give an existing \.yaml path or a preset name"),
    Case("yaml-field", lambda c: resolve(c.file("field.yaml", "optimizer:\n  name: lion\n")),
         r"optimizer\.name = 'lion' " + CHOICE),
    # ---------------------------------------------------------------- what this machine cannot run (strict)
    Case("strict-bf16-on-v100", lambda c: plan(cfg(precision={"dtype": "bf16", "strict": True}), CUDA_V100),
         r"precision\.dtype = 'bf16' cannot run on this machine \(no bf16 on .*\) and precision\.strict = true; allowed "
         r"here: 'fp16', 'fp32', 'auto'; fix: set precision\.dtype: auto"),
    Case("strict-tf32-on-cpu", lambda c: plan(cfg(precision={"tf32": True, "strict": True})),
         r"precision\.tf32 = True cannot run on this machine \(tf32: n/a on cpu .*\).*fix: set precision\.tf32: auto"),
    Case("strict-args-bf16-on-v100",
         lambda c: plan({"base": "auto", "precision": {"strict": True}}, CUDA_V100, args=c.make_args(bf16=True)),
         r"TrainingArguments\.bf16 = True cannot run on this machine .*fix: set bf16=False in TrainingArguments"),
    Case("strict-launcher-bf16-on-v100",
         lambda c: (c.env(ACCELERATE_MIXED_PRECISION="bf16"),
                    plan({"base": "auto", "precision": {"strict": True}}, CUDA_V100, args=c.make_args())),
         r"ACCELERATE_MIXED_PRECISION = 'bf16' cannot run on this machine .*fix: launch with --mixed_precision fp16 or "
         r"no, or precision\.strict: false"),
    Case("strict-qlora-on-cpu", lambda c: plan({"base": "qlora", "lora": {"strict": True}}),
         r"lora\.quantization = '4bit' cannot be honoured: .*allowed here: null \(plain LoRA\); fix: run on a CUDA "
         r"machine .*or set lora\.strict: false"),
    Case("strict-8bit-adam-on-cpu", lambda c: plan(cfg(optimizer={"name": "adamw_8bit", "strict": True})),
         r"optimizer\.name = 'adamw_8bit' cannot run on this machine \(.*\) and optimizer\.strict = true; allowed here: "
         r".*fix: set optimizer\.name: auto"),
    Case("fsdp-with-8bit-base", lambda c: plan({"base": "fsdp-lora", "lora": {"quantization": "8bit"}}, CUDA_H100),
         r"fsdp\.enabled = true with an 8-bit bitsandbytes base .*fix: set lora\.quantization: '4bit' or fsdp\.enabled: false"),
    # ---------------------------------------------------------------- the model
    Case("lora-target-unknown", lambda c: c.trainer({"base": "lora", "lora": {"target_modules": ["qq_proj"]}}),
         r"lora\.target_modules = \['qq_proj'\]: \['qq_proj'\] match no Linear layer \(nn\.Linear, transformers Conv1D\) "
         r"of this LlamaForCausalLM; allowed: \[.*'q_proj'.*\], 'auto' or 'all-linear'; fix: set lora\.target_modules: auto"),
    Case("lora-gpt2-target-unknown",
         lambda c: c.trainer({"base": "lora", "lora": {"target_modules": ["q_proj"]}}, model=_gpt2()),
         r"\['q_proj'\] match no Linear layer \(nn\.Linear, transformers Conv1D\) of this GPT2LMHeadModel; allowed: "
         r"\['c_attn', 'c_fc', 'c_proj', 'lm_head'\]"),
    Case("lora-plain-module-without-linear",
         lambda c: c.trainer("lora", model=_NoLinear(), dataset=c.rows([[5] * 8] * 4), collator=None),
         r"lora\.target_modules = 'all-linear': this _NoLinear has no linear layer \(nn\.Linear, transformers Conv1D\) "
         r"for LoRA to adapt; fix: set lora\.enabled: false"),
    Case("peak-flops-env", lambda c: (c.env(HF_SPEEDUP_PEAK_FLOPS="fast"), c.trainer("baseline")),
         r"HF_SPEEDUP_PEAK_FLOPS = 'fast' " + CHOICE + r"a positive number", ValueError),
    # ---------------------------------------------------------------- the launch
    Case("world-size-without-launcher", lambda c: c.trainer(args=_no_launch_env(c)),
         r"WORLD_SIZE = '2' is set but RANK, MASTER_ADDR, MASTER_PORT are not: this process was not started by a "
         r"launcher.*allowed: WORLD_SIZE together with RANK, MASTER_ADDR, MASTER_PORT .*fix: launch with torchrun "
         r"--nproc_per_node 2 train\.py \(or accelerate launch\), or unset WORLD_SIZE"),
    Case("world-size-not-a-number", lambda c: c.trainer(args=_no_launch_env(c, "two")),
         r"WORLD_SIZE = 'two' " + CHOICE + r"a whole number of processes .*fix: unset WORLD_SIZE"),
    Case("world-size-training-arguments",
         lambda c: (_no_launch_env(c), training_arguments("auto", output_dir=str(c.tmp / "o"), use_cpu=True)),
         r"WORLD_SIZE = '2' is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
    # ---------------------------------------------------------------- the output directory
    Case("output-dir-is-a-file", lambda c: c.trainer(args=c.make_args(output_dir=str(c.file("taken", "x")))),
         r"TrainingArguments\.output_dir = '.*taken' is a file, not a directory; allowed: a directory path; fix: set "
         r"TrainingArguments\(output_dir=\.\.\.\) to a writable directory"),
    Case("output-dir-inside-a-file",
         lambda c: c.trainer(args=c.make_args(output_dir=str(c.file("taken2", "x") / "run"))),
         r"TrainingArguments\.output_dir = '.*taken2/run' would be inside '.*taken2', which is a file, not a directory"),
    Case("output-dir-read-only", lambda c: c.trainer(args=_read_only(c)),
         r"TrainingArguments\.output_dir = '.*ro/out' cannot be written \(it does not exist yet and cannot be created in "
         r"'.*'\): Permission denied; allowed: a writable directory; fix: set TrainingArguments\(output_dir=\.\.\.\)"),
    # ---------------------------------------------------------------- the training data
    Case("empty-dataset", lambda c: c.trainer(dataset=c.dataset.select([])),
         r"train_dataset has 0 rows; allowed: a training set with at least one row; fix: check the split, filter or map"),
    Case("ragged-rows-default-collator",
         lambda c: c.trainer("baseline", dataset=c.rows([[5] * 9, [6] * 11, [7] * 4]), collator=None),
         r"train_dataset rows have different lengths \(input_ids: 4 to 11 tokens in the first 3 rows\) and the collator "
         r"default_data_collator \(the Trainer's default\) only stacks rows: batches would fail to stack; allowed: rows "
         r"of one length, or a padding collator; fix: pass data_collator=DataCollatorForLanguageModeling\(tokenizer, "
         r"mlm=False\)"),
    Case("ragged-rows-explicit-default-collator",
         lambda c: c.trainer("baseline", dataset=c.rows([[5] * 9, [6] * 11]), collator=_default_collator()),
         r"rows have different lengths \(input_ids: 9 to 11 tokens in the first 2 rows\) and the collator "
         r"default_data_collator only stacks rows"),
    Case("ragged-labels-padding-collator",
         lambda c: SpeedupTrainer(model=c.model(), args=c.make_args(), processing_class=c.tokenizer, speedup="baseline",
                                  train_dataset=c.rows([[5] * 9, [6] * 11], labels=[[5] * 9, [6] * 11])),
         r"rows have different lengths \(labels: 9 to 11 tokens .*\) and the collator DataCollatorWithPadding \(the "
         r"Trainer's default\) pads input_ids and attention_mask but not labels.*DataCollatorForSeq2Seq\(tokenizer\)"),
    Case("labels-all-ignored",
         lambda c: c.trainer("baseline", dataset=c.rows([[5] * 8] * 6, labels=[[-100] * 8] * 6), collator=None),
         r"train_dataset labels are all -100 in the first 6 rows: the loss ignores every token, so the run would learn "
         r"nothing \(and report a loss of 0\); allowed: rows with some label tokens != -100; fix: check the masking"),
    Case("user-drop-last-fewer-rows-than-a-batch",
         lambda c: c.trainer("baseline", dataset=c.dataset.select(range(3)),
                             args=c.make_args(dataloader_drop_last=True, per_device_train_batch_size=4)),
         r"TrainingArguments\.dataloader_drop_last = True: the training set has 3 row\(s\), fewer than one batch \(4 per "
         r"device x 1 process\(es\)\): every row would be dropped and training would take no step; allowed: at least "
         r"per_device_train_batch_size x processes rows; fix: set dataloader_drop_last=False"),
    Case("data-problems-gathered",
         lambda c: c.trainer("baseline", dataset=c.rows([[5] * 3, [6] * 4], labels=[[-100] * 3, [-100] * 4]),
                             collator=None, args=c.make_args(dataloader_drop_last=True, per_device_train_batch_size=4)),
         r"\(3 problem\(s\)\):\n  - TrainingArguments\.dataloader_drop_last = True: .*\n  - train_dataset rows have "
         r"different lengths .*\n  - train_dataset labels are all -100 "),
    # ---------------------------------------------------------------- accelerate configs
    Case("accelerate-config-shape", lambda c: _accelerate_config(num_processes=3, num_machines=2),
         r"num_processes = 3 is not a multiple of num_machines = 2; allowed: the same number of processes on every "
         r"machine; fix: e\.g\. num_processes = 2"),
    Case("accelerate-config-precision", lambda c: _accelerate_config(num_processes=2, mixed_precision="fp8"),
         r"mixed_precision = 'fp8' " + CHOICE + r"None \(from the preset\), 'no', 'bf16', 'fp16'"),
]

CLI = [
    Cli("cli-report-missing", lambda c: ["report", str(c.tmp / "nowhere")],
        r"hf-speedup report: error: .*nowhere does not exist; pass a training output_dir or a speedup_report\.json"),
    Cli("cli-report-malformed", lambda c: ["report", str(c.file("r.json", "{not json"))],
        r"hf-speedup report: error: .*r\.json is not valid JSON \(Expecting property name"),
    Cli("cli-report-not-a-report", lambda c: ["report", str(c.file("o.json", json.dumps({"loss": 1})))],
        r"hf-speedup report: error: .*o\.json is not an hf_speedup report \(no 'plan' section\)"),
    Cli("cli-report-wrong-shape", lambda c: ["report", str(c.file("w.json", json.dumps({"plan": [1, 2]})))],
        r"hf-speedup report: error: .*w\.json is not an hf_speedup report: 'plan' is a list, not a mapping"),
    Cli("cli-report-entry-shape", lambda c: ["report", str(c.file("e.json", json.dumps({"plan": {"compile": 1}})))],
        r"hf-speedup report: error: .*e\.json is not an hf_speedup report: plan entries \['compile'\] are not mappings"),
    Cli("cli-report-dir-without-report", lambda c: ["report", str(c.tmp)],
        r"hf-speedup report: error: no speedup_report\.json in .* \(nor below it\); pass a training output_dir"),
    Cli("cli-report-compare-missing", lambda c: ["report", str(c.file("a.json", "{}")), "--compare", str(c.tmp / "b")],
        r"hf-speedup report: error: .*a\.json is not an hf_speedup report"),
    Cli("cli-report-plot-no-history",
        lambda c: ["report", str(c.file("p.json", json.dumps({"plan": {}}))), "--plot", str(c.tmp / "p.png")],
        r"hf-speedup report: error: .*p\.json has no per-step history"),
    Cli("cli-plan-model-missing", lambda c: ["plan", "--model", str(c.tmp / "no" / "model")],
        r"hf-speedup plan: error: plan --model '.*no/model': no causal-LM config could be read there \(.*\); fix: give "
        r"a local model directory holding config\.json"),
    Cli("cli-plan-model-not-a-model", lambda c: ["plan", "--model", str(c.tmp)],
        r"hf-speedup plan: error: plan --model '.*': no causal-LM config could be read there"),
    Cli("cli-plan-config-bad-yaml", lambda c: ["plan", "--config", str(c.file("bad.yaml", "compile: [\n"))],
        r"hf-speedup plan: error: .*bad\.yaml: line \d+, column \d+: not valid YAML"),
    Cli("cli-plan-config-base-unknown", lambda c: ["plan", "--config", str(c.file("b.yaml", "base: warp\n"))],
        r"hf-speedup plan: error: base = 'warp' \(in .*b\.yaml\) is not a known preset"),
    Cli("cli-plan-config-missing", lambda c: ["plan", "--config", str(c.tmp / "gone.yaml")],
        r"hf-speedup plan: error: speedup = '.*gone\.yaml': no such file"),
    Cli("cli-plan-preset-unknown", lambda c: ["plan", "--preset", "warp"],
        r"hf-speedup plan: error: speedup = 'warp' is not a known preset"),
    Cli("cli-presets-write-unwritable", lambda c: ["presets", "--write", str(c.file("f", "x") / "presets")],
        r"hf-speedup presets: error: presets --write '.*f/presets': cannot write there \(.*\); fix: choose a writable"),
    Cli("cli-accelerate-config-unwritable",
        lambda c: ["accelerate-config", "--num-processes", "2", "--output", str(c.file("g", "x") / "acc.yaml")],
        r"hf-speedup accelerate-config: error: accelerate-config --output '.*g/acc\.yaml': cannot write there"),
    Cli("cli-accelerate-config-shape", lambda c: ["accelerate-config", "--num-processes", "3", "--num-machines", "2"],
        r"hf-speedup accelerate-config: error: num_processes = 3 is not a multiple of num_machines = 2"),
    Cli("cli-demo-output-dir-is-a-file", lambda c: ["demo", "--max-steps", "1", "--output-dir", str(c.file("h", "x"))],
        r"hf-speedup demo: error: TrainingArguments\.output_dir = '.*h' is a file, not a directory"),
]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=128,
                                      bos_token_id=1, eos_token_id=2))


def _default_collator():
    from transformers import default_data_collator

    return default_data_collator


def _accelerate_config(**kw):
    from hf_speedup.accelerate_config import accelerate_config_dict

    return accelerate_config_dict("fsdp", **kw)


@pytest.fixture
def ctx(tmp_path, make_args, tokenizer, dataset, collator, monkeypatch):
    for var in LAUNCHER_VARS + ("HF_SPEEDUP_PEAK_FLOPS",):
        monkeypatch.delenv(var, raising=False)
    return Ctx(tmp_path, make_args, tokenizer, dataset, collator, monkeypatch)


def test_the_table_is_large_and_every_id_is_unique():
    ids = [c.id for c in CASES + CLI]
    assert len(ids) >= 50 and len(ids) == len(set(ids))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_clear_error(case, ctx):
    with pytest.raises(case.exc) as info:
        case.run(ctx)
    message = str(info.value)
    assert re.search(case.match, message, re.S), f"\n{message}\n!~ {case.match}"
    if isinstance(info.value, SpeedupConfigError):  # every problem names its fix
        assert info.value.problems and all("fix:" in p for p in info.value.problems), message


@pytest.mark.parametrize("case", CLI, ids=[c.id for c in CLI])
def test_cli_user_mistake_is_one_line_without_traceback(case, ctx, capsys):
    rc = main(case.argv(ctx))
    out = capsys.readouterr()
    assert rc == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert "Traceback" not in out.err and re.search(case.match, lines[0]), f"\n{out.err}\n!~ {case.match}"


def test_errors_come_before_any_model_work(ctx):
    """Input errors leave the model as it was (no adapters injected, nothing compiled)."""
    model = ctx.model()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(SpeedupConfigError, match="labels are all -100"):
        ctx.trainer("lora", model=model, dataset=ctx.rows([[5] * 8] * 4, labels=[[-100] * 8] * 4), collator=None)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert not hasattr(model, "peft_config")


def test_elastic_restarts_that_would_fail_to_reconnect_are_said_at_construction(monkeypatch, caplog, tiny_model,
                                                                                make_args, dataset, collator):
    """torchrun --max-restarts N shares its rendezvous store with the workers, and this torch keeps it across a
    restart: the restarted group would fail in init_process_group. Said when the trainer is built, with the fix."""
    import logging

    from hf_speedup import SpeedupTrainer

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=dataset, data_collator=collator,
                       speedup="baseline")
    assert any("torchrun --max-restarts 1: a restarted worker group re-uses the rendezvous store" in r.message
               and "fix: export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.message for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store per attempt: nothing to say
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=dataset, data_collator=collator,
                       speedup="baseline")
    assert not any("max-restarts" in r.message for r in caplog.records)
