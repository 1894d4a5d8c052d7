// One row through a linear layer (y = x W^T + b) from the weight as stored, [N, K] row-major. A decode step of
// batch 1 streams every weight once, and on a tensor-parallel rank's shard (a few hundred rows) oneDNN's per-call
// setup cost more than the streaming: this kernel reads four weight rows at a time while it prefetches the rows two
// blocks ahead, summing each row in 16 fp32 lanes and then across them, a fixed order. Built and loaded by
// pdserve/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "convert.h"
#include "ops.h"

namespace {

using pdserve_kernels::from_f;
using pdserve_kernels::prefetch_rows;
using pdserve_kernels::raw;
using pdserve_kernels::storage_t;
using pdserve_kernels::to_f;

constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;  // weight rows per block
constexpr int64_t kAhead = 2;  // blocks prefetched ahead

#ifdef __AVX512F__
// 16 weights of row w from element c (masked where fewer remain), as fp32
template <typename S>
inline __m512 load16(const S* w, __mmask16 m) {
  if constexpr (sizeof(S) == 4) {
    return m == 0xFFFF ? _mm512_loadu_ps(w) : _mm512_maskz_loadu_ps(m, w);
  } else {  // bfloat16 bits: the high half of an fp32
    const __m256i h = _mm256_maskz_loadu_epi16(m, w);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// Rows r0.. r0 + 3 of w (all four present): their four sums in 16 lanes each, interleaved so four streams are in
// flight at once.
template <typename S>
inline void four_rows(const float* xf, const S* w, int64_t k, float* out) {
  const S* w0 = w;
  const S* w1 = w0 + k;
  const S* w2 = w1 + k;
  const S* w3 = w2 + k;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int64_t body = k / kLanes * kLanes;
  const __mmask16 all = 0xFFFF, tail = static_cast<__mmask16>((1u << (k - body)) - 1);
  for (int64_t c = 0; c < body; c += kLanes) {
    const __m512 xv = _mm512_loadu_ps(xf + c);
    a0 = _mm512_fmadd_ps(xv, load16(w0 + c, all), a0);
    a1 = _mm512_fmadd_ps(xv, load16(w1 + c, all), a1);
    a2 = _mm512_fmadd_ps(xv, load16(w2 + c, all), a2);
    a3 = _mm512_fmadd_ps(xv, load16(w3 + c, all), a3);
  }
  if (tail) {
    const __m512 xv = _mm512_maskz_loadu_ps(tail, xf + body);
    a0 = _mm512_fmadd_ps(xv, load16(w0 + body, tail), a0);
    a1 = _mm512_fmadd_ps(xv, load16(w1 + body, tail), a1);
    a2 = _mm512_fmadd_ps(xv, load16(w2 + body, tail), a2);
    a3 = _mm512_fmadd_ps(xv, load16(w3 + body, tail), a3);
  }
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}
#endif

template <typename T>
void gemv_kernel(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, at::Tensor& y) {
  using S = storage_t<T>;
  const int64_t n = w.size(0), k = w.size(1), body = k / kLanes * kLanes;
  const S* xp = raw(x.data_ptr<T>());
  const S* wp = raw(w.data_ptr<T>());
  const S* bp = bias ? raw(bias->data_ptr<T>()) : nullptr;
  S* yp = raw(y.data_ptr<T>());
  const int64_t blocks = (n + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(k);
    for (int64_t i = 0; i < k; ++i) xf[i] = to_f<T>(xp[i]);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kRows, rows = std::min(kRows, n - r0);
      const int64_t ahead = std::min(n, r0 + kAhead * kRows);
      prefetch_rows(wp + ahead * k, std::min(kRows, n - ahead) * k);
#ifdef __AVX512F__
      if constexpr (sizeof(S) == 4 || std::is_same_v<T, c10::BFloat16>) {
        if (rows == kRows) {
          float sums[kRows];
          four_rows(xf.data(), wp + r0 * k, k, sums);
          for (int64_t r = 0; r < rows; ++r) yp[r0 + r] = from_f<T>(bp ? sums[r] + to_f<T>(bp[r0 + r]) : sums[r]);
          continue;
        }
      }
#endif
      float acc[kRows][kLanes] = {};
      for (int64_t r = 0; r < rows; ++r) {
        const S* wr = wp + (r0 + r) * k;
        float* a = acc[r];
        for (int64_t c = 0; c < body; c += kLanes) {
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) a[l] += xf[c + l] * to_f<T>(wr[c + l]);
        }
        for (int64_t c = body; c < k; ++c) a[c - body] += xf[c] * to_f<T>(wr[c]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float s = 0.0f;
        for (int64_t l = 0; l < kLanes; ++l) s += acc[r][l];
        if (bp) s += to_f<T>(bp[r0 + r]);
        yp[r0 + r] = from_f<T>(s);
      }
    }
  });
}

}  // namespace

namespace pdserve_kernels {  // the entry point for other kernels (ops.h)

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "gemv: x [1, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "gemv: x and weight of one dtype");
  auto xc = x.contiguous();
  auto w = weight.contiguous();
  at::Tensor b;
  if (bias) b = bias->contiguous();
  auto y = at::empty({1, w.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gemv", [&] {
    gemv_kernel<scalar_t>(xc, w, bias ? &b : nullptr, y);
  });
  return y;
}

}  // namespace pdserve_kernels

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("gemv", c10::DispatchKey::CPU, TORCH_FN(pdserve_kernels::gemv));
}
