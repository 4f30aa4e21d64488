// Matrix products of many rows on Intel AMX, in three bf16 passes: out = x @ w, with
// fp32 operands and result (JAX's `Precision.HIGH`, "bf16_3x").
//
// A prompt chunk's projections and MLP are products of thousands of rows, which
// XLA:CPU runs at about 300 GFLOP/s on two cores in fp32 (AVX-512). The AMX tile unit
// multiplies bf16 matrices with fp32 accumulation about ten times as fast, but one bf16
// pass keeps only 8 bits of each operand. Splitting each operand into a high and a low
// bf16 part (a = a_hi + a_lo, exact to about 16 bits) and summing the three products
// that matter (a_hi b_hi + a_hi b_lo + a_lo b_hi) gives results within ~1e-5 relative
// of fp32 — more accurate than TF32, JAX's default for fp32 products on GPUs — at
// about twice XLA:CPU's fp32 speed.
//
// The layout. Each weight is split and packed once per call, by 32-column blocks, into
// 1 KB tiles in AMX's pair-interleaved ("VNNI") order: [column block][part][k step of
// 32][16-column half][16 row pairs][16 columns][2]. Each task then takes a chunk of up
// to 128 rows: it splits them into its own buffer (which stays in cache), and for each
// 32-column block of each weight computes the chunk 32 rows at a time in four 16x16
// accumulator tiles (`Block`). Operands and results: `linear.h` (one x, one or more
// weights; SwiGLU).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "amx.h"
#include "common.h"
#include "linear.h"
#include "variant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The variant's namespace (variant.h): its functions' names say which variant they are.
namespace kvpage {
inline namespace KVPAGE_VARIANT_NAMESPACE {
namespace {

#ifdef KVPAGE_AMX

constexpr int64_t kChunkRows = 128;  // rows a task computes, at most

using kvpage::amx::Block;
using kvpage::amx::ConfigureTiles;
using kvpage::amx::kBlock;
using kvpage::amx::kStep;
using kvpage::amx::kTile;
using kvpage::amx::LoadPartial;
using kvpage::amx::PackBlock;
using kvpage::amx::RequestAmx;
using kvpage::amx::Split;

// Rows [row0, row0 + rows) of every product, rows <= kChunkRows. `packed[i]`: weight
// i's packed blocks.
template <bool kSwiglu>
void Chunk(const kvpage::Products& p, int64_t steps, const std::vector<uint16_t*>& packed,
           int64_t row0, int64_t rows) {
  // The chunk's rows, split: [part][kChunkRows][steps * 32], zero-padded.
  thread_local std::vector<uint16_t> parts;
  const int64_t width = steps * kStep, padded_rows = (rows + kBlock - 1) / kBlock * kBlock;
  parts.resize(2 * kChunkRows * width);
  uint16_t* high = parts.data();
  uint16_t* low = high + kChunkRows * width;
  for (int64_t r = 0; r < padded_rows; ++r) {
    const float* row = p.x + (row0 + r) * p.inner;
    // RMSNorm: x * rsqrt(mean(x^2) + eps), times the scale.
    float inverse = 1.0f;
    if (p.norm_scale != nullptr && r < rows) {
      __m512 squares = _mm512_setzero_ps();
      for (int64_t k = 0; k < p.inner; k += 16) {
        const __m512 value = LoadPartial(row + k, p.inner - k);
        squares = _mm512_fmadd_ps(value, value, squares);
      }
      inverse = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / p.inner + p.norm_eps);
    }
    for (int64_t k = 0; k < width; k += 16) {
      __m512 value = r < rows && k < p.inner ? LoadPartial(row + k, p.inner - k)
                                             : _mm512_setzero_ps();
      if (p.norm_scale != nullptr && k < p.inner) {
        value = _mm512_mul_ps(LoadPartial(p.norm_scale + k, p.inner - k),
                              _mm512_mul_ps(value, _mm512_set1_ps(inverse)));
      }
      __m256i h, l;
      Split(value, &h, &l);
      _mm256_storeu_si256((__m256i*)(high + r * width + k), h);
      _mm256_storeu_si256((__m256i*)(low + r * width + k), l);
    }
  }
  ConfigureTiles();
  const int64_t block_floats = 2 * steps * 2 * kTile;
  // Blocks of results that do not go straight to their place: a partial row block, or
  // SwiGLU's two products.
  alignas(64) float gate[kBlock * kBlock], up[kBlock * kBlock];
  for (size_t i = 0; i < (kSwiglu ? 1 : p.weights.size()); ++i) {
    const auto& w = p.weights[i];
    for (int64_t block = 0; block < w.columns / kBlock; ++block) {
      const uint16_t* w_block = packed[i] + block * block_floats;
      for (int64_t r = 0; r < padded_rows; r += kBlock) {
        float* place = w.out + (row0 + r) * w.columns + block * kBlock;
        const int64_t valid = std::min(kBlock, rows - r);
        const uint16_t* x_high = high + r * width;
        const uint16_t* x_low = low + r * width;
        if (kSwiglu) {
          Block(x_high, x_low, width, steps, w_block, gate, kBlock);
          Block(x_high, x_low, width, steps, packed[1] + block * block_floats, up, kBlock);
          for (int64_t row = 0; row < valid; ++row) {
            for (int64_t c = 0; c < kBlock; c += 16) {
              kvpage::Store(place + row * w.columns + c,
                            kvpage::Silu(kvpage::Load(gate + row * kBlock + c)) *
                                kvpage::Load(up + row * kBlock + c));
            }
          }
        } else if (p.residual != nullptr) {
          Block(x_high, x_low, width, steps, w_block, gate, kBlock);
          const float* add = p.residual + (row0 + r) * w.columns + block * kBlock;
          for (int64_t row = 0; row < valid; ++row) {
            for (int64_t c = 0; c < kBlock; c += 16) {
              kvpage::Store(place + row * w.columns + c,
                            kvpage::Load(add + row * w.columns + c) +
                                kvpage::Load(gate + row * kBlock + c));
            }
          }
        } else if (valid == kBlock) {
          Block(x_high, x_low, width, steps, w_block, place, w.columns);
        } else {
          Block(x_high, x_low, width, steps, w_block, gate, kBlock);
          for (int64_t row = 0; row < valid; ++row) {
            std::memcpy(place + row * w.columns, gate + row * kBlock, kBlock * sizeof(float));
          }
        }
      }
    }
  }
  _tile_release();  // a released tile state costs nothing at a context switch
}

template <bool kSwiglu>
ffi::Error LinearBf16x3(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                        ffi::RemainingRets results, int64_t norm, float norm_eps,
                        int64_t residual) {
  kvpage::Products p;
  if (ffi::Error error = kvpage::ParseProducts(kSwiglu ? "swiglu_bf16x3" : "linear_bf16x3",
                                               kSwiglu, x, args, results, &p, norm != 0,
                                               norm_eps, residual != 0);
      error.failure()) {
    return error;
  }
  if (!RequestAmx()) return ffi::Error::Internal("linear_bf16x3: the OS refused AMX");
  const int64_t steps = (p.inner + kStep - 1) / kStep, block_floats = 2 * steps * 2 * kTile;
  // Every weight's packed blocks, in the caller's buffer (one call at a time per
  // thread), and the list of (weight, block) to pack.
  thread_local std::vector<uint16_t> buffer;
  std::vector<std::pair<int64_t, int64_t>> blocks;
  int64_t total = 0;
  for (size_t i = 0; i < p.weights.size(); ++i) {
    for (int64_t b = 0; b < p.weights[i].columns / kBlock; ++b) blocks.emplace_back(i, b);
    total += p.weights[i].columns / kBlock * block_floats;
  }
  buffer.resize(total);
  std::vector<uint16_t*> packed;
  for (size_t i = 0, at = 0; i < p.weights.size(); ++i) {
    packed.push_back(buffer.data() + at);
    at += p.weights[i].columns / kBlock * block_floats;
  }
  kvpage::Workers::Run(blocks.size(), [&](int64_t task) {
    const auto [i, block] = blocks[task];
    PackBlock(p.weights[i].data, p.inner, p.weights[i].columns, steps, block, packed[i]);
  });
  kvpage::Workers::Run((p.rows + kChunkRows - 1) / kChunkRows, [&](int64_t chunk) {
    const int64_t row0 = chunk * kChunkRows;
    Chunk<kSwiglu>(p, steps, packed, row0, std::min(kChunkRows, p.rows - row0));
  });
  return ffi::Error::Success();
}

#else  // the avx2 and avx512 variants: no AMX

template <bool kSwiglu>
ffi::Error LinearBf16x3(ffi::Buffer<ffi::F32>, ffi::RemainingArgs, ffi::RemainingRets, int64_t,
                        float, int64_t) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "linear_bf16x3: only the library's amx variant runs it");
}

#endif

}  // namespace

// x, [norm scale], [residual], weights...; results; whether there is a norm (and its
// epsilon) and a residual.
#define KVPAGE_AMX_LINEAR_BINDING                                                          \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Buffer<ffi::F32>>()                                                    \
      .RemainingArgs()                                                                 \
      .RemainingRets()                                                                 \
      .Attr<int64_t>("norm")                                                           \
      .Attr<float>("norm_eps")                                                         \
      .Attr<int64_t>("residual")

// Each named for its variant (`KvpageLinearBf16x3_amx`, ...; variant.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(KVPAGE_HANDLER(KvpageLinearBf16x3), LinearBf16x3<false>,
                              KVPAGE_AMX_LINEAR_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KVPAGE_HANDLER(KvpageSwigluBf16x3), LinearBf16x3<true>,
                              KVPAGE_AMX_LINEAR_BINDING);

}  // namespace KVPAGE_VARIANT_NAMESPACE
}  // namespace kvpage
