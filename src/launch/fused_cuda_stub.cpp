// CPU-only build: the CUDA fused producers report that CUDA was not built.
#include "cuda/fused/fused_cuda.h"

namespace mxflash::cuda {
Status rmsnorm_quantize(const detail::RmsNormQuantizeProblem&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
Status rmsnorm_backward(const detail::RmsNormBackwardProblem&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
bool gemm_coarse_supported(const detail::GemmQuantizeProblem&) { return false; }
Status gemm_quantize(const detail::GemmQuantizeProblem&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
}  // namespace mxflash::cuda
