// MXFP8 attention forward on packed jagged tensors, head dim 128, non-causal.
//
// Operands are MX tensors as the quantizer writes them: Q and K along the head dim (hdim), V along
// tokens (seq, token-major or token-contiguous payload), scales plain or blocked128x4.
// On CUDA tensors the fast sm_90a kernel runs (FP8 wgmma; block scales re-expressed per Q row, per
// 128-key tile and per V channel in a prepare pass: ARCHITECTURE.md §4, docs/attention.md);
// on CPU tensors the exact-MX CPU reference runs (src/reference/attention_ref.h).
#pragma once
#include <cmath>
#include <cstddef>

#include "mxflash/jagged.h"
#include "mxflash/quantize.h"
#include "mxflash/tensor.h"

namespace mxflash {

// One MX operand: payload + scales and how they are laid out.
struct MxTensor {
  TensorView payload;  // e4m3 (uint8 accepted)
  TensorView scales;   // e8m0 (uint8 accepted)
  Orientation orientation = Orientation::kHdim;
  ScaleLayout scale_layout = ScaleLayout::kPlain;
  PayloadLayout payload_layout = PayloadLayout::kTokenMajor;
};

struct AttentionOptions {
  float softmax_scale = NAN;  // NaN: 1/sqrt(128)
  // One shared Q sequence (q_meta has one sequence) attends to each of the B K/V sequences; the
  // output has B*Lq tokens, token b*Lq + i. Q is read in place, never gathered.
  bool broadcast_q = false;
  // CUDA tensors only: run the exact-MX GPU path (every block scale applied, FP64 sums; slow) instead
  // of the fast kernel. The oracle for shapes the CPU reference cannot reach; CPU tensors always
  // run the exact reference.
  bool exact_mx = false;
};

// Device workspace the CUDA forward needs (bytes); 0 on CPU. Pass a buffer of at least this size
// as `workspace`, or nullptr to let the call allocate (stream-ordered) and free it.
size_t attention_forward_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                        const AttentionOptions& opt);

// out: (To, H, 128) bf16, lse: (H, To) fp32 natural log, To = Tq (or B*Lq with broadcast_q).
// Rows with no keys give out = 0 and lse = -inf.
Status attention_forward(const MxTensor& q, const MxTensor& k, const MxTensor& v, const JaggedMeta& q_meta,
                         const JaggedMeta& k_meta, const AttentionOptions& opt, TensorView out, TensorView lse,
                         void* workspace = nullptr, size_t workspace_bytes = 0, void* stream = nullptr);

}  // namespace mxflash
