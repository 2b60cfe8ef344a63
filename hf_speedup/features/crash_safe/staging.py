"""Host copies of what a checkpoint writes, so the files can be written while training changes the originals.

A background save must write the state as it was at its step: the optimizer steps the weights and moments in
place right after the save returns. So the blocking part of an asynchronous save copies every tensor it writes
into a host buffer, and the writer thread serializes the copies. The buffers are kept across saves (the next
save of the same file and shapes copies into them again): on CUDA they are pinned, which makes the device-to-host
copies fast and asynchronous, and allocating pinned memory per save would cost more than the copy itself; on CPU
reusing them saves the page faults of fresh allocations.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch.utils import _pytree as pytree

logger = logging.getLogger("hf_speedup")

# what the staging copy may take of the host memory that is free when a save starts (the rest stays for the
# data loaders, the page cache the writes go through and everything else)
FREE_MEMORY_SHARE = 0.5


def _stageable(t) -> bool:
    """Plain tensors (parameters included) are copied into buffers; subclasses (DTensor, quantized weights) are
    deep-copied as they are."""
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided


class HostStage:
    """The host buffers of the tensors a save writes, keyed by file name and position in the object."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.device_copies = False  # a CUDA tensor was copied without blocking: synchronize before writing
        self.allowance: float = float("inf")  # new buffer bytes this save may still allocate
        self.no_room: list[str] = []  # this save's files written synchronously: their copy did not fit
        self.free = 0
        self.stagers: dict[str, object] = {}  # torch's stagers of sharded (DCP) state dicts, by folder name
        self.stager_bytes = 0

    def begin(self, free: int | None = None) -> None:
        """A save starts: it may allocate new buffers up to a share of the host memory free now."""
        free = free_host_bytes() if free is None else free
        self.allowance, self.free, self.no_room = FREE_MEMORY_SHARE * free, free, []

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values()) + self.stager_bytes

    def freeze(self, obj, file_key: str):
        """``obj`` with every tensor replaced by its host copy and every other leaf deep-copied: what the writer
        thread serializes, unaffected by what training does next. None: the caller writes it now (it holds no
        tensor, cannot be copied, or its new buffers would not fit in this save's allowance: ``no_room`` says)."""
        leaves, spec = pytree.tree_flatten(obj)
        if not any(_stageable(leaf) for leaf in leaves):
            return None  # no tensors to copy (the training arguments, a scheduler's state): cheap to write now
        new = sum(leaf.numel() * leaf.element_size() for i, leaf in enumerate(leaves)
                  if _stageable(leaf) and not self._fits((file_key, i), leaf))
        if new > self.allowance:
            self.no_room.append(f"{file_key} (its host copy needs {new / 2**30:.2f} GiB more; {self.free / 2**30:.2f} "
                                f"GiB of host memory was free, at most {FREE_MEMORY_SHARE:.0%} of it for staging)")
            return None
        try:
            others = {i: copy.deepcopy(leaf) for i, leaf in enumerate(leaves) if not _stageable(leaf)}
        except Exception:  # noqa: BLE001 - an object that cannot be copied is written now, as it is
            return None
        self.allowance -= new
        frozen = [others[i] if i in others else self._copy(leaf, (file_key, i)) for i, leaf in enumerate(leaves)]
        return pytree.tree_unflatten(frozen, spec)

    def stage_sharded(self, state_dict: dict, file_key: str):
        """A torch.distributed.checkpoint state dict (DTensors: this rank's shards) staged to host memory by
        torch's own stager (the one DCP's ``async_save`` uses; it keeps its host storages across saves). None:
        it does not fit in this save's allowance."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = self.stagers.get(file_key)
        new = tensor_bytes(state_dict) if stager is None else 0
        if new > self.allowance:
            self.no_room.append(f"{file_key} (its host copy needs {new / 2**30:.2f} GiB more; {self.free / 2**30:.2f} "
                                f"GiB of host memory was free, at most {FREE_MEMORY_SHARE:.0%} of it for staging)")
            return None
        self.allowance -= new
        if stager is None:
            cuda = torch.cuda.is_available()
            stager = self.stagers[file_key] = DefaultStager(StagingOptions(cuda, False, False, cuda))
            self.stager_bytes += new
        staged = stager.stage(state_dict)
        if stager.should_synchronize_after_execute:
            stager.synchronize_staging()
        return staged

    def _fits(self, key: tuple[str, int], tensor: torch.Tensor) -> bool:
        buf = self.buffers.get(key)
        return buf is not None and buf.shape == tensor.shape and buf.dtype == tensor.dtype

    def _copy(self, tensor: torch.Tensor, key: tuple[str, int]) -> torch.Tensor:
        src = tensor.detach()
        buf = self.buffers.get(key)
        if not self._fits(key, src):
            pin = src.is_cuda and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self.buffers[key] = buf
        buf.copy_(src, non_blocking=src.is_cuda)
        self.device_copies |= src.is_cuda
        return buf

    def settle(self) -> None:
        """The copies are complete (the device's copies were queued without blocking)."""
        if self.device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.device_copies = False


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in ``obj`` (this rank's shards of DTensors)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return sum(local(t).numel() * local(t).element_size() for t in pytree.tree_leaves(obj)
               if isinstance(t, torch.Tensor))


def free_host_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
