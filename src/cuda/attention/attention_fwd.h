// Internal: a validated MXFP8 attention forward problem with device pointers, and the CUDA entry.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

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
  int64_t Pq = 0, Pk = 0, To = 0;
  bool broadcast_q = false;
  float softmax_scale = 0.f;
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

size_t attention_fwd_workspace_bytes(int batch, int heads, int64_t Pq, int64_t Pk, int64_t num_q_tiles);
int64_t attention_fwd_num_q_tiles(const std::vector<int32_t>& cu_q, int batch, bool broadcast_q);

// The exact-MX oracle (attention_fwd_exact.cu): no workspace.
Status attention_forward_exact(const AttentionFwdProblem& p, void* stream);

// workspace: at least attention_fwd_workspace_bytes, or nullptr (allocated on the stream).
Status attention_forward(const AttentionFwdProblem& p, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace mxflash::cuda
