// Single-token attention over the KV cache for the rollout engine's decode step, called from
// XLA through the FFI.
//
// XLA:CPU runs single-token attention as dozens of tiny batched matmuls after copying the
// cache's used slots out (docs/performance.md, the rollout engine). The kernel below reads each
// visible key and value once, in place, and splits (row, kv head) pairs over XLA's
// intra-op thread pool. ptrain/kernels/cpu/__init__.py builds it at first use with the host
// compiler (-O3 -march=native), so the vector code is the CPU's own.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

using ptrain_cpu::kLanes;
using ptrain_cpu::load16;
using ptrain_cpu::loadN;
using ptrain_cpu::parallel_for;
using ptrain_cpu::store16;
using ptrain_cpu::storeN;
using ptrain_cpu::v16;
using ptrain_cpu::v16i;
using ptrain_cpu::vN;

inline float sum16(v16 v) {  // a shuffle tree, not 15 scalar extracts
  v16 t = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  t += __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  t += __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  t += __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return t[0];
}

// exp for x <= 0 (scores minus their maximum), 16 lanes: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2 and p a degree-6 Taylor polynomial (relative error < 3e-7). Below -87 the
// result is 0, as is exp(-inf) for masked slots.
inline v16 exp16(v16 x) {
  const auto tiny = x < -87.f;
  x = tiny ? -87.f : x;
  const float round_bias = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const v16 n = (x * 1.44269504f + round_bias) - round_bias;
  const v16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  v16 p = r * (1.f / 720) + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return tiny ? 0.f : p * two_n;
}

// Sum of a native vector's lanes by a shuffle tree (not kLanes scalar extracts).
inline float sumN(vN v) {
#if defined(__AVX512F__)
  return sum16(v);
#elif defined(__AVX__)
  vN t = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  t += __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5);
  t += __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6);
  return t[0];
#else
  vN t = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
  t += __builtin_shufflevector(t, t, 1, 0, 3, 2);
  return t[0];
#endif
}

// The hot loops below (a score per visible key, a value row per visible slot) work in the
// target's native vectors, which GCC keeps in registers on AVX-512, AVX2 and NEON alike.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float acc = 0.f;
  if (n >= kLanes) {
    vN va = loadN(a) * loadN(b);
    for (d = kLanes; d + kLanes <= n; d += kLanes) va += loadN(a + d) * loadN(b + d);
    acc = sumN(va);
  }
  for (; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) storeN(y + d, loadN(y + d) + p * loadN(x + d));
  for (; d < n; ++d) y[d] += p * x[d];
}

constexpr int64_t kAhead = 2048;  // floats of keys or values prefetched ahead of the slot being read (8 KiB)

// out[g, :] = softmax_s(scale * q[g] . k[s]) v[s] over the slots s < S with mask[s] set, for
// the G query heads that share one kv head; no visible slot gives zeros.
// q, out: [G, Dh]; k, v: [S_max, Dh]; scores: scratch [G, S rounded up to 16].
void attend_one(const float* q, const float* k, const float* v, const bool* mask, float* out, int64_t G, int64_t S,
                int64_t Dh, float scale, float* scores) {
  std::memset(out, 0, sizeof(float) * G * Dh);
  const int64_t S16 = (S + 15) / 16 * 16;
  float m[64];  // G <= 64 (checked by the caller)
  for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t s = 0; s < S; ++s) {
    const float* ks = k + s * Dh;
    for (int64_t d = 0; d < Dh; d += 16) {
      __builtin_prefetch(ks + kAhead + d, 0, 3);
      if (s * Dh < kAhead) __builtin_prefetch(v + s * Dh + d, 0, 3);  // the values' first slots
    }
    for (int64_t g = 0; g < G; ++g) {
      float x = -INFINITY;
      if (mask[s]) {
        x = scale * dot(q + g * Dh, ks, Dh);
        m[g] = std::max(m[g], x);
      }
      scores[g * S16 + s] = x;
    }
  }
  if (m[0] == -INFINITY) return;  // no visible slot (the mask is shared by the G heads)
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * S16;
    for (int64_t s = S; s < S16; ++s) sc[s] = -INFINITY;
    v16 total = v16{};
    for (int64_t s = 0; s < S16; s += 16) {
      const v16 p = exp16(load16(sc + s) - m[g]);
      store16(sc + s, p);
      total += p;
    }
    const float inv = 1.f / sum16(total);
    for (int64_t s = 0; s < S16; ++s) sc[s] *= inv;
  }
  for (int64_t s = 0; s < S; ++s) {
    const float* vs = v + s * Dh;
    for (int64_t d = 0; d < Dh; d += 16) __builtin_prefetch(vs + kAhead + d, 0, 3);
    if (!mask[s]) continue;
    for (int64_t g = 0; g < G; ++g) axpy(scores[g * S16 + s], vs, out + g * Dh, Dh);
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::PRED> mask, float scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  // q: [B, H, Dh]; caches: [R, K, S_max, Dh] with R >= B; mask: [B, S] with S <= S_max.
  auto qd = q.dimensions(), cd = k_cache.dimensions(), md = mask.dimensions();
  if (qd.size() != 3 || cd.size() != 4 || md.size() != 2) {
    return ffi::Error::InvalidArgument("decode_attention: expected q [B, H, Dh], caches [R, K, S_max, Dh], mask [B, S]");
  }
  const int64_t B = qd[0], H = qd[1], Dh = qd[2], R = cd[0], K = cd[1], S_max = cd[2], S = md[1];
  if (cd[3] != Dh || R < B || H % K != 0 || H / K > 64 || md[0] != B || S > S_max) {
    return ffi::Error::InvalidArgument("decode_attention: shapes of q, caches and mask do not agree");
  }
  const int64_t G = H / K;
  const float* qp = q.typed_data();
  const float* kp = k_cache.typed_data();
  const float* vp = v_cache.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  // Two (row, head) pairs per item: enough items to balance, few enough to keep claims cheap.
  const int64_t pairs = B * K, per = 2, items = (pairs + per - 1) / per;
  auto body = [&](int64_t item) {
    std::vector<float> scores(G * ((S + 15) / 16 * 16));
    for (int64_t p = item * per; p < std::min(pairs, (item + 1) * per); ++p) {
      const int64_t b = p / K, kh = p % K;
      const int64_t cache_off = (b * K + kh) * S_max * Dh;
      attend_one(qp + (b * H + kh * G) * Dh, kp + cache_off, vp + cache_off, mp + b * S, op + (b * H + kh * G) * Dh,
                 G, S, Dh, scale, scores.data());
    }
  };
  parallel_for(pool, items, std::max<int64_t>(1, pool.num_threads() - 1), body);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ptrain_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
