// The GPU's re-expression of e4m3 bytes to a coarser power-of-two scale (cuda::shift_e4m3x4,
// src/cuda/common/e4m3_shift.cuh: the forward's prepare pass, the backward's operands and
// gemm_quantize's A tiles) against the rule it implements (mx.h: the byte's value times 2^-shift,
// rounded to nearest even, saturating), for every byte in every lane of the word and every shift
// 0..40, on the GPU (its f16x2 arithmetic runs only there).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/common/e4m3_shift.cuh"
#include "gpu/gpu_test_util.h"
#include "mxflash/mx.h"

namespace mxflash {
namespace {

constexpr int kShifts = 41;

// out[shift][byte][lane]: byte placed in lane 0..3 of a word whose other lanes hold other bytes.
__global__ void shift_kernel(uint8_t* out) {
  const int shift = blockIdx.x, b = threadIdx.x;  // 41 x 256
  for (int lane = 0; lane < 4; ++lane) {
    uint32_t word = 0;
    for (int l = 0; l < 4; ++l) word |= uint32_t(l == lane ? b : (b * 37 + 11 * l) & 0xFF) << (8 * l);
    const uint32_t r = cuda::shift_e4m3x4(word, shift);
    out[(shift * 256 + b) * 4 + lane] = uint8_t(r >> (8 * lane));
  }
}

TEST(PrepareShiftGpu, EveryByteEveryLaneEveryShiftRoundsLikeTheRule) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  gputest::DeviceBuffer dev(size_t(kShifts) * 256 * 4);
  dev.fill(gputest::kDevicePoison);
  shift_kernel<<<kShifts, 256>>>(static_cast<uint8_t*>(dev.get()));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_TRUE(gputest::device_ok());
  const std::vector<uint8_t> got = dev.download();
  int bad = 0;
  for (int shift = 0; shift < kShifts; ++shift)
    for (int b = 0; b < 256; ++b) {
      const float v = e4m3_to_float(uint8_t(b));
      for (int lane = 0; lane < 4; ++lane) {
        const uint8_t g = got[size_t((shift * 256 + b) * 4 + lane)];
        if (std::isnan(v)) {  // NaN stays NaN (either sign)
          if ((g & 0x7F) != 0x7F && bad++ < 10) ADD_FAILURE() << "byte " << b << " shift " << shift << ": NaN lost";
          continue;
        }
        uint8_t want = float_to_e4m3(std::ldexp(v, -shift), /*saturate=*/true);
        if ((want & 0x7F) == 0) want = uint8_t(std::signbit(v) ? 0x80 : 0x00);  // zero keeps the input's sign
        if (g != want && bad++ < 10)
          ADD_FAILURE() << "byte 0x" << std::hex << b << std::dec << " lane " << lane << " shift " << shift << ": got 0x"
                        << std::hex << int(g) << ", want 0x" << int(want);
      }
    }
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace mxflash
