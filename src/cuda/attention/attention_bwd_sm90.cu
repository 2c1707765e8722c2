// MXFP8 attention backward, sm_90a: FP8 wgmma, TMA loads, one producer warpgroup and two consumer
// warpgroups, two kernels and no atomics (deterministic: the same inputs give the same bits).
//
//  dK/dV kernel: a CTA owns 128 keys (64 per consumer warpgroup) and streams the Q tiles of its
//    sequence. Per 64-query half: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (both from shared memory), Pᵀ and
//    dSᵀ = Pᵀ∘(dPᵀ − D) in registers, then dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ and dSᵀ as register
//    A operands: the keys are the wgmma rows, so no transpose of P or dS is ever needed.
//  dQ kernel: a CTA owns 128 queries and streams the K/V tiles: S = Q Kᵀ, dP = dO Vᵀ, dS, and
//    dQ += dS K with dS as the register A operand.
// S and dP are recomputed in both kernels (7 GEMMs instead of 5): the price of having neither
// atomics nor a shared-memory transpose of dS.
//
// Scales stay out of the wgmma loops as in the forward (ARCHITECTURE.md §4, docs/attention.md):
// Q per row, K and V (along hdim) per 128-key tile, Q and K along tokens per (sequence, channel)
// (the forward's V preparation), dO per row (dP) and per (128-token tile, channel) (dV), all powers
// of two. P enters dV as e4m3(256 p) (the constant 2^-8 scale); dS is quantized in-kernel with a
// power-of-two scale per row of each 64 x 128 (dK) or 128 x 128 (dQ) block: one scale per key and
// 64 queries for dK, per query and 128 keys for dQ (the exact reference uses 1x32 and 32x32
// blocks; docs/accuracy.md measures the difference). dV and dK are accumulated in FP32 registers
// and every wgmma group is promoted into them (two-level accumulation), dQ alike.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/attention/attention_bwd.h"
#include "cuda/attention/attention_fwd_prepare.cuh"
#include "cuda/attention/attention_sm90_common.cuh"
#include "cuda/attention/tma_map.h"
#include "cuda/attention/trace.cuh"
#include "cuda/attention/work_list.cuh"
#include "cuda/common/launch_utils.cuh"
#include "cuda/common/upload.h"
#include "cuda/common/workspace.h"
#include "cuda/quantize/mx_device.cuh"
#include "cuda/quantize/quantize_cuda.h"

namespace mxflash::cuda {
namespace bwd {

using attn::kTile;
inline constexpr int kHalf = kTile / 2;  // queries per dK/dV step, keys per consumer warpgroup
inline constexpr int kTileBytes = kTile * kHeadDim;
inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kConsumers = 2;
inline constexpr int kThreads = kWarpgroupThreads * (1 + kConsumers);
inline constexpr int kProducerRegs = 24;
inline constexpr int kConsumerRegs = 240;
inline constexpr float kPScale = 256.f;  // P stored as e4m3(256 p)
inline constexpr float kPScaleLog2 = 8.f;

// ------------------------------------------------------------------------------ preprocess of dO
// Per padded output row o of head h (o_pad, see OutRows), written by prepare_dout_kernel:
//   info(h, o) = {Q row scale * softmax_scale * log2 e, LSE * log2 e - 8, dO row scale, D = rowsum(O∘dO)}
// so that exp2(S * x - y) = 256 p, the kernels' P (e4m3(256 p) is the dV operand; dS is formed from
// 256 p and its scale divided by 256). {0, +inf, 0, 0} on padding rows (P = 0 there). Rows facing a
// single key get dO scale 0 and D = 0: dS = P (0 * dP - 0) = 0 exactly, as the reference defines it.
struct DoutPrep {
  const __nv_bfloat16* out;
  const __nv_bfloat16* dout;
  const float* lse;      // (H, To)
  const float* q_scale;  // (H, Pq), from prepare_rows_kernel<true>
  const int32_t* cu_q;
  const int32_t* cu_q_sf;
  const int32_t* cu_k;  // K/V sequence b faces output sequence b
  CausalMask causal;    // rows facing one key: the rule above; rows facing none: padding's infos
  int out_seqs;      // output sequences (K/V sequences)
  bool broadcast_q;  // output sequence b: queries of Q sequence 0, padded to lq_pad rows each
  int64_t lq_pad;
  int64_t H, Pq, Po, To;
  float scale_log2;
  uint8_t* do_rows;   // (H, Po, 128) e4m3, per-row scale
  uint8_t* do_t;      // (H, 128, Po) e4m3, tokens permuted per 32-group, per (tile, channel) scale
  float* do_t_scale;  // (H, Po / 128, 128)
  float4* info;       // (H, Po)
  unsigned* zero;     // zero_words words zeroed on the way (the ring's flags: no memset of their own)
  int64_t zero_words;
};

// The output sequence of a padded output row and where its rows live.
struct OutRows {
  int seq, qb;
  int64_t first;     // row of the padded tile within its sequence
  int64_t len;       // queries of the sequence
  int64_t tok0;      // output token of the sequence's row 0
  int64_t q_pad0;    // padded Q row of the sequence's row 0
};

// Called by whole warps with a warp-uniform o_pad (sequence_of_padded_warp).
__device__ __forceinline__ OutRows out_rows_of(const int32_t* cu_q, const int32_t* cu_q_sf, int out_seqs, bool bcast,
                                               int64_t lq_pad, int64_t o_pad) {
  OutRows r;
  if (bcast) {
    r.seq = int(o_pad / lq_pad);
    r.first = o_pad - int64_t(r.seq) * lq_pad;
    r.qb = 0;
  } else {
    r.seq = attn::sequence_of_padded_warp(cu_q_sf, out_seqs, o_pad);  // o_pad is the CTA's
    r.first = o_pad - cu_q_sf[r.seq];
    r.qb = r.seq;
  }
  r.len = int64_t(cu_q[r.qb + 1]) - cu_q[r.qb];
  r.tok0 = bcast ? int64_t(r.seq) * r.len : int64_t(cu_q[r.seq]);
  r.q_pad0 = cu_q_sf[r.qb];
  return r;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Power-of-two quantization scale of a block with amax a (RCEIL, as the quantizer): byte s,
// 1/scale = 2^(127 - s) (s <= 253 for finite amax).
__device__ __forceinline__ uint32_t scale_byte(float amax) {
  return scale_byte_from_amax_bits(__float_as_uint(amax), ScalingMode::kRceil);
}
__device__ __forceinline__ float inv_scale_of(uint32_t s) { return __uint_as_float((254u - s) << 23); }
// e8m0_to_float(s) without its early returns, which ptxas compiled into two branches (and their
// convergence barriers) on the path from the dS maxima to the packing: the same values.
__device__ __forceinline__ float scale_of(uint32_t s) {
  return __uint_as_float(s == 0 ? 0x00400000u : s == 255 ? 0x7FC00000u : s << 23);
}

// One CTA of 256 threads per (128-row output tile, head): eight threads per row, thread c of a row
// with channels 8c..8c+7 and 64+8c..64+8c+7, so that each of its two 16-byte loads (and each 8-byte
// store of dO's row bytes) is, across the row's eight threads, 128 contiguous bytes: whole sectors.
inline constexpr int kPrepThreads = 256;
inline constexpr int kPrepOutPitch = kTile + 16;  // bytes per dOᵀ channel row staged in shared memory
__global__ void __launch_bounds__(kPrepThreads) prepare_dout_kernel(const DoutPrep p) {
  constexpr int kPitch = kHeadDim / 2 + 1;  // words (bf16 pairs) per row in shared memory
  // The tile's dO rows; after the transposition, the staged dOᵀ bytes (128 channels x 128 tokens).
  __shared__ __align__(16) uint32_t rows[kTile][kPitch];
  static_assert(sizeof(rows) >= kHeadDim * kPrepOutPitch, "dOᵀ's staging fits over the rows");
  __shared__ float cmax[2][kHeadDim];
  const int64_t tile = blockIdx.x, h = blockIdx.y;
  // A programmatic dependent of the work list's upload or the prepare passes (none of whose output
  // it reads; the wait keeps the stream's order for what follows), and the main kernel's primary:
  // that kernel may start its launch now and waits for this grid before its first read.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t threads = int64_t(gridDim.x) * gridDim.y * kPrepThreads;  // the words to zero, grid-stride
  for (int64_t i = (h * gridDim.x + tile) * kPrepThreads + threadIdx.x; i < p.zero_words; i += threads) p.zero[i] = 0u;
  const OutRows o = out_rows_of(p.cu_q, p.cu_q_sf, p.out_seqs, p.broadcast_q, p.lq_pad, tile * kTile);
  const int chunk = threadIdx.x % 8, row0 = threadIdx.x / 8;
  // This thread's words (bf16 pairs) of a row: 4 chunk + k, then 32 + 4 chunk + k (k < 4).
  auto word_of = [&](int k) { return (k / 4) * (kHeadDim / 4) + chunk * 4 + k % 4; };
#pragma unroll 1
  for (int pass = 0; pass < kTile / (kPrepThreads / 8); ++pass) {
    const int r = row0 + pass * (kPrepThreads / 8);
    const int64_t i = o.first + r;
    const bool valid = i < o.len;
    uint32_t g[8] = {0, 0, 0, 0, 0, 0, 0, 0}, x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (valid) {
      const int64_t at = ((o.tok0 + i) * p.H + h) * kHeadDim + chunk * 8;
      const uint4* gd = reinterpret_cast<const uint4*>(p.dout + at);
      const uint4* od = reinterpret_cast<const uint4*>(p.out + at);
      const uint4 g0 = gd[0], g1 = gd[8], o0 = od[0], o1 = od[8];  // (channels +0 and +64)
      g[0] = g0.x, g[1] = g0.y, g[2] = g0.z, g[3] = g0.w, g[4] = g1.x, g[5] = g1.y, g[6] = g1.z, g[7] = g1.w;
      x[0] = o0.x, x[1] = o0.y, x[2] = o0.z, x[3] = o0.w, x[4] = o1.x, x[5] = o1.y, x[6] = o1.z, x[7] = o1.w;
    }
    float dsum = 0.f, amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      dsum = fmaf(bf16_lo(g[k]), bf16_lo(x[k]), dsum);
      dsum = fmaf(bf16_hi(g[k]), bf16_hi(x[k]), dsum);
      amax = fmaxf(amax, fmaxf(fabsf(bf16_lo(g[k])), fabsf(bf16_hi(g[k]))));
      rows[r][word_of(k)] = g[k];
    }
#pragma unroll
    for (int off = 1; off < 8; off *= 2) {
      dsum += __shfl_xor_sync(0xFFFFFFFFu, dsum, off);
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    }
    const uint32_t s = scale_byte(amax);
    const float inv = inv_scale_of(s);
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      q[k] = attn::pack_e4m3x4(bf16_lo(g[2 * k]) * inv, bf16_hi(g[2 * k]) * inv, bf16_lo(g[2 * k + 1]) * inv,
                               bf16_hi(g[2 * k + 1]) * inv);
    const int64_t orow = h * p.Po + tile * kTile + r;
    uint8_t* const dst = p.do_rows + orow * kHeadDim + chunk * 8;
    *reinterpret_cast<uint2*>(dst) = make_uint2(q[0], q[1]);
    *reinterpret_cast<uint2*>(dst + kHeadDim / 2) = make_uint2(q[2], q[3]);
    if (chunk == 0) {
      const int64_t keys = causal_keys(p.causal, i, o.len, p.cu_k[o.seq + 1] - p.cu_k[o.seq]);
      const bool one_key = keys == 1;
      p.info[orow] = valid && keys > 0 ? make_float4(p.q_scale[h * p.Pq + o.q_pad0 + i] * p.scale_log2,
                                         p.lse[h * p.To + o.tok0 + i] * attn::kLog2e - kPScaleLog2,
                                         one_key ? 0.f : scale_of(s), one_key ? 0.f : dsum)
                           : make_float4(0.f, INFINITY, 0.f, 0.f);
    }
  }
  __syncthreads();
  {  // channel amax over the tile: thread = (channel, half of the rows)
    const int d = threadIdx.x % kHeadDim, half = threadIdx.x / kHeadDim;
    float m = 0.f;
    for (int r = half * kHalf; r < (half + 1) * kHalf; ++r) {
      const uint32_t w = rows[r][d / 2];
      m = fmaxf(m, fabsf(d % 2 ? bf16_hi(w) : bf16_lo(w)));
    }
    cmax[half][d] = m;
  }
  __syncthreads();
  // dOᵀ: unit = (channel d, 32-token group gq): 32 bytes in the permuted token order, staged in
  // shared memory over the rows once all are read, then stored a whole 128-byte channel row per
  // eight threads.
  constexpr int kUnits = kHeadDim * (kTile / kBlockSize) / kPrepThreads;
  uint32_t w[kUnits][8];
#pragma unroll
  for (int n = 0; n < kUnits; ++n) {
    const int u = threadIdx.x + n * kPrepThreads, d = u % kHeadDim, gq = u / kHeadDim;
    const uint32_t s = scale_byte(fmaxf(cmax[0][d], cmax[1][d]));
    const float inv = inv_scale_of(s);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t word = rows[gq * kBlockSize + attn::permuted_token(4 * k + e)][d / 2];
        v[e] = (d % 2 ? bf16_hi(word) : bf16_lo(word)) * inv;
      }
      w[n][k] = attn::pack_e4m3x4(v[0], v[1], v[2], v[3]);
    }
    if (gq == 0) p.do_t_scale[(h * (p.Po / kTile) + tile) * kHeadDim + d] = scale_of(s);
  }
  __syncthreads();
  uint8_t* const out_t = reinterpret_cast<uint8_t*>(&rows[0][0]);
#pragma unroll
  for (int n = 0; n < kUnits; ++n) {
    const int u = threadIdx.x + n * kPrepThreads, d = u % kHeadDim, gq = u / kHeadDim;
    uint4* st = reinterpret_cast<uint4*>(out_t + d * kPrepOutPitch + gq * kBlockSize);
    st[0] = make_uint4(w[n][0], w[n][1], w[n][2], w[n][3]);
    st[1] = make_uint4(w[n][4], w[n][5], w[n][6], w[n][7]);
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kHeadDim * kTile / 16 / kPrepThreads; ++n) {
    const int idx = threadIdx.x + n * kPrepThreads, d = idx / (kTile / 16), c = idx % (kTile / 16);
    *reinterpret_cast<uint4*>(p.do_t + (h * kHeadDim + d) * p.Po + tile * kTile + c * 16) =
        *reinterpret_cast<const uint4*>(out_t + d * kPrepOutPitch + c * 16);
  }
}

// ------------------------------------------------------------------------------ main kernels
struct BwdParams {
  const int32_t* cu_q;
  const int32_t* cu_q_sf;
  const int32_t* cu_k;
  const int32_t* cu_k_sf;
  const int2* items;  // the work list (work_list.cuh): K/V tiles (dK/dV kernel) or Q tiles (dQ kernel)
  int num_items;      // items x heads: the persistent dK/dV kernel's work list
  bool heads_inner;   // its order within a sequence (heads_in_turn)
  bool causal_br;     // kCausal kernels: the bottom-right alignment (else top-left); in heads_inner's padding
  int heads;
  int64_t Pq, Pk, Po;
  bool broadcast_q;
  int64_t lq_pad;
  const float* k_scale;     // (H, Pk / 128) K along hdim, per tile
  const float* v_scale;     // (H, Pk / 128) V along hdim, per tile
  const float* qt_scale;    // (Bq, H, 128) Q along tokens, per (sequence, channel), in the epilogue
  const float* kt_scale;    // (B, H, 128) K along tokens, per (sequence, channel), in the epilogue
  // kTileScales (exec operands, quantize_attention_bwd_operands): Qᵀ', Kᵀ' per 128-token tile
  // instead, (H, Pq / 128) and (H, Pk / 128), folded into the dK / dQ promotions.
  const float* qt_tile_scale;
  const float* kt_tile_scale;
  const float4* info;       // (H, Po)
  const float* do_t_scale;  // (H, Po / 128, 128)
  float softmax_scale;
  __nv_bfloat16* dq;  // (Tq, H, 128), unless broadcast_q
  float* dq_part;     // broadcast_q: (To, H, 128) fp32, summed over the batch afterwards
  __nv_bfloat16* dk;
  __nv_bfloat16* dv;
  float* dk_f32;  // non-null (output_mxfp8_dkv): dK, dV written in fp32 here instead, quantized after
  float* dv_f32;
  bool staged_dkdv;  // dK, dV (bf16, 16-byte aligned) through the persistent kernel's staging tiles
  bool staged_dq;    // dQ (bf16, 16-byte aligned) staged by the persistent dQ kernel (consume_dq)
  // kDiagDumpDs (experiments builds, MXFLASH_BWD_VARIANT bit 30, exec operands, no broadcast Q):
  // the dK/dV kernel's packed dSᵀ of every (Q tile, K tile, head), 16 KB blocks at
  // ((h Pq / 128 + padded Q tile) dump_kt + K tile of the sequence), and its keys' scale bytes (256
  // a block), for attention_bwd_dq_dump_kernel.
  uint8_t* ds_dump;
  uint8_t* ds_scales;
  int dump_kt;  // the longest K/V sequence's tiles
  // Diagnostic (MXFLASH_BWD_DUMP_WRAP=n, a power of two): every block index taken modulo n, so that
  // the dump's writes and reads stay in an L2-sized window (dQ wrong): what an L2-resident ring of
  // dS blocks between the two kernels would cost them. 0: off.
  int64_t dump_wrap_mask;
  // Diagnostic (experiments builds, MXFLASH_BWD_VARIANT bit 12 with bit 19): a counter a dump block,
  // to which the dQ kernel's signaler warp adds 8 (red.release.gpu) once its eight consumer warps have
  // stored their shares (an mbarrier), awaited (>= 8, ld.acquire.gpu) by the dK/dV kernel's producer before
  // loading the block: the per-step cost of a ring's hand-over (the kernels still run one after the
  // other, so every wait succeeds at once; the counters are not reset between calls).
  unsigned* pds_flags;
  // The ring (ring_config: uniform shapes on exec operands; attention_bwd_ring_kernel): the two
  // kernels' kDumpPds / kFromPds forms run at once as the roles of one cooperative launch, the dK/dV
  // role on ring_config's CTAs, the dQ role on the other SMs, and the dump blocks go through a ring of
  // ring_groups x ring_steps x ring_n blocks in ds_dump. ring_n: the tiles of every sequence (0:
  // off); a group = one (sequence, head), in the same order on both sides. Q tile i takes K tile
  // (i + t) mod n at step t, K tile j Q tile (j - t) mod n, so that each step hands every K-tile unit
  // of the group one block; ring_ready / ring_free: each slot's epoch (g n + t + 1).
  int ring_n;
  int ring_ctas;  // the ring kernel's dK/dV role's CTAs (blockIdx.x < ring_ctas)
  int ring_groups;
  int ring_steps;  // a power of two dividing ring_n: how far a group's dQ side may run ahead of its dK/dV side
  int ring_poll_ns;  // ring_wait's sleep between polls (0: acquire loads back to back)
  unsigned* ring_ready;
  unsigned* ring_free;
  const int2* ring_group;  // kRect: each group's (b x heads + h) bundle and the bundle's step of its K tile 0
  // kCausal kernels: their items in the order of the host's causal_orders (work_list.cuh's
  // static_order for the dK/dV kernel, its slot -> item with -1 for an empty slot, num_items slots;
  // dynamic_order for the dQ kernel, after the dK/dV kernel's). Null elsewhere.
  const int* causal_order;
};
// The epoch of step t of group gid, and that of the slot's previous use (the same group ring_steps
// steps before, or the group ring_groups before at step n - ring_steps + t), 0 for none.
__device__ __forceinline__ unsigned ring_epoch(const BwdParams& p, int gid, int t) {
  return unsigned(gid * p.ring_n + t + 1);
}
__device__ __forceinline__ unsigned ring_prev_epoch(const BwdParams& p, int gid, int t) {
  const int e = int(ring_epoch(p, gid, t));
  const int prev = t >= p.ring_steps ? e - p.ring_steps : e - (p.ring_groups - 1) * p.ring_n - p.ring_steps;
  return prev > 0 ? unsigned(prev) : 0u;
}
// Waits until *a >= want (the ring's ready and free epochs, the bit-12 diagnostic's counters).
// poll_ns 0: acquire loads until then; otherwise relaxed loads with
// poll_ns of sleep between them, then one acquire fence (MXFLASH_BWD_RING_POLL).
__device__ __forceinline__ void ring_wait(const unsigned* a, unsigned want, int poll_ns) {
  unsigned v;
  if (poll_ns == 0) {
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
    } while (v < want);
    return;
  }
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  while (v < want) {
    __nanosleep(unsigned(poll_ns));
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
__device__ __forceinline__ void ring_release(unsigned* a, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(a), "r"(v) : "memory");
}

struct Item {
  int h, b, blk, qb;
  int Lq, Lk;
  int k0;          // the K/V sequence's first token (cu_k[b])
  int64_t o_pad0;  // padded output row of the sequence's row 0
  // The rectangular ring (kRect): the item's bundle, and its bundle's step of the item's first block
  // (dQ unit: of K tile 0; dK/dV unit: the step that produced its blocks).
  int ring_bundle, ring_s0;  // (set only where kRect reads them)
};
// Ring mode: item w's group (one (sequence, head), numbered alike on both sides); the K tile that Q
// tile q takes at step t and the Q tile that K tile k takes ((q + t) and (k - t) mod n); the slot of
// group gid's block of step t and K tile kt (a group's ring_steps x ring_n slots: step t mod
// ring_steps, then K tile).
__device__ __forceinline__ int ring_gid(const BwdParams& p, const Item& w) { return w.b * p.heads + w.h; }
__device__ __forceinline__ int ring_k_tile(int q, int t, int n) { return q + t < n ? q + t : q + t - n; }
__device__ __forceinline__ int ring_q_tile(int k, int t, int n) { return k >= t ? k - t : k - t + n; }
__device__ __forceinline__ int64_t ring_slot(const BwdParams& p, int gid, int t, int kt) {
  return (int64_t(gid % p.ring_groups) * p.ring_steps + (t & (p.ring_steps - 1))) * p.ring_n + kt;
}

// Both kernels' kDiag 8192 (with kRing): the rectangular ring (BwdParams::ring_n is then the Q
// tiles of every group, nq; rect_config on the host). The dQ role's CTAs form bundles of nq, and
// bundle u's CTA i takes Q tile i of the bundle's groups (u, u + bundles, ... in the dQ list's
// group order), one after the other; every unit walks its K tiles in order, so the bundle's
// steps run on across its groups (Item::ring_s0). The group's nq blocks of K tile k are made at
// one step s, each into its own slot of the bundle's ring_steps x nq: slot (u, s mod ring_steps, i),
// ready and free epoch s + 1. The dK/dV role walks an explicit list (BwdParams::items, {group, K
// tile} each, written by rect_list_kernel; BwdParams::ring_group the group's bundle and step of K
// tile 0) sorted by step, then bundle: each of its units takes the nq blocks of one step.
// So a unit only ever waits on units of smaller steps (deadlock-free with every CTA resident), and
// the two roles may take any share of the SMs (the square ring's groups are n x n units in step).
inline constexpr int kRect = 8192;
__device__ __forceinline__ int64_t rect_slot(const BwdParams& p, int bundle, int step, int q_tile) {
  return (int64_t(bundle) * p.ring_steps + (step & (p.ring_steps - 1))) * p.ring_n + q_tile;
}
// Ring helpers of both forms (kDiag's kRing, kRect). A dQ unit (Q tile w.blk): the K tile of its
// step j, the slot its block goes to, the epoch it releases, and the epoch of the slot's previous
// use it waits for (0: none).
template <int kDiag>
__device__ __forceinline__ int dq_ring_k_tile(const Item& w, int j, int n_k) {
  if constexpr ((kDiag & kRect) != 0) return j;
  return ring_k_tile(w.blk, j, n_k);
}
template <int kDiag>
__device__ __forceinline__ int64_t dq_ring_slot(const BwdParams& p, const Item& w, int j, int kt) {
  if constexpr ((kDiag & kRect) != 0) return rect_slot(p, w.ring_bundle, w.ring_s0 + j, w.blk);
  return ring_slot(p, ring_gid(p, w), j, kt);
}
template <int kDiag>
__device__ __forceinline__ unsigned dq_ring_epoch(const BwdParams& p, const Item& w, int j) {
  if constexpr ((kDiag & kRect) != 0) return unsigned(w.ring_s0 + j + 1);
  return ring_epoch(p, ring_gid(p, w), j);
}
template <int kDiag>
__device__ __forceinline__ unsigned dq_ring_prev_epoch(const BwdParams& p, const Item& w, int j) {
  if constexpr ((kDiag & kRect) != 0) {
    const int s = w.ring_s0 + j;
    return s >= p.ring_steps ? unsigned(s + 1 - p.ring_steps) : 0u;
  }
  return ring_prev_epoch(p, ring_gid(p, w), j);
}
// A dK/dV unit (K tile w.blk): the Q tile of its step j, the slot of that block, and its epoch.
template <int kDiag>
__device__ __forceinline__ int kv_ring_q_tile(const Item& w, int j, int n_q) {
  if constexpr ((kDiag & kRect) != 0) return j;
  return ring_q_tile(w.blk, j, n_q);
}
template <int kDiag>
__device__ __forceinline__ int64_t kv_ring_slot(const BwdParams& p, const Item& w, int j) {
  if constexpr ((kDiag & kRect) != 0) return rect_slot(p, w.ring_bundle, w.ring_s0, j);
  return ring_slot(p, ring_gid(p, w), j, w.blk);
}
template <int kDiag>
__device__ __forceinline__ unsigned kv_ring_epoch(const BwdParams& p, const Item& w, int j) {
  if constexpr ((kDiag & kRect) != 0) return unsigned(w.ring_s0 + 1);
  return ring_epoch(p, ring_gid(p, w), j);
}

// An item's fields that follow from its sequence b alone: qb, Lq, Lk and o_pad0.
__device__ __forceinline__ Item sequence_item(const BwdParams& p, int b) {
  Item w;
  w.b = b;
  w.qb = p.broadcast_q ? 0 : b;
  w.Lq = p.cu_q[w.qb + 1] - p.cu_q[w.qb];
  w.k0 = p.cu_k[b];
  w.Lk = p.cu_k[b + 1] - w.k0;
  w.o_pad0 = p.broadcast_q ? int64_t(b) * p.lq_pad : int64_t(p.cu_q_sf[b]);
  return w;
}
// The causal mask (AttentionBackwardOptions::causal), a template flag of the dK/dV kernel (its kDiag
// bit kCausal, not a diagnostic) and of the persistent dQ kernel, which alone run it (no ring): query
// i of item w faces its keys j <= i + causal_off (causal_keys).
inline constexpr int kCausal = 32768;
__device__ __forceinline__ int causal_off(const BwdParams& p, const Item& w) {
  return attn::causal_off(p.causal_br, w.Lq, w.Lk);
}
// Under the causal mask (host and device: the host weighs the items by them, causal_orders): the Q
// tiles [x, x + y) with a query that faces K tile `blk`'s first key, and the K/V tiles up to the
// diagonal of Q tile `blk`'s last row; `off` the diagonal's offset (attn::causal_off).
__host__ __device__ __forceinline__ int2 causal_kv_q_tiles(int blk, int Lq, int off) {
  const int n_q = (Lq + kTile - 1) / kTile;
  const int first = blk * kTile - off > 0 ? blk * kTile - off : 0;
  if (first >= Lq) return make_int2(0, 0);
  return make_int2(first / kTile, n_q - first / kTile);
}
__host__ __device__ __forceinline__ int causal_dq_k_tiles(int blk, int Lq, int Lk, int off) {
  const int last = ((blk + 1) * kTile < Lq ? (blk + 1) * kTile : Lq) - 1;
  return (attn::causal_row_keys(last, off, Lk) + kTile - 1) / kTile;
}
// The Q tiles [x, x + y) of dK/dV item w (K tile w.blk): all of them, or (kCausal) those with a query
// that faces the tile's first key.
template <bool kCausalMask>
__device__ __forceinline__ int2 kv_q_tiles(const BwdParams& p, const Item& w) {
  if constexpr (!kCausalMask) {
    return make_int2(0, (w.Lq + kTile - 1) / kTile);
  } else {
    return causal_kv_q_tiles(w.blk, w.Lq, causal_off(p, w));
  }
}
// The K/V tiles of dQ item w (Q tile w.blk): all, or (kCausal) up to the diagonal of its last row.
template <bool kCausalMask>
__device__ __forceinline__ int dq_k_tiles(const BwdParams& p, const Item& w) {
  if constexpr (!kCausalMask) {
    return (w.Lk + kTile - 1) / kTile;
  } else {
    return causal_dq_k_tiles(w.blk, w.Lq, w.Lk, causal_off(p, w));
  }
}
// The item in slot `index` of a causal kernel's order (BwdParams::causal_order; -1: an empty slot),
// or `index` itself.
template <bool kCausalMask>
__device__ __forceinline__ int ordered_item(const BwdParams& p, unsigned index) {
  if constexpr (kCausalMask) {
    return p.causal_order[index];
  } else {
    return int(index);
  }
}

// kKvTiles: the items are K/V tiles (dK/dV kernel), otherwise Q tiles (dQ kernel).
// kReverse: a sequence's tiles last first (the causal dQ kernel: the Q tiles that face the most keys
// first; the dK/dV list's first K tiles face the most queries already).
template <bool kKvTiles, bool kReverse = false>
__device__ __forceinline__ Item item_of(const BwdParams& p, unsigned index) {
  const int2 it = p.items[index / unsigned(p.heads)];
  Item w = sequence_item(p, it.x);
  const unsigned tiles = unsigned(((kKvTiles ? w.Lk : w.Lq) + kTile - 1) / kTile);
  const attn::HeadTile ht = attn::head_and_tile(index, unsigned(it.y), tiles, unsigned(p.heads), p.heads_inner);
  w.h = ht.h;
  w.blk = kReverse ? int(tiles) - 1 - ht.tile : ht.tile;
  return w;
}
// The dK/dV role's item `index` of the rectangular ring's explicit list (kRect: {group b x heads + h,
// K tile}); otherwise item_of<true>.
template <int kDiag>
__device__ __forceinline__ Item kv_item_of(const BwdParams& p, unsigned index) {
  if constexpr ((kDiag & kRect) != 0) {
    const int2 e = p.items[index];
    const int2 g = p.ring_group[e.x];
    Item w = sequence_item(p, e.x / p.heads);
    w.h = e.x - w.b * p.heads;
    w.blk = e.y;
    w.ring_bundle = g.x;
    w.ring_s0 = g.y + e.y;
    return w;
  } else {
    return item_of<true>(p, index);
  }
}

// dS row scale of one accumulator row pair: amax over the quad, 1/scale and scale.
__device__ __forceinline__ void row_scales(const float (&amax)[2], float (&inv)[2], float (&scale)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t s = scale_byte(attn::quad_max(amax[r]));
    inv[r] = inv_scale_of(s);
    scale[r] = scale_of(s);
  }
}

// ---------------------------------------------------------------- dK / dV
struct KvStage {
  alignas(1024) uint8_t q[kTileBytes];     // Q' rows of the Q tile
  alignas(1024) uint8_t dout[kTileBytes];  // dO' rows
  alignas(1024) uint8_t qt[kTileBytes];    // Qᵀ' (128 channels x 128 queries)
  alignas(1024) uint8_t dot[kTileBytes];   // dOᵀ'
  alignas(16) float4 info[kTile];
  alignas(16) float dot_scale[kHeadDim];
  // kFromPds (the ring; experiments): the dump block's dS row scale bytes, and each half's scale as a float
  // (in the stage's padding to 1 KB: the other fields keep their places).
  alignas(16) uint8_t ds_rows[kTile];
  float ds_scale[4];
};
inline constexpr int kKvStages = 2;
inline constexpr uint32_t kKvStageTx = 4 * kTileBytes + kTile * sizeof(float4) + kHeadDim * sizeof(float);
struct KvSmem {
  alignas(1024) uint8_t k[kTileBytes];
  alignas(1024) uint8_t v[kTileBytes];
  KvStage st[kKvStages];
  alignas(8) uint64_t kv_full;
  uint64_t kv_empty;  // persistent form: the consumers are done with K, V
  uint64_t full[kKvStages];
  uint64_t empty[kKvStages];
  uint64_t info_ready[kKvStages];  // the stage's query infos times the item's K and V tile scales
};
inline constexpr size_t kKvSmemBytes = sizeof(KvSmem) + 1024;

inline constexpr size_t kKvSmemOffsetStage = (sizeof(KvSmem) + 1023) / 1024 * 1024;

// The staged epilogue of the persistent dK/dV kernel (placed after KvSmem): one staging tile per
// consumer warpgroup (64 keys x 128 channels of bf16), dV then dK through it
// (attn::stage_and_store); named barriers kBarStage0 + the warpgroup. The ring's dK/dV role, which
// loads no K or V, stages dK in their space instead (dkdv_body's kNeedKv).
struct DkdvStageSmem {
  alignas(1024) uint8_t t[kConsumers][attn::kStageBytes];
};
inline constexpr size_t kKvSmemBytesStaged = kKvSmemOffsetStage + sizeof(DkdvStageSmem) + 1024;
static_assert(kKvSmemBytesStaged <= 227 * 1024, "dK/dV kernel with staging tiles: shared memory");
inline constexpr int kBarStage0 = 3;

// A warpgroup's 64 x 128 fp32 accumulator (the m64n128 layout, this thread's `quad`) as the bf16
// pairs attn::stage_and_store takes, each value times factor(channel) / kPScale.
template <typename Factor>
__device__ __forceinline__ void pack_bf16_rows(const float (&acc)[64], int quad, Factor factor,
                                               uint32_t (&packed)[2][16]) {
#pragma unroll
  for (int jn = 0; jn < 16; ++jn) {
    const int col = 8 * jn + 2 * quad;
    const float f0 = factor(col), f1 = factor(col + 1);
#pragma unroll
    for (int r = 0; r < 2; ++r)
      packed[r][jn] =
          attn::bf16x2_bits(acc[4 * jn + 2 * r] * f0 * (1.f / kPScale), acc[4 * jn + 2 * r + 1] * f1 * (1.f / kPScale));
  }
}

// kPersistent (the default; MXFLASH_BWD_VARIANT bit 0 of experiment builds runs the other form):
// one CTA per SM walks the work list with a stride of gridDim.x; the Q-tile stages run on across
// items and the next item's K, V load as soon as both consumer warpgroups issued their last Sᵀ /
// dPᵀ (kv_empty), i.e. under the previous item's last dV / dK GEMMs and its epilogue. Otherwise one
// CTA per item. Both roles count the Q tiles (it) and K/V loads (kv_i) of the items before, alike.
// Measured on an H200 (same binary, A/B): +5% on cross and jagged (few Q tiles per item, so the
// prologue and epilogue weigh), the same on llm and llm-long.
// kDvPerHalf (experiment, MXFLASH_BWD_VARIANT bit 1): dV += Pᵀ dO issued and promoted per 64-query
// half, as dK, instead of once per Q tile (the default: both halves' Pᵀ go into one fresh
// accumulator after the second half's dK, one promotion with the tile's dO channel scales, which
// the two halves share).
// kTrace (experiments builds, MXFLASH_BWD_VARIANT bit 10): the consumers' clock trace (trace.cuh).
// The fused 5-GEMM form (dQ from dS in this kernel, reduced in fp32 into a workspace:
// MXFLASH_BWD_VARIANT bits 3-8 and its diagnostics) measured slower than the two kernels and was
// removed on 2026-11-30 (docs/backward.md; commit f68e8a5 has the code).
// kTileScales: operands in the execution layout (BwdParams::qt_tile_scale): Qᵀ' scales per Q tile in
// dK's promotions instead of per channel in the epilogue. (A template flag: testing the pointers in
// the kernels instead measured 1-5% slower on the MX-tensor path.)
// kDiag (experiments builds, MXFLASH_BWD_VARIANT bits 20-23, 28-29; dK, dV garbage): parts of the
// consumers' work left out to measure what each costs: 1 the S and dP GEMMs (their accumulators
// undefined), 2 the P and dS math (the accumulators packed as they are), 4 the dK and dV GEMMs
// (their fragments consumed, the fresh accumulators undefined), 8 the promotions.
inline constexpr int kDiagNoSdp = 1, kDiagNoMath = 2, kDiagNoGrad = 4, kDiagNoPromote = 8;
// The dK/dV math's pipes (MXFLASH_BWD_VARIANT bits 28, 29): 16 the exponentials left out (P = their
// argument: one MUFU.EX2 fewer per score element), 32 Pᵀ and dSᵀ packed by byte permutes (the
// floats' top bytes, integer pipe) instead of F2FP conversions.
inline constexpr int kDiagNoExp = 16, kDiagNoCvt = 32;
// MXFLASH_BWD_VARIANT bit 30 (kDiag 64, an experiment): each consumer thread also stores its packed
// dSᵀ of every half (32 bytes) and its keys' scale bytes to global memory (BwdParams::ds_dump), and
// dQ comes from those by a GEMM kernel (attention_bwd_dq_dump_kernel) instead of the dQ kernel.
inline constexpr int kDiagDumpDs = 64;
// consume_dq's kDiag 64 (experiments builds; docs/backward.md "The dQ kernel feeding a GEMM-only
// dK/dV kernel"): the dQ kernel also stores each tile's P (e4m3 of 256 p) and dS bytes and dS's row
// scale bytes into a dump block per (head, padded Q tile, K tile of the sequence), which the dK/dV
// kernel's kFromPds form reads instead of computing S, dP, P and dS itself (with
// MXFLASH_BWD_DUMP_WRAP the blocks wrap around a window: dump_block).
inline constexpr int kDumpPds = 64;
// The dK/dV kernel's kDiag 256: dK and dV from the dump blocks (kDumpPds) instead of its own S, dP
// GEMMs and math.
inline constexpr int kFromPds = 256;
// Both kernels' kDiag 512 (with kDumpPds / kFromPds): ring mode (BwdParams::ring_n).
inline constexpr int kRing = 512;
// Both kernels' kDiag 1024 (with kDumpPds / kFromPds; MXFLASH_BWD_VARIANT bit 14): the dQ kernel stores
// dS only (its block's P bytes left unwritten), and the dK/dV kernel computes Sᵀ and P itself (the
// default kernel's S GEMM and exponentials, no dP GEMM or dS math) and takes dS from the block.
inline constexpr int kDsOnly = 1024;
// The dQ kernel's kDumpPds diagnostics (MXFLASH_BWD_DQ_DUMP_DIAG 1, 2, 3; dK, dV wrong): 2048 its global
// stores of P and dS left out (P still packed), 4096 its warpgroup dS scale exchange left out (per-row
// scales, as the default kernel).
inline constexpr int kDumpNoStore = 2048, kDumpNoBar = 4096;
// A dump block: P's 16 KB, dS's 16 KB, then dS's 128 row scale bytes (e8m0, 0 for a zero row).
// Each 16 KB tile is 32 x 32 chunks of 16 bytes, chunk (QG, KG) at 16 pds_chunk(QG, KG): query group
// QG = 8 cc + 4 h + m holds queries 32 cc + 16 h + 2 m + {0, 1, 8, 9}, key group KG likewise keys
// 32 c + 16 h' + 2 m' + {0, 1, 8, 9} (the accumulator's column pairs: the bytes of one packed word
// of pack_chunk); the chunk's four words are the queries 2 m + {0, 8, 1, 9} of its group, each word
// the group's four keys in pack order. So the dQ kernel's thread stores its rows r and r + 8 as one
// 8-byte pair per key group, and a dK/dV thread builds its two keys' words over four queries from
// one 16-byte load and four byte permutes.
inline constexpr int kPdsTileBytes = kTile * kTile;
inline constexpr int64_t kPdsBlockBytes = 2 * kPdsTileBytes + kTile;
static_assert(kPdsBlockBytes % 128 == 0, "the ring's blocks: whole 128-byte L2 lines (discarded once read)");
__device__ __forceinline__ uint4 ld_shared_u32x4(const void* p) {
  const float4 v = sm90::ld_shared_f32x4(p);
  return make_uint4(__float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z), __float_as_uint(v.w));
}
// The dump block of (head h, Q tile q_tile of the sequence q_seq, K tile k_tile of its K/V
// sequence), for both dumps (kDiagDumpDs, kDumpPds): H x (Pq / 128) x dump_kt blocks, the index
// taken modulo dump_wrap_mask + 1 when that is set (MXFLASH_BWD_DUMP_WRAP).
__device__ __forceinline__ int64_t dump_block(const BwdParams& p, int h, int q_seq, int q_tile, int k_tile) {
  const int64_t block = (int64_t(h) * (p.Pq / kTile) + p.cu_q_sf[q_seq] / kTile + q_tile) * p.dump_kt + k_tile;
  return p.dump_wrap_mask != 0 ? block & p.dump_wrap_mask : block;
}
// Chunk (qg, kg)'s place in its tile, key group major: each 8-lane phase of a dK/dV warp's 16-byte
// loads (four consecutive query groups of one key group, two lanes a chunk) reads 64 contiguous
// bytes, one wavefront (query group major put all four on one bank group: four wavefronts, and
// B's kernel took 2.2 ms instead of 1.35 on llm-long); the dQ kernel's warp still stores 64
// contiguous bytes per key group (its four query groups).
__device__ __forceinline__ int pds_chunk(int qg, int kg) { return 32 * kg + qg; }
// The dQ kernel's consumer thread (warpgroup cw, warp, lane): its packed words of k32 block cc
// (words[4 cc + 2 h + {0, 1}]: key group (cc, h, lane % 4), rows r, r + 8) into the tile.
__device__ __forceinline__ void pds_store_words(uint8_t* tile, int cw, int warp, int lane, int cc,
                                                const uint32_t (&words)[16]) {
  const int qg = 8 * (2 * cw + warp / 2) + 4 * (warp % 2) + (lane / 4) / 2, u = (lane / 4) % 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int kg = 8 * cc + 4 * h + lane % 4;
    *reinterpret_cast<uint2*>(tile + pds_chunk(qg, kg) * 16 + 8 * u) = make_uint2(words[4 * cc + 2 * h], words[4 * cc + 2 * h + 1]);
  }
}
// The dK/dV kernel's consumer thread (warpgroup cw, warp, lane): its RS operand words of query half
// hh from a tile in that layout in shared memory (P's or dS's): per k32 block c and query group h one
// 16-byte chunk (four queries' words of this thread's key group), then its two keys' words by byte
// permutes, in the query order of Qᵀ' and dOᵀ'.
__device__ __forceinline__ void pds_load_words(const uint8_t* tile, int hh, int cw, int warp, int lane,
                                               uint32_t (&words)[8]) {
  const int kg = 8 * (2 * cw + warp / 2) + 4 * (warp % 2) + (lane / 4) / 2, t = (lane / 4) % 2, quad = lane % 4;
  const uint32_t sel = uint32_t(t) | uint32_t(4 + t) << 4 | uint32_t(2 + t) << 8 | uint32_t(6 + t) << 12;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 w = ld_shared_u32x4(tile + pds_chunk(8 * (2 * hh + c) + 4 * h + quad, kg) * 16);
      const uint32_t x = __byte_perm(w.x, w.z, sel), y = __byte_perm(w.y, w.w, sel);
      words[4 * c + 2 * h] = __byte_perm(x, y, 0x5410);
      words[4 * c + 2 * h + 1] = __byte_perm(x, y, 0x7632);
    }
  }
}
// kDiagNoCvt's packing: pack_chunk's words from the top bytes of the floats (3 PRMT a word).
template <int M>
__device__ __forceinline__ void pack_chunk_bytes(const float* x, int c, uint32_t (&pa)[M]) {
  auto word = [](float a, float b, float c2, float d) {
    const uint32_t lo = __byte_perm(__float_as_uint(a), __float_as_uint(b), 0x73);
    const uint32_t hi = __byte_perm(__float_as_uint(c2), __float_as_uint(d), 0x73);
    return __byte_perm(lo, hi, 0x5410);
  };
  pa[4 * c + 0] = word(x[0], x[1], x[4], x[5]);
  pa[4 * c + 1] = word(x[2], x[3], x[6], x[7]);
  pa[4 * c + 2] = word(x[8], x[9], x[12], x[13]);
  pa[4 * c + 3] = word(x[10], x[11], x[14], x[15]);
}
// kDiag: keeps values whose consumer a diagnostic removed (ptxas drops dead wgmmas and arithmetic):
// stores them behind a branch that is never taken.
template <typename T, int N>
__device__ __forceinline__ void diag_sink(const BwdParams& p, const T (&x)[N]) {
  if (p.num_items < 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) reinterpret_cast<T*>(p.dk)[threadIdx.x * N + i] = x[i];
  }
}
// kDiag: accumulators whose GEMM a diagnostic left out, defined (undefined values) without an
// instruction.
template <int N>
__device__ __forceinline__ void diag_undefined(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "=f"(x[i]));
}
// The CTAs that walk the dK/dV work list: the grid's, or the ring kernel's dK/dV role's (kDiag with kRing),
// whose CTAs come first in its grid.
template <int kDiag>
__device__ __forceinline__ unsigned dkdv_ctas(const BwdParams& p) {
  if constexpr ((kDiag & kRing) != 0) return unsigned(p.ring_ctas);
  return gridDim.x;
}
// The dK/dV kernel's items of this CTA that have Q tiles (n_q > 0), in order: fn(w, n_q, it, kv_i),
// `it` Q tiles and `kv_i` K/V tiles loaded before (persistent CTAs walk many items). The producer
// thread and the info-patching warp walk the same stages through it.
template <bool kPersistent, int kDiag, typename Fn>
__device__ __forceinline__ void for_each_loaded_item(const BwdParams& p, Fn&& fn) {
  if constexpr (kPersistent) {
    int it = 0, kv_i = 0;
    for (unsigned index = blockIdx.x; index < unsigned(p.num_items); index += dkdv_ctas<kDiag>(p)) {
      const int e = ordered_item<(kDiag & kCausal) != 0>(p, index);
      if ((kDiag & kCausal) != 0 && e < 0) continue;
      const Item w = kv_item_of<kDiag>(p, unsigned(e));
      const int n_q = kv_q_tiles<(kDiag & kCausal) != 0>(p, w).y;  // (kCausal: from Q tile kv_q_tiles(.).x on)
      if (n_q == 0) continue;
      fn(w, n_q, it, kv_i);
      it += n_q;
      ++kv_i;
    }
  } else {
    static_assert((kDiag & kCausal) == 0, "the causal mask: the persistent dK/dV kernel");
    const Item w = item_of<true>(p, blockIdx.x);
    const int n_q = (w.Lq + kTile - 1) / kTile;
    if (n_q > 0) fn(w, n_q, 0, 0);
  }
}

// The dK/dV kernel's body (the kernel's, or the ring kernel's dK/dV role: kDiag with kRing).
template <bool kPersistent, bool kDvPerHalf, bool kTrace, bool kTileScales, int kDiag>
__device__ __forceinline__ void dkdv_body(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                                          const CUtensorMap& tm_do, const CUtensorMap& tm_qt, const CUtensorMap& tm_dot,
                                          const CUtensorMap& tm_dk, const CUtensorMap& tm_dv, const BwdParams& p) {
  // kFromPds: P and dS from the dQ kernel's dump blocks (in the stage's Q and dO tiles, the row scale
  // bytes in ds_rows; the patching warp turns them into each 64-query half's scale, ds_scale).
  constexpr bool kPds = (kDiag & kFromPds) != 0;
  constexpr bool kRingMode = (kDiag & kRing) != 0;  // (with kFromPds)
  constexpr bool kDsOnlyMode = (kDiag & kDsOnly) != 0;  // (with kFromPds)
  // The item's K and V tiles: for the S and dP GEMMs, which kFromPds (but for kDsOnly's S) leaves
  // out. Without them their 32 KB hold the staged epilogue's dK tiles (one per warpgroup).
  constexpr bool kNeedKv = !kPds || kDsOnlyMode;
  constexpr bool kCausalMask = (kDiag & kCausal) != 0;
  static_assert(!kCausalMask || (!kPds && !kDvPerHalf && kPersistent), "the causal mask: the default persistent kernel");
  extern __shared__ uint8_t smem_raw[];
  KvSmem& s = attn::aligned_shared<KvSmem>(smem_raw);
  uint8_t* const smem_base = reinterpret_cast<uint8_t*>(&s);
  // The staged epilogue (persistent and p.staged_dkdv; launched with kKvSmemBytesStaged).
  DkdvStageSmem& stg = *reinterpret_cast<DkdvStageSmem*>(smem_base + kKvSmemOffsetStage);
  const int wg = attn::warpgroup_index(), tid = threadIdx.x % kWarpgroupThreads;
  attn::init_pipeline(&s.kv_full, s.full, s.empty, kConsumers);
  if (threadIdx.x == 0) {
    if (kPersistent) sm90::mbar_init(&s.kv_empty, kConsumers * kWarpgroupThreads);
    for (int i = 0; i < kKvStages; ++i) sm90::mbar_init(&s.info_ready[i], 32);  // the patching warp's lanes
    sm90::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid / 32 == 1) {
      // The producer warpgroup's second warp: once a Q-tile stage has landed, multiplies its 128
      // query infos' x by the item's K tile scale and z by its V tile scale in place (four a lane),
      // so that the consumers' math reads the products (32 multiplications a thread and 64-query half
      // fewer, off the chain from the shared load to the FFMA), then completes info_ready (every
      // lane arrives for its own writes). It waits for the consumers' release of the stage's
      // previous fill first, as the producer thread does: implied by `full`, but so the order is a
      // direct one (compute-sanitizer's racecheck flagged the patch with one lane arriving after a
      // __syncwarp and no `empty` wait; clean with both changes).
      const int lane = tid % 32;
      for_each_loaded_item<kPersistent, kDiag>(p, [&](const Item& w, int n_q, int it, int) {
        const int64_t tile_idx = int64_t(w.h) * (p.Pk / kTile) + p.cu_k_sf[w.b] / kTile + w.blk;
        const float ks = p.k_scale[tile_idx], vs = p.v_scale[tile_idx];
        for (int j = 0; j < n_q; ++j) {
          const int stage = (it + j) % kKvStages;
          sm90::mbar_wait(&s.empty[stage], (((it + j) / kKvStages) & 1) ^ 1);
          sm90::mbar_wait(&s.full[stage], ((it + j) / kKvStages) & 1);
          if constexpr (kPds) {
            // Each 64-query half's dS scale (the dQ kernel's warpgroup scale, the byte of its first
            // row) as a float (0 for a half whose dS are all zero); kDsOnly then patches the query
            // infos as by default.
            KvStage& st = s.st[stage];
            // Ring: the block is in shared memory, its slot free again, after the consumers' signal
            // below (this warp's discards off their path). Its lines are dropped from L2 unwritten
            // first (discard: no write-back to DRAM of bytes nobody reads again; the next epoch's
            // stores follow the release). H200: the ring's DRAM writes 800 -> 197 MB on llm-long,
            // 666 -> 193 MB on llm (docs/backward.md).
            auto free_slot = [&] {
              const int64_t slot = kv_ring_slot<kDiag>(p, w, j);
              const uint8_t* blk = p.ds_dump + slot * kPdsBlockBytes;
              for (int l = lane; l < int(kPdsBlockBytes / 128); l += 32)
                asm volatile("discard.global.L2 [%0], 128;" ::"l"(blk + 128 * l) : "memory");
              __syncwarp();
              if (lane == 2) ring_release(p.ring_free + slot, kv_ring_epoch<kDiag>(p, w, j));
            };
            if (lane < 2) {
              const uint32_t x = st.ds_rows[64 * lane];
              st.ds_scale[lane] = x == 0 ? 0.f : __uint_as_float(x << 23);
            }
            if constexpr (!kDsOnlyMode) {
              sm90::mbar_arrive(&s.info_ready[stage]);
              if (kRingMode) free_slot();
              continue;
            }
            if (kRingMode) free_slot();
          }
          float4* info = s.st[stage].info;
#pragma unroll
          for (int i = 0; i < kTile / 32; ++i) {
            float4 v = info[lane + 32 * i];
            v.x *= ks;
            v.z *= vs;
            info[lane + 32 * i] = v;
          }
          sm90::mbar_arrive(&s.info_ready[stage]);  // every lane, for its own writes
        }
      });
      return;
    }
    if (tid != 0) return;
    // One item's loads; `it` Q tiles and `kv_i` K/V tiles were loaded before (persistent CTAs).
    auto produce = [&](const Item& w, int n_q, int it, int kv_i) {
      const int64_t k_row = int64_t(w.h) * p.Pk + p.cu_k_sf[w.b] + int64_t(w.blk) * kTile;
      if constexpr (kNeedKv) {
        if (kPersistent) sm90::mbar_wait(&s.kv_empty, (kv_i & 1) ^ 1);
        sm90::mbar_arrive_expect_tx(&s.kv_full, 2 * kTileBytes);
        sm90::tma_load_2d(s.k, &tm_k, &s.kv_full, 0, int(k_row));
        sm90::tma_load_2d(s.v, &tm_v, &s.kv_full, 0, int(k_row));
      }
      const int64_t q_pad0 = p.cu_q_sf[w.qb];
      for (int j = 0; j < n_q; ++j) {
        const int stage = (it + j) % kKvStages;
        KvStage& st = s.st[stage];
        // Ring: Q tile qj = (this K tile - j) mod n at step j, its block in the ring's slot.
        // kCausal: from the item's first Q tile that faces its keys on.
        const int qj = kRingMode ? kv_ring_q_tile<kDiag>(w, j, n_q) : kv_q_tiles<kCausalMask>(p, w).x + j;
        if constexpr (kRingMode) {  // the block of step j stored (before the stage is free: its latency
                                    // under the consumers' work)
          ring_wait(p.ring_ready + kv_ring_slot<kDiag>(p, w, j), kv_ring_epoch<kDiag>(p, w, j), p.ring_poll_ns);
        } else if constexpr (kPds) {  // the dQ kernel's flag of the block, before the stage is free (its
                                      // latency under the consumers' work): its eight warps' releases
          // (>= 8: the eight warps of this call or earlier calls, a diagnostic)
          if (p.pds_flags != nullptr) ring_wait(p.pds_flags + dump_block(p, w.h, w.qb, j, w.blk), kConsumers * 4, 0);
        }
        sm90::mbar_wait(&s.empty[stage], (((it + j) / kKvStages) & 1) ^ 1);
        const int64_t qr = q_pad0 + int64_t(qj) * kTile, orow = w.o_pad0 + int64_t(qj) * kTile;
        // The stage: Q' and the query infos where this kernel computes S and P (not kFromPds, or
        // kDsOnly), dO' (not kFromPds), Qᵀ', dOᵀ', dO's channel scales; kFromPds: the dump block of
        // (Q tile qj, this K tile): P (not kDsOnly) into the Q' slot, dS into the dO' slot, its row
        // scale bytes.
        constexpr bool kOwnP = !kPds || kDsOnlyMode;
        constexpr uint32_t kTx = 2 * kTileBytes + kHeadDim * sizeof(float) +
                                 (kOwnP ? kTileBytes + kTile * sizeof(float4) : 0) +
                                 (kPds ? (kDsOnlyMode ? 1 : 2) * kPdsTileBytes + kTile : kTileBytes);
        static_assert(kPds || kTx == kKvStageTx, "the default stage's bytes");
        sm90::mbar_arrive_expect_tx(&s.full[stage], kTx);
        if constexpr (kOwnP) sm90::tma_load_2d(st.q, &tm_q, &s.full[stage], 0, int(w.h * p.Pq + qr));
        if constexpr (!kPds) sm90::tma_load_2d(st.dout, &tm_do, &s.full[stage], 0, int(w.h * p.Po + orow));
        sm90::tma_load_2d(st.qt, &tm_qt, &s.full[stage], int(qr), w.h * kHeadDim);
        sm90::tma_load_2d(st.dot, &tm_dot, &s.full[stage], int(orow), w.h * kHeadDim);
        if constexpr (kPds) {
          const uint8_t* blk =
              p.ds_dump +
              (kRingMode ? kv_ring_slot<kDiag>(p, w, j) : dump_block(p, w.h, w.qb, j, w.blk)) * kPdsBlockBytes;
          if constexpr (!kDsOnlyMode) sm90::bulk_load(st.q, blk, kPdsTileBytes, &s.full[stage]);
          sm90::bulk_load(st.dout, blk + kPdsTileBytes, kPdsTileBytes, &s.full[stage]);
          sm90::bulk_load(st.ds_rows, blk + 2 * kPdsTileBytes, kTile, &s.full[stage]);
        }
        if constexpr (kOwnP)
          sm90::bulk_load(st.info, p.info + w.h * p.Po + orow, kTile * sizeof(float4), &s.full[stage]);
        sm90::bulk_load(st.dot_scale, p.do_t_scale + (w.h * (p.Po / kTile) + orow / kTile) * kHeadDim,
                        kHeadDim * sizeof(float), &s.full[stage]);
      }
    };
    for_each_loaded_item<kPersistent, kDiag>(p, produce);
    return;
  }

  // ---------------------------------------------------------------------------------- consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1, warp = tid / 32, lane = tid % 32, quad = lane % 4;
  // One item: dK, dV of its 128 keys over the Q tiles, then the epilogue.
  auto consume = [&](const Item& w, int n_q, int it, int kv_i) {
    // kTrace (experiments builds, MXFLASH_BWD_VARIANT 1024): the SM clock of the first warp of each
    // consumer warpgroup at seven points of each 64-query half of
    // the first item of CTAs 0, 40, 80, 120 (trace.cuh): slot 2 j + hh, events 0 before S and dP, 1
    // S, dP done, 2 P and dS computed, 3 dK GEMM done, 4 dK promoted, 5 dV GEMM done, 6 dV promoted
    // (5, 6 on the second half only), 7 P and dS values done (before their row scales and packing).
    const int trace_row = kTrace && kv_i == 0 && warp == 0 && lane == 0
                              ? attn::trace_cta_slot(blockIdx.x, 0, 40, 80, 120)
                              : -1;
    auto stamp = [&](int slot, int event) {
      if constexpr (kTrace) attn::trace_stamp(trace_row, cw, slot, event);
    };
    int math_slot = 0;  // kTrace: the slot of the half whose math runs (event 7: P, dS values done)
    // Math turns (MXFLASH_BWD_VARIANT 2048: the two consumer warpgroups alternating their P / dS math
    // per half, pinned by data): measured +-1% on 2026-11-29 night, removed
    // (docs/backward.md; commit ed1004c has the code).
    float dv[64], dk[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) dv[i] = dk[i] = 0.f;
    if (n_q > 0) {
      const float* q_tiles =
          kTileScales ? p.qt_tile_scale + int64_t(w.h) * (p.Pq / kTile) + p.cu_q_sf[w.qb] / kTile : nullptr;
      if constexpr (kNeedKv) sm90::mbar_wait(&s.kv_full, kv_i & 1);
      const uint64_t desc_k = sm90::make_desc_k128b(s.k + cw * kHalf * kHeadDim);
      const uint64_t desc_v = sm90::make_desc_k128b(s.v + cw * kHalf * kHeadDim);
      uint32_t pa[8], da[8];
      float rs[2];
      // Sᵀ (64 keys x 64 queries) = K Qᵀ and dPᵀ = V dOᵀ over the head dim, for query half hh.
      auto issue_sdp = [&](float (&sc)[32], float (&dp)[32], const KvStage& st, int hh) {
        const uint64_t desc_q = sm90::make_desc_k128b(st.q + hh * kHalf * kHeadDim);
        const uint64_t desc_do = sm90::make_desc_k128b(st.dout + hh * kHalf * kHeadDim);
        if constexpr ((kDiag & kDiagNoSdp) != 0) {
          diag_undefined(sc);
          diag_undefined(dp);
          return;
        }
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) sm90::wgmma_m64n64k32_ss(sc, desc_k + 2 * kk, desc_q + 2 * kk, kk);
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) sm90::wgmma_m64n64k32_ss(dp, desc_v + 2 * kk, desc_do + 2 * kk, kk);
        sm90::wgmma_commit();
      };
      // Sᵀ alone (kDsOnly).
      auto issue_s = [&](float (&sc)[32], const KvStage& st, int hh) {
        const uint64_t desc_q = sm90::make_desc_k128b(st.q + hh * kHalf * kHeadDim);
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) sm90::wgmma_m64n64k32_ss(sc, desc_k + 2 * kk, desc_q + 2 * kk, kk);
        sm90::wgmma_commit();
      };
      // Pᵀ and dSᵀ: column c = query 64 hh + 8 (i / 4) + 2 quad + i % 2 of the tile. Fills pa (e4m3 of
      // 256 p), da (e4m3 of 256 dS over its row scale) and rs (that scale). first: the two query
      // infos of jn = 0 (first_info), loaded before the wait for S and dP so the first
      // multiplications do not wait on shared memory (4% of the kernel's stall samples, ncu).
      auto first_info = [&](const KvStage& st, int hh, float4 (&first)[2]) {
        first[0] = sm90::ld_shared_f32x4(&st.info[hh * kHalf + 2 * quad]);
        first[1] = sm90::ld_shared_f32x4(&st.info[hh * kHalf + 2 * quad + 1]);
      };
      // kCausal, masked: this thread's score (key k, query q) of the half has p = 0 where k - q >
      // the tile's delta: thr > 8 jn - 8 r + (0, 1) with thr = (its first key - first query) - delta.
      auto math = [&](float (&sc)[32], float (&dp)[32], const KvStage& st, int hh, const float4 (&first)[2],
                      [[maybe_unused]] int thr, auto masked) {
        if constexpr ((kDiag & kDiagNoMath) != 0) {
          rs[0] = rs[1] = 1.f;
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            attn::pack_chunk(sc + 16 * c, c, pa);
            attn::pack_chunk(dp + 16 * c, c, da);
          }
          return;
        }
        float amax[2] = {0.f, 0.f};
#pragma unroll
        for (int jn = 0; jn < 8; ++jn) {
          const float4 in0 = jn == 0 ? first[0] : sm90::ld_shared_f32x4(&st.info[hh * kHalf + 8 * jn + 2 * quad]);
          const float4 in1 = jn == 0 ? first[1] : sm90::ld_shared_f32x4(&st.info[hh * kHalf + 8 * jn + 2 * quad + 1]);
          const float a0 = in0.x, a1 = in1.x, c0 = in0.z, c1 = in1.z;  // times K's, V's tile scales (info_ready)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int i0 = 4 * jn + 2 * r;
            float p0 = fmaf(sc[i0], a0, -in0.y), p1 = fmaf(sc[i0 + 1], a1, -in1.y);
            if constexpr ((kDiag & kDiagNoExp) == 0) {
              p0 = attn::fast_exp2(p0);  // 256 p
              p1 = attn::fast_exp2(p1);
            }
            if constexpr (decltype(masked)::value) {
              p0 = thr > 8 * jn - 8 * r ? 0.f : p0;
              p1 = thr > 8 * jn - 8 * r + 1 ? 0.f : p1;
            }
            const float d0 = p0 * fmaf(dp[i0], c0, -in0.w);  // 256 dS
            const float d1 = p1 * fmaf(dp[i0 + 1], c1, -in1.w);
            sc[i0] = p0;
            sc[i0 + 1] = p1;
            dp[i0] = d0;
            dp[i0 + 1] = d1;
            amax[r] = fmaxf(amax[r], fmaxf(fabsf(d0), fabsf(d1)));
          }
        }
        stamp(math_slot, 7);
        float inv[2];
        row_scales(amax, inv, rs);  // of 256 dS: rs carries the factor 256
#pragma unroll
        for (int i = 0; i < 32; ++i) dp[i] *= inv[(i % 4) / 2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if constexpr ((kDiag & kDiagNoCvt) != 0) {
            pack_chunk_bytes(sc + 16 * c, c, pa);
            pack_chunk_bytes(dp + 16 * c, c, da);
          } else {
            attn::pack_chunk(sc + 16 * c, c, pa);
            attn::pack_chunk(dp + 16 * c, c, da);
          }
        }
      };
      // The wgmmas of dV += Pᵀ dO or dK += dSᵀ Q over the half's 64 queries (into t, fresh when
      // `first`), uncommitted.
      auto grad_steps = [&](float (&t)[64], uint64_t db, const uint32_t (&frag)[8], int hh, bool first) {
        if constexpr ((kDiag & kDiagNoGrad) != 0) {
          diag_sink(p, frag);
          diag_undefined(t);
          return;
        }
        sm90::wgmma_rs_steps<kHalf / 32>(t, frag, db, first, 2 * hh);
      };
      // One half's gradient into fresh accumulators t.
      auto issue_grad = [&](float (&t)[64], const uint8_t* bt, const uint32_t (&frag)[8], int hh) {
        sm90::wgmma_fence();
        grad_steps(t, sm90::make_desc_k128b(bt), frag, hh, true);
        sm90::wgmma_commit();
      };
      // dV over the whole Q tile: both halves' Pᵀ into fresh accumulators t.
      auto issue_dv_tile = [&](float (&t)[64], const uint8_t* bt, const uint32_t (&pa0)[8], const uint32_t (&pa1)[8]) {
        const uint64_t db = sm90::make_desc_k128b(bt);
        sm90::wgmma_fence();
        grad_steps(t, db, pa0, 0, true);
        grad_steps(t, db, pa1, 1, false);
        sm90::wgmma_commit();
      };
      // Promotions: dV times the stage's dO channel scales, dK times the dS row scales.
      auto promote_dv = [&](const float (&t)[64], const KvStage& st) {
        if constexpr ((kDiag & kDiagNoPromote) != 0) {
          diag_sink(p, t);
        } else {
#pragma unroll
          for (int jn = 0; jn < 16; ++jn) {
            const float2 cs = sm90::ld_shared_f32x2(&st.dot_scale[8 * jn + 2 * quad]);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              dv[4 * jn + 2 * r] = fmaf(t[4 * jn + 2 * r], cs.x, dv[4 * jn + 2 * r]);
              dv[4 * jn + 2 * r + 1] = fmaf(t[4 * jn + 2 * r + 1], cs.y, dv[4 * jn + 2 * r + 1]);
            }
          }
        }
      };
      auto promote_dk = [&](const float (&t)[64], float q_tile) {
        if constexpr ((kDiag & kDiagNoPromote) != 0) {
          diag_sink(p, t);
          diag_sink(p, rs);
          return;
        }
        if constexpr (kTileScales) {
          const float f[2] = {rs[0] * q_tile, rs[1] * q_tile};
#pragma unroll
          for (int i = 0; i < 64; ++i) dk[i] = fmaf(t[i], f[(i % 4) / 2], dk[i]);
        } else {
#pragma unroll
          for (int i = 0; i < 64; ++i) dk[i] = fmaf(t[i], rs[(i % 4) / 2], dk[i]);
        }
      };
      {
        // kCausal: the Q tiles from q0 on; tile qj is masked where the tile's last key lies past its
        // first query's diagonal (delta: first query + causal_off - the tile's first key).
        const int q0 = kv_q_tiles<kCausalMask>(p, w).x;
        [[maybe_unused]] const int key_minus_col = cw * kHalf + warp * 16 + lane / 4 - 2 * quad;
#pragma unroll 1
        for (int j = 0; j < n_q; ++j) {
          const int stage = (it + j) % kKvStages;
          const KvStage& st = s.st[stage];
          const int qj = kRingMode ? kv_ring_q_tile<kDiag>(w, j, n_q) : q0 + j;  // (square ring: rotated)
          [[maybe_unused]] const int delta = kCausalMask ? (qj - w.blk) * kTile + causal_off(p, w) : 0;
          const float q_tile = kTileScales ? q_tiles[qj] : 1.f;  // the Q tile's Qᵀ' scale (kTileScales)
          sm90::mbar_wait(&s.full[stage], ((it + j) / kKvStages) & 1);
          sm90::mbar_wait(&s.info_ready[stage], ((it + j) / kKvStages) & 1);
          uint32_t pa0[8];  // the first half's Pᵀ, for the tile's dV (default order)
#pragma unroll 1
          for (int hh = 0; hh < 2; ++hh) {
            stamp(2 * j + hh, 0);
            if constexpr (kDsOnlyMode) {
              // Sᵀ of the half (the S GEMM alone), Pᵀ from it as the default math computes it, dSᵀ
              // words from the block's dS tile (as kFromPds takes them), the half's dS scale.
              float sc[32];
              issue_s(sc, st, hh);
              float4 first[2];
              first_info(st, hh, first);
              sm90::wgmma_wait<0>();
              attn::fence_all(sc);
              if (kPersistent && j == n_q - 1 && hh == 1) sm90::mbar_arrive(&s.kv_empty);  // K read for the last time
#pragma unroll
              for (int jn = 0; jn < 8; ++jn) {
                const float4 in0 = jn == 0 ? first[0] : sm90::ld_shared_f32x4(&st.info[hh * kHalf + 8 * jn + 2 * quad]);
                const float4 in1 =
                    jn == 0 ? first[1] : sm90::ld_shared_f32x4(&st.info[hh * kHalf + 8 * jn + 2 * quad + 1]);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                  const int i0 = 4 * jn + 2 * r;
                  sc[i0] = attn::fast_exp2(fmaf(sc[i0], in0.x, -in0.y));  // 256 p
                  sc[i0 + 1] = attn::fast_exp2(fmaf(sc[i0 + 1], in1.x, -in1.y));
                }
              }
#pragma unroll
              for (int c = 0; c < 2; ++c) attn::pack_chunk(sc + 16 * c, c, pa);
              pds_load_words(st.dout, hh, cw, warp, lane, da);
              rs[0] = rs[1] = sm90::ld_shared_f32(&st.ds_scale[hh]);
            } else if constexpr (kPds) {
              // Pᵀ and dSᵀ words of this half from the dump tiles: per k32 block c and query group h
              // one 16-byte chunk (four queries' words of this thread's key group) each, then two
              // keys' words by byte permutes (pds_store_words' layout).
              pds_load_words(st.q, hh, cw, warp, lane, pa);
              pds_load_words(st.dout, hh, cw, warp, lane, da);
              rs[0] = rs[1] = sm90::ld_shared_f32(&st.ds_scale[hh]);
            } else {
              float sc[32], dp[32];
              issue_sdp(sc, dp, st, hh);
              float4 first[2];
              first_info(st, hh, first);
              sm90::wgmma_wait<0>();
              attn::fence_all(sc);
              attn::fence_all(dp);
              stamp(2 * j + hh, 1);
              if (kPersistent && j == n_q - 1 && hh == 1) sm90::mbar_arrive(&s.kv_empty);  // K, V read for the last time
              math_slot = 2 * j + hh;
              if (kCausalMask && delta < kTile - 1)  // (uniform: the tile's last key past its first query's diagonal)
                math(sc, dp, st, hh, first, key_minus_col - hh * kHalf - delta, std::true_type{});
              else
                math(sc, dp, st, hh, first, 0, std::false_type{});
            }
            stamp(2 * j + hh, 2);
            if constexpr ((kDiag & kDiagDumpDs) != 0) {
              const int64_t block = dump_block(p, w.h, w.qb, j, w.blk);
              uint4* dst =
                  reinterpret_cast<uint4*>(p.ds_dump + block * 16384 + hh * 8192 + (cw * kWarpgroupThreads + tid) * 32);
              dst[0] = make_uint4(da[0], da[1], da[2], da[3]);
              dst[1] = make_uint4(da[4], da[5], da[6], da[7]);
              if (quad == 0) {
                const int key = cw * kHalf + warp * 16 + lane / 4, valid = w.Lk - w.blk * kTile;
                uint8_t* sc_out = p.ds_scales + block * 256 + hh * 128;
                sc_out[key] = key < valid ? uint8_t(__float_as_uint(rs[0]) >> 23) : uint8_t(0);
                sc_out[key + 8] = key + 8 < valid ? uint8_t(__float_as_uint(rs[1]) >> 23) : uint8_t(0);
              }
            }
            float t[64];
            if constexpr (kDvPerHalf) {
              issue_grad(t, st.dot, pa, hh);
              sm90::wgmma_wait<0>();
              attn::fence_all(t);
              promote_dv(t, st);
            } else if (hh == 0) {
#pragma unroll
              for (int i = 0; i < 8; ++i) pa0[i] = pa[i];
            }
            issue_grad(t, st.qt, da, hh);
            sm90::wgmma_wait<0>();
            attn::fence_all(t);
            stamp(2 * j + hh, 3);
            promote_dk(t, q_tile);
            stamp(2 * j + hh, 4);
          }
          if constexpr (!kDvPerHalf) {
            float t[64];
            issue_dv_tile(t, st.dot, pa0, pa);
            sm90::wgmma_wait<0>();
            attn::fence_all(t);
            stamp(2 * j + 1, 5);
            promote_dv(t, st);
            stamp(2 * j + 1, 6);
          }
          sm90::mbar_arrive(&s.empty[stage]);
        }
      }
    }
    // ------------------------------------------------------------------------------ epilogue
    const float* qts = kTileScales ? nullptr : p.qt_scale + (int64_t(w.qb) * p.heads + w.h) * kHeadDim;
    // Q's channel scale times softmax_scale (kTileScales: in the promotions already), 0 without Q.
    auto dk_factor = [&](int col) {
      return n_q > 0 ? (kTileScales ? p.softmax_scale : qts[col] * p.softmax_scale) : 0.f;
    };
    const int first_key = w.blk * kTile + cw * kHalf;  // the warpgroup's first key of the sequence
    // Staged: dV, then dK, through the warpgroup's tile, where all its 64 keys are the sequence's (a
    // box cannot skip the next sequence's rows); the same values as the direct stores below. Without
    // K and V (kNeedKv false) dK goes through the warpgroup's half of their space, so that it need
    // not wait for dV's store to have read the tile.
    if (kPersistent && p.staged_dkdv && first_key + kHalf <= w.Lk) {
      const bool issuer = warp == 0 && lane == 0;
      const int barrier = kBarStage0 + cw, tok = w.k0 + first_key;
      uint32_t packed[2][16];
      attn::staging_acquire(issuer, barrier);
      pack_bf16_rows(dv, quad, [](int) { return 1.f; }, packed);
      attn::stage_and_store(&tm_dv, stg.t[cw], issuer, barrier, warp, lane, packed, w.h, tok);
      if constexpr (kNeedKv) attn::staging_acquire(issuer, barrier);
      pack_bf16_rows(dk, quad, dk_factor, packed);
      attn::stage_and_store(&tm_dk, kNeedKv ? stg.t[cw] : cw == 0 ? s.k : s.v, issuer, barrier, warp, lane, packed,
                            w.h, tok);
      return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = w.blk * kTile + cw * kHalf + warp * 16 + lane / 4 + 8 * r;
      if (key >= w.Lk) continue;
      const int64_t at = ((int64_t(w.k0) + key) * p.heads + w.h) * kHeadDim;
#pragma unroll
      for (int jn = 0; jn < 16; ++jn) {
        const int col = 8 * jn + 2 * quad;
        const float q0 = dk_factor(col), q1 = dk_factor(col + 1);
        const float2 gv = make_float2(dv[4 * jn + 2 * r] * (1.f / kPScale), dv[4 * jn + 2 * r + 1] * (1.f / kPScale));
        const float2 gk =
            make_float2(dk[4 * jn + 2 * r] * q0 * (1.f / kPScale), dk[4 * jn + 2 * r + 1] * q1 * (1.f / kPScale));
        if (p.dk_f32) {
          *reinterpret_cast<float2*>(p.dv_f32 + at + col) = gv;
          *reinterpret_cast<float2*>(p.dk_f32 + at + col) = gk;
        } else {
          *reinterpret_cast<__nv_bfloat162*>(p.dv + at + col) = __floats2bfloat162_rn(gv.x, gv.y);
          *reinterpret_cast<__nv_bfloat162*>(p.dk + at + col) = __floats2bfloat162_rn(gk.x, gk.y);
        }
      }
    }
  };
  if constexpr (kPersistent) {
    int it = 0, kv_i = 0;
    for (unsigned index = blockIdx.x; index < unsigned(p.num_items); index += dkdv_ctas<kDiag>(p)) {
      const int e = ordered_item<kCausalMask>(p, index);
      if (kCausalMask && e < 0) continue;
      const Item w = kv_item_of<kDiag>(p, unsigned(e));
      const int n_q = kv_q_tiles<kCausalMask>(p, w).y;
      consume(w, n_q, it, kv_i);
      if (n_q > 0) {
        it += n_q;
        ++kv_i;
      }
    }
  } else {
    const Item w = item_of<true>(p, blockIdx.x);
    consume(w, (w.Lq + kTile - 1) / kTile, 0, 0);
  }
  if (kPersistent && p.staged_dkdv && tid == 0) sm90::bulk_wait<0>();  // the last stores, likewise
}

template <bool kPersistent, bool kDvPerHalf = false, bool kTrace = false, bool kTileScales = false, int kDiag = 0>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dkdv_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                              const __grid_constant__ CUtensorMap tm_qt, const __grid_constant__ CUtensorMap tm_dot,
                              const __grid_constant__ CUtensorMap tm_dk, const __grid_constant__ CUtensorMap tm_dv,
                              const BwdParams p) {
  // Launched as a programmatic dependent of dO's preprocess (or of the upload before it): nothing
  // read before this wait. The dQ kernel, launched next with programmatic stream serialization, reads
  // nothing this kernel writes: its CTAs may take the SMs this kernel's CTAs leave in its last round
  // (and they start after this wait: what the preprocess wrote is complete for them too).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  dkdv_body<kPersistent, kDvPerHalf, kTrace, kTileScales, kDiag>(tm_q, tm_k, tm_v, tm_do, tm_qt, tm_dot, tm_dk, tm_dv, p);
}

// ---------------------------------------------------------------- dQ
struct QStage {
  alignas(1024) uint8_t k[kTileBytes];   // K' rows of the K/V tile
  alignas(1024) uint8_t v[kTileBytes];   // V' rows (V along hdim)
  alignas(1024) uint8_t kt[kTileBytes];  // Kᵀ' (128 channels x 128 keys)
};
inline constexpr int kQStages = 3;
struct QSmem {
  alignas(1024) uint8_t q[kTileBytes];
  alignas(1024) uint8_t dout[kTileBytes];
  QStage st[kQStages];
  alignas(8) uint64_t q_full;
  uint64_t full[kQStages];
  uint64_t empty[kQStages];
  alignas(16) float wg_amax[2][kConsumers][4];  // kDumpPds: each warp's |dS| maximum, by tile parity
  uint64_t dump_done[8];  // kDumpPds with pds_flags: the consumer warps' tile stored, tile j in j % 8
  uint64_t q_empty;       // the ring kernel's dQ role: the consumers done with an item's Q and dO
};
inline constexpr size_t kQSmemBytes = sizeof(QSmem) + 1024;

// Producer thread of a dQ item: its K/V tiles (K', V', Kᵀ') into the stages; `it` tiles were loaded
// before (persistent CTAs), which sets the stage and phase of the first one. kRingDiag with kRing: K
// tile (blk + j) mod n at step j (kRect: K tile j), loaded once the ring slot its block goes to is
// free (its consumers write the block only after they have consumed these tiles).
template <int kRingDiag = 0>
__device__ __forceinline__ void produce_dq_tiles(QStage (&st)[kQStages], uint64_t (&full)[kQStages],
                                                 uint64_t (&empty)[kQStages], const CUtensorMap* tm_k,
                                                 const CUtensorMap* tm_v, const CUtensorMap* tm_kt, const BwdParams& p,
                                                 const Item& w, int n_k, int it) {
  const int64_t k_pad0 = p.cu_k_sf[w.b];
  for (int j = 0; j < n_k; ++j) {
    const int stage = (it + j) % kQStages;
    QStage& t = st[stage];
    int kt = j;
    if constexpr ((kRingDiag & kRing) != 0) {
      kt = dq_ring_k_tile<kRingDiag>(w, j, n_k);
      const unsigned prev = dq_ring_prev_epoch<kRingDiag>(p, w, j);
      if (prev != 0) ring_wait(p.ring_free + dq_ring_slot<kRingDiag>(p, w, j, kt), prev, p.ring_poll_ns);
    }
    sm90::mbar_wait(&empty[stage], (((it + j) / kQStages) & 1) ^ 1);
    sm90::mbar_arrive_expect_tx(&full[stage], 3 * kTileBytes);
    const int64_t kr = k_pad0 + int64_t(kt) * kTile;
    sm90::tma_load_2d(t.k, tm_k, &full[stage], 0, int(w.h * p.Pk + kr));
    sm90::tma_load_2d(t.v, tm_v, &full[stage], 0, int(w.h * p.Pk + kr));
    sm90::tma_load_2d(t.kt, tm_kt, &full[stage], int(kr), w.h * kHeadDim);
  }
}

// A consumer warpgroup (cw) of the dQ kernel on item w: dQ of its 64 rows over the item's K/V tiles,
// then written. Q and dO from q / dout, complete at phase q_phase of q_full; the rows' constants
// from info (kPersistent: shared memory, row-indexed within the tile; else the workspace, global
// rows from o_row); `it` K/V tiles consumed before (persistent CTAs, else 0).
// kPersistent with p.staged_dq (tm_dq: make_bf16_rows_map of dq): where the warpgroup's 64 rows are
// all in the sequence, they go out through the item buffer's Q and dO halves that only this
// warpgroup read (its S and dP GEMMs are complete by then): one 64 x 64 box of bf16 in each (8 KB,
// the 128-byte swizzle), then two TMA stores; the issuer waits for them to have read the boxes before
// the warpgroup releases the buffer (q_empty) to the producer.
// kDiag (experiments builds, MXFLASH_BWD_VARIANT bits 24-27 on quantizer-written operands, the
// CTA-per-item kernel; dQ garbage): as the dK/dV kernel's, 1 the S and dP GEMMs (ptxas then
// serializes the dQ GEMM: C7514), 2 the P and dS math, 4 dQ's GEMM (only with 1: alone it spilled
// ~1 KB), 8 its promotion left out.
template <bool kTileScales, bool kPersistent, int kDiag = 0>
__device__ __forceinline__ void consume_dq(QStage (&st)[kQStages], uint64_t (&full_bar)[kQStages],
                                           uint64_t (&empty)[kQStages], uint8_t* q, uint8_t* dout,
                                           uint64_t* q_full, uint32_t q_phase, const float4* info, const BwdParams& p,
                                           const Item& w, int cw, int tid, int it, const CUtensorMap* tm_dq = nullptr,
                                           float* wg_amax = nullptr, uint64_t* dump_done = nullptr,
                                           uint64_t* q_release = nullptr) {
  constexpr bool kCausalMask = (kDiag & kCausal) != 0;
  const int n_k = dq_k_tiles<kCausalMask>(p, w);
  const int64_t o_row = w.o_pad0 + int64_t(w.blk) * kTile;  // padded output row of the Q tile
  const int warp = tid / 32, lane = tid % 32, quad = lane % 4;
  const int row0 = cw * kHalf + warp * 16 + lane / 4;  // rows row0, row0 + 8 of the Q tile
  // kCausal: the keys (causal_keys) of the warpgroup's first row and of this thread's rows.
  [[maybe_unused]] int lim_first = 0, lim[2] = {0, 0};
  if constexpr (kCausalMask) {
    const int off = causal_off(p, w);
    lim_first = attn::causal_row_keys(w.blk * kTile + cw * kHalf, off, w.Lk);
    lim[0] = attn::causal_row_keys(w.blk * kTile + row0, off, w.Lk);
    lim[1] = attn::causal_row_keys(w.blk * kTile + row0 + 8, off, w.Lk);
  }
  float dq[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dq[i] = 0.f;
  if (n_k > 0) {
    float4 in[2];
    const int64_t tile0 = int64_t(w.h) * (p.Pk / kTile) + p.cu_k_sf[w.b] / kTile;
    if constexpr (kPersistent) {
      sm90::mbar_wait(q_full, q_phase);
      for (int r = 0; r < 2; ++r) in[r] = info[row0 + 8 * r];
    } else {
      for (int r = 0; r < 2; ++r) in[r] = info[w.h * p.Po + o_row + row0 + 8 * r];
      sm90::mbar_wait(q_full, q_phase);
    }
    const uint64_t desc_q = sm90::make_desc_k128b(q + cw * kHalf * kHeadDim);
    const uint64_t desc_do = sm90::make_desc_k128b(dout + cw * kHalf * kHeadDim);
    // S of tile j + 1 is issued right behind dQ's GEMM of tile j, into the registers S(j)'s math
    // has just freed, so that it runs under the wait for that GEMM and the promotion; dP(j + 1)
    // follows the promotion. The two accumulator sets swap roles every tile (the loop unrolled by
    // two). 1-2% faster on every preset than S and dP issued together at the top of each tile (same
    // binary, same run, 2026-11-30; docs/backward.md), the same arithmetic: the same bits.
    {
      auto full = [&](int j) { sm90::mbar_wait(&full_bar[(it + j) % kQStages], ((it + j) / kQStages) & 1); };
      auto issue_s = [&](float (&acc)[64], int j) {
        const uint64_t desc_k = sm90::make_desc_k128b(st[(it + j) % kQStages].k);
        if constexpr ((kDiag & kDiagNoSdp) != 0) {
          diag_undefined(acc);
          return;
        }
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) sm90::wgmma_m64n128k32_ss(acc, desc_q + 2 * kk, desc_k + 2 * kk, kk);
        sm90::wgmma_commit();
      };
      auto issue_dp = [&](float (&acc)[64], int j) {
        const uint64_t desc_v = sm90::make_desc_k128b(st[(it + j) % kQStages].v);
        if constexpr ((kDiag & kDiagNoSdp) != 0) {
          diag_undefined(acc);
          return;
        }
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) sm90::wgmma_m64n128k32_ss(acc, desc_do + 2 * kk, desc_v + 2 * kk, kk);
        sm90::wgmma_commit();
      };
      // Tile j: S(j) is in (or on its way into) sa; dP(j) goes into sb, dS is computed in place in sb
      // and packed, dQ's GEMM of tile j goes into sa and S(j + 1) into sb, then dQ is promoted.
      auto tile = [&](int j, float (&sa)[64], float (&sb)[64]) {
        const int stage = (it + j) % kQStages;
        // The K tile (kRing: rotated, (blk + j) mod n).
        const int kt = (kDiag & kRing) == 0 ? j : dq_ring_k_tile<kDiag>(w, j, n_k);
        const float ks = p.k_scale[tile0 + kt], vs = p.v_scale[tile0 + kt];
        const float k_tile = kTileScales ? p.kt_tile_scale[tile0 + kt] : 1.f;
        issue_dp(sb, j);
        sm90::wgmma_wait<0>();
        // q_release (the ring's dQ role): Q and dO read for the last time (S and dP of the last tile
        // done), so that the next item's load under this tile's math, dQ GEMM and epilogue.
        if (q_release != nullptr && j == n_k - 1) sm90::mbar_arrive(q_release);
        attn::fence_all(sa);
        attn::fence_all(sb);
        // The keys of the tile the warpgroup's rows all face (kCausal: its first row's), and a row's.
        const int valid = (kCausalMask ? lim_first : w.Lk) - kt * kTile;
        auto valid_of = [&](int r) { return kCausalMask ? lim[r] - kt * kTile : valid; };
        float a[2], c[2], amax[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) a[r] = in[r].x * ks, c[r] = in[r].z * vs;
        auto ds_of = [&](int i) {
          const int r = (i % 4) / 2;
          return attn::fast_exp2(fmaf(sa[i], a[r], -in[r].y)) * fmaf(sb[i], c[r], -in[r].w);
        };
        // kDumpPds: this tile's P (e4m3 of 256 p) and dS bytes (the dQ GEMM's operand) and dS's row
        // scale bytes into its dump block: pds_store_words.
        [[maybe_unused]] uint8_t* const pds =
            (kDiag & kDumpPds) == 0 ? nullptr
            : (kDiag & kRing) != 0
                ? p.ds_dump + dq_ring_slot<kDiag>(p, w, j, kt) * kPdsBlockBytes
                : p.ds_dump + dump_block(p, w.h, w.qb, w.blk, j) * kPdsBlockBytes;
        if constexpr ((kDiag & kDiagNoMath) != 0) {
          diag_sink(p, sa);
        } else if constexpr ((kDiag & kDumpPds) != 0) {
          // Two forms, as the default path below: full tiles without the per-key test (one form
          // with the test on every tile executed 48% more instructions than the default kernel).
          auto dump_math = [&](auto full) {
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
              float e[16];
#pragma unroll
              for (int k = 0; k < 16; ++k) {
                const int i = 16 * cc + k, r = (i % 4) / 2;
                const int col = 8 * (i / 4) + 2 * quad + (i % 2);
                const bool in_seq = decltype(full)::value || col < valid;
                e[k] = in_seq ? attn::fast_exp2(fmaf(sa[i], a[r], -in[r].y)) : 0.f;
                sb[i] = in_seq ? e[k] * fmaf(sb[i], c[r], -in[r].w) : 0.f;
                amax[r] = fmaxf(amax[r], fabsf(sb[i]));
              }
              if constexpr ((kDiag & kDsOnly) == 0) {  // (kDsOnly: P left to the dK/dV kernel)
                uint32_t pp[16];
                attn::pack_chunk(e, cc, pp);
                if constexpr ((kDiag & kDumpNoStore) != 0) {
                  diag_sink(p, pp);
                } else {
                  pds_store_words(pds, cw, warp, lane, cc, pp);
                }
              }
            }
          };
          if (valid >= kTile) {
            dump_math(std::true_type{});
          } else {
            dump_math(std::false_type{});
          }
        } else if (valid >= kTile) {
#pragma unroll
          for (int i = 0; i < 64; ++i) {
            sb[i] = ds_of(i);
            amax[(i % 4) / 2] = fmaxf(amax[(i % 4) / 2], fabsf(sb[i]));
          }
        } else {
#pragma unroll
          for (int i = 0; i < 64; ++i) {
            const int col = 8 * (i / 4) + 2 * quad + (i % 2);
            sb[i] = col < valid_of((i % 4) / 2) ? ds_of(i) : 0.f;
            amax[(i % 4) / 2] = fmaxf(amax[(i % 4) / 2], fabsf(sb[i]));
          }
        }
        if constexpr ((kDiag & kDumpPds) != 0 && (kDiag & kDumpNoBar) == 0) {
          // One dS scale for the warpgroup's 64 rows x 128 keys (dQ's and dK's operand alike, so that
          // the dK/dV kernel needs no re-expression): the warps' maxima through shared memory, a
          // buffer per tile parity (a warp writes tile j + 2's only after every warp passed tile
          // j + 1's barrier, i.e. read tile j's).
          const float m = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fmaxf(amax[0], amax[1]))));
          float* const slot = wg_amax + ((it + j) % 2) * (kConsumers * 4) + cw * 4;
          if (lane == 0) asm volatile("st.shared.f32 [%0], %1;" ::"r"(sm90::smem_u32(slot + warp)), "f"(m) : "memory");
          sm90::named_barrier_sync(8 + cw, kWarpgroupThreads);
          const float4 v = sm90::ld_shared_f32x4(slot);
          amax[0] = amax[1] = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
        }
        float inv[2], rs[2];
        row_scales(amax, inv, rs);
        if constexpr ((kDiag & kDiagNoMath) != 0) inv[0] = inv[1] = rs[0] = rs[1] = 1.f;
        [[maybe_unused]] const float rs_pre[2] = {rs[0], rs[1]};  // (kDumpPds: dS's own scales)
        if constexpr (kTileScales) {
          rs[0] *= k_tile;
          rs[1] *= k_tile;
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) sb[i] *= inv[(i % 4) / 2];
        uint32_t da[16];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) attn::pack_chunk(sb + 16 * cc, cc, da);
        if constexpr ((kDiag & kDumpPds) != 0) {
          if constexpr ((kDiag & kDumpNoStore) == 0) {
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) pds_store_words(pds + kPdsTileBytes, cw, warp, lane, cc, da);
          }
          if ((kDiag & kDumpNoStore) == 0 && quad == 0) {  // the rows' dS scale bytes (the warpgroup's; 0: all its dS zero)
            const int row = cw * kHalf + warp * 16 + lane / 4;
            pds[2 * kPdsTileBytes + row] = amax[0] > 0.f ? uint8_t(__float_as_uint(rs_pre[0]) >> 23) : uint8_t(0);
            pds[2 * kPdsTileBytes + row + 8] = amax[1] > 0.f ? uint8_t(__float_as_uint(rs_pre[1]) >> 23) : uint8_t(0);
          }
          if ((kDiag & kRing) != 0 || p.pds_flags != nullptr) {  // each warp's share stored: its arrival for the signaler
            __syncwarp();
            if (lane == 0) sm90::mbar_arrive(&dump_done[(it + j) % 8]);
          }
        }
        const uint64_t desc_kt = sm90::make_desc_k128b(st[stage].kt);
        if constexpr ((kDiag & kDiagNoGrad) != 0) {
          diag_sink(p, da);
          diag_undefined(sa);
        } else {
          sm90::wgmma_fence();
          sm90::wgmma_rs_steps<kTile / 32>(sa, da, desc_kt, true);
        }
        sm90::wgmma_commit();
        if (j + 1 < n_k) {
          full(j + 1);
          issue_s(sb, j + 1);
          sm90::wgmma_wait<1>();  // dQ's GEMM of tile j; S(j + 1) may still run
        } else {
          sm90::wgmma_wait<0>();
        }
        attn::fence_all(sa);
        sm90::mbar_arrive(&empty[stage]);
        if constexpr ((kDiag & kDiagNoPromote) != 0) {
          diag_sink(p, sa);
          diag_sink(p, rs);
        } else {
#pragma unroll
          for (int i = 0; i < 64; ++i) dq[i] = fmaf(sa[i], rs[(i % 4) / 2], dq[i]);
        }
      };
      float s0[64], s1[64];
      full(0);
      issue_s(s0, 0);
      int j = 0;
#pragma unroll 1
      for (; j + 1 < n_k; j += 2) {
        tile(j, s0, s1);
        tile(j + 1, s1, s0);
      }
      if (j < n_k) tile(j, s0, s1);
    }
  }
  // ------------------------------------------------------------------------------ epilogue
  // The CTA-per-item kernel is launched as the dK/dV kernel's programmatic dependent (it may start
  // while that kernel's last CTAs run): its last CTA waits for that kernel to complete, so that this
  // kernel's completion, which the stream's next work waits for, implies it (dK, dV written and
  // visible). The persistent kernel's last CTA waits after its last item.
  if (!kPersistent && blockIdx.x == gridDim.x - 1) asm volatile("griddepcontrol.wait;" ::: "memory");
  const float* kts = kTileScales ? nullptr : p.kt_scale + (int64_t(w.b) * p.heads + w.h) * kHeadDim;
  // K's channel scale times softmax_scale (kTileScales: in the promotions already), 0 without keys.
  auto dq_factor = [&](int col) {
    return n_k > 0 ? (kTileScales ? p.softmax_scale : kts[col] * p.softmax_scale) : 0.f;
  };
  const int first_row = w.blk * kTile + cw * kHalf;  // the warpgroup's first row of the sequence
  if (kPersistent && p.staged_dq && first_row + kHalf <= w.Lq) {
    const bool issuer = warp == 0 && lane == 0;
    const int barrier = kBarStage0 + cw;
    // (pack_bf16_rows' loop written out: through the helper ptxas rescheduled this kernel's main
    // loop, 33 more instructions and one more wgmma wait in it.)
    uint32_t packed[2][16];
#pragma unroll
    for (int jn = 0; jn < 16; ++jn) {
      const int col = 8 * jn + 2 * quad;
      const float k0 = dq_factor(col), k1 = dq_factor(col + 1);
#pragma unroll
      for (int r = 0; r < 2; ++r)
        packed[r][jn] = attn::bf16x2_bits(dq[4 * jn + 2 * r] * k0 * (1.f / kPScale),
                                          dq[4 * jn + 2 * r + 1] * k1 * (1.f / kPScale));
    }
    uint8_t* const box0 = q + cw * kHalf * kHeadDim;  // then dout + cw * kHalf * kHeadDim
    sm90::fence_proxy_async_smem();  // (the boxes were written by TMA loads and read by wgmma)
    attn::stage_and_store(tm_dq, box0, issuer, barrier, warp, lane, packed, w.h, int(p.cu_q[w.qb] + first_row),
                          uint32_t(dout - q));
    if (issuer) sm90::bulk_wait_read<0>();  // before the buffer is released
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w.blk * kTile + row0 + 8 * r;
    if (i >= w.Lq) continue;
#pragma unroll
    for (int jn = 0; jn < 16; ++jn) {
      const int col = 8 * jn + 2 * quad;
      const float k0 = dq_factor(col), k1 = dq_factor(col + 1);
      const float x0 = dq[4 * jn + 2 * r] * k0 * (1.f / kPScale), x1 = dq[4 * jn + 2 * r + 1] * k1 * (1.f / kPScale);
      if (p.broadcast_q) {
        const int64_t at = ((int64_t(w.b) * w.Lq + i) * p.heads + w.h) * kHeadDim + col;
        *reinterpret_cast<float2*>(p.dq_part + at) = make_float2(x0, x1);
      } else {
        const int64_t at = ((int64_t(p.cu_q[w.qb]) + i) * p.heads + w.h) * kHeadDim + col;
        *reinterpret_cast<__nv_bfloat162*>(p.dq + at) = __floats2bfloat162_rn(x0, x1);
      }
    }
  }
}

// kTileScales: as the dK/dV kernel's (Kᵀ' per K tile in dQ's promotions).
// The producer warpgroup's part of a dQ item (dq_item): kDumpPds's signaler warp, then one thread's
// loads of Q, dO and the K/V tiles.
// `it`: the K/V tiles this CTA loaded before (the ring kernel's dQ role, whose pipeline runs on
// across items; q_empty then the consumers' release of the previous item's Q and dO, at `q_phase`).
template <int kDiag>
__device__ __forceinline__ void dq_item_producer(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                                                 const CUtensorMap& tm_do, const CUtensorMap& tm_kt, const BwdParams& p,
                                                 QSmem& s, const Item& w, int n_k, int64_t o_row, int tid, int it = 0,
                                                 uint64_t* q_empty = nullptr, uint32_t q_phase = 0) {
  if constexpr ((kDiag & kDumpPds) != 0) {
    // The signaler (the producer warpgroup's second warp): per tile, once the eight consumer warps
    // have stored their share of the dump block, one release add on its counter, so that the
    // consumers never wait on a gpu-scope fence (a release by each consumer warp cost the kernel
    // 0.8 ms on llm-long, a 256-thread barrier and one fence 0.5 ms).
    if (tid == 32 && ((kDiag & kRing) != 0 || p.pds_flags != nullptr)) {
      for (int j = 0; j < n_k; ++j) {
        sm90::mbar_wait(&s.dump_done[(it + j) % 8], ((it + j) / 8) & 1);  // (consumers 8 tiles ahead would alias)
        if constexpr ((kDiag & kRing) != 0) {  // ring: the slot's epoch
          ring_release(p.ring_ready + dq_ring_slot<kDiag>(p, w, j, dq_ring_k_tile<kDiag>(w, j, n_k)),
                       dq_ring_epoch<kDiag>(p, w, j));
          continue;
        }
        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p.pds_flags + dump_block(p, w.h, w.qb, w.blk, j)),
                     "r"(8u)
                     : "memory");
      }
    }
  }
  if (tid != 0 || n_k == 0) return;
  if (q_empty != nullptr) sm90::mbar_wait(q_empty, q_phase);
  sm90::mbar_arrive_expect_tx(&s.q_full, 2 * kTileBytes);
  sm90::tma_load_2d(s.q, &tm_q, &s.q_full, 0, int(w.h * p.Pq + p.cu_q_sf[w.qb] + int64_t(w.blk) * kTile));
  sm90::tma_load_2d(s.dout, &tm_do, &s.q_full, 0, int(w.h * p.Po + o_row));
  produce_dq_tiles<kDiag & (kRing | kRect)>(s.st, s.full, s.empty, &tm_k, &tm_v, &tm_kt, p, w, n_k, it);
}

// The CTA-per-item dQ kernel's item: its barriers initialised, then the producer warpgroup's loads
// (and kDumpPds's signaler) and the consumers' dQ, each role's registers set first (setmaxnreg).
template <bool kTileScales, int kDiag>
__device__ __forceinline__ void dq_item(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                                        const CUtensorMap& tm_do, const CUtensorMap& tm_kt, const BwdParams& p,
                                        unsigned index) {
  extern __shared__ uint8_t smem_raw[];
  QSmem& s = attn::aligned_shared<QSmem>(smem_raw);
  const int wg = attn::warpgroup_index(), tid = threadIdx.x % kWarpgroupThreads;
  const Item w = item_of<false>(p, index);
  const int n_k = (w.Lk + kTile - 1) / kTile;
  attn::init_pipeline(&s.q_full, s.full, s.empty, kConsumers);
  const int64_t o_row = w.o_pad0 + int64_t(w.blk) * kTile;  // padded output row of the Q tile

  if constexpr ((kDiag & kDumpPds) != 0) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < 8; ++i) sm90::mbar_init(&s.dump_done[i], kConsumers * 4);
      sm90::fence_barrier_init();
    }
    __syncthreads();
  }
  if (wg == 0) {  // ---------------------------------------------------------------- producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    dq_item_producer<kDiag>(tm_q, tm_k, tm_v, tm_do, tm_kt, p, s, w, n_k, o_row, tid);
    return;
  }
  // ---------------------------------------------------------------------------------- consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  consume_dq<kTileScales, false, kDiag>(s.st, s.full, s.empty, s.q, s.dout, &s.q_full, 0, p.info, p, w, wg - 1, tid,
                                       0, nullptr, &s.wg_amax[0][0][0], s.dump_done);
}

template <bool kTileScales, int kDiag = 0>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dq_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                            const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                            const __grid_constant__ CUtensorMap tm_kt, const BwdParams p) {
  dq_item<kTileScales, kDiag>(tm_q, tm_k, tm_v, tm_do, tm_kt, p, blockIdx.x);
}

// The rectangular ring's dK/dV list (kRect), written on the device from its groups' table (group
// b x heads + h: its bundle and the bundle's step of its K tile 0) and each bundle's steps in all
// (`totals`): one block a group, an item {group, K tile k} per K tile at its place in the order by
// step s, then bundle u: the items of all steps before s (sum over bundles of min(s, total)) and
// those of step s on the bundles before u (total > s). Launched after the upload of the table, as
// a programmatic dependent of it (and dO's preprocess after it likewise).
inline size_t rect_list_smem(int bundles) { return size_t(bundles + 3) / 4 * 4 * sizeof(int); }
__global__ void rect_list_kernel(const int2* __restrict__ group, const int* __restrict__ totals, int bundles,
                                 const int* __restrict__ cu_k, int heads, int2* __restrict__ items) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // (rect_list_smem: whole 16-byte slots, the padding zero: ptxas reads the totals four at a time,
  // past `bundles` too, and a bundle of no steps counts for nothing)
  extern __shared__ int total[];
  for (int i = threadIdx.x; i < (bundles + 3) / 4 * 4; i += blockDim.x) total[i] = i < bundles ? totals[i] : 0;
  __syncthreads();
  const int gid = blockIdx.x, b = gid / heads;
  const int n_k = (cu_k[b + 1] - cu_k[b] + kTile - 1) / kTile;
  const int2 g = group[gid];
  for (int k = threadIdx.x; k < n_k; k += blockDim.x) {
    const int step = g.y + k;
    int64_t pos = 0;
    for (int u = 0; u < bundles; ++u) pos += min(step, total[u]) + (u < g.x && total[u] > step ? 1 : 0);
    items[pos] = make_int2(gid, k);
  }
}

// The ring (BwdParams::ring_n): one cooperative launch, so that every CTA is resident at once (the
// ring's lockstep needs it: a group's dQ and dK/dV units wait on each other). CTAs below
// pk.ring_ctas run the persistent dK/dV kernel's kFromPds form on pk's work list; the others, the
// dQ role, take pq's items r, r + (grid - ring_ctas), ... (the r-th of them), in the list's (group)
// order, each as one CTA of the CTA-per-item dQ kernel's kDumpPds form would.
template <int kDqDiag, int kKvDiag>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_ring_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                              const __grid_constant__ CUtensorMap tm_qt, const __grid_constant__ CUtensorMap tm_dot,
                              const __grid_constant__ CUtensorMap tm_dk, const __grid_constant__ CUtensorMap tm_dv,
                              const __grid_constant__ CUtensorMap tm_kt, const BwdParams pk, const BwdParams pq) {
  static_assert((kDqDiag & kDumpPds) != 0 && (kDqDiag & kRing) != 0, "the dQ role stores the ring's blocks");
  static_assert((kKvDiag & kFromPds) != 0 && (kKvDiag & kRing) != 0, "the dK/dV role reads them");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // as attention_bwd_dkdv_kernel (the flags too)
  const unsigned kv_ctas = unsigned(pk.ring_ctas);
  if (blockIdx.x < kv_ctas) {
    dkdv_body<true, false, false, true, kKvDiag>(tm_q, tm_k, tm_v, tm_do, tm_qt, tm_dot, tm_dk, tm_dv, pk);
    return;
  }
  // The dQ role: each warpgroup's registers set once and its items in a loop of its own (a loop
  // shared by both roles would meet them with two register counts: ptxas then ignores every
  // setmaxnreg of the kernel, C7507). The K/V pipeline and the dump barriers run on across items
  // (`it`: the tiles before), and the producer loads an item's Q and dO once the consumers have
  // released the previous item's (q_empty, as soon as its last S and dP GEMMs are done): the next
  // item's Q, dO and first K/V tiles load under this item's last tile and epilogue.
  extern __shared__ uint8_t smem_raw[];
  QSmem& s = attn::aligned_shared<QSmem>(smem_raw);
  const int wg = attn::warpgroup_index(), tid = threadIdx.x % kWarpgroupThreads;
  // kRect: the bundles' CTAs (ring_groups x ring_n; any CTAs past them have no items).
  const unsigned first = blockIdx.x - kv_ctas;
  const unsigned stride = (kDqDiag & kRect) != 0 ? unsigned(pq.ring_groups * pq.ring_n) : gridDim.x - kv_ctas;
  if ((kDqDiag & kRect) != 0 && first >= stride) return;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 8; ++i) sm90::mbar_init(&s.dump_done[i], kConsumers * 4);
    sm90::mbar_init(&s.q_empty, kConsumers * kWarpgroupThreads);
  }
  attn::init_pipeline(&s.q_full, s.full, s.empty, kConsumers);  // (and the fence of the two above)
  int it = 0;
  unsigned n = 0;  // items with K/V tiles before
  // kRect: this CTA's bundle (its CTAs are ring_n in a row, the stride a multiple of ring_n), whose
  // steps run on across its items (`it` counts them: every item of the CTA is the bundle's).
  auto item = [&](unsigned index) {
    Item w = item_of<false>(pq, index);
    if constexpr ((kDqDiag & kRect) != 0) {
      w.ring_bundle = int(first) / pq.ring_n;
      w.ring_s0 = it;
    }
    return w;
  };
  if (wg == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid != 0 && tid != 32) return;
    for (unsigned index = first; index < unsigned(pq.num_items); index += stride) {
      const Item w = item(index);
      const int n_k = (w.Lk + kTile - 1) / kTile;
      dq_item_producer<kDqDiag>(tm_q, tm_k, tm_v, tm_do, tm_kt, pq, s, w, n_k, w.o_pad0 + int64_t(w.blk) * kTile, tid,
                                it, n > 0 ? &s.q_empty : nullptr, (n - 1) & 1);
      if (n_k > 0) it += n_k, ++n;
    }
    return;
  }
  sm90::setmaxnreg_inc<kConsumerRegs>();
  for (unsigned index = first; index < unsigned(pq.num_items); index += stride) {
    const Item w = item(index);
    const int n_k = (w.Lk + kTile - 1) / kTile;
    consume_dq<true, false, kDqDiag>(s.st, s.full, s.empty, s.q, s.dout, &s.q_full, n & 1, pq.info, pq, w, wg - 1, tid,
                                     it, nullptr, &s.wg_amax[0][0][0], s.dump_done, &s.q_empty);
    if (n_k > 0) it += n_k, ++n;
  }
}

// The persistent dQ kernel (attention_bwd_dq_kernel_p; dq_persistent on the host): one CTA per SM,
// CTA c item c first, then the first item not yet taken (`next_item`, zeroed with the work list's
// upload), as the forward's persistent kernels (attention_fwd_sm90.cu): the producer warp publishes
// each item (its Item, Q, dO and the rows' constants) in one of two buffers an item ahead, and the
// K/V stages run on across items. Per item the CTA-per-item kernel pays its start, the first loads'
// latency and an epilogue no other work covers, which weighs where the items have few K/V tiles.
struct QSmemP {
  alignas(1024) uint8_t q[2][kTileBytes];
  alignas(1024) uint8_t dout[2][kTileBytes];
  QStage st[kQStages];
  float4 info[2][kTile];  // each buffer's rows' constants
  Item item[2];           // each buffer's item; h < 0: no more items
  alignas(8) uint64_t q_full[2];
  uint64_t q_empty[2];
  uint64_t full[kQStages];
  uint64_t empty[kQStages];
};
inline constexpr size_t kQSmemBytesP = sizeof(QSmemP) + 1024;

// kCausalMask: the causal mask (consume_dq's kCausal).
template <bool kTileScales, bool kCausalMask = false>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dq_kernel_p(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                              const __grid_constant__ CUtensorMap tm_kt, const BwdParams p, unsigned* next_item,
                              const __grid_constant__ CUtensorMap tm_dq) {
  extern __shared__ uint8_t smem_raw[];
  QSmemP& s = attn::aligned_shared<QSmemP>(smem_raw);
  const int wg = attn::warpgroup_index(), tid = threadIdx.x % kWarpgroupThreads;
  constexpr int kQArrivals = 32;  // the producer warp's lanes (lane 0's with Q's and dO's expect_tx)
  if (threadIdx.x == 0) {
    sm90::mbar_init(&s.q_full[1], kQArrivals);
    for (int i = 0; i < 2; ++i) sm90::mbar_init(&s.q_empty[i], kConsumers * kWarpgroupThreads);
  }
  attn::init_pipeline(&s.q_full[0], s.full, s.empty, kConsumers, kQArrivals);

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid >= 32) return;
    const int lane = tid;
    int it = 0;  // K/V tiles loaded before
    for (unsigned n = 0, index = blockIdx.x;; ++n) {
      const int qb = int(n & 1u);
      // The item's global reads (the work list and the sequence bounds: dependent loads) before
      // the wait for its buffer; its rows' constants come with Q and dO, by the TMA.
      const bool more = index < unsigned(p.num_items);
      unsigned next = 0;  // the CTA's next item: the first not yet taken
      Item w{};
      if (more) {
        if (lane == 0) next = gridDim.x + atomicAdd(next_item, 1u);
        w = item_of<false, kCausalMask>(p, unsigned(ordered_item<kCausalMask>(p, index)));
      }
      sm90::mbar_wait(&s.q_empty[qb], ((n >> 1) & 1u) ^ 1u);
      if (!more) {  // the end
        if (lane == 0) s.item[qb].h = -1;
        sm90::mbar_arrive(&s.q_full[qb]);
        return;
      }
      const int n_k = dq_k_tiles<kCausalMask>(p, w);
      if (lane == 0) {
        s.item[qb] = w;
        if (n_k > 0) {
          const int64_t o_row = w.o_pad0 + int64_t(w.blk) * kTile;
          sm90::mbar_arrive_expect_tx(&s.q_full[qb], 2 * kTileBytes + kTile * sizeof(float4));
          sm90::tma_load_2d(s.q[qb], &tm_q, &s.q_full[qb], 0,
                            int(w.h * p.Pq + p.cu_q_sf[w.qb] + int64_t(w.blk) * kTile));
          sm90::tma_load_2d(s.dout[qb], &tm_do, &s.q_full[qb], 0, int(w.h * p.Po + o_row));
          sm90::bulk_load(s.info[qb], p.info + w.h * p.Po + o_row, kTile * sizeof(float4), &s.q_full[qb]);
        } else {
          sm90::mbar_arrive(&s.q_full[qb]);
        }
      } else {
        sm90::mbar_arrive(&s.q_full[qb]);
      }
      if (lane == 0 && n_k > 0) produce_dq_tiles(s.st, s.full, s.empty, &tm_k, &tm_v, &tm_kt, p, w, n_k, it);
      it += n_k;
      index = __shfl_sync(0xFFFFFFFFu, next, 0);
    }
  }

  // ---------------------------------------------------------------------------------- consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;
  int it = 0;
  for (unsigned n = 0;; ++n) {
    const int qb = int(n & 1u);
    const uint32_t phase = (n >> 1) & 1u;
    sm90::mbar_wait(&s.q_full[qb], phase);
    const Item w = attn::warp_uniform(s.item[qb]);
    if (w.h < 0) break;
    consume_dq<kTileScales, true, kCausalMask ? kCausal : 0>(s.st, s.full, s.empty, s.q[qb], s.dout[qb], &s.q_full[qb],
                                                             phase, s.info[qb], p, w, cw, tid, it, &tm_dq);
    it += dq_k_tiles<kCausalMask>(p, w);
    sm90::mbar_arrive(&s.q_empty[qb]);
  }
  // Launched as the dK/dV kernel's programmatic dependent: the last CTA waits for that kernel to
  // complete (see consume_dq's epilogue).
  if (blockIdx.x == gridDim.x - 1) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (p.staged_dq && tid == 0) sm90::bulk_wait<0>();  // the last stores done before the shared memory goes
}

// ---------------------------------------------------------------- dQ from the dumped dS (experiment)
// kDiagDumpDs: one CTA per (128 queries, head) item of the dQ work list; per K/V tile the producer
// loads Kᵀ' and the dump block (both key halves' dSᵀ fragments of both query halves) with its scale
// bytes; consumer warpgroup c takes query half c: it re-expresses the 128 keys' bytes to the largest
// of their scales (shift_e4m3x4's arithmetic without its branch: exact, one rounding), writes them
// transposed as the K-major A operand (row = query, bytes in Kᵀ''s token order), runs dQ = dS Kᵀ'
// (m64n128k32 SS) and promotes it times that scale. No S, dP or softmax; no atomics (one CTA sums a
// Q tile's K/V tiles in order).
struct DumpStage {
  alignas(1024) uint8_t kt[kTileBytes];
  alignas(16) uint32_t ds[2][kConsumers][kWarpgroupThreads][8];  // [query half][key half][thread][word]
  alignas(16) uint8_t sc[2][kTile];                               // [query half][key] scale bytes
};
inline constexpr int kDumpStages = 4;
struct DumpSmem {
  DumpStage st[kDumpStages];
  alignas(1024) uint8_t a[kConsumers][2][kHalf * kTile];  // each warpgroup's A tiles (tiles j, j + 1)
  uint32_t smax[kConsumers][4];
  alignas(8) uint64_t once;
  uint64_t full[kDumpStages];
  uint64_t empty[kDumpStages];
};
inline constexpr size_t kDumpSmemBytes = sizeof(DumpSmem) + 1024;
static_assert(kDumpSmemBytes <= 227 * 1024, "dQ dump kernel: shared memory");

template <bool kTileScales>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dq_dump_kernel(const __grid_constant__ CUtensorMap tm_kt, const BwdParams p) {
  extern __shared__ uint8_t smem_raw[];
  DumpSmem& s = attn::aligned_shared<DumpSmem>(smem_raw);
  const int wg = attn::warpgroup_index(), tid = threadIdx.x % kWarpgroupThreads;
  const Item w = item_of<false>(p, blockIdx.x);
  const int n_k = (w.Lk + kTile - 1) / kTile;
  attn::init_pipeline<kDumpStages>(&s.once, s.full, s.empty, kConsumers);
  // dump_block(p, w.h, w.qb, w.blk, j), its unwrapped part hoisted (the form measured; computed in
  // the loop, ptxas rescheduled this kernel).
  const int64_t qt = p.cu_q_sf[w.qb] / kTile + w.blk;  // the padded Q tile
  const int64_t block0 = (int64_t(w.h) * (p.Pq / kTile) + qt) * p.dump_kt;

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid != 0) return;
    for (int j = 0; j < n_k; ++j) {
      const int stage = j % kDumpStages;
      DumpStage& st = s.st[stage];
      sm90::mbar_wait(&s.empty[stage], ((j / kDumpStages) & 1) ^ 1);
      sm90::mbar_arrive_expect_tx(&s.full[stage], kTileBytes + sizeof(st.ds) + sizeof(st.sc));
      sm90::tma_load_2d(st.kt, &tm_kt, &s.full[stage], int(p.cu_k_sf[w.b] + int64_t(j) * kTile), w.h * kHeadDim);
      const int64_t block = p.dump_wrap_mask != 0 ? (block0 + j) & p.dump_wrap_mask : block0 + j;
      sm90::bulk_load(st.ds, p.ds_dump + block * 16384, sizeof(st.ds), &s.full[stage]);
      sm90::bulk_load(st.sc, p.ds_scales + block * 256, sizeof(st.sc), &s.full[stage]);
    }
    return;
  }

  // ---------------------------------------------------------------------------------- consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1, warp = tid / 32, lane = tid % 32, quad = lane % 4;
  // This thread's share of the half's dSᵀ (see the comment of the producer): key half sc, its warp
  // sw, query quad q and the keys 2u, 2u + 1, 2u + 8, 2u + 9 of that warp's 16 (held by the dumping
  // lanes src0 and src0 + 4, rows g and g + 8), whose bytes fill one word of Kᵀ''s token order; four
  // groups (c, h2) of 4 queries, taken in an order rotated by u (conflict-free shared loads).
  const int sc = tid / 64, sw = (tid / 16) % 4, u = (tid / 4) % 4, q = tid % 4;
  const int src0 = 32 * sw + 8 * u + q, kkey = 64 * sc + 16 * sw + 2 * u;
  const uint32_t word = uint32_t(kkey + 2 * u);  // = 64 sc + 16 sw + 4 u, the keys' position
  const int64_t tile0 = int64_t(w.h) * (p.Pk / kTile) + p.cu_k_sf[w.b] / kTile;
  // Tile j's A operand into s.a[cw][j & 1] (its stage complete); returns the half's scale byte.
  auto transform = [&](int j) {
    const DumpStage& st = s.st[j % kDumpStages];
    sm90::mbar_wait(&s.full[j % kDumpStages], (j / kDumpStages) & 1);
    // The half's scale: the largest of its 128 keys' (0 for keys past the sequence).
    const uint32_t wmax = __reduce_max_sync(0xFFFFFFFFu, uint32_t(st.sc[cw][tid]));
    if (lane == 0) s.smax[cw][warp] = wmax;
    sm90::named_barrier_sync(1 + cw, kWarpgroupThreads);
    const uint4 sm = *reinterpret_cast<const uint4*>(&s.smax[cw][0]);
    const int sig = int(max(max(sm.x, sm.y), max(sm.z, sm.w)));
    const uint32_t m00 = f16x2_pow2_neg(sig - int(st.sc[cw][kkey])), m10 = f16x2_pow2_neg(sig - int(st.sc[cw][kkey + 1]));
    const uint32_t m01 = f16x2_pow2_neg(sig - int(st.sc[cw][kkey + 8])),
                   m11 = f16x2_pow2_neg(sig - int(st.sc[cw][kkey + 9]));
    const uint32_t a_base = sm90::smem_u32(s.a[cw][j & 1]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int grp = (k + u) & 3, c = grp >> 1, h2 = grp & 1;
      const uint2 x0 = *reinterpret_cast<const uint2*>(&st.ds[cw][sc][src0][4 * c + 2 * h2]);
      const uint2 x1 = *reinterpret_cast<const uint2*>(&st.ds[cw][sc][src0 + 4][4 * c + 2 * h2]);
      const uint32_t w0 = e4m3x4_times_f16x2(x0.x, m00), w2 = e4m3x4_times_f16x2(x0.y, m01);
      const uint32_t w1 = e4m3x4_times_f16x2(x1.x, m10), w3 = e4m3x4_times_f16x2(x1.y, m11);
      const uint32_t t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);
      const uint32_t t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);
      const uint32_t d[4] = {__byte_perm(t0, t2, 0x5410), __byte_perm(t0, t2, 0x7632), __byte_perm(t1, t3, 0x5410),
                             __byte_perm(t1, t3, 0x7632)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t row = uint32_t(32 * c + 16 * h2 + 8 * (i / 2) + 2 * q + (i % 2));  // the query
        const uint32_t at = a_base + row * 128 + ((((word / 16) ^ row) & 7) << 4) + (word % 16);
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(at), "r"(d[i]) : "memory");
      }
    }
    sm90::fence_proxy_async_smem();
    sm90::named_barrier_sync(1 + cw, kWarpgroupThreads);  // the A tile written, smax read
    return sig;
  };
  float dq[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dq[i] = 0.f;
  // The GEMM of tile j runs while tile j + 1 is transformed.
  int sig = n_k > 0 ? transform(0) : 0;
#pragma unroll 1
  for (int j = 0; j < n_k; ++j) {
    float acc[64];
    const uint64_t desc_a = sm90::make_desc_k128b(s.a[cw][j & 1]);
    const uint64_t desc_b = sm90::make_desc_k128b(s.st[j % kDumpStages].kt);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTile / 32; ++kk) sm90::wgmma_m64n128k32_ss(acc, desc_a + 2 * kk, desc_b + 2 * kk, kk);
    sm90::wgmma_commit();
    const int sig_next = j + 1 < n_k ? transform(j + 1) : 0;
    sm90::wgmma_wait<0>();
    attn::fence_all(acc);
    sm90::mbar_arrive(&s.empty[j % kDumpStages]);
    const float f = scale_of(uint32_t(sig)) * (kTileScales ? p.kt_tile_scale[tile0 + j] : 1.f);
#pragma unroll
    for (int i = 0; i < 64; ++i) dq[i] = fmaf(acc[i], f, dq[i]);
    sig = sig_next;
  }
  // As consume_dq's direct stores (no broadcast Q here; written out there too: a shared helper
  // made ptxas reschedule the dQ kernels' main loops, +19-37 instructions).
  const float* kts = kTileScales ? nullptr : p.kt_scale + (int64_t(w.b) * p.heads + w.h) * kHeadDim;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w.blk * kTile + cw * kHalf + warp * 16 + lane / 4 + 8 * r;
    if (i >= w.Lq) continue;
    const int64_t at = ((int64_t(p.cu_q[w.qb]) + i) * p.heads + w.h) * kHeadDim;
#pragma unroll
    for (int jn = 0; jn < 16; ++jn) {
      const int col = 8 * jn + 2 * quad;
      const float k0 = n_k > 0 ? (kTileScales ? p.softmax_scale : kts[col] * p.softmax_scale) : 0.f;
      const float k1 = n_k > 0 ? (kTileScales ? p.softmax_scale : kts[col + 1] * p.softmax_scale) : 0.f;
      *reinterpret_cast<__nv_bfloat162*>(p.dq + at + col) =
          __floats2bfloat162_rn(dq[4 * jn + 2 * r] * k0 * (1.f / kPScale), dq[4 * jn + 2 * r + 1] * k1 * (1.f / kPScale));
    }
  }
}

// dQ in bf16 = scale x the sum over `batch` fp32 parts of n values each: broadcast_q's batch sum of
// each output sequence's dQ.
__global__ void sum_dq_kernel(const float* __restrict__ part, int batch, int64_t n, float scale,
                              __nv_bfloat16* __restrict__ dq) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int b = 0; b < batch; ++b) s += part[int64_t(b) * n + e];
    dq[e] = __float2bfloat16_rn(s * scale);
  }
}

// output_mxfp8_dkv: the (Tk, H, 4) per-token-row view of square32 plain scales (P / 32, H, 4).
__global__ void token_row_scales_kernel(const uint8_t* __restrict__ square, const int32_t* __restrict__ cu,
                                        const int32_t* __restrict__ cu_sf, int batch, int64_t T, int64_t H,
                                        uint8_t* __restrict__ out) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < T * H; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / H, h = e % H;
    const int b = attn::sequence_of_padded(cu, batch, t);  // the largest b with cu[b] <= t: t's sequence
    const int64_t g = (cu_sf[b] + t - cu[b]) / kBlockSize;
    const uint32_t v = *reinterpret_cast<const uint32_t*>(square + (g * H + h) * 4);
    *reinterpret_cast<uint32_t*>(out + e * 4) = v;
  }
}

}  // namespace bwd

namespace {

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

// Kernel variants of experiment builds (-DMXFLASH_FWD_EXPERIMENTS=1), picked with the environment
// variable MXFLASH_BWD_VARIANT for A/B runs of one binary: bit 0 one CTA per dK/dV item instead of
// the persistent dK/dV kernel, bit 1 dV promoted per 64-query half (kDvPerHalf), bit 10 the dK/dV
// consumers' clock trace into the file named by MXFLASH_BWD_TRACE (trace.cuh), bit 17 the dQ
// kernel launched without programmatic stream serialization, bit 18 (a diagnostic: garbage out)
// the operands' prepare passes (Q, K, V rows, Qᵀ', Kᵀ') launched on the first call only, so that
// the time is what a backward on quantizer-written operands would take; diagnostics on
// quantizer-written operands (garbage gradients): bits 20-23 and 28-29 the dK/dV kernel's kDiag,
// bits 24-27 the dQ kernel's (docs/backward.md); bit 30 (right gradients) dQ from dS dumped by the
// dK/dV kernel (kDiagDumpDs, attention_bwd_dq_dump_kernel). Other builds run variant 0.
int bwd_variant() {
#if MXFLASH_FWD_EXPERIMENTS
  static const int v = [] {
    const char* e = std::getenv("MXFLASH_BWD_VARIANT");
    return e ? std::atoi(e) : 0;
  }();
  return v;
#else
  return 0;
#endif
}

#if MXFLASH_FWD_EXPERIMENTS
// The dK/dV kernel's kDiag in an experiments variant: bits 20-23 as 1-8, bits 28-29 as 16, 32.
int dkdv_diag(int variant) { return ((variant >> 20) & 15) | ((variant >> 24) & 112); }
#endif

// Experiments builds, MXFLASH_BWD_VARIANT bit 30 (kDiagDumpDs): dQ from dS dumped by the dK/dV kernel
// (exec operands, no broadcast Q), through a workspace of H x (Pq / 128) x (longest K tiles) x 16 KB.
bool dump_ds(const cuda::AttentionBwdProblem& p) {
  return (bwd_variant() & (1 << 30)) != 0 && p.exec != nullptr && !p.broadcast_q && p.Tq > 0 && p.Tk > 0;
}
// The ring (attention_bwd_ring_kernel; docs/backward.md): MXFLASH_BWD_RING=0 turns it off, =1 takes
// it wherever the shape allows (ring_tiles, else rect_config), =2 its rectangular form wherever that
// can run, unset (the default) where it measured faster.
int ring_env() {
  const char* e = std::getenv("MXFLASH_BWD_RING");
  return e == nullptr ? -1 : std::atoi(e);
}
// The tiles n of every sequence where the ring can run (0: it cannot, or is off): exec operands, no
// broadcast Q, every Q and K/V sequence of one length L, a multiple of 4 x 128 of at
// most 64 tiles (a group's Q-tile and K-tile units all run at once). By default (ring_env() < 0) also
// n >= kRingMinTiles and at least kRingMinUnits tiles in all (groups x n). H200, 2026-11-30, the
// whole backward on operands, ring against the two kernels one after the other, TFLOP/s (same
// call, two rounds), since the mbarrier waits suspend (mbar_wait): L=4096 B=4 H=16 652.6 / 647.7
// against 577.9 / 579.9; L=2048 B=8 H=4 563.2 / 557.9 against 516.2 / 515.2, B=2 H=8 (256 tiles)
// 496.9 / 496.2 against 477.9 / 478.7; L=1024 B=16 H=16 516.7 / 514.1 against 497.3 / 497.6; L=512
// B=32 H=16 371.6 / 372.1 against 414.0 / 414.0. (Before, with spinning waits, the ring lost at
// L=1024 and on L=2048 B=2 H=8, and tied on B=8 H=4: the rule was 16 tiles and 1024 in all.)
inline constexpr int kRingMinTiles = 8, kRingMinUnits = 256;
int ring_tiles(const cuda::AttentionBwdProblem& p) {
  const int env = ring_env();
  if (env == 0 || env == 2 || p.exec == nullptr || p.broadcast_q || p.Tq <= 0 || p.Tk <= 0 || p.Tq != p.Tk) return 0;
  const std::vector<int32_t>& ck = *p.host_cu_k;
  const std::vector<int32_t>& cq = *p.host_cu_q;
  if (ck.size() != cq.size()) return 0;
  const int L = ck[1] - ck[0];
  for (size_t b = 0; b + 1 < ck.size(); ++b)
    if (ck[b + 1] - ck[b] != L || cq[b + 1] - cq[b] != L) return 0;
  if (L % (4 * bwd::kTile) != 0 || L / bwd::kTile > 64) return 0;
  const int n = L / bwd::kTile;
  if (env < 0 && (n < kRingMinTiles || int64_t(ck.size() - 1) * p.heads * n < kRingMinUnits)) return 0;
  return n;
}
// Experiments builds, MXFLASH_BWD_VARIANT bit 19 (kDumpPds / kFromPds): where the ring does not run,
// the dQ kernel first, storing P and dS for every (Q tile, K tile) (a workspace of H x (Pq / 128) x
// (longest K tiles) x 32.1 KB), then the dK/dV kernel on those bytes (exec operands, no broadcast
// Q; docs/backward.md). The ring's kernel uses the same two forms (BwdPlan::pds: either).
bool pds_experiment(const cuda::AttentionBwdProblem& p) {
  return (bwd_variant() & (1 << 19)) != 0 && p.exec != nullptr && !p.broadcast_q && p.Tq > 0 && p.Tk > 0;
}
// The ring's shape: the tiles a sequence n (0: off), the dK/dV role's CTAs (56 where n <= 16, else
// 64, or MXFLASH_BWD_RING_CTAS; each role >= n CTAs, else no ring), the steps a group's dQ side may
// run ahead (8 where n is a multiple of 8, else 4, or MXFLASH_BWD_RING_STEPS, a power of two dividing
// n) and the ring's groups (the dQ side's groups in flight + 2). The defaults are the best measured
// (H200, 2026-11-30: llm-long 615-617 TFLOP/s with 8 steps against 601-610 with 4; llm 558 with 56
// CTAs and 8 steps against 528-537 with 64 and 4; docs/backward.md).
struct RingConfig {
  int n = 0, ctas = 0, steps = 4, groups = 1;
  // The rectangular ring (kRect): n the Q tiles of every group, groups its bundles of n dQ CTAs.
  bool rect = false;
  size_t blocks() const { return size_t(groups) * size_t(steps) * size_t(n); }
};
inline constexpr int kRingDkdvCtas = 64;
#if MXFLASH_FWD_EXPERIMENTS
// MXFLASH_BWD_VARIANT bit 14 with bit 19: the kernels' kDsOnly forms (P computed by the dK/dV kernel).
bool ds_only() { return (bwd_variant() & 16384) != 0; }
// MXFLASH_BWD_DQ_DUMP_DIAG (0 when unset): the dQ kernel's kDumpPds diagnostics, 1 kDumpNoStore, 2
// kDumpNoBar, 3 both (dK, dV wrong).
int dq_dump_diag() {
  const char* e = std::getenv("MXFLASH_BWD_DQ_DUMP_DIAG");
  return e != nullptr ? std::atoi(e) : 0;
}
#endif
// The ring's kernel; in experiments builds its kDsOnly forms (MXFLASH_BWD_VARIANT bit 14), or with
// MXFLASH_BWD_DQ_DUMP_DIAG=1 the dQ role's kDumpNoStore form (the blocks never written, dK and dV
// wrong): what the ring would run at if its hand-over's stores cost nothing.
auto ring_kernel(bool rect) {
  auto kernel = bwd::attention_bwd_ring_kernel<bwd::kDumpPds | bwd::kRing, bwd::kFromPds | bwd::kRing>;
  if (rect) return bwd::attention_bwd_ring_kernel<bwd::kDumpPds | bwd::kRing | bwd::kRect, bwd::kFromPds | bwd::kRing | bwd::kRect>;
#if MXFLASH_FWD_EXPERIMENTS
  if (ds_only())
    kernel = bwd::attention_bwd_ring_kernel<bwd::kDumpPds | bwd::kRing | bwd::kDsOnly,
                                            bwd::kFromPds | bwd::kRing | bwd::kDsOnly>;
  else if (dq_dump_diag() == 1)
    kernel = bwd::attention_bwd_ring_kernel<bwd::kDumpPds | bwd::kRing | bwd::kDumpNoStore, bwd::kFromPds | bwd::kRing>;
#endif
  return kernel;
}
RingConfig ring_config(const cuda::AttentionBwdProblem& p, int sms) {
  RingConfig c;
  c.n = ring_tiles(p);
  if (c.n == 0) return c;
  // (Even counts: the hardware places blocks 2t and 2t + 1 on one TPC, and a TPC holding one CTA of
  // each role measured 6-7% slower than TPCs of one role; docs/performance.md, twelfth session.)
  c.ctas = c.n <= 16 ? 56 : kRingDkdvCtas;
  if (c.n % 8 == 0) c.steps = 8;
  if (const char* e = std::getenv("MXFLASH_BWD_RING_CTAS")) {
    const int v = std::atoi(e);
    if (v >= c.n && sms - v >= c.n) c.ctas = v;
  }
  if (const char* e = std::getenv("MXFLASH_BWD_RING_STEPS")) {
    const int v = std::atoi(e);
    if (v >= 4 && (v & (v - 1)) == 0 && c.n % v == 0) c.steps = v;
  }
  if (c.ctas < c.n || sms - c.ctas < c.n) return RingConfig{};
  c.groups = (sms - c.ctas) / c.n + 2;
  return c;
}
// The rectangular ring (kRect; BwdParams and the ring kernel say how it runs): exec operands, every
// Q sequence of one length (broadcast Q: its one) of at most kRectMaxQTiles tiles (64 with
// MXFLASH_BWD_RING=2), K/V sequences of any lengths. By default (ring_config_of) it runs, ahead of
// the square ring, from kRectMinQTiles Q tiles, kRectMinKTiles K/V tiles a sequence on average and
// kRectMinGroups groups a bundle (fewer leave the bundles' last groups unbalanced). The dQ role
// gets bundles of nq CTAs on the SMs that the dK/dV role's share leaves (52 of 132, 64 where nq <=
// 4: its units of few blocks pay their K/V loads and epilogue more often; MXFLASH_BWD_RING_CTAS:
// that many), at most one bundle per group, and the dK/dV role the rest (MXFLASH_BWD_RING_DQ_CTAS:
// that many dQ CTAs instead, in bundles; more than the device holds take the two kernels: the
// tests use it); 8 steps (MXFLASH_BWD_RING_STEPS).
// H200, 2026-11-30, the whole backward on operands, TFLOP/s, same calls:
// - cross (B=64, Lq=512 shared, Lk=16384, H=3: nq = 4) by dK/dV CTAs at 4 / 8 steps: 40 449, 46
//   492, 52 554, 58 590, 64 597 / 599, 70 571 / 581, 76 552 / 564, 82 505 / 514, 88 456 / 466;
//   jagged at 64: 581 / 602 (the two kernels 535 / 520).
// - rectangular / two kernels: cross 605 / 528, jagged 603 / 515, Lq=1024 Lk=4096 B=16 H=16 595 /
//   539, broadcast Lq=512 Lk=1024 B=256 H=4 460 / 431; slower where its units hold few blocks:
//   Lq=Lk=512 B=32 H=16 341 / 406, Lq=Lk=256 B=64 H=16 213 / 306, Lq=128 Lk=2048 B=256 H=8 332 / 382.
// - rectangular (52 CTAs) / the default before it (square ring or two kernels): llm (L=2048 B=8
//   H=16) 630 / 607 (68 CTAs 557, 4 steps 605), L=1024 B=16 H=16 523 / 510 (64 CTAs 458), L=1024
//   B=32 H=8 522 / 506, L=2048 B=8 H=4 566 / 566, L=2048 B=2 H=8 (16 groups) 456 / 497, L=4096 B=4
//   H=16 (2 bundles) 618 / 645.
inline constexpr int kRectMaxQTiles = 16, kRectMaxBundles = 4096, kRectMinQTiles = 4, kRectMinKTiles = 8,
                     kRectMinGroups = 8;
RingConfig rect_config(const cuda::AttentionBwdProblem& p, int sms) {
  const int env = ring_env();
  if (env == 0 || p.exec == nullptr || p.Tq <= 0 || p.Tk <= 0) return RingConfig{};
  const std::vector<int32_t>& cq = *p.host_cu_q;
  const std::vector<int32_t>& ck = *p.host_cu_k;
  const int lq = cq[1] - cq[0];
  for (size_t b = 0; b + 1 < cq.size(); ++b)
    if (cq[b + 1] - cq[b] != lq) return RingConfig{};
  const int nq = (lq + bwd::kTile - 1) / bwd::kTile;
  if (nq < 1 || nq > (env == 2 ? 64 : kRectMaxQTiles)) return RingConfig{};
  int64_t k_tiles = 0;
  for (size_t b = 0; b + 1 < ck.size(); ++b) k_tiles += (ck[b + 1] - ck[b] + bwd::kTile - 1) / bwd::kTile;
  if (env < 0 && (nq < kRectMinQTiles || k_tiles < int64_t(kRectMinKTiles) * p.batch)) return RingConfig{};
  RingConfig c;
  c.rect = true;
  c.n = nq;
  c.steps = 8;
  c.ctas = (sms * (nq <= 4 ? 64 : 52) + 66) / 132;
  if (const char* e = std::getenv("MXFLASH_BWD_RING_CTAS")) {
    const int v = std::atoi(e);
    if (v >= 1 && v <= sms - nq) c.ctas = v;
  }
  if (const char* e = std::getenv("MXFLASH_BWD_RING_STEPS")) {
    const int v = std::atoi(e);
    if (v >= 1 && (v & (v - 1)) == 0) c.steps = v;
  }
  if (sms - c.ctas < nq) return RingConfig{};
  const int64_t groups = int64_t(p.batch) * p.heads;
  int64_t bundles = (sms - c.ctas) / nq;
  if (const char* e = std::getenv("MXFLASH_BWD_RING_DQ_CTAS")) bundles = std::max<int64_t>(1, std::atoll(e) / nq);
  c.groups = int(std::max<int64_t>(1, std::min({bundles, groups, int64_t(kRectMaxBundles)})));
  c.ctas = std::max(c.ctas, sms - c.groups * nq);  // (the SMs the bundles leave)
  if (env < 0 && groups < int64_t(kRectMinGroups) * c.groups) return RingConfig{};
  return c;
}
// The ring a call runs (n 0: none): the rectangular form where it runs by default (or with
// MXFLASH_BWD_RING=2), else the square one; MXFLASH_BWD_RING=1 the square one where the shape allows,
// else the rectangular.
RingConfig ring_config_of(const cuda::AttentionBwdProblem& p, int sms) {
  if (ring_env() == 1) {
    const RingConfig square = ring_config(p, sms);
    return square.n > 0 ? square : rect_config(p, sms);
  }
  const RingConfig rect = rect_config(p, sms);
  return rect.n > 0 ? rect : ring_config(p, sms);
}
// The rectangular ring's groups' table (BwdParams::ring_group: {bundle, step of K tile 0} per group
// b x heads + h), then each bundle's steps in all (rect_list_kernel's `totals`, two a slot): the
// groups in the dQ list's order (`q_items`, its heads in a row), group g of that order on bundle g
// mod bundles, whose steps run on across its groups. `n_items`: the dK/dV list's length; `totals_at`:
// the entry where the bundles' steps start.
std::vector<int2> rect_meta(const std::vector<int2>& q_items, const std::vector<int>& k_tiles, int heads, int bundles,
                            size_t* n_items, size_t* totals_at) {
  std::vector<int2> table(k_tiles.size() * size_t(heads), int2{0, 0});
  std::vector<int> steps(size_t(bundles) + 1, 0);  // (+1: whole int2 slots)
  int64_t g = 0;
  *n_items = 0;
  for (size_t e = 0; e < q_items.size(); ++e) {
    if (q_items[e].y != int(e)) continue;  // (the sequence's first Q tile)
    const int b = q_items[e].x;
    for (int h = 0; h < heads; ++h, ++g) {
      const int u = int(g % bundles);
      table[size_t(b * heads + h)] = int2{u, steps[size_t(u)]};
      steps[size_t(u)] += k_tiles[size_t(b)];
      *n_items += size_t(k_tiles[size_t(b)]);
    }
  }
  *totals_at = table.size();
  for (size_t u = 0; u + 1 < steps.size(); u += 2) table.push_back(int2{steps[u], steps[u + 1]});
  return table;
}
// The current device's SMs (132 where it cannot be read: the launcher's sm_count then fails first).
int device_sms() {
  int sms = 132, dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}
int dump_k_tiles(const cuda::AttentionBwdProblem& p) {
  const std::vector<int32_t>& ck = *p.host_cu_k;
  int longest = 0;
  for (size_t b = 0; b + 1 < ck.size(); ++b) longest = std::max(longest, ck[b + 1] - ck[b]);
  return (longest + bwd::kTile - 1) / bwd::kTile;
}

// How many CTAs of the persistent dQ kernel (attention_bwd_dq_kernel_p) run the dQ items: one per
// SM (`sms`, the device's count), or 0 for one CTA per item (attention_bwd_dq_kernel): persistent where the longest K/V
// sequence (`lk`: the K/V lengths) has at most kDqPersistentMaxTiles tiles. H200, 2026-11-30, the
// whole backward on operands, TFLOP/s against a CTA per item (one round, same call): 128-token
// self-attention (B=512, H=16) 142 against 128, 256 tokens 239 against 218, 512 333 against 316,
// llm (2048) 484 against 485, llm-long (8192) 555 against 566. Since dQ is staged for TMA stores
// (consume_dq; same run, the previous commit's binary as base): B=512 L=128 190 against 172, 256
// tokens 300 against 270, 512 394 against 363, 1024 471 against 447, and llm persistent 509 against
// 496 for a CTA per item: persistent up to 16 tiles since.
// MXFLASH_BWD_DQ_PERSISTENT forces it, read at every call: 0 = off, 1 = one CTA per SM, n >= 2 =
// at most n CTAs (tests: each CTA then walks many items).
constexpr int kDqPersistentMaxTiles = 16;
int dq_persistent_ctas(int sms, const std::vector<int>& lk) {
  if (const char* e = std::getenv("MXFLASH_BWD_DQ_PERSISTENT")) {
    const int n = std::atoi(e);
    if (n == 0) return 0;
    return n >= 2 ? std::min(n, sms) : sms;
  }
  const int longest = lk.empty() ? 0 : *std::max_element(lk.begin(), lk.end());
  return (longest + bwd::kTile - 1) / bwd::kTile <= kDqPersistentMaxTiles ? sms : 0;
}

// BwdParams::heads_inner for a work list whose items read the other side's `len` tokens of
// `bytes_per_token` each, per head.
bool heads_inner(int64_t heads, const std::vector<int>& len, int64_t bytes_per_token) {
  const int64_t longest = len.empty() ? 0 : *std::max_element(len.begin(), len.end());
  return attn::heads_in_turn(heads, longest * bytes_per_token);
}

struct BwdWorkspace {
  size_t ring_items, ring_meta, q, k, v, qt, kt, dout, dot, info, q_scale, k_scale, v_scale, qt_byte, qt_scale, kt_byte, kt_scale, dot_scale,
      kv_items, orders, q_items, dq_part, dk_f32, dv_f32, dk_sq, dv_sq, ds_dump, ds_scales, total;
};

BwdWorkspace bwd_layout(const cuda::AttentionBwdProblem& p, int64_t Po, size_t n_kv_items, size_t n_q_items,
                        const RingConfig& ring, bool pds, size_t n_ring_items, size_t n_ring_meta, size_t n_orders) {
  BwdWorkspace w;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  const size_t H = size_t(p.heads), D = kHeadDim, Bq = size_t(p.broadcast_q ? 1 : p.batch), B = size_t(p.batch);
  // The re-expressed operands: none with exec operands (p.exec), which the caller holds.
  const size_t ops = p.exec ? 0 : 1;
  w.q = take(ops * H * p.Pq * D);
  w.k = take(ops * H * p.Pk * D);
  w.v = take(ops * H * p.Pk * D);
  w.qt = take(ops * H * p.Pq * D);
  w.kt = take(ops * H * p.Pk * D);
  w.dout = take(H * Po * D);
  w.dot = take(H * Po * D);
  w.info = take(H * Po * sizeof(float4));
  w.q_scale = take(ops * H * p.Pq * sizeof(float));
  w.k_scale = take(ops * H * (p.Pk / bwd::kTile) * sizeof(float));
  w.v_scale = take(ops * H * (p.Pk / bwd::kTile) * sizeof(float));
  w.qt_byte = take(ops * Bq * H * D);
  w.qt_scale = take(ops * Bq * H * D * sizeof(float));
  w.kt_byte = take(ops * B * H * D);
  w.kt_scale = take(ops * B * H * D * sizeof(float));
  w.dot_scale = take(H * (Po / bwd::kTile) * D * sizeof(float));
  // The rectangular ring's dK/dV list (rect_list_kernel's), then its groups' table and both work
  // lists, in a row: one upload (attention_backward), which leaves out the dK/dV kernel's list, last,
  // where the rectangular ring runs without it.
  w.ring_items = take(n_ring_items * sizeof(int2));
  w.ring_meta = take(n_ring_meta * sizeof(int2));
  w.q_items = take(attn::work_list_bytes(n_q_items));  // + the persistent dQ kernel's item counter
  w.kv_items = take(n_kv_items * sizeof(int2));
  w.orders = take((n_orders + 1) / 2 * sizeof(int2));  // the causal kernels' orders (ints), in the same upload
  w.dq_part = take(p.broadcast_q ? size_t(p.To) * H * D * sizeof(float) : 0);
  const bool mx = p.mxfp8_dkv;  // fp32 dK, dV, then square32 quantization
  w.dk_f32 = take(mx ? size_t(p.Tk) * H * D * sizeof(float) : 0);
  w.dv_f32 = take(mx ? size_t(p.Tk) * H * D * sizeof(float) : 0);
  w.dk_sq = take(mx ? size_t(p.Pk / kBlockSize) * H * 4 : 0);
  w.dv_sq = take(mx ? size_t(p.Pk / kBlockSize) * H * 4 : 0);
  const size_t ring_blocks = ring.blocks();  // (0 off ring mode)
  const size_t dump_blocks = ring.n > 0           ? ring_blocks
                             : dump_ds(p) || pds ? size_t(H) * size_t(p.Pq / bwd::kTile) * size_t(dump_k_tiles(p))
                                                 : 0;
  w.ds_dump = take(dump_blocks * (pds ? size_t(bwd::kPdsBlockBytes) : size_t(16384)));
  w.ds_scales = take(dump_ds(p)                      ? dump_blocks * 256
                     : ring.n > 0                      ? 2 * ring_blocks * 4  // ready, free
                     : pds && (bwd_variant() & 4096) ? dump_blocks * 4
                                                       : 0);
  w.total = off;
  return w;
}

// Output padding, work lists and workspace layout of a problem (host metadata only).
struct BwdPlan {
  int64_t lq_pad = 0, Po = 0;  // broadcast_q: each output sequence padded to lq_pad rows
  std::vector<int> lq, lk;
  std::vector<int2> kv_items, q_items;
  // The causal mask: the dK/dV kernel's slots (static_order over kv_ctas CTAs) then the dQ kernel's
  // (dynamic_order), BwdParams::causal_order; kv_slots of them the dK/dV kernel's.
  std::vector<int> orders;
  size_t kv_slots = 0;
  int kv_ctas = 0;
  std::vector<int2> ring_meta;  // the rectangular ring's groups' table and bundles' steps (rect_meta)
  size_t ring_totals = 0;       // where in ring_meta the bundles' steps start (after one entry a group)
  size_t ring_n_items = 0;      // its dK/dV list's length
  RingConfig ring;  // (n 0: no ring)
  bool pds = false;  // the dQ kernel's kDumpPds and the dK/dV kernel's kFromPds forms: the ring, or pds_experiment
  BwdWorkspace w;
};

// The causal kernels' orders (work_list.cuh): items weighed by the tiles they walk plus one (the
// item's loads and epilogue), windows of MXFLASH_BWD_CAUSAL_WINDOW items (read at every call; 0: the
// lists' order as it is), by default 4 x the CTAs: the simulated longest CTA of the dK/dV kernel
// within 1-2% of the mean, where the lists' order gave 8% (llm-long) to 21% (llm) above it, and
// the dQ kernel's within 1% instead of 6-7%.
void causal_orders(const AttentionBwdProblem& p, int sms, BwdPlan* pl) {
  const int64_t H = p.heads;
  const bool br = p.causal == CausalMask::kBottomRight;
  // Item `index` of a list (item_of): its sequence, head and tile, as the kernels decode it.
  auto decode = [&](const std::vector<int2>& list, int64_t index, bool heads_inner_order, bool kv) {
    const int2 e = list[size_t(index / H)];
    const int tiles = ((kv ? pl->lk : pl->lq)[size_t(e.x)] + bwd::kTile - 1) / bwd::kTile;
    const int64_t off = index - int64_t(e.y) * H;
    return std::make_pair(e.x, int(heads_inner_order ? off / H : off % tiles));
  };
  const int64_t n_kv = int64_t(pl->kv_items.size()) * H, n_q = int64_t(pl->q_items.size()) * H;
  pl->kv_ctas = int(std::min<int64_t>(n_kv, sms));
  int64_t window = 4 * int64_t(sms);
  if (const char* e = std::getenv("MXFLASH_BWD_CAUSAL_WINDOW")) window = std::atoll(e);
  const bool kv_inner = heads_inner(H, pl->lq, 4 * kHeadDim + sizeof(float4));  // (the launchers')
  const bool q_inner = heads_inner(H, pl->lk, 3 * kHeadDim);
  // The last orders made on this thread, for the same lengths, heads, mask, SMs and window (a
  // training loop's next step, and the workspace query before each call, which also plans): their
  // making costs the host 0.1-0.2 ms at llm's 2048 items a kernel, the time a step's GPU work
  // hides only where it is long.
  struct Cached {
    std::vector<int> lq, lk, orders;
    int64_t heads = -1, window = 0;
    bool br = false, kv_inner = false, q_inner = false;
    int sms = 0;
    size_t kv_slots = 0;
  };
  thread_local Cached cached;
  if (cached.heads == H && cached.br == br && cached.sms == sms && cached.window == window &&
      cached.kv_inner == kv_inner && cached.q_inner == q_inner && cached.lq == pl->lq && cached.lk == pl->lk) {
    pl->orders = cached.orders;
    pl->kv_slots = cached.kv_slots;
    return;
  }
  std::vector<int64_t> weight(static_cast<size_t>(n_kv));
  for (int64_t i = 0; i < n_kv; ++i) {
    const auto [b, tile] = decode(pl->kv_items, i, kv_inner, true);
    const int lq = pl->lq[size_t(b)], lk = pl->lk[size_t(b)];
    weight[size_t(i)] = bwd::causal_kv_q_tiles(tile, lq, attn::causal_off(br, lq, lk)).y + 1;
  }
  pl->orders = mxflash::attn::static_order(weight, pl->kv_ctas, window);
  pl->kv_slots = pl->orders.size();
  weight.assign(size_t(n_q), 0);
  for (int64_t i = 0; i < n_q; ++i) {
    const auto [b, tile] = decode(pl->q_items, i, q_inner, false);
    const int lq = pl->lq[size_t(b)], lk = pl->lk[size_t(b)];
    const int blk = (lq + bwd::kTile - 1) / bwd::kTile - 1 - tile;  // (item_of<false, true>: last first)
    weight[size_t(i)] = bwd::causal_dq_k_tiles(blk, lq, lk, attn::causal_off(br, lq, lk)) + 1;
  }
  const std::vector<int> q_order = mxflash::attn::dynamic_order(weight, window);
  pl->orders.insert(pl->orders.end(), q_order.begin(), q_order.end());
  cached.lq = pl->lq;
  cached.lk = pl->lk;
  cached.orders = pl->orders;
  cached.heads = H;
  cached.br = br;
  cached.kv_inner = kv_inner;
  cached.q_inner = q_inner;
  cached.sms = sms;
  cached.window = window;
  cached.kv_slots = pl->kv_slots;
}

BwdPlan plan_of(const AttentionBwdProblem& p) {
  BwdPlan pl;
  const std::vector<int32_t>& cq = *p.host_cu_q;
  const std::vector<int32_t>& ck = *p.host_cu_k;
  const int lq0 = cq[1] - cq[0];
  pl.lq_pad = p.broadcast_q ? (int64_t(lq0) + bwd::kTile - 1) / bwd::kTile * bwd::kTile : 0;
  pl.Po = p.broadcast_q ? p.batch * pl.lq_pad : p.Pq;
  std::vector<int> q_tiles(size_t(p.batch)), k_tiles(size_t(p.batch));
  pl.lq.resize(size_t(p.batch));
  pl.lk.resize(size_t(p.batch));
  for (int b = 0; b < p.batch; ++b) {
    const int qb = p.broadcast_q ? 0 : b;
    pl.lq[size_t(b)] = cq[qb + 1] - cq[qb];
    pl.lk[size_t(b)] = ck[b + 1] - ck[b];
    q_tiles[size_t(b)] = (pl.lq[size_t(b)] + bwd::kTile - 1) / bwd::kTile;
    k_tiles[size_t(b)] = (pl.lk[size_t(b)] + bwd::kTile - 1) / bwd::kTile;
  }
  pl.kv_items = attn::work_list(k_tiles, pl.lq);  // dK/dV: K/V tiles
  pl.q_items = attn::work_list(q_tiles, pl.lk);   // dQ: Q tiles
  const int sms = device_sms();  // (the launcher's sm_count: the same device)
  // The causal mask runs on the two kernels (no ring).
  pl.ring = p.causal != CausalMask::kNone ? RingConfig{} : ring_config_of(p, sms);
  if (pl.ring.rect)
    pl.ring_meta = rect_meta(pl.q_items, k_tiles, p.heads, pl.ring.groups, &pl.ring_n_items, &pl.ring_totals);
  pl.pds = pl.ring.n > 0 || pds_experiment(p);
  if (p.causal != CausalMask::kNone) causal_orders(p, sms, &pl);
  pl.w = bwd_layout(p, pl.Po, pl.kv_items.size(), pl.q_items.size(), pl.ring, pl.pds, pl.ring_n_items,
                    pl.ring_meta.size(), pl.orders.size());
  return pl;
}

}  // namespace

namespace {

// The backward's workspace (with_workspace): 256-byte aligned (its regions sit at 256-byte offsets:
// TMA, whole L2 lines).
constexpr WorkspaceRule kBwdWorkspace = {"attention_backward workspace", " (attention_backward_workspace_size)", 256,
                                         "workspace: the CUDA backward needs a 256-byte aligned pointer (cudaMalloc's are)"};

// The backward with as many K/V heads as Q heads (p.kv_heads 0 or p.heads).
Status backward_mha(const AttentionBwdProblem& p, void* workspace, size_t workspace_bytes, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t H = p.heads;
  const BwdPlan plan = plan_of(p);
  const int64_t lq_pad = plan.lq_pad, Po = plan.Po;
  const std::vector<int>& lk = plan.lk;
  const std::vector<int2>& kv_items = plan.kv_items;
  const std::vector<int2>& q_items = plan.q_items;
  const BwdWorkspace& w = plan.w;
  return with_workspace(workspace, workspace_bytes, w.total, stream, kBwdWorkspace, [&](uint8_t* ws) -> Status {
    const int Bq = p.broadcast_q ? 1 : p.batch;
    auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
    // The ring's ready and free epochs (2 x its blocks' words, over the dump scales' region, which
    // the ring does not use): zeroed each call by dO's preprocess. The ring needs Q tiles (ring_config
    // takes it only for uniform Q lengths of 512 and more, rect_config for Q of one length and at least
    // one tile), so that preprocess always runs with it.
    unsigned* const ring_flags = plan.ring.n > 0 ? reinterpret_cast<unsigned*>(ws + w.ds_scales) : nullptr;
    if (ring_flags != nullptr && Po == 0) return Status::Internal("backward: the ring planned for a call without Q tiles");
    // The work lists (and the persistent dQ kernel's item counter after the Q tiles' list) in one
    // upload, first: the kernels after it start as programmatic dependents of their predecessors.
    // The rectangular ring reads no dK/dV kernel list (its own is rect_list_kernel's): that list,
    // last, is uploaded only where a kernel reads it (e.g. cross, 8192 entries: two of the upload's
    // ~32 KB kernels, 24 us under ncu, before the ring could start), and by the two kernels' fallback.
    const bool kv_list = !(plan.ring.n > 0 && plan.ring.rect);
    auto upload_kv_items = [&] {
      return upload_to_device(ws + w.kv_items, kv_items.data(), kv_items.size() * sizeof(int2), stream);
    };
    unsigned* const next_item = reinterpret_cast<unsigned*>(ws + w.q_items + q_items.size() * sizeof(int2));
    {
      std::vector<int2> lists(plan.ring_meta);
      lists.resize((w.q_items - w.ring_meta) / sizeof(int2), int2{0, 0});  // (the alignment's gaps)
      lists.insert(lists.end(), q_items.begin(), q_items.end());
      lists.push_back(int2{0, 0});  // the item counter, zeroed
      if (kv_list && !kv_items.empty()) {
        lists.resize((w.kv_items - w.ring_meta) / sizeof(int2), int2{0, 0});
        lists.insert(lists.end(), kv_items.begin(), kv_items.end());
      }
      if (!plan.orders.empty()) {  // (the causal mask: never the ring, so after the dK/dV list)
        lists.resize((w.orders - w.ring_meta) / sizeof(int2), int2{0, 0});
        const size_t at = lists.size();
        lists.resize(at + (plan.orders.size() + 1) / 2, int2{-1, -1});
        std::memcpy(lists.data() + at, plan.orders.data(), plan.orders.size() * sizeof(int));
      }
      MXFLASH_RETURN_IF_ERROR(upload_to_device(ws + w.ring_meta, lists.data(), lists.size() * sizeof(int2), stream));
    }
    const bool pdl = pdl_after_setup();
    if (plan.ring.rect && plan.ring_n_items > 0) {  // the rectangular ring's dK/dV list, from that table
      const size_t groups = plan.ring_totals;  // the table's entries before the totals: one a group
      MXFLASH_RETURN_IF_ERROR(cuda_error(
          launch_programmatic(pdl, bwd::rect_list_kernel, dim3(unsigned(groups)), dim3(128),
                              bwd::rect_list_smem(plan.ring.groups), stream,
                              reinterpret_cast<const int2*>(ws + w.ring_meta),
                              reinterpret_cast<const int*>(ws + w.ring_meta + groups * sizeof(int2)),
                              plan.ring.groups, p.cu_k, int(H), reinterpret_cast<int2*>(ws + w.ring_items)),
          "backward: rect_list_kernel launch"));
    }
    // Operands re-expressed (attention_fwd_prepare.cuh): Q per row, K and V per 128-key tile, Q and
    // K along tokens per (sequence, channel).
    bool prepare = p.exec == nullptr;  // exec operands: written by the quantizer already
#if MXFLASH_FWD_EXPERIMENTS
    static int calls = 0;  // MXFLASH_BWD_VARIANT bit 18 (a diagnostic): the first call prepares
    if ((bwd_variant() & 262144) != 0 && calls++ > 0) prepare = false;
#endif
    if (prepare && p.Pq > 0) {
      attn::prepare_rows_kernel<true><<<dim3(unsigned(p.Pq / bwd::kTile), unsigned(H)), attn::kRowThreads, 0, stream>>>(
          attn::MxRowSource{p.q.payload, p.q.scales, p.q.scale_layout, H, p.Pq}, p.cu_q, p.cu_q_sf, Bq, p.Pq, ws + w.q,
          f32(w.q_scale));
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: prepare Q launch"));
    }
    if (prepare && p.Pk > 0) {
      for (const auto& [op, dst, sc] : {std::tuple{&p.k, w.k, w.k_scale}, std::tuple{&p.v, w.v, w.v_scale}}) {
        attn::prepare_rows_kernel<false><<<dim3(unsigned(p.Pk / bwd::kTile), unsigned(H)), attn::kRowThreads, 0, stream>>>(
            attn::MxRowSource{op->payload, op->scales, op->scale_layout, H, p.Pk}, p.cu_k, p.cu_k_sf, p.batch, p.Pk,
            ws + dst, f32(sc));
        MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: prepare K/V launch"));
      }
    }
    struct Tokens {
      const MxOperand* op;
      const int32_t *cu, *cu_sf;
      int batch;
      int64_t P;
      size_t out, byte, scale;
    };
    for (const Tokens& t : {Tokens{&p.q_seq, p.cu_q, p.cu_q_sf, Bq, p.Pq, w.qt, w.qt_byte, w.qt_scale},
                            Tokens{&p.k_seq, p.cu_k, p.cu_k_sf, p.batch, p.Pk, w.kt, w.kt_byte, w.kt_scale}}) {
      if (!prepare) break;  // (both or neither)
      attn::prepare_v_scale_kernel<<<unsigned(int64_t(t.batch) * H), attn::kVScaleSlices * kHeadDim, 0, stream>>>(
          t.op->scales, t.op->scale_layout, t.cu, t.cu_sf, H, t.P, ws + t.byte, f32(t.scale));
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: prepare channel scales launch"));
      if (t.P > 0) {
        attn::prepare_v_kernel<<<dim3(unsigned(t.P / bwd::kTile), unsigned(H)), attn::kVThreads, 0, stream>>>(
            t.op->payload, t.op->payload_layout, t.op->scales, t.op->scale_layout, t.cu, t.cu_sf, t.batch, H, t.P,
            ws + t.byte, ws + t.out);
        MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: prepare tokens-contiguous launch"));
      }
    }
    if (Po > 0) {
      bwd::DoutPrep d;
      d.out = static_cast<const __nv_bfloat16*>(p.out);
      d.dout = static_cast<const __nv_bfloat16*>(p.dout);
      d.lse = p.lse;
      d.q_scale = p.exec ? p.exec->q_scale : f32(w.q_scale);
      d.cu_q = p.cu_q;
      d.cu_q_sf = p.cu_q_sf;
      d.cu_k = p.cu_k;
      d.causal = p.causal;
      d.out_seqs = p.batch;
      d.broadcast_q = p.broadcast_q;
      d.lq_pad = lq_pad;
      d.H = H;
      d.Pq = p.Pq;
      d.Po = Po;
      d.To = p.To;
      d.scale_log2 = p.softmax_scale * attn::kLog2e;
      d.do_rows = ws + w.dout;
      d.do_t = ws + w.dot;
      d.do_t_scale = f32(w.dot_scale);
      d.info = reinterpret_cast<float4*>(ws + w.info);
      d.zero = ring_flags;  // the ring's epochs, from 0 each call
      d.zero_words = ring_flags != nullptr ? int64_t(2 * plan.ring.blocks()) : 0;
      MXFLASH_RETURN_IF_ERROR(cuda_error(launch_programmatic(pdl, bwd::prepare_dout_kernel,
                                                             dim3(unsigned(Po / bwd::kTile), unsigned(H)),
                                                             dim3(bwd::kPrepThreads), 0, stream, d),
                                         "backward: prepare dO launch"));
    }
    int sms = 0;  // one CTA per SM for the persistent kernels: shared memory and registers allow no second
    MXFLASH_RETURN_IF_ERROR(sm_count(&sms));
    // Maps need at least one tile of rows even when a side is empty (then unused).
    const uint64_t q_rows = uint64_t(std::max<int64_t>(H * p.Pq, bwd::kTile));
    const uint64_t k_rows = uint64_t(std::max<int64_t>(H * p.Pk, bwd::kTile));
    const uint64_t o_rows = uint64_t(std::max<int64_t>(H * Po, bwd::kTile));
    CUtensorMap tm_q, tm_k, tm_v, tm_do, tm_qt, tm_kt, tm_dot, tm_dk{}, tm_dv{};
    // The operands: the caller's exec operands, or the workspace the prepare passes wrote (whose Qᵀ',
    // Kᵀ' scales are per (sequence, channel), not per tile: BwdParams::qt_scale, kt_scale below).
    const BwdExecOperands in = p.exec ? *p.exec
                                      : BwdExecOperands{ws + w.q,       ws + w.k,       ws + w.v,       ws + w.qt,
                                                        ws + w.kt,      f32(w.q_scale), f32(w.k_scale), f32(w.v_scale),
                                                        nullptr,        nullptr};
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_q, in.q, kHeadDim, q_rows));
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_k, in.k, kHeadDim, k_rows));
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_v, in.v, kHeadDim, k_rows));
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_do, ws + w.dout, kHeadDim, o_rows));
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_qt, in.qt, uint64_t(std::max<int64_t>(p.Pq, bwd::kTile)), H * kHeadDim));
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_kt, in.kt, uint64_t(std::max<int64_t>(p.Pk, bwd::kTile)), H * kHeadDim));
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_dot, ws + w.dot, uint64_t(std::max<int64_t>(Po, bwd::kTile)), H * kHeadDim));
    bwd::BwdParams bp{};
    bp.cu_q = p.cu_q;
    bp.cu_q_sf = p.cu_q_sf;
    bp.cu_k = p.cu_k;
    bp.cu_k_sf = p.cu_k_sf;
    bp.heads = p.heads;
    bp.Pq = p.Pq;
    bp.Pk = p.Pk;
    bp.Po = Po;
    bp.broadcast_q = p.broadcast_q;
    bp.causal_br = p.causal == CausalMask::kBottomRight;
    const bool causal = p.causal != CausalMask::kNone;
    bp.lq_pad = lq_pad;
    bp.k_scale = in.k_scale;
    bp.v_scale = in.v_scale;
    // Qᵀ', Kᵀ' scales: per (sequence, channel) in the epilogues, or per tile in the promotions of the
    // kernels' kTileScales forms (exec operands).
    bp.qt_scale = p.exec ? nullptr : f32(w.qt_scale);
    bp.kt_scale = p.exec ? nullptr : f32(w.kt_scale);
    bp.qt_tile_scale = in.qt_scale;
    bp.kt_tile_scale = in.kt_scale;
    bp.info = reinterpret_cast<const float4*>(ws + w.info);
    bp.do_t_scale = f32(w.dot_scale);
    bp.softmax_scale = p.softmax_scale;
    bp.dq = static_cast<__nv_bfloat16*>(p.dq);
    bp.dq_part = f32(w.dq_part);
    bp.dk = static_cast<__nv_bfloat16*>(p.dk);
    bp.dv = static_cast<__nv_bfloat16*>(p.dv);
    const bool mx = p.mxfp8_dkv;
    bp.ds_dump = ws + w.ds_dump;
    bp.ds_scales = ws + w.ds_scales;
    bool pds = plan.pds;  // (false again where the ring's launch falls back)
    bp.dump_kt = dump_ds(p) || pds ? dump_k_tiles(p) : 0;
    bp.dump_wrap_mask = 0;
    const RingConfig& ring = plan.ring;
    bp.ring_n = ring.n;
    bp.pds_flags = pds && (bwd_variant() & 4096) && bp.ring_n == 0 ? reinterpret_cast<unsigned*>(ws + w.ds_scales)
                                                                    : nullptr;
    bp.ring_groups = ring.groups;
    bp.ring_steps = ring.steps;
    bp.ring_poll_ns = 0;
#if MXFLASH_FWD_EXPERIMENTS
    if (const char* e = std::getenv("MXFLASH_BWD_RING_POLL")) bp.ring_poll_ns = std::max(0, std::atoi(e));
#endif
    if (bp.ring_n > 0) {  // the ready and free epochs, zeroed by dO's preprocess
      bp.ring_ready = ring_flags;
      bp.ring_free = ring_flags + ring.blocks();
    }
#if MXFLASH_FWD_EXPERIMENTS
    if (const char* e = std::getenv("MXFLASH_BWD_DUMP_WRAP")) {
      const int64_t n = std::atoll(e);
      if (n > 0 && (n & (n - 1)) == 0) bp.dump_wrap_mask = n - 1;
    }
#endif
    bp.dk_f32 = mx ? f32(w.dk_f32) : nullptr;
    bp.dv_f32 = mx ? f32(w.dv_f32) : nullptr;
#if MXFLASH_FWD_EXPERIMENTS
    if (pds && bp.ring_n == 0 && !q_items.empty()) {  // the dQ kernel first, storing P and dS for the dK/dV kernel
      bp.items = reinterpret_cast<const int2*>(ws + w.q_items);
      bp.heads_inner = heads_inner(H, plan.lk, 3 * kHeadDim);
      auto kernel = ds_only() ? bwd::attention_bwd_dq_kernel<true, bwd::kDumpPds | bwd::kDsOnly>
                              : bwd::attention_bwd_dq_kernel<true, bwd::kDumpPds>;
      switch (dq_dump_diag()) {  // (dK, dV wrong)
        case 1: kernel = bwd::attention_bwd_dq_kernel<true, bwd::kDumpPds | bwd::kDumpNoStore>; break;
        case 2: kernel = bwd::attention_bwd_dq_kernel<true, bwd::kDumpPds | bwd::kDumpNoBar>; break;
        case 3: kernel = bwd::attention_bwd_dq_kernel<true, bwd::kDumpPds | bwd::kDumpNoStore | bwd::kDumpNoBar>; break;
        default: break;
      }
      MXFLASH_RETURN_IF_ERROR(cuda_error(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bwd::kQSmemBytes)),
          "cudaFuncSetAttribute(attention_bwd_dq_kernel)"));
      kernel<<<unsigned(int64_t(q_items.size()) * H), bwd::kThreads, bwd::kQSmemBytes, stream>>>(tm_q, tm_k, tm_v,
                                                                                              tm_do, tm_kt, bp);
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "attention_bwd_dq_kernel launch"));
    }
#endif
    if (!kv_items.empty()) {
      bp.items = reinterpret_cast<const int2*>(ws + w.kv_items);
      bp.heads_inner = heads_inner(H, plan.lq, 4 * kHeadDim + sizeof(float4));  // Q, Qᵀ, dO, dOᵀ, info
      const int64_t n_items = int64_t(kv_items.size()) * H;
      bp.num_items = int(n_items);
      if (causal) {  // the slots of its order (causal_orders), over plan.kv_ctas CTAs
        bp.causal_order = reinterpret_cast<const int*>(ws + w.orders);
        bp.num_items = int(plan.kv_slots);
      }
      const int variant = bwd_variant();
      const bool persistent = (variant & 1) == 0 || p.exec != nullptr || causal;  // (exec: the persistent kernel, below)
      auto kernel = persistent ? bwd::attention_bwd_dkdv_kernel<true> : bwd::attention_bwd_dkdv_kernel<false>;
      // dK, dV through the staging tiles (bf16 output, TMA's 16-byte alignment; the API asks 4).
      bp.staged_dkdv = persistent && !mx && p.Tk > 0 && is_aligned(p.dk, 16) && is_aligned(p.dv, 16);
      size_t smem = bp.staged_dkdv ? bwd::kKvSmemBytesStaged : bwd::kKvSmemBytes;
      if (bp.staged_dkdv) {
        MXFLASH_RETURN_IF_ERROR(make_bf16_rows_map(&tm_dk, p.dk, uint64_t(p.Tk), uint64_t(H)));
        MXFLASH_RETURN_IF_ERROR(make_bf16_rows_map(&tm_dv, p.dv, uint64_t(p.Tk), uint64_t(H)));
      }
#if MXFLASH_FWD_EXPERIMENTS
      if ((variant & 2) != 0)
        kernel = persistent ? bwd::attention_bwd_dkdv_kernel<true, true> : bwd::attention_bwd_dkdv_kernel<false, true>;
      // Bit 10: the default kernel with the consumers' clock trace (kTrace, trace.cuh).
      if ((variant & 1024) != 0 && (variant & 3) == 0) kernel = bwd::attention_bwd_dkdv_kernel<true, false, true>;
      // Bit 10 with bit 29: the trace of kDiag 32 (the math's packing by byte permutes).
      if ((variant & 1024) != 0 && (variant & 3) == 0 && dkdv_diag(variant) == 32)
        kernel = bwd::attention_bwd_dkdv_kernel<true, false, true, false, 32>;
#endif
      // Exec operands: the default (persistent) kernel's kTileScales form, whatever the variant.
      if (p.exec) kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true>;
#if MXFLASH_FWD_EXPERIMENTS
      if (pds && bp.ring_n == 0)
        kernel = ds_only() ? bwd::attention_bwd_dkdv_kernel<true, false, false, true, bwd::kFromPds | bwd::kDsOnly>
                           : bwd::attention_bwd_dkdv_kernel<true, false, false, true, bwd::kFromPds>;
#endif
#if MXFLASH_FWD_EXPERIMENTS
      // Bits 20-23 (exec operands): kDiag, parts of the dK/dV consumers' work left out (garbage dK, dV).
      if (p.exec) switch (dkdv_diag(variant)) {
          case 1: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 1>; break;
          case 3: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 3>; break;
          case 2: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 2>; break;
          case 4: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 4>; break;
          case 8: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 8>; break;
          case 12: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 12>; break;
          case 5: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 5>; break;
          case 10: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 10>; break;
          case 16: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 16>; break;
          case 32: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 32>; break;
          case 48: kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 48>; break;
          case 64:  // dS dumped for attention_bwd_dq_dump_kernel (where dump_ds: else the default)
            if (dump_ds(p)) kernel = bwd::attention_bwd_dkdv_kernel<true, false, false, true, 64>;
            break;
          default: break;
        }
#endif
      if (causal)  // the persistent kernel's causal form (either operand form)
        kernel = p.exec ? bwd::attention_bwd_dkdv_kernel<true, false, false, true, bwd::kCausal>
                        : bwd::attention_bwd_dkdv_kernel<true, false, false, false, bwd::kCausal>;
      bool ring_done = false;
      if (bp.ring_n > 0) {
        // The ring: one cooperative launch of both roles (every CTA resident at once, or the launch
        // fails), the dK/dV role on ring.ctas CTAs, the dQ role on the other SMs; where the device
        // cannot hold the grid at once (e.g. an MPS share of its SMs), the two kernels below instead.
        bwd::BwdParams pq = bp;
        pq.items = reinterpret_cast<const int2*>(ws + w.q_items);
        pq.num_items = int(int64_t(q_items.size()) * H);
        pq.heads_inner = bp.heads_inner = false;  // a group's tiles in a row, both roles
        const size_t ring_smem = std::max(smem, bwd::kQSmemBytes);
        const auto rk = ring_kernel(ring.rect);
        bwd::BwdParams pk = bp;  // the dK/dV role's list: kRect's own
        if (ring.rect) {
          pk.items = reinterpret_cast<const int2*>(ws + w.ring_items);
          pk.num_items = int(plan.ring_n_items);
          pk.ring_group = reinterpret_cast<const int2*>(ws + w.ring_meta);
        }
        MXFLASH_RETURN_IF_ERROR(
            cuda_error(cudaFuncSetAttribute(rk, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ring_smem)),
                       "cudaFuncSetAttribute(attention_bwd_ring_kernel)"));
        // The dQ role's CTAs: the SMs the dK/dV role leaves, or MXFLASH_BWD_RING_DQ_CTAS (at least n, so
        // that a group's Q-tile units run at once; more than the device holds take the fallback: the
        // tests use it).
        int64_t dq_ctas = ring.rect ? int64_t(ring.groups) * ring.n : std::min<int64_t>(sms - ring.ctas, pq.num_items);
        if (const char* e = std::getenv("MXFLASH_BWD_RING_DQ_CTAS")) {
          const int64_t v = std::atoll(e);
          if (v >= ring.n) dq_ctas = ring.rect ? std::max(dq_ctas, v) : v;
        }
        int per_sm = 0;
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rk, bwd::kThreads, ring_smem), "ring occupancy"));
        cudaError_t e = cudaErrorCooperativeLaunchTooLarge;
        bp.ring_ctas = pk.ring_ctas = ring.ctas;
        if (ring.ctas + dq_ctas <= int64_t(per_sm) * sms) {
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(unsigned(ring.ctas + dq_ctas));
          cfg.blockDim = dim3(bwd::kThreads);
          cfg.dynamicSmemBytes = ring_smem;
          cfg.stream = stream;
          cudaLaunchAttribute attr[2];
          attr[0].id = cudaLaunchAttributeCooperative;
          attr[0].val.cooperative = 1;
          attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // (the kernel's first wait)
          attr[1].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = attr;
          cfg.numAttrs = pdl ? 2 : 1;
          e = cudaLaunchKernelEx(&cfg, rk, tm_q, tm_k, tm_v, tm_do, tm_qt, tm_dot, tm_dk, tm_dv, tm_kt, pk, pq);
          if (e != cudaSuccess && e != cudaErrorCooperativeLaunchTooLarge && cfg.numAttrs == 2) {
            (void)cudaGetLastError();  // a driver without the two together: an ordinary cooperative launch
            cfg.numAttrs = 1;
            e = cudaLaunchKernelEx(&cfg, rk, tm_q, tm_k, tm_v, tm_do, tm_qt, tm_dot, tm_dk, tm_dv, tm_kt, pk, pq);
          }
          if (e == cudaErrorCooperativeLaunchTooLarge) (void)cudaGetLastError();  // (clears it)
        }
        if (e == cudaErrorCooperativeLaunchTooLarge) {  // the two kernels instead
          if (!kv_list && !kv_items.empty()) MXFLASH_RETURN_IF_ERROR(upload_kv_items());
          bp.ring_n = 0;
          pds = false;
          bp.heads_inner = heads_inner(H, plan.lq, 4 * kHeadDim + sizeof(float4));
        } else {
          MXFLASH_RETURN_IF_ERROR(cuda_error(e, "attention_bwd_ring_kernel launch"));
          ring_done = true;
        }
      }
      if (!ring_done) {
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
            "cudaFuncSetAttribute(attention_bwd_dkdv_kernel)"));
        const int64_t grid = causal ? plan.kv_ctas : persistent ? std::min<int64_t>(n_items, sms) : n_items;
        MXFLASH_RETURN_IF_ERROR(cuda_error(launch_programmatic(pdl, kernel, dim3(unsigned(grid)), dim3(bwd::kThreads),
                                                               smem, stream, tm_q, tm_k, tm_v, tm_do, tm_qt, tm_dot,
                                                               tm_dk, tm_dv, bp),
                                           "attention_bwd_dkdv_kernel launch"));
      }
#if MXFLASH_FWD_EXPERIMENTS
      if ((variant & 1024) != 0) {
        static int calls = 0;  // the dK/dV consumers' timeline (MXFLASH_BWD_TRACE)
        MXFLASH_RETURN_IF_ERROR(attn::dump_trace_when_due(calls, 10, "MXFLASH_BWD_TRACE", stream));
      }
#endif
    }
    if (!q_items.empty() && dump_ds(p)) {
#if MXFLASH_FWD_EXPERIMENTS
      bp.items = reinterpret_cast<const int2*>(ws + w.q_items);
      bp.heads_inner = heads_inner(H, plan.lk, kHeadDim);  // Kᵀ' (the dump is read once)
      auto kernel = bwd::attention_bwd_dq_dump_kernel<true>;
      MXFLASH_RETURN_IF_ERROR(cuda_error(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bwd::kDumpSmemBytes)),
          "cudaFuncSetAttribute(attention_bwd_dq_dump_kernel)"));
      kernel<<<unsigned(int64_t(q_items.size()) * H), bwd::kThreads, bwd::kDumpSmemBytes, stream>>>(tm_kt, bp);
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "attention_bwd_dq_dump_kernel launch"));
#endif
    } else if (!q_items.empty() && !pds) {
      bp.items = reinterpret_cast<const int2*>(ws + w.q_items);
      bp.heads_inner = heads_inner(H, plan.lk, 3 * kHeadDim);  // K, V, Kᵀ
      const int64_t n_q = int64_t(q_items.size()) * H;
      // Programmatic dependent of the dK/dV kernel (independent work: see the dQ kernel's epilogue).
      // (Only behind that kernel, whose CTAs trigger after their wait for dO's preprocess.)
      const bool programmatic = (bwd_variant() & 131072) == 0 && !kv_items.empty();
      // The causal mask: the persistent kernel's causal form, at least 2 CTAs where
      // MXFLASH_BWD_DQ_PERSISTENT asks for none.
      int dq_ctas = dq_persistent_ctas(sms, plan.lk);
      if (causal && dq_ctas == 0) dq_ctas = sms;
      if (const int ctas = dq_ctas) {
        bp.num_items = int(n_q);
        // (the causal mask: its order after the dK/dV kernel's, a slot an item)
        if (causal) bp.causal_order = reinterpret_cast<const int*>(ws + w.orders) + plan.kv_slots;
        // dQ (bf16, 16-byte aligned: TMA) staged in the item buffers (consume_dq).
        bp.staged_dq = !p.broadcast_q && p.Tq > 0 && is_aligned(p.dq, 16);
        CUtensorMap tm_dq{};
        if (bp.staged_dq) MXFLASH_RETURN_IF_ERROR(make_bf16_rows_map(&tm_dq, p.dq, uint64_t(p.Tq), uint64_t(H)));
        auto kernel = p.exec ? bwd::attention_bwd_dq_kernel_p<true> : bwd::attention_bwd_dq_kernel_p<false>;
        if (causal)
          kernel = p.exec ? bwd::attention_bwd_dq_kernel_p<true, true> : bwd::attention_bwd_dq_kernel_p<false, true>;
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bwd::kQSmemBytesP)),
            "cudaFuncSetAttribute(attention_bwd_dq_kernel_p)"));
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            launch_programmatic(programmatic, kernel, dim3(unsigned(std::min<int64_t>(n_q, ctas))), dim3(bwd::kThreads),
                                bwd::kQSmemBytesP, stream, tm_q, tm_k, tm_v, tm_do, tm_kt, bp, next_item, tm_dq),
            "attention_bwd_dq_kernel_p launch"));
      } else {
        auto kernel = p.exec ? bwd::attention_bwd_dq_kernel<true> : bwd::attention_bwd_dq_kernel<false>;
#if MXFLASH_FWD_EXPERIMENTS
        // Bits 24-27 (exec operands): consume_dq's kDiag (garbage dQ).
        if (p.exec) switch ((bwd_variant() >> 24) & 15) {
            case 1: kernel = bwd::attention_bwd_dq_kernel<true, 1>; break;
            case 2: kernel = bwd::attention_bwd_dq_kernel<true, 2>; break;
            case 8: kernel = bwd::attention_bwd_dq_kernel<true, 8>; break;
            case 5: kernel = bwd::attention_bwd_dq_kernel<true, 5>; break;
            case 10: kernel = bwd::attention_bwd_dq_kernel<true, 10>; break;
            default: break;
          }
#endif
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bwd::kQSmemBytes)),
            "cudaFuncSetAttribute(attention_bwd_dq_kernel)"));
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            launch_programmatic(programmatic, kernel, dim3(unsigned(n_q)), dim3(bwd::kThreads), bwd::kQSmemBytes,
                                stream, tm_q, tm_k, tm_v, tm_do, tm_kt, bp),
            "attention_bwd_dq_kernel launch"));
      }
    }
    if (p.broadcast_q && p.Tq > 0) {
      const int64_t n = p.Tq * H * kHeadDim;
      const unsigned grid = unsigned(std::min<int64_t>((n + 255) / 256, 8192));
      bwd::sum_dq_kernel<<<grid, 256, 0, stream>>>(bp.dq_part, p.batch, n, 1.f, bp.dq);
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: dQ batch sum launch"));
    }
    if (mx && p.Tk > 0) {
      // dK, dV in 32x32 blocks from each K sequence start (the library quantizer, RCEIL), then each
      // token row's block scales.
      detail::QuantizeProblem qp;
      qp.dims.batch = p.batch;
      qp.dims.T = p.Tk;
      qp.dims.P = p.Pk;
      qp.dims.H = H;
      qp.dims.max_seqlen = *std::max_element(lk.begin(), lk.end());
      qp.dims.cu_seqlens = p.cu_k;
      qp.dims.cu_seqlens_sf = p.cu_k_sf;
      qp.x_bf16 = false;
      qp.tok_orientation = Orientation::kSquare32;
      for (const auto& [src, payload, sq, scales] :
           {std::tuple{w.dk_f32, p.dk, w.dk_sq, p.dk_scales}, std::tuple{w.dv_f32, p.dv, w.dv_sq, p.dv_scales}}) {
        qp.x = ws + src;
        qp.tok_payload = static_cast<uint8_t*>(payload);
        qp.tok_scales = ws + sq;
        MXFLASH_RETURN_IF_ERROR(cuda::quantize(qp, stream));
        const unsigned grid = unsigned(std::min<int64_t>((p.Tk * H + 255) / 256, 4096));
        bwd::token_row_scales_kernel<<<grid, 256, 0, stream>>>(ws + sq, p.cu_k, p.cu_k_sf, p.batch, p.Tk, H, scales);
        MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: dK/dV scale rows launch"));
      }
    }
    return Status::Ok();
  });
}

// ------------------------------------------------------------------ grouped-query attention
// Q head h attends K/V head h / g (g = heads / kv_heads). The backward runs the kernels above on the
// K-side operands repeated per Q head in the workspace (gqa_expand_kernel: K', V rows, Kᵀ' and their
// scales, ~3 bytes per element of the repeated K/V, for the call only), their dK, dV per Q head
// (bf16, (Tk, H, 128)) into the workspace, then sums each group's g heads in fp32, in head order, and
// rounds once to bf16 (gqa_sum_kernel): the bytes of the same backward on repeated inputs followed by
// that sum.

// One tensor of per-head slabs: dst slab h = src slab h / group.
struct GqaCopy {
  const uint8_t* src;
  uint8_t* dst;
  int64_t slab;  // bytes per head (a multiple of 4)
};
struct GqaCopies {
  GqaCopy c[6];
  int group;
};

__global__ void __launch_bounds__(256) gqa_expand_kernel(const GqaCopies a) {
  const GqaCopy c = a.c[blockIdx.y];
  const int h = int(blockIdx.z);
  const uint8_t* src = c.src + int64_t(h / a.group) * c.slab;
  uint8_t* dst = c.dst + int64_t(h) * c.slab;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (c.slab % 16 == 0) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < c.slab / 16; i += stride)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < c.slab / 4; i += stride)
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
  }
}

// out (T, H / group, 128) = the sum over each group's heads of in (T, H, 128), bf16, fp32 sums in
// head order; blockIdx.y: dK (0) or dV (1). Eight channels a thread; `aligned`: dk and dv 16-byte
// aligned (else stored a value at a time).
__global__ void __launch_bounds__(256) gqa_sum_kernel(const __nv_bfloat16* dk_in, const __nv_bfloat16* dv_in,
                                                      __nv_bfloat16* dk, __nv_bfloat16* dv, int64_t T, int kv_heads,
                                                      int group, bool aligned) {
  const __nv_bfloat16* in = blockIdx.y == 0 ? dk_in : dv_in;
  __nv_bfloat16* out = blockIdx.y == 0 ? dk : dv;
  const int64_t n = T * kv_heads * (kHeadDim / 8);  // 8-channel chunks of out
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (kHeadDim / 8), c = i % (kHeadDim / 8);  // row: t * kv_heads + kvh
    const uint4* src = reinterpret_cast<const uint4*>(in + row * group * kHeadDim) + c;
    float acc[8] = {};
    for (int r = 0; r < group; ++r) {
      const uint4 w = src[r * (kHeadDim / 8)];
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(b[k]);
        acc[2 * k] += f.x;
        acc[2 * k + 1] += f.y;
      }
    }
    if (aligned) {
      uint4 o;
      __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int k = 0; k < 4; ++k) ob[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
      reinterpret_cast<uint4*>(out)[i] = o;
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) out[8 * i + k] = __float2bfloat16_rn(acc[k]);
    }
  }
}

// The workspace of a grouped-query call: the repeated operands and the per-head dK, dV, then the
// backward's own (`inner`, 256-byte aligned).
struct GqaLayout {
  size_t k, v, kt, k_scale, v_scale, kt_scale, dk, dv, inner;
};
GqaLayout gqa_layout(const AttentionBwdProblem& p) {
  GqaLayout g;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  const size_t H = size_t(p.heads), D = kHeadDim, tiles = size_t(p.Pk / bwd::kTile);
  g.k = take(H * size_t(p.Pk) * D);
  g.v = take(H * size_t(p.Pk) * D);
  g.kt = take(H * size_t(p.Pk) * D);
  g.k_scale = take(H * tiles * sizeof(float));
  g.v_scale = take(H * tiles * sizeof(float));
  g.kt_scale = take(H * tiles * sizeof(float));
  g.dk = take(size_t(p.Tk) * H * D * sizeof(__nv_bfloat16));
  g.dv = take(size_t(p.Tk) * H * D * sizeof(__nv_bfloat16));
  g.inner = off;
  return g;
}

// p with every K/V head its own (the repeated operands' problem; its exec and dk, dv set by the caller).
AttentionBwdProblem per_q_head(const AttentionBwdProblem& p) {
  AttentionBwdProblem q = p;
  q.kv_heads = 0;
  return q;
}

bool grouped(const AttentionBwdProblem& p) { return kv_heads_of(p) != p.heads; }

}  // namespace

size_t attention_bwd_workspace_bytes(const AttentionBwdProblem& p) {
  if (!grouped(p)) return plan_of(p).w.total;
  return gqa_layout(p).inner + plan_of(per_q_head(p)).w.total;
}

Status attention_backward(const AttentionBwdProblem& p, void* workspace, size_t workspace_bytes, void* stream_ptr) {
  if (!grouped(p)) return backward_mha(p, workspace, workspace_bytes, stream_ptr);
  const int64_t H = p.heads, Hkv = kv_heads_of(p);
  if (p.exec == nullptr || Hkv < 1 || H % Hkv != 0 || p.mxfp8_dkv)
    return Status::Internal("backward: grouped-query attention takes operands in the execution layout and bf16 dK, dV");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const GqaLayout g = gqa_layout(p);
  const size_t total = attention_bwd_workspace_bytes(p);
  return with_workspace(workspace, workspace_bytes, total, stream, kBwdWorkspace, [&](uint8_t* ws) -> Status {
    const BwdExecOperands& e = *p.exec;
    BwdExecOperands x = e;  // Q-side operands as they are, K-side ones repeated
    x.k = ws + g.k;
    x.v = ws + g.v;
    x.kt = ws + g.kt;
    x.k_scale = reinterpret_cast<float*>(ws + g.k_scale);
    x.v_scale = reinterpret_cast<float*>(ws + g.v_scale);
    x.kt_scale = reinterpret_cast<float*>(ws + g.kt_scale);
    const int64_t slab = p.Pk * kHeadDim, tiles = p.Pk / bwd::kTile;
    if (slab > 0) {
      GqaCopies c;
      c.group = int(H / Hkv);
      c.c[0] = {e.k, x.k, slab};
      c.c[1] = {e.v, x.v, slab};
      c.c[2] = {e.kt, x.kt, slab};
      c.c[3] = {reinterpret_cast<const uint8_t*>(e.k_scale), reinterpret_cast<uint8_t*>(x.k_scale), tiles * 4};
      c.c[4] = {reinterpret_cast<const uint8_t*>(e.v_scale), reinterpret_cast<uint8_t*>(x.v_scale), tiles * 4};
      c.c[5] = {reinterpret_cast<const uint8_t*>(e.kt_scale), reinterpret_cast<uint8_t*>(x.kt_scale), tiles * 4};
      const unsigned blocks = unsigned(std::min<int64_t>((slab / 16 + 255) / 256, 64));
      gqa_expand_kernel<<<dim3(blocks, 6, unsigned(H)), 256, 0, stream>>>(c);
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: grouped-query K/V repeat launch"));
    }
    AttentionBwdProblem q = per_q_head(p);
    q.exec = &x;
    q.dk = ws + g.dk;
    q.dv = ws + g.dv;
    MXFLASH_RETURN_IF_ERROR(backward_mha(q, ws + g.inner, total - g.inner, stream));
    const int64_t n = p.Tk * Hkv * (kHeadDim / 8);
    if (n > 0) {
      const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 4096));
      gqa_sum_kernel<<<dim3(blocks, 2), 256, 0, stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(ws + g.dk), reinterpret_cast<const __nv_bfloat16*>(ws + g.dv),
          static_cast<__nv_bfloat16*>(p.dk), static_cast<__nv_bfloat16*>(p.dv), p.Tk, int(Hkv), int(H / Hkv),
          is_aligned(p.dk, 16) && is_aligned(p.dv, 16));
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "backward: grouped-query dK/dV sum launch"));
    }
    return Status::Ok();
  });
}

}  // namespace mxflash::cuda
