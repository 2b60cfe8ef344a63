"""Named SpeedupConfigs and YAML load/save: this module only builds configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .config import SpeedupConfig, SpeedupConfigError, dotted_keys


# name -> (one-line description with its trade-off, nested overrides of the SpeedupConfig defaults)
_PRESETS: dict[str, tuple[str, dict]] = {
    "baseline": (
        "Nothing changed: exactly the stock Trainer with your TrainingArguments. The reference for parity and speed.",
        {"precision": {"dtype": "keep", "tf32": "keep"}, "optimizer": {"name": "keep"},
         "interrupt": {"enabled": False},  # signals keep their default action, as with the stock Trainer
         "crash_safe": {"asynchronous": False},  # the Trainer waits for its checkpoints, as the stock one does
         "attention": {"implementation": "keep"}, "experts": {"implementation": "keep"},
         "loss": {"scaling": "stock"},  # the stock Trainer's loss scaling, wrong where a head takes its own mean
         # output_dir, the logs and stdout as the stock Trainer leaves them: the report stays in memory
         "report": {"path": None, "trackers": False, "console": False}},
    ),
    "auto": (
        "Safe wins for this machine: native bf16 where it is fast, TF32, fused AdamW, regional compile on GPUs, "
        "padding-free batches where the model keeps packed sequences apart (else padding to a multiple of 8), the "
        "attention kernel for the device and the rows. Trade-off: bf16 and TF32 round differently from fp32 (losses "
        "differ in the 3rd-4th digit), and on GPUs a cold compile of the blocks (tens of seconds) before the first "
        "compiled step.",
        {"compile": {"enabled": "auto"},
         "data": {"pad_to_multiple_of": 8, "pin_memory": True, "padding_free": "auto"}},
    ),
    "fast": (
        "Maximum steps/s: auto plus regional compile of the decoder blocks on every device (max-autotune GEMMs), "
        "padding-free rows with a dynamic sequence dimension (or, where rows must be padded, static shapes padded "
        "to 64 with the last partial batch of an epoch dropped; on CUDA padding-free rows compile in mode default), "
        "Liger's fused loss on CUDA, and on CPU freed memory "
        "kept for reuse. Trade-off: a cold compile (tens of seconds on CPU); on CPU the first steps run eager and "
        "the blocks compile only when the rest of the run earns that back (compile.when: pays_back); on CPU "
        "resident memory stays at its peak. regions: blocks+head also compiles final norm + lm_head + loss (no "
        "steady gain measurable on CPU here, ~40% longer cold start).",
        {
            "compile": {"enabled": True, "mode": "max-autotune", "dynamic": False, "regions": "blocks",
                        "when": "pays_back"},
            "optimizer": {"name": "adamw_fused"},
            "memory": {"cpu_reuse_freed": True},
            "data": {"pad_to_multiple_of": 64, "drop_last": True, "padding_free": "auto"},
            "liger": {"enabled": "auto"},
        },
    ),
    "memory": (
        "Fit a bigger model or batch: activation checkpointing on every block, chunked cross-entropy (the "
        "full-vocabulary logits never exist), paged 8-bit AdamW (GPU), expandable CUDA segments, periodic "
        "empty-cache, Liger kernels on CUDA, TRL's activation offloading on CUDA. Trade-off: ~30% slower steps "
        "from recomputation.",
        {
            "checkpointing": {"enabled": True, "every_n_blocks": 1},
            "loss": {"chunked": True},
            "optimizer": {"name": "paged_adamw_8bit"},
            "memory": {"empty_cache_steps": 50, "expandable_segments": True, "activation_offloading": "auto"},
            "data": {"pad_to_multiple_of": 8, "pin_memory": True},
            "liger": {"enabled": "auto"},
        },
    ),
    "long": (
        "Long sequences: what a block keeps between forward and backward is its input alone (every block "
        "checkpointed; on CUDA that input waits in pinned host memory, copied on a side stream and prefetched a block "
        "ahead), and each block's MLP runs over tiles of the sequence, recomputed tile by tile, so its intermediates "
        "never exist for the whole sequence; chunked cross-entropy (no full logits), padding-free rows, an attention "
        "kernel whose memory is linear in the length. Compose with LoRA/QLoRA through base: long. Trade-off: slower "
        "steps (every block recomputed, ~35%), host memory for the block inputs on CUDA.",
        {
            "checkpointing": {"enabled": True, "every_n_blocks": 1, "offload": "auto"},
            "tiled_mlp": {"enabled": True, "tile_tokens": "auto"},
            "loss": {"chunked": True},
            "memory": {"expandable_segments": True},
            "data": {"padding_free": "auto", "pin_memory": True},
        },
    ),
    "lora": (
        "Parameter-efficient fine-tuning: LoRA adapters (r=16) on every attention and MLP projection, base frozen. "
        "Trade-off: adapters learn less than a full fine-tune on large domain shifts; optimizer state is tiny.",
        {"lora": {"enabled": True}, "compile": {"enabled": "auto"}, "data": {"pad_to_multiple_of": 8, "pin_memory": True}},
    ),
    "qlora": (
        "LoRA on a 4-bit NF4 base (bitsandbytes, CUDA) with checkpointing and paged 8-bit AdamW: the least memory. "
        "Trade-off: slower steps (dequantisation, recomputation); without CUDA it falls back to plain LoRA.",
        {
            "lora": {"enabled": True, "quantization": "4bit"},
            "checkpointing": {"enabled": True},
            "optimizer": {"name": "paged_adamw_8bit"},
            "memory": {"expandable_segments": True},
            "data": {"pad_to_multiple_of": 8, "pin_memory": True},
        },
    ),
    "fsdp": (
        "Shard a full fine-tune across processes: FSDP2 full_shard, one unit per decoder block, mixed precision "
        "matched to the device, sharded checkpoints (accelerate on GPUs; hf_speedup's own fully_shard on CPU). "
        "Launch with torchrun/accelerate launch. Trade-off: all-gather/reduce-scatter traffic every step.",
        {"fsdp": {"enabled": True}, "compile": {"enabled": "auto"}, "data": {"pad_to_multiple_of": 8, "pin_memory": True}},
    ),
    "fsdp-offload": (
        "fsdp plus parameters, gradients and optimizer state offloaded to CPU RAM and activation checkpointing: "
        "the largest model that fits. Trade-off: much slower steps (host<->device copies, recomputation).",
        {
            "fsdp": {"enabled": True, "cpu_offload": True},
            "checkpointing": {"enabled": True},
            "data": {"pad_to_multiple_of": 8, "pin_memory": True},
        },
    ),
    "fsdp-lora": (
        "LoRA adapters under FSDP2: the frozen base sharded across processes, adapters sharded with their "
        "blocks, tiny optimizer state. Trade-off: as lora, plus FSDP communication.",
        {"fsdp": {"enabled": True}, "lora": {"enabled": True}, "compile": {"enabled": "auto"},
         "data": {"pad_to_multiple_of": 8, "pin_memory": True}},
    ),
}


def list_presets() -> dict[str, str]:
    """Preset name -> description."""
    return {name: desc for name, (desc, _) in _PRESETS.items()}


def get_preset(name: str) -> SpeedupConfig:
    if name not in _PRESETS:
        raise SpeedupConfigError([
            f"speedup = {name!r} is not a known preset; allowed: {', '.join(_PRESETS)}, a SpeedupConfig or a path "
            "to a .yaml file; fix: e.g. speedup='auto'"
        ])
    desc, overrides = _PRESETS[name]
    return SpeedupConfig.from_dict({"name": name, "description": desc, **overrides}).with_explicit_fields(())


def load_config(path: str | Path) -> SpeedupConfig:
    """Read a YAML config; ``base: PRESET`` starts from that preset and overrides its sections."""
    path = Path(path)
    if not path.is_file():
        raise SpeedupConfigError([f"speedup = {str(path)!r}: no such file; fix: give an existing .yaml path or a preset name ({', '.join(_PRESETS)})"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpeedupConfigError([f"{path}:{where}: not valid YAML ({problem}); fix: correct the YAML syntax "
                                  "there (sections such as 'compile:' map to indented 'field: value' lines)"]) from None
    if not isinstance(data, dict):
        raise SpeedupConfigError([f"{path}: the YAML is a {type(data).__name__}, not a mapping; fix: write sections such as 'compile:' at the top level"])
    return from_dict({"name": path.stem, **data}, source=str(path))


def from_dict(data: dict, source: str | None = None) -> SpeedupConfig:
    """A config dict (as in YAML); ``base: PRESET`` starts from that preset and overrides its sections."""
    base = data.get("base")
    if base is None:
        return SpeedupConfig.from_dict(data)
    if not isinstance(base, str) or base not in _PRESETS:
        where = f" (in {source})" if source else ""
        raise SpeedupConfigError([f"base = {base!r}{where} is not a known preset; allowed: {', '.join(_PRESETS)}; fix: "
                                  "name the preset to start from, e.g. base: fast, or drop base:"])
    merged = get_preset(base).to_dict()
    for key, value in data.items():
        if key == "base":
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    merged["name"] = data.get("name", f"{base}+custom")
    return SpeedupConfig.from_dict(merged).with_explicit_fields(dotted_keys(data))  # the preset's own: not explicit


def resolve(speedup: Any) -> SpeedupConfig:
    """Anything ``SpeedupTrainer(speedup=...)`` accepts -> a validated SpeedupConfig."""
    if speedup is None:  # ambiguous: "the default" to some, "nothing" to others; say which is which
        raise SpeedupConfigError([
            f"speedup = None is not allowed; allowed: a preset name ({', '.join(_PRESETS)}), a SpeedupConfig, a dict "
            "or a .yaml path; fix: leave speedup out for the default 'auto', or speedup='baseline' for the stock "
            "Trainer unchanged"])
    if isinstance(speedup, SpeedupConfig):
        return speedup.validate()
    if isinstance(speedup, dict):
        return from_dict(speedup)
    if isinstance(speedup, Path) or (isinstance(speedup, str) and speedup.endswith((".yaml", ".yml"))):
        return load_config(speedup)
    if isinstance(speedup, str):
        return get_preset(speedup)
    raise SpeedupConfigError([
        f"speedup = {speedup!r} has type {type(speedup).__name__}; allowed: a preset name ({', '.join(_PRESETS)}), "
        "a SpeedupConfig, a dict or a .yaml path; fix: e.g. speedup='auto'"
    ])


def write_preset_yamls(folder: str | Path) -> list[Path]:
    """Write every preset as YAML (the files shipped in ``configs/presets/``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name in _PRESETS:
        p = folder / f"{name}.yaml"
        cfg = get_preset(name)
        header = f"# hf_speedup preset '{name}' (generated by `hf-speedup presets --write`)\n"
        p.write_text(header + cfg.to_yaml())
        out.append(p)
    return out
