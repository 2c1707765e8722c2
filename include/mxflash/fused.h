// Fused producers: operations that write MX tensors straight from what the layer computes, so that
// quantization costs no pass of its own (ARCHITECTURE.md §6).
//
// Every entry point runs on the device its tensors live on: all on the CPU -> the CPU reference
// (src/reference/fused_ref.cpp, the definition), all on CUDA -> the CUDA kernels (byte for byte the
// same). Bad arguments give Status::Invalid naming the argument and the rule; nothing is written.
// CUDA work is enqueued on `stream` (a cudaStream_t, nullptr = default) without synchronizing.
#pragma once
#include "mxflash/mx.h"
#include "mxflash/tensor.h"

namespace mxflash {

struct RmsNormQuantizeOptions {
  float eps = 1e-6f;  // added to mean(x^2) before the square root; finite, >= 0
  ScalingMode mode = ScalingMode::kRceil;
};

// RMSNorm + MX quantization along the row, in one pass over x:
//   rstd[t] = 1 / sqrt(mean_c(x[t, c]^2) + eps),   y[t, c] = x[t, c] * rstd[t] * weight[c],
// y quantized in 32-element blocks along c (the orientation a GEMM contracting over c reads; for
// C = H * 128 these are exactly `quantize(y viewed as (T, H, 128), hdim, plain)`'s bytes).
// All arithmetic in fp32, in the order src/common/rmsnorm_rules.h defines (y is never rounded to
// bf16). A NaN y is stored as 0x7F; a block holding inf or NaN gets scale 0xFF (REFERENCE.md §2).
//  x:       (T, C) bf16 or fp32, contiguous; C a multiple of 32, 32..65536.
//  weight:  (C) fp32 or bf16, or an empty view (ndim 0, no data): no weight (y = x * rstd).
//  payload: (T, C) e4m3 (uint8 accepted).   scales: (T, C / 32) e8m0 (uint8 accepted), plain.
//  rstd:    (T) fp32 (what an RMSNorm backward needs), or an empty view: not written.
Status rmsnorm_quantize(const TensorView& x, const TensorView& weight, const RmsNormQuantizeOptions& opt,
                        TensorView payload, TensorView scales, TensorView rstd, void* stream = nullptr);

}  // namespace mxflash
