// CPU reference of the fused producers: the definition the CUDA kernels are compared to, byte for byte.
#pragma once
#include "common/fused_problem.h"

namespace mxflash::ref {

// Sum of squares of one row of x in the order src/common/rmsnorm_rules.h defines.
float rms_sum_of_squares(const float* row, int64_t cols);

// Fills payload, scales and (when requested) rstd.
void rmsnorm_quantize(const detail::RmsNormQuantizeProblem& p);

}  // namespace mxflash::ref
