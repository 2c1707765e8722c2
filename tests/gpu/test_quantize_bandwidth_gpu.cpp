// Quantizer bandwidth against a device-to-device copy, on ~1 GiB of input. Disabled by default (it
// measures, it does not check correctness); run it with
//   mxflash_tests_gpu --gtest_also_run_disabled_tests --gtest_filter='*Bandwidth*'
// It prints TB/s counting read + write bytes, and the ratio to cudaMemcpy of the input size, and
// fails when a mode is below 85% of the copy (the bar of the quantizer).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "mxflash/jagged.h"
#include "mxflash/quantize.h"

namespace mxflash {
namespace {

using gputest::DeviceBuffer;

constexpr int kWarmup = 3;
constexpr int kIters = 20;
constexpr double kBar = 0.85;

// Median time of kIters launches of fn, in seconds.
double time_median(const std::function<void()>& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < kWarmup; ++i) fn();
  std::vector<float> ms(kIters);
  for (int i = 0; i < kIters; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms[size_t(i)], a, b);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[kIters / 2] * 1e-3;
}

void run_bandwidth(const std::vector<int64_t>& lengths, int64_t H, bool bf16) {
  JaggedMeta meta;
  ASSERT_TRUE(JaggedMeta::FromLengths(lengths, &meta).ok());
  ASSERT_TRUE(meta.upload().ok());
  const int64_t T = meta.total_tokens(), n = T * H * kHeadDim;
  const size_t in_bytes = size_t(n) * (bf16 ? 2 : 4);
  DeviceBuffer x(in_bytes), copy(in_bytes);
  x.fill(0x3C);  // finite values: 0x3C3C as bf16 (~0.011), 0x3C3C3C3C as fp32
  const TensorView xv =
      gputest::view_of(x.get(), bf16 ? DType::kBFloat16 : DType::kFloat32, Device::kCUDA, {T, H, kHeadDim});

  const double copy_s = time_median([&] { cudaMemcpyAsync(copy.get(), x.get(), in_bytes, cudaMemcpyDeviceToDevice); });
  const double copy_bw = 2.0 * double(in_bytes) / copy_s;
  std::printf("%s input, T=%lld H=%lld (%.2f GiB): device copy %.3f TB/s\n", bf16 ? "bf16" : "fp32", (long long)T,
              (long long)H, double(in_bytes) / double(1 << 30), copy_bw * 1e-12);

  struct Mode {
    const char* name;
    bool hdim, tok;
    Orientation o;
    PayloadLayout pl;
  };
  const Mode modes[] = {
      {"hdim", true, false, Orientation::kHdim, PayloadLayout::kTokenMajor},
      {"seq token-major", false, true, Orientation::kSeq, PayloadLayout::kTokenMajor},
      {"seq token-contiguous", false, true, Orientation::kSeq, PayloadLayout::kTokenContiguous},
      {"square32 token-major", false, true, Orientation::kSquare32, PayloadLayout::kTokenMajor},
      {"square32 token-contiguous", false, true, Orientation::kSquare32, PayloadLayout::kTokenContiguous},
      {"hdim+seq token-major", true, true, Orientation::kSeq, PayloadLayout::kTokenMajor},
      {"hdim+seq token-contiguous", true, true, Orientation::kSeq, PayloadLayout::kTokenContiguous},
  };
  for (ScaleLayout sl : {ScaleLayout::kPlain, ScaleLayout::kBlocked128x4}) {
    for (const Mode& m : modes) {
      QuantizeOptions opt;
      opt.scale_layout = sl;
      opt.payload_layout = m.pl;
      int64_t ps[3];
      payload_shape(meta, H, m.pl, ps);
      const ScaleShape hs = scale_shape(meta, H, Orientation::kHdim, sl);
      const ScaleShape ts = scale_shape(meta, H, m.o, sl);
      DeviceBuffer ph{size_t(n)}, sh{size_t(hs.numel())}, pt{size_t(ps[0] * ps[1] * ps[2])}, st{size_t(ts.numel())};
      const TensorView phv = gputest::view_of(ph.get(), DType::kE4M3, Device::kCUDA, {T, H, kHeadDim});
      const TensorView shv = make_view(sh.get(), DType::kE8M0, Device::kCUDA, hs.ndim, hs.dims);
      const TensorView ptv = gputest::view_of(pt.get(), DType::kE4M3, Device::kCUDA, {ps[0], ps[1], ps[2]});
      const TensorView stv = make_view(st.get(), DType::kE8M0, Device::kCUDA, ts.ndim, ts.dims);
      Status status;
      const auto run = [&] {
        if (m.hdim && m.tok)
          status = quantize_hdim_seq(xv, meta, opt, phv, shv, ptv, stv);
        else if (m.hdim)
          status = quantize(xv, meta, Orientation::kHdim, opt, phv, shv);
        else
          status = quantize(xv, meta, m.o, opt, ptv, stv);
      };
      const double s = time_median(run);
      ASSERT_TRUE(status.ok()) << status.message();
      ASSERT_TRUE(gputest::device_ok());
      double bytes = double(in_bytes);
      if (m.hdim) bytes += double(ph.size() + sh.size());
      if (m.tok) bytes += double(pt.size() + st.size());
      const double bw = bytes / s;
      std::printf("  %-26s %-12s %8.1f us  %.3f TB/s  %5.1f%% of copy\n", m.name, to_string(sl), s * 1e6, bw * 1e-12,
                  100.0 * bw / copy_bw);
      EXPECT_GE(bw / copy_bw, kBar) << m.name << " " << to_string(sl);
    }
  }
}

TEST(QuantizeGpu, DISABLED_BandwidthBf16OneGiB) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  run_bandwidth(std::vector<int64_t>(64, 4096), 16, true);  // 64 x 4096 tokens x 16 heads x 128 x 2 B
}

TEST(QuantizeGpu, DISABLED_BandwidthBf16OneGiBJagged) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  std::vector<int64_t> lengths;
  for (int i = 0; lengths.size() < 2048; ++i) lengths.push_back(1 + (i * 2654435761u) % 255);  // mean ~128
  run_bandwidth(lengths, 16, true);
}

TEST(QuantizeGpu, DISABLED_BandwidthFp32OneGiB) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  run_bandwidth(std::vector<int64_t>(32, 4096), 16, false);
}

}  // namespace
}  // namespace mxflash
