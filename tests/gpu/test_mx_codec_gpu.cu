// The device fast paths of src/cuda/quantize/mx_device.cuh against the mx.h rules they replace,
// over every input bit pattern, on the GPU (the hardware e4m3 converter can only be checked there).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/quantize/mx_device.cuh"
#include "gpu/gpu_test_util.h"
#include "mxflash/mx.h"

namespace mxflash {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 1024;

struct Mismatches {
  unsigned long long count;
  unsigned int first;  // smallest failing input bits (0xFFFFFFFF: none)
};

__device__ void record(Mismatches* m, unsigned long long local, unsigned int first) {
  if (local == 0) return;
  atomicAdd(&m->count, local);
  atomicMin(&m->first, first);
}

// scale_byte_from_amax_bits == e8m0_scale_byte (IEEE division) for every |amax| bit pattern.
__global__ void scale_byte_kernel(ScalingMode mode, Mismatches* m) {
  unsigned long long bad = 0;
  unsigned int first = 0xFFFFFFFFu;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u <= 0x7FFFFFFFull; u += stride) {
    const uint32_t ua = uint32_t(u);
    if (cuda::scale_byte_from_amax_bits(ua, mode) != e8m0_scale_byte(bits_float(ua), mode, 0)) {
      if (bad++ == 0) first = ua;
    }
  }
  record(m, bad, first);
}

// The element path of the kernels -- the (hardware) pair conversion for finite values, checked as
// the low and the high byte, and e4m3_nonfinite_byte for inf/NaN -- equals quantize_element_exact
// (mx.h's float_to_e4m3, with x's NaN sign) for every fp32 bit pattern.
__global__ void e4m3_kernel(Mismatches* m) {
  unsigned long long bad = 0;
  unsigned int first = 0xFFFFFFFFu;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i <= 0xFFFFFFFFull; i += stride) {
    const uint32_t u = uint32_t(i);
    const float y = bits_float(u);
    uint32_t want = cuda::quantize_element_exact(y, 1.f), lo, hi;
    if ((u & cuda::kExpAllOnes) == cuda::kExpAllOnes) {
      lo = hi = cuda::e4m3_nonfinite_byte(u);
    } else {
      lo = cuda::e4m3x2_satfinite(y, 0.f) & 0xFFu;
      hi = cuda::e4m3x2_satfinite(0.f, y) >> 8;
    }
    if (lo != want || hi != want) {
      if (bad++ == 0) first = u;
    }
  }
  record(m, bad, first);
}

// dequantize_value == e4m3_to_float * e8m0_to_float for every non-NaN (payload, scale) pair, and
// NaN exactly when the payload or the scale is NaN.
__global__ void dequantize_value_kernel(Mismatches* m) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536) return;
  const uint32_t q = i & 0xFF, s = i >> 8;
  const float got = cuda::dequantize_value(q, s);
  const bool nan_expected = (q & 0x7F) == kE4m3Nan || s == kE8m0Nan;
  bool ok;
  if (nan_expected) {
    const uint32_t want = (q & 0x7F) == kE4m3Nan ? (((q & 0x80u) << 24) | 0x7FC00000u) : 0x7FC00000u;
    ok = float_bits(got) == want;
  } else {
    ok = float_bits(got) == float_bits(e4m3_to_float(uint8_t(q)) * e8m0_to_float(uint8_t(s)));
  }
  if (!ok) record(m, 1, i);
}

template <typename Launch>
Mismatches run(Launch launch) {
  Mismatches* d = nullptr;
  Mismatches h{0, 0xFFFFFFFFu};
  EXPECT_EQ(cudaMalloc(&d, sizeof(Mismatches)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, &h, sizeof(h), cudaMemcpyHostToDevice), cudaSuccess);
  launch(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_TRUE(gputest::device_ok());
  EXPECT_EQ(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d);
  return h;
}

TEST(MxCodecGpu, ScaleByteWithoutDivisionExhaustive) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  for (ScalingMode mode : {ScalingMode::kRceil, ScalingMode::kFloor}) {
    const Mismatches m = run([mode](Mismatches* d) { scale_byte_kernel<<<kBlocks, kThreads>>>(mode, d); });
    EXPECT_EQ(m.count, 0u) << to_string(mode) << ": first mismatch at amax bits 0x" << std::hex << m.first;
  }
}

TEST(MxCodecGpu, E4m3ElementPathExhaustive) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const Mismatches m = run([](Mismatches* d) { e4m3_kernel<<<kBlocks, kThreads>>>(d); });
  EXPECT_EQ(m.count, 0u) << "first mismatch at fp32 bits 0x" << std::hex << m.first
                         << (cuda::kHardwareE4m3Convert ? " (set kHardwareE4m3Convert = false in mx_device.cuh)" : "");
}

TEST(MxCodecGpu, DequantizeValueAllPairs) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const Mismatches m = run([](Mismatches* d) { dequantize_value_kernel<<<65536 / kThreads, kThreads>>>(d); });
  EXPECT_EQ(m.count, 0u) << "first mismatch at (scale << 8 | payload) 0x" << std::hex << m.first;
}

}  // namespace
}  // namespace mxflash
