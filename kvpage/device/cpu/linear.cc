// Matrix products over few rows for XLA:CPU, as an XLA FFI handler: out = x @ w, fp32.
//
// XLA:CPU runs a product of a few dozen rows (a decode step's projections and MLP) on
// one core: splitting it would cost a thread wake-up per product, about as long as the
// product. `Linear` splits each product over kvpage's workers (`common.h`), whose
// helpers stay awake between the kernels of a step, so every product of a decode step
// runs on all cores.
//
// Each task computes a 32-column panel of the result for a chunk of up to 64 rows, 8
// rows at a time: 16 vector accumulators (8 rows x 2 vectors of columns) folded over
// the inner dimension, each step loading two vectors of one row of `w` and broadcasting
// one element of each of the 8 rows of `x`.
// Operands: x f32[M, K], w f32[K, N] with N a multiple of 32. Result: f32[M, N].

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvpage::F16;
using kvpage::kLanes;
using kvpage::Load;
using kvpage::Store;
using kvpage::Workers;

constexpr int64_t kPanel = 2 * kLanes;  // result columns a task computes
constexpr int64_t kChunkRows = 64;      // result rows a task computes, at most
constexpr int kBlockRows = 8;           // rows a micro-kernel holds

// out[0:R, 0:32] = x[0:R, :] @ w[:, 0:32]; rows `stride_x`, `stride_w` and
// `stride_out` floats apart.
template <int R>
inline void MicroKernel(const float* x, int64_t stride_x, const float* w, int64_t stride_w,
                        float* out, int64_t stride_out, int64_t inner) {
  F16 acc[R][2] = {};
  const float* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x + r * stride_x;
  for (int64_t i = 0; i < inner; ++i) {
    const F16 w0 = Load(w + i * stride_w), w1 = Load(w + i * stride_w + kLanes);
    for (int r = 0; r < R; ++r) {
      const float xi = rows[r][i];
      acc[r][0] += xi * w0;
      acc[r][1] += xi * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    Store(out + r * stride_out, acc[r][0]);
    Store(out + r * stride_out + kLanes, acc[r][1]);
  }
}

ffi::Error Linear(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || w_dims[0] != x_dims[1] ||
      w_dims[1] % kPanel != 0) {
    return ffi::Error::InvalidArgument(
        "linear: x must be [M, K] and w [K, N] with N a multiple of 32");
  }
  const int64_t rows = x_dims[0], inner = x_dims[1], columns = w_dims[1];
  const float* x_data = x.typed_data();
  const float* w_data = w.typed_data();
  float* out_data = out->typed_data();
  const int64_t panels = columns / kPanel;
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  Workers::Run(panels * chunks, [&](int64_t task) {
    const int64_t column = task % panels * kPanel;
    const int64_t end = std::min(rows, (task / panels + 1) * kChunkRows);
    const float* w_panel = w_data + column;
    auto block = [&](auto size, int64_t row) {
      MicroKernel<decltype(size)::value>(x_data + row * inner, inner, w_panel, columns,
                                         out_data + row * columns + column, columns, inner);
    };
    int64_t row = task / panels * kChunkRows;
    for (; row + kBlockRows <= end; row += kBlockRows) {
      block(std::integral_constant<int, kBlockRows>{}, row);
    }
    if (row + 4 <= end) block(std::integral_constant<int, 4>{}, row), row += 4;
    if (row + 2 <= end) block(std::integral_constant<int, 2>{}, row), row += 2;
    if (row < end) block(std::integral_constant<int, 1>{}, row);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvpageLinear, Linear,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
