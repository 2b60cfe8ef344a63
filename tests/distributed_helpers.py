"""What the tests that launch several processes (torchrun, accelerate launch, the SLURM script) share: their
marks, the worker scripts of tests/dist made importable, the environment of a launch, a free port, the launcher
found on PATH (else the test skips), a launch that fails with the workers' output, and the per-rank result files
the workers write. One place, so every such test launches the same way."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "tests" / "dist"  # the worker scripts; importable (fsdp_train's run settings, multinode_train.main)
if str(DIST) not in sys.path:
    sys.path.insert(0, str(DIST))


def distributed_marks() -> list:
    """``pytestmark`` of a module of multi-process tests: the ``distributed`` marker and, where pytest-timeout is
    installed, a timeout above the suite's default (a launch takes minutes on 2 cores)."""
    marks = [pytest.mark.distributed]
    if importlib.util.find_spec("pytest_timeout") is not None:
        marks.append(pytest.mark.timeout(900))
    return marks


def launch_env() -> dict:
    """The environment of a test's own torchrun launch: offline, one thread per rank, this checkout importable,
    and nothing left over from a launcher the test itself runs under."""
    root = str(ROOT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""),
               WANDB_MODE="offline", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def free_port() -> int:
    """A port nothing listens on now (other test runs launch torchrun on this machine at the same time)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def executable(name: str) -> str:
    """A launcher on PATH (``torchrun``, ``accelerate``); the test skips without it."""
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not on PATH")
    return found


def launch(cmd: list[str], *, env: dict | None = None, timeout: float = 540, check: bool = True,
           what: str | None = None) -> subprocess.CompletedProcess:
    """``cmd`` run from the checkout's root in :func:`launch_env` (plus ``env``), output captured; with ``check``
    a non-zero exit fails the test with the tail of the output (``what`` names the launch, else the command)."""
    proc = subprocess.run(cmd, cwd=ROOT, env={**launch_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{what or ' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def rank_results(out: Path, prefix: str = "", ranks=(0, 1)) -> list[dict]:
    """The JSON each rank wrote as ``<out>/<prefix>rank<R>.json``, in rank order."""
    return [json.loads((out / f"{prefix}rank{r}.json").read_text()) for r in ranks]
