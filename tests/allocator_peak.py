"""The peak of one training step as the CPU allocator counts it: torch.profiler's memory events over that step.

MemTracker (the report's ``memory.track_live_tensors``) is a dispatch mode: it sees every tensor an op returns,
but not the temporaries a kernel allocates inside itself (``torch.logsumexp``'s ``x - max``: a whole
chunk of fp32 logits), which a GPU's ``max_memory_allocated`` does count. The profiler's allocation events carry
the allocator's running total of what was allocated while it ran, those temporaries included; added to what was
alive when the step began (parameters, optimizer states) it is the step's peak. Used by the tests and by
``benchmarks/estimate_at_length.py``.
"""

from __future__ import annotations


def allocator_peak_callback(step: int = 2):
    """A TrainerCallback measuring global step ``step`` (1-based); its ``result``: ``{"bytes", "start_bytes"}``."""
    import torch
    from torch._C._profiler import _EventType
    from transformers import TrainerCallback

    class AllocatorPeak(TrainerCallback):
        def __init__(self):
            self.prof, self.result = None, {}

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step != step - 1:
                return
            tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
            opt = getattr(optimizer, "optimizer", optimizer)
            tensors += [v for s in getattr(opt, "state", {}).values() for v in s.values() if torch.is_tensor(v)]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            self.result["start_bytes"] = sum(storages.values())
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if self.prof is None:
                return
            self.prof.__exit__(None, None, None)
            totals: list[int] = []
            stack = list(self.prof.profiler.kineto_results.experimental_event_tree())
            while stack:
                event = stack.pop()
                if event.tag == _EventType.Allocation:
                    totals.append(event.extra_fields.total_allocated)
                stack += list(event.children)
            self.result["bytes"] = self.result["start_bytes"] + max(totals, default=0)
            self.prof = None

    return AllocatorPeak()
