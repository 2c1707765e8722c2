// Host entry points of the CUDA fused producers (device pointers, validated problems).
#pragma once
#include "common/fused_problem.h"
#include "mxflash/status.h"

namespace mxflash::cuda {

Status rmsnorm_quantize(const detail::RmsNormQuantizeProblem& p, void* stream);
// Also for T = 0 (dweight then zeros).
Status rmsnorm_backward(const detail::RmsNormBackwardProblem& p, void* stream);

// Whether the coarse (wgmma) gemm_quantize kernel takes this problem's shapes and pointers.
bool gemm_coarse_supported(const detail::GemmQuantizeProblem& p);
// p.path kExact or kCoarse (resolved by the launcher).
Status gemm_quantize(const detail::GemmQuantizeProblem& p, void* stream);

}  // namespace mxflash::cuda
