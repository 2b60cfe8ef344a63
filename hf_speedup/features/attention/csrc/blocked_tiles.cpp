// The tiled form of the ``blocked`` kernel: bf16 on CPUs whose matrix units oneDNN drives (AMX).
//
// Why: with ATen's bmm per block of queries, a block's scores against all its keys go through memory (more than L2
// at a few thousand keys) and the softmax passes over them are memory-bound. Here a tile of queries meets a tile of
// keys at a time (flash-style): the score tile stays in L1/L2 from the score GEMM through the softmax to the next
// GEMM, and every GEMM is one oneDNN micro-kernel call (``cpublas::brgemm``) on operands packed once (keys and
// values once per key/value head, shared by its query heads; a query tile once per tile). The forward keeps an
// online softmax (running max and sum in fp32); the backward recomputes each score tile from the saved
// log-sum-exp. Both stack the query heads of a group on each tile of keys (one load serves the group, and the
// GEMMs grow by the group's size). The forward splits work over (row, key/value head, query tile); the backward
// over (row, key/value head) and, where those are fewer than twice the threads, interleaved parts of the query
// tiles, each task with its own fp32 dK/dV accumulators (summed at the end: deterministic for a thread count,
// memory linear in the length).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace hf_speedup_tiles {

using bf16 = at::BFloat16;
using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float LOG2E = 1.4426950408889634f;

#if defined(CPU_CAPABILITY_AVX512)  // AMX CPUs all have AVX-512; the packing and the exp below are AVX-512 code

bool available() { return at::native::cpublas::could_pack(at::kBFloat16); }

// dst (cols x rows, ld_dst) = src (rows x cols, ld_src)^T in 32 x 32 blocks of AVX-512 shuffles
inline void transpose(const bf16* src, int64_t ld_src, bf16* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r += 32)
    for (int64_t c = 0; c < cols; c += 32)
      at::vec::transpose_mxn<bf16>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst,
                                   static_cast<int>(std::min<int64_t>(32, rows - r)),
                                   static_cast<int>(std::min<int64_t>(32, cols - c)));
}

inline void gemm(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add, const bf16* A,
                 const bf16* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add, A, B, C, true);
}

// 2^y for y <= 0 in ~7 instructions: 2^floor(y) by scalef times a degree-4 polynomial of the fraction (relative
// error 5e-6, far below bf16's 4e-3). ATen's exp_u20 costs ~1.5x as much, and the exp of each score is what bounds
// this kernel next to its GEMMs (RESULTS.md).
inline fVec exp2_fast(fVec yv) {
  const __m512 y = _mm512_max_ps(_mm512_set1_ps(-126.f), yv);  // a NaN score stays NaN (MAXPS returns operand 2)
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3534167e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2011464e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144275e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300383e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline float hmax(fVec v) {
  float lanes[W];
  v.store(lanes);
  float m = lanes[0];
  for (int64_t i = 1; i < W; ++i) m = std::max(m, lanes[i]);
  return m;
}

inline float hsum(fVec v) {
  float lanes[W];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < W; ++i) s += lanes[i];
  return s;
}

// Keys and values of one key/value head, packed per key tile of ``NK`` (padded with zeros past T):
// kt: K^T tiles (D x NK) for the score GEMM; vt: V^T tiles (D x NK) for dP; kk: K tiles (NK x D) for dQ;
// vv: V tiles (NK x D) for the output.
struct Packed {
  std::vector<bf16> kt, vt, kk, vv;
};

// B operands in VNNI-2 order ([K / 2][N][2], ATen's pack_vnni2): a K x N row-major tile packed as it lies
void pack_head(const bf16* k, const bf16* v, int64_t T, int64_t D, int64_t NK, bool backward, Packed& p) {
  const int64_t tiles = (T + NK - 1) / NK, tile = D * NK;
  p.kt.resize(tiles * tile);
  if (backward) {
    p.vt.resize(tiles * tile);
    p.kk.resize(tiles * tile);
  } else {
    p.vv.resize(tiles * tile);
  }
  std::vector<bf16> rows(NK * D), cols(D * NK);  // one tile of keys (zero past T) and its transpose
  auto load = [&](const bf16* src, int64_t j0, int64_t n) {
    std::memcpy(rows.data(), src + j0 * D, n * D * sizeof(bf16));
    if (n < NK) std::memset(static_cast<void*>(rows.data() + n * D), 0, (NK - n) * D * sizeof(bf16));
  };
  for (int64_t j = 0; j < tiles; ++j) {
    const int64_t j0 = j * NK, n = std::min(NK, T - j0);
    load(k, j0, n);
    transpose(rows.data(), D, cols.data(), NK, NK, D);
    at::vec::pack_vnni2(cols.data(), p.kt.data() + j * tile, NK, D, NK);
    if (backward) {
      at::vec::pack_vnni2(rows.data(), p.kk.data() + j * tile, D, NK, D);
      load(v, j0, n);
      transpose(rows.data(), D, cols.data(), NK, NK, D);
      at::vec::pack_vnni2(cols.data(), p.vt.data() + j * tile, NK, D, NK);
    } else {
      load(v, j0, n);
      at::vec::pack_vnni2(rows.data(), p.vv.data() + j * tile, D, NK, D);
    }
  }
}

std::vector<Packed> pack_all(const at::Tensor& k, const at::Tensor& v, int64_t NK, bool backward) {
  const int64_t B = k.size(0), Hkv = k.size(1), T = k.size(2), D = k.size(3);
  std::vector<Packed> packed(B * Hkv);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      pack_head(k.data_ptr<bf16>() + i * T * D, v.data_ptr<bf16>() + i * T * D, T, D, NK, backward, packed[i]);
  });
  return packed;
}

// ``result`` in ``input``'s memory layout (the fake implementation promises ``empty_like``)
inline at::Tensor like(const at::Tensor& input, const at::Tensor& result) {
  return input.is_contiguous() ? result : at::empty_like(input).copy_(result);
}

// the first and last visible column of key tile [j0, j0 + NK) for query ``qi`` (empty when lo > hi)
inline void visible(const int64_t* starts, int64_t qi, int64_t j0, int64_t NK, int64_t& lo, int64_t& hi) {
  lo = std::max<int64_t>(starts[qi] - j0, 0);
  hi = std::min<int64_t>(qi - j0, NK - 1);
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           const at::Tensor& starts_in, double scale_d, int64_t BQ, int64_t NK) {
  auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), starts = starts_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  auto out = at::empty_like(q);
  auto lse = at::empty({B, H, T}, q.options().dtype(at::kFloat));
  const auto packed = pack_all(k, v, NK, false);
  const int64_t qtiles = (T + BQ - 1) / BQ, tile = D * NK;
  // a task: one query tile of every query head of a key/value head, stacked (G x BQ rows), so each key and value
  // tile loaded serves the whole group
  at::parallel_for(0, B * Hkv * qtiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(G * BQ * NK), o(G * BQ * D), m(G * BQ), l(G * BQ);
    std::vector<bf16> p(G * BQ * NK), qs(G * BQ * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bk = task / qtiles, i0 = (task % qtiles) * BQ, b = bk / Hkv;
      const int64_t M = std::min(BQ, T - i0), R = G * M;
      const int64_t* st = starts.data_ptr<int64_t>() + (starts.size(0) == 1 ? 0 : b * T);
      const Packed& pk = packed[bk];
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(qs.data() + g * M * D, q.data_ptr<bf16>() + ((bk * G + g) * T + i0) * D, M * D * sizeof(bf16));
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(m.begin(), m.end(), NEG_INF);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t j = st[i0] / NK; j <= (i0 + M - 1) / NK; ++j) {
        const int64_t j0 = j * NK;
        gemm(R, NK, D, D, NK, NK, false, qs.data(), pk.kt.data() + j * tile, s.data());
        for (int64_t r = 0; r < R; ++r) {
          int64_t lo, hi;
          visible(st, i0 + r % M, j0, NK, lo, hi);
          float* sr = s.data() + r * NK;
          bf16* pr = p.data() + r * NK;
          if (lo > hi) {
            std::memset(static_cast<void*>(pr), 0, NK * sizeof(bf16));
            continue;
          }
          fVec vm(NEG_INF);
          int64_t c = lo;
          for (; c + W <= hi + 1; c += W) vm = at::vec::maximum(vm, fVec::loadu(sr + c));
          float mx = hmax(vm);
          for (; c <= hi; ++c) mx = std::max(mx, sr[c]);
          const float m_new = std::max(m[r], mx * scale);
          const float alpha = std::exp(m[r] - m_new);  // 0 on the first visible tile (m = -inf)
          const fVec vs(scale * LOG2E), vsh(m_new * LOG2E);
          fVec acc(0.f);
          c = lo;
          for (; c + W <= hi + 1; c += W) {
            fVec e = exp2_fast(at::vec::fmsub(fVec::loadu(sr + c), vs, vsh));
            e.store(sr + c);
            acc = acc + e;
          }
          float sum = hsum(acc);
          for (; c <= hi; ++c) {
            sr[c] = std::exp(sr[c] * scale - m_new);
            sum += sr[c];
          }
          std::fill(sr, sr + lo, 0.f);
          std::fill(sr + hi + 1, sr + NK, 0.f);
          at::vec::convert(sr, pr, NK);
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
          if (alpha != 1.f) {
            float* orow = o.data() + r * D;
            const fVec va(alpha);
            for (int64_t d = 0; d < D; d += W) (fVec::loadu(orow + d) * va).store(orow + d);
          }
        }
        gemm(R, D, NK, NK, D, D, true, p.data(), pk.vv.data() + j * tile, o.data());
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t row = (bk * G + r / M) * T + i0 + r % M;
        const fVec inv(1.f / l[r]);
        float* orow = o.data() + r * D;
        for (int64_t d = 0; d < D; d += W) (fVec::loadu(orow + d) * inv).store(orow + d);
        at::vec::convert(orow, out.data_ptr<bf16>() + row * D, D);
        lse.data_ptr<float>()[row] = m[r] + std::log(l[r]);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return {like(q_in, out), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_in, const at::Tensor& q_in,
                                                        const at::Tensor& k_in, const at::Tensor& v_in,
                                                        const at::Tensor& out, const at::Tensor& lse_in,
                                                        const at::Tensor& starts_in, double scale_d, int64_t BQ,
                                                        int64_t NK) {
  auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), grad = grad_in.contiguous();
  auto lse = lse_in.contiguous(), starts = starts_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  auto delta = (grad.to(at::kFloat) * out.to(at::kFloat)).sum(-1).contiguous();  // (B, H, T)
  const int64_t ktiles = (T + NK - 1) / NK, TP = ktiles * NK, tile = D * NK, qtiles = (T + BQ - 1) / BQ;
  const int64_t R = G * BQ;  // a task's rows: the group's query heads stacked, BQ rows each (zero past T)
  // a task: one key/value head's query tiles part, part + parts, ...; parts only where the heads are too few to
  // keep the threads busy, each with its own dK^T, dV^T accumulators (D x keys, fp32), summed below
  const int64_t want = (2 * at::get_num_threads() + B * Hkv - 1) / (B * Hkv);
  const int64_t parts = std::max<int64_t>(1, std::min({want, G, qtiles}));
  auto dq = at::empty_like(q);
  auto acc = at::zeros({B, Hkv, parts, 2, D, TP}, q.options().dtype(at::kFloat));
  const auto packed = pack_all(k, v, NK, true);
  at::parallel_for(0, B * Hkv * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(R * NK), dp(R * NK), dqa(R * D);
    std::vector<bf16> qs(R * D), gs(R * D), qT(D * R), gT(D * R), p(R * NK), ds(R * NK), pv(R * NK), dsv(R * NK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bk = task / parts, part = task % parts, b = bk / Hkv;
      const int64_t* st = starts.data_ptr<int64_t>() + (starts.size(0) == 1 ? 0 : b * T);
      const Packed& pk = packed[bk];
      float* dk = acc.data_ptr<float>() + task * 2 * D * TP;
      float* dv = dk + D * TP;
      for (int64_t i0 = part * BQ; i0 < T; i0 += parts * BQ) {
        const int64_t M = std::min(BQ, T - i0);
        if (M < BQ) {  // the last tile: rows past T are zero (their scores, P and dS come out zero or unused)
          std::memset(static_cast<void*>(qs.data()), 0, qs.size() * sizeof(bf16));
          std::memset(static_cast<void*>(gs.data()), 0, gs.size() * sizeof(bf16));
          std::memset(static_cast<void*>(p.data()), 0, p.size() * sizeof(bf16));
          std::memset(static_cast<void*>(ds.data()), 0, ds.size() * sizeof(bf16));
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = ((bk * G + g) * T + i0) * D;
          std::memcpy(qs.data() + g * BQ * D, q.data_ptr<bf16>() + row, M * D * sizeof(bf16));
          std::memcpy(gs.data() + g * BQ * D, grad.data_ptr<bf16>() + row, M * D * sizeof(bf16));
        }
        transpose(qs.data(), D, qT.data(), R, R, D);  // Q^T and dO^T: the A operands of dK^T and dV^T
        transpose(gs.data(), D, gT.data(), R, R, D);
        std::fill(dqa.begin(), dqa.end(), 0.f);
        for (int64_t j = st[i0] / NK; j <= (i0 + M - 1) / NK; ++j) {
          const int64_t j0 = j * NK;
          gemm(R, NK, D, D, NK, NK, false, qs.data(), pk.kt.data() + j * tile, s.data());
          gemm(R, NK, D, D, NK, NK, false, gs.data(), pk.vt.data() + j * tile, dp.data());
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = bk * G + g;
            const float* lt = lse.data_ptr<float>() + h * T + i0;
            const float* dt = delta.data_ptr<float>() + h * T + i0;
            for (int64_t r = 0; r < M; ++r) {
              int64_t lo, hi;
              visible(st, i0 + r, j0, NK, lo, hi);
              float* sr = s.data() + (g * BQ + r) * NK;
              float* dr = dp.data() + (g * BQ + r) * NK;
              if (lo <= hi) {
                const fVec vs(scale), vs2(scale * LOG2E), vl(lt[r] * LOG2E), vdelta(dt[r]);
                int64_t c = lo;
                for (; c + W <= hi + 1; c += W) {
                  fVec e = exp2_fast(at::vec::fmsub(fVec::loadu(sr + c), vs2, vl));
                  e.store(sr + c);
                  (e * (fVec::loadu(dr + c) - vdelta) * vs).store(dr + c);
                }
                for (; c <= hi; ++c) {
                  sr[c] = std::exp(sr[c] * scale - lt[r]);
                  dr[c] = sr[c] * (dr[c] - dt[r]) * scale;
                }
              } else {
                lo = NK, hi = NK - 1;
              }
              std::fill(sr, sr + lo, 0.f);
              std::fill(sr + hi + 1, sr + NK, 0.f);
              std::fill(dr, dr + lo, 0.f);
              std::fill(dr + hi + 1, dr + NK, 0.f);
              at::vec::convert(sr, p.data() + (g * BQ + r) * NK, NK);
              at::vec::convert(dr, ds.data() + (g * BQ + r) * NK, NK);
            }
          }
          // P and dS as B operands (R x NK, VNNI) of dV^T and dK^T
          at::vec::pack_vnni2(p.data(), pv.data(), NK, R, NK);
          at::vec::pack_vnni2(ds.data(), dsv.data(), NK, R, NK);
          gemm(D, NK, R, R, NK, TP, true, gT.data(), pv.data(), dv + j0);
          gemm(D, NK, R, R, NK, TP, true, qT.data(), dsv.data(), dk + j0);
          gemm(R, D, NK, NK, D, D, true, ds.data(), pk.kk.data() + j * tile, dqa.data());
        }
        for (int64_t g = 0; g < G; ++g) {
          bf16* dqt = dq.data_ptr<bf16>() + ((bk * G + g) * T + i0) * D;
          for (int64_t r = 0; r < M; ++r) at::vec::convert(dqa.data() + (g * BQ + r) * D, dqt + r * D, D);
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  auto grads = acc.sum(2).narrow(4, 0, T).transpose(3, 4);  // (B, Hkv, 2, T, D)
  auto dk = at::empty_like(k_in).copy_(grads.select(2, 0));
  auto dv = at::empty_like(v_in).copy_(grads.select(2, 1));
  return {like(q_in, dq), dk, dv};
}

#else  // an AVX2 or plain build: the bmm form serves every call

bool available() { return false; }

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, double, int64_t, int64_t) {
  TORCH_CHECK(false, "blocked attention tiles: built without AVX-512");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, double, int64_t, int64_t) {
  TORCH_CHECK(false, "blocked attention tiles: built without AVX-512");
}

#endif

}  // namespace hf_speedup_tiles
