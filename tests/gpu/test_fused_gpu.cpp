// rmsnorm_quantize on CUDA against the CPU reference (include/mxflash/fused.h): payload, scales and
// rstd byte for byte, outputs poisoned first, on row lengths that take each of the kernel's forms
// (a row held in 1, 2, 3, 4, 6 or 8 chunks a lane, or read twice), row counts that leave CTAs part
// full, both input and weight dtypes, no weight, no rstd, both scaling modes, rows spread over 40
// binades, and rows with NaN, inf, zeros and sums of squares that overflow. Then bad pointers:
// misaligned, or on another device, rejected by name with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "mxflash/fused.h"

namespace mxflash {
namespace {

using gputest::DeviceBuffer;
using gputest::device_ok;
using gputest::input_bytes;
using gputest::same_bytes;

struct RmsCase {
  int64_t T, C;
  bool x_bf16, has_w, w_bf16, rstd;
  ScalingMode mode;
  bool nonfinite;
};

std::vector<float> make_rows(int64_t T, int64_t C, uint32_t seed, bool nonfinite) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_real_distribution<float> binade(-20.f, 20.f);
  std::vector<float> x(size_t(T * C));
  for (int64_t t = 0; t < T; ++t) {
    const float sigma = std::exp2(binade(rng));
    for (int64_t c = 0; c < C; ++c) x[size_t(t * C + c)] = n01(rng) * sigma;
  }
  if (nonfinite && T >= 6) {
    x[size_t(0 * C + C / 2)] = std::numeric_limits<float>::quiet_NaN();
    x[size_t(1 * C + 7)] = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < C; ++c) x[size_t(2 * C + c)] = 0.f;
    for (int64_t c = 0; c < C; ++c) x[size_t(3 * C + c)] = 1e38f * (c % 2 ? 1.f : -1.f);  // bf16: still finite
    x[size_t(4 * C + 3)] = std::numeric_limits<float>::infinity();
    x[size_t(4 * C + 5)] = std::numeric_limits<float>::quiet_NaN();
  }
  return x;
}

void run_case(const RmsCase& s, uint32_t seed, float eps) {
  const std::string what = "T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) + " x " +
                           (s.x_bf16 ? "bf16" : "fp32") + (s.has_w ? (s.w_bf16 ? " w bf16" : " w fp32") : " no w") +
                           (s.rstd ? "" : " no rstd") + " mode " + std::to_string(int(s.mode)) +
                           (s.nonfinite ? " non-finite rows" : "");
  const std::vector<float> xs = make_rows(s.T, s.C, seed, s.nonfinite);
  std::vector<float> ws(size_t(s.C));
  std::mt19937 rng(seed + 1000);
  std::normal_distribution<float> n01(0.f, 1.f);
  for (auto& v : ws) v = 1.f + 0.5f * n01(rng);
  std::vector<uint8_t> xb = input_bytes(xs, s.x_bf16), wb = input_bytes(ws, s.w_bf16);
  const DType xt = s.x_bf16 ? DType::kBFloat16 : DType::kFloat32, wt = s.w_bf16 ? DType::kBFloat16 : DType::kFloat32;
  RmsNormQuantizeOptions opt;
  opt.eps = eps;
  opt.mode = s.mode;

  // CPU reference.
  std::vector<uint8_t> cp(size_t(s.T * s.C)), cs(size_t(s.T * s.C / 32)), cr(size_t(s.T) * 4);
  const Status cst = rmsnorm_quantize(
      make_view(xb.data(), xt, Device::kCPU, {s.T, s.C}),
      s.has_w ? make_view(wb.data(), wt, Device::kCPU, {s.C}) : TensorView{}, opt,
      make_view(cp.data(), DType::kE4M3, Device::kCPU, {s.T, s.C}),
      make_view(cs.data(), DType::kE8M0, Device::kCPU, {s.T, s.C / 32}),
      make_view(cr.data(), DType::kFloat32, Device::kCPU, {s.T}));
  ASSERT_TRUE(cst.ok()) << what << ": " << cst.message();

  DeviceBuffer dx(xb), dw(wb), dp(cp.size()), ds(cs.size()), dr(cr.size());
  for (DeviceBuffer* b : {&dp, &ds, &dr}) b->fill(gputest::kDevicePoison);
  const Status gst = rmsnorm_quantize(
      make_view(dx.get(), xt, Device::kCUDA, {s.T, s.C}),
      s.has_w ? make_view(dw.get(), wt, Device::kCUDA, {s.C}) : TensorView{}, opt,
      make_view(dp.get(), DType::kE4M3, Device::kCUDA, {s.T, s.C}),
      make_view(ds.get(), DType::kE8M0, Device::kCUDA, {s.T, s.C / 32}),
      s.rstd ? make_view(dr.get(), DType::kFloat32, Device::kCUDA, {s.T}) : TensorView{});
  ASSERT_TRUE(gst.ok()) << what << ": " << gst.message();
  ASSERT_TRUE(device_ok()) << what;
  EXPECT_TRUE(same_bytes(cp, dp.download())) << what << ": payload";
  EXPECT_TRUE(same_bytes(cs, ds.download())) << what << ": scales";
  if (s.rstd) {
    EXPECT_TRUE(same_bytes(cr, dr.download())) << what << ": rstd";
  } else {
    const std::vector<uint8_t> r = dr.download();
    EXPECT_TRUE(std::all_of(r.begin(), r.end(), [](uint8_t b) { return b == gputest::kDevicePoison; }))
        << what << ": rstd written although not requested";
  }
}

TEST(RmsNormQuantizeGpu, EqualsCpuReferenceOnEveryKernelForm) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const ScalingMode R = ScalingMode::kRceil, F = ScalingMode::kFloor;
  const RmsCase setups[] = {
      {1, 32, true, true, false, true, R, false},      {13, 96, true, true, true, true, R, false},
      {1003, 384, true, true, false, true, R, true},   {333, 512, false, true, false, true, F, false},
      {64, 768, true, false, false, false, R, false},  {41, 1024, true, true, true, true, F, true},
      {17, 1536, false, true, true, true, R, false},   {9, 2048, true, true, false, true, R, true},
      {7, 2080, true, true, false, true, F, false},    {11, 4096, false, false, false, true, R, true},
      {2, 65536, true, true, true, true, R, false},    {4099, 128, true, true, false, true, R, false},
  };
  uint32_t seed = 100;
  for (const RmsCase& s : setups) {
    run_case(s, seed++, 1e-6f);
    run_case(s, seed++, 0.f);  // eps 0: all-zero rows give NaN everywhere (rstd inf)
  }
}

TEST(RmsNormQuantizeGpu, BadPointersAreNamedAndNothingIsWritten) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t T = 8, C = 256;
  DeviceBuffer dx(size_t(T * C * 2 + 64)), dw(size_t(C * 4 + 64)), dp(size_t(T * C + 64)), ds(size_t(T * C / 32)),
      dr(size_t(T * 4));
  dx.fill(0x3F);
  dw.fill(0x3F);
  auto* xb = static_cast<uint8_t*>(dx.get());
  auto* wbase = static_cast<uint8_t*>(dw.get());
  auto* pb = static_cast<uint8_t*>(dp.get());
  std::vector<float> host_rstd(T);
  struct Bad {
    const char* name;
    const char* prefix;
    TensorView x, w, p, r;
  };
  const TensorView x_ok = make_view(xb, DType::kBFloat16, Device::kCUDA, {T, C});
  const TensorView w_ok = make_view(wbase, DType::kFloat32, Device::kCUDA, {C});
  const TensorView p_ok = make_view(pb, DType::kE4M3, Device::kCUDA, {T, C});
  const TensorView r_ok = make_view(dr.get(), DType::kFloat32, Device::kCUDA, {T});
  const Bad bad[] = {
      {"x off 16 bytes", "x:", make_view(xb + 2, DType::kBFloat16, Device::kCUDA, {T, C}), w_ok, p_ok, r_ok},
      {"weight off 16 bytes", "weight:", x_ok, make_view(wbase + 4, DType::kFloat32, Device::kCUDA, {C}), p_ok, r_ok},
      {"payload off 8 bytes", "payload:", x_ok, w_ok, make_view(pb + 4, DType::kE4M3, Device::kCUDA, {T, C}), r_ok},
      {"rstd on the CPU", "rstd:", x_ok, w_ok, p_ok, make_view(host_rstd.data(), DType::kFloat32, Device::kCPU, {T})},
  };
  for (const Bad& b : bad) {
    for (DeviceBuffer* buf : {&dp, &ds, &dr}) buf->fill(gputest::kDevicePoison);
    const Status st = rmsnorm_quantize(b.x, b.w, RmsNormQuantizeOptions{}, b.p,
                                       make_view(ds.get(), DType::kE8M0, Device::kCUDA, {T, C / 32}), b.r);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.name << ": " << st.message();
    EXPECT_EQ(st.message().rfind(b.prefix, 0), 0u) << b.name << ": " << st.message();
    ASSERT_TRUE(device_ok());
    for (DeviceBuffer* buf : {&dp, &ds, &dr}) {
      const std::vector<uint8_t> v = buf->download();
      EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](uint8_t c) { return c == gputest::kDevicePoison; })) << b.name;
    }
  }
  // The same call with aligned pointers succeeds.
  const Status ok = rmsnorm_quantize(x_ok, w_ok, RmsNormQuantizeOptions{}, p_ok,
                                     make_view(ds.get(), DType::kE8M0, Device::kCUDA, {T, C / 32}), r_ok);
  EXPECT_TRUE(ok.ok()) << ok.message();
  ASSERT_TRUE(device_ok());
}

}  // namespace
}  // namespace mxflash
