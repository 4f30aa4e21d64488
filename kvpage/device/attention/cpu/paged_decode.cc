// Paged decode attention for XLA:CPU, as an XLA FFI handler: one query token per
// sequence, read against the sequence's pages where they lie in the pool.
//
// XLA:CPU has no way to express this without first gathering every page a step reads
// into a fresh buffer (a copy of the whole context, per layer, per step), then reading
// the copy again. Here each (sequence, KV head) is one task: its query heads walk the
// page table and fold each page into an online softmax (the reference's update, a
// page at a time), so the keys and values are read once, in place.
//
// Operands: q f32[S, H, D] (row s: sequence s's query, already in the cache's dtype),
// k_cache and v_cache f32[L, KVH, P, PS, D] (the whole cache; `layer` picks one),
// page_tables s32[S, W], limits s32[S] (row s sees keys at positions < limits[s]; 0:
// a padding or non-decode row, which comes out zero). Attributes: layer, sm_scale,
// soft_cap (0: none). Result: f32[S, H, D]. Tasks run on XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxGroup = 16;     // query heads per KV head this kernel handles
constexpr int kMaxPageSize = 64;  // tokens per page this kernel handles
// Below any score: the running max before the first page.
constexpr float kNoScore = -1e30f;

// exp(x) for the x <= 0 of an online softmax (a score minus the running max), written
// so the compiler vectorizes it: exp(x) = 2^n * 2^f with n = round(x log2 e) and 2^f on
// [-1/2, 1/2] by Cephes' exp2f polynomial (relative error below 2e-7). No -ffast-math:
// loading a library built with it would flush subnormals process-wide.
inline float ExpNonPositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;  // log2(e)
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n >= -126
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
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

// One sequence's query heads of one KV head, folded over its pages.
void AttendOne(const Problem& p, int64_t seq, int64_t kv_head) {
  const int64_t d = p.head_dim, group = p.num_heads / p.num_kv_heads;
  float* out = p.out + (seq * p.num_heads + kv_head * group) * d;
  const int64_t limit = p.limits[seq];
  if (limit <= 0) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const float* q = p.q + (seq * p.num_heads + kv_head * group) * d;
  std::vector<float> scaled(group * d), acc(group * d, 0.0f);
  for (int64_t i = 0; i < group * d; ++i) scaled[i] = q[i] * p.sm_scale;
  float running_max[kMaxGroup], denominator[kMaxGroup];
  std::fill(running_max, running_max + group, kNoScore);
  std::fill(denominator, denominator + group, 0.0f);
  float scores[kMaxPageSize];
  const int64_t page_floats = p.page_size * d;
  const int64_t head_base = (p.layer * p.num_kv_heads + kv_head) * p.num_pages;
  const int64_t num_table_pages = (limit + p.page_size - 1) / p.page_size;
  for (int64_t entry = 0; entry < num_table_pages; ++entry) {
    const int64_t page = p.tables[seq * p.table_width + entry];
    const float* keys = p.k + (head_base + page) * page_floats;
    const float* values = p.v + (head_base + page) * page_floats;
    const int64_t tokens = std::min(p.page_size, limit - entry * p.page_size);
    for (int64_t r = 0; r < group; ++r) {
      const float* qr = scaled.data() + r * d;
      float page_max = kNoScore;
      for (int64_t t = 0; t < tokens; ++t) {
        const float* kt = keys + t * d;
        float s = 0.0f;
        for (int64_t i = 0; i < d; ++i) s += qr[i] * kt[i];
        if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
        scores[t] = s;
        page_max = std::max(page_max, s);
      }
      const float new_max = std::max(running_max[r], page_max);
      const float rescale = ExpNonPositive(running_max[r] - new_max);  // ~0 at first
      float* ar = acc.data() + r * d;
      float page_sum = 0.0f;
      for (int64_t t = 0; t < tokens; ++t) {
        scores[t] = ExpNonPositive(scores[t] - new_max);
        page_sum += scores[t];
      }
      for (int64_t i = 0; i < d; ++i) ar[i] *= rescale;
      for (int64_t t = 0; t < tokens; ++t) {
        const float weight = scores[t];
        const float* vt = values + t * d;
        for (int64_t i = 0; i < d; ++i) ar[i] += weight * vt[i];
      }
      denominator[r] = denominator[r] * rescale + page_sum;
      running_max[r] = new_max;
    }
  }
  for (int64_t r = 0; r < group; ++r) {
    const float inverse = 1.0f / denominator[r];
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = acc[r * d + i] * inverse;
  }
}

// The tasks of one call, shared with the pool's helpers (see `PagedDecode`).
struct Work {
  Work(const Problem& problem, int64_t num_tasks) : problem(problem), num_tasks(num_tasks) {}

  void Drain() {
    for (int64_t task = next++; task < num_tasks; task = next++) {
      AttendOne(problem, task / problem.num_kv_heads, task % problem.num_kv_heads);
    }
  }

  const Problem problem;
  const int64_t num_tasks;
  std::atomic<int64_t> next{0};
  std::mutex mutex;
  std::condition_variable idle;
  int64_t active = 0;   // helpers inside Drain
  bool closed = false;  // the caller is done: helpers starting now do nothing
};

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                       ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
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
  if (q_dims[2] != p.head_dim || p.num_heads % p.num_kv_heads != 0 ||
      p.num_heads / p.num_kv_heads > kMaxGroup || p.page_size > kMaxPageSize ||
      table_dims[0] != num_seqs || limits.element_count() != num_seqs ||
      layer < 0 || layer >= cache_dims[0]) {
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes or layer");
  }
  // Helpers from XLA's pool take tasks from a shared counter while the caller works
  // too. The caller then waits only for helpers that have started: one that starts
  // later finds the work closed and returns at once. (Waiting for helpers that have not
  // started could deadlock: under several CPU devices one pool serves them all, and
  // its threads may all be callers waiting here.) The state outlives the call for them.
  auto work = std::make_shared<Work>(p, num_seqs * p.num_kv_heads);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0),
                                            work->num_tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work] {
      {
        std::lock_guard<std::mutex> lock(work->mutex);
        if (work->closed) return;
        ++work->active;
      }
      work->Drain();
      std::lock_guard<std::mutex> lock(work->mutex);
      if (--work->active == 0) work->idle.notify_all();
    });
  }
  work->Drain();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->closed = true;
  work->idle.wait(lock, [&] { return work->active == 0; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvpagePagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
