// W8A8 linear layers: int8 weights [N, K] with one fp32 scale per output row, activations quantised per row (token)
// to int8 on the fly, int32 sums, y = acc * x_scale[row] * w_scale[col] (+ bias), as vLLM's CPU backend computes
// compressed-tensors' "int8 dynamic per-token" layers. Integer sums are exact, so every path below (AVX512_VNNI,
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

inline void prefetch(const int8_t* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
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

// acc [M, N] int32 sums of xq [M, K] against wq [N, K]; each task owns a run of weight-row blocks and streams them
// once, meeting every activation row while the block is in L1 (prefill's batch reuses each weight byte M times).
template <typename F>
void for_each_block(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k, F&& emit) {
  const int64_t blocks = (n + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    int32_t sums[kRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kRows, rows = std::min(kRows, n - r0);
      const int64_t ahead = std::min(n, r0 + 2 * kRows);
      prefetch(wq + ahead * k, std::min(kRows, n - ahead) * k);
      for (int64_t i = 0; i < m; ++i) {
        dot_rows(xq + i * k, wq + r0 * k, k, rows, sums);
        emit(i, r0, rows, sums);
      }
    }
  });
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

}  // namespace pdserve_kernels

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("quantize_per_token(Tensor x) -> (Tensor, Tensor)");
  m.impl("quantize_per_token", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::quantize_per_token));
  m.def("int8_matmul(Tensor xq, Tensor wq) -> Tensor");
  m.impl("int8_matmul", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::int8_matmul));
  m.def("int8_linear(Tensor x, Tensor wq, Tensor w_scale, Tensor? bias) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::int8_linear));
}
