// Host entry points of the CUDA fused producers (device pointers, validated problems).
#pragma once
#include "common/fused_problem.h"
#include "mxflash/status.h"

namespace mxflash::cuda {

Status rmsnorm_quantize(const detail::RmsNormQuantizeProblem& p, void* stream);

}  // namespace mxflash::cuda
