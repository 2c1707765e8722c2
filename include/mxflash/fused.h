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

// The RMSNorm's backward (of y = x * rstd * weight, rstd held from the forward: rmsnorm_quantize
// writes it), in fp32 in the order src/common/rmsnorm_rules.h defines:
//   dx[t, c] = (dy[t, c] w[c] - xh[t, c] mean_c'(dy[t, c'] w[c'] xh[t, c'])) rstd[t],   xh = x rstd,
//   dweight[c] = sum_t dy[t, c] xh[t, c].
// Gradients pass the forward's quantization unchanged (dy is the gradient of the quantized y).
// Deterministic (no atomics); the CUDA path allocates about ceil(T / 512) * C * 4 bytes of
// workspace, stream-ordered from the library's pool, inside the call when dweight is requested.
//  x:       (T, C) bf16 or fp32, contiguous; C a multiple of 32, 32..65536.
//  weight:  (C) fp32 or bf16, or an empty view (no weight: w = 1).
//  rstd:    (T) fp32.     dy: (T, C), x's dtype.     dx: (T, C), x's dtype (may not alias x or dy).
//  dweight: (C) fp32, or an empty view: not computed (it must be empty when there is no weight).
Status rmsnorm_backward(const TensorView& x, const TensorView& weight, const TensorView& rstd, const TensorView& dy,
                        TensorView dx, TensorView dweight, void* stream = nullptr);

// Which arithmetic gemm_quantize runs.
//  kAuto:   CUDA: kCoarse where its shapes allow (N a multiple of 128, 16-byte aligned pointers),
//           else kExact. CPU: kExact.
//  kExact:  the MX definition: every 32-block scale pair applied to its block's exact partial sum
//           (src/common/gemm_rules.h). CPU and CUDA bytes are identical.
//  kCoarse: the fast path's arithmetic: A re-expressed against one scale per row, W against one per
//           output channel, a plain FP8 GEMM (wgmma on CUDA) with fp32 accumulation, both scales
//           applied in the epilogue. On the CPU a model of that arithmetic (fp64 sums), for tests.
enum class GemmPath : int { kAuto = 0, kExact = 1, kCoarse = 2 };

struct GemmQuantizeOptions {
  ScalingMode mode = ScalingMode::kRceil;  // of the output's block scales
  GemmPath path = GemmPath::kAuto;
};

// GEMM + MX quantization of its result, in one pass (the projections that produce Q, K, V):
//   y[m, n] = sum_k A[m, k] W[n, k]   (y = A W^T, W in nn.Linear's (out, in) layout),
// A and W MX tensors blocked along K (what rmsnorm_quantize writes, what `quantize(..., hdim)` gives
// for K = H * 128), y quantized in 32-blocks along n (for N = H * 128: Q or K for attention_forward,
// `hdim` orientation, plain scales). y is never stored wider than e4m3. The CUDA fast path needs a
// workspace of N * (K + 4) bytes, allocated stream-ordered (cudaMallocAsync) inside the call.
//  a:        (M, K) e4m3 (uint8 accepted); K a multiple of 32, 32..65536; M < 2^31.
//  a_scales: (M, K / 32) e8m0 (uint8 accepted), plain.
//  w:        (N, K) e4m3;  N a multiple of 32, 32..65536.   w_scales: (N, K / 32) e8m0, plain.
//  payload:  (M, N) e4m3.  scales: (M, N / 32) e8m0, plain.
Status gemm_quantize(const TensorView& a, const TensorView& a_scales, const TensorView& w, const TensorView& w_scales,
                     const GemmQuantizeOptions& opt, TensorView payload, TensorView scales, void* stream = nullptr);

}  // namespace mxflash
