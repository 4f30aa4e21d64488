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
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"
#include "linear.h"
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

// Packs column block `block` of w (rows `inner`, padded with zeros to `steps` * 32)
// into `packed`'s tiles for that block.
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

// A 32x32 block of results, to `to` (rows `to_stride` floats apart): the 32 split rows
// at `high` / `low` (rows `width` bf16 apart) times one packed column block.
void Block(const uint16_t* high, const uint16_t* low, int64_t width, int64_t steps,
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
    for (int64_t k = 0; k < width; k += 16) {
      const __m512 value = r < rows && k < p.inner
                               ? LoadPartial(p.x + (row0 + r) * p.inner + k, p.inner - k)
                               : _mm512_setzero_ps();
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
ffi::Error LinearBf16x3(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                        ffi::RemainingRets results) {
  kvpage::Products p;
  if (ffi::Error error = kvpage::ParseProducts(kSwiglu ? "swiglu_bf16x3" : "linear_bf16x3",
                                               kSwiglu, x, weights, results, &p);
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

#else  // no AMX in this build's target CPU

template <bool kSwiglu>
ffi::Error LinearBf16x3(ffi::Buffer<ffi::F32>, ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "linear_bf16x3: built for a CPU without AMX");
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

#define KVPAGE_LINEAR_BINDING \
  ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().RemainingArgs().RemainingRets()

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvpageLinearBf16x3, LinearBf16x3<false>, KVPAGE_LINEAR_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvpageSwigluBf16x3, LinearBf16x3<true>, KVPAGE_LINEAR_BINDING);
