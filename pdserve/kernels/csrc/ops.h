// pdserve's CPU kernels as C++ functions, for kernels that call others without a trip through the dispatcher
// (decode_step.cpp). Each is the function behind the torch op of the same name (pdserve/kernels/__init__.py).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace pdserve_kernels {

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps);
void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
at::Tensor silu_mul(const at::Tensor& gate_up);
std::tuple<at::Tensor, at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                          const at::Tensor& context_lens, int64_t window,
                                                          double scale);
std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale);
void sum_in_order(const at::Tensor& rows, at::Tensor& out);
std::tuple<at::Tensor, at::Tensor> merge_partials(const at::Tensor& outs, const at::Tensor& lses);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias);
at::Tensor int8_linear_grouped(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& w_scale, int64_t group,
                               const std::optional<at::Tensor>& bias);

}  // namespace pdserve_kernels
