"""What the FLOPs and MFU figures need to know of the model and the machine: matmul parameters, layers and
attention width (read before accelerate or FSDP wraps or shards the model), the compute dtype and its peak
FLOP/s, the number of devices. Kept apart from the collector so that its hooks only count and time."""

from __future__ import annotations

from ..measured import shared_across_ranks
from ..model_info import ParamCounts, parameter_counts
from ..peak_flops import resolve_peak_flops
from . import measure as M
from .measure.matmul_peak import matmul_peak


class ModelFacts:
    """The model's sizes and the device's peak, as the report's FLOPs formula takes them."""

    def __init__(self) -> None:
        self.params: ParamCounts | None = None
        self.layers = self.attention_width = None
        self.matmul_peak: float | None = None  # this machine's measured GEMM FLOP/s per device, in the run's dtype
        self.matmul_peak_source = "matmul peak not measured (training did not start)"

    def describe(self, model) -> None:
        """Parameter counts and attention dimensions, once (the first model seen, before it is wrapped)."""
        if model is not None and self.params is None:
            self.params = parameter_counts(model)
            self.layers, self.attention_width = M.attention_dims(model)

    def resolve_peak(self, trainer) -> None:
        """The compute dtype and its peak FLOP/s on this device (a malformed HF_SPEEDUP_PEAK_FLOPS fails here)."""
        caps = trainer.speedup_plan.caps
        device_type = getattr(getattr(trainer.args, "device", None), "type", caps.device_type)
        self.device_type = device_type
        self.dtype = M.compute_dtype(trainer.args, trainer.model, device_type)
        self.peak_flops, self.peak_source = resolve_peak_flops(device_type, caps.device_name, self.dtype)

    def measure_matmul_peak(self, trainer) -> None:
        """This machine's matmul peak in the compute dtype (:mod:`.measure.matmul_peak`), timed once per machine and
        cached; rank 0's figure on every rank. Call after :meth:`resolve_peak`, at train begin."""
        caps = trainer.speedup_plan.caps

        def measure() -> dict:
            value, source = matmul_peak(self.device_type, caps.device_name, self.dtype)
            return {"value": value, "source": source}

        found = shared_across_ranks(measure)
        self.matmul_peak, self.matmul_peak_source = found["value"], found["source"]

    def flops_per_token(self, attended_tokens: int, attended_squares: int) -> float | None:
        seq_len = M.attention_length(attended_tokens, attended_squares)
        if seq_len is None or self.params is None:
            return None
        return M.flops_per_token(self.params.matmul_trainable, self.params.matmul_frozen, self.layers,
                                 self.attention_width, seq_len)


def num_devices(trainer) -> int:
    """Devices the run trains on: its processes, or a single process's GPUs (DataParallel)."""
    acc = getattr(trainer, "accelerator", None)
    procs = int(getattr(acc, "num_processes", 1) or 1)
    n_gpu = int(getattr(trainer.args, "n_gpu", 1) or 1)
    return procs * (n_gpu if procs == 1 and n_gpu > 1 else 1)
