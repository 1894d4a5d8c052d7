// Causal prefill attention with the log-sum-exp of every query row, GQA-aware, for one sequence.
//
// torch's CPU flash kernel runs each query head on its own, so a KV head's keys and values are read once per query
// head of its group, and it multiplies small tiles through a GEMM library call each. Here one task takes a tile of
// query positions for every query head of one KV head's group at once (group x positions rows), packs each key
// tile once for all of them, and multiplies in register-blocked loops the compiler keeps in vector registers; the
// softmax is the online one of flash attention. Query i (absolute position ctx - n + i) sees keys 0..ctx - n + i,
// so this covers a whole prompt and a later chunk whose earlier keys are all visible. bfloat16 on a CPU with
// AVX512_BF16 multiplies bf16 pairs directly (prefill_kernel_bf16). Built and loaded by pdserve/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "convert.h"
#include "exp_nonpositive.h"
#include "ops.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_BF16_DOT 1
#endif

namespace {

using pdserve_kernels::exp_nonpositive;
using pdserve_kernels::from_f;
using pdserve_kernels::raw;
using pdserve_kernels::storage_t;
using pdserve_kernels::to_f;

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads and stores

constexpr int64_t kMR = 6;   // rows per register block: 6 x 2 accumulators + 2 loads + 1 broadcast of 16 registers
constexpr int64_t kNR = 16;  // columns per register block (two 8-float vectors)
constexpr int64_t kQT = 16;  // query positions per task (x the group's heads = rows)
constexpr int64_t kKT = 64;  // keys per tile

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

// max(init, x[0..n)); the plain loop does not vectorise (float max is not associative for the compiler)
inline float row_max(const float* x, int64_t n, float init) {
  v8 acc = (v8){} + init;
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const v8 y = load(x + c);
    acc = acc > y ? acc : y;
  }
  float mx = init;
  for (int i = 0; i < 8; ++i) mx = std::max(mx, acc[i]);
  for (; c < n; ++c) mx = std::max(mx, x[c]);
  return mx;
}

// c[rows r0..r0+kMR)[NV vectors of V floats from c0] (+)= a . b: a broadcast of a times NV vectors of b per step.
template <typename V, int NV>
inline void product_block(const float* __restrict__ a, int64_t lda, const float* __restrict__ b, int64_t ldb,
                          float* __restrict__ c, int64_t ldc, int64_t r0, int64_t c0, int64_t inner, bool accumulate) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  typedef float VU __attribute__((vector_size(sizeof(V)), aligned(4)));  // unaligned loads and stores
  V acc[kMR][NV] = {};
  if (accumulate)
    for (int64_t r = 0; r < kMR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = *reinterpret_cast<const VU*>(c + (r0 + r) * ldc + c0 + W * j);
  for (int64_t k = 0; k < inner; ++k) {
    V bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = *reinterpret_cast<const VU*>(b + k * ldb + c0 + W * j);
    for (int64_t r = 0; r < kMR; ++r) {
      const float x = a[(r0 + r) * lda + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += x * bv[j];
    }
  }
  for (int64_t r = 0; r < kMR; ++r)
    for (int j = 0; j < NV; ++j) *reinterpret_cast<VU*>(c + (r0 + r) * ldc + c0 + W * j) = acc[r][j];
}

// c[M][nc] (+)= a[M][inner] . b[inner][nc], M a multiple of kMR and nc of kNR, in kMR-row register blocks: with
// AVX-512, 32 columns of 16-float vectors (half the instructions of 8-float ones), else 16 of 8-float vectors. Each
// element's sum runs over k in order either way, so both give the same bits. Both products of attention are this.
void block_product(const float* __restrict__ a, int64_t lda, const float* __restrict__ b, int64_t ldb,
                   float* __restrict__ c, int64_t ldc, int64_t M, int64_t nc, int64_t inner, bool accumulate) {
  for (int64_t r0 = 0; r0 < M; r0 += kMR) {
    int64_t c0 = 0;
#ifdef __AVX512F__
    typedef float v16 __attribute__((vector_size(64)));
    for (; c0 + 32 <= nc; c0 += 32) product_block<v16, 2>(a, lda, b, ldb, c, ldc, r0, c0, inner, accumulate);
    if (c0 < nc) product_block<v16, 1>(a, lda, b, ldb, c, ldc, r0, c0, inner, accumulate);
#else
    for (; c0 < nc; c0 += kNR) product_block<v8, 2>(a, lda, b, ldb, c, ldc, r0, c0, inner, accumulate);
#endif
  }
}

// One row's step of the online softmax over a key tile: sr[0, nv) becomes exp(sr * scale - max), 0 from nv up to
// nkp, and the row's running max m, sum l and output row o (D floats) are rescaled to the new max. scale: 1 where
// the queries came prescaled (x * 1 and its FMA are exact, so that is the same arithmetic as no scale).
inline void softmax_row(float* sr, int64_t nv, int64_t nkp, float scale, float& m, float& l, float* orow, int64_t D) {
  const float mx = std::max(m, row_max(sr, nv, -std::numeric_limits<float>::infinity()) * scale);
  const float alpha = exp_nonpositive(m - mx);  // m = -inf: the clamp gives ~0, and o, l are 0
  float tot = 0.f;
#pragma omp simd reduction(+ : tot)
  for (int64_t c = 0; c < nv; ++c) {
    sr[c] = exp_nonpositive(sr[c] * scale - mx);
    tot += sr[c];
  }
  for (int64_t c = nv; c < nkp; ++c) sr[c] = 0.f;
  if (mx != m) {
    for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
    l *= alpha;
  }
  l += tot;
  m = mx;
}

// A task's rows out: each query row's o / l as T, and its LSE m + log(l).
template <typename T>
void write_rows(const float* o, const float* m, const float* l, storage_t<T>* op, float* lp, int64_t t0, int64_t nt,
                int64_t G, int64_t h, int64_t Hq, int64_t D) {
  for (int64_t r = 0; r < nt * G; ++r) {
    const int64_t i = t0 + r / G, hq = h * G + r % G;
    storage_t<T>* dst = op + (i * Hq + hq) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(o[r * D + d] * inv);
    lp[i * Hq + hq] = m[r] + std::log(l[r]);
  }
}

struct Task {
  int64_t h, t0, cost;
};

// One task: a tile of kQT query positions for one KV head's group. Later tiles see more keys: longest first, each
// to the least loaded thread, one bucket per thread.
std::vector<std::vector<Task>> balance_tasks(int64_t n, int64_t Hkv, int64_t off) {
  std::vector<Task> tasks;
  for (int64_t t0 = 0; t0 < n; t0 += kQT)
    for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({h, t0, off + std::min(n, t0 + kQT)});
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t nb = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<std::vector<Task>> buckets(nb);
  std::vector<int64_t> load_of(nb, 0);
  for (const Task& t : tasks) {
    const int64_t b = std::min_element(load_of.begin(), load_of.end()) - load_of.begin();
    buckets[b].push_back(t);
    load_of[b] += t.cost;
  }
  return buckets;
}

template <typename T, int64_t D>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out,
                    at::Tensor& lse) {
  const int64_t n = q.size(0), Hq = q.size(1), ctx = k.size(0), Hkv = k.size(1);
  const int64_t G = Hq / Hkv, off = ctx - n;
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0);
  using S = storage_t<T>;
  const S* qp = raw(q.data_ptr<T>());
  const S* kp = raw(k.data_ptr<T>());
  const S* vp = raw(v.data_ptr<T>());
  S* op = raw(out.data_ptr<T>());
  float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t Mmax = (kQT * G + kMR - 1) / kMR * kMR;

  const auto buckets = balance_tasks(n, Hkv, off);
  const int64_t nb = static_cast<int64_t>(buckets.size());

  // Each KV head's keys transposed into [tile][D][kKT] and its values into [keys][D], once for every query tile;
  // zeros pad the last tile, so the padded columns score 0 and add nothing.
  const int64_t ntiles = (ctx + kKT - 1) / kKT;
  std::vector<float> kt_all(Hkv * ntiles * D * kKT), v_all(Hkv * ntiles * kKT * D);
  at::parallel_for(0, Hkv * ntiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / ntiles, k0 = (item % ntiles) * kKT;
      float* kt = kt_all.data() + item * D * kKT;
      float* vt = v_all.data() + item * kKT * D;
      for (int64_t j = 0; j < kKT; ++j) {
        if (k0 + j < ctx) {
          const S* ks = kp + (k0 + j) * sk + h * D;
          const S* vs = vp + (k0 + j) * sv + h * D;
          for (int64_t d = 0; d < D; ++d) kt[d * kKT + j] = to_f<T>(ks[d]);
          for (int64_t d = 0; d < D; ++d) vt[j * D + d] = to_f<T>(vs[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * kKT + j] = 0.f;
          std::fill(vt + j * D, vt + (j + 1) * D, 0.f);
        }
      }
    }
  });

  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(Mmax * D), o(Mmax * D), s(Mmax * kKT), m(Mmax), l(Mmax);
    for (int64_t b = begin; b < end; ++b) {
      for (const Task& task : buckets[b]) {
        const int64_t h = task.h, t0 = task.t0, nt = std::min(kQT, n - t0);
        const int64_t M = (nt * G + kMR - 1) / kMR * kMR;  // rows: position-major, the group's heads inside
        for (int64_t r = 0; r < M; ++r) {
          float* dst = qs.data() + r * D;
          if (r < nt * G) {
            const S* src = qp + (t0 + r / G) * sq + (h * G + r % G) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = to_f<T>(src[d]) * sc;
          } else {
            std::fill(dst, dst + D, 0.f);
          }
        }
        std::fill(o.begin(), o.begin() + M * D, 0.f);
        std::fill(m.begin(), m.begin() + M, -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.begin() + M, 0.f);
        const int64_t keys = off + t0 + nt;  // the tile's last query sees keys [0, keys)
        for (int64_t k0 = 0; k0 < keys; k0 += kKT) {
          const int64_t nk = std::min(kKT, keys - k0);
          const int64_t nkp = (nk + kNR - 1) / kNR * kNR;
          const float* kt = kt_all.data() + (h * ntiles + k0 / kKT) * D * kKT;
          const float* vt = v_all.data() + (h * ntiles + k0 / kKT) * kKT * D;
          block_product(qs.data(), D, kt, kKT, s.data(), kKT, M, nkp, D, false);  // scores: q . k^T
          for (int64_t r = 0; r < M; ++r) {
            float* sr = s.data() + r * kKT;
            // keys this row sees in the tile (padding rows take the tile's last position's)
            const int64_t pos = off + t0 + std::min(r / G, nt - 1);
            const int64_t nv = std::min(nk, pos + 1 - k0);
            if (nv <= 0) {
              std::fill(sr, sr + nkp, 0.f);
              continue;
            }
            softmax_row(sr, nv, nkp, 1.f, m[r], l[r], o.data() + r * D, D);  // q came scaled
          }
          block_product(s.data(), kKT, vt, D, o.data(), D, M, D, nkp, true);  // o += p . v
        }
        write_rows<T>(o.data(), m.data(), l.data(), op, lp, t0, nt, G, h, Hq, D);
      }
    }
  });
}

#ifdef PDSERVE_BF16_DOT
// c[rows r0..r0+kMR)[16 * NV columns from c0] (+)= a . b over pairs of the inner index: a [rows][lda] bf16, b packed
// [inner / 2][ldb][2] (each column's pair side by side). AVX512_BF16's vdpbf16ps: exact products, fp32 sums, twice
// the multiplies of an fp32 FMA per instruction.
template <int NV>
inline void pair_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                       int64_t r0, int64_t c0, int64_t pairs, bool accumulate) {
  __m512 acc[kMR][NV];
  for (int64_t r = 0; r < kMR; ++r)
    for (int j = 0; j < NV; ++j)
      acc[r][j] = accumulate ? _mm512_loadu_ps(c + (r0 + r) * ldc + c0 + 16 * j) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + (p * ldb + c0 + 16 * j) * 2);
    for (int64_t r = 0; r < kMR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + (r0 + r) * lda + 2 * p, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
    }
  }
  for (int64_t r = 0; r < kMR; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + (r0 + r) * ldc + c0 + 16 * j, acc[r][j]);
}

// block_product for bf16 operands: M a multiple of kMR, nc of 16, inner even.
void pair_product(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c, int64_t ldc, int64_t M,
                  int64_t nc, int64_t inner, bool accumulate) {
  for (int64_t r0 = 0; r0 < M; r0 += kMR) {
    int64_t c0 = 0;
    for (; c0 + 32 <= nc; c0 += 32) pair_block<2>(a, lda, b, ldb, c, ldc, r0, c0, inner / 2, accumulate);
    if (c0 < nc) pair_block<1>(a, lda, b, ldb, c, ldc, r0, c0, inner / 2, accumulate);
  }
}

// prefill_kernel for bfloat16 on a CPU with AVX512_BF16: both products on bf16 operands. The scores are exact
// products summed in fp32 and scaled after; the softmax weights are rounded to bf16 for p . v, as torch's flash
// kernel does for reduced precision; the running max, sums and output stay fp32.
template <int64_t D>
void prefill_kernel_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out,
                         at::Tensor& lse) {
  using T = c10::BFloat16;
  const int64_t n = q.size(0), Hq = q.size(1), ctx = k.size(0), Hkv = k.size(1);
  const int64_t G = Hq / Hkv, off = ctx - n;
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0);
  const uint16_t* qp = raw(q.data_ptr<T>());
  const uint16_t* kp = raw(k.data_ptr<T>());
  const uint16_t* vp = raw(v.data_ptr<T>());
  uint16_t* op = raw(out.data_ptr<T>());
  float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t Mmax = (kQT * G + kMR - 1) / kMR * kMR;
  const auto buckets = balance_tasks(n, Hkv, off);

  // Per KV head and key tile: keys as [D / 2][kKT][2] and values as [kKT / 2][D][2] (pair_block's b), zero padded.
  const int64_t ntiles = (ctx + kKT - 1) / kKT;
  std::vector<uint16_t> kt_all(Hkv * ntiles * D * kKT), v_all(Hkv * ntiles * kKT * D);
  at::parallel_for(0, Hkv * ntiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / ntiles, k0 = (item % ntiles) * kKT;
      uint16_t* kt = kt_all.data() + item * D * kKT;
      uint16_t* vt = v_all.data() + item * kKT * D;
      for (int64_t j = 0; j < kKT; ++j) {
        const bool in = k0 + j < ctx;
        const uint16_t* ks = kp + (k0 + j) * sk + h * D;
        const uint16_t* vs = vp + (k0 + j) * sv + h * D;
        for (int64_t d = 0; d < D; ++d) kt[((d / 2) * kKT + j) * 2 + d % 2] = in ? ks[d] : 0;
        for (int64_t d = 0; d < D; ++d) vt[((j / 2) * D + d) * 2 + j % 2] = in ? vs[d] : 0;
      }
    }
  });

  at::parallel_for(0, static_cast<int64_t>(buckets.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> qs(Mmax * D), pb(Mmax * kKT);
    std::vector<float> o(Mmax * D), s(Mmax * kKT), m(Mmax), l(Mmax);
    for (int64_t b = begin; b < end; ++b) {
      for (const Task& task : buckets[b]) {
        const int64_t h = task.h, t0 = task.t0, nt = std::min(kQT, n - t0);
        const int64_t M = (nt * G + kMR - 1) / kMR * kMR;  // rows: position-major, the group's heads inside
        for (int64_t r = 0; r < M; ++r) {
          uint16_t* dst = qs.data() + r * D;
          if (r < nt * G)
            std::memcpy(dst, qp + (t0 + r / G) * sq + (h * G + r % G) * D, D * sizeof(uint16_t));
          else
            std::fill(dst, dst + D, 0);
        }
        std::fill(o.begin(), o.begin() + M * D, 0.f);
        std::fill(m.begin(), m.begin() + M, -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.begin() + M, 0.f);
        const int64_t keys = off + t0 + nt;
        for (int64_t k0 = 0; k0 < keys; k0 += kKT) {
          const int64_t nk = std::min(kKT, keys - k0);
          const int64_t nkp = (nk + kNR - 1) / kNR * kNR;
          const uint16_t* kt = kt_all.data() + (h * ntiles + k0 / kKT) * D * kKT;
          const uint16_t* vt = v_all.data() + (h * ntiles + k0 / kKT) * kKT * D;
          pair_product(qs.data(), D, kt, kKT, s.data(), kKT, M, nkp, D, false);  // q . k^T, unscaled
          for (int64_t r = 0; r < M; ++r) {
            float* sr = s.data() + r * kKT;
            uint16_t* pr = pb.data() + r * kKT;
            const int64_t pos = off + t0 + std::min(r / G, nt - 1);
            const int64_t nv = std::min(nk, pos + 1 - k0);
            if (nv <= 0) {
              std::fill(pr, pr + nkp, 0);
              continue;
            }
            softmax_row(sr, nv, nkp, sc, m[r], l[r], o.data() + r * D, D);  // the scale in the exponent's FMA
            for (int64_t c = 0; c < nkp; c += 16)  // round to nearest even, as from_f (the weights are finite)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sr + c)));
          }
          pair_product(pb.data(), kKT, vt, D, o.data(), D, M, D, nkp, true);  // o += p . v
        }
        write_rows<T>(o.data(), m.data(), l.data(), op, lp, t0, nt, G, h, Hq, D);
      }
    }
  });
}
#endif

std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [n, Hq, D], k / v [ctx, Hkv, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2), "q heads / head size mismatch");
  TORCH_CHECK(q.size(0) <= k.size(0), "more queries than keys");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "dtypes");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "heads contiguous within a row");
  const int64_t D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head size 64 or 128");
  auto out = at::empty({q.size(0), q.size(1), D}, q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
#ifdef PDSERVE_BF16_DOT
  if (q.scalar_type() == at::kBFloat16) {
    if (D == 64)
      prefill_kernel_bf16<64>(q, k, v, scale, out, lse);
    else
      prefill_kernel_bf16<128>(q, k, v, scale, out, lse);
    return {out, lse};
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    if (D == 64)
      prefill_kernel<scalar_t, 64>(q, k, v, scale, out, lse);
    else
      prefill_kernel<scalar_t, 128>(q, k, v, scale, out, lse);
  });
  return {out, lse};
}

}  // namespace

namespace pdserve_kernels {  // the entry point for other kernels (ops.h)

std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale) {
  return ::prefill_attention(q, k, v, scale);
}

}  // namespace pdserve_kernels

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
