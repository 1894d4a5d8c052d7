// The local arithmetic of the shared-memory collectives (pdserve/engine/comm.py, ShmComm) and of the DCP merge,
// each one pass instead of a torch op per rank: with TP 9 on two cores a rank's collectives were ~40% of its CPU,
// most of it dispatch. Built and loaded by pdserve/kernels/__init__.py.
//
// The sums go in rank order, one rounding per addition, as the torch loop they replace: the same bits on every rank
// and in every run. Reassociation (allowed for the other kernels) is switched off for this file.
#pragma GCC optimize("no-associative-math")

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// out = rows[0] + rows[1] + ... + rows[n - 1], left to right, each addition in torch's op math type (fp32 for the
// 16-bit floats) and rounded to T after it, as torch's add_ is
template <typename T>
void sum_kernel(const at::Tensor& rows, at::Tensor& out) {
  using acc_t = at::opmath_type<T>;
  const int64_t n = rows.size(0), m = rows.size(1), stride = rows.stride(0);
  const T* src = rows.data_ptr<T>();
  T* __restrict__ dst = out.data_ptr<T>();
  for (int64_t i = 0; i < m; ++i) dst[i] = src[i];
  for (int64_t r = 1; r < n; ++r) {
    const T* __restrict__ row = src + r * stride;
    for (int64_t i = 0; i < m; ++i) dst[i] = static_cast<T>(static_cast<acc_t>(dst[i]) + static_cast<acc_t>(row[i]));
  }
}

void sum_in_order(const at::Tensor& rows, at::Tensor& out) {
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1, "rows: [n, m], each row contiguous");
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows.size(1) && out.scalar_type() == rows.scalar_type(),
              "out: m contiguous values of the rows' dtype");
  AT_DISPATCH_ALL_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "sum_in_order",
                                  [&] { sum_kernel<scalar_t>(rows, out); });
}

// Partial attentions over disjoint key sets -> exact attention: outs [N, T, H, D] and lses [N, T, H] (float32, any
// strides with D contiguous) -> (out [T, H, D], lse [T, H]) as merge_attn_states computes them: lse = logsumexp
// over N, out = sum of exp(lse_n - lse) * out_n in order of n; where every partial is empty, 0 and -inf.
std::tuple<at::Tensor, at::Tensor> merge_partials(const at::Tensor& outs, const at::Tensor& lses) {
  TORCH_CHECK(outs.dim() == 4 && lses.dim() == 3, "outs [N, T, H, D], lses [N, T, H]");
  TORCH_CHECK(outs.scalar_type() == at::kFloat && lses.scalar_type() == at::kFloat, "float32 partials");
  TORCH_CHECK(outs.sizes().slice(0, 3) == lses.sizes() && outs.stride(3) == 1, "shapes");
  const int64_t N = outs.size(0), T = outs.size(1), H = outs.size(2), D = outs.size(3);
  auto out = at::empty({T, H, D}, outs.options());
  auto lse = at::empty({T, H}, lses.options());
  const float* op = outs.data_ptr<float>();
  const float* lp = lses.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  float* ldst = lse.data_ptr<float>();
  const int64_t on = outs.stride(0), ot = outs.stride(1), oh = outs.stride(2);
  const int64_t ln = lses.stride(0), lt = lses.stride(1), lh = lses.stride(2);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / H, h = item % H;
      float m = -kInf;
      for (int64_t n = 0; n < N; ++n) m = std::max(m, lp[n * ln + t * lt + h * lh]);
      float* o = dst + (t * H + h) * D;
      if (m == -kInf) {  // no partial holds a key
        std::fill(o, o + D, 0.f);
        ldst[t * H + h] = -kInf;
        continue;
      }
      float s = 0.f;
      for (int64_t n = 0; n < N; ++n) s += std::exp(lp[n * ln + t * lt + h * lh] - m);
      const float total = m + std::log(s);
      ldst[t * H + h] = total;
      std::fill(o, o + D, 0.f);
      for (int64_t n = 0; n < N; ++n) {
        const float w = std::exp(lp[n * ln + t * lt + h * lh] - total);  // 0 for an empty partial
        const float* src = op + n * on + t * ot + h * oh;
        for (int64_t d = 0; d < D; ++d) o[d] += w * src[d];
      }
    }
  });
  return {out, lse};
}

}  // namespace

namespace pdserve_kernels {  // the entry points for other kernels (ops.h)

void sum_in_order(const at::Tensor& rows, at::Tensor& out) { ::sum_in_order(rows, out); }

std::tuple<at::Tensor, at::Tensor> merge_partials(const at::Tensor& outs, const at::Tensor& lses) {
  return ::merge_partials(outs, lses);
}

}  // namespace pdserve_kernels

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("sum_in_order(Tensor rows, Tensor(a!) out) -> ()");
  m.def("merge_partials(Tensor outs, Tensor lses) -> (Tensor, Tensor)");
  m.impl("sum_in_order", c10::DispatchKey::CPU, TORCH_FN(sum_in_order));
  m.impl("merge_partials", c10::DispatchKey::CPU, TORCH_FN(merge_partials));
}
