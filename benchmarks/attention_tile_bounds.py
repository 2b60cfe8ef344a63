"""What bounds the ``blocked`` kernel's tiled form on this CPU, one core: the oneDNN micro-kernel GEMM
(``cpublas::brgemm``, bf16 in, fp32 out, B packed VNNI) at the tile shapes the kernel calls, and the exponential
of each score (ATen's ``exp_u20`` and the kernel's ``exp2_fast``) over one tile, against a 2048^3 bf16 GEMM on the
same core. The C++ includes ``csrc/blocked_tiles.cpp``: what is timed is the kernel's own code.

    python benchmarks/attention_tile_bounds.py

Per score the forward does 4 x head-size FLOPs of GEMM (scores, then probabilities x values) and one exponential;
the backward 10 x head-size and one. At a head size of 64 the forward's GEMMs are 256 FLOPs a score: where the
exponential of a score costs as long as those FLOPs at the GEMM's rate, the forward cannot pass half the GEMM rate.
Needs AVX-512 and the matrix units oneDNN drives (AMX); elsewhere it says so and stops.
"""

from __future__ import annotations

import tempfile
import time

import torch
from torch.utils import cpp_extension

from hf_speedup.features.attention import blocked

SOURCE = r"""
#include "blocked_tiles.cpp"  // the kernel's own micro-kernel call and exponential, measured as it runs them
#include <torch/library.h>
#include <chrono>

using hf_speedup_tiles::bf16;
using hf_speedup_tiles::fVec;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// (brgemm GFLOP/s, exp_u20 ns per score, exp2_fast ns per score) for an M x N x K tile
std::vector<double> tile(int64_t M, int64_t N, int64_t K, int64_t reps) {
  std::vector<bf16> A(M * K, bf16(0.01f)), B(K * N, bf16(0.02f)), P(M * N);
  std::vector<float> C(M * N, -1.f);
  for (int i = 0; i < 10; ++i) hf_speedup_tiles::gemm(M, N, K, K, N, N, false, A.data(), B.data(), C.data());
  double t = now();
  for (int i = 0; i < reps; ++i) hf_speedup_tiles::gemm(M, N, K, K, N, N, false, A.data(), B.data(), C.data());
  const double gemm = 2.0 * M * N * K * reps / (now() - t) / 1e9;
  at::native::cpublas::brgemm_release(true);
  std::vector<float> S(M * N, -1.f);
  float sink = 0.f;
  t = now();
  for (int i = 0; i < reps; ++i) {
    for (int64_t r = 0; r < M; ++r) {
      float* s = S.data() + r * N;
      fVec acc(0.f);
      for (int64_t c = 0; c < N; c += fVec::size()) {
        fVec e = (fVec::loadu(s + c) * fVec(0.125f) - fVec(0.5f)).exp_u20();
        e.store(s + c);
        acc = acc + e;
      }
      at::vec::convert(s, P.data() + r * N, N);
      sink += acc.reduce_add();
      std::fill(s, s + N, -1.f);
    }
  }
  const double u20 = (now() - t) / reps / (M * N) * 1e9;
  t = now();
  for (int i = 0; i < reps; ++i) {
    for (int64_t r = 0; r < M; ++r) {
      float* s = S.data() + r * N;
      fVec acc(0.f);
      for (int64_t c = 0; c < N; c += fVec::size()) {
        fVec e = hf_speedup_tiles::exp2_fast(at::vec::fmsub(fVec::loadu(s + c), fVec(0.18f), fVec(0.7f)));
        e.store(s + c);
        acc = acc + e;
      }
      at::vec::convert(s, P.data() + r * N, N);
      sink += acc.reduce_add();
      std::fill(s, s + N, -1.f);
    }
  }
  const double fast = (now() - t) / reps / (M * N) * 1e9;
  return {gemm, u20, fast, sink == 42.f ? 1.0 : 0.0};
}

bool amx() { return hf_speedup_tiles::available(); }

TORCH_LIBRARY(hf_speedup_tile_bounds, m) {
  m.def("tile(int M, int N, int K, int reps) -> float[]", &tile);
  m.def("amx() -> bool", &amx);
}
"""

SHAPES = [  # (M, N, K): the forward's scores and P x V, the backward's dK^T / dV^T, at tiles of 64 and 128
    ("scores, 64 queries x 128 keys, head 64", 64, 128, 64),
    ("scores, 3 heads x 64 queries x 128 keys, head 64", 192, 128, 64),
    ("P x V, 3 x 64 queries, 128 keys, head 64", 192, 64, 128),
    ("dK^T, head 64 x 128 keys over 3 x 64 queries", 64, 128, 192),
    ("scores, 4 heads x 64 queries x 128 keys, head 128", 256, 128, 128),
    ("scores, 128 x 128, head 64", 128, 128, 64),
    ("scores, 256 x 256, head 64", 256, 256, 64),
]


def main() -> None:
    if str(torch.backends.cpu.get_cpu_capability()) != "AVX512":
        raise SystemExit("needs AVX-512 (the kernel's tiled form runs only there)")
    flags = ["-O3", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
    cpp_extension.load_inline(name="hf_speedup_tile_bounds", cpp_sources=[SOURCE], extra_cflags=flags,
                              extra_include_paths=[str(blocked.SOURCE.parent)], build_directory=tempfile.mkdtemp(),
                              is_python_module=False)
    if not torch.ops.hf_speedup_tile_bounds.amx():
        raise SystemExit("no matrix units oneDNN drives here (AMX): the tiled form does not run")
    torch.set_num_threads(1)
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    peak = 2 * 2048 ** 3 / best / 1e9
    print(f"one core: bf16 2048^3 GEMM {peak:.0f} GFLOP/s")
    print("| tile | brgemm GFLOP/s | % of the 2048^3 GEMM | exp_u20 ns/score | exp2_fast ns/score "
          "| ns/score of forward GEMMs at head 64 at this rate |")
    print("|---|---|---|---|---|---|")
    for name, m, n, k in SHAPES:
        gemm, u20, fast, _ = torch.ops.hf_speedup_tile_bounds.tile(m, n, k, 2000)
        print(f"| {name} ({m}x{n}x{k}) | {gemm:.0f} | {gemm / peak:.0%} | {u20:.2f} | {fast:.2f} "
              f"| {256 / gemm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
