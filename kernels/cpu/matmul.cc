// x [M, K] times a weight matrix [K, N] held in panels, for the few rows of a decode step,
// split over XLA's intra-op threads and called from XLA through the FFI.
//
// With 16 rows each weight element is used 16 times, so a decode step's dense projections
// are bound by reading the weights. XLA:CPU runs each such dot on one thread and reaches
// about half of one core's read bandwidth (docs/performance.md, the rollout engine). Here the weight
// is laid out as panels [ceil(N / 16), K, 16] (`pack` in __init__.py, once per weight
// version), so a thread reads its range of panels as one sequential stream, prefetched
// 8 KiB ahead, into a register block of up to kRows rows x 16 columns.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

using ptrain_cpu::kLanes;
using ptrain_cpu::kVecs;
using ptrain_cpu::loadN;
using ptrain_cpu::parallel_for;
using ptrain_cpu::storeN;
using ptrain_cpu::vN;

// Rows per register block, by the vector width the compiler targets: a block keeps a row's
// 16 columns of accumulators (kVecs registers) for each of its rows, plus the weight's 16
// columns, in registers. AVX-512 has 32 registers of 16 floats: 16 rows take 17. AVX2 has
// 16 of 8 floats: 6 rows take 14. NEON has 32 of 4 floats: 6 rows take 28.
#if defined(__AVX512F__)
constexpr int64_t kRows = 16;
#else
constexpr int64_t kRows = 6;
#endif
constexpr int64_t kAhead = 2048;  // floats prefetched ahead of the panel being read (8 KiB)

// out[r, 0:16] = sum over k < K of xT[k, r] * panel[k, 0:16], for r < R. xT holds a row
// block transposed (kRows floats per k), so the R broadcasts of a step share one line.
template <int R>
void panel_block(const float* panel, const float* xT, int64_t K, float* out, int64_t ldo, bool prefetch) {
  vN acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) acc[r][j] = vN{};
  for (int64_t k = 0; k < K; ++k, panel += 16, xT += kRows) {
    if (prefetch) __builtin_prefetch(panel + kAhead, 0, 3);
    vN wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = loadN(panel + j * kLanes);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kVecs; ++j) acc[r][j] += xT[r] * wv[j];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) storeN(out + r * ldo + j * kLanes, acc[r][j]);
}

using PanelFn = void (*)(const float*, const float*, int64_t, float*, int64_t, bool);

template <int... Rs>
constexpr std::array<PanelFn, sizeof...(Rs)> panel_table(std::integer_sequence<int, Rs...>) {
  return {&panel_block<Rs + 1>...};
}

constexpr auto kPanelFns = panel_table(std::make_integer_sequence<int, kRows>{});

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                        ffi::ResultBuffer<ffi::F32> out) {
  // x: [M, K]; panels: [P, K, 16]; out: [M, N] with 16 (P - 1) < N <= 16 P.
  auto xd = x.dimensions(), pd = panels.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || od.size() != 2 || pd[2] != 16 || pd[1] != xd[1] || od[0] != xd[0] ||
      od[1] > 16 * pd[0] || od[1] <= 16 * (pd[0] - 1)) {
    return ffi::Error::InvalidArgument("packed_matmul: expected x [M, K], panels [ceil(N / 16), K, 16], out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], P = pd[0], N = od[1];
  const float* xp = x.typed_data();
  const float* wp = panels.typed_data();
  float* op = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();

  // x in row blocks of kRows, transposed: xT[b][k][r] = x[kRows b + r, k], zeros past M.
  const int64_t row_blocks = (M + kRows - 1) / kRows;
  std::vector<float> xT(row_blocks * K * kRows, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    float* dst = xT.data() + (m / kRows) * K * kRows + m % kRows;
    for (int64_t k = 0; k < K; ++k) dst[k * kRows] = xp[m * K + k];
  }

  // Contiguous ranges of panels, a few per thread so a late thread still finds work.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_item = std::max<int64_t>(1, (P + 2 * threads - 1) / (2 * threads));
  const int64_t items = (P + per_item - 1) / per_item;
  auto body = [&](int64_t item) {
    float tail[kRows * 16];
    for (int64_t p = item * per_item; p < std::min(P, (item + 1) * per_item); ++p) {
      const float* panel = wp + p * K * 16;
      const bool ragged = 16 * (p + 1) > N;  // the last panel of an N that is not a multiple of 16
      for (int64_t b = 0; b < row_blocks; ++b) {
        const int64_t rows = std::min(kRows, M - b * kRows);
        float* dst = ragged ? tail : op + b * kRows * N + 16 * p;
        // Later row blocks read the panel back from cache: prefetch only on the first.
        kPanelFns[rows - 1](panel, xT.data() + b * K * kRows, K, dst, ragged ? 16 : N, b == 0);
        if (ragged) {
          for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(op + (b * kRows + r) * N + 16 * p, tail + r * 16, sizeof(float) * (N - 16 * p));
          }
        }
      }
    }
  };
  parallel_for(pool, items, threads - 1, body);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ptrain_packed_matmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
