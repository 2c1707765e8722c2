// CPU reference of the fused producers: the definition the CUDA kernels are compared to, byte for byte.
#pragma once
#include "common/fused_problem.h"

namespace mxflash::ref {

// Sum of squares of one row of x in the order src/common/rmsnorm_rules.h defines.
float rms_sum_of_squares(const float* row, int64_t cols);

// Fills payload, scales and (when requested) rstd.
void rmsnorm_quantize(const detail::RmsNormQuantizeProblem& p);

// rmsnorm_backward in the arithmetic and order of src/common/rmsnorm_rules.h.
void rmsnorm_backward(const detail::RmsNormBackwardProblem& p);

// gemm_quantize: p.path kExact -> the MX definition, kCoarse -> the model of the fast path's
// arithmetic (src/common/gemm_rules.h).
void gemm_quantize(const detail::GemmQuantizeProblem& p);

// The fast path's operand: rows of `src` ((rows, K) e4m3, blocks along K) re-expressed against each
// row's coarse exponent, written to dst (same shape) and coarse (rows).
void reexpress_rows(const uint8_t* src, const uint8_t* scales, int64_t rows, int64_t k, uint8_t* dst,
                    uint8_t* coarse);

// Quantizes one row of fp32 values along it in 32-blocks (mx.h's quantize_produced_element).
void quantize_row_blocks(const float* y, int64_t n, ScalingMode mode, uint8_t* payload, uint8_t* scales);

}  // namespace mxflash::ref
