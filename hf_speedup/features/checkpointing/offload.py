"""Checkpointed blocks' inputs kept in host memory between forward and backward, the copies overlapped.

Under non-reentrant checkpointing (the Trainer's default) a block keeps one thing from its forward to its
recompute: its input. transformers' ``offload`` wraps the checkpoint in ``save_on_cpu``, which moves it only where
the checkpoint saves its inputs as saved tensors (torch 2.13 does; releases whose checkpoint holds them in its
closure hand the hook nothing), and then copies on the compute stream, into pinned memory allocated afresh for
every block of every step, with nothing prefetched: the step waits for every copy both ways.

:class:`BlockInputOffloader` hands the checkpoint a function that reads the block input from a :class:`HostCopy`
instead of taking it as an argument: in the forward the input itself (a device-to-host copy into a pinned buffer,
reused across steps, starts on a side stream and the device memory is let go once the copy has read it), in the
recompute a copy brought back, which was prefetched on the side stream when the block after it began its
recompute. Gradients are untouched: autograd runs the forward's graph; the recompute only rebuilds the saved
tensors, from equal values.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint


class HostCopy:
    """One block input in host memory. On CUDA the copies run on the offloader's side stream: out after the
    compute stream produced the input, back ahead of the recompute that needs it."""

    def __init__(self, x: torch.Tensor, offloader: "BlockInputOffloader"):
        self.offloader = offloader
        self.device = x.device
        self.requires_grad = x.requires_grad  # the recompute must save what the forward saved
        self.back: torch.Tensor | None = None  # the copy on the device again (prefetched or fetched)
        self.back_event = None
        stream = offloader.side_stream(x.device)
        if stream is None:  # a CPU "device": a separate copy stands in for host memory (tests the mechanism)
            self.host = x.detach().clone()
            self.out_event = None
            return
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            self.host = offloader.pinned_like(x)
            self.host.copy_(x.detach(), non_blocking=True)
            self.out_event = torch.cuda.Event()
            self.out_event.record(stream)
        x.record_stream(stream)  # the allocator keeps x's memory until the copy has read it

    def prefetch(self) -> None:
        """Start the copy back (on the side stream) if it has not started."""
        if self.back is not None:
            return
        stream = self.offloader.side_stream(self.device)
        if stream is None:
            self.back = self.host.clone()
            return
        with torch.cuda.stream(stream):
            stream.wait_event(self.out_event)
            self.back = torch.empty_like(self.host, device=self.device)
            self.back.copy_(self.host, non_blocking=True)
            self.back_event = torch.cuda.Event()
            self.back_event.record(stream)

    def fetch(self) -> torch.Tensor:
        """The input on the device again, for the recompute (waits only for a copy still in flight)."""
        self.prefetch()
        back = self.back
        if self.back_event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.back_event)
            back.record_stream(current)
        self.back = None  # the recompute holds it now; freed with the block's saved tensors
        self.offloader.returned(self)
        return back.requires_grad_(self.requires_grad)


class BlockInputOffloader:
    """The checkpoint function of every offloaded block of one model; keeps the forward order of the copies so
    that each block's recompute prefetches the input of the block before it."""

    def __init__(self) -> None:
        self._order: list[weakref.ref] = []
        self._streams: dict = {}
        self._pinned: dict = {}
        self.copies = 0  # inputs copied out (forwards); read by verification
        self.fetches = 0  # inputs brought back (recomputes)

    def side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pinned_like(self, x: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer for ``x``, reused from an earlier step where one of that shape is free."""
        key = (tuple(x.shape), x.dtype)
        free = self._pinned.get(key)
        if free:
            buf, event = free.pop()
            if event is not None:
                event.synchronize()  # its copy back has finished reading it
            return buf
        return torch.empty(x.shape, dtype=x.dtype, pin_memory=True)

    def returned(self, copy: HostCopy) -> None:
        """A copy has been brought back: prefetch the one before it, and keep its pinned buffer for reuse."""
        self.fetches += 1
        alive = [c for c in (r() for r in self._order) if c is not None]
        if copy in alive:
            i = alive.index(copy)
            if i > 0:
                alive[i - 1].prefetch()
        if copy.host.is_pinned():
            key = (tuple(copy.host.shape), copy.host.dtype)
            self._pinned.setdefault(key, []).append((copy.host, copy.back_event))
        self._order = [r for r in self._order if r() is not None and r() is not copy]

    def __call__(self, function, *args, **kwargs):
        """``torch.utils.checkpoint.checkpoint`` with the first argument (the block input) held in host memory."""
        if not args or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
            return checkpoint(function, *args, **kwargs)
        x, rest = args[0], args[1:]
        copy = HostCopy(x, self)
        self.copies += 1
        self._order.append(weakref.ref(copy))
        held = [x]

        def run(*inner_args, **inner_kwargs):
            source = held[0] if held[0] is not None else copy.fetch()
            return function(source, *inner_args, **inner_kwargs)

        try:
            return checkpoint(run, *rest, **kwargs)
        finally:
            held[0] = None  # from here the checkpoint reaches the input only through the host copy
