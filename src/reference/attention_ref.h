// CPU reference of attention forward and backward on packed jagged (T, H, 128) tensors, with or
// without a causal mask, in four numeric methods. The FP64 method is the ground truth every accuracy
// number is measured against; the exact-MX method is the definition the GPU kernels are checked
// against (ARCHITECTURE.md §3, §5; REFERENCE.md §2, §5).
//
// Shapes and conventions (all host memory, token-major, head dim 128):
//   q (Tq, H, 128), k and v (Tk, H, 128), fp32, with independent metadata q_meta and k_meta.
//   Without broadcast_q, q_meta and k_meta have the same batch B and Q sequence b attends to K/V
//   sequence b; the output has Tq tokens. With broadcast_q, q_meta holds one sequence of length Lq
//   that attends to each of the B K/V sequences; the output has B*Lq tokens (token b*Lq + i) and
//   dQ is summed over the batch.
//   out (To, H, 128); lse (H, To), natural log; rows with no keys give O = 0 and LSE = -inf.
//   causal (mxflash::CausalMask, attention.h): query row i of a Q sequence of Lq rows sees keys
//   0 .. n - 1 of its K/V sequence of Lk keys, n = causal_keys(causal, i, Lq, Lk) (broadcast_q: the
//   shared sequence's rows against each K/V sequence b, with b's Lk). Every method treats a masked
//   key as absent: it takes no part in the row max, the row sum, P or dS (both exactly 0), so it
//   contributes exactly nothing to O, LSE, dQ, dK or dV; a row facing no key gets O = 0, LSE = -inf
//   and no gradient contribution, as a row of an empty K/V sequence. Masked zeros never raise a
//   block's amax, so the MX blocks of P and dS (and the per-tensor FP8 dS scale) are those of the
//   unmasked values. kNone gives the results of the unmasked code bit for bit.
//   dout (To, H, 128) fp32; dq (Tq, H, 128); dk, dv (Tk, H, 128).
//
// Methods (what each models):
//   kFp64         exact math in double on the unquantized inputs.
//   kBf16         a BF16 flash-attention kernel: Q, K, V, dO rounded to bf16; S in fp32; P rounded
//                 to bf16 before P.V; row sum l from the fp32 P; fp32 accumulation; O, dQ, dK, dV
//                 rounded to bf16; backward P and dS rounded to bf16 before their GEMMs. Under a
//                 causal mask, as FA2 / FA3 do: masked scores are -inf (P = 0 exactly, no part in
//                 the row max or sum), the unmasked keys' arithmetic is unchanged.
//   kFp8PerTensor cuDNN / FA3 FP8: one fp32 scale per (tensor, head), descale = amax / 448 from
//                 the exact current amax (not a power of two: that is what those libraries are fed,
//                 and it is the most favourable per-tensor choice), elements e4m3 with saturating
//                 RNE. P in [0, 1] is stored as e4m3(448 p) (the scale that maps P's maximum 1.0 to
//                 the top of the e4m3 range, as cuDNN's scale_s for amax(P) = 1; FA3 converts P
//                 unscaled, which differs only for p < 2^-6) in the forward and for dV; dS per
//                 tensor and head from its exact amax (a first backward pass finds it); D as for MX
//                 below; fp32 accumulation; O, dQ, dK, dV in bf16. Under a causal mask: Q, K, V, dO
//                 keep their scales from the whole tensors (they are quantized before the attention,
//                 which the mask does not reach); P keeps 448 (each row's max over its unmasked keys
//                 still gives p = 1); dS's amax is over the unmasked entries only (masked dS are 0,
//                 as in a kernel that masks the scores before the softmax).
//   kMx           exact MX: Q, K along hdim, V along seq (32-token blocks from each sequence start),
//                 RCEIL, through the library quantizer; products are sums over 32-blocks of
//                 scale_a * scale_b * (a8 . b8), evaluated exactly (dequantize, then double).
//                 Forward P = exp(S*scale - m) with m the row max, stored as e4m3(256 p) (constant
//                 2^-8 scale); O = sum(P_q V) / l with l = sum of the unquantized P (as FA kernels
//                 do); O in bf16, LSE = m + log l in fp32.
//                 Backward: P = exp2(min(S*scale*log2e - LSE*log2e, 20)) from the forward LSE; dO in
//                 32x32 blocks; dP = dO_q . V_q^T with V hdim-oriented; dV = P_q^T . dO_q (P_q as in
//                 the forward); D = rowsum(O . dO) from the forward's O and the fp32 dO;
//                 dS = P (dP - D), quantized in-kernel style (RCEIL, zero block byte 127) in 1x32
//                 blocks along Q tokens for dK = dS^T . Q_seq and in 32x32 blocks for dQ = dS . K_seq
//                 (blocks aligned to the Q and K sequence starts); softmax_scale applied to dK and dQ
//                 afterwards. A row facing exactly one key (causal_keys(...) == 1: without a mask, a
//                 K/V sequence of length 1; with one, e.g. row 0 under kTopLeft) gives dS = 0 exactly
//                 (softmax over one key is constant; REFERENCE.md §5): the MX method applies that rule
//                 explicitly, because the quantized dP and the bf16 O no longer cancel on their own.
// "fp32 accumulation" is modelled as double accumulation rounded to fp32 at each GEMM output: the
// fp32 summation error (~1e-7 relative) is orders of magnitude below the bf16 / e4m3 rounding the
// methods are compared on. The forward uses the final row max instead of an online running max:
// the same relative P rounding for every element above the e4m3 subnormal range.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "mxflash/attention.h"
#include "mxflash/jagged.h"
#include "mxflash/status.h"

namespace mxflash::ref {

enum class AttnMethod : int { kFp64 = 0, kBf16 = 1, kFp8PerTensor = 2, kMx = 3 };
const char* to_string(AttnMethod m);  // "fp64", "bf16", "fp8", "mx"
bool parse_attn_method(const std::string& name, AttnMethod* m);
// Status::Invalid naming causal for a value outside CausalMask (the reference's and the public
// entry points' one check).
Status check_causal(CausalMask causal);

inline const double kDefaultSoftmaxScale = 1.0 / std::sqrt(double(kHeadDim));
inline constexpr float kFp8PScale = 448.f;  // per-tensor FP8: P stored as e4m3(448 p)
inline constexpr int kMxPScaleLog2 = 8;     // exact MX: P stored as e4m3(2^8 p)
inline constexpr double kPExp2Clamp = 20.0; // backward P = exp2(min(x, 20)) (REFERENCE.md §5)

struct AttnProblem {
  const JaggedMeta* q_meta = nullptr;
  const JaggedMeta* k_meta = nullptr;
  int64_t heads = 0;
  const float* q = nullptr;  // (Tq, H, 128)
  const float* k = nullptr;  // (Tk, H, 128)
  const float* v = nullptr;  // (Tk, H, 128)
  double softmax_scale = kDefaultSoftmaxScale;
  bool broadcast_q = false;
  CausalMask causal = CausalMask::kNone;  // the keys each query row sees (above; attention.h)
};

inline AttnProblem make_problem(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, const float* q,
                                const float* k, const float* v, double softmax_scale = kDefaultSoftmaxScale,
                                bool broadcast_q = false, CausalMask causal = CausalMask::kNone) {
  return AttnProblem{&q_meta, &k_meta, heads, q, k, v, softmax_scale, broadcast_q, causal};
}

// The forward's Hopper execution form (AttnOptions::hopper_fwd).
// kVPerTile: one scale per (128-key tile, head) for V as for K, so the kernel's once-per-tile
// promotion needs no per-channel multiply.
enum class HopperFwd : int { kNone = 0, kVPerSequenceChannel, kVPerTileChannel, kVPerTile };

struct AttnOptions {
  // Non-FP64 methods: O, dQ, dK, dV rounded to bf16, as the kernels deliver them; false keeps
  // them at fp32 (for analysis of the output rounding itself). LSE is fp32 either way.
  bool round_outputs = true;
  int threads = 2;  // std::thread workers over (sequence, head) items; results do not depend on it
  // MX backward only: >= 0 models dQ accumulated in fp16 with the static scale 2^k (AttentionBackward
  // Options::dq_accum = fp16): per Q row, each 128-key K/V tile's contribution is rounded to fp32,
  // scaled, rounded to fp16 and added to the fp16 accumulator (rounded again), tile after tile; with
  // broadcast_q the sequences' accumulators are then summed in fp16 in batch order. Overflow gives
  // +-inf, as it would on the GPU. -1: fp32 accumulation.
  int dq_fp16_scale_log2 = -1;
  // MX backward only: P for dV quantized in 1x32 blocks along Q tokens with their own scales
  // (AttentionBackwardOptions::p_scale = dynamic) instead of e4m3(256 p).
  bool dynamic_p = false;
  // MX backward only: the Hopper execution form the fast kernel is planned around (docs/backward.md):
  // operands re-expressed to coarser power-of-two scales (Q and dO for dP per row, K and V per
  // 128-key tile, the token-contracted Q, K, dO per (sequence, channel)), dS quantized per key over a
  // 64-row Q tile (dK) and per row over a 128-key tile (dQ), 64-row Q blocks.
  bool hopper_exec = false;
  // hopper_exec only: query rows per dS block of dQ's operand (one scale per rows x 128 keys): 1 =
  // per row (the default kernel); 64 = the fused-dQ experiment (removed from the kernels; commit
  // f68e8a5), one scale per 64-query half and the CTA's 128 keys; 0 = dK's operand (per key over
  // the 64-query tile) re-expressed to the largest of the 128-key tile's key scales, rounded once
  // more to e4m3 (the dQ-from-a-dS-dump experiment, MXFLASH_BWD_VARIANT bit 30).
  int hopper_dq_rows = 1;
  // hopper_exec only: dK's operand is dQ's, both dS in blocks of 64 query rows (half of a 128-row
  // Q tile aligned to the sequence start) x 128 keys with one scale each, as a dK/dV kernel fed with
  // the dQ kernel's bytes uses them (docs/backward.md, "The dQ kernel feeding a GEMM-only dK/dV
  // kernel"); overrides hopper_dq_rows.
  bool hopper_dk_from_dq = false;
  // hopper_exec only: the P in dS = P (dP - D): 0 the fp32 P; 1 the P the dV product takes (e4m3 of
  // 256 p, over 256); 2 P rounded to bf16. 1 and 2 are the numerics of a split where the dQ side
  // hands P over (as e4m3 or bf16 bytes) and the dK/dV side computes dP and dS from it
  // (docs/backward.md, "The ring's hand-over, costed").
  int hopper_ds_p = 0;
  // MX forward only: its operands in the Hopper execution form (Q per row, K per 128-key tile, V
  // per (sequence, channel) as the fast kernel's prepare pass writes them, or V per (128-key tile,
  // channel): a form a quantizer could write from one 128-token strip).
  HopperFwd hopper_fwd = HopperFwd::kNone;
};

struct AttnForwardResult {
  std::vector<double> out;  // (To, H, 128)
  std::vector<double> lse;  // (H, To)
};

struct AttnBackwardResult {
  std::vector<double> dq;  // (Tq, H, 128)
  std::vector<double> dk;  // (Tk, H, 128)
  std::vector<double> dv;  // (Tk, H, 128)
};

// The values each product of a method consumes, dequantized to double, (T, H, 128) each: the
// operand contract of a method (for MX: which orientation feeds which product).
struct AttnOperands {
  std::vector<double> q_s, k_s;    // S = Q K^T
  std::vector<double> v_o;         // O = P V
  std::vector<double> v_dp, do_g;  // dP = dO V^T; dV = P^T dO
  std::vector<double> q_dk, k_dq;  // dK = dS^T Q; dQ = dS K
};
Status attention_operands(const AttnProblem& p, AttnMethod m, const float* dout, AttnOperands* ops);

// Checks metadata, heads, pointers, the softmax scale and the causal mask; names the argument and
// the rule.
Status check_problem(const AttnProblem& p);
// Output tokens: Tq, or B * Lq with broadcast_q.
int64_t out_tokens(const AttnProblem& p);

Status attention_forward(const AttnProblem& p, AttnMethod m, AttnForwardResult* result,
                         const AttnOptions& opt = {});

// The exact-MX backward on operands the caller quantized (the public attention_backward's CPU
// path): ops.q_s, ops.k_s (Q, K along hdim), ops.v_dp (V along hdim), ops.q_dk, ops.k_dq (Q, K along
// seq), dequantized, (T, H, 128) each; the other members are not read. dO is quantized here in
// 32x32 blocks from `dout`; D and P come from `fwd` (out and lse) as in attention_backward. p.q,
// p.k, p.v are not read.
Status attention_backward_mx_operands(const AttnProblem& p, const AttnOperands& ops, const AttnForwardResult& fwd,
                                      const float* dout, AttnBackwardResult* grads, const AttnOptions& opt = {});

// `fwd` must be the same method's forward result (its O enters D = rowsum(O . dO), its LSE
// recomputes P), `dout` (To, H, 128).
Status attention_backward(const AttnProblem& p, AttnMethod m, const AttnForwardResult& fwd, const float* dout,
                          AttnBackwardResult* grads, const AttnOptions& opt = {});

// The forward's operands in the fast kernel's execution layout (mxflash::AttentionFwdOperands,
// attention.h): q, k, v (T, H, 128) fp32 quantized to MX by the library quantizer (RCEIL; Q, K
// along hdim, V along tokens), each block's bytes then re-expressed to the largest block scale of
// its group (Q: row; K: (head, 128-key tile); V: (head, 128-key tile, channel)) with
// shift_e4m3_byte. Padding tokens hold zero bytes, their Q scale is 1.
struct AttnFwdOperands {
  std::vector<uint8_t> q, k, v;                // (H, Pq, 128), (H, Pk, 128), (H, 128, Pk) (fragment order)
  std::vector<float> q_scale, k_scale, v_scale;  // (H, Pq), (H, Pk / 128), (H, Pk / 128)
};
Status attention_fwd_operands(const JaggedMeta& q_meta, const JaggedMeta& k_meta, int64_t heads, const float* q,
                              const float* k, const float* v, AttnFwdOperands* out);
// An e4m3 byte's value times 2^-shift, rounded to nearest even (NaN kept; a zero keeps the sign).
uint8_t shift_e4m3_byte(uint8_t b, int shift);

}  // namespace mxflash::ref
