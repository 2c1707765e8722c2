// MXFP8 attention forward on packed jagged tensors, head dim 128, with or without a causal mask.
//
// Operands are MX tensors as the quantizer writes them: Q and K along the head dim (hdim), V along
// tokens (seq, token-major or token-contiguous payload), scales plain or blocked128x4.
// On CUDA tensors the fast sm_90a kernel runs (FP8 wgmma; block scales re-expressed per Q row, per
// 128-key tile and per V channel in a prepare pass: ARCHITECTURE.md §4, docs/attention.md);
// on CPU tensors the exact-MX CPU reference runs (src/reference/attention_ref.h). The causal mask
// (CausalMask below; AttentionOptions::causal, AttentionBackwardOptions::causal) applies on every
// path alike: masked keys contribute exactly nothing, rows facing no key give out = 0, lse = -inf.
#pragma once
#include <cmath>
#include <cstddef>
#include <string>

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

// The causal mask. Query row i of a Q sequence of Lq rows attends keys 0 .. n - 1 of its K/V
// sequence of Lk keys, n = causal_keys(mask, i, Lq, Lk) (rows i = 0 .. Lq - 1, counted from the Q
// sequence's start; with broadcast_q, the shared sequence's rows against each K/V sequence):
//   kNone         n = Lk (every key);
//   kTopLeft      key j <= i: the diagonal starts at the sequences' first row and key (torch's
//                 scaled_dot_product_attention(is_causal=True));
//   kBottomRight  key j <= i + Lk - Lq: the diagonal ends at the last row and key
//                 (FlashAttention's causal, torch.nn.attention.bias.causal_lower_right); rows
//                 i < Lq - Lk then face no key.
// Lq == Lk (self-attention) gives the same mask either way. A row facing no key gets out = 0,
// lse = -inf and zero gradients.
enum class CausalMask : int { kNone = 0, kTopLeft = 1, kBottomRight = 2 };
MXFLASH_HD int64_t causal_keys(CausalMask mask, int64_t i, int64_t Lq, int64_t Lk) {
  if (mask == CausalMask::kNone) return Lk;
  const int64_t n = i + 1 + (mask == CausalMask::kBottomRight ? Lk - Lq : 0);
  return n < 0 ? 0 : (n > Lk ? Lk : n);
}

// The masks' names in the tools' command lines and JSON and in the Python package: "none",
// "top_left", "bottom_right"; parse_causal also takes "top-left" and "bottom-right" (false for
// anything else, *out untouched).
const char* causal_name(CausalMask mask);
bool parse_causal(const std::string& text, CausalMask* out);

struct AttentionOptions {
  float softmax_scale = NAN;  // NaN: 1/sqrt(128)
  CausalMask causal = CausalMask::kNone;
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
// Rows with no keys (an empty K/V sequence, or none left by opt.causal) give out = 0 and lse = -inf.
// opt.causal outside the enum: Status kInvalidArgument naming "causal", nothing written.
Status attention_forward(const MxTensor& q, const MxTensor& k, const MxTensor& v, const JaggedMeta& q_meta,
                         const JaggedMeta& k_meta, const AttentionOptions& opt, TensorView out, TensorView lse,
                         void* workspace = nullptr, size_t workspace_bytes = 0, void* stream = nullptr);

// ------------------------------------------------------ forward operands in the execution layout
// The fast kernel's operands as its main loop reads them (docs/attention.md): MX values (RCEIL,
// 32-blocks; Q, K along the head dim, V along tokens) re-expressed to coarser power-of-two scales,
// Q per (head, token), K and V per (head, 128-key tile). Written by
// quantize_attention_forward in one pass over Q, K, V, they spare attention_forward its prepare pass
// (the pass that re-expresses MX tensors; 15-40% of the forward's time on the H200,
// docs/performance.md). Shapes (Pq, Pk: the metadata's padded token counts; Hkv: K and V's heads,
// H itself or, for grouped-query attention, a divisor of H: Q head h then attends K/V head
// h / (H / Hkv), torch's enable_gqa and FlashAttention's rule):
//   q (H, Pq, 128) e4m3, q_scale (H, Pq) fp32;  k (Hkv, Pk, 128) e4m3, k_scale (Hkv, Pk/128) fp32;
//   v (Hkv, 128, Pk) e4m3 (tokens of each 32-group in the kernel's fragment order), v_scale
//   (Hkv, Pk/128) fp32. Padding tokens hold zero bytes (and q_scale 1). A V block whose MX scale is
//   NaN (it holds an inf or NaN) is stored as NaN bytes, so only its channel turns NaN.
// The bytes are exactly the MX quantizer's, shifted to the group scale and rounded to nearest even
// (exact unless a value falls below e4m3's subnormal floor of its group). For the backward, quantize
// MX tensors as before (attention_backward takes those).
struct AttentionFwdOperands {
  TensorView q, q_scale, k, k_scale, v, v_scale;
};
struct AttentionFwdOperandShapes {
  int64_t q[3], q_scale[2], k[3], k_scale[2], v[3], v_scale[2];
};
// kv_heads: K and V's head count (0: heads).
AttentionFwdOperandShapes attention_fwd_operand_shapes(const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                                                       int64_t heads, int64_t kv_heads = 0);
// The six tensors in the order q, k, v, q_scale, k_scale, v_scale: their byte sizes, and views of
// them over caller buffers (e4m3 payloads, fp32 scales) on `device`.
inline constexpr int kAttentionFwdOperandCount = 6;
void attention_fwd_operand_bytes(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                 size_t bytes[kAttentionFwdOperandCount], int64_t kv_heads = 0);
AttentionFwdOperands attention_fwd_operand_views(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                 void* const data[kAttentionFwdOperandCount], Device device,
                                                 int device_id = 0, int64_t kv_heads = 0);

// q (Tq, H, 128), k and v (Tk, Hkv, 128) (Hkv = H, or a divisor of H: grouped-query attention):
// bf16 or fp32 (all three alike), contiguous. Every byte of `ops` is written (padding included). CPU tensors: the CPU reference (ref::attention_fwd_operands);
// CUDA: three kernels, bit-identical to it.
Status quantize_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionFwdOperands& ops,
                                  void* stream = nullptr);

// Device workspace of the forward on operands: its work list (8 bytes per Q tile of 128 or 192
// rows, rounded up to 256) and, where the kernel splits the last, partial wave of its work items
// over more CTAs, their partial states (99 KiB per part; at most 2 parts per SM of the current
// device, e.g. 26 MB on an H200); 0 on CPU-only builds and for metadata the call would reject.
size_t attention_forward_operands_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                 const AttentionOptions& opt);

// The forward on operands from quantize_attention_forward (same q_meta, k_meta). Outputs and
// options as above; workspace: at least attention_forward_operands_workspace_size bytes, or
// nullptr. opt.exact_mx is not supported here (the exact path takes MX tensors).
Status attention_forward(const AttentionFwdOperands& ops, const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                         const AttentionOptions& opt, TensorView out, TensorView lse, void* workspace = nullptr,
                         size_t workspace_bytes = 0, void* stream = nullptr);

// ---------------------------------------------------------------------------------- backward
// Kernel options of the MXFP8 backward (issue 5). The exact-MX CPU reference implements the
// defaults and models dq_accum = fp16 (docs/accuracy.md: no static scale serves the whole suite),
// p_scale = dynamic (no accuracy change on the suite) and output_mxfp8_dkv; the exact GPU path takes
// the defaults only (anything else: Status kUnsupported, never ignored).
enum class DqAccum : int { kFp32 = 0, kFp16 = 1 };          // dQ accumulation across K/V tiles
enum class PScaleMode : int { kConstant = 0, kDynamic = 1 };  // P as e4m3(256 p), or per-block scales

struct AttentionBackwardOptions {
  float softmax_scale = NAN;  // NaN: 1/sqrt(128); must be the forward's
  CausalMask causal = CausalMask::kNone;  // must be the forward's
  bool broadcast_q = false;   // dQ of the shared Q sequence is summed over the batch
  DqAccum dq_accum = DqAccum::kFp32;
  int dq_fp16_scale_log2 = 12;  // static scale 2^k of the FP16 dQ accumulator, k in 0..15
  PScaleMode p_scale = PScaleMode::kConstant;
  bool output_mxfp8_dkv = false;  // dK, dV as E4M3 + 32x32-block scales instead of BF16
  // CUDA tensors: run the exact-MX GPU path (every block scale applied, FP64 sums; slow), the
  // oracle for shapes the CPU reference cannot reach, instead of the fast kernel.
  bool exact_mx = false;
};

// MXFP8 attention backward. Operands (ARCHITECTURE.md §5, REFERENCE.md §5): q and k along the head
// dim (S = Q Kᵀ), q_seq and k_seq the same tensors quantized along tokens (dK = dSᵀ Q, dQ = dS K),
// v along the head dim (dP = dO Vᵀ); out and dout (To, H, 128) bf16 and lse (H, To) fp32 from the
// forward (To as in attention_forward). dO is quantized inside in 32x32 blocks, D = rowsum(out∘dout),
// dS = P∘(dP − D) quantized 1x32 along Q tokens (dK) and 32x32 (dQ). With opt.causal (the
// forward's), P = dS = 0 exactly for masked keys, and a row facing exactly one key gets dS = 0.
// Outputs: dq (Tq, H, 128), dk and dv (Tk, H, 128), bf16; with broadcast_q, dq is the sum over the
// batch. With opt.output_mxfp8_dkv, dk and dv are E4M3 payloads (Tk, H, 128) instead, quantized in
// 32x32 blocks (32 tokens from each K sequence start x 32 dims, RCEIL), and dk_scales, dv_scales
// (Tk, H, 4) E8M0 receive each token row's block scale (the hdim-plain shape); without the option
// the scale views must be left empty. CPU tensors run the exact-MX CPU reference. CUDA tensors run
// the fast sm_90a kernel (docs/attention.md: a dK/dV kernel and a dQ kernel, no atomics, so the
// results are deterministic; scales re-expressed as for the forward, dO and dS quantized with
// power-of-two scales per row / channel block; workspace O(T·H·128) bytes, allocated on the stream),
// or with opt.exact_mx the exact-MX GPU path. Both CUDA paths take the default dq_accum, p_scale and
// output_mxfp8_dkv only (others: Status kUnsupported, nothing written). The metadata must be
// uploaded for CUDA tensors.
// workspace: device memory of at least attention_backward_workspace_size() bytes for the fast
// kernel, 256-byte aligned (as cudaMalloc's), or nullptr to let the call allocate (stream-ordered)
// and free it; unused elsewhere.
Status attention_backward(const MxTensor& q, const MxTensor& q_seq, const MxTensor& k, const MxTensor& k_seq,
                          const MxTensor& v, TensorView out, TensorView dout, TensorView lse, const JaggedMeta& q_meta,
                          const JaggedMeta& k_meta, const AttentionBackwardOptions& opt, TensorView dq, TensorView dk,
                          TensorView dv, TensorView dk_scales = {}, TensorView dv_scales = {}, void* workspace = nullptr,
                          size_t workspace_bytes = 0, void* stream = nullptr);

// Device workspace the fast CUDA backward needs (bytes; 0 for metadata the call would reject and in
// a build without CUDA). The same for CPU tensors and exact_mx, which use none.
size_t attention_backward_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                         const AttentionBackwardOptions& opt);

// ------------------------------------------------------ backward operands in the execution layout
// The fast backward's operands as its kernels read them (docs/backward.md): MX values (RCEIL,
// 32-blocks) re-expressed to coarser power-of-two scales, as attention_backward's prepare passes do
// for MX tensors, except that Q and K along tokens get one scale per (head, 128-token tile) instead
// of per (sequence, head, channel), so that each output is one pass over its input. Shapes (Pq, Pk:
// the metadata's padded token counts):
//   q (H, Pq, 128) e4m3, q_scale (H, Pq) fp32 and k (H, Pk, 128), k_scale (H, Pk/128): Q and K along
//     the head dim, the same bytes as AttentionFwdOperands' q and k;
//   v (H, Pk, 128), v_scale (H, Pk/128): V along the head dim, per 128-key tile (as k);
//   qt (H, 128, Pq), qt_scale (H, Pq/128) and kt (H, 128, Pk), kt_scale (H, Pk/128): Q and K along
//     tokens, token-contiguous in the kernels' fragment order, per 128-token tile (as the forward's v).
// With grouped-query attention (K and V with Hkv heads, a divisor of H), k, v, kt and their scales
// have Hkv heads; q and qt keep H.
// Written by quantize_attention_backward (one pass per output), they spare attention_backward its
// five prepare passes (8-20% of the backward on the H200, docs/performance.md).
struct AttentionBwdOperands {
  TensorView q, q_scale, k, k_scale, v, v_scale, qt, qt_scale, kt, kt_scale;
};
struct AttentionBwdOperandShapes {
  int64_t q[3], q_scale[2], k[3], k_scale[2], v[3], v_scale[2], qt[3], qt_scale[2], kt[3], kt_scale[2];
};
AttentionBwdOperandShapes attention_bwd_operand_shapes(const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                                                       int64_t heads, int64_t kv_heads = 0);
// The ten tensors in the order q, k, v, qt, kt, q_scale, k_scale, v_scale, qt_scale, kt_scale: their
// byte sizes, and views of them over caller buffers (e4m3 payloads, fp32 scales) on `device`.
inline constexpr int kAttentionBwdOperandCount = 10;
void attention_bwd_operand_bytes(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                 size_t bytes[kAttentionBwdOperandCount], int64_t kv_heads = 0);
AttentionBwdOperands attention_bwd_operand_views(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                 void* const data[kAttentionBwdOperandCount], Device device,
                                                 int device_id = 0, int64_t kv_heads = 0);

// q (Tq, H, 128), k and v (Tk, H, 128): bf16 or fp32 (all three alike), contiguous; the same
// inputs the forward quantizes. Every byte of `ops` is written (padding included). CPU tensors: the
// CPU reference (ref::attention_fwd_operands' rules applied to each output); CUDA: five kernels,
// bit-identical to it. write_qk = false: ops.q, q_scale, k, k_scale are checked but not written
// (pass views of the forward's AttentionFwdOperands of the same inputs, which hold those bytes:
// a training step then writes three outputs instead of five).
Status quantize_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const JaggedMeta& q_meta, const JaggedMeta& k_meta,
                                   const AttentionBwdOperands& ops, void* stream = nullptr, bool write_qk = true);

// Both operand sets of a training step from one read of q, k, v: all of `fwd` (as
// quantize_attention_forward writes it) and `bwd`'s v, qt, kt and their scales (as
// quantize_attention_backward writes them). bwd.q, q_scale, k, k_scale must be views of fwd's q,
// q_scale, k, k_scale (the same data pointers: the backward's Q' and K' are the forward's bytes);
// they are written once, through fwd. Inputs and every rule as for the two quantizers; nothing is
// written unless all checks pass. CPU tensors: the CPU reference; CUDA: three kernels for bf16
// inputs (each reads its input once and writes both of its outputs), six for fp32. The bytes equal
// quantize_attention_forward's followed by quantize_attention_backward(..., write_qk = false).
Status quantize_attention_training(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionFwdOperands& fwd,
                                   const AttentionBwdOperands& bwd, void* stream = nullptr);

// The same with K and V given as MX tensors: hdim orientation, plain scales, token-major payloads
// (Tk, H, 128), e.g. what gemm_quantize writes for N = H * 128 (a fused producer's K and V reach the
// attention without a bf16 copy). The bytes equal quantize_attention_training's on their bf16 values
// (dequantize(..., bf16): every MX value but those under bf16's normal range, which it rounds);
// q bf16 or fp32. CUDA: one read of each MX tensor (half the bytes of bf16); CPU: through bf16.
Status quantize_attention_training(const TensorView& q, const MxTensor& k, const MxTensor& v,
                                   const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionFwdOperands& fwd,
                                   const AttentionBwdOperands& bwd, void* stream = nullptr);

// Device workspace of the backward on operands (the MX-tensor backward's less the operands' room,
// plus the ring's blocks where it runs: see below); 0 for metadata the call would reject and in a
// build without CUDA. Read at the call: MXFLASH_BWD_RING changes it.
// kv_heads: K and V's heads (0: heads); grouped-query attention adds the K-side operands repeated per
// Q head and the per-head dK, dV (bf16), ~7 bytes per element of the repeated K/V.
size_t attention_backward_operands_workspace_size(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads,
                                                  const AttentionBackwardOptions& opt, int64_t kv_heads = 0);

// The backward on operands from quantize_attention_backward (same q_meta, k_meta); out, dout, lse,
// options and outputs as for attention_backward on MX tensors, except that with grouped-query operands
// (k, v, kt with Hkv heads, a divisor of ops.q's H) dk and dv are (Tk, Hkv, 128) bf16, each the sum of
// its group's H / Hkv Q heads' gradients (fp32 sums of the per-head bf16 gradients, rounded once:
// the bytes of the backward on K and V repeated per Q head followed by that sum; output_mxfp8_dkv is
// not supported with them). CPU tensors: the exact-MX reference
// on the operands' values; CUDA: the fast kernels without their prepare passes. Where every Q and
// K/V sequence has one length L, a multiple of 512 up to 8192, without broadcast_q, and from 1024
// tokens and 256 128-token tiles in all, or where every Q sequence (broadcast_q: the one) has one
// length of 4 to 16 tiles, the K/V sequences, of any lengths, 8 tiles on average or more, and the
// batch at least 8 (sequence, head) groups a bundle of dQ CTAs (the ring's rectangular form, taken
// first; MXFLASH_BWD_RING=0|1|2: off, the square form wherever a shape allows, the rectangular form
// wherever it can run), the two kernels run as one cooperative
// launch that hands P and dS over through L2 (the ring, docs/backward.md): dK takes dS with one
// scale per 64 queries x 128 keys, still deterministic, ~20-50 MB more workspace; a device that
// cannot hold its grid at once runs the two kernels instead. opt.exact_mx is not supported here (the exact path takes MX tensors).
// workspace: as for attention_backward on MX tensors (256-byte aligned).
Status attention_backward(const AttentionBwdOperands& ops, TensorView out, TensorView dout, TensorView lse,
                          const JaggedMeta& q_meta, const JaggedMeta& k_meta, const AttentionBackwardOptions& opt,
                          TensorView dq, TensorView dk, TensorView dv, TensorView dk_scales = {},
                          TensorView dv_scales = {}, void* workspace = nullptr, size_t workspace_bytes = 0,
                          void* stream = nullptr);

}  // namespace mxflash
