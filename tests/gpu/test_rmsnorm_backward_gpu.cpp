// rmsnorm_backward on CUDA against the CPU reference (include/mxflash/fused.h): dx and dweight byte
// for byte, outputs poisoned first, on row lengths that give each lane count (4 to 32 lanes a row)
// and rows read in 1 to 256 chunks a lane, row counts that leave warps and CTAs part full and that
// make dweight's row groups longer than 512 (more than 4 M rows) and its group sums span several
// blocks, bf16 and fp32, weights in both dtypes or none, dweight not requested, no rows, rows over 40
// binades with zeros, inf and NaN; bf16 rows of 1 to 3 chunks a lane with dweight take the fused
// pass, the others the rows and group kernels.
// Then bad pointers (misaligned, on the CPU) rejected by name with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

struct BwdCase {
  int64_t T, C;
  bool bf16, has_w, w_bf16, want_dw, nonfinite;
};

void run_case(const BwdCase& s, uint32_t seed) {
  const std::string what = "T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) + (s.bf16 ? " bf16" : " fp32") +
                           (s.has_w ? (s.w_bf16 ? " w bf16" : " w fp32") : " no w") + (s.want_dw ? "" : " no dweight") +
                           (s.nonfinite ? " non-finite" : "");
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_real_distribution<float> binade(-20.f, 20.f);
  std::vector<float> x(size_t(s.T * s.C)), dy(x.size()), r(size_t(s.T)), w(size_t(s.C));
  for (int64_t t = 0; t < s.T; ++t) {
    const float sx = std::exp2(binade(rng)), sd = std::exp2(binade(rng) / 2);
    for (int64_t c = 0; c < s.C; ++c) {
      x[size_t(t * s.C + c)] = n01(rng) * sx;
      dy[size_t(t * s.C + c)] = n01(rng) * sd;
    }
    r[size_t(t)] = 1.f / sx;
  }
  for (auto& v : w) v = 1.f + 0.5f * n01(rng);
  if (s.nonfinite && s.T >= 4) {
    x[size_t(s.C / 2)] = std::numeric_limits<float>::quiet_NaN();
    dy[size_t(s.C + 3)] = std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < s.C; ++c) x[size_t(2 * s.C + c)] = 0.f;
    r[3] = std::numeric_limits<float>::infinity();
  }
  const DType xt = s.bf16 ? DType::kBFloat16 : DType::kFloat32, wt = s.w_bf16 ? DType::kBFloat16 : DType::kFloat32;
  std::vector<uint8_t> xb = input_bytes(x, s.bf16), dyb = input_bytes(dy, s.bf16), wb = input_bytes(w, s.w_bf16),
                       rb = input_bytes(r, false);
  const size_t esz = s.bf16 ? 2 : 4;
  std::vector<uint8_t> cdx(size_t(s.T * s.C) * esz), cdw(size_t(s.C) * 4);
  const bool dw = s.has_w && s.want_dw;
  // The same call on `dev` over its buffers.
  auto backward = [&](Device dev, void* x, void* w, void* r, void* dy, void* dx, void* dweight) {
    return rmsnorm_backward(make_view(x, xt, dev, {s.T, s.C}), s.has_w ? make_view(w, wt, dev, {s.C}) : TensorView{},
                            make_view(r, DType::kFloat32, dev, {s.T}), make_view(dy, xt, dev, {s.T, s.C}),
                            make_view(dx, xt, dev, {s.T, s.C}),
                            dw ? make_view(dweight, DType::kFloat32, dev, {s.C}) : TensorView{});
  };
  const Status cst = backward(Device::kCPU, xb.data(), wb.data(), rb.data(), dyb.data(), cdx.data(), cdw.data());
  ASSERT_TRUE(cst.ok()) << what << ": " << cst.message();

  DeviceBuffer gx(xb), gdy(dyb), gw(wb), gr(rb), gdx(cdx.size() + 64), gdw(cdw.size());
  gdx.fill(gputest::kDevicePoison);
  gdw.fill(gputest::kDevicePoison);
  const Status gst = backward(Device::kCUDA, gx.get(), gw.get(), gr.get(), gdy.get(), gdx.get(), gdw.get());
  ASSERT_TRUE(gst.ok()) << what << ": " << gst.message();
  ASSERT_TRUE(device_ok()) << what;
  std::vector<uint8_t> got = gdx.download();
  EXPECT_TRUE(std::all_of(got.begin() + long(cdx.size()), got.end(), [](uint8_t b) { return b == gputest::kDevicePoison; }))
      << what << ": written past dx";
  got.resize(cdx.size());
  EXPECT_TRUE(same_bytes(cdx, got)) << what << ": dx";
  const std::vector<uint8_t> gw_bytes = gdw.download();
  if (dw)
    EXPECT_TRUE(same_bytes(cdw, gw_bytes)) << what << ": dweight";
  else
    EXPECT_TRUE(std::all_of(gw_bytes.begin(), gw_bytes.end(), [](uint8_t b) { return b == gputest::kDevicePoison; }))
        << what << ": dweight written although not requested";
}

TEST(RmsNormBackwardGpu, EqualsCpuReference) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const BwdCase setups[] = {
      {1, 32, true, true, false, true, false},      {13, 96, true, true, true, true, false},
      {1003, 384, true, true, false, true, true},   {333, 512, false, true, false, true, false},
      {64, 768, true, false, false, false, false},  {41, 1024, true, true, true, false, true},
      {17, 1536, false, true, true, true, false},   {7, 2080, true, true, false, true, false},
      {3, 65536, true, true, true, true, false},    {4099, 128, false, true, false, true, true},
      {2500, 384, true, true, false, true, false},  {530001, 32, true, true, false, true, false},
      {0, 384, true, true, false, true, false},
      // the fused pass (bf16, dweight, up to 3 chunks a lane): 2 chunks a lane, 3 at 32 lanes, the
      // module's C on 16 lanes over 5 sum blocks, and groups of 1024 rows over 17 blocks
      {777, 512, true, true, true, true, false},    {300, 768, true, true, false, true, true},
      {530001, 384, true, true, true, true, false}, {4194305, 32, true, true, false, true, false},
  };
  uint32_t seed = 300;
  for (const BwdCase& s : setups) run_case(s, seed++);
}

TEST(RmsNormBackwardGpu, BadPointersAreNamedAndNothingIsWritten) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t T = 8, C = 256;
  DeviceBuffer gx(size_t(T * C * 2 + 64)), gw(size_t(C * 4 + 64)), gr(size_t(T * 4)), gdy(size_t(T * C * 2 + 64)),
      gdx(size_t(T * C * 2 + 64)), gdw(size_t(C * 4));
  for (DeviceBuffer* b : {&gx, &gw, &gdy}) b->fill(0x3F);
  gr.fill(0);
  auto* xb = static_cast<uint8_t*>(gx.get());
  auto* dyb = static_cast<uint8_t*>(gdy.get());
  auto* dxb = static_cast<uint8_t*>(gdx.get());
  auto* wbase = static_cast<uint8_t*>(gw.get());
  std::vector<float> host_rstd(T, 1.f);
  const TensorView x_ok = make_view(xb, DType::kBFloat16, Device::kCUDA, {T, C});
  const TensorView w_ok = make_view(wbase, DType::kFloat32, Device::kCUDA, {C});
  const TensorView r_ok = make_view(gr.get(), DType::kFloat32, Device::kCUDA, {T});
  const TensorView dy_ok = make_view(dyb, DType::kBFloat16, Device::kCUDA, {T, C});
  const TensorView dx_ok = make_view(dxb, DType::kBFloat16, Device::kCUDA, {T, C});
  const TensorView dw_ok = make_view(gdw.get(), DType::kFloat32, Device::kCUDA, {C});
  struct Bad {
    const char* name;
    const char* prefix;
    TensorView x, w, r, dy, dx;
  };
  const Bad bad[] = {
      {"x off 16 bytes", "x:", make_view(xb + 2, DType::kBFloat16, Device::kCUDA, {T, C}), w_ok, r_ok, dy_ok, dx_ok},
      {"weight off 16 bytes", "weight:", x_ok, make_view(wbase + 4, DType::kFloat32, Device::kCUDA, {C}), r_ok, dy_ok,
       dx_ok},
      {"dy off 16 bytes", "dy:", x_ok, w_ok, r_ok, make_view(dyb + 2, DType::kBFloat16, Device::kCUDA, {T, C}), dx_ok},
      {"dx off 16 bytes", "dx:", x_ok, w_ok, r_ok, dy_ok, make_view(dxb + 2, DType::kBFloat16, Device::kCUDA, {T, C})},
      {"rstd on the CPU", "rstd:", x_ok, w_ok, make_view(host_rstd.data(), DType::kFloat32, Device::kCPU, {T}), dy_ok,
       dx_ok},
  };
  for (const Bad& b : bad) {
    gdx.fill(gputest::kDevicePoison);
    gdw.fill(gputest::kDevicePoison);
    const Status st = rmsnorm_backward(b.x, b.w, b.r, b.dy, b.dx, dw_ok);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.name << ": " << st.message();
    EXPECT_EQ(st.message().rfind(b.prefix, 0), 0u) << b.name << ": " << st.message();
    ASSERT_TRUE(device_ok());
    for (DeviceBuffer* buf : {&gdx, &gdw}) {
      const std::vector<uint8_t> v = buf->download();
      EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](uint8_t c) { return c == gputest::kDevicePoison; })) << b.name;
    }
  }
  const Status ok = rmsnorm_backward(x_ok, w_ok, r_ok, dy_ok, dx_ok, dw_ok);
  EXPECT_TRUE(ok.ok()) << ok.message();
  ASSERT_TRUE(device_ok());
}

}  // namespace
}  // namespace mxflash
