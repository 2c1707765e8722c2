// Internal: validated fused-producer problems, shared by the CPU reference and the CUDA launchers.
// Pointers are host pointers for the reference and device pointers for CUDA.
#pragma once
#include <cstdint>

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

}  // namespace mxflash::detail
