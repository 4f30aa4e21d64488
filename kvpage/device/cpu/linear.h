// What the two linear kernels (`linear.cc`, fp32; `linear_amx.cc`, bf16x3) share: their
// FFI operands, checked.
//
// A call multiplies one x f32[M, K] by one or more weights w_i f32[K, N_i] (N_i a
// multiple of 32): the projections that read the same input (q, k and v; gate and up)
// in one call, so the input is read, and on AMX split, once. Plain calls return one
// result per weight, x @ w_i. SwiGLU calls take two weights of one shape and return
// silu(x @ w_gate) * (x @ w_up), so neither product is ever written out.

#ifndef KVPAGE_DEVICE_CPU_LINEAR_H_
#define KVPAGE_DEVICE_CPU_LINEAR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace kvpage {

namespace ffi = xla::ffi;

constexpr int64_t kColumnBlock = 32;  // weights' columns come in multiples of this

struct Products {
  struct Weight {
    const float* data;
    int64_t columns;
    float* out;  // [rows, columns]; SwiGLU: both weights name the one result
  };
  const float* x;
  int64_t rows, inner;
  std::vector<Weight> weights;
};

// Checks a call's operands; fills `products`.
inline ffi::Error ParseProducts(const char* kernel, bool swiglu, ffi::Buffer<ffi::F32> x,
                                ffi::RemainingArgs weights, ffi::RemainingRets results,
                                Products* products) {
  auto fail = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(kernel) + ": " + what);
  };
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return fail("x must be [rows, inner]");
  products->x = x.typed_data();
  products->rows = x_dims[0];
  products->inner = x_dims[1];
  products->weights.clear();
  if (weights.size() == 0) return fail("no weights");
  if (swiglu ? weights.size() != 2 || results.size() != 1
             : results.size() != weights.size()) {
    return fail(swiglu ? "SwiGLU takes two weights (gate, up) and gives one result"
                       : "one result per weight");
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    auto out = results.get<ffi::Buffer<ffi::F32>>(swiglu ? 0 : i);
    if (!w.has_value() || !out.has_value()) return fail("operands must be f32");
    const auto w_dims = w->dimensions(), out_dims = (*out)->dimensions();
    if (w_dims.size() != 2 || w_dims[0] != products->inner ||
        w_dims[1] % kColumnBlock != 0) {
      return fail("each weight must be [inner, N] with N a multiple of 32");
    }
    if (out_dims.size() != 2 || out_dims[0] != products->rows || out_dims[1] != w_dims[1]) {
      return fail("each result must be [rows, N]");
    }
    products->weights.push_back({w->typed_data(), w_dims[1], (*out)->typed_data()});
  }
  return ffi::Error::Success();
}

}  // namespace kvpage

#endif  // KVPAGE_DEVICE_CPU_LINEAR_H_
