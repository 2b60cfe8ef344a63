"""What one benchmark run compares and how: validated in one pass, before any worker starts.

A variant is a peer (how people train today: the stock Trainer, TRL, Liger, Unsloth), a preset (or a
preset with edits, ``fast:compile.mode=None``, or a YAML config), or a custom step function (Python API
only: a kernel floor, a hand-written loop).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..config import SpeedupConfigError
from ..presets import list_presets
from .chat_data import TOKEN_RANGE as CHAT_RANGE
from .data import RAGGED_RANGE, read_records

REFERENCE = "stock"  # every ratio is taken against it, so it always runs
LORA_REFERENCE = "stock-peft"  # LoRA variants are also compared with the stock way to LoRA
PEERS = ("stock", "stock-bf16", "stock-flat", "stock-compile", "stock-peft", "trl-sft", "liger", "unsloth")
DATA_KINDS = ("ragged", "fixed", "docs-chat")
SCHEDULES = ("auto", "lockstep", "sequential")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")

DEFAULT_PEERS = ("stock", "stock-bf16", "stock-flat", "stock-compile", "trl-sft", "liger", "unsloth")
DEFAULT_PRESETS = ("auto", "fast", "memory", "lora")

# Llama-3.2-1B's sizes: the GPU plan builds it from this config (random weights, no hub).
LLAMA_3_2_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
# The same plan, shrunk to run on a CPU in seconds (``--dry-run``).
DRY_RUN_CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                      max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)

# Named settings for `hf-speedup bench --profile NAME`; flags given on the command line win.
PROFILES: dict[str, dict[str, Any]] = {
    "gpu-1b": dict(
        model_config=LLAMA_3_2_1B, seq_len=2048, batch_size=4, data="fixed", steps=30, warmup=8,
        variants=["stock", "stock-compile", "liger", "fast", "memory", "stock-peft", "lora", "qlora"],
        schedule="sequential", device="cuda", precision="bf16", timeout=300.0,
    ),
}


@dataclass
class BenchOptions:
    """One ``hf-speedup bench`` run. ``variants`` keeps the order of the table (``stock`` is added first
    when missing: every ratio is taken against it)."""

    model: str | None = None  # hub id or local path
    tiny: bool = False  # the embedded tiny Llama (the default when no model is given)
    model_config: dict | None = None  # a model built from this config, random weights
    variants: list[str] = field(default_factory=lambda: [*DEFAULT_PEERS, *DEFAULT_PRESETS])
    batch_size: int = 8
    seq_len: int = 512
    data: str = "ragged"  # ragged | fixed | docs-chat | a .jsonl/.json/.txt file
    steps: int = 20  # optimizer steps per variant; the loss is read after the last one
    warmup: int | None = None  # steps left out of the steady state (None: min(5, steps // 4), at least 1)
    output: str = "outputs/bench"
    device: str = "auto"
    schedule: str = "auto"  # lockstep: step i of every variant back to back; sequential: one variant at a time
    precision: str = "auto"  # the TrainingArguments every variant gets: bf16=True or not
    learning_rate: float = 2e-4
    threads: int | None = None  # torch.set_num_threads in every worker
    timeout: float = 600.0  # seconds a worker may take for its set-up, for one step, or for its wrap-up
    custom: dict[str, str] = field(default_factory=dict)  # name -> "path/to/file.py:factory"
    seed: int = 0
    command: str | None = None  # the command line, for the record
    profile: str | None = None
    breakdown: bool = False  # profile one extra steady step per variant: where its time goes, by bucket

    # ------------------------------------------------------------------------------ derived
    @property
    def model_source(self) -> str:
        if self.model:
            return "model"
        if self.model_config is not None:
            return "config"
        return "tiny"

    @property
    def warmup_steps(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return 0 if self.steps <= 1 else min(5, max(1, self.steps // 4))

    @property
    def loss_window(self) -> int:
        """The loss reported is the mean training loss of the last ``loss_window`` steps."""
        return max(1, self.steps // 5)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_schedule(self, device: str) -> str:
        """Lock-step keeps every variant alive at once (fine for CPU RAM); one GPU rarely holds them all."""
        if self.schedule != "auto":
            return self.schedule
        return "sequential" if device == "cuda" else "lockstep"

    def bf16(self, device: str) -> bool:
        if self.precision != "auto":
            return self.precision == "bf16"
        if device != "cuda":
            return False
        import torch

        return bool(torch.cuda.is_bf16_supported())

    def with_reference(self) -> list[str]:
        names = list(dict.fromkeys(self.variants))
        return names if REFERENCE in names else [REFERENCE, *names]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ---------------------------------------------------------------------------- validation
    def problems(self) -> list[str]:
        """Every problem, each naming the option, the value, the allowed values and the fix."""
        out: list[str] = []
        sources = [s for s, on in (("--model", bool(self.model)), ("--tiny", self.tiny),
                                   ("--config", self.model_config is not None)) if on]
        if len(sources) > 1:
            out.append(f"model source = {' and '.join(sources)}: only one is allowed; allowed: --model PATH_OR_ID, "
                       "--tiny or --config JSON; fix: keep one of them")
        if self.model_config is not None and not isinstance(self.model_config, dict):
            out.append(f"--config = {self.model_config!r} is not a mapping; allowed: a JSON object of config fields "
                       "(or a path to a config.json); fix: e.g. --config '{\"model_type\": \"llama\", \"hidden_size\": 256}'")
        for name, value, low in (("--batch-size", self.batch_size, 1), ("--steps", self.steps, 1),
                                 ("--seq-len", self.seq_len, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                out.append(f"{name} = {value!r} is not allowed; allowed: an integer >= {low}; fix: e.g. {name} {max(low, 8)}")
        if self.warmup is not None and (not isinstance(self.warmup, int) or not 0 <= self.warmup < max(self.steps, 1)):
            out.append(f"--warmup = {self.warmup!r} is not allowed; allowed: an integer in [0, --steps) = [0, {self.steps}) "
                       "(at least one step must be measured); fix: lower --warmup or raise --steps")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            out.append(f"--threads = {self.threads!r} is not allowed; allowed: an integer >= 1; fix: e.g. --threads 2, or leave it out")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            out.append(f"--timeout = {self.timeout!r} is not allowed; allowed: seconds > 0; fix: e.g. --timeout 600")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            out.append(f"--learning-rate = {self.learning_rate!r} is not allowed; allowed: a number > 0; fix: e.g. 2e-4")
        for name, value, allowed in (("--device", self.device, DEVICES), ("--schedule", self.schedule, SCHEDULES),
                                     ("--precision", self.precision, PRECISIONS)):
            if value not in allowed:
                out.append(f"{name} = {value!r} is not allowed; allowed: {', '.join(allowed)}; fix: e.g. {name} {allowed[0]}")
        if self.device == "cuda" and not _cuda_available():
            out.append("--device = 'cuda': no CUDA device here; allowed: auto, cpu, or cuda on a machine with a GPU; "
                       "fix: run it on a GPU machine, or add --dry-run to prove the plan on this CPU")
        if self.data not in DATA_KINDS and not os.path.isfile(str(self.data)):
            out.append(f"--data = {self.data!r} is not allowed; allowed: ragged, fixed, docs-chat, or an existing "
                       ".jsonl/.json/.txt file; fix: e.g. --data ragged, or check the file's path")
        elif self.data not in DATA_KINDS and not str(self.data).endswith((".jsonl", ".json", ".txt")):
            out.append(f"--data = {self.data!r}: unknown file type; allowed: .jsonl or .json (objects with 'text' or "
                       "'input_ids') or .txt (one example per line); fix: convert the file to one of these")
        elif self.data not in DATA_KINDS:
            try:
                read_records(self.data)
            except (ValueError, OSError) as exc:
                out.append(str(exc))
        if os.path.exists(str(self.output)) and not os.path.isdir(str(self.output)):
            out.append(f"--output = {self.output!r} is a file; allowed: a folder (created when missing); fix: "
                       "give a folder path")
        if self.model:
            out.extend(_model_problems(self.model))
        if self.data == "ragged" and isinstance(self.seq_len, int) and self.seq_len < RAGGED_RANGE[0]:
            out.append(f"--seq-len = {self.seq_len} is too short for --data ragged (lengths from {RAGGED_RANGE[0]}); "
                       f"allowed: >= {RAGGED_RANGE[0]}; fix: raise --seq-len or use --data fixed")
        if self.data == "docs-chat" and isinstance(self.seq_len, int) and self.seq_len < CHAT_RANGE[0]:
            out.append(f"--seq-len = {self.seq_len} is too short for --data docs-chat (conversations of "
                       f"{CHAT_RANGE[0]}-{CHAT_RANGE[1]} tokens); allowed: >= {CHAT_RANGE[0]}; fix: --seq-len {CHAT_RANGE[1]}")
        if not self.variants:
            out.append("--presets/--peers: nothing to run; allowed: at least one preset or peer; fix: e.g. --presets fast")
        for spec in self.variants:
            out.extend(variant_problems(spec, self.custom))
        if self.profile is not None and self.profile not in PROFILES:
            out.append(f"--profile = {self.profile!r} is not allowed; allowed: {', '.join(PROFILES)}; fix: e.g. "
                       "--profile gpu-1b, or leave it out")
        return out

    def validate(self) -> "BenchOptions":
        problems = self.problems()
        if problems:
            raise SpeedupConfigError(problems)
        return self


def _model_problems(model: str) -> list[str]:
    """Read the model's config now (small), so a wrong id fails here rather than in every worker."""
    try:
        from transformers import AutoConfig

        from ..loading import split_gguf

        path, gguf_file = split_gguf(model, {})  # a .gguf file reads its config from the file, as load_model does
        AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception as exc:  # noqa: BLE001 - any failure to find it is the same problem for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [f"--model = {model!r}: its config cannot be loaded ({first[:200]}); allowed: a hub id, a local "
                "folder with config.json or a .gguf file; fix: check the id or path (or use --tiny / --config)"]
    return []


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ------------------------------------------------------------------------------------------ variants
def variant_kind(spec: str, custom: dict | None = None) -> str:
    """'peer', 'custom' or 'preset' (a preset name, NAME:section.field=value edits, or a YAML path)."""
    if spec in PEERS:
        return "peer"
    if custom and spec in custom:
        return "custom"
    return "preset"


def parse_edits(spec: str) -> tuple[str, dict]:
    """``'fast:compile.mode=None:data.pad_to_multiple_of=8'`` -> ``('fast', {'compile': {'mode': None}, ...})``."""
    import yaml

    name, *edits = spec.split(":")
    sections: dict = {}
    for edit in edits:
        if "=" not in edit or "." not in edit.split("=", 1)[0]:
            raise ValueError(edit)
        key, value = edit.split("=", 1)
        section, fld = key.split(".", 1)
        sections.setdefault(section, {})[fld] = None if value == "None" else yaml.safe_load(value)
    return name, sections


def preset_config(spec: str):
    """The SpeedupConfig (or YAML path) a preset variant trains with."""
    from ..presets import get_preset, resolve

    if spec.endswith((".yaml", ".yml")):
        return resolve(spec)
    name, edits = parse_edits(spec)
    return get_preset(name).replace(**edits) if edits else get_preset(name)


def variant_problems(spec: str, custom: dict | None = None) -> list[str]:
    kind = variant_kind(spec, custom)
    if kind != "preset":
        return []
    presets = list(list_presets())
    allowed = (f"peers {', '.join(PEERS)}; presets {', '.join(presets)} (optionally with edits, "
               "PRESET:section.field=value); or a .yaml config")
    if spec.endswith((".yaml", ".yml")):
        if not os.path.isfile(spec):
            return [f"--presets: {spec!r} is not an existing file; allowed: {allowed}; fix: check the path"]
    else:
        try:
            name, _ = parse_edits(spec)
        except ValueError as exc:
            return [f"--presets: {spec!r} has the edit {str(exc)!r}, not section.field=value; fix: e.g. "
                    "fast:compile.mode=None"]
        if name not in presets:
            return [f"--presets/--peers: {spec!r} is not allowed; allowed: {allowed}; fix: e.g. --presets fast "
                    "--peers stock,trl-sft"]
    try:
        preset_config(spec)
    except SpeedupConfigError as exc:
        return [f"--presets {spec!r}: {p}" for p in exc.problems]
    return []


def split_list(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def parse_model_config(text: str) -> Any:
    """``--config``: inline JSON or a path to a JSON file (a model's config.json)."""
    if os.path.isfile(text):
        with open(text) as fh:
            text = fh.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpeedupConfigError([f"--config = {text[:80]!r} is not valid JSON ({exc.msg}); allowed: a JSON object "
                                  "or a path to a JSON file; fix: e.g. --config '{\"hidden_size\": 256}'"]) from None


def dry_run(options: BenchOptions) -> BenchOptions:
    """The same plan on a CPU with a tiny config: proves the harness end to end in a minute or two."""
    return dataclasses.replace(options, model=None, tiny=False, model_config=dict(DRY_RUN_CONFIG), device="cpu",
                               seq_len=min(options.seq_len, 128), batch_size=min(options.batch_size, 2), steps=3,
                               warmup=1, precision="fp32", schedule="sequential")
