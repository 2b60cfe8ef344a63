"""What every training script in tests/dist starts with, in one place: this checkout importable (a script run by
torchrun, accelerate launch or srun has its own folder on ``sys.path``, not the repository), an offline, quiet
environment set before transformers is imported, the tiny model and global batch the tests compare runs of, and
the rank and world size the launcher gave this process. Import it before anything from hf_speedup."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)

if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
import fake_cpu  # noqa: E402

if fake_cpu.faked() is not None:  # the CPU kind the launching test asked for (HF_SPEEDUP_FAKE_CPU_AMX)
    fake_cpu.install()

GLOBAL_BATCH = 8  # split over the ranks: every world size trains on the same batches
MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
