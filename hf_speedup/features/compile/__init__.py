"""Regional torch.compile: each repeated decoder block compiled in place (optionally the head too).

Why regional: the blocks are identical, so dynamo compiles one graph and reuses it for every block
(cold start is one block's compile, not the whole model's), and the rest of the model stays eager.
Why in place (``module.compile()``-style ``_compiled_call_impl``): ``nn.Module.__call__`` stays on the
call path, so hooks added later (FSDP2's ``fully_shard``, peft) still run, and ``_orig_mod``-style
wrappers never appear in state dicts.

Every region goes through :class:`GuardedRegion`: if compiling (or running compiled) fails, that
region runs eager from then on, training goes on, and the failure is recorded (``fallback_reason``)
so ``verify`` and the report say which regions fell back and why. Backward graphs are lowered
together with the forward (``force_non_lazy_backward_lowering``) so backward compile errors surface
inside the guarded call too, not later in ``loss.backward()`` where no fallback is possible.

Region statistics (compiles, recompiles, compile seconds, fallbacks) are kept on each region and
summed by :func:`compile_stats`.

``mode='max-autotune'`` on CPU also autotunes the GEMM library per shape (MKL or oneDNN, see ``cpu_gemm``):
inductor's own CPU GEMM templates only serve frozen (inference) weights, and the fp32 GEMMs are
most of a small model's training step.

The modules, in the order a run meets them: ``decision`` (``decide``, ``training_args``), ``install``
(``apply``, ``callbacks``), ``regions`` (the guarded regions at run time), ``cpu_gemm`` (the CPU GEMM
autotune), ``payback`` (``compile.when: pays_back``: the regions' shared gate and the callback that opens it),
``cache`` (the compile cache saved with each checkpoint and loaded before a resumed run compiles: ``write_into``)
and ``verification`` (``verify``).
"""

from __future__ import annotations

from .cpu_gemm import benchmark_gemm, choose_cpu_gemms, cpu_gemm_pass, cpu_gemm_summary, onednn_fp32_ok, onednn_mm
from .decision import NAME, NO_CUDAGRAPHS, Settings, changes_model, decide, training_args
from .cache import write_into
from .install import apply, callbacks, compile_kwargs_of, settle_cpu_gemm
from .payback import measure
from .regions import HEAD_REGIONS, CompiledLoss, GuardedRegion, compile_module, compile_stats, gate_of, guarded_regions
from .verification import verify

APPLIES_TO = "model"

__all__ = ["APPLIES_TO", "HEAD_REGIONS", "NAME", "NO_CUDAGRAPHS", "CompiledLoss", "GuardedRegion", "Settings", "apply",
           "benchmark_gemm", "callbacks", "choose_cpu_gemms", "compile_kwargs_of", "compile_module", "compile_stats",
           "changes_model", "cpu_gemm_pass", "cpu_gemm_summary", "decide", "gate_of", "guarded_regions", "measure", "onednn_fp32_ok", "onednn_mm",
           "settle_cpu_gemm", "training_args", "verify", "write_into"]
