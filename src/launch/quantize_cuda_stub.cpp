// CPU-only build: the CUDA quantization entry points report that CUDA was not built.
#include "cuda/quantize/quantize_cuda.h"

namespace mxflash::cuda {
namespace {
Status no_cuda() { return Status::Unsupported("mxflash was built without CUDA"); }
}  // namespace
Status quantize(const detail::QuantizeProblem&, void*) { return no_cuda(); }
Status dequantize(const detail::DequantizeProblem&, void*) { return no_cuda(); }
Status to_token_contiguous(const detail::LayoutProblem&, void*) { return no_cuda(); }
Status to_token_major(const detail::LayoutProblem&, void*) { return no_cuda(); }
Status scales_to_blocked(const detail::LayoutProblem&, void*) { return no_cuda(); }
Status scales_to_plain(const detail::LayoutProblem&, void*) { return no_cuda(); }
}  // namespace mxflash::cuda
