// Internal: a validated MXFP8 attention forward problem with device pointers, and the CUDA entry.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "mxflash/attention.h"
#include "mxflash/mx.h"
#include "mxflash/status.h"

namespace mxflash::cuda {

struct MxOperand {
  const uint8_t* payload = nullptr;
  const uint8_t* scales = nullptr;
  ScaleLayout scale_layout = ScaleLayout::kPlain;
  PayloadLayout payload_layout = PayloadLayout::kTokenMajor;
};

struct AttentionFwdProblem {
  int batch = 0;   // K/V sequences (and Q sequences unless broadcast_q)
  int heads = 0;
  // K and V heads (0: heads). Fewer (dividing heads) is grouped-query attention: Q head h attends
  // K/V head h / (heads / kv_heads). The operand kernels (quantize_attention_*_operands and the
  // forward on them) take it; the MX-tensor paths take heads only.
  int kv_heads = 0;
  int64_t Pq = 0, Pk = 0, To = 0;
  bool broadcast_q = false;
  float softmax_scale = 0.f;
  CausalMask causal = CausalMask::kNone;
  // device copies of the metadata
  const int32_t* cu_q = nullptr;
  const int32_t* cu_q_sf = nullptr;
  const int32_t* cu_k = nullptr;
  const int32_t* cu_k_sf = nullptr;
  // host copies (tile scheduling)
  const std::vector<int32_t>* host_cu_q = nullptr;
  const std::vector<int32_t>* host_cu_k = nullptr;
  MxOperand q, k, v;  // q, k: hdim; v: seq
  void* out = nullptr;  // bf16 (To, H, 128)
  float* lse = nullptr;  // (H, To)
};

// K and V heads of an operand problem (AttentionFwdProblem, AttentionBwdProblem): kv_heads, or heads
// where it is 0.
template <typename Problem>
int64_t kv_heads_of(const Problem& p) {
  return p.kv_heads > 0 ? p.kv_heads : p.heads;
}

// The main kernel's operands (the execution layout, attention_fwd_prepare.cuh): Q' (H, Pq, 128)
// with per-row scales (H, Pq), K' (H, Pk, 128) with per-128-key-tile scales (H, Pk / 128), V'
// (H, 128, Pk) with channel scales per (sequence, head), (B, H, 128), as the prepare pass writes
// them, or one scale per (head, 128-key tile), (H, Pk / 128) (v_per_tile), as
// quantize_attention_fwd_operands writes them.
struct FwdExecOperands {
  uint8_t *q = nullptr, *k = nullptr, *v = nullptr;
  float *q_scale = nullptr, *k_scale = nullptr, *v_scale = nullptr;
  bool v_per_tile = false;
};

// Q, K, V (T, H, 128) bf16 (fp32: x_fp32) quantized to MX (RCEIL; Q, K along the head dim, V along
// tokens) and re-expressed into the execution layout with V per tile, in one pass per tensor.
// Bit-identical to the CPU's ref::attention_fwd_operands. Needs p's metadata, heads, Pq, Pk, batch.
Status quantize_attention_fwd_operands(const AttentionFwdProblem& p, const void* q, const void* k, const void* v,
                                       bool x_fp32, const FwdExecOperands& out, void* stream);

// The forward from operands in the execution layout (no prepare pass); workspace: at least
// attention_fwd_exec_workspace_bytes(...) (the work list, and the partial states of the split tail
// when the three-consumer kernel runs one: it depends on the current device's SM count), or nullptr.
size_t attention_fwd_exec_workspace_bytes(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                                          int batch, int64_t heads, bool broadcast_q,
                                          CausalMask causal = CausalMask::kNone);
Status attention_forward_exec(const AttentionFwdProblem& p, const FwdExecOperands& ops, void* workspace,
                              size_t workspace_bytes, void* stream);

// The forward on MX tensors: its re-expressed operands, the work list and the split tail's partial
// states (attention_fwd_exec_workspace_bytes).
size_t attention_fwd_workspace_bytes(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, int batch,
                                     int64_t heads, int64_t Pq, int64_t Pk, bool broadcast_q,
                                     CausalMask causal = CausalMask::kNone);

// The exact-MX oracle (attention_fwd_exact.cu): no workspace.
Status attention_forward_exact(const AttentionFwdProblem& p, void* stream);

// workspace: at least attention_fwd_workspace_bytes, or nullptr (allocated on the stream).
Status attention_forward(const AttentionFwdProblem& p, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace mxflash::cuda
