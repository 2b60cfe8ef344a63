"""The report's ``environment`` section: package versions and the device the run saw."""

from __future__ import annotations

from typing import Any

from ..._version import __version__


def package_versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "datasets", "wandb"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(caps: Any = None) -> dict:
    """Versions and the device, for the report's ``environment`` section."""
    import platform

    import torch

    env = {"hf_speedup": __version__, **package_versions(), "python": platform.python_version(),
           "cuda": getattr(torch.version, "cuda", None), "platform": platform.platform(terse=True)}
    if caps is not None:
        env.update(device_type=caps.device_type, device=caps.device, device_reason=caps.device_reason,
                   device_name=caps.device_name, device_count=caps.device_count, world_size=caps.world_size)
    return env
