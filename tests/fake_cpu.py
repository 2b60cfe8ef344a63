"""Plan as a CPU with or without AMX on any machine, so both CPU precision paths are tested whatever CPU a session
draws. The switch is an environment variable (``HF_SPEEDUP_FAKE_CPU_AMX``: "1" with AMX, "0" without, unset: this
machine), read at every probe, so ``monkeypatch.setenv`` in a test and the processes a test launches (the scripts in
tests/dist apply it through ``dist_common``) plan for the same kind. The package knows nothing of it: the probe and
the precision door are wrapped here."""

from __future__ import annotations

import os

FAKE_CPU_AMX = "HF_SPEEDUP_FAKE_CPU_AMX"


def faked() -> bool | None:
    """The faked kind (True: AMX), or None where the real CPU plans."""
    value = os.environ.get(FAKE_CPU_AMX, "").strip()
    return None if value not in ("0", "1") else value == "1"


def install() -> None:
    """Wrap the CPU probe and the precision door once per process (idempotent)."""
    from hf_speedup import hardware
    from hf_speedup.features import precision

    if getattr(hardware._cpu_bf16, "_fake_cpu", False):
        return
    real_probe, real_measure = hardware._cpu_bf16, precision.measure

    def cpu_bf16():
        amx = faked()
        if amx is None:
            return real_probe()
        return amx, (f"{FAKE_CPU_AMX}={int(amx)}: planned as a CPU "
                     + ("with AMX tiles (bf16 matmuls native)" if amx else "without AMX (bf16 not faster than fp32)"))

    def measure(config, caps, model):
        return {} if faked() is not None else real_measure(config, caps, model)  # a faked kind plans as that kind

    cpu_bf16._fake_cpu = True
    hardware._cpu_bf16 = cpu_bf16
    precision.measure = measure  # the feature's hook, as the plan finds it
