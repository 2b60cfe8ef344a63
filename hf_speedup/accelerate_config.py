"""``accelerate launch`` config files for an hf_speedup preset and a machine layout.

    from hf_speedup.accelerate_config import write_accelerate_config
    write_accelerate_config("fsdp", num_processes=8)                    # -> YAML text
    write_accelerate_config("fsdp", 16, num_machines=2, path="hsdp.yaml")  # -> Path

What the preset decides:

- ``fsdp.enabled``: ``distributed_type: FSDP`` and the ``fsdp_config`` the fsdp feature decides for a
  launched GPU run on that layout (``features/fsdp``: the same settings and the same translation into
  accelerate's options as the Trainer path): ``fsdp_version: 2``, ``TRANSFORMER_BASED_WRAP`` (the block
  class comes from the model's ``_no_split_modules``, the same class hf_speedup's block finder uses),
  ``fsdp_reshard_after_forward`` from the strategy (FSDP1, i.e. ``no_shard``: also ``fsdp_sharding_strategy``,
  since the launcher exports FSDP_SHARDING_STRATEGY and accelerate's FSDP1 prefers it), CPU offload,
  state-dict type, CPU-RAM-efficient loading and FSDP's own activation checkpointing when the preset
  checkpoints. ``hybrid_shard`` on several machines is HSDP: ``parallelism_config`` with one replica per
  machine, sharded within it.
- otherwise: one process -> ``distributed_type: NO``; several -> ``MULTI_GPU`` (DDP).
- ``mixed_precision``: bf16 unless the preset keeps the user's precision or asks for fp16/fp32.
- ``dynamo_config``: accelerate's regional compilation (one compile of the repeated block, reused) when
  the preset compiles (``compile.enabled`` auto/true); left out with CPU offload, where host<->device
  copies dominate the step. With ``--speedup`` and hf_speedup's compile decision active, SpeedupTrainer turns
  accelerate's dynamo off (hf_speedup already compiled the blocks; the compile reason says so); the file's
  ``dynamo_config`` serves the stock Trainer.

These files are for GPU machines. With ``--speedup`` (SpeedupTrainer) the preset's own FSDP settings
reach the Trainer through TrainingArguments and take precedence over the file's ``fsdp_config``; the file
still sets the launch topology (processes, machines, rendezvous) and, for the stock Trainer, everything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .config import SpeedupConfig, SpeedupConfigError
from .features.fsdp.decision import settings_for_launch_file
from .features.fsdp.settings import launch_file_fsdp_config
from .presets import get_preset, resolve

# The shipped files (configs/accelerate/<name>.yaml): name -> (preset, overrides, num_processes, num_machines)
SHIPPED: dict[str, tuple[str, dict, int, int]] = {
    "single_gpu_bf16": ("auto", {}, 1, 1),
    "multi_gpu_ddp": ("auto", {}, 8, 1),
    "fsdp2_full_shard": ("fsdp", {}, 8, 1),
    "fsdp2_offload": ("fsdp-offload", {}, 8, 1),
    "fsdp2_hybrid_multinode": ("fsdp", {"fsdp": {"strategy": "hybrid_shard"}}, 16, 2),
    "long_context_parallel": ("long", {"fsdp": {"enabled": True}}, 8, 1),
}
# what a shipped file's layout adds beyond processes and machines (keyword arguments of write_accelerate_config)
SHIPPED_LAYOUT: dict[str, dict] = {"long_context_parallel": {"context_parallel": 2}}

_PLACEHOLDER_IP = "MAIN_NODE_IP"
# Seconds the launchers wait for every machine to join (the rendezvous) before they stop with an error; torch's
# default is 600 s of silence. An accelerate config file has no field for it: the commands pass --rdzv_conf.
RENDEZVOUS_TIMEOUT_S = 300
_COMMENTS = {
    "main_process_ip": "# REPLACE: address of the machine with machine_rank 0, reachable from every node",
    "machine_rank": "# REPLACE on each node: 0 on the main node, 1 .. num_machines-1 elsewhere (or --machine_rank)",
    "num_processes": "# processes in total, all machines (override: --num_processes)",
}


def _mixed_precision(cfg: SpeedupConfig) -> str:
    dtype = cfg.precision.dtype
    if dtype == "fp16":
        return "fp16"
    if dtype in ("fp32", "keep"):
        return "no"
    return "bf16"  # auto / bf16: every GPU these files target (Ampere+) runs bf16 natively


def accelerate_config_dict(preset: Any = "fsdp", num_processes: int = 8, num_machines: int = 1, *,
                           machine_rank: int = 0, main_process_ip: str | None = None,
                           main_process_port: int = 29500, mixed_precision: str | None = None,
                           regional_compile: bool | None = None, context_parallel: int = 1) -> dict:
    """The config as a dict, in the keys ``accelerate launch --config_file`` reads (``ClusterConfig``).
    ``context_parallel``: ranks each row is split over (torch's context parallelism inside FSDP2)."""
    cfg = resolve(preset)
    problems = []
    if context_parallel != 1 and (not isinstance(context_parallel, int) or isinstance(context_parallel, bool)
                                  or context_parallel < 1 or not cfg.fsdp.enabled
                                  or (isinstance(num_processes, int) and num_processes % context_parallel)):
        problems.append(f"context_parallel = {context_parallel!r} is not allowed here; allowed: an integer >= 1 that "
                        "divides num_processes, with a preset that shards with FSDP2 (context parallelism runs inside "
                        "it); fix: e.g. preset={'base': 'long', 'fsdp': {'enabled': True}}, context_parallel=2")
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        problems.append(f"num_processes = {num_processes!r} is not allowed; allowed: an integer >= 1; fix: e.g. 8")
    if not isinstance(num_machines, int) or isinstance(num_machines, bool) or num_machines < 1:
        problems.append(f"num_machines = {num_machines!r} is not allowed; allowed: an integer >= 1; fix: e.g. 2")
    elif isinstance(num_processes, int) and num_processes >= 1 and num_processes % num_machines:
        problems.append(f"num_processes = {num_processes} is not a multiple of num_machines = {num_machines}; "
                        "allowed: the same number of processes on every machine; fix: e.g. "
                        f"num_processes = {num_machines * max(1, num_processes // num_machines)}")
    if mixed_precision not in (None, "no", "bf16", "fp16"):
        problems.append(f"mixed_precision = {mixed_precision!r} is not allowed; allowed: None (from the preset), "
                        "'no', 'bf16', 'fp16'; fix: mixed_precision='bf16'")
    if problems:
        raise SpeedupConfigError(problems)

    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if cfg.fsdp.enabled:
        fsdp = settings_for_launch_file(cfg, num_processes, num_machines)
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = launch_file_fsdp_config(fsdp)
        if fsdp.parallelism and fsdp.parallelism[0] > 1:  # one replica (one machine) is a plain full shard
            replicas, shard = fsdp.parallelism
            out["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicas,
                                         "parallelism_config_dp_shard_size": shard}
        if context_parallel > 1:
            out["parallelism_config"] = {"parallelism_config_dp_shard_size": num_processes // context_parallel,
                                         "parallelism_config_cp_size": context_parallel}
    else:
        out["distributed_type"] = "NO" if num_processes == 1 else "MULTI_GPU"
    out["downcast_bf16"] = "no"
    out["enable_cpu_affinity"] = False
    out["gpu_ids"] = "all"
    out["machine_rank"] = machine_rank
    if num_machines > 1:
        out["main_process_ip"] = main_process_ip or _PLACEHOLDER_IP
        out["main_process_port"] = main_process_port
    out["main_training_function"] = "main"
    out["mixed_precision"] = mixed_precision or _mixed_precision(cfg)
    out["num_machines"] = num_machines
    out["num_processes"] = num_processes
    out["rdzv_backend"] = "static"
    out["same_network"] = True
    out["tpu_env"] = []
    out["tpu_use_cluster"] = False
    out["tpu_use_sudo"] = False
    out["use_cpu"] = False
    compile_on = regional_compile if regional_compile is not None else (
        cfg.compile.enabled in (True, "auto") and not cfg.fsdp.cpu_offload)
    if compile_on:
        out["dynamo_config"] = {
            "dynamo_backend": "INDUCTOR",
            "dynamo_mode": cfg.compile.mode or "default",
            "dynamo_use_dynamic": bool(cfg.compile.dynamic),
            "dynamo_use_fullgraph": bool(cfg.compile.fullgraph),
            "dynamo_use_regional_compilation": True,
        }
    return out


def _header(shown: str, cfg: SpeedupConfig, d: dict) -> str:
    n, m = d["num_processes"], d["num_machines"]
    lines = [f"# accelerate launch config for hf_speedup preset {cfg.name!r}: {d['distributed_type']}, "
             f"{n} process(es) on {m} machine(s), mixed_precision {d['mixed_precision']}"
             + (", regional compile" if d.get("dynamo_config") else "") + ".",
             "# Written by hf_speedup.accelerate_config (hf-speedup accelerate-config); loaded by accelerate's own",
             "# config loader in tests/test_accelerate_configs.py.",
             "#"]
    script = f"examples/finetune.py --speedup {cfg.name}"
    if m > 1:
        wait = f"--rdzv_conf timeout={RENDEZVOUS_TIMEOUT_S}"
        lines += ["# Run the same command on every machine, each with its own --machine_rank:",
                  f"#   accelerate launch --config_file {shown} --machine_rank 0 {wait} {script}",
                  f"#   accelerate launch --config_file {shown} --machine_rank 1 {wait} {script}",
                  f"# A machine that never joins: after {RENDEZVOUS_TIMEOUT_S} s the main machine's launcher stops with",
                  f"# 'DistStoreError: Timed out after ... seconds waiting for clients. {m - 1}/{m} clients joined.'",
                  "# (without --rdzv_conf it waits 600 s)."]
    else:
        lines += [f"#   accelerate launch --config_file {shown} {script}"]
        if n > 1:
            lines += [f"# Another GPU count: add --num_processes N (same file)."]
    pc = d.get("parallelism_config") or {}
    if pc.get("parallelism_config_cp_size"):
        lines += [f"# Context parallelism: each row split over {pc['parallelism_config_cp_size']} GPUs (torch's, inside "
                  f"FSDP2), sharded over {pc['parallelism_config_dp_shard_size']};",
                  "# keep dp_shard_size * cp_size = num_processes. SDPA attention, unpacked rows (the plan sees to both).",
                  "# Not run on GPUs by hf_speedup yet (docs/features/long-context.md)."]
    elif pc:
        lines += [f"# HSDP: {pc['parallelism_config_dp_replicate_size']} replicas (one per machine), each sharded over "
                  f"{pc['parallelism_config_dp_shard_size']} GPUs;",
                  "# keep dp_replicate_size * dp_shard_size = num_processes.",
                  "# CPU machines: accelerate refuses parallelism_config there (MULTI_CPU); hf_speedup's fsdp presets",
                  "# apply the layout themselves (--mixed_precision no); for any other preset drop parallelism_config."]
    if d.get("fsdp_config", {}).get("fsdp_offload_params"):
        lines += ["# No dynamo_config: with CPU offload the step is bound by host<->device copies, not compute."]
    return "\n".join(lines) + "\n"


def render(d: dict, header: str = "") -> str:
    text = yaml.safe_dump(d, sort_keys=False)
    out = []
    for line in text.splitlines():
        key = line.split(":", 1)[0]
        comment = _COMMENTS.get(key) if not line.startswith(" ") else None
        if comment and (key != "num_processes" or d.get("num_machines", 1) > 1) and \
                (key != "machine_rank" or d.get("num_machines", 1) > 1):
            line = f"{line}  {comment}"
        out.append(line)
    return header + "\n".join(out) + "\n"


def write_accelerate_config(preset: Any = "fsdp", num_processes: int = 8, num_machines: int = 1,
                            path: str | Path | None = None, *, machine_rank: int = 0,
                            main_process_ip: str | None = None, main_process_port: int = 29500,
                            mixed_precision: str | None = None, regional_compile: bool | None = None,
                            name: str | None = None, context_parallel: int = 1) -> str | Path:
    """An ``accelerate launch --config_file`` YAML for ``preset`` on ``num_processes`` processes.

    ``preset``: a preset name, SpeedupConfig, dict or YAML path. ``num_processes`` counts all machines.
    With ``num_machines > 1`` the multi-node fields are written (``main_process_ip`` defaults to the
    placeholder ``MAIN_NODE_IP``; ``machine_rank`` is set per node at launch). Returns the YAML text when
    ``path`` is None, else writes it and returns the Path. ``name`` makes the header's example command point at
    ``configs/accelerate/<name>.yaml`` (the shipped files). Bad arguments raise SpeedupConfigError (all at once).
    """
    cfg = resolve(preset)
    d = accelerate_config_dict(cfg, num_processes, num_machines, machine_rank=machine_rank,
                               main_process_ip=main_process_ip, main_process_port=main_process_port,
                               mixed_precision=mixed_precision, regional_compile=regional_compile,
                               context_parallel=context_parallel)
    shown = f"configs/accelerate/{name}.yaml" if name else (str(path) if path is not None else "THIS_FILE.yaml")
    text = render(d, _header(shown, cfg, d))
    if path is None:
        return text
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_shipped_configs(folder: str | Path = "configs/accelerate") -> list[Path]:
    """(Re)write the files shipped in ``configs/accelerate/``."""
    out = []
    for name, (preset, overrides, n, m) in SHIPPED.items():
        cfg = get_preset(preset).replace(**overrides) if overrides else get_preset(preset)
        if overrides:
            cfg.name = preset
        out.append(write_accelerate_config(cfg, n, m, Path(folder) / f"{name}.yaml", name=name,
                                           **SHIPPED_LAYOUT.get(name, {})))
    return out
