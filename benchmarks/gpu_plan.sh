#!/usr/bin/env bash
# The GPU plan on a machine with a CUDA GPU: the `gpu` tests, then the benchmark (benchmarks/gpu.py).
#   bash benchmarks/gpu_plan.sh              # the tests (as `tests`)
#   bash benchmarks/gpu_plan.sh tests        # pytest -m gpu only (stopped with a summary at 9 minutes, or GPU_TESTS_S)
#   bash benchmarks/gpu_plan.sh all          # both (about 20 minutes on one H100: more than one device call)
#   bash benchmarks/gpu_plan.sh bench [ARGS] # benchmarks/gpu.py only; ARGS go to it (e.g. --variants stock,fast)
#   bash benchmarks/gpu_plan.sh long [ARGS]  # benchmarks/long_gpu.py: Llama-3.1-8B-shaped LoRA, stock+gc vs long
#   bash benchmarks/gpu_plan.sh goodput      # async_save.py and compile_resume.py on a 300M Llama shape (CUDA)
# Wheels from benchmarks/gpu_wheels.sh (.whl/) are installed first when present. Results go to $OUT (the
# device machine's output folder) or runs/gpu_plan: device.txt, gpu_tests.log/.xml, bench.{json,md,png,log},
# bench_logs.tar.gz (at most 8 files, as the device machine returns them). The exit status is the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-tests}"
[ $# -gt 0 ] && shift
out="${OUT:-runs/gpu_plan}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, accelerate, peft, importlib.metadata as m; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, \
'| accelerate', accelerate.__version__, '| peft', peft.__version__, '|', \
', '.join(f'{p} {m.version(p)}' for p in ('bitsandbytes', 'liger-kernel', 'triton') \
if __import__('importlib').util.find_spec(p.replace('-', '_'))))"
} 2>&1 | tee "$out/device.txt"
status=0
if [ "$part" = tests ] || [ "$part" = all ]; then
  # SIGINT before the device call's limit: pytest still prints its summary and writes the XML
  PYTHONUNBUFFERED=1 timeout -s INT -k 20 "${GPU_TESTS_S:-540}" python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 240 \
    --durations=0 --junitxml "$out/gpu_tests.xml" > "$out/gpu_tests.log" 2>&1
  status=$?
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu_tests.log" | tail -40
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  runs="$(mktemp -d)"
  python3 benchmarks/gpu.py --output "$runs" "$@" > "$out/bench.log" 2>&1
  cp "$runs"/bench.json "$runs"/bench.md "$runs"/bench.png "$out"/ 2>/dev/null
  tar -czf "$out/bench_logs.tar.gz" -C "$runs" . 2>/dev/null
  tail -30 "$out/bench.log"
fi
if [ "$part" = long ]; then
  python3 benchmarks/long_gpu.py --output "$out" "$@" > "$out/long.log" 2>&1
  tail -40 "$out/long.log"
fi
if [ "$part" = goodput ]; then
  python3 benchmarks/async_save.py --model llama-300m --cuda --steps 120 --save-steps 30 > "$out/async_save.log" 2>&1
  tail -8 "$out/async_save.log"
  python3 benchmarks/compile_resume.py --model llama-300m --cuda --steps 8 --save-at 4 > "$out/compile_resume.log" 2>&1
  tail -6 "$out/compile_resume.log"
fi
exit $status
