// Paged attention for XLA:CPU, as XLA FFI handlers that read each sequence's pages
// where they lie in the pool.
//
// XLA:CPU has no way to express this without first gathering every page a step reads
// into a fresh buffer (a copy of the whole context, per layer, per step), then reading
// the copy again. Two handlers read the pages in place instead:
//
// * `PagedDecode`: one query token per sequence. Each (sequence, KV head) is one task:
//   its query heads walk the page table, 16 keys at a time, folding them into an online
//   softmax (the reference's update), so keys and values are read once; the next
//   page is prefetched while one is read, since pages lie anywhere in the pool.
//   Operands: q f32[S, H, D] (row s: sequence s's query), k_cache and v_cache
//   f32[L, KVH, P, PS, D] (the whole cache; `layer` picks one), page_tables s32[S, W],
//   limits s32[S] (row s sees keys at positions < limits[s]; 0: a padding or
//   non-decode row, which comes out zero). Result: f32[S, H, D].
// * `PagedPrefill`: prompt chunks, causal. Each (sequence, KV head, query block) is one
//   task: a block of a chunk's tokens times the KV head's query heads (about 128 query
//   rows) folds key tiles of 64 tokens into an online softmax, scoring the whole block
//   against a tile with register-blocked products (a small matrix multiply) rather
//   than one row at a time. Operands: q f32[T, H, D], the caches, page_tables,
//   query_start_loc s32[S+1], context_lens s32[S]. A sequence with fewer than two new
//   tokens (a decode, or padding) is left to the decode handler: its rows, and the
//   padding tokens', come out zero. Result: f32[T, H, D].
//
// Both take the attributes layer, sm_scale and soft_cap (0: none), and run their tasks
// on kvpage's worker threads (`common.h`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "common.h"
#include "variant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The variant's namespace (variant.h): its functions' names say which variant they are.
namespace kvpage {
inline namespace KVPAGE_VARIANT_NAMESPACE {
namespace {

// Query heads per KV head the decode kernel handles (limits.py's MAX_GROUP).
constexpr int kMaxGroup = limits::kMaxGroup;
constexpr int64_t kFloatsPerLine = 16;  // a 64-byte cache line
// Below any score: the running max before the first page.
constexpr float kNoScore = -1e30f;

// Calls `attend(std::integral_constant<int, head_dim / kLanes>{})` where `head_dim` is
// one of the head sizes the kernels are instantiated for (limits.py's HEAD_DIMS, whole
// vectors); returns whether it is.
template <size_t kIndex = 0, typename Attend>
bool WithHeadDim(int64_t head_dim, const Attend& attend) {
  if constexpr (kIndex == std::size(limits::kHeadDims)) {
    return false;
  } else {
    constexpr int64_t kDim = limits::kHeadDims[kIndex];
    static_assert(kDim > 0 && kDim % kLanes == 0, "head sizes are whole vectors (limits.py)");
    if (head_dim != kDim) return WithHeadDim<kIndex + 1>(head_dim, attend);
    attend(std::integral_constant<int, kDim / kLanes>{});
    return true;
  }
}

inline bool SupportedHeadDim(int64_t head_dim) {
  return WithHeadDim(head_dim, [](auto) {});
}

// Across the 16 lanes by halving: each step adds (or maxes) the vector with itself
// rotated by half its width, 4 shuffles in all.
inline F16 Rotate(F16 v, int width) {
  switch (width) {
    case 8:
      return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15,
                                     0, 1, 2, 3, 4, 5, 6, 7);
    case 4:
      return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3,
                                     12, 13, 14, 15, 8, 9, 10, 11);
    case 2:
      return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5,
                                     10, 11, 8, 9, 14, 15, 12, 13);
    default:
      return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6,
                                     9, 8, 11, 10, 13, 12, 15, 14);
  }
}

inline float ReduceMax(F16 v) {
  for (int width = 8; width >= 1; width /= 2) {
    const F16 other = Rotate(v, width);
    v = v > other ? v : other;
  }
  return v[0];
}

inline float ReduceSum(F16 v) {
  for (int width = 8; width >= 1; width /= 2) v += Rotate(v, width);
  return v[0];
}

// Lane t of the result: the sum of the lanes of part[t]. A transpose-and-add tree
// (16 -> 8 -> 4 -> 2 -> 1 partial sums a vector) that leaves lane L holding the vector
// at position bitreverse(L): so callers store key t's partial sums at kBitReversed[t].
constexpr int kBitReversed[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline F16 SumLanes(const F16 (&part)[kLanes]) {
  F16 half[8], quarter[4], eighth[2];
  for (int i = 0; i < 8; ++i) {
    const F16 x = part[2 * i], y = part[2 * i + 1];
    half[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7,
                                      16, 17, 18, 19, 20, 21, 22, 23) +
              __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15,
                                      24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const F16 x = half[2 * i], y = half[2 * i + 1];
    quarter[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19,
                                         8, 9, 10, 11, 24, 25, 26, 27) +
                 __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23,
                                         12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const F16 x = quarter[2 * i], y = quarter[2 * i + 1];
    eighth[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21,
                                        8, 9, 24, 25, 12, 13, 28, 29) +
                __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23,
                                        10, 11, 26, 27, 14, 15, 30, 31);
  }
  const F16 x = eighth[0], y = eighth[1];
  return __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22,
                                 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23,
                                 9, 25, 11, 27, 13, 29, 15, 31);
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* tables;
  const int32_t* limits;
  float* out;
  int64_t num_heads, num_kv_heads, num_pages, page_size, head_dim, table_width;
  int64_t layer;
  float sm_scale, soft_cap;
};

// Asks for the keys and values of the page at `offset` (floats into a cache), one cache
// line at a time: pages lie anywhere in the pool, so the hardware cannot guess them.
inline void Prefetch(const Problem& p, int64_t offset) {
  for (int64_t i = 0; i < p.page_size * p.head_dim; i += kFloatsPerLine) {
    __builtin_prefetch(p.k + offset + i);
    __builtin_prefetch(p.v + offset + i);
  }
}

// One sequence's query heads of one KV head, folded over its pages 16 keys at a time
// (`VD`: vectors per head_dim): each key's products with a query head are summed across
// vectors, then the 16 keys' sums across lanes at once (`SumLanes`), instead of one
// horizontal sum per key; the weighted values fold into all the group's accumulators
// per value row loaded.
template <int VD>
void AttendOne(const Problem& p, int64_t seq, int64_t kv_head) {
  constexpr int64_t d = VD * kLanes;
  const int64_t group = p.num_heads / p.num_kv_heads;
  float* out = p.out + (seq * p.num_heads + kv_head * group) * d;
  const int64_t limit = p.limits[seq];
  if (limit <= 0) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const float* q = p.q + (seq * p.num_heads + kv_head * group) * d;
  F16 scaled[kMaxGroup][VD], acc[kMaxGroup][VD];
  float running_max[kMaxGroup], denominator[kMaxGroup];
  for (int64_t r = 0; r < group; ++r) {
    for (int j = 0; j < VD; ++j) {
      scaled[r][j] = Load(q + r * d + j * kLanes) * p.sm_scale;
      acc[r][j] = F16{};
    }
    running_max[r] = kNoScore;
    denominator[r] = 0.0f;
  }
  const int64_t page_floats = p.page_size * d;
  const int64_t head_base = (p.layer * p.num_kv_heads + kv_head) * p.num_pages;
  const int32_t* table = p.tables + seq * p.table_width;
  const int64_t num_table_pages = (limit + p.page_size - 1) / p.page_size;
  for (int64_t entry = 0; entry < num_table_pages; ++entry) {
    const float* keys = p.k + (head_base + table[entry]) * page_floats;
    const float* values = p.v + (head_base + table[entry]) * page_floats;
    if (entry + 1 < num_table_pages) {  // the next page is elsewhere: ask for it now
      Prefetch(p, (head_base + table[entry + 1]) * page_floats);
    }
    const int64_t page_tokens = std::min(p.page_size, limit - entry * p.page_size);
    for (int64_t first = 0; first < page_tokens; first += kLanes) {
      const int64_t tokens = std::min<int64_t>(kLanes, page_tokens - first);
      F16 weights[kMaxGroup];
      for (int64_t r = 0; r < group; ++r) {
        F16 part[kLanes];
        for (int t = 0; t < kLanes; ++t) {
          F16 sum = {};
          if (t < tokens) {
            const float* key = keys + (first + t) * d;
            for (int j = 0; j < VD; ++j) sum += scaled[r][j] * Load(key + j * kLanes);
          }
          part[kBitReversed[t]] = sum;
        }
        F16 scores = SumLanes(part);
        if (p.soft_cap > 0.0f) {
          for (int i = 0; i < kLanes; ++i) {
            scores[i] = p.soft_cap * std::tanh(scores[i] / p.soft_cap);
          }
        }
        const F16 visible = Lane() < static_cast<float>(tokens) ? Splat(1.0f) : F16{};
        scores = visible > 0.0f ? scores : Splat(kNoScore);
        const float new_max = std::max(running_max[r], ReduceMax(scores));
        const F16 weight = ExpNonPositive(scores - new_max) * visible;
        const float rescale = ExpNonPositive(running_max[r] - new_max);  // ~0 at first
        for (int j = 0; j < VD; ++j) acc[r][j] *= rescale;
        denominator[r] = denominator[r] * rescale + ReduceSum(weight);
        running_max[r] = new_max;
        weights[r] = weight;
      }
      for (int64_t t = 0; t < tokens; ++t) {
        F16 value[VD];
        for (int j = 0; j < VD; ++j) value[j] = Load(values + (first + t) * d + j * kLanes);
        for (int64_t r = 0; r < group; ++r) {
          const float w = weights[r][t];
          for (int j = 0; j < VD; ++j) acc[r][j] += w * value[j];
        }
      }
    }
  }
  for (int64_t r = 0; r < group; ++r) {
    const float inverse = 1.0f / denominator[r];
    for (int j = 0; j < VD; ++j) Store(out + r * d + j * kLanes, acc[r][j] * inverse);
  }
}

ffi::Error PagedDecode(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                       ffi::Buffer<ffi::F32> v_cache,
                       ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> limits,
                       ffi::ResultBuffer<ffi::F32> out, int64_t layer, float sm_scale,
                       float soft_cap) {
  const auto q_dims = q.dimensions(), cache_dims = k_cache.dimensions();
  const auto table_dims = page_tables.dimensions();
  if (q_dims.size() != 3 || cache_dims.size() != 5 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: q must be rank 3, the caches rank 5 "
                                       "and the page tables rank 2");
  }
  Problem p{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(),
            page_tables.typed_data(), limits.typed_data(), out->typed_data(),
            q_dims[1], cache_dims[1], cache_dims[2], cache_dims[3], cache_dims[4],
            table_dims[1], layer, sm_scale, soft_cap};
  const int64_t num_seqs = q_dims[0];
  if (p.num_kv_heads <= 0 || q_dims[2] != p.head_dim || p.num_heads % p.num_kv_heads != 0 ||
      p.num_heads / p.num_kv_heads > kMaxGroup || !SupportedHeadDim(p.head_dim) ||
      table_dims[0] != num_seqs || static_cast<int64_t>(limits.element_count()) != num_seqs ||
      layer < 0 || layer >= cache_dims[0]) {
    return ffi::Error::InvalidArgument(
        std::string("paged_decode: inconsistent shapes or layer, or a head_dim other than ") +
        limits::kHeadDimsText);
  }
  Workers::Run(num_seqs * p.num_kv_heads, [&p](int64_t task) {
    const int64_t seq = task / p.num_kv_heads, kv_head = task % p.num_kv_heads;
    WithHeadDim(p.head_dim, [&](auto vd) { AttendOne<decltype(vd)::value>(p, seq, kv_head); });
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------
// Prompt chunks. A key tile is 64 keys: 4 vectors of scores.
constexpr int kTileKeys = 64;
constexpr int kScoreRows = 8;  // query rows scored together against a tile
constexpr int kQueryRows = 128;  // query rows a task aims for (block tokens x group)

struct PrefillProblem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* tables;
  const int32_t* query_start_loc;
  const int32_t* context_lens;
  float* out;
  int64_t num_heads, num_kv_heads, num_pages, page_size, table_width, layer;
  float sm_scale, soft_cap;
};

// A query block: `num_tokens` new tokens of sequence `seq` from token `first_token`
// of the step, the first at position `first_position`.
struct Block {
  int64_t seq, first_token, num_tokens, first_position;
};

// One query block's attention, over the query heads of `kv_head`. `VD`: vectors per
// head_dim.
template <int VD>
void AttendBlock(const PrefillProblem& p, const Block& block, int64_t kv_head) {
  constexpr int64_t d = VD * kLanes;
  const int64_t seq = block.seq, first_token = block.first_token;
  const int64_t num_tokens = block.num_tokens, first_position = block.first_position;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t rows = num_tokens * group;
  const int64_t padded_rows = (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
  // Row r: token r / group, query head kv_head * group + r % group.
  std::vector<float> q(padded_rows * d, 0.0f), acc(padded_rows * d, 0.0f);
  std::vector<float> scores(padded_rows * kTileKeys), running_max(padded_rows, kNoScore);
  std::vector<float> denominator(padded_rows, 0.0f);
  alignas(64) float keys_t[d * kTileKeys];  // the tile's keys, transposed: [d][key]
  const float* values[kTileKeys];           // the tile's value rows, in place
  for (int64_t r = 0; r < rows; ++r) {
    const float* from = p.q + ((first_token + r / group) * p.num_heads + kv_head * group +
                               r % group) * d;
    for (int64_t i = 0; i < d; ++i) q[r * d + i] = from[i] * p.sm_scale;
  }
  const int64_t page_floats = p.page_size * d;
  const int64_t head_base = (p.layer * p.num_kv_heads + kv_head) * p.num_pages;
  const int32_t* table = p.tables + seq * p.table_width;
  const int64_t end = first_position + num_tokens;  // keys the last token sees
  for (int64_t tile = 0; tile < end; tile += kTileKeys) {
    const int64_t tile_keys = std::min<int64_t>(kTileKeys, end - tile);
    const int64_t tile_vectors = (tile_keys + kLanes - 1) / kLanes;
    for (int64_t t = 0; t < tile_keys; ++t) {
      const int64_t position = tile + t;
      const int64_t offset = (head_base + table[position / p.page_size]) * page_floats +
                             position % p.page_size * d;
      const float* key = p.k + offset;
      for (int64_t i = 0; i < d; ++i) keys_t[i * kTileKeys + t] = key[i];
      values[t] = p.v + offset;
    }
    // Zeros past the tile's keys, up to the even number of key vectors scored below.
    for (int64_t t = tile_keys; t < (tile_vectors + 1) / 2 * 2 * kLanes; ++t) {
      for (int64_t i = 0; i < d; ++i) keys_t[i * kTileKeys + t] = 0.0f;
    }
    // Scores: kScoreRows rows x two vectors of keys at a time, over head_dim.
    for (int64_t r0 = 0; r0 < padded_rows; r0 += kScoreRows) {
      const float* qr = q.data() + r0 * d;
      for (int64_t kv = 0; kv < tile_vectors; kv += 2) {  // two key vectors at a time
        F16 s[kScoreRows][2] = {};
        for (int64_t i = 0; i < d; ++i) {
          const float* row = keys_t + i * kTileKeys + kv * kLanes;
          const F16 key0 = *reinterpret_cast<const F16*>(row);
          const F16 key1 = *reinterpret_cast<const F16*>(row + kLanes);
          for (int r = 0; r < kScoreRows; ++r) {
            const float qi = qr[r * d + i];
            s[r][0] += qi * key0;
            s[r][1] += qi * key1;
          }
        }
        for (int r = 0; r < kScoreRows; ++r) {
          Store(scores.data() + (r0 + r) * kTileKeys + kv * kLanes, s[r][0]);
          Store(scores.data() + (r0 + r) * kTileKeys + (kv + 1) * kLanes, s[r][1]);
        }
      }
    }
    // Online softmax, row by row: mask the keys past the row's position, then turn the
    // scores into weights (zero where masked) and rescale what came before.
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores.data() + r * kTileKeys;
      const int64_t visible = std::min<int64_t>(first_position + r / group + 1 - tile,
                                                tile_keys);
      if (visible <= 0) {  // the whole tile is in this row's future
        std::fill(sr, sr + tile_vectors * kLanes, 0.0f);
        continue;
      }
      F16 tile_max = Splat(kNoScore);
      for (int64_t kv = 0; kv < tile_vectors; ++kv) {
        F16 s = Load(sr + kv * kLanes);
        if (p.soft_cap > 0.0f) {
          for (int i = 0; i < kLanes; ++i) s[i] = p.soft_cap * std::tanh(s[i] / p.soft_cap);
        }
        if ((kv + 1) * kLanes > visible) {  // keys in the row's future: no score
          s = Lane() + static_cast<float>(kv * kLanes) < static_cast<float>(visible)
                  ? s : Splat(kNoScore);
        }
        Store(sr + kv * kLanes, s);
        tile_max = tile_max > s ? tile_max : s;
      }
      const float new_max = std::max(running_max[r], ReduceMax(tile_max));
      F16 sum = {};
      for (int64_t kv = 0; kv < tile_vectors; ++kv) {
        F16 s = Load(sr + kv * kLanes);
        const F16 weight = ExpNonPositive(s - new_max);
        const F16 masked = s > kNoScore * 0.5f ? weight : F16{};
        sum += masked;
        Store(sr + kv * kLanes, masked);
      }
      const float rescale = ExpNonPositive(running_max[r] - new_max);
      denominator[r] = denominator[r] * rescale + ReduceSum(sum);
      running_max[r] = new_max;
      float* ar = acc.data() + r * d;
      for (int j = 0; j < VD; ++j) Store(ar + j * kLanes, Load(ar + j * kLanes) * rescale);
    }
    // Weighted values: a few rows at a time, their accumulators in registers. (Rows
    // are padded to a multiple of kScoreRows, which kValueRows divides.)
    constexpr int kValueRows = VD >= 16 ? 1 : 16 / VD > 8 ? 8 : 16 / VD;
    static_assert(kScoreRows % kValueRows == 0, "value blocks must tile the padded rows");
    for (int64_t r0 = 0; r0 < padded_rows; r0 += kValueRows) {
      F16 a[kValueRows][VD];
      for (int r = 0; r < kValueRows; ++r) {
        for (int j = 0; j < VD; ++j) a[r][j] = Load(acc.data() + (r0 + r) * d + j * kLanes);
      }
      for (int64_t t = 0; t < tile_keys; ++t) {
        F16 value[VD];
        for (int j = 0; j < VD; ++j) value[j] = Load(values[t] + j * kLanes);
        for (int r = 0; r < kValueRows; ++r) {
          const float weight = scores[(r0 + r) * kTileKeys + t];
          for (int j = 0; j < VD; ++j) a[r][j] += weight * value[j];
        }
      }
      for (int r = 0; r < kValueRows; ++r) {
        for (int j = 0; j < VD; ++j) Store(acc.data() + (r0 + r) * d + j * kLanes, a[r][j]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* to = p.out + ((first_token + r / group) * p.num_heads + kv_head * group +
                         r % group) * d;
    const float inverse = 1.0f / denominator[r];
    for (int64_t i = 0; i < d; ++i) to[i] = acc[r * d + i] * inverse;
  }
}

#ifdef KVPAGE_AMX
// ---------------------------------------------------------------------------------
// Prompt chunks on AMX, in three bf16 passes (`amx.h`; JAX's `Precision.HIGH`).
//
// Everything is transposed, so that each operand is packed once: scores come out as
// S^T = K Q^T ([keys][query rows]: K's split rows are the left operand, packed once per
// sequence and KV head; Q^T is packed once per block of 32 query rows), the online
// softmax runs down the keys with 16 query rows per vector (no reductions across
// lanes), and the weighted values come out as O^T = V^T P^T (V^T split once per
// sequence and KV head, P^T packed per key tile like a weight).
constexpr int64_t kAmxTileKeys = 64;  // keys per softmax tile: two 32-key blocks

// One sequence's keys and values for one KV head, split: K [keys][d] and V^T [d][keys],
// keys padded with zeros to a multiple of kAmxTileKeys (`padded`).
struct SplitContext {
  uint16_t *k_high, *k_low, *vt_high, *vt_low;
  int64_t padded;
};

// Fills `split` with the first `context` keys and values of sequence `seq`, KV head
// `kv_head`, read through its page table.
void SplitSequence(const PrefillProblem& p, int64_t head_dim, int64_t seq, int64_t kv_head,
                   int64_t context, const SplitContext& split) {
  uint16_t *k_high = split.k_high, *k_low = split.k_low;
  uint16_t *vt_high = split.vt_high, *vt_low = split.vt_low;
  const int64_t padded = split.padded;
  const int64_t page_floats = p.page_size * head_dim;
  const int64_t head_base = (p.layer * p.num_kv_heads + kv_head) * p.num_pages;
  const int32_t* table = p.tables + seq * p.table_width;
  for (int64_t t = 0; t < padded; ++t) {
    const bool real = t < context;
    const int64_t offset = real ? (head_base + table[t / p.page_size]) * page_floats +
                                      t % p.page_size * head_dim
                                : 0;
    for (int64_t i = 0; i < head_dim; i += 16) {
      __m256i high, low;
      amx::Split(real ? _mm512_loadu_ps(p.k + offset + i) : _mm512_setzero_ps(), &high, &low);
      _mm256_storeu_si256((__m256i*)(k_high + t * head_dim + i), high);
      _mm256_storeu_si256((__m256i*)(k_low + t * head_dim + i), low);
      amx::Split(real ? _mm512_loadu_ps(p.v + offset + i) : _mm512_setzero_ps(), &high, &low);
      alignas(32) uint16_t h[16], l[16];
      _mm256_store_si256((__m256i*)h, high);
      _mm256_store_si256((__m256i*)l, low);
      for (int j = 0; j < 16; ++j) {
        vt_high[(i + j) * padded + t] = h[j];
        vt_low[(i + j) * padded + t] = l[j];
      }
    }
  }
}

// Q^T for 32 query rows (`q`: [32][d] fp32, scaled), packed as the right operand of
// S^T = K Q^T: [part][d / 32 steps][16-row half][16 dim pairs][16 rows][2].
void PackQueries(const float* q, int64_t head_dim, uint16_t* packed) {
  const int64_t steps = head_dim / amx::kStep;
  uint16_t* parts[2] = {packed, packed + steps * 2 * amx::kTile};
  for (int64_t row = 0; row < amx::kBlock; ++row) {
    for (int64_t i = 0; i < head_dim; i += 16) {
      __m256i high, low;
      amx::Split(_mm512_loadu_ps(q + row * head_dim + i), &high, &low);
      alignas(32) uint16_t split[2][16];
      _mm256_store_si256((__m256i*)split[0], high);
      _mm256_store_si256((__m256i*)split[1], low);
      for (int part = 0; part < 2; ++part) {
        for (int j = 0; j < 16; ++j) {
          const int64_t dim = i + j;
          parts[part][((dim / amx::kStep) * 2 + row / 16) * amx::kTile +
                      (dim % amx::kStep) / 2 * 32 + (row % 16) * 2 + dim % 2] = split[part][j];
        }
      }
    }
  }
}

// One query block's attention over the query heads of `kv_head`, on AMX, with the
// sequence's split keys and values. `VD`: vectors per head_dim (a multiple of 2).
template <int VD>
void AttendBlockAmx(const PrefillProblem& p, const Block& block, int64_t kv_head,
                    const SplitContext& context) {
  constexpr int64_t d = VD * kLanes;
  constexpr int64_t kRows = amx::kBlock;  // query rows per pass
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t rows = block.num_tokens * group;
  alignas(64) float q[kRows * d];
  alignas(64) float scores[kAmxTileKeys * kRows];  // S^T, then P^T
  alignas(64) float acc[d * kRows];                // O^T
  alignas(64) float product[amx::kBlock * kRows];
  alignas(64) uint16_t q_packed[2 * (d / amx::kStep) * 2 * amx::kTile];
  alignas(64) uint16_t p_packed[2 * (kAmxTileKeys / amx::kStep) * 2 * amx::kTile];
  amx::ConfigureTiles();
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    // Row r: token r / group, query head kv_head * group + r % group; rows past the
    // block see no key.
    F16 position[2], running_max[2], denominator[2] = {};
    for (int half = 0; half < 2; ++half) {
      float lanes[kLanes];
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t r = r0 + half * kLanes + lane;
        lanes[lane] = r < rows ? static_cast<float>(block.first_position + r / group) : -1.0f;
      }
      position[half] = Load(lanes);
      running_max[half] = Splat(kNoScore);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      const float* from = p.q + ((block.first_token + (r0 + r) / group) * p.num_heads +
                                 kv_head * group + (r0 + r) % group) * d;
      for (int64_t i = 0; i < d; ++i) q[r * d + i] = r0 + r < rows ? from[i] * p.sm_scale : 0.0f;
    }
    PackQueries(q, d, q_packed);
    std::fill(acc, acc + d * kRows, 0.0f);
    // Keys the pass's last row sees.
    const int64_t last = block.first_position + (std::min(rows, r0 + kRows) - 1) / group + 1;
    for (int64_t tile = 0; tile < last; tile += kAmxTileKeys) {
      // S^T for the tile: two blocks of 32 keys.
      for (int64_t sub = 0; sub < kAmxTileKeys; sub += amx::kBlock) {
        amx::Block(context.k_high + (tile + sub) * d, context.k_low + (tile + sub) * d, d,
                   d / amx::kStep, q_packed, scores + sub * kRows, kRows);
      }
      // Online softmax down the keys, 16 rows per vector.
      F16 tile_max[2] = {Splat(kNoScore), Splat(kNoScore)};
      for (int64_t t = 0; t < kAmxTileKeys; ++t) {
        const float key_position = static_cast<float>(tile + t);
        for (int half = 0; half < 2; ++half) {
          F16 s = Load(scores + t * kRows + half * kLanes);
          if (p.soft_cap > 0.0f) {
            for (int i = 0; i < kLanes; ++i) s[i] = p.soft_cap * std::tanh(s[i] / p.soft_cap);
          }
          s = key_position <= position[half] ? s : Splat(kNoScore);
          Store(scores + t * kRows + half * kLanes, s);
          tile_max[half] = tile_max[half] > s ? tile_max[half] : s;
        }
      }
      F16 rescale[2], sum[2] = {};
      for (int half = 0; half < 2; ++half) {
        const F16 new_max = running_max[half] > tile_max[half] ? running_max[half]
                                                                : tile_max[half];
        rescale[half] = ExpNonPositive(running_max[half] - new_max);
        running_max[half] = new_max;
      }
      for (int64_t t = 0; t < kAmxTileKeys; ++t) {
        for (int half = 0; half < 2; ++half) {
          const F16 s = Load(scores + t * kRows + half * kLanes);
          const F16 weight = ExpNonPositive(s - running_max[half]);
          const F16 masked = s > kNoScore * 0.5f ? weight : F16{};
          sum[half] += masked;
          Store(scores + t * kRows + half * kLanes, masked);
        }
      }
      for (int half = 0; half < 2; ++half) {
        denominator[half] = denominator[half] * rescale[half] + sum[half];
      }
      for (int64_t i = 0; i < d; ++i) {
        for (int half = 0; half < 2; ++half) {
          float* a = acc + i * kRows + half * kLanes;
          Store(a, Load(a) * rescale[half]);
        }
      }
      // O^T += V^T P^T, 32 dims at a time.
      amx::PackBlock(scores, kAmxTileKeys, kRows, kAmxTileKeys / amx::kStep, 0, p_packed);
      for (int64_t dim = 0; dim < d; dim += amx::kBlock) {
        amx::Block(context.vt_high + dim * context.padded + tile,
                   context.vt_low + dim * context.padded + tile, context.padded,
                   kAmxTileKeys / amx::kStep, p_packed, product, kRows);
        for (int64_t i = 0; i < amx::kBlock * kRows; i += kLanes) {
          Store(acc + dim * kRows + i, Load(acc + dim * kRows + i) + Load(product + i));
        }
      }
    }
    for (int64_t r = 0; r < std::min(kRows, rows - r0); ++r) {
      float* to = p.out + ((block.first_token + (r0 + r) / group) * p.num_heads +
                           kv_head * group + (r0 + r) % group) * d;
      const float inverse = 1.0f / denominator[r / kLanes][r % kLanes];
      for (int64_t i = 0; i < d; ++i) to[i] = acc[i * kRows + r] * inverse;
    }
  }
  _tile_release();
}

// The blocks' attention on AMX: every prompt-chunk sequence's keys and values split
// once per KV head (one task each), then the blocks.
ffi::Error PrefillOnAmx(const PrefillProblem& p, int64_t head_dim, int64_t num_seqs,
                        const std::vector<Block>& blocks) {
  if (!amx::RequestAmx()) return ffi::Error::Internal("paged_prefill: the OS refused AMX");
  std::vector<int64_t> padded(num_seqs, 0), at(num_seqs + 1, 0);
  std::vector<int64_t> split_seqs;
  for (const Block& block : blocks) {
    if (padded[block.seq] == 0) split_seqs.push_back(block.seq);
    padded[block.seq] = (p.context_lens[block.seq] + kAmxTileKeys - 1) / kAmxTileKeys *
                        kAmxTileKeys;
  }
  // Per sequence and KV head: K high, K low, V^T high, V^T low.
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    at[seq + 1] = at[seq] + 4 * padded[seq] * head_dim * p.num_kv_heads;
  }
  thread_local std::vector<uint16_t> buffer;  // the caller's: one call at a time
  buffer.resize(at[num_seqs]);
  uint16_t* data = buffer.data();  // (in a helper, `buffer` would name the helper's own)
  auto context = [&](int64_t seq, int64_t kv_head) {
    const int64_t size = padded[seq] * head_dim;
    uint16_t* base = data + at[seq] + 4 * size * kv_head;
    return SplitContext{base, base + size, base + 2 * size, base + 3 * size, padded[seq]};
  };
  Workers::Run(static_cast<int64_t>(split_seqs.size()) * p.num_kv_heads, [&](int64_t task) {
    const int64_t seq = split_seqs[task / p.num_kv_heads], kv_head = task % p.num_kv_heads;
    SplitSequence(p, head_dim, seq, kv_head, p.context_lens[seq], context(seq, kv_head));
  });
  Workers::Run(static_cast<int64_t>(blocks.size()) * p.num_kv_heads, [&](int64_t task) {
    const Block& block = blocks[task / p.num_kv_heads];
    const int64_t kv_head = task % p.num_kv_heads;
    WithHeadDim(head_dim, [&](auto vd) {
      constexpr int kVd = decltype(vd)::value;
      if constexpr (kVd * kLanes % limits::kBf16x3HeadDimMultiple == 0) {
        AttendBlockAmx<kVd>(p, block, kv_head, context(block.seq, kv_head));
      }
    });
  });
  return ffi::Error::Success();
}
#else
ffi::Error PrefillOnAmx(const PrefillProblem&, int64_t, int64_t, const std::vector<Block>&) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "paged_prefill_bf16x3: only the library's amx variant runs it");
}
#endif  // KVPAGE_AMX

template <bool kAmx>
ffi::Error PagedPrefill(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                        ffi::Buffer<ffi::F32> v_cache,
                        ffi::Buffer<ffi::S32> page_tables,
                        ffi::Buffer<ffi::S32> query_start_loc,
                        ffi::Buffer<ffi::S32> context_lens, ffi::ResultBuffer<ffi::F32> out,
                        int64_t layer, float sm_scale, float soft_cap) {
  const auto q_dims = q.dimensions(), cache_dims = k_cache.dimensions();
  const auto table_dims = page_tables.dimensions();
  if (q_dims.size() != 3 || cache_dims.size() != 5 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged_prefill: q must be rank 3, the caches rank 5 "
                                       "and the page tables rank 2");
  }
  const int64_t num_tokens = q_dims[0], num_seqs = table_dims[0], head_dim = q_dims[2];
  PrefillProblem p{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(),
                   page_tables.typed_data(), query_start_loc.typed_data(),
                   context_lens.typed_data(), out->typed_data(), q_dims[1], cache_dims[1],
                   cache_dims[2], cache_dims[3], table_dims[1], layer, sm_scale, soft_cap};
  if (p.num_kv_heads <= 0 || cache_dims[4] != head_dim ||
      p.num_heads % p.num_kv_heads != 0 ||
      static_cast<int64_t>(query_start_loc.element_count()) != num_seqs + 1 ||
      static_cast<int64_t>(context_lens.element_count()) != num_seqs || layer < 0 ||
      layer >= cache_dims[0] || !SupportedHeadDim(head_dim)) {
    return ffi::Error::InvalidArgument(
        std::string("paged_prefill: inconsistent shapes or layer, or a head_dim other than ") +
        limits::kHeadDimsText);
  }
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t block_tokens = std::max<int64_t>(1, kQueryRows / group);
  // Every prompt chunk's query blocks, the costliest (latest) first for balance.
  std::vector<Block> blocks;
  std::vector<char> covered(num_tokens, 0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t first = p.query_start_loc[seq], count = p.query_start_loc[seq + 1] - first;
    const int64_t context = p.context_lens[seq];
    if (count < 2 || first < 0 || first + count > num_tokens || context < count ||
        (context + p.page_size - 1) / p.page_size > p.table_width) {
      continue;  // a decode or padding (left to others), or out of range: zeros
    }
    for (int64_t offset = 0; offset < count; offset += block_tokens) {
      blocks.push_back({seq, first + offset, std::min(block_tokens, count - offset),
                        context - count + offset});
    }
    std::fill(covered.begin() + first, covered.begin() + first + count, 1);
  }
  std::stable_sort(blocks.begin(), blocks.end(), [](const Block& a, const Block& b) {
    return a.first_position > b.first_position;
  });
  float* out_data = out->typed_data();
  const int64_t token_floats = p.num_heads * head_dim;
  for (int64_t token = 0; token < num_tokens; ++token) {
    if (!covered[token]) std::fill_n(out_data + token * token_floats, token_floats, 0.0f);
  }
  if (kAmx && head_dim % limits::kBf16x3HeadDimMultiple == 0) {
    return PrefillOnAmx(p, head_dim, num_seqs, blocks);
  }
  Workers::Run(static_cast<int64_t>(blocks.size()) * p.num_kv_heads, [&](int64_t task) {
    WithHeadDim(head_dim, [&](auto vd) {
      AttendBlock<decltype(vd)::value>(p, blocks[task / p.num_kv_heads], task % p.num_kv_heads);
    });
  });
  return ffi::Error::Success();
}

// The bindings both handlers share: q, k_cache, v_cache and the page tables
// (`Operands`); the result and the attributes (`Results`).
auto Operands() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

template <typename Binding>
auto Results(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("layer")
      .template Attr<float>("sm_scale")
      .template Attr<float>("soft_cap");
}

}  // namespace

// Decode: + limits. Prefill: + query_start_loc, context_lens. Each named for its variant
// (`KvpagePagedDecode_avx2`, ...; variant.h), found through dispatch.cc's table.
XLA_FFI_DEFINE_HANDLER_SYMBOL(KVPAGE_HANDLER(KvpagePagedDecode), PagedDecode,
                              Results(Operands().Arg<ffi::Buffer<ffi::S32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KVPAGE_HANDLER(KvpagePagedPrefill), PagedPrefill<false>,
                              Results(Operands()
                                          .Arg<ffi::Buffer<ffi::S32>>()
                                          .Arg<ffi::Buffer<ffi::S32>>()));

// The same in three bf16 passes on AMX (JAX's `Precision.HIGH`), for head sizes that are
// multiples of 32 (limits.py's BF16X3_HEAD_DIM_MULTIPLE); others as above. Only the amx
// variant runs it (the others answer "unimplemented").
XLA_FFI_DEFINE_HANDLER_SYMBOL(KVPAGE_HANDLER(KvpagePagedPrefillBf16x3), PagedPrefill<true>,
                              Results(Operands()
                                          .Arg<ffi::Buffer<ffi::S32>>()
                                          .Arg<ffi::Buffer<ffi::S32>>()));

}  // namespace KVPAGE_VARIANT_NAMESPACE
}  // namespace kvpage
