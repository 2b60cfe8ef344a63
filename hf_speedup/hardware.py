"""Probe the machine once into frozen Capabilities, so planning stays pure and testable with fakes."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from dataclasses import asdict, dataclass


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
    torch_version: str = ""
    memory_bytes: int | None = None  # the device's memory: CUDA total_memory, CPU physical RAM (memory.budget: auto)

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
        return False, ("CPU has avx512_bf16 but no AMX: bf16 autocast was measured 2.6x slower than fp32 "
                       "on such a CPU (conversions dominate)")
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


def probe() -> Capabilities:
    """Read the hardware once. Touches CUDA only to query it (no allocation)."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    common = dict(world_size=world, rank=rank, local_rank=local_rank, cpu_threads=torch.get_num_threads(),
                  torch_version=torch.__version__)
    if torch.cuda.is_available():
        idx = local_rank % max(torch.cuda.device_count(), 1)
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
            fp16=True, tf32=cc >= (8, 0) and not rocm, rocm=rocm, fused_adamw=True, bitsandbytes=bnb, bitsandbytes_reason=bnb_reason,
            compile=comp, compile_reason=comp_reason, **common,
        )
    bf16, bf16_reason = _cpu_bf16()
    common["memory_bytes"] = _physical_memory()
    bnb, bnb_reason = _bitsandbytes(False)
    comp, comp_reason = _compile_ok(False)
    return Capabilities(
        device_type="cpu", device_name=cpu_name(), device_count=0, bf16=bf16, bf16_reason=bf16_reason,
        fused_adamw=True, bitsandbytes=bnb, bitsandbytes_reason=bnb_reason, compile=comp,
        compile_reason=comp_reason, **common,
    )


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
