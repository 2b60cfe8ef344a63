"""``hf-speedup bench``: every preset against the peers people use, on your model and hardware, in one table.

    from hf_speedup.bench import BenchOptions, run_bench
    result = run_bench(BenchOptions(tiny=True, variants=["stock", "trl-sft", "fast"], steps=20))
    print(result.table())
"""

from .cli import main
from .core import BenchResult, run_bench
from .options import DEFAULT_PEERS, DEFAULT_PRESETS, PEERS, PROFILES, BenchOptions

__all__ = ["BenchOptions", "BenchResult", "run_bench", "main", "PEERS", "PROFILES", "DEFAULT_PEERS",
           "DEFAULT_PRESETS"]
