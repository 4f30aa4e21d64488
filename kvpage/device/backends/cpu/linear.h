// What the two linear kernels (`linear.cc`, fp32; `linear_amx.cc`, bf16x3) share: their
// FFI operands, checked.
//
// A call multiplies one x f32[M, K] by one or more weights w_i f32[K, N_i] (N_i a
// multiple of 32): the projections that read the same input (q, k and v; gate and up)
// in one call, so the input is read, and on AMX split, once. Plain calls return one
// result per weight, x @ w_i. SwiGLU calls take two weights of one shape and return
// silu(x @ w_gate) * (x @ w_up), so neither product is ever written out. The AMX
// kernels also take the RMSNorm before the products (x's rows normalized and scaled as
// they are split) and the residual added to a single product, so neither is a pass of
// its own.

#ifndef KVPAGE_DEVICE_CPU_LINEAR_H_
#define KVPAGE_DEVICE_CPU_LINEAR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "variant.h"
#include "xla/ffi/api/ffi.h"

namespace kvpage {
inline namespace KVPAGE_VARIANT_NAMESPACE {

namespace ffi = xla::ffi;

// Weights' columns come in multiples of this (limits.py's PANEL).
constexpr int64_t kColumnBlock = limits::kPanel;

struct Products {
  struct Weight {
    const float* data;
    int64_t columns;
    float* out;  // [rows, columns]; SwiGLU: both weights name the one result
  };
  const float* x;
  int64_t rows, inner;
  std::vector<Weight> weights;
  // Optional (AMX kernels): x's rows RMS-normalized and scaled by `norm_scale` [inner]
  // before the products; `residual` [rows, N] added to a single product's result.
  const float* norm_scale = nullptr;
  float norm_eps = 0.0f;
  const float* residual = nullptr;
};

// Checks a call's operands; fills `products`. With `norm` (`residual`), the first
// remaining argument (the next) is the norm's scale (the residual), then the weights.
inline ffi::Error ParseProducts(const char* kernel, bool swiglu, ffi::Buffer<ffi::F32> x,
                                ffi::RemainingArgs args, ffi::RemainingRets results,
                                Products* products, bool norm = false, float norm_eps = 0.0f,
                                bool residual = false) {
  auto fail = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(kernel) + ": " + what);
  };
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return fail("x must be [rows, inner]");
  products->x = x.typed_data();
  products->rows = x_dims[0];
  products->inner = x_dims[1];
  products->weights.clear();
  const size_t first = (norm ? 1 : 0) + (residual ? 1 : 0);  // the first weight's index
  if (args.size() <= first) return fail("no weights");
  const size_t num_weights = args.size() - first;
  if (swiglu ? num_weights != 2 || results.size() != 1 || residual
             : results.size() != num_weights || (residual && num_weights != 1)) {
    return fail(swiglu ? "SwiGLU takes two weights (gate, up), gives one result and adds "
                         "no residual"
                       : "one result per weight, and a residual only to a single one");
  }
  if (norm) {
    auto scale = args.get<ffi::Buffer<ffi::F32>>(0);
    if (!scale.has_value() || scale->dimensions().size() != 1 ||
        scale->dimensions()[0] != products->inner) {
      return fail("the norm's scale must be f32[inner]");
    }
    products->norm_scale = scale->typed_data();
    products->norm_eps = norm_eps;
  }
  auto add = args.get<ffi::Buffer<ffi::F32>>(norm ? 1 : 0);  // the residual, if any
  if (residual) {
    if (!add.has_value()) return fail("the residual must be f32[rows, N]");
    products->residual = add->typed_data();
  }
  for (size_t i = 0; i < num_weights; ++i) {
    auto w = args.get<ffi::Buffer<ffi::F32>>(first + i);
    auto out = results.get<ffi::Buffer<ffi::F32>>(swiglu ? 0 : i);
    if (!w.has_value() || !out.has_value()) return fail("operands must be f32");
    const auto w_dims = w->dimensions(), out_dims = (*out)->dimensions();
    if (w_dims.size() != 2 || w_dims[0] != products->inner ||
        w_dims[1] % kColumnBlock != 0) {
      return fail("each weight must be [inner, N] with N a multiple of " +
                  std::to_string(kColumnBlock));
    }
    if (out_dims.size() != 2 || out_dims[0] != products->rows || out_dims[1] != w_dims[1]) {
      return fail("each result must be [rows, N]");
    }
    products->weights.push_back({w->typed_data(), w_dims[1], (*out)->typed_data()});
  }
  if (residual) {
    const auto dims = add->dimensions();
    if (dims.size() != 2 || dims[0] != products->rows ||
        dims[1] != products->weights[0].columns) {
      return fail("the residual must be f32[rows, N]");
    }
  }
  return ffi::Error::Success();
}

}  // namespace KVPAGE_VARIANT_NAMESPACE
}  // namespace kvpage

#endif  // KVPAGE_DEVICE_CPU_LINEAR_H_
