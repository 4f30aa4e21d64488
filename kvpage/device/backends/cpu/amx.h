// What kvpage's AMX kernels share (`linear_amx.cc`, and the prompt-chunk attention in
// `paged_attention.cc`): the tile setup, operands split into high and low bf16 parts
// (three bf16 passes: JAX's `Precision.HIGH`, "bf16_3x"), the pair-interleaved layout
// of a right-hand operand, and the 32x32 block product.
//
// Defines KVPAGE_AMX where the variant is compiled for AMX (bf16 tiles) and
// AVX512-BF16 (the amx variant, `variant.h`); the rest of this header exists only then.

#ifndef KVPAGE_DEVICE_CPU_AMX_H_
#define KVPAGE_DEVICE_CPU_AMX_H_

#include "variant.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVPAGE_AMX 1

// GCC 12's AVX-512 intrinsics leave operands undefined on purpose (`__Y = __Y`), which
// its -Wmaybe-uninitialized reports wherever they are inlined (GCC bug 105593, fixed in
// GCC 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

#include <cstdint>

// dispatch.cc: 1 where this CPU has the AMX variant's instructions and Linux grants this
// process the tile registers (which it hands only to a process that asks for them).
extern "C" int KvpageAmxAvailable();

namespace kvpage {
inline namespace KVPAGE_VARIANT_NAMESPACE {
namespace amx {

constexpr int64_t kBlock = 32;       // result rows and columns one tile pass computes
constexpr int64_t kStep = 32;        // inner elements one tile multiply folds
constexpr int64_t kTile = 512;       // bf16 elements in one packed tile of w (1 KB)
static_assert(limits::kBf16x3HeadDimMultiple % kStep == 0,
              "bf16x3 attention takes head sizes of whole tile steps (limits.py)");
static_assert(limits::kPanel % kBlock == 0, "weights come in whole column blocks (limits.py)");

// Whether this process may use the tile registers (asks Linux for them once).
inline bool RequestAmx() { return KvpageAmxAvailable() != 0; }

// Tiles 0-3: 16x16 fp32 accumulators; 4-5: 16 rows x 32 bf16 of x; 6-7: 16 row pairs
// x 16 columns of w.
inline void ConfigureTiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
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

// Packs column block `block` of w [inner, columns] (rows padded with zeros to `steps` *
// 32) into `packed`'s tiles for that block: [part][k step][16-column half][16 row
// pairs][16 columns][2].
inline void PackBlock(const float* w, int64_t inner, int64_t columns, int64_t steps, int64_t block,
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

// A 32x32 block of results, to `to` (rows `to_stride` floats apart): the 32 split rows
// at `high` / `low` (rows `width` bf16 apart) times one packed column block.
inline void Block(const uint16_t* high, const uint16_t* low, int64_t width, int64_t steps,
           const uint16_t* w_block, float* to, int64_t to_stride) {
  const uint16_t* w_high = w_block;
  const uint16_t* w_low = w_block + steps * 2 * kTile;
  const int64_t stride = width * 2;  // bytes between rows of a part
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // Per k step, 8 tile loads for 12 multiplies: the rows' high part with w's low part,
  // then w's high part, then the rows' low part with w's high part still in place.
  // Loads are spread between the multiplies that free their tile (AMX does not rename
  // tiles): faster than loading each pair before its four multiplies, and a tile
  // load costs about as long as a multiply here, so loads bound the kernel (9.6 against
  // 11.4 ns a multiply, with every operand in L1).
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t k = step * kStep, at = step * 2 * kTile;
    _tile_loadd(4, high + k, stride);
    _tile_loadd(6, w_low + at, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w_low + at + kTile, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, high + 16 * width + k, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(6, w_high + at, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, w_high + at + kTile, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(4, low + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, low + 16 * width + k, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t bytes = to_stride * 4;
  _tile_stored(0, to, bytes);
  _tile_stored(1, to + 16, bytes);
  _tile_stored(2, to + 16 * to_stride, bytes);
  _tile_stored(3, to + 16 * to_stride + 16, bytes);
}

}  // namespace amx
}  // namespace KVPAGE_VARIANT_NAMESPACE
}  // namespace kvpage

#endif  // AMX
#endif  // KVPAGE_DEVICE_CPU_AMX_H_
