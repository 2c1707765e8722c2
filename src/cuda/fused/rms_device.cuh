// Device pieces shared by the RMSNorm kernels (rmsnorm_quantize.cu, rmsnorm_backward.cu): a chunk
// of kRmsChunk values as loaded and widened to fp32, and the butterfly of src/common/rmsnorm_rules.h
// over a row's lanes.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/rmsnorm_rules.h"

namespace mxflash::cuda {

// A chunk of 8 values as loaded: one 16-byte word of bf16, two of fp32.
template <typename T>
struct Raw {
  static constexpr int kWords = int(sizeof(T)) / 2;
  uint4 w[kWords];
};

template <typename T>
__device__ __forceinline__ Raw<T> load_raw(const T* base, int64_t i) {
  Raw<T> r;
#pragma unroll
  for (int k = 0; k < Raw<T>::kWords; ++k) r.w[k] = __ldg(reinterpret_cast<const uint4*>(base + i) + k);
  return r;
}

// The chunk's 8 values as fp32 (bf16 widens exactly by a shift).
template <typename T>
__device__ __forceinline__ void widen(const Raw<T>& r, float (&v)[kRmsChunk]) {
  if constexpr (sizeof(T) == 2) {
    const uint32_t w[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  } else {
    const uint32_t w[8] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w, r.w[1].x, r.w[1].y, r.w[1].z, r.w[1].w};
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __uint_as_float(w[k]);
  }
}

// rmsnorm_rules.h's butterfly: for d = L/2, ..., 1 every lane adds lane (its index xor d)'s value
// (xor d < L stays in the row's lane group). kLanes: L at compile time, or 0: `lanes`.
template <int kLanes>
__device__ __forceinline__ float rms_lane_sum(float v, int lanes) {
  if constexpr (kLanes > 0) {
#pragma unroll
    for (int d = kLanes / 2; d >= 1; d /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, d));
  } else {
    for (int d = lanes / 2; d >= 1; d /= 2) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, d));
  }
  return v;
}

}  // namespace mxflash::cuda
