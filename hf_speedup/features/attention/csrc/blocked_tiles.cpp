// The tiled form of the ``blocked`` kernel: bf16 on CPUs whose matrix units oneDNN drives (AMX).
//
// Why: with ATen's bmm per block of queries, a block's scores against all its keys go through memory (more than L2
// at a few thousand keys) and the softmax passes over them are memory-bound. Here a tile of queries meets a tile of
// keys at a time (flash-style): the score tile stays in L1/L2 from the score GEMM through the softmax to the next
// GEMM, and every GEMM is one oneDNN micro-kernel call (``cpublas::brgemm``) on operands packed once (keys and
// values once per key/value head, shared by its query heads; a query tile once per tile). The forward keeps an
// online softmax (running max and sum in fp32); the backward recomputes each score tile from the saved
// log-sum-exp. Work is split over (row, query head) for the backward, so each task owns its dK/dV accumulators
// (fp32, summed over the heads of a group afterwards: deterministic, memory linear in the length), and over (row,
// query head, query tile) for the forward.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace hf_speedup_tiles {

using bf16 = at::BFloat16;
using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float LOG2E = 1.4426950408889634f;

bool available() {
#if defined(CPU_CAPABILITY_AVX512)
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;  // the VNNI packing below is AVX-512 code
#endif
}

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
  const __m512 y = _mm512_max_ps(yv, _mm512_set1_ps(-126.f));
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
  const int64_t ktiles = (T + NK - 1) / NK, TP = ktiles * NK, tile = D * NK;
  auto dq = at::empty_like(q);
  // dK^T and dV^T per query head (D x keys), summed over the heads of a group below
  auto dk_h = at::empty({B, Hkv, G, D, TP}, q.options().dtype(at::kFloat));
  auto dv_h = at::empty({B, Hkv, G, D, TP}, q.options().dtype(at::kFloat));
  const auto packed = pack_all(k, v, NK, true);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(BQ * NK), dp(BQ * NK), dqa(BQ * D);
    std::vector<bf16> p(BQ * NK, bf16(0.f)), ds(BQ * NK, bf16(0.f)), pv(BQ * NK), dsv(BQ * NK), qT(D * BQ),
        gT(D * BQ);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H;
      const int64_t* st = starts.data_ptr<int64_t>() + (starts.size(0) == 1 ? 0 : b * T);
      const Packed& pk = packed[b * Hkv + (bh % H) / G];
      float* dk = dk_h.data_ptr<float>() + bh * D * TP;
      float* dv = dv_h.data_ptr<float>() + bh * D * TP;
      std::memset(dk, 0, TP * D * sizeof(float));
      std::memset(dv, 0, TP * D * sizeof(float));
      for (int64_t i0 = 0; i0 < T; i0 += BQ) {
        const int64_t M = std::min(BQ, T - i0);
        const bf16* qt = q.data_ptr<bf16>() + (bh * T + i0) * D;
        const bf16* gt = grad.data_ptr<bf16>() + (bh * T + i0) * D;
        const float* lt = lse.data_ptr<float>() + bh * T + i0;
        const float* dt = delta.data_ptr<float>() + bh * T + i0;
        // Q^T and dO^T of the tile (D x BQ, columns past M zero): the A operands of dK^T and dV^T
        if (M < BQ) {
          std::memset(static_cast<void*>(qT.data()), 0, qT.size() * sizeof(bf16));
          std::memset(static_cast<void*>(gT.data()), 0, gT.size() * sizeof(bf16));
        }
        transpose(qt, D, qT.data(), BQ, M, D);
        transpose(gt, D, gT.data(), BQ, M, D);
        std::fill(dqa.begin(), dqa.end(), 0.f);
        for (int64_t j = st[i0] / NK; j <= (i0 + M - 1) / NK; ++j) {
          const int64_t j0 = j * NK;
          gemm(M, NK, D, D, NK, NK, false, qt, pk.kt.data() + j * tile, s.data());
          gemm(M, NK, D, D, NK, NK, false, gt, pk.vt.data() + j * tile, dp.data());
          for (int64_t r = 0; r < M; ++r) {
            int64_t lo, hi;
            visible(st, i0 + r, j0, NK, lo, hi);
            float* sr = s.data() + r * NK;
            float* dr = dp.data() + r * NK;
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
            at::vec::convert(sr, p.data() + r * NK, NK);
            at::vec::convert(dr, ds.data() + r * NK, NK);
          }
          // P and dS as B operands (BQ x NK, VNNI; rows past M stay zero) of dV^T and dK^T
          at::vec::pack_vnni2(p.data(), pv.data(), NK, BQ, NK);
          at::vec::pack_vnni2(ds.data(), dsv.data(), NK, BQ, NK);
          gemm(D, NK, BQ, BQ, NK, TP, true, gT.data(), pv.data(), dv + j0);
          gemm(D, NK, BQ, BQ, NK, TP, true, qT.data(), dsv.data(), dk + j0);
          gemm(M, D, NK, NK, D, D, true, ds.data(), pk.kk.data() + j * tile, dqa.data());
        }
        if (M < BQ) {  // the last tile's rows past M were written: zero them for the next head
          std::memset(static_cast<void*>(p.data() + M * NK), 0, (BQ - M) * NK * sizeof(bf16));
          std::memset(static_cast<void*>(ds.data() + M * NK), 0, (BQ - M) * NK * sizeof(bf16));
        }
        bf16* dqt = dq.data_ptr<bf16>() + (bh * T + i0) * D;
        for (int64_t r = 0; r < M; ++r) at::vec::convert(dqa.data() + r * D, dqt + r * D, D);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  auto dk = at::empty_like(k_in).copy_(dk_h.sum(2).narrow(3, 0, T).transpose(2, 3));
  auto dv = at::empty_like(v_in).copy_(dv_h.sum(2).narrow(3, 0, T).transpose(2, 3));
  return {like(q_in, dq), dk, dv};
}

}  // namespace hf_speedup_tiles
