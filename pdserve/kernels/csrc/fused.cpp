// The small ops of a decoder layer, each one pass over its rows instead of several torch ops: RMSNorm (with the
// residual add before it), rotary embedding in place on the fused q/k/v rows, SiLU(gate) * up; and greedy
// sampling's argmax with its log-probability. At batch 1 torch spends more time dispatching their pieces than
// computing them; at prefill they read and write each activation several times. Numbers as the torch path computes
// them (fp32 inside, rounded to the tensor's dtype where torch rounds), up to the order of the sums. Built and
// loaded by pdserve/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "convert.h"
#include "ops.h"
#include "exp_nonpositive.h"

namespace {

using pdserve_kernels::exp_nonpositive;
using pdserve_kernels::from_f;
using pdserve_kernels::raw;
using pdserve_kernels::storage_t;
using pdserve_kernels::to_f;

constexpr int64_t kGrainElems = 1 << 15;  // elements per parallel task: small steps stay on the calling thread

int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

// residual += delta (when given, rounded to T as torch's add is), then out = w * T(residual * rsqrt(mean(residual^2)
// + eps)): transformers' LlamaRMSNorm.
template <typename T>
void add_rms_norm_kernel(at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, at::Tensor& out, double eps) {
  using S = storage_t<T>;
  const int64_t n = x.size(0), h = x.size(1);
  S* xp = raw(x.data_ptr<T>());
  const S* dp = delta ? raw(delta->data_ptr<T>()) : nullptr;
  const S* wp = raw(w.data_ptr<T>());
  S* op = raw(out.data_ptr<T>());
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, grain_rows(h), [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t r = begin; r < end; ++r) {
      S* xr = xp + r * h;
      float ss = 0.0f;
      if (dp) {
        const S* dr = dp + r * h;
        for (int64_t i = 0; i < h; ++i) {
          const S s = from_f<T>(to_f<T>(xr[i]) + to_f<T>(dr[i]));
          xr[i] = s;
          row[i] = to_f<T>(s);
        }
      } else {
        for (int64_t i = 0; i < h; ++i) row[i] = to_f<T>(xr[i]);
      }
      for (int64_t i = 0; i < h; ++i) ss += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + e);
      S* orow = op + r * h;
      for (int64_t i = 0; i < h; ++i) orow[i] = from_f<T>(to_f<T>(wp[i]) * to_f<T>(from_f<T>(row[i] * inv)));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(), "weight");
  at::Tensor d;
  if (delta) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == x.sizes() && d.scalar_type() == x.scalar_type(), "delta: x's shape and dtype");
  }
  auto w = weight.contiguous();
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x, delta ? &d : nullptr, w, out, eps);
  });
  return {x, out};
}

// HF's rotate_half convention on the first `heads` heads of every row of qkv (the query and key heads), in place:
// x * cos + rotate_half(x) * sin with cos / sin [rows, head_dim].
template <typename T>
void rope_kernel(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t d) {
  using S = storage_t<T>;
  const int64_t n = qkv.size(0), stride = qkv.stride(0), half = d / 2;
  S* xp = raw(qkv.data_ptr<T>());
  const S* cp = raw(cos.data_ptr<T>());
  const S* sp = raw(sin.data_ptr<T>());
  at::parallel_for(0, n, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* c = cp + r * d;
      const S* s = sp + r * d;
      for (int64_t hh = 0; hh < heads; ++hh) {
        S* x = xp + r * stride + hh * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f<T>(x[i]), x2 = to_f<T>(x[i + half]);
          x[i] = from_f<T>(x1 * to_f<T>(c[i]) - x2 * to_f<T>(s[i]));
          x[i + half] = from_f<T>(x2 * to_f<T>(c[i + half]) + x1 * to_f<T>(s[i + half]));
        }
      }
    }
  });
}

void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * head_dim, "qkv: [rows, >= heads*D]");
  TORCH_CHECK(head_dim % 2 == 0, "an even head size");
  auto c = cos.reshape({qkv.size(0), head_dim}).contiguous();
  auto s = sin.reshape({qkv.size(0), head_dim}).contiguous();
  TORCH_CHECK(c.scalar_type() == qkv.scalar_type() && s.scalar_type() == qkv.scalar_type(), "cos / sin dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    rope_kernel<scalar_t>(qkv, c, s, heads, head_dim);
  });
}

// gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter], silu rounded to T before the product as torch does.
template <typename T>
void silu_mul_kernel(const at::Tensor& gu, at::Tensor& out) {
  using S = storage_t<T>;
  const int64_t n = gu.size(0), inter = out.size(1);
  const S* gp = raw(gu.data_ptr<T>());
  S* op = raw(out.data_ptr<T>());
  at::parallel_for(0, n, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* g = gp + r * 2 * inter;
      const S* u = g + inter;
      S* o = op + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float x = to_f<T>(g[i]);
        const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|): no overflow on either side
        const float sig = (x >= 0.0f ? 1.0f : e) / (1.0f + e);  // one division per value, vectorised
        o[i] = from_f<T>(to_f<T>(from_f<T>(x * sig)) * to_f<T>(u[i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up: [rows, 2 * inter]");
  auto gu = gate_up.contiguous();
  auto out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    silu_mul_kernel<scalar_t>(gu, out);
  });
  return out;
}

// Greedy sampling's pick: per row the first index of the maximum and its log-probability, -log(sum(exp(x - max))),
// in two passes over the row instead of log_softmax (which writes a [rows, vocab] copy) followed by argmax.
std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0, "float32 [rows, vocab]");
  auto x = logits.contiguous();
  const int64_t n = x.size(0), v = x.size(1);
  auto tokens = at::empty({n}, x.options().dtype(at::kLong));
  auto lps = at::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      float m = row[0];
      for (int64_t i = 1; i < v; ++i) m = row[i] > m ? row[i] : m;  // vectorised; NaNs are caught below
      int64_t best = 0;
      while (best < v && !(row[best] == m)) ++best;
      float sum = 0.0f;
      for (int64_t i = 0; i < v; ++i) sum += exp_nonpositive(row[i] - m);
      if (std::isnan(sum) || best == v) {  // a NaN or +inf in the row: argmax picks the first NaN, if any
        for (int64_t i = 0; i < v; ++i) {
          if (std::isnan(row[i])) {
            best = i;
            break;
          }
        }
        sum = std::numeric_limits<float>::quiet_NaN();
      }
      tp[r] = best;
      lp[r] = -std::log(sum);
    }
  });
  return {tokens, lps};
}

}  // namespace

namespace pdserve_kernels {  // the entry points for other kernels (ops.h)

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps) {
  return ::add_rms_norm(std::move(x), delta, weight, eps);
}

void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  ::rope_(std::move(qkv), cos, sin, heads, head_dim);
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return ::silu_mul(gate_up); }

}  // namespace pdserve_kernels

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> (Tensor(a!), Tensor)");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rope_", c10::DispatchKey::CPU, TORCH_FN(rope_));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("greedy_pick(Tensor logits) -> (Tensor, Tensor)");
  m.impl("greedy_pick", c10::DispatchKey::CPU, TORCH_FN(greedy_pick));
}
