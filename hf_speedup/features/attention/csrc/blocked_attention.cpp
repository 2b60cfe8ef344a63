// Blocked causal attention for training on CPU (hf_speedup's ``blocked`` attention kernel).
//
// Each block of queries meets every key it may see in a few large GEMMs (ATen's bmm: MKL / oneDNN, the matrix
// units where the CPU has them): grouped query heads are stacked on their key/value head, so keys and values are
// read in place. The softmax between the GEMMs is one fused, vectorised pass per row in fp32. Scores exist for one
// block at a time (memory linear in the length); the backward recomputes them from the saved log-sum-exp.
// Documents of a padding-free row come as ``starts`` (each position's document start): a row's keys are the
// contiguous range [its document's start, itself], so no mask is built and blocks of earlier documents are skipped.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace hf_speedup_tiles {  // blocked_tiles.cpp
bool available();
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& starts, double scale, int64_t queries, int64_t keys);
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse,
                                                        const at::Tensor& starts, double scale, int64_t queries,
                                                        int64_t keys);
}  // namespace hf_speedup_tiles

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();

template <typename T>
inline fVec load_f(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(src);
  } else {
    fVec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

template <typename T>
inline void zero(T* dst, int64_t n) {
  if (n > 0) std::memset(static_cast<void*>(dst), 0, n * sizeof(T));
}

// x <- exp(x * scale - shift); returns the sum
inline float exp_sum(float* x, int64_t n, float scale, float shift) {
  const fVec vs(scale), vsh(shift);
  fVec acc(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    fVec e = (fVec::loadu(x + i) * vs - vsh).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float lanes[W];
  acc.store(lanes);
  float s = 0.f;
  for (int64_t j = 0; j < W; ++j) s += lanes[j];
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] * scale - shift);
    s += x[i];
  }
  return s;
}

struct Rows {
  int64_t n;             // queries in the block
  int64_t tk;            // keys in the block
  const int64_t* lo;     // per query: first key it sees (block-relative)
  const int64_t* hi;     // per query: last key it sees (block-relative, inclusive)
};

// forward: p = softmax(s * scale) over each row's keys, zero elsewhere; lse per row
template <typename T>
void softmax_rows(const T* s, T* p, float* lse, int64_t rows, const Rows& r, float scale) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(r.tk);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t qi = row % r.n, lo = r.lo[qi], len = r.hi[qi] - lo + 1;
      const T* src = s + row * r.tk + lo;
      T* dst = p + row * r.tk;
      float* b = buf.data();
      // one pass: to fp32 and the running max
      fVec vm(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + W <= len; i += W) {
        fVec x = load_f(src + i);
        x.store(b + i);
        vm = at::vec::maximum(vm, x);
      }
      float lanes[W];
      vm.store(lanes);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < W; ++j) m = std::max(m, lanes[j]);
      for (; i < len; ++i) {
        b[i] = static_cast<float>(src[i]);
        m = std::max(m, b[i]);
      }
      const float sum = exp_sum(b, len, scale, m * scale);
      const fVec inv(1.f / sum);
      for (i = 0; i + W <= len; i += W) (fVec::loadu(b + i) * inv).store(b + i);
      for (; i < len; ++i) b[i] /= sum;
      zero(dst, lo);
      from_float(b, dst + lo, len);
      zero(dst + lo + len, r.tk - lo - len);
      lse[row] = m * scale + std::log(sum);
    }
  });
}

// backward: p = exp(s * scale - lse), ds = p * (dp - delta) * scale, both zero outside each row's keys
template <typename T>
void softmax_grad_rows(const T* s, const T* dp, T* p, T* ds, const float* lse, const float* delta, int64_t rows,
                       const Rows& r, float scale) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> bs(r.tk), bd(r.tk);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t qi = row % r.n, lo = r.lo[qi], len = r.hi[qi] - lo + 1;
      const int64_t off = row * r.tk;
      const T* srow = s + off + lo;
      const T* dprow = dp + off + lo;
      const fVec vs(scale), vl(lse[row]), vdelta(delta[row]);
      int64_t i = 0;
      for (; i + W <= len; i += W) {
        fVec e = (load_f(srow + i) * vs - vl).exp_u20();
        e.store(bs.data() + i);
        (e * (load_f(dprow + i) - vdelta) * vs).store(bd.data() + i);
      }
      for (; i < len; ++i) {
        bd[i] = static_cast<float>(dprow[i]);
        const float e = std::exp(static_cast<float>(srow[i]) * scale - lse[row]);
        bs[i] = e;
        bd[i] = e * (bd[i] - delta[row]) * scale;
      }
      zero(p + off, lo);
      zero(ds + off, lo);
      from_float(bs.data(), p + off + lo, len);
      from_float(bd.data(), ds + off + lo, len);
      zero(p + off + lo + len, r.tk - lo - len);
      zero(ds + off + lo + len, r.tk - lo - len);
    }
  });
}

// the block's queries [i0, i0 + n): the first key any of them sees, and each one's key range
struct Block {
  int64_t i0, n, ks, tk;
  std::vector<int64_t> lo, hi;
};

Block make_block(const int64_t* starts, int64_t i0, int64_t n) {
  Block b{i0, n, starts[i0], 0, std::vector<int64_t>(n), std::vector<int64_t>(n)};
  b.tk = i0 + n - b.ks;
  for (int64_t j = 0; j < n; ++j) {
    b.lo[j] = starts[i0 + j] - b.ks;
    b.hi[j] = i0 + j - b.ks;
  }
  return b;
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts) {
  TORCH_CHECK(q.device().is_cpu(), "blocked attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "blocked attention takes (batch, heads, tokens, dim)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "blocked attention: query, key and value in one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "blocked attention: fp32 or bf16");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "blocked attention: query heads a multiple of key/value heads");
  TORCH_CHECK(q.size(3) == v.size(3) && q.size(3) == k.size(3), "blocked attention: one head size");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "blocked attention: keys and values of the queries' batch and length");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 2 && starts.size(1) == q.size(2),
              "blocked attention: starts is (rows, tokens) int64");
  TORCH_CHECK(starts.size(0) == 1 || starts.size(0) == q.size(0), "blocked attention: starts has 1 or batch rows");
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& starts_in, double scale, int64_t block) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3), Hkv = k.size(1), G = H / Hkv;
  auto out = at::empty_like(q);
  auto lse = at::empty({B, H, T_}, q.options().dtype(at::kFloat));
  auto starts = starts_in.contiguous();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* st = starts.data_ptr<int64_t>() + (starts.size(0) == 1 ? 0 : b * T_);
    auto qb = q.select(0, b).view({Hkv, G, T_, D});
    auto kb = k.select(0, b), vb = v.select(0, b);
    auto ob = out.select(0, b).view({Hkv, G, T_, D});
    auto lb = lse.select(0, b).view({Hkv, G, T_});
    for (int64_t i0 = 0; i0 < T_; i0 += block) {
      const Block blk = make_block(st, i0, std::min(block, T_ - i0));
      auto qblk = qb.slice(2, i0, i0 + blk.n).reshape({Hkv, G * blk.n, D});
      auto kblk = kb.slice(1, blk.ks, i0 + blk.n);
      auto vblk = vb.slice(1, blk.ks, i0 + blk.n);
      auto s = at::bmm(qblk, kblk.transpose(1, 2));
      auto p = at::empty_like(s);
      auto l = at::empty({Hkv * G * blk.n}, lse.options());
      const Rows rows{blk.n, blk.tk, blk.lo.data(), blk.hi.data()};
      softmax_rows<T>(s.data_ptr<T>(), p.data_ptr<T>(), l.data_ptr<float>(), Hkv * G * blk.n, rows,
                      static_cast<float>(scale));
      lb.slice(2, i0, i0 + blk.n).copy_(l.view({Hkv, G, blk.n}));
      ob.slice(2, i0, i0 + blk.n).copy_(at::bmm(p, vblk).view({Hkv, G, blk.n, D}));
    }
  }
  return {out, lse};
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(const at::Tensor& grad, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& out, const at::Tensor& lse,
                                                             const at::Tensor& starts_in, double scale,
                                                             int64_t block) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3), Hkv = k.size(1), G = H / Hkv;
  auto delta = (grad.to(at::kFloat) * out.to(at::kFloat)).sum(-1);  // (B, H, T)
  auto dq = at::empty_like(q);
  auto dk_acc = at::zeros({B, Hkv, T_, D}, q.options().dtype(at::kFloat));
  auto dv_acc = at::zeros({B, Hkv, T_, D}, q.options().dtype(at::kFloat));
  auto starts = starts_in.contiguous();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* st = starts.data_ptr<int64_t>() + (starts.size(0) == 1 ? 0 : b * T_);
    auto qb = q.select(0, b).view({Hkv, G, T_, D});
    auto gb = grad.select(0, b).view({Hkv, G, T_, D});
    auto kb = k.select(0, b), vb = v.select(0, b);
    auto dqb = dq.select(0, b).view({Hkv, G, T_, D});
    auto lb = lse.select(0, b).view({Hkv, G, T_});
    auto db = delta.select(0, b).view({Hkv, G, T_});
    auto dkb = dk_acc.select(0, b), dvb = dv_acc.select(0, b);
    for (int64_t i0 = 0; i0 < T_; i0 += block) {
      const Block blk = make_block(st, i0, std::min(block, T_ - i0));
      const int64_t i1 = i0 + blk.n, M = G * blk.n;
      auto qblk = qb.slice(2, i0, i1).reshape({Hkv, M, D});
      auto gblk = gb.slice(2, i0, i1).reshape({Hkv, M, D});
      auto kblk = kb.slice(1, blk.ks, i1);
      auto vblk = vb.slice(1, blk.ks, i1);
      auto s = at::bmm(qblk, kblk.transpose(1, 2));
      auto dp = at::bmm(gblk, vblk.transpose(1, 2));
      auto l = lb.slice(2, i0, i1).contiguous();
      auto d = db.slice(2, i0, i1).contiguous();
      auto p = at::empty_like(s), ds = at::empty_like(s);
      const Rows rows{blk.n, blk.tk, blk.lo.data(), blk.hi.data()};
      softmax_grad_rows<T>(s.data_ptr<T>(), dp.data_ptr<T>(), p.data_ptr<T>(), ds.data_ptr<T>(), l.data_ptr<float>(),
                           d.data_ptr<float>(), Hkv * M, rows, static_cast<float>(scale));
      // dV^T = dO^T P and dK^T = Q^T dS: the large operands (P, dS) read as they lie, only the small ones transposed
      dvb.slice(1, blk.ks, i1).add_(at::bmm(gblk.transpose(1, 2), p).transpose(1, 2));
      dkb.slice(1, blk.ks, i1).add_(at::bmm(qblk.transpose(1, 2), ds).transpose(1, 2));
      dqb.slice(2, i0, i1).copy_(at::bmm(ds, kblk).view({Hkv, G, blk.n, D}));
    }
  }
  auto dk = at::empty_like(k).copy_(dk_acc);
  auto dv = at::empty_like(v).copy_(dv_acc);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor> blocked_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& starts,
                                                             double scale, int64_t block) {
  check(q, k, v, starts);
  TORCH_CHECK(block > 0, "blocked attention: block > 0");
  if (q.scalar_type() == at::kBFloat16) return forward_impl<at::BFloat16>(q, k, v, starts, scale, block);
  return forward_impl<float>(q, k, v, starts, scale, block);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> blocked_attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& starts, double scale, int64_t block) {
  check(q, k, v, starts);
  TORCH_CHECK(grad.scalar_type() == q.scalar_type(), "blocked attention: gradient in the query's dtype");
  if (q.scalar_type() == at::kBFloat16)
    return backward_impl<at::BFloat16>(grad, q, k, v, out, lse, starts, scale, block);
  return backward_impl<float>(grad, q, k, v, out, lse, starts, scale, block);
}

int64_t vector_lanes() { return W; }

bool tiles_available() { return hf_speedup_tiles::available(); }

void check_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                 int64_t queries, int64_t keys) {
  check(q, k, v, starts);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "blocked attention tiles: bf16 only");
  TORCH_CHECK(hf_speedup_tiles::available(), "blocked attention tiles: this CPU has no matrix units oneDNN drives");
  TORCH_CHECK(queries > 0 && keys > 0 && queries % 2 == 0 && keys % 2 == 0 && q.size(3) % fVec::size() == 0,
              "blocked attention tiles: even tile sizes and a head size a multiple of the vector width");
}

std::tuple<at::Tensor, at::Tensor> tiles_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& starts, double scale, int64_t queries,
                                                 int64_t keys) {
  check_tiles(q, k, v, starts, queries, keys);
  return hf_speedup_tiles::forward(q, k, v, starts, scale, queries, keys);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tiles_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& starts, double scale, int64_t queries, int64_t keys) {
  check_tiles(q, k, v, starts, queries, keys);
  TORCH_CHECK(grad.scalar_type() == q.scalar_type(), "blocked attention: gradient in the query's dtype");
  TORCH_CHECK(grad.sizes() == q.sizes() && out.sizes() == q.sizes(), "blocked attention: gradient and output like q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == q.size(0) &&
              lse.size(1) == q.size(1) && lse.size(2) == q.size(2), "blocked attention: lse is (batch, heads, T) fp32");
  return hf_speedup_tiles::backward(grad, q, k, v, out, lse, starts, scale, queries, keys);
}

}  // namespace

TORCH_LIBRARY(hf_speedup_cpu, m) {
  m.def("vector_lanes() -> int");
  m.def("blocked_attention_forward(Tensor q, Tensor k, Tensor v, Tensor starts, float scale, int block) "
        "-> (Tensor, Tensor)");
  m.def("blocked_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor starts, float scale, int block) -> (Tensor, Tensor, Tensor)");
  m.def("tiles_available() -> bool");
  m.def("blocked_tiles_forward(Tensor q, Tensor k, Tensor v, Tensor starts, float scale, int queries, int keys) "
        "-> (Tensor, Tensor)");
  m.def("blocked_tiles_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor starts, float scale, int queries, int keys) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_speedup_cpu, CPU, m) {
  m.impl("blocked_attention_forward", &blocked_attention_forward);
  m.impl("blocked_attention_backward", &blocked_attention_backward);
  m.impl("blocked_tiles_forward", &tiles_forward);
  m.impl("blocked_tiles_backward", &tiles_backward);
}

TORCH_LIBRARY_IMPL(hf_speedup_cpu, CompositeExplicitAutograd, m) {
  m.impl("vector_lanes", &vector_lanes);
  m.impl("tiles_available", &tiles_available);
}
