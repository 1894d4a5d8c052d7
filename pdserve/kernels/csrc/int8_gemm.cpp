// W8A8 linear layers: int8 weights [N, K] with one fp32 scale per output row, activations quantised per row (token)
// to int8 on the fly, int32 sums, y = acc * x_scale[row] * w_scale[col] (+ bias), as vLLM's CPU backend computes
// compressed-tensors' "int8 dynamic per-token" layers. The group-wise layers (int8_linear_grouped, llama.cpp's
// Q8_0) give weights and activations one scale per `group` columns and sum each group's exact int32 dot in fp32. Integer sums are exact, so every path below (AVX512_VNNI,
// AVX_VNNI, AVX2, scalar) gives the same bits. Built and loaded by pdserve/kernels/__init__.py.
//
// The vector paths multiply |w| (unsigned) by x * sign(w) (signed): activations are in [-127, 127], so neither
// operand overflows even where a checkpoint's weight is -128, and AVX2's u8 x s8 pair sums (at most 2 * 128 * 127)
// stay below int16's saturation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "convert.h"

namespace {

using pdserve_kernels::from_f;
using pdserve_kernels::prefetch_rows;
using pdserve_kernels::raw;
using pdserve_kernels::storage_t;
using pdserve_kernels::to_f;

constexpr int64_t kRows = 4;  // weight rows per block: four streams in flight for batch-1 decode

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kVec = 64;
using vec_t = __m512i;
inline vec_t vzero() { return _mm512_setzero_si512(); }
inline vec_t vload(const int8_t* p) { return _mm512_loadu_si512(p); }
// acc += sum of four |w| * (x * sign(w)) products per int32 lane
inline vec_t vdot(vec_t acc, vec_t x, vec_t w) {
  const __mmask64 neg = _mm512_movepi8_mask(w);
  const vec_t aw = _mm512_abs_epi8(w);  // -128 -> 0x80, which dpbusd reads as unsigned 128
  const vec_t sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
  return _mm512_dpbusd_epi32(acc, aw, sx);
}
inline int32_t vsum(vec_t v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX2__)
constexpr int64_t kVec = 32;
using vec_t = __m256i;
inline vec_t vzero() { return _mm256_setzero_si256(); }
inline vec_t vload(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vec_t vdot(vec_t acc, vec_t x, vec_t w) {
  const vec_t aw = _mm256_sign_epi8(w, w);  // |w|; -128 stays 0x80 = unsigned 128
  const vec_t sx = _mm256_sign_epi8(x, w);  // x * sign(w), 0 where w is 0
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, aw, sx);
#else
  const vec_t pairs = _mm256_maddubs_epi16(aw, sx);  // exact: |pair sum| <= 2 * 128 * 127 < 32768
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
inline int32_t vsum(vec_t v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
#else
constexpr int64_t kVec = 0;  // scalar only
#endif

inline int32_t dot_tail(const int8_t* x, const int8_t* w, int64_t from, int64_t k) {
  int32_t s = 0;
  for (int64_t c = from; c < k; ++c) s += static_cast<int32_t>(x[c]) * static_cast<int32_t>(w[c]);
  return s;
}

// The int32 sums of one activation row x against `rows` (<= kRows) weight rows starting at w.
inline void dot_rows(const int8_t* x, const int8_t* w, int64_t k, int64_t rows, int32_t* out) {
  int64_t body = 0;
#if defined(__AVX2__)
  body = k / kVec * kVec;
  if (rows == kRows) {
    vec_t a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    const int8_t *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    for (int64_t c = 0; c < body; c += kVec) {
      const vec_t xv = vload(x + c);
      a0 = vdot(a0, xv, vload(w0 + c));
      a1 = vdot(a1, xv, vload(w1 + c));
      a2 = vdot(a2, xv, vload(w2 + c));
      a3 = vdot(a3, xv, vload(w3 + c));
    }
    out[0] = vsum(a0), out[1] = vsum(a1), out[2] = vsum(a2), out[3] = vsum(a3);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      vec_t a = vzero();
      for (int64_t c = 0; c < body; c += kVec) a = vdot(a, vload(x + c), vload(w + r * k + c));
      out[r] = vsum(a);
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r) out[r] = 0;
#endif
  for (int64_t r = 0; r < rows; ++r) out[r] += dot_tail(x, w + r * k, body, k);
}

// Row m of x [M, K] -> int8 q[m] and its scale amax / 127 (1 for an all-zero row, whose q is all zeros).
template <typename T>
void quantize_rows(const at::Tensor& x, int8_t* q, float* scales) {
  using S = storage_t<T>;
  const int64_t m = x.size(0), k = x.size(1);
  const S* xp = raw(x.data_ptr<T>());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const S* row = xp + i * k;
      float amax = 0.0f;
      for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(to_f<T>(row[c])));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      scales[i] = amax > 0.0f ? amax / 127.0f : 1.0f;
      int8_t* qr = q + i * k;
      for (int64_t c = 0; c < k; ++c) qr[c] = static_cast<int8_t>(std::nearbyint(to_f<T>(row[c]) * inv));
    }
  });
}

// Each task owns a run of weight-row blocks of wq [N, K] and streams them once, meeting every one of the M activation
// rows while the block is in L1 (prefill's batch reuses each weight byte M times): dot(i, r0, rows, sums) fills the
// block's Acc sums for row i, emit(i, r0, rows, sums) writes them.
template <typename Acc, typename Dot, typename Emit>
void blocks_of_rows(const int8_t* wq, int64_t m, int64_t n, int64_t k, Dot&& dot, Emit&& emit) {
  const int64_t blocks = (n + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    Acc sums[kRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kRows, rows = std::min(kRows, n - r0);
      const int64_t ahead = std::min(n, r0 + 2 * kRows);
      prefetch_rows(wq + ahead * k, std::min(kRows, n - ahead) * k);
      for (int64_t i = 0; i < m; ++i) {
        dot(i, r0, rows, sums);
        emit(i, r0, rows, static_cast<const Acc*>(sums));
      }
    }
  });
}

// acc [M, N] int32 sums of xq [M, K] against wq [N, K], through blocks_of_rows.
template <typename F>
void for_each_block(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k, F&& emit) {
  blocks_of_rows<int32_t>(
      wq, m, n, k,
      [&](int64_t i, int64_t r0, int64_t rows, int32_t* sums) { dot_rows(xq + i * k, wq + r0 * k, k, rows, sums); },
      emit);
}

// Row m of x [M, K] -> int8 q[m] with one scale per `group` columns (the last group may be shorter): Q8_0's
// activation blocks, scale amax / 127 per block (1 for an all-zero block).
template <typename T>
void quantize_row_groups(const at::Tensor& x, int64_t group, int8_t* q, float* scales) {
  using S = storage_t<T>;
  const int64_t m = x.size(0), k = x.size(1), groups = (k + group - 1) / group;
  const S* xp = raw(x.data_ptr<T>());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t c0 = g * group, c1 = std::min(k, c0 + group);
        const S* row = xp + i * k;
        float amax = 0.0f;
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(to_f<T>(row[c])));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        scales[i * groups + g] = amax > 0.0f ? amax / 127.0f : 1.0f;
        for (int64_t c = c0; c < c1; ++c) q[i * k + c] = static_cast<int8_t>(std::nearbyint(to_f<T>(row[c]) * inv));
      }
    }
  });
}

#if defined(__AVX2__)
// The exact int32 lane sums of one 32-byte group, |w| x (x * sign(w)) as in vdot (at most 4 * 128 * 127 per lane,
// so the lane converts to fp32 exactly).
inline __m256i group_dot32(__m256i x, __m256i w) {
  const __m256i aw = _mm256_sign_epi8(w, w);
  const __m256i sx = _mm256_sign_epi8(x, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, sx);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
#endif
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Q8_0's dot product of one activation row against `rows` (<= kRows) weight rows: each group's int32 sum is exact,
// then scaled by x_scale[g] * w_scale[row, g] and summed in fp32 (ggml's vec_dot_q8_0_q8_0). The AVX2 path keeps
// eight fp32 lanes per row and adds them once at the end, so its fp32 order differs from the scalar path's.
inline void group_dot_rows(const int8_t* x, const float* xs, const int8_t* w, const float* ws, int64_t k,
                           int64_t group, int64_t rows, float* out) {
  const int64_t groups = (k + group - 1) / group;
  int64_t full = 0;  // groups the vector path covers
#if defined(__AVX2__)
  if (group == 32) {
    full = k / 32;
    if (rows == kRows) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const int8_t *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
      const float *s0 = ws, *s1 = ws + groups, *s2 = ws + 2 * groups, *s3 = ws + 3 * groups;
      for (int64_t g = 0; g < full; ++g) {
        const int64_t c = g * 32;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c));
        const __m256 d = _mm256_set1_ps(xs[g]);
#define PDSERVE_GROUP_ROW(A, W, S)                                                                        \
  A = _mm256_fmadd_ps(                                                                                    \
      _mm256_cvtepi32_ps(group_dot32(xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + c)))), \
      _mm256_mul_ps(d, _mm256_set1_ps(S[g])), A)
        PDSERVE_GROUP_ROW(a0, w0, s0);
        PDSERVE_GROUP_ROW(a1, w1, s1);
        PDSERVE_GROUP_ROW(a2, w2, s2);
        PDSERVE_GROUP_ROW(a3, w3, s3);
#undef PDSERVE_GROUP_ROW
      }
      out[0] = hsum_ps(a0), out[1] = hsum_ps(a1), out[2] = hsum_ps(a2), out[3] = hsum_ps(a3);
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t g = 0; g < full; ++g) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * 32));
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + g * 32));
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot32(xv, wv)), _mm256_set1_ps(xs[g] * ws[r * groups + g]), a);
        }
        out[r] = hsum_ps(a);
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) out[r] = 0.0f;
  }
#else
  for (int64_t r = 0; r < rows; ++r) out[r] = 0.0f;
#endif
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = full; g < groups; ++g) {
      const int64_t c0 = g * group, c1 = std::min(k, c0 + group);
      const int32_t s = dot_tail(x + c0, w + r * k + c0, 0, c1 - c0);
      out[r] += static_cast<float>(s) * (xs[g] * ws[r * groups + g]);
    }
  }
}

void check_weight(const at::Tensor& x, const at::Tensor& wq, const char* what) {
  TORCH_CHECK(x.dim() == 2 && wq.dim() == 2 && x.size(1) == wq.size(1), what, ": x [M, K] and weight [N, K]");
  TORCH_CHECK(wq.scalar_type() == at::kChar, what, ": the weight must be int8");
}

}  // namespace

namespace pdserve_kernels {

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "quantize_per_token: x [M, K]");
  auto xc = x.contiguous();
  auto q = at::empty(xc.sizes(), xc.options().dtype(at::kChar));
  auto s = at::empty({xc.size(0)}, xc.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "quantize_per_token", [&] {
    quantize_rows<scalar_t>(xc, q.data_ptr<int8_t>(), s.data_ptr<float>());
  });
  return {q, s};
}

at::Tensor int8_matmul(const at::Tensor& xq, const at::Tensor& wq) {
  check_weight(xq, wq, "int8_matmul");
  TORCH_CHECK(xq.scalar_type() == at::kChar, "int8_matmul: x must be int8");
  TORCH_CHECK(xq.size(1) == 0 || xq.max().item<int8_t>() <= 127 && xq.min().item<int8_t>() >= -127,
              "int8_matmul: x must lie in [-127, 127]");
  auto x = xq.contiguous();
  auto w = wq.contiguous();
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  auto acc = at::empty({m, n}, x.options().dtype(at::kInt));
  int32_t* ap = acc.data_ptr<int32_t>();
  for_each_block(x.data_ptr<int8_t>(), w.data_ptr<int8_t>(), m, n, k,
                 [&](int64_t i, int64_t r0, int64_t rows, const int32_t* sums) {
                   for (int64_t r = 0; r < rows; ++r) ap[i * n + r0 + r] = sums[r];
                 });
  return acc;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias) {
  check_weight(x, wq, "int8_linear");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == wq.size(0),
              "int8_linear: one float32 weight scale per output row");
  auto [xq, xs] = quantize_per_token(x);
  auto w = wq.contiguous();
  auto ws = w_scale.contiguous();
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
  at::Tensor b;
  if (bias) b = bias->to(at::kFloat).contiguous();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const float* xsp = xs.data_ptr<float>();
  const float* wsp = ws.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    using S = storage_t<scalar_t>;
    S* yp = raw(y.data_ptr<scalar_t>());
    for_each_block(xq.data_ptr<int8_t>(), w.data_ptr<int8_t>(), m, n, k,
                   [&](int64_t i, int64_t r0, int64_t rows, const int32_t* sums) {
                     for (int64_t r = 0; r < rows; ++r) {
                       float v = static_cast<float>(sums[r]) * xsp[i] * wsp[r0 + r];
                       if (bp) v += bp[r0 + r];
                       yp[i * n + r0 + r] = from_f<scalar_t>(v);
                     }
                   });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> quantize_per_group(const at::Tensor& x, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && group > 0, "quantize_per_group: x [M, K] and a positive group size");
  auto xc = x.contiguous();
  const int64_t groups = (xc.size(1) + group - 1) / group;
  auto q = at::empty(xc.sizes(), xc.options().dtype(at::kChar));
  auto s = at::empty({xc.size(0), groups}, xc.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "quantize_per_group", [&] {
    quantize_row_groups<scalar_t>(xc, group, q.data_ptr<int8_t>(), s.data_ptr<float>());
  });
  return {q, s};
}

at::Tensor int8_linear_grouped(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale, int64_t group,
                               const std::optional<at::Tensor>& bias) {
  check_weight(x, wq, "int8_linear_grouped");
  TORCH_CHECK(group > 0, "int8_linear_grouped: a positive group size");
  const int64_t m = x.size(0), n = wq.size(0), k = x.size(1), groups = (k + group - 1) / group;
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 2 && w_scale.size(0) == n &&
                  w_scale.size(1) == groups,
              "int8_linear_grouped: float32 weight scales [N, ceil(K / group)]");
  auto [xq, xs] = quantize_per_group(x, group);
  auto w = wq.contiguous();
  auto ws = w_scale.contiguous();
  auto y = at::empty({m, n}, x.options());
  at::Tensor b;
  if (bias) b = bias->to(at::kFloat).contiguous();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const int8_t* wqp = w.data_ptr<int8_t>();
  const float* xsp = xs.data_ptr<float>();
  const float* wsp = ws.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear_grouped", [&] {
    using S = storage_t<scalar_t>;
    S* yp = raw(y.data_ptr<scalar_t>());
    blocks_of_rows<float>(
        wqp, m, n, k,
        [&](int64_t i, int64_t r0, int64_t rows, float* sums) {
          group_dot_rows(xqp + i * k, xsp + i * groups, wqp + r0 * k, wsp + r0 * groups, k, group, rows, sums);
        },
        [&](int64_t i, int64_t r0, int64_t rows, const float* sums) {
          for (int64_t r = 0; r < rows; ++r) {
            float v = sums[r];
            if (bp) v += bp[r0 + r];
            yp[i * n + r0 + r] = from_f<scalar_t>(v);
          }
        });
  });
  return y;
}

}  // namespace pdserve_kernels

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("quantize_per_token(Tensor x) -> (Tensor, Tensor)");
  m.impl("quantize_per_token", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::quantize_per_token));
  m.def("int8_matmul(Tensor xq, Tensor wq) -> Tensor");
  m.impl("int8_matmul", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::int8_matmul));
  m.def("int8_linear(Tensor x, Tensor wq, Tensor w_scale, Tensor? bias) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::int8_linear));
  m.def("quantize_per_group(Tensor x, int group) -> (Tensor, Tensor)");
  m.impl("quantize_per_group", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::quantize_per_group));
  m.def("int8_linear_grouped(Tensor x, Tensor wq, Tensor w_scale, int group, Tensor? bias) -> Tensor");
  m.impl("int8_linear_grouped", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::int8_linear_grouped));
}
