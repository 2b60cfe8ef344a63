"""A "GPU host" on any machine: torch.cuda answers as one H100 does, up to the first real CUDA call.

Queries (name, capability, properties) answer as an H100's and, like torch's, initialise CUDA; the first
call that would allocate or run a kernel (``torch.cuda._lazy_init``: a tensor moved to ``cuda``) raises
:class:`FirstCudaCall`. The host keeps a timeline of what happened when (``events``): CUDA initialised, an
allocator setting applied, the first CUDA call, so a test can check that no setting is applied after the
moment torch reads it. Its allocator holds fake segments (``reserve``) that ``memory_snapshot`` lists.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

H100_NAME = "NVIDIA H100 80GB HBM3"


class FirstCudaCall(RuntimeError):
    """A real CUDA call (an allocation, a kernel launch) on a faked GPU host."""


@dataclass
class GpuHost:
    device_count: int = 1
    initialized: bool = False
    events: list[tuple[str, str]] = field(default_factory=list)  # (what, where: the caller's file:function)
    segments: list[dict] = field(default_factory=list)
    queried: list[int] = field(default_factory=list)  # device indexes the queries asked about
    allocator_settings: list[str] = field(default_factory=list)  # what set_allocator_settings applied, in order

    def event(self, what: str) -> None:
        frame = next((f for f in reversed(traceback.extract_stack()[:-2]) if "fake_gpu" not in f.filename),
                     None)
        self.events.append((what, f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}" if frame else "?"))

    def init(self) -> None:
        if not self.initialized:
            self.initialized = True
            self.event("cuda-init")

    def first(self, what: str) -> int | None:
        """Index of the first event ``what`` in the timeline, None when it never happened."""
        return next((i for i, (w, _) in enumerate(self.events) if w == what), None)

    def reserve(self, size: int, expandable: bool) -> None:
        """A segment the caching allocator reserved (what ``memory_snapshot`` will list)."""
        self.segments.append({"address": 0x7F0000000000 + (len(self.segments) << 36), "total_size": size,
                              "is_expandable": expandable, "device": 0, "blocks": []})

    def install(self, monkeypatch) -> "GpuHost":
        import hf_speedup.compat as compat
        import hf_speedup.hardware as hardware
        import hf_speedup.features.memory as memory

        props = SimpleNamespace(name=H100_NAME, total_memory=80 * 2**30, major=9, minor=0, multi_processor_count=132)

        def query(value, initialises: bool = True):
            def answer(*args, **kwargs):
                if args and isinstance(args[0], (int, torch.device)):
                    self.queried.append(args[0] if isinstance(args[0], int) else (args[0].index or 0))
                if initialises:
                    self.init()
                return value
            return answer

        def real_call(*args, **kwargs):
            self.event("first-cuda-call")
            raise FirstCudaCall("a real CUDA call on the faked GPU host (an allocation or a kernel)")

        answers = {"is_available": query(True, False), "device_count": query(self.device_count, False),
                   "get_device_name": query(H100_NAME), "get_device_capability": query((9, 0)),
                   "get_device_properties": query(props), "is_bf16_supported": query(True),
                   "current_device": query(0), "set_device": query(None), "is_initialized": lambda: self.initialized,
                   "_lazy_init": real_call, "memory_snapshot": lambda *a, **k: list(self.segments),
                   "memory_reserved": lambda *a, **k: sum(s["total_size"] for s in self.segments)}
        for name, fn in answers.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(torch.cuda.memory, "memory_snapshot", answers["memory_snapshot"])
        monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(torch.version, "hip", None, raising=False)
        compile_ok = hardware._compile_ok
        monkeypatch.setattr(hardware, "_compile_ok",
                            lambda cuda: (True, "triton present (faked GPU host)") if cuda else compile_ok(cuda))
        set_settings = compat.set_allocator_settings

        def recorded_set(conf: str) -> bool:
            self.event("allocator-set")
            self.allocator_settings.append(conf)
            return set_settings(conf)

        monkeypatch.setattr(memory, "set_allocator_settings", recorded_set)
        return self


# transformers' answers about the machine, cached per process (``lru_cache``), and its TF32 switch, cached per value
CACHED_DEVICE_CHECKS = ("is_torch_cuda_available", "is_torch_bf16_gpu_available", "is_torch_tf32_available",
                        "is_torch_fp16_available_on_device", "is_torch_bf16_available_on_device", "enable_tf32")


def clear_device_caches() -> None:
    from transformers.utils import import_utils

    for name in CACHED_DEVICE_CHECKS:
        fn = getattr(import_utils, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


# ---------------------------------------------------------------------------------- process-wide torch state
def tf32_snapshot() -> dict:
    """TF32 settings of both torch API generations, to put back after a test changed them."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through the new API alone (transformers' enable_tf32): put back readable
        legacy = "high"
    state = {"legacy": legacy, "cudnn": torch.backends.cudnn.allow_tf32}
    if hasattr(torch.backends, "fp32_precision"):
        state.update(glob=torch.backends.fp32_precision, mm=torch.backends.cuda.matmul.fp32_precision,
                     onednn=torch.backends.mkldnn.matmul.fp32_precision)
    return state


def tf32_restore(state: dict) -> None:
    if "glob" in state:
        torch.backends.fp32_precision = "none"  # undoes a process-wide value (transformers' enable_tf32)
    torch.set_float32_matmul_precision(state["legacy"])
    torch.backends.cudnn.allow_tf32 = state["cudnn"]
    if "glob" in state:
        torch.backends.mkldnn.matmul.fp32_precision = state["onednn"]
        torch.backends.cuda.matmul.fp32_precision = state["mm"]
        if state["glob"] != "none":
            torch.backends.fp32_precision = state["glob"]
    torch.get_float32_matmul_precision()  # readable again
