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
// The layout. `w` is split and packed once per call, by 32-column blocks, into 1 KB
// tiles in AMX's pair-interleaved ("VNNI") order: [column block][part][k step of 32]
// [16-column half][16 row pairs][16 columns][2]. Each task then takes a chunk of up
// to 128 rows: it splits them into its own buffer (which stays in cache), and for each
// 32-column block computes the chunk 32 rows at a time in four 16x16 accumulator
// tiles. Each k step loads the rows' high part with the block's high then low part,
// and the rows' low part with the block's high part.
// Operands: x f32[M, K], w f32[K, N] with N a multiple of 32. Result: f32[M, N].

#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVPAGE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

#ifdef KVPAGE_AMX

constexpr int64_t kBlock = 32;       // result rows and columns one tile pass computes
constexpr int64_t kStep = 32;        // inner elements one tile multiply folds
constexpr int64_t kChunkRows = 128;  // rows a task computes, at most
constexpr int64_t kTile = 512;       // bf16 elements in one packed tile of w (1 KB)

// Linux hands the AMX tile registers only to a process that asks for them.
bool RequestAmx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Tiles 0-3: 16x16 fp32 accumulators; 4-5: 16 rows x 32 bf16 of x; 6-7: 16 row pairs
// x 16 columns of w.
void ConfigureTiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// Accumulators 0-3 += the 2 x 2 products of x's tiles 4-5 and w's tiles 6-7.
inline void MultiplyTiles() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

inline __m512 Widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// The high and low bf16 parts of 16 floats, rounded to nearest.
inline void Split(__m512 value, __m256i* high, __m256i* low) {
  *high = (__m256i)_mm512_cvtneps_pbh(value);
  *low = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(value, Widen(*high)));
}

// 16 floats from `row`, zeros past `count`.
inline __m512 LoadPartial(const float* row, int64_t count) {
  return count >= 16 ? _mm512_loadu_ps(row)
                     : _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), row);
}

// Packs column block `block` of w (rows `inner`, padded with zeros to `steps` * 32).
void PackBlock(const float* w, int64_t inner, int64_t columns, int64_t steps, int64_t block,
               uint16_t* packed) {
  uint16_t* high = packed + block * 2 * steps * 2 * kTile;
  uint16_t* low = high + steps * 2 * kTile;
  for (int64_t k = 0; k < steps * kStep; k += 2) {
    for (int half = 0; half < 2; ++half) {
      const int64_t column = block * kBlock + half * 16;
      const __m512 zero = _mm512_setzero_ps();
      const __m512 even = k < inner ? _mm512_loadu_ps(w + k * columns + column) : zero;
      const __m512 odd = k + 1 < inner ? _mm512_loadu_ps(w + (k + 1) * columns + column) : zero;
      __m256i even_high, even_low, odd_high, odd_low;
      Split(even, &even_high, &even_low);
      Split(odd, &odd_high, &odd_low);
      const int64_t at = ((k / kStep) * 2 + half) * kTile + (k % kStep) / 2 * 32;
      auto interleave = [](__m256i first, __m256i second) {
        return _mm512_or_si512(_mm512_cvtepu16_epi32(first),
                               _mm512_slli_epi32(_mm512_cvtepu16_epi32(second), 16));
      };
      _mm512_storeu_si512(high + at, interleave(even_high, odd_high));
      _mm512_storeu_si512(low + at, interleave(even_low, odd_low));
    }
  }
}

// out[row0 : row0 + rows] = x[row0 : ...] @ w, for rows <= kChunkRows.
void Chunk(const float* x, int64_t inner, int64_t columns, int64_t steps,
           const uint16_t* packed, int64_t row0, int64_t rows, float* out) {
  // The chunk's rows, split: [part][kChunkRows][steps * 32], zero-padded.
  thread_local std::vector<uint16_t> parts;
  const int64_t width = steps * kStep, padded_rows = (rows + kBlock - 1) / kBlock * kBlock;
  parts.resize(2 * kChunkRows * width);
  uint16_t* high = parts.data();
  uint16_t* low = high + kChunkRows * width;
  for (int64_t r = 0; r < padded_rows; ++r) {
    for (int64_t k = 0; k < width; k += 16) {
      const __m512 value = r < rows && k < inner
                               ? LoadPartial(x + (row0 + r) * inner + k, inner - k)
                               : _mm512_setzero_ps();
      __m256i h, l;
      Split(value, &h, &l);
      _mm256_storeu_si256((__m256i*)(high + r * width + k), h);
      _mm256_storeu_si256((__m256i*)(low + r * width + k), l);
    }
  }
  ConfigureTiles();
  alignas(64) float spill[kBlock * kBlock];  // the last, partial row block's results
  const int64_t stride = width * 2;            // bytes between rows of a part
  for (int64_t block = 0; block < columns / kBlock; ++block) {
    const uint16_t* w_high = packed + block * 2 * steps * 2 * kTile;
    const uint16_t* w_low = w_high + steps * 2 * kTile;
    for (int64_t r = 0; r < padded_rows; r += kBlock) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t step = 0; step < steps; ++step) {
        const int64_t k = step * kStep, at = step * 2 * kTile;
        _tile_loadd(4, high + r * width + k, stride);
        _tile_loadd(5, high + (r + 16) * width + k, stride);
        _tile_loadd(6, w_high + at, 64);
        _tile_loadd(7, w_high + at + kTile, 64);
        MultiplyTiles();
        _tile_loadd(6, w_low + at, 64);
        _tile_loadd(7, w_low + at + kTile, 64);
        MultiplyTiles();
        _tile_loadd(4, low + r * width + k, stride);
        _tile_loadd(5, low + (r + 16) * width + k, stride);
        _tile_loadd(6, w_high + at, 64);
        _tile_loadd(7, w_high + at + kTile, 64);
        MultiplyTiles();
      }
      const bool whole = r + kBlock <= rows;
      float* to = whole ? out + (row0 + r) * columns + block * kBlock : spill;
      const int64_t to_stride = (whole ? columns : kBlock) * 4;
      _tile_stored(0, to, to_stride);
      _tile_stored(1, to + 16, to_stride);
      _tile_stored(2, to + 16 * to_stride / 4, to_stride);
      _tile_stored(3, to + 16 * to_stride / 4 + 16, to_stride);
      if (!whole) {
        for (int64_t i = 0; r + i < rows; ++i) {
          std::memcpy(out + (row0 + r + i) * columns + block * kBlock, spill + i * kBlock,
                      kBlock * sizeof(float));
        }
      }
    }
  }
  _tile_release();  // a released tile state costs nothing at a context switch
}

ffi::Error LinearBf16x3(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || w_dims[0] != x_dims[1] ||
      w_dims[1] % kBlock != 0) {
    return ffi::Error::InvalidArgument(
        "linear_bf16x3: x must be [M, K] and w [K, N] with N a multiple of 32");
  }
  if (!RequestAmx()) return ffi::Error::Internal("linear_bf16x3: the OS refused AMX");
  const int64_t rows = x_dims[0], inner = x_dims[1], columns = w_dims[1];
  const int64_t steps = (inner + kStep - 1) / kStep, blocks = columns / kBlock;
  const float* x_data = x.typed_data();
  const float* w_data = w.typed_data();
  float* out_data = out->typed_data();
  thread_local std::vector<uint16_t> packed;  // the caller's: one call at a time
  packed.resize(blocks * 2 * steps * 2 * kTile);
  uint16_t* packed_data = packed.data();
  kvpage::Workers::Run(blocks, [&](int64_t block) {
    PackBlock(w_data, inner, columns, steps, block, packed_data);
  });
  kvpage::Workers::Run((rows + kChunkRows - 1) / kChunkRows, [&](int64_t chunk) {
    const int64_t row0 = chunk * kChunkRows;
    Chunk(x_data, inner, columns, steps, packed_data, row0,
          std::min(kChunkRows, rows - row0), out_data);
  });
  return ffi::Error::Success();
}

#else  // no AMX in this build's target CPU

ffi::Error LinearBf16x3(ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                        ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Unimplemented("linear_bf16x3: built for a CPU without AMX");
}

#endif

}  // namespace

// 1 where this process can run `KvpageLinearBf16x3`: built for an AMX CPU, and the
// OS grants the tile registers.
extern "C" int KvpageAmxAvailable() {
#ifdef KVPAGE_AMX
  return RequestAmx() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvpageLinearBf16x3, LinearBf16x3,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
