// Host entry points of the CUDA quantization kernels (device pointers, validated problems).
#pragma once
#include "common/quantize_problem.h"
#include "mxflash/status.h"

namespace mxflash::cuda {

Status quantize(const detail::QuantizeProblem& p, void* stream);
Status dequantize(const detail::DequantizeProblem& p, void* stream);
Status to_token_contiguous(const detail::LayoutProblem& p, void* stream);
Status to_token_major(const detail::LayoutProblem& p, void* stream);
Status scales_to_blocked(const detail::LayoutProblem& p, void* stream);
Status scales_to_plain(const detail::LayoutProblem& p, void* stream);

}  // namespace mxflash::cuda
