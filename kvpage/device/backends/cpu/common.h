// What kvpage's CPU kernels share: vectors of 16 floats, and the threads they run on.
//
// The threads. XLA:CPU runs a step's small operations one after another on one
// thread, and a decode step is dozens of small operations (each matrix product over
// a few dozen rows takes tens of microseconds). Waking a sleeping thread for each
// costs about as much as the work, which is why XLA keeps them on one core. `Workers`
// keeps its helper threads awake between calls instead: after a job a helper spins
// for `kSpinMicros` before it sleeps, so the next kernel of the same step (the next
// layer's products, its attention) finds it running, and a job costs a few atomic
// operations. Between steps, and whenever the process has nothing for them, the
// helpers sleep.
//
// One job at a time: a kernel called while another holds the helpers (several CPU
// devices, or several engines, stepping at once from their own threads) runs its
// tasks on its caller alone, which is what a core per caller wants anyway, and never
// waits on another caller. Such a collision also keeps every caller off the helpers
// for the next `kContendedMicros`: while callers take turns on the cores, a helper
// spinning beside them would only take a core from one of them.

#ifndef KVPAGE_DEVICE_CPU_COMMON_H_
#define KVPAGE_DEVICE_CPU_COMMON_H_

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "variant.h"

namespace kvpage {
inline namespace KVPAGE_VARIANT_NAMESPACE {

// Vectors of 16 floats (GCC/Clang vector extensions: one AVX-512 register in the
// avx512 and amx variants, two AVX2 ones in the avx2 variant; `variant.h`).
typedef float F16 __attribute__((vector_size(64)));
typedef float F16Unaligned __attribute__((vector_size(64), aligned(4)));
typedef int32_t I16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline F16 Load(const float* from) { return *reinterpret_cast<const F16Unaligned*>(from); }
inline void Store(float* to, F16 value) { *reinterpret_cast<F16Unaligned*>(to) = value; }
inline F16 Splat(float value) { return F16{} + value; }
inline F16 Lane() {  // 0, 1, ..., 15
  return F16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
}

// exp(x) on 16 lanes, for x <= 0 (an online softmax's score minus the running max, a
// sigmoid's -|x|): exp(x) = 2^n * 2^f with n = round(x log2 e), here trunc(t - 1/2)
// for t <= 0, and 2^f on [-1/2, 1/2] by Cephes' exp2f polynomial (relative error below
// 2e-7). Written out because -ffast-math is not an option: loading a library built
// with it would flush subnormals process-wide.
inline F16 ExpNonPositive(F16 x) {
  F16 t = x * 1.44269504088896341f;
  t = t < -125.0f ? Splat(-125.0f) : t;
  const I16 n = __builtin_convertvector(t - 0.5f, I16);
  const F16 f = t - __builtin_convertvector(n, F16);
  F16 p = Splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const I16 bits = (n + 127) << 23;
  F16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float ExpNonPositive(float x) { return ExpNonPositive(Splat(x))[0]; }

// x * sigmoid(x) on 16 lanes (SiLU), through exp(-|x|) so nothing overflows.
inline F16 Silu(F16 x) {
  const F16 e = ExpNonPositive(x < 0 ? x : -x);
  return x * (x < 0 ? e : Splat(1.0f)) / (1.0f + e);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Workers {
 public:
  // Runs `task(0) .. task(num_tasks - 1)` on the caller and the helpers, each task
  // once; returns when all are done.
  static void Run(int64_t num_tasks, const std::function<void(int64_t)>& task) {
    Workers& workers = Get();
    if (num_tasks <= 1 || workers.num_helpers_ == 0 || workers.Contended()) {
      for (int64_t i = 0; i < num_tasks; ++i) task(i);
      return;
    }
    if (!workers.job_.try_lock()) {
      workers.contended_until_.store(Now() + kContendedMicros);
      for (int64_t i = 0; i < num_tasks; ++i) task(i);
      return;
    }
    workers.RunJob(num_tasks, task);
    workers.job_.unlock();
  }

 private:
  static constexpr int kMaxThreads = 16;    // helpers + the caller
  static constexpr int64_t kSpinMicros = 100;
  static constexpr int64_t kContendedMicros = 10000;

  static int64_t Now() {  // microseconds
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool Contended() const { return Now() < contended_until_.load(std::memory_order_relaxed); }

  static Workers& Get() {
    static Workers* workers = new Workers();  // never destroyed: helpers outlive exit
    return *workers;
  }

  Workers() {
    cpu_set_t cpus;
    const int available = sched_getaffinity(0, sizeof(cpus), &cpus) == 0
                              ? CPU_COUNT(&cpus)
                              : static_cast<int>(std::thread::hardware_concurrency());
    num_helpers_ = std::clamp(available, 1, kMaxThreads) - 1;
    for (int i = 0; i < num_helpers_; ++i) std::thread([this] { Help(); }).detach();
  }

  void RunJob(int64_t num_tasks, const std::function<void(int64_t)>& task) {
    task_ = &task;
    num_tasks_ = num_tasks;
    next_.store(0, std::memory_order_relaxed);
    open_.store(true);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    Drain();
    // Every task is taken; wait for the helpers still in one. A helper counts itself
    // active before it checks `open_`, and the caller closes before it reads the
    // count, so no helper touches this job after the wait (both sequentially
    // consistent).
    open_.store(false);
    while (active_.load() != 0) CpuRelax();
  }

  void Drain() {
    for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < num_tasks_;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      (*task_)(i);
    }
  }

  void Help() {
    uint64_t seen = generation_.load();
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        CpuRelax();
        if (spins % 256 == 255 && std::chrono::steady_clock::now() - start >
                                      std::chrono::microseconds(kSpinMicros)) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
          break;
        }
      }
      seen = generation_.load();
      active_.fetch_add(1);
      if (open_.load()) Drain();
      active_.fetch_sub(1);
    }
  }

  int num_helpers_ = 0;
  std::mutex job_;  // held by the caller whose job the helpers run
  const std::function<void(int64_t)>* task_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> active_{0};  // helpers inside a job
  std::atomic<uint64_t> generation_{0};  // one more per job
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> contended_until_{0};  // microseconds (`Now`)
  std::mutex mutex_;  // for sleeping only
  std::condition_variable wake_;
};

}  // namespace KVPAGE_VARIANT_NAMESPACE
}  // namespace kvpage

#endif  // KVPAGE_DEVICE_CPU_COMMON_H_
