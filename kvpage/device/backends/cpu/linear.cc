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
// Operands and results: `linear.h` (one x, one or more weights; SwiGLU).

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "linear.h"
#include "variant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The variant's namespace (variant.h): its functions' names say which variant they are.
namespace kvpage {
inline namespace KVPAGE_VARIANT_NAMESPACE {
namespace {

constexpr int64_t kPanel = 2 * kLanes;  // result columns a task computes
static_assert(kPanel == kvpage::limits::kPanel,
              "a task's panel is two vectors of columns (limits.py's PANEL)");
static_assert(kPanel == kvpage::kColumnBlock, "weights come in whole panels (linear.h)");
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

// Rows [row0, end) of one 32-column panel: out = x @ w, `stride_w` and `stride_out`
// floats between rows of w and of out.
void Panel(const float* x, int64_t inner, const float* w, int64_t stride_w, float* out,
           int64_t stride_out, int64_t row0, int64_t end) {
  auto block = [&](auto size, int64_t row) {
    MicroKernel<decltype(size)::value>(x + row * inner, inner, w, stride_w,
                                       out + (row - row0) * stride_out, stride_out, inner);
  };
  int64_t row = row0;
  for (; row + kBlockRows <= end; row += kBlockRows) {
    block(std::integral_constant<int, kBlockRows>{}, row);
  }
  if (row + 4 <= end) block(std::integral_constant<int, 4>{}, row), row += 4;
  if (row + 2 <= end) block(std::integral_constant<int, 2>{}, row), row += 2;
  if (row < end) block(std::integral_constant<int, 1>{}, row);
}

// Each task: one 32-column panel of one weight (SwiGLU: of both) for up to 64 rows.
template <bool kSwiglu>
ffi::Error Linear(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                  ffi::RemainingRets results) {
  kvpage::Products p;
  if (ffi::Error error = kvpage::ParseProducts(kSwiglu ? "swiglu" : "linear", kSwiglu, x,
                                               weights, results, &p);
      error.failure()) {
    return error;
  }
  // The panels of every weight in a row (SwiGLU: of the gate's, each with the up's).
  std::vector<std::pair<int64_t, int64_t>> panels;  // (weight, column)
  for (int64_t i = 0; i < (kSwiglu ? 1 : static_cast<int64_t>(p.weights.size())); ++i) {
    for (int64_t column = 0; column < p.weights[i].columns; column += kPanel) {
      panels.emplace_back(i, column);
    }
  }
  const int64_t num_panels = panels.size();
  const int64_t chunks = (p.rows + kChunkRows - 1) / kChunkRows;
  Workers::Run(num_panels * chunks, [&](int64_t task) {
    const auto [i, column] = panels[task % num_panels];
    const int64_t row0 = task / num_panels * kChunkRows;
    const int64_t end = std::min(p.rows, row0 + kChunkRows);
    const auto& w = p.weights[i];
    if (!kSwiglu) {
      Panel(p.x, p.inner, w.data + column, w.columns, w.out + row0 * w.columns + column,
            w.columns, row0, end);
      return;
    }
    float gate[kChunkRows * kPanel], up[kChunkRows * kPanel];
    Panel(p.x, p.inner, w.data + column, w.columns, gate, kPanel, row0, end);
    const auto& w_up = p.weights[1];
    Panel(p.x, p.inner, w_up.data + column, w.columns, up, kPanel, row0, end);
    for (int64_t r = 0; r < end - row0; ++r) {
      for (int64_t c = 0; c < kPanel; c += kLanes) {
        Store(w.out + (row0 + r) * w.columns + column + c,
              kvpage::Silu(Load(gate + r * kPanel + c)) * Load(up + r * kPanel + c));
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#define KVPAGE_LINEAR_BINDING                                    \
  ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().RemainingArgs().RemainingRets()

// Each named for its variant (`KvpageLinear_avx2`, ...; variant.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(KVPAGE_HANDLER(KvpageLinear), Linear<false>,
                              KVPAGE_LINEAR_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KVPAGE_HANDLER(KvpageSwiglu), Linear<true>,
                              KVPAGE_LINEAR_BINDING);

}  // namespace KVPAGE_VARIANT_NAMESPACE
}  // namespace kvpage
