// CPU-only build: the CUDA attention entry points report that CUDA was not built.
#include "cuda/attention/attention_bwd.h"
#include "cuda/attention/attention_fwd.h"

namespace mxflash::cuda {
size_t attention_fwd_workspace_bytes(const std::vector<int32_t>&, const std::vector<int32_t>&, int, int64_t, int64_t,
                                     int64_t, bool, CausalMask) {
  return 0;
}
Status attention_forward_exact(const AttentionFwdProblem&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
Status attention_forward(const AttentionFwdProblem&, void*, size_t, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
Status quantize_attention_fwd_operands(const AttentionFwdProblem&, const void*, const void*, const void*, bool,
                                       const FwdExecOperands&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
size_t attention_fwd_exec_workspace_bytes(const std::vector<int32_t>&, const std::vector<int32_t>&, int, int64_t, bool,
                                          CausalMask) {
  return 0;
}
Status attention_forward_exec(const AttentionFwdProblem&, const FwdExecOperands&, void*, size_t, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
Status attention_backward_exact(const AttentionBwdProblem&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
Status quantize_attention_bwd_operands(const AttentionBwdProblem&, const void*, const void*, const void*, bool,
                                       const BwdExecOperands&, bool, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
Status quantize_attention_training_operands(const AttentionFwdProblem&, const void*, const void*, const void*, bool,
                                            const FwdExecOperands&, const BwdExecOperands&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
Status quantize_attention_training_operands_mx_kv(const AttentionFwdProblem&, const void*, bool, const MxKvSource&,
                                                  const FwdExecOperands&, const BwdExecOperands&, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
size_t attention_bwd_workspace_bytes(const AttentionBwdProblem&) { return 0; }
Status attention_backward(const AttentionBwdProblem&, void*, size_t, void*) {
  return Status::Unsupported("mxflash was built without CUDA");
}
}  // namespace mxflash::cuda
