// gemm_quantize on CUDA (include/mxflash/fused.h), outputs poisoned first:
//  - the exact path equals the CPU reference byte for byte (any multiple-of-32 shape);
//  - the coarse (wgmma) path equals the CPU model of its arithmetic up to the tensor cores'
//    accumulation (nearly_same says how close), on shapes with partial row tiles, K tails, several
//    N panels, more tiles than SMs, block scales up to 12 binades apart (the subnormal rounding of
//    the re-expression), NaN scales and zero blocks;
//  - the automatic choice falls back to the exact path where the coarse kernel cannot run;
//  - bad pointers are rejected by name with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gemm_operands.h"
#include "gpu_test_util.h"
#include "mxflash/fused.h"

namespace mxflash {
namespace {

using gputest::DeviceBuffer;
using gputest::device_ok;
using gputest::same_bytes;

using Operand = mxtest::GemmOperand;
// With zero blocks (scale byte 0) in every operand.
Operand make_operand(int64_t rows, int64_t k, uint32_t seed, int spread) {
  return mxtest::make_gemm_operand(rows, k, seed, spread, /*uniform_rows=*/false, /*zero_blocks=*/true);
}

using Outputs = mxtest::GemmOutputs;

Status run(const Operand& a, const Operand& w, GemmPath path, ScalingMode mode, Device dev, Outputs* out) {
  if (dev == Device::kCPU) return mxtest::gemm_quantize_cpu(a, w, path, mode, gputest::kHostPoison, out);
  const int64_t M = a.rows, N = w.rows, K = a.k;
  GemmQuantizeOptions opt;
  opt.path = path;
  opt.mode = mode;
  DeviceBuffer da(a.payload), dsa(a.scales), dw(w.payload), dsw(w.scales), dp(size_t(M * N)), ds(size_t(M * N / 32));
  dp.fill(gputest::kDevicePoison);
  ds.fill(gputest::kDevicePoison);
  const Status st = gemm_quantize(make_view(da.get(), DType::kE4M3, dev, {M, K}),
                                  make_view(dsa.get(), DType::kE8M0, dev, {M, K / 32}),
                                  make_view(dw.get(), DType::kE4M3, dev, {N, K}),
                                  make_view(dsw.get(), DType::kE8M0, dev, {N, K / 32}), opt,
                                  make_view(dp.get(), DType::kE4M3, dev, {M, N}),
                                  make_view(ds.get(), DType::kE8M0, dev, {M, N / 32}));
  if (!st.ok()) return st;
  EXPECT_TRUE(device_ok());
  out->payload = dp.download();
  out->scales = ds.download();
  return st;
}

double e4m3_value(uint8_t b) { return double(e4m3_to_float(b)); }

// The coarse kernel against the CPU model of its arithmetic. The model sums each product exactly;
// FP8 wgmma adds inside a 512-deep chain with ~14 significant bits before the fp32 promotion, so a
// value may move by a few 2^-14 of its partial sums: a byte near a rounding boundary takes the next
// code, and a small value left by cancellation can take many codes (or the other sign). So: scale
// bytes equal or one apart, every byte the model's, an adjacent code, or a value within 2^-8 x 448 x
// scale of the model's (a sixteenth of the top binade's code step: a wrong shift or a lost block is
// far larger; in a block re-scaled by one binade, within an eighth of the larger scale's range),
// and at most `max_frac` of the bytes different.
::testing::AssertionResult nearly_same(const Outputs& want, const Outputs& got, double max_frac) {
  size_t diff = 0, sdiff = 0;
  double worst = 0;
  for (size_t i = 0; i < want.scales.size(); ++i) {
    if (want.scales[i] == got.scales[i]) continue;
    ++sdiff;
    if (std::abs(int(want.scales[i]) - int(got.scales[i])) != 1)
      return ::testing::AssertionFailure() << "scale " << i << ": " << int(want.scales[i]) << " vs " << int(got.scales[i]);
  }
  for (size_t i = 0; i < want.payload.size(); ++i) {
    const uint8_t ws = want.scales[i / 32], gs = got.scales[i / 32];
    if (ws == 0xFF || gs == 0xFF) {  // NaN rows and channels: NaN where the model has NaN, else +-0
      const bool want_nan = (want.payload[i] & 0x7F) == 0x7F, got_nan = (got.payload[i] & 0x7F) == 0x7F;
      if (ws != gs || want_nan != got_nan || (!want_nan && ((want.payload[i] | got.payload[i]) & 0x7F) != 0))
        return ::testing::AssertionFailure() << "NaN block, byte " << i << ": " << int(want.payload[i]) << " vs "
                                             << int(got.payload[i]);
      continue;
    }
    if (want.payload[i] == got.payload[i] && ws == gs) continue;
    ++diff;
    const double unit = std::ldexp(1.0, int(ws) - 127);
    const double d = std::fabs(e4m3_value(want.payload[i]) * unit - e4m3_value(got.payload[i]) * std::ldexp(1.0, int(gs) - 127));
    worst = std::max(worst, d / (448 * unit));
    const bool adjacent = ws == gs && (want.payload[i] & 0x80) == (got.payload[i] & 0x80) &&
                          std::abs(int(want.payload[i] & 0x7F) - int(got.payload[i] & 0x7F)) == 1;
    // A block whose amax crossed a scale boundary (e.g. 448 saturated against 256 at the next
    // scale): its elements within an eighth of the larger scale's range.
    const double tol = ws == gs ? 448 * unit / 256 : 448 * std::ldexp(1.0, std::max(int(ws), int(gs)) - 127) / 8;
    if (!adjacent && d > tol)
      return ::testing::AssertionFailure() << "byte " << i << ": " << int(want.payload[i]) << " (scale " << int(ws)
                                           << ") vs " << int(got.payload[i]) << " (scale " << int(gs) << ")";
  }
  if (double(diff) > max_frac * double(want.payload.size()))
    return ::testing::AssertionFailure() << diff << " bytes and " << sdiff << " scales differ";
  return ::testing::AssertionSuccess() << diff << " bytes, " << sdiff << " scales differ, worst " << worst
                                       << " of the block range";
}

TEST(GemmQuantizeGpu, ExactPathEqualsCpuReference) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  struct Shape {
    int64_t M, N, K;
    ScalingMode mode;
  };
  const Shape shapes[] = {{1, 32, 32, ScalingMode::kRceil},
                          {77, 96, 160, ScalingMode::kFloor},
                          {300, 384, 384, ScalingMode::kRceil},
                          {129, 128, 1024, ScalingMode::kRceil}};
  uint32_t seed = 1;
  for (const Shape& s : shapes) {
    Operand a = make_operand(s.M, s.K, seed++, 8), w = make_operand(s.N, s.K, seed++, 8);
    if (s.M > 2) a.scales[size_t(s.K / 32 + 0)] = 0xFF;  // row 1: NaN
    Outputs cpu, gpu;
    ASSERT_TRUE(run(a, w, GemmPath::kExact, s.mode, Device::kCPU, &cpu).ok());
    const Status st = run(a, w, GemmPath::kExact, s.mode, Device::kCUDA, &gpu);
    ASSERT_TRUE(st.ok()) << st.message();
    const std::string what = std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K);
    EXPECT_TRUE(same_bytes(cpu.payload, gpu.payload)) << what;
    EXPECT_TRUE(same_bytes(cpu.scales, gpu.scales)) << what;
  }
}

TEST(GemmQuantizeGpu, CoarsePathEqualsCpuModel) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  struct Shape {
    int64_t M, N, K;
    int spread;
    ScalingMode mode;
  };
  const Shape shapes[] = {
      {128, 128, 128, 3, ScalingMode::kRceil},  {300, 384, 384, 6, ScalingMode::kRceil},
      {1000, 256, 160, 12, ScalingMode::kFloor}, {4099, 384, 384, 2, ScalingMode::kRceil},
      {257, 768, 1024, 4, ScalingMode::kRceil},  {20000, 128, 256, 1, ScalingMode::kRceil},
      {513, 256, 768, 5, ScalingMode::kFloor},   {200, 128, 2048, 3, ScalingMode::kRceil},
  };
  uint32_t seed = 50;
  for (const Shape& s : shapes) {
    Operand a = make_operand(s.M, s.K, seed++, s.spread), w = make_operand(s.N, s.K, seed++, s.spread);
    a.scales[size_t(5 * (s.K / 32) + 1)] = 0xFF;  // row 5: NaN
    w.scales[size_t(7 * (s.K / 32))] = 0xFF;      // channel 7: NaN
    Outputs cpu, gpu;
    ASSERT_TRUE(run(a, w, GemmPath::kCoarse, s.mode, Device::kCPU, &cpu).ok());
    const Status st = run(a, w, GemmPath::kCoarse, s.mode, Device::kCUDA, &gpu);
    ASSERT_TRUE(st.ok()) << st.message();
    const std::string what = std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K);
    const ::testing::AssertionResult r = nearly_same(cpu, gpu, 0.02);
    EXPECT_TRUE(r) << what;
    std::printf("coarse %s: %s\n", what.c_str(), r.message());
  }
}

TEST(GemmQuantizeGpu, AutoFallsBackToExactWhereCoarseCannotRun) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  // N = 160 is not a multiple of 128; M = 64 is below a tile: both take the exact path.
  for (auto [M, N] : {std::pair<int64_t, int64_t>{300, 160}, {64, 256}}) {
    const Operand a = make_operand(M, 256, 90, 4), w = make_operand(N, 256, 91, 4);
    Outputs cpu, gpu;
    ASSERT_TRUE(run(a, w, GemmPath::kExact, ScalingMode::kRceil, Device::kCPU, &cpu).ok());
    ASSERT_TRUE(run(a, w, GemmPath::kAuto, ScalingMode::kRceil, Device::kCUDA, &gpu).ok());
    EXPECT_TRUE(same_bytes(cpu.payload, gpu.payload)) << M << "x" << N;
    EXPECT_TRUE(same_bytes(cpu.scales, gpu.scales)) << M << "x" << N;
    Outputs bad;
    const Status st = run(a, w, GemmPath::kCoarse, ScalingMode::kRceil, Device::kCUDA, &bad);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("path"), std::string::npos) << st.message();
  }
}

TEST(GemmQuantizeGpu, BadPointersAreNamedAndNothingIsWritten) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t M = 256, N = 128, K = 128;
  DeviceBuffer da(size_t(M * K + 64)), dsa(size_t(M * K / 32)), dw(size_t(N * K)), dsw(size_t(N * K / 32)),
      dp(size_t(M * N)), ds(size_t(M * N / 32));
  dp.fill(gputest::kDevicePoison);
  ds.fill(gputest::kDevicePoison);
  GemmQuantizeOptions opt;
  opt.path = GemmPath::kCoarse;
  auto* a1 = static_cast<uint8_t*>(da.get()) + 1;  // misaligned
  Status st = gemm_quantize(make_view(a1, DType::kE4M3, Device::kCUDA, {M, K}),
                            make_view(dsa.get(), DType::kE8M0, Device::kCUDA, {M, K / 32}),
                            make_view(dw.get(), DType::kE4M3, Device::kCUDA, {N, K}),
                            make_view(dsw.get(), DType::kE8M0, Device::kCUDA, {N, K / 32}), opt,
                            make_view(dp.get(), DType::kE4M3, Device::kCUDA, {M, N}),
                            make_view(ds.get(), DType::kE8M0, Device::kCUDA, {M, N / 32}));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("aligned"), std::string::npos) << st.message();
  std::vector<uint8_t> host_scales(size_t(N * K / 32));
  st = gemm_quantize(make_view(da.get(), DType::kE4M3, Device::kCUDA, {M, K}),
                     make_view(dsa.get(), DType::kE8M0, Device::kCUDA, {M, K / 32}),
                     make_view(dw.get(), DType::kE4M3, Device::kCUDA, {N, K}),
                     make_view(host_scales.data(), DType::kE8M0, Device::kCPU, {N, K / 32}), GemmQuantizeOptions{},
                     make_view(dp.get(), DType::kE4M3, Device::kCUDA, {M, N}),
                     make_view(ds.get(), DType::kE8M0, Device::kCUDA, {M, N / 32}));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("w_scales"), std::string::npos) << st.message();
  ASSERT_TRUE(device_ok());
  for (uint8_t b : dp.download()) ASSERT_EQ(b, gputest::kDevicePoison);
  for (uint8_t b : ds.download()) ASSERT_EQ(b, gputest::kDevicePoison);
}

}  // namespace
}  // namespace mxflash
