"""The machine a benchmark ran on, for the record: numbers mean little without it."""

from __future__ import annotations

import os
import platform

CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_flags() -> dict[str, bool]:
    try:
        with open("/proc/cpuinfo") as fh:
            line = next((ln for ln in fh if ln.startswith("flags")), "")
    except OSError:
        line = ""
    flags = set(line.split(":", 1)[-1].split())
    return {f: f in flags for f in CPU_FLAGS}


def machine_info(device: str) -> dict:
    import torch
    from importlib import metadata

    from ..hardware import cpu_name

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "cpu_flags": cpu_flags(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "device": device}
    for package in ("torch", "transformers", "accelerate", "peft", "trl", "liger-kernel", "unsloth"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    if hasattr(os, "getloadavg"):
        info["loadavg"] = list(os.getloadavg())
    return info


def describe(info: dict) -> str:
    """One line: CPU (flags), cores, GPU, versions."""
    flags = ", ".join(f for f, on in info.get("cpu_flags", {}).items() if on) or "none of " + "/".join(CPU_FLAGS)
    gpu = f"; GPU {info['gpu']} (CUDA {info.get('cuda')})" if info.get("gpu") else "; no GPU"
    versions = ", ".join(f"{p} {info[p]}" for p in ("torch", "transformers", "trl") if info.get(p))
    return f"{info['cpu']} ({flags}), {info['cores']} cores{gpu}; {versions}; Python {info['python']}"
