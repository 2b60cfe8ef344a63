"""How the ranks of a multi-process run agree on the step to stop at: one integer all-reduced (MAX) per optimizer
step over gloo, the default group when it is gloo, else a gloo side group, so a GPU run adds no device
synchronisation. Apart from the callback so the collective is in one small place (tests make it see "nccl")."""

from __future__ import annotations


def default_backend() -> str:
    """The default process group's backend ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...)."""
    import torch.distributed as dist

    return str(dist.get_backend())


class _RankAgreement:
    """MAX of one integer over every rank; CPU tensors only (a gloo group), so no device synchronisation."""

    def __init__(self, group, description: str):
        self.group = group
        self.description = description

    @classmethod
    def create(cls, trainer) -> "_RankAgreement | None":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        backend = default_backend()
        if "gloo" in backend:
            return cls(None, f"default {backend} group")
        cached = getattr(trainer, "_speedup_interrupt_group", None)
        if cached is None:
            cached = dist.new_group(backend="gloo")  # collective: every rank is entering train() here
            trainer._speedup_interrupt_group = cached
        return cls(cached, f"gloo side group (default backend {backend})")

    def max(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)
