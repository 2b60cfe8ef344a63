"""Which experts implementations transformers can run here, and which one an experts module really dispatches to.

transformers 5 runs the routed experts of a mixture-of-experts block through ``@use_experts_implementation``:
the module's ``forward`` looks ``config._experts_implementation`` up in an ``ExpertsInterface`` (``eager``: the
model's own per-expert loop; ``batched_mm``: every (token, expert) pair as one ``bmm`` over gathered expert
weights; ``grouped_mm``: tokens sorted by expert, one grouped GEMM per projection through ``torch._grouped_mm``,
or transformers' per-expert fallback op where torch has no kernel for the device).
"""

from __future__ import annotations

import torch

KERNELS = ("eager", "batched_mm", "grouped_mm")
TRANSFORMERS_DEFAULT = "grouped_mm"  # what a model gets when nobody asks (get_correct_experts_implementation)

WHY = {
    "eager": "the model's per-expert loop (one GEMM pair per expert that received tokens)",
    "batched_mm": "one batched GEMM over each (token, expert) pair's gathered expert weights",
    "grouped_mm": "tokens sorted by expert, one grouped GEMM per projection (torch._grouped_mm)",
}


def grouped_gemm(caps) -> tuple[bool, str]:
    """(torch has a grouped-GEMM kernel transformers uses on this device, why not) - its ``_can_use_grouped_mm``."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    if caps.is_cuda:
        cc = caps.compute_capability or (0, 0)
        if caps.rocm:
            return False, "torch._grouped_mm's CUDA kernel is NVIDIA's; this is an AMD GPU (ROCm)"
        if cc < (8, 0):
            return False, f"torch._grouped_mm needs compute capability >= 8.0; this is {cc[0]}.{cc[1]}"
        return True, ""
    if caps.device_type == "cpu":
        version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
        if version <= (2, 8):
            return False, f"torch {torch.__version__} has no CPU kernel for torch._grouped_mm (2.9+ has)"
        return True, ""
    return False, f"transformers runs grouped_mm natively on CUDA and CPU only; this is {caps.device_type}"


def usable(name: str, caps) -> tuple[bool, str]:
    """(``name`` can run the experts here, why not)."""
    if name == "grouped_mm":
        ok, why = grouped_gemm(caps)
        return ok, "" if ok else f"{why} (transformers would run its per-expert fallback loop under that name)"
    return name in KERNELS, "" if name in KERNELS else f"{name} is not one of {', '.join(KERNELS)}"


def default(caps) -> str:
    """The known-good choice where nothing was measured: grouped GEMMs on a GPU that has them, else the loop
    (on CPU the loop measured fastest at every shape tried: benchmarks/bench_moe.py)."""
    return "grouped_mm" if caps.is_cuda and grouped_gemm(caps)[0] else "eager"


# ----------------------------------------------------------------------------------------- the live model
def _interface(module):
    """The ExpertsInterface the module's class dispatches through (the decorator's closure)."""
    from transformers.utils.generic import GeneralInterface

    for cell in getattr(type(module).forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, GeneralInterface):
            return value
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS


def sharded(module) -> str:
    """How the module's weights are split across ranks ("" where they are whole on this one)."""
    for p in module.parameters(recurse=False):
        if hasattr(p, "ds_id"):
            return "partitioned by DeepSpeed ZeRO-3"
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return "sharded DTensors (FSDP2)"
    return ""


def dispatched(module) -> tuple[str, str]:
    """(implementation key, function name) a 4-token forward of ``module`` really ran: the module's interface
    answers the key through a recorder for the duration of the call (restored after)."""
    interface = _interface(module)
    key = module.config._experts_implementation
    original = type(module).forward.__wrapped__
    target = interface.get_interface(key, original)
    seen: list[tuple[str, str]] = []

    def recorder(self, *args, **kwargs):
        seen.append((key, getattr(target, "__name__", repr(target))))
        return target(self, *args, **kwargs)

    had = key in interface._local_mapping
    saved = interface._local_mapping.get(key)
    interface._local_mapping[key] = recorder
    try:
        down = module.down_proj
        hidden = down.shape[2] if getattr(module, "is_transposed", False) else down.shape[1]
        experts = int(getattr(module, "num_experts", down.shape[0]))
        tokens = 4
        x = torch.zeros(tokens, hidden, device=down.device, dtype=down.dtype)
        index = (torch.arange(tokens, device=down.device) % experts).unsqueeze(-1)
        weights = torch.ones(tokens, 1, device=down.device, dtype=down.dtype)
        with torch.no_grad():
            module(x, index, weights)
    finally:
        if had:
            interface._local_mapping[key] = saved
        else:
            del interface._local_mapping[key]
    return seen[0] if seen else ("", "")
