// Shared by the CPU kernels: a deadlock-free parallel loop over XLA's intra-op thread pool,
// and 16-lane float vectors (GCC's vector extension: AVX-512, AVX2 or NEON code as the
// -march=native target has them).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ptrain_cpu {

namespace ffi = xla::ffi;

// Runs body(i) for i in [0, n) on the calling thread and up to `helpers` pool threads.
// Items are claimed from a shared counter, so a helper that starts late finds nothing left,
// and the caller waits only for items that a running thread has claimed: no deadlock when
// every pool thread is itself inside such a loop. A helper that runs after the caller has
// returned touches only the counters it shares ownership of.
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t helpers, const Body& body) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto run = [state, n, &body]() {
    int64_t i;
    while ((i = state->next.fetch_add(1, std::memory_order_relaxed)) < n) {
      body(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < std::min<int64_t>(helpers, n - 1); ++h) pool.Schedule([run]() { run(); });
  run();
  // Only claimed items are outstanding, each on a running thread; yield rather than spin so
  // that thread gets the core when the process has fewer cores than threads.
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// The widest float vector the target keeps in one register: GCC lowers a 16-lane vector
// on AVX2 or NEON through memory, so a kernel whose accumulators must stay in registers
// works in these and takes 16 lanes as kVecs of them.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int kVecs = 16 / kLanes;
typedef float vN __attribute__((vector_size(4 * kLanes)));

inline vN loadN(const float* p) {
  vN v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storeN(float* p, vN v) { std::memcpy(p, &v, sizeof(v)); }

}  // namespace ptrain_cpu
