// Internal: validated fused-producer problems, shared by the CPU reference and the CUDA launchers.
// Pointers are host pointers for the reference and device pointers for CUDA.
#pragma once
#include <cstdint>

#include "mxflash/fused.h"
#include "mxflash/mx.h"

namespace mxflash::detail {

struct RmsNormQuantizeProblem {
  const void* x = nullptr;  // (T, C)
  bool x_bf16 = true;       // else fp32
  const void* weight = nullptr;  // (C), or null: no weight
  bool weight_bf16 = false;      // else fp32
  int64_t rows = 0;  // T
  int64_t cols = 0;  // C, a multiple of 32
  float eps = 1e-6f;
  ScalingMode mode = ScalingMode::kRceil;
  uint8_t* payload = nullptr;  // (T, C)
  uint8_t* scales = nullptr;   // (T, C / 32)
  float* rstd = nullptr;       // (T), or null
};

struct RmsNormBackwardProblem {
  const void* x = nullptr;       // (T, C); dy and dx have x's dtype
  bool bf16 = true;              // x, dy, dx bf16, else fp32
  const void* weight = nullptr;  // (C), or null: no weight
  bool weight_bf16 = false;
  const float* rstd = nullptr;   // (T)
  const void* dy = nullptr;      // (T, C)
  int64_t rows = 0, cols = 0;    // T, C (a multiple of 32)
  void* dx = nullptr;            // (T, C)
  float* dweight = nullptr;      // (C), or null: not computed
};

struct GemmQuantizeProblem {
  const uint8_t* a = nullptr;         // (M, K) e4m3, blocks along K
  const uint8_t* a_scales = nullptr;  // (M, K / 32)
  const uint8_t* w = nullptr;         // (N, K) e4m3, blocks along K
  const uint8_t* w_scales = nullptr;  // (N, K / 32)
  int64_t m = 0, n = 0, k = 0;        // K and N multiples of 32
  ScalingMode mode = ScalingMode::kRceil;
  GemmPath path = GemmPath::kAuto;    // resolved by the launcher: kExact or kCoarse
  uint8_t* payload = nullptr;         // (M, N), blocks along N
  uint8_t* scales = nullptr;          // (M, N / 32)
};

}  // namespace mxflash::detail
