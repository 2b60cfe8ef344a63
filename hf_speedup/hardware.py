"""Probe the machine once into frozen Capabilities, so planning stays pure and testable with fakes."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    device_type: str = "cpu"  # cuda | cpu | mps | xpu
    device_name: str = "cpu"
    device_count: int = 0
    compute_capability: tuple[int, int] | None = None
    bf16: bool = False  # bf16 runs natively *and fast* (Ampere+ GPU, AMX CPU)
    bf16_reason: str = ""
    fp16: bool = False  # fp16 tensor cores (CUDA)
    tf32: bool = False  # Ampere+ NVIDIA (transformers refuses tf32 under ROCm)
    rocm: bool = False  # an AMD GPU through torch's ROCm build: compute capabilities are not NVIDIA's
    fused_adamw: bool = True  # torch.optim.AdamW(fused=True) on this device
    bitsandbytes: bool = False  # importable and has a CUDA device to run on
    bitsandbytes_reason: str = ""
    compile: bool = True  # torch.compile usable (inductor needs a C compiler on CPU, triton on GPU)
    compile_reason: str = ""
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    cpu_threads: int = 1
    cpu_cores: int = 0  # the cores this process may run on (sched_getaffinity); 0: unknown
    torch_version: str = ""
    memory_bytes: int | None = None  # the device's memory: CUDA total_memory, CPU physical RAM (memory.budget: auto)
    device: str = "cpu"  # the device the Trainer trains on ("cuda:1", "cpu"): the plan is made for it
    device_reason: str = ""  # who chose it: TrainingArguments.use_cpu, ACCELERATE_USE_CPU, the local rank, ...
    # what this machine measured for this model, by key ("precision.bf16_matmul" -> measured.Measurement): filled
    # at the door by the features' ``measure`` hooks (runner.measure); empty where nothing was measured
    measured: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _cpu_bf16() -> tuple[bool, str]:
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    if amx:
        return True, "CPU has AMX tiles: bf16 matmuls run natively"
    if avx512_bf16:
        return False, ("CPU has avx512_bf16 but no AMX: whether bf16 autocast beats fp32 depends on the model's "
                       "shapes (2-3x at a 135M model's matmuls on a Zen 4 core, slower at a toy model's, where the "
                       "casts dominate): timed per model at the door (precision.bf16_matmul)")
    return False, "CPU has no native bf16 (no AMX, no avx512_bf16)"


BITSANDBYTES_ON_CPU = ("hf_speedup runs bitsandbytes on CUDA only: its CPU kernels work but are slow (an 8-bit "
                       "AdamW step over 134M parameters took 32x torch's fused AdamW on a 2-core AMD EPYC, AVX2)")


def _bitsandbytes(cuda: bool) -> tuple[bool, str]:
    if importlib.util.find_spec("bitsandbytes") is None:
        return False, "bitsandbytes is not installed (pip install bitsandbytes)"
    if not cuda:
        return False, BITSANDBYTES_ON_CPU
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # a broken CUDA setup surfaces here, not mid-training
        return False, f"bitsandbytes failed to import: {exc}"
    return True, "bitsandbytes imports and a CUDA device is present"


def _compile_ok(cuda: bool) -> tuple[bool, str]:
    if cuda:
        if importlib.util.find_spec("triton") is None:
            return False, "inductor on CUDA needs triton, which is not installed"
        return True, "triton present"
    if not (shutil.which("gcc") or shutil.which("cc") or shutil.which("clang") or os.environ.get("CXX")):
        return False, "inductor on CPU needs a C++ compiler (gcc/clang); none on PATH"
    return True, "C++ compiler present for inductor CPU code"


def training_device(args: Any = None) -> tuple[Any, str]:
    """(the device the Trainer will train on, who chose it), found without initialising any device.

    TrainingArguments resolve their device when they are built (``use_cpu``, ``ACCELERATE_USE_CPU`` from
    ``accelerate launch --cpu``, the local rank's GPU, MPS, XPU), so ``args.device`` is what the Trainer
    trains on. Without arguments (``hf-speedup plan``, ``estimate_memory``) it is the device accelerate
    would pick: CPU when ``ACCELERATE_USE_CPU`` says so, else MPS, CUDA (the local rank's index), XPU, CPU.
    """
    import torch

    if args is not None and getattr(args, "use_cpu", False):
        return torch.device("cpu"), "TrainingArguments.use_cpu=True"
    if _env_flag("ACCELERATE_USE_CPU"):
        return torch.device("cpu"), "ACCELERATE_USE_CPU (accelerate launch --cpu)"
    device = _args_device(args)
    if device is not None:
        return device, f"TrainingArguments.device={device}"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps"), "MPS available"
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1)), "CUDA available"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return torch.device("xpu", local_rank % max(xpu.device_count(), 1)), "XPU available"
    return torch.device("cpu"), "no accelerator"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on", "y")


def _args_device(args: Any):
    """``args.device`` where TrainingArguments already resolved it; None for other objects."""
    import torch

    device = getattr(args, "device", None) if args is not None else None
    return device if isinstance(device, torch.device) else None


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def probe(args: Any = None) -> Capabilities:
    """Read once the device the Trainer will train on (:func:`training_device`). Touches CUDA only to query it
    (no allocation), and only when the training device is a GPU."""
    import torch

    device, why = training_device(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    common = dict(world_size=world, rank=rank, local_rank=local_rank, cpu_threads=torch.get_num_threads(),
                  cpu_cores=_cpu_cores(),
                  torch_version=torch.__version__, device=str(device), device_reason=why)
    if device.type == "cuda":
        return _cuda_caps(device.index or 0, common)
    if device.type != "cpu":
        return _other_accelerator_caps(device, common)
    bf16, bf16_reason = _cpu_bf16()
    common["memory_bytes"] = _physical_memory()
    bnb, bnb_reason = _bitsandbytes(False)
    comp, comp_reason = _compile_ok(False)
    return Capabilities(
        device_type="cpu", device_name=cpu_name(), device_count=0, bf16=bf16, bf16_reason=bf16_reason,
        fused_adamw=True, bitsandbytes=bnb, bitsandbytes_reason=bnb_reason, compile=comp,
        compile_reason=comp_reason, **common,
    )


def _cuda_caps(idx: int, common: dict) -> Capabilities:
    import torch

    name = torch.cuda.get_device_name(idx)
    cc = torch.cuda.get_device_capability(idx)
    bf16 = torch.cuda.is_bf16_supported() and cc >= (8, 0)
    rocm = getattr(torch.version, "hip", None) is not None  # MI300 reports 9.4, yet has no TF32 or Hopper kernels
    bnb, bnb_reason = _bitsandbytes(True)
    comp, comp_reason = _compile_ok(True)
    common["memory_bytes"] = int(torch.cuda.get_device_properties(idx).total_memory)
    return Capabilities(
        device_type="cuda", device_name=name, device_count=torch.cuda.device_count(), compute_capability=cc,
        bf16=bf16, bf16_reason=f"CUDA compute capability {cc[0]}.{cc[1]}" + ("" if bf16 else " < 8.0: no bf16"),
        fp16=True, tf32=cc >= (8, 0) and not rocm, rocm=rocm, fused_adamw=True, bitsandbytes=bnb,
        bitsandbytes_reason=bnb_reason, compile=comp, compile_reason=comp_reason, **common,
    )


def _other_accelerator_caps(device, common: dict) -> Capabilities:
    """XPU, MPS or another accelerator: what torch says of it, planned conservatively where hf_speedup has
    measured nothing; no TF32 and no bitsandbytes (hf_speedup runs those on CUDA only)."""
    import torch

    bnb_reason = f"hf_speedup runs bitsandbytes on CUDA only (this is {device.type})"
    if device.type == "xpu":
        idx = device.index or 0
        bf16 = bool(torch.xpu.is_bf16_supported())
        comp, comp_reason = ((True, "triton present") if importlib.util.find_spec("triton") is not None
                             else (False, "inductor on XPU needs triton, which is not installed"))
        common["memory_bytes"] = int(torch.xpu.get_device_properties(idx).total_memory)
        return Capabilities(
            device_type="xpu", device_name=torch.xpu.get_device_name(idx), device_count=torch.xpu.device_count(),
            bf16=bf16, bf16_reason="XPU " + ("supports bf16" if bf16 else "without bf16"), fp16=True,
            fused_adamw=True, bitsandbytes=False, bitsandbytes_reason=bnb_reason, compile=comp,
            compile_reason=comp_reason, **common)
    mps = device.type == "mps"
    if mps:
        common["memory_bytes"] = _physical_memory()  # unified memory
    return Capabilities(
        device_type=device.type, device_name="Apple MPS" if mps else device.type.upper(), device_count=1,
        bf16=False, bf16_reason=f"bf16 autocast on {device.type} is not measured by hf_speedup: fp32 unless asked",
        fp16=False, fused_adamw=mps, bitsandbytes=False, bitsandbytes_reason=bnb_reason, compile=False,
        compile_reason=f"hf_speedup compiles on CUDA, XPU and CPU; inductor on {device.type} is not measured",
        **common)


def _physical_memory() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # pragma: no cover - psutil is a dependency
        return None


def cpu_name() -> str:
    """The CPU's model name: ``device_name`` on CPU, and part of the CPU GEMM choices' cache key."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
