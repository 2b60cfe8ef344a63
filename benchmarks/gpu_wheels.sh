#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (see ../shared/GPU.md), into .whl/ (git-ignored), for the GPU plan:
#   bash benchmarks/gpu_wheels.sh        # then carry .whl and run: bash benchmarks/gpu_plan.sh
# bitsandbytes (8-bit/paged optimizers, QLoRA), liger-kernel, pytest and its plugins. The image has torch,
# transformers, accelerate, peft, triton; `datasets` is not needed (the GPU tests build their rows as lists).
# One version each, no dependencies resolved: the image provides the rest. About 45 MB of the 64 MiB carry.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(bitsandbytes==0.50.2 liger-kernel==0.8.5 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 pygments==2.20.0
        pytest-timeout==2.4.0)
exclude="$(git rev-parse --git-path info/exclude)"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${WHEELS[@]}"
ls -1 .whl && du -sh .whl
