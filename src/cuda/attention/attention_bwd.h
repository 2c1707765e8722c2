// Internal: a validated MXFP8 attention backward problem with device pointers, and the CUDA entry.
#pragma once
#include <cstdint>

#include "cuda/attention/attention_fwd.h"
#include "mxflash/status.h"

namespace mxflash::cuda {

// The backward's operands in its execution layout, written by quantize_attention_bwd_operands (device
// pointers): q (H, Pq, 128) + q_scale (H, Pq) per row, k and v (H, Pk, 128) + k_scale, v_scale
// (H, Pk / 128) per 128-key tile, qt (H, 128, Pq) and kt (H, 128, Pk) token-contiguous in the
// kernels' fragment order + qt_scale (H, Pq / 128), kt_scale (H, Pk / 128) per 128-token tile.
struct BwdExecOperands {
  uint8_t *q = nullptr, *k = nullptr, *v = nullptr, *qt = nullptr, *kt = nullptr;
  float *q_scale = nullptr, *k_scale = nullptr, *v_scale = nullptr, *qt_scale = nullptr, *kt_scale = nullptr;
};

struct AttentionBwdProblem {
  int batch = 0;  // K/V sequences (and Q sequences unless broadcast_q)
  int heads = 0;
  // K and V heads (0: heads); fewer (dividing heads) with exec operands only: grouped-query
  // attention, K-side operands (k, v, kt and their scales) and dk, dv (Tk, kv_heads, 128) bf16 (the
  // sums over each group's Q heads). The fast kernels run on the K-side operands repeated per Q
  // head in the workspace, their per-head dK, dV summed after (attention_bwd_sm90.cu).
  int kv_heads = 0;
  int64_t Tq = 0, Tk = 0, Pq = 0, Pk = 0, To = 0;
  bool broadcast_q = false;
  float softmax_scale = 0.f;
  CausalMask causal = CausalMask::kNone;
  const int32_t* cu_q = nullptr;  // device metadata
  const int32_t* cu_q_sf = nullptr;
  const int32_t* cu_k = nullptr;
  const int32_t* cu_k_sf = nullptr;
  const std::vector<int32_t>* host_cu_q = nullptr;  // host copies (the list of 32-row blocks)
  const std::vector<int32_t>* host_cu_k = nullptr;
  MxOperand q, q_seq, k, k_seq, v;  // q, k, v: hdim; q_seq, k_seq: seq (unused with exec)
  const BwdExecOperands* exec = nullptr;  // operands in the execution layout instead (no prepare passes)
  const void* out = nullptr;        // bf16 (To, H, 128)
  const void* dout = nullptr;       // bf16 (To, H, 128)
  const float* lse = nullptr;       // (H, To)
  void* dq = nullptr;               // bf16 (Tq, H, 128)
  void* dk = nullptr;               // bf16 (Tk, H, 128), or e4m3 with dk_scales
  void* dv = nullptr;               // bf16 (Tk, H, 128), or e4m3 with dv_scales
  // MXFP8 dK, dV (output_mxfp8_dkv; fast kernel only): (Tk, H, 4) e8m0, each token row's 32x32 block
  // scale; null for bf16 outputs.
  bool mxfp8_dkv = false;
  uint8_t* dk_scales = nullptr;
  uint8_t* dv_scales = nullptr;
};

// Q, K, V (T, H, 128) bf16 (fp32: x_fp32) quantized to MX (RCEIL) and re-expressed into the
// backward's execution layout, one pass per output (Q and K twice: along the head dim and along
// tokens). Bit-identical to the CPU's composition of ref::attention_fwd_operands (attention.cpp).
// write_qk = false: Q' and K' (the forward's operands) are left as they are.
Status quantize_attention_bwd_operands(const AttentionBwdProblem& p, const void* q, const void* k, const void* v,
                                       bool x_fp32, const BwdExecOperands& out, bool write_qk, void* stream);

// The forward's operands (all of fwd) and the backward's (bwd's v, qt, kt and their scales; its q and
// k are fwd's) from one read of each input: three kernels for bf16 (operand_v_kernel with a row
// output), six for fp32. The same bytes as quantize_attention_fwd_operands followed by
// quantize_attention_bwd_operands(write_qk = false).
Status quantize_attention_training_operands(const AttentionFwdProblem& p, const void* q, const void* k,
                                            const void* v, bool x_fp32, const FwdExecOperands& fwd,
                                            const BwdExecOperands& bwd, void* stream);

// K and V as MX tensors for quantize_attention_training_operands_mx_kv: payloads (Tk, H, 128) e4m3
// with plain hdim scales (Tk, H, 4), token-major.
struct MxKvSource {
  const uint8_t *k = nullptr, *k_scales = nullptr, *v = nullptr, *v_scales = nullptr;
};
// quantize_attention_training_operands with K and V from MX tensors: the same bytes as on their
// bf16 values (dequantize to bf16), from one read of each MX tensor. q: bf16, or fp32 (q_fp32).
Status quantize_attention_training_operands_mx_kv(const AttentionFwdProblem& p, const void* q, bool q_fp32,
                                                  const MxKvSource& kv, const FwdExecOperands& fwd,
                                                  const BwdExecOperands& bwd, void* stream);

// The exact-MX backward (attention_bwd_exact.cu): the CPU reference's arithmetic on the GPU, step
// for step, FP64 sums; allocates its FP64 accumulators on the stream.
Status attention_backward_exact(const AttentionBwdProblem& p, void* stream);

// The fast sm_90a backward (attention_bwd_sm90.cu): a dK/dV kernel and a dQ kernel on FP8 wgmma,
// no atomics (deterministic). Workspace: attention_bwd_workspace_bytes(p) (O(T·H·128); device
// pointers of p are not read; smaller with p.exec, whose operands need no room), or nullptr to
// allocate it on the stream.
size_t attention_bwd_workspace_bytes(const AttentionBwdProblem& p);
Status attention_backward(const AttentionBwdProblem& p, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace mxflash::cuda
