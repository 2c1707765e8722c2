// MXFP8 attention forward, sm_90a: FP8 wgmma, TMA loads, one producer warpgroup and two consumer
// warpgroups of 64 Q rows each, K/V tiles of 128 keys in a 3-stage pipeline, P in registers.
//
// Scales never enter the wgmma loops (attention_fwd_prepare.cuh): the S accumulator of a tile is
// multiplied by (Q row scale * K tile scale * softmax_scale * log2 e) inside the softmax FFMA; P is
// stored as e4m3(256 p) (the constant 2^-8 MX scale of the Blackwell kernels); V's per-channel
// scale and the 1/256 are applied in the epilogue. P.V of each tile accumulates in fresh registers
// and is promoted into the fp32 output accumulator once per tile (two-level accumulation: Hopper's
// FP8 tensor-core accumulator keeps ~22 mantissa bits).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/attention/attention_fwd.h"
#include "cuda/attention/attention_fwd_prepare.cuh"
#include "cuda/attention/attention_sm90_common.cuh"
#include "cuda/attention/tma_map.h"
#include "cuda/attention/trace.cuh"
#include "cuda/attention/work_list.cuh"
#include "cuda/common/launch_utils.cuh"
#include "cuda/common/sm90_primitives.cuh"
#include "cuda/common/upload.h"
#include "cuda/common/workspace.h"

namespace mxflash::cuda {
namespace attn {

inline constexpr int kStages = 4;  // K+V tiles, 32 KB a stage
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);
inline constexpr int kRowsPerConsumer = 64;  // wgmma M
inline constexpr int kTileBytes = kTile * kHeadDim;
inline constexpr int kProducerRegs = 24;
inline constexpr int kConsumerRegs = 240;
inline constexpr float kPScaleLog2 = 8.f;  // P stored as e4m3(256 p)
// Kernel variants. Bit 0: tree reductions for the row max and row sum (5 dependent steps instead
// of 32). Bits 1-2, diagnostics that compute garbage, built only with -DMXFLASH_FWD_EXPERIMENTS=1
// and picked with the environment variable MXFLASH_FWD_VARIANT (for A/B runs of one binary): 1 no
// softmax (P constant), 2 no K/V reloads after the first kStages tiles, 3 no wgmma.
inline constexpr int kVariantTree = 1;
// Bit 3: the split-S schedule (64-key halves, softmax under the same warpgroup's P.V), measured
// 5-7% slower and removed (docs/attention.md).
// Bit 4 (experiment): FA3's intra-warpgroup order on whole 128-key tiles: the softmax of tile j
// (exponentials left in the S registers) under the same warpgroup's P.V of tile j-1; P of tile j
// packed into the registers of P of tile j-1 once that P.V is done.
inline constexpr int kVariantOverlap = 16;
// Bit 5: free (a first persistent two-consumer kernel, measured -0.5 to -1.5% and replaced by
// attention_fwd_kernel2p).
// Bit 6 (with bit 4): V' with one scale per 128-key tile, the form quantize_attention_fwd_operands
// writes in one pass (no prepare pass): the producer stores the tile's scale with its stage and the
// promotion folds it into the rescale factor of O (promote_vtile), instead of V's per-channel
// scales being applied once in the epilogue (docs/attention.md).
inline constexpr int kVariantVTile = 64;
// Bit 7 (experiment, host only; diagnostic, garbage out): the prepare pass is not launched, so the
// forward's time is the main kernel's (what remains once a quantizer writes the execution layout).
inline constexpr int kVariantNoPrepare = 128;
// Bits 8-9 (part of the exponentials on the FMA pipe by a polynomial) and 12 (the wait for P.V(j-1)
// before the softmax): measured slower (docs/attention.md) and removed.
// Bit 13 (experiment): no ping-pong turns: each warpgroup issues its GEMMs as soon
// as its own softmax is done (measured 2026-11-29: -1% to +1.7%, docs/attention.md).
inline constexpr int kVariantNoTurn = 8192;
// Bit 15 (with bit 4; part of the operands kernel's default since 2026-11-29 evening): P of tile j
// packed into e4m3 as its exponentials come out, into a second register set (P of even / odd tiles
// alternate; the loop is unrolled by two), instead of after the wait for P.V(j-1): only the
// promotion is left behind that wait. 16 registers more.
inline constexpr int kVariantPackEarly = 32768;
// Bit 18 (experiments build only; a diagnostic with correct output): lane 0 of the first warp of
// each consumer warpgroup in four CTAs (0, 700, 1400, 1900) reads the SM clock at seven points of
// every K/V tile of the pack-early loop (before the GEMM turn / GEMMs issued / S done / row maxima /
// exps done / P.V done / promoted; trace.cuh); the host writes the table to the file named by
// MXFLASH_FWD_TRACE after the 30th launch (scripts/attn_trace.py prints it by phase).
inline constexpr int kVariantTrace = 262144;
// Bits 17 (P's row sums from the tensor cores: V' plus 8 rows of ones, P.V as m64n136k32, the 64
// FADDs per tile and thread gone) and 20 (P through shared memory, P.V as SS wgmma): measured
// 2026-11-29 night, +-0 and -10%; removed (docs/attention.md; commit 241577e has their code).
// Bit 19 (experiment): the consumer warpgroups take turns for their exponentials (named barriers 3,
// 4 around each loop tile's exp phase), so that one warpgroup's exponentials never share the SM
// sub-partitions' issue slots and MUFUs with the other's. Pinned in the SASS by data: the exp
// phase reads its row maxima plus a zero loaded from shared memory after the barrier, and the
// row sums are stored to shared memory before the hand-over (a first version without the pins
// had 36 of 64 MUFUs hoisted above the barrier by ptxas).
inline constexpr int kVariantExpTurn = 524288;
// Bit 25: the causal mask (AttentionOptions::causal; FwdParams::causal_br picks the alignment), on the
// persistent kernels without a split tail only (exec_plan). Each row faces causal_keys(...) keys: an
// item's K/V tiles end at its last row's diagonal (work_item), the Q tiles of a sequence run
// heaviest first, and the tiles a warpgroup's first row does not wholly see take the masked softmax
// (per-row key limits; rows facing no key of a tile keep O, l and m as they were).
inline constexpr int kVariantCausal = 1 << 25;
// Bit 29: grouped-query attention (FwdParams::kv_magic): the producer reads K/V head h / g for Q
// head h. Kernels of their own, so that those of as many K/V heads as Q heads keep their SASS (the
// division inlined into them moved their register allocation: two spills in the three-consumer
// kernel's loop, tests/sass).
inline constexpr int kVariantGqa = 1 << 29;
// Bit 24 (P packed into e4m3 by integer ALU work, 4 LEA + 3 PRMT per 4 values, instead of F2FP):
// measured 2026-11-30, 6% slower; removed (docs/attention.md).
// Bit 21 (the exponential turn taken before the wait for S, so that the whole softmax alternates):
// measured 5-7% slower than bit 19 alone, removed.
__host__ __device__ constexpr int variant_diag(int v) { return (v >> 1) & 3; }
static_assert(kProducerRegs * kWarpgroupThreads + kConsumerRegs * kWarpgroupThreads * kConsumerWarpgroups <= 65536,
              "register budget exceeds the register file");
static_assert(kRowsPerConsumer * kConsumerWarpgroups == kTile, "consumers must cover the Q tile");

struct SharedStorage {
  alignas(1024) uint8_t q[kTileBytes];
  alignas(1024) uint8_t k[kStages][kTileBytes];
  alignas(1024) uint8_t v[kStages][kTileBytes];
  float k_scale[kStages];  // each stage's K tile scale, stored by the producer before it arms `full`
  float v_scale[kStages];  // kVariantVTile: each stage's V tile scale, stored alike
  alignas(8) uint64_t q_full;
  uint64_t full[kStages];
  uint64_t empty[kStages];
  float turn_zero;   // kVariantExpTurn: 0, read after each exp turn is taken
  float turn_sink[kConsumerWarpgroups * kWarpgroupThreads];  // kVariantExpTurn: row sums before each hand-over
};
inline constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + alignment slack

struct FwdParams {
  const int32_t* cu_q;
  const int32_t* cu_q_sf;
  const int32_t* cu_k;
  const int32_t* cu_k_sf;
  const float* q_scale;  // (H, Pq)
  const float* k_scale;  // (Hkv, Pk / 128)
  const float* v_scale;  // (B, H, 128); kVariantVTile: (Hkv, Pk / 128)
  const int2* tiles;  // the work list of Q tiles (work_list.cuh), sequences facing the most keys first
  bool heads_inner;   // its order within a sequence (heads_in_turn)
  bool causal_br;     // kVariantCausal: the bottom-right alignment (else top-left); in heads_inner's padding
  int heads;
  int64_t Pq, Pk, To;
  float scale_log2;
  bool broadcast_q;
  __nv_bfloat16* out;
  float* lse;
  int num_items;  // (Q tile, head) pairs: the persistent kernel's work list
  // Grouped-query attention: Q head h reads K/V head h / g of K' and V' (Hkv = H / g heads; g = 1
  // otherwise), computed as kv_head(): kv_magic = ceil(2^16 / g). (In the struct's tail padding:
  // the other fields keep their offsets.)
  unsigned kv_magic;
};

// The split tail of the three-consumer kernel (split_parts on the host): items first.. run as
// `parts` CTAs each, one contiguous share of the item's K/V tiles per CTA (a part), which write
// their partial row state to part_o / part_rows; the last part of an item to finish combines them
// into out and lse (merge_when_last3). first = the item count: nothing split. A parameter of its own, not fields of FwdParams: with
// them there, ptxas scheduled the two-consumer kernel's loop differently (its SASS otherwise the
// same) and that kernel ran 2.5% slower on cross and jagged (H200, same run, 2026-11-30).
struct SplitParams {
  int first, parts;
  int slots;  // parts in all ((items - first) x parts; 0: nothing split)
  float4* part_o;     // (slot, consumer, 16, 128 threads): a consumer thread's 64 accumulators
  float4* part_rows;  // (slot, consumer, 64 rows): {m, l (quad-summed), O's unit exponent, 0}
  unsigned* arrivals;  // (split item, consumer): parts done, zeroed with the work list's upload
};

// Stage and phase of the n-th K/V tile a CTA loads (n >= 0; unsigned: one AND and one shift, not
// the signed division's four instructions in the consumers' loop).
__device__ __forceinline__ int stage_of(int n) { return int(unsigned(n) % kStages); }
__device__ __forceinline__ uint32_t phase_of(int n) { return (unsigned(n) / kStages) & 1u; }

inline constexpr int kTurnBarrier0 = 1;  // named barriers 1, 2: the consumers' GEMM turns (0 is __syncthreads)
inline constexpr int kExpBarrier0 = 3;   // named barriers 3, 4: their exponential turns (kVariantExpTurn)
inline constexpr int kStageBarrier0 = 5;  // named barriers 5..7: each consumer warpgroup's staging tile (persistent kernels)

// S(64x128) = Q(64 rows of this warpgroup) . K(tile)^T, 4 k32 steps over the head dim.
__device__ __forceinline__ void issue_s(float (&sc)[64], uint64_t desc_q, uint64_t desc_k) {
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 32; ++kk) sm90::wgmma_m64n128k32_ss(sc, desc_q + 2 * kk, desc_k + 2 * kk, kk);
  sm90::wgmma_commit();
}

// O_tile(64x128) = P(64x128 keys, registers) . V'(tile), fresh accumulators (promoted by the caller).
__device__ __forceinline__ void issue_pv(float (&ot)[64], const uint32_t (&pa)[16], uint64_t desc_v) {
  sm90::wgmma_fence();
  sm90::wgmma_rs_steps<kTile / 32>(ot, pa, desc_v, true);
  sm90::wgmma_commit();
}

// Online softmax of one S tile held as wgmma accumulators: this thread's rows r0 and r0 + 8,
// columns 8j + 2q + {0, 1}. Produces the tile's P fragments (e4m3 of 256 p, computed as
// exp2(x + 8)) and the rescale factor of O; the row sums l carry the factor 256 (removed in the
// epilogue). Only a sequence's last tile can hold masked keys, so the mask is compiled there alone.
template <bool kTree, bool kCausal = false>
struct TileSoftmax {
  float row_mult[2];      // Q row scale * softmax_scale * log2 e
  int Lk;                 // keys from the first K/V tile on
  int quad;
  // kCausal: the warpgroup's first row's keys before the clamp to Lk (causal_keys without it), from
  // the first tile on; a row's limit is derived from it where the mask runs (no register of its
  // own through the loop: the two-consumer kernel's 240 spilled with two).
  int diag;
  __device__ __forceinline__ int row_keys(int r) const {
    const int t = int(threadIdx.x % 128u);
    return min(Lk, diag + t / 32 * 16 + t % 32 / 4 + 8 * r);
  }

  // Row state between the two phases of one tile.
  struct Rows {
    float mult[2], m_new[2];
  };

  __device__ __forceinline__ bool masked_tile(int j) const { return (kCausal ? min(Lk, diag) : Lk) - j * kTile < kTile; }

  // ks: the K tile's scale (from its stage in shared memory, read by the caller).
  __device__ __forceinline__ void run(float (&sc)[64], int j, float ks, float (&m)[2], float (&l)[2],
                                      float (&alpha)[2], uint32_t (&pa)[16]) const {
    if (masked_tile(j)) {
      const Rows rows = max_phase<true>(sc, j, ks, m, l, alpha);
      exp_phase<true>(sc, j, rows, l, pa);
    } else {
      const Rows rows = max_phase<false>(sc, j, ks, m, l, alpha);
      exp_phase<false>(sc, j, rows, l, pa);
    }
  }

  template <bool kMasked, int N>
  __device__ __forceinline__ float value(const float (&sc)[N], int j, int i) const {
    if (!kMasked) return sc[i];
    const int col = 8 * (i / 4) + 2 * quad + (i % 2);
    const int keys = kCausal ? row_keys((i % 4) / 2) : Lk;
    return col >= keys - j * kTile ? -INFINITY : sc[i];  // keys past the sequence's end (or the row's diagonal)
  }

  template <int W, int N>
  __device__ __forceinline__ static void tree_max(float (&t)[N]) {
    if constexpr (W >= 1) {
#pragma unroll
      for (int k = 0; k < W; ++k) t[k] = fmaxf(t[k], t[k + W]);
      tree_max<W / 2>(t);
    }
  }

  // Phase 1 (needs S only): the new row maxima, the rescale factor alpha of O and l.
  template <bool kMasked, int N>
  __device__ __forceinline__ Rows max_phase(const float (&sc)[N], int j, float ks, float (&m)[2],
                                            float (&l)[2], float (&alpha)[2]) const {
    auto masked = [&](int i) { return value<kMasked>(sc, j, i); };
    Rows rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx;
      if constexpr (kTree) {
        float t[N / 4];
#pragma unroll
        for (int k = 0; k < N / 4; ++k) t[k] = fmaxf(masked(4 * k + 2 * r), masked(4 * k + 2 * r + 1));
        tree_max<N / 8>(t);
        mx = t[0];
      } else {
        mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < N; ++i)
          if ((i % 4) / 2 == r) mx = fmaxf(mx, masked(i));
      }
      rows.mult[r] = row_mult[r] * ks;
      rows.m_new[r] = fmaxf(m[r], quad_max(mx) * rows.mult[r]);
      if constexpr (kCausal) {
        // A row that has faced no key yet keeps m = -inf; its exponentials use 0 as the maximum
        // (every value is -inf: p = 0) and alpha = 0 (O and l are 0).
        const float m_use = rows.m_new[r] == -INFINITY ? 0.f : rows.m_new[r];
        alpha[r] = fast_exp2(m[r] - m_use);
        m[r] = rows.m_new[r];
        rows.m_new[r] = m_use;
      } else {
        alpha[r] = fast_exp2(m[r] - rows.m_new[r]);
        m[r] = rows.m_new[r];
      }
      l[r] *= alpha[r];
    }
    return rows;
  }

  // Phase 2: P = e4m3(256 p) fragments and the row sums. kInPlace: the values 256 p replace S in sc
  // and pa is left alone (packed later by pack(), once the registers of the previous P are free).
  template <bool kMasked, int N, bool kInPlace = false>
  __device__ __forceinline__ void exp_phase(float (&sc)[N], int j, const Rows& rows, float (&l)[2],
                                            uint32_t (&pa)[N / 4]) const {
    auto masked = [&](int i) { return value<kMasked>(sc, j, i); };
    const float(&mult)[2] = rows.mult;
    const float(&m_new)[2] = rows.m_new;
    // P fragments (see permuted_token in the prepare pass): chunk c of 32 keys uses accumulators
    // 16c..16c+15; each thread packs its own values, V' is stored in the matching key order.
#pragma unroll
    for (int c = 0; c < N / 16; ++c) {
      float x[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const int r = (t % 4) / 2;
        const float e = fmaf(masked(16 * c + t), mult[r], kPScaleLog2 - m_new[r]);
        x[t] = fast_exp2(e);  // 256 p
      }
      sum_chunk(x, l);
      if constexpr (kInPlace) {
#pragma unroll
        for (int t = 0; t < 16; ++t) sc[16 * c + t] = x[t];
      } else {
        attn::pack_chunk(x, c, pa);
      }
    }
  }

  // Adds the 16 values of one chunk (accumulators 16c..16c+15) into the two row sums.
  __device__ __forceinline__ static void sum_chunk(const float* x, float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (kTree) {
        // rows r: t = 4k + 2r + {0, 1}, k = 0..3
        const float a0 = x[2 * r] + x[2 * r + 1], a1 = x[4 + 2 * r] + x[5 + 2 * r];
        const float a2 = x[8 + 2 * r] + x[9 + 2 * r], a3 = x[12 + 2 * r] + x[13 + 2 * r];
        l[r] += (a0 + a1) + (a2 + a3);
      } else {
#pragma unroll
        for (int t = 0; t < 16; ++t)
          if ((t % 4) / 2 == r) l[r] += x[t];
      }
    }
  }
  // All chunks of values left in place by exp_phase<..., kInPlace = true>.
  template <int N>
  __device__ __forceinline__ static void pack(const float (&x)[N], uint32_t (&pa)[N / 4]) {
#pragma unroll
    for (int c = 0; c < N / 16; ++c) attn::pack_chunk(x + 16 * c, c, pa);
  }
};

// A consumer warpgroup's softmax for the tile of Q rows from row0 of its sequence on, `first` the
// warpgroup's first row within the tile (kCausal: the key limits, causal_keys; Lk: the keys from the
// item's first K/V tile on).
template <bool kTree, bool kCausal>
__device__ __forceinline__ TileSoftmax<kTree, kCausal> make_softmax(const FwdParams& p, const float (&row_mult)[2],
                                                                   int Lq, int Lk, int row0, int first, int quad) {
  if constexpr (kCausal) {
    return {{row_mult[0], row_mult[1]}, Lk, quad, row0 + first + 1 + causal_off(p.causal_br, Lq, Lk)};
  } else {
    return {{row_mult[0], row_mult[1]}, Lk, quad};
  }
}

// 1 / l for the epilogue; kCausal: 0 for a row that faced no key (l = 0; O is 0).
template <bool kCausal>
__device__ __forceinline__ float inv_sum(float lsum) {
  return kCausal && lsum == 0.f ? 0.f : 1.f / lsum;
}

// FwdParams::kv_magic for g Q heads a K/V head.
inline unsigned kv_magic(int64_t g) { return unsigned(((int64_t(1) << 16) + g - 1) / g); }

// The K/V head of Q head h (kVariantGqa): h / g as one multiply-high by FwdParams::kv_magic =
// ceil(2^16 / g), exact while h x g < 2^16 (the host checks H x g).
template <int kVariant>
__device__ __forceinline__ int kv_head(const FwdParams& p, int h) {
  if constexpr ((kVariant & kVariantGqa) != 0) return int(__umulhi(unsigned(h) << 16, p.kv_magic));
  return h;
}

// One (Q tile, head) of the work list.
struct WorkItem {
  int h, b, m_block, qb, Lq, Lk, n_tiles;
  int64_t q_row;  // first row of the Q tile in Q' (H, Pq, 128)
  int j0 = 0;     // first K/V tile (split items' parts; n_tiles: the part's count)
  int slot = -1;  // split items: the part's slot in FwdParams::part_o / part_rows
};

// kCausal: a sequence's Q tiles in reverse order (the last, which faces the most keys, first), and
// the K/V tiles up to the diagonal of the tile's last row.
template <int kQTile = kTile, bool kCausal = false>
__device__ __forceinline__ WorkItem work_item(const FwdParams& p, unsigned index) {
  WorkItem w;
  const int2 work = p.tiles[index / p.heads];
  w.b = work.x;
  w.qb = p.broadcast_q ? 0 : w.b;
  w.Lq = p.cu_q[w.qb + 1] - p.cu_q[w.qb];
  const unsigned tiles = unsigned((w.Lq + kQTile - 1) / kQTile);
  const HeadTile ht = head_and_tile(index, unsigned(work.y), tiles, unsigned(p.heads), p.heads_inner);
  w.h = ht.h;
  w.m_block = kCausal ? int(tiles) - 1 - ht.tile : ht.tile;
  w.Lk = p.cu_k[w.b + 1] - p.cu_k[w.b];
  if constexpr (kCausal) {
    const int last = min((w.m_block + 1) * kQTile, w.Lq) - 1;  // the tile's last row
    w.n_tiles = (causal_row_keys(last, causal_off(p.causal_br, w.Lq, w.Lk), w.Lk) + kTile - 1) / kTile;
  } else {
    w.n_tiles = (w.Lk + kTile - 1) / kTile;
  }
  w.q_row = int64_t(w.h) * p.Pq + p.cu_q_sf[w.qb] + int64_t(w.m_block) * kQTile;
  return w;
}

// Producer thread: the item's Q tile into q, in kQBoxes boxes of kQBoxRows rows (the Q map's box),
// completing q_full.
template <int kQBoxes, int kQBoxRows>
__device__ __forceinline__ void produce_q(uint8_t* q, uint64_t* q_full, const CUtensorMap* tm_q, const WorkItem& w) {
  sm90::mbar_arrive_expect_tx(q_full, kQBoxes * kQBoxRows * kHeadDim);
#pragma unroll
  for (int c = 0; c < kQBoxes; ++c) sm90::tma_load_2d(q + c * kQBoxRows * kHeadDim, tm_q, q_full, 0, int(w.q_row) + c * kQBoxRows);
}

// The scales of the item's K/V tile j (counted from its first, w.j0): K's (x) and, with
// kVariantVTile, V's (y; else 0).
template <int kVariant>
__device__ __forceinline__ float2 kv_tile_scales(const FwdParams& p, const WorkItem& w, int j) {
  const int64_t t = int64_t(kv_head<kVariant>(p, w.h)) * (p.Pk / kTile) + (p.cu_k_sf[w.b] + w.j0 * kTile) / kTile + j;
  return make_float2(p.k_scale[t], (kVariant & kVariantVTile) != 0 ? p.v_scale[t] : 0.f);
}

// Producer thread: the item's K/V tiles into the stages; `it` K/V tiles were loaded before
// (persistent CTAs), which sets the stage and phase of the first one; `first`: the first tile's
// scales, read already (kv_tile_scales), or null. Storage: SharedStorage, SharedStorage3,
// SharedStorage3P or SharedStorage2P.
template <int kVariant, typename Storage>
__device__ __forceinline__ void produce_kv(Storage& s, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                           const FwdParams& p, const WorkItem& w, int it,
                                           const float2* first = nullptr) {
  const int h = kv_head<kVariant>(p, w.h), b = w.b, n_tiles = w.n_tiles;  // h: the K/V head
  const int k_first = p.cu_k_sf[b] + w.j0 * kTile;  // the first K/V tile's token in K' and V'
  const int k_row = int(int64_t(h) * p.Pk + k_first);
  const int v_col = k_first;
  const float* k_scale = p.k_scale + int64_t(h) * (p.Pk / kTile) + k_first / kTile;
  constexpr bool kVTile = (kVariant & kVariantVTile) != 0;
  const float* v_scale = p.v_scale + int64_t(h) * (p.Pk / kTile) + k_first / kTile;
  const int loads = variant_diag(kVariant) == 2 ? min(n_tiles, kStages) : n_tiles;
  for (int j = 0; j < loads; ++j) {
    const int stage = stage_of(it + j);
    const uint32_t phase = phase_of(it + j);
    // The K tile's scale goes through shared memory with its tile: the consumers' own global load
    // of it (LDG, then R2UR right behind it) held ~7% of their stall samples in ncu. Loaded before
    // the wait, stored after it (the stage's previous scale is read before the stage is released),
    // visible to the consumers through the release of the arrive below.
    float ks = k_scale[j];
    float vs = kVTile ? v_scale[j] : 0.f;
    if (first != nullptr && j == 0) ks = first->x, vs = first->y;
    sm90::mbar_wait(&s.empty[stage], phase ^ 1);
    s.k_scale[stage] = ks;
    if constexpr (kVTile) s.v_scale[stage] = vs;
    sm90::mbar_arrive_expect_tx(&s.full[stage], 2 * kTileBytes);
    sm90::tma_load_2d(s.k[stage], tm_k, &s.full[stage], 0, k_row + j * kTile);
    sm90::tma_load_2d(s.v[stage], tm_v, &s.full[stage], v_col + j * kTile, h * kHeadDim);
  }
}

// Producer thread: Q of the item (in SharedStorage's or SharedStorage3's one Q buffer), then its K/V
// tiles.
template <int kVariant, int kQBoxes = 1, int kQBoxRows = kTile, typename Storage>
__device__ __forceinline__ void produce_item(Storage& s, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                             const CUtensorMap* tm_v, const FwdParams& p, const WorkItem& w, int it) {
  produce_q<kQBoxes, kQBoxRows>(s.q, &s.q_full, tm_q, w);
  produce_kv<kVariant>(s, tm_k, tm_v, p, w, it);
}

// 2^n as a float for n <= 127 (0 under 2^-126); pow2i_exact: subnormals down to 2^-149 too.
__device__ __forceinline__ float pow2i(int n) { return n < -126 ? 0.f : __int_as_float((min(n, 127) + 127) << 23); }
__device__ __forceinline__ float pow2i_exact(int n) {
  return n >= -126 ? pow2i(n) : (n >= -149 ? __int_as_float(1 << (n + 149)) : 0.f);
}

// kVariantVTile: V' tile t has one scale 2^e(t), and O is kept in units of 2^e_ref: the exponent of
// the latest tile, but never more than 64 binades under the largest so far (e_max), so that O stays
// far inside fp32's range (|O| <= 2^30 in units of the largest tile's scale) for any input. The
// promotion of tile t, o = o alpha 2^(e_ref_old - e_ref) + ot 2^(e(t) - e_ref), is then one FFMA per
// element: the change of unit folds into the per-row alpha, and the second factor is 1 unless V's
// scale fell more than 64 binades under an earlier tile's (then one FMUL more). Powers of two:
// exact. The epilogue multiplies by 2^e_ref. A scale that is no power of two (operands not written
// by quantize_attention_forward: any finite value, zero, subnormal or negative included) gets its
// exponent field as e(t) and the rest as the second factor, so it is applied exactly as a multiply
// would (a zero scale takes that path too: its exponent field is that of 2^-127).
struct VTileUnit {
  int e_ref = -1000, e_max = -1000;  // before the first tile: O = 0, any unit
};
struct VTilePromotion {
  float a[2];  // per-row factors of O
  float vs;    // the tile's scale and O's new unit 2^e_new (the slow path's factor vs / 2^e_new)
  int e_new;
  bool slow;
};
__device__ __forceinline__ VTilePromotion promote_vtile_prepare(const float (&alpha)[2], float vs, VTileUnit& u) {
  const uint32_t bits = __float_as_uint(vs);
  const int e = int((bits >> 23) & 0xFFu) - 127;  // vs = 2^e for the quantizer's scales
  u.e_max = max(u.e_max, e);
  const int e_new = max(e, u.e_max - 64);
  const float g = pow2i(u.e_ref - e_new);
  u.e_ref = e_new;
  VTilePromotion pr;
  pr.a[0] = alpha[0] * g;
  pr.a[1] = alpha[1] * g;
  // vs is not +2^e_new (a normal power of two; a zero or subnormal vs has e = -127 and is not)
  pr.slow = e != e_new || (bits & 0x807FFFFFu) != 0u || e == -127;
  pr.vs = vs;
  pr.e_new = e_new;
  return pr;
}
// o[i] for i < N (a whole tile's accumulators, or a 64-channel half: N = 32).
template <int N>
__device__ __forceinline__ void promote_vtile_apply(float* o, const float* ot, const VTilePromotion& pr) {
  if (pr.slow) {
    const float f = pr.vs * pow2i_exact(-pr.e_new);  // vs / 2^e_new, exact
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = fmaf(ot[i], f, o[i] * pr.a[(i % 4) / 2]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = fmaf(o[i], pr.a[(i % 4) / 2], ot[i]);
  }
}
// Without tile scales (V's channel scales applied in the epilogue): o = o alpha + ot.
__device__ __forceinline__ VTilePromotion plain_promotion(const float (&alpha)[2]) {
  return {{alpha[0], alpha[1]}, 1.f, 0, false};
}
__device__ __forceinline__ void promote_vtile(float (&o)[64], const float (&ot)[64], const float (&alpha)[2], float vs,
                                              VTileUnit& u) {
  promote_vtile_apply<64>(o, ot, promote_vtile_prepare(alpha, vs, u));
}

// Rows of a Q tile (first row row0 within its sequence) that face no keys: out = 0, lse = -inf.
__device__ __forceinline__ void write_keyless_rows(const FwdParams& p, int h, int64_t tok_base, int row0, int Lq,
                                                   const int (&rows)[2], int quad) {
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + rows[r];
    if (i >= Lq) continue;
    const int64_t tok = tok_base + i;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out + (tok * p.heads + h) * kHeadDim);
    for (int c = quad; c < kHeadDim / 2; c += 4) o[c] = __floats2bfloat162_rn(0.f, 0.f);
    if (quad == 0) p.lse[h * p.To + tok] = -INFINITY;
  }
}

// Out's normalization and LSE, one definition for every epilogue (write_rows, write_rows_staged,
// merge_parts3), so that a row gets the same bytes whichever of them writes it: O / (l 256) times
// V's scale (kVTile: O's unit 2^e_ref, promote_vtile; else V's per-channel scales of sequence b),
// and LSE = (m + log2 l - 8) ln 2.
template <bool kVTile>
struct OutNorm {
  const float* v_scale;
  float unit;
  __device__ __forceinline__ OutNorm(const FwdParams& p, int b, int h, int e_ref)
      : v_scale(p.v_scale + (int64_t(b) * p.heads + h) * kHeadDim), unit(kVTile ? ldexpf(1.f, e_ref) : 1.f) {}
  // Channels col and col + 1 of a row from its accumulators x, y; inv = 1 / l (l carries the P
  // scale 256).
  __device__ __forceinline__ float2 pair(float x, float y, float inv, int col) const {
    return make_float2(x * inv * (kVTile ? unit : v_scale[col]), y * inv * (kVTile ? unit : v_scale[col + 1]));
  }
  __device__ __forceinline__ static float lse(float m, float lsum) {
    const float log2_l = log2f(lsum) - kPScaleLog2;
    return (m + log2_l) * kLn2;
  }
};

// The epilogue: O / (l 256) times V's scale (kVTile: O's unit 2^e_ref, promote_vtile; else V's
// per-channel scales of sequence b) to BF16, and LSE = (m + log2 l - 8) ln 2, for this thread's two
// rows of the tile that starts at row row0 of its sequence.
template <bool kVTile, bool kCausal = false>
__device__ __forceinline__ void write_rows(const FwdParams& p, const float (&o)[64], const float (&l)[2],
                                           const float (&m)[2], const VTileUnit& vunit, int b, int h,
                                           int64_t tok_base, int row0, int Lq, const int (&rows)[2], int quad) {
  const OutNorm<kVTile> norm(p, b, h, vunit.e_ref);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const int i = row0 + rows[r];
    if (i >= Lq) continue;
    const int64_t tok = tok_base + i;
    const float inv = inv_sum<kCausal>(lsum);
    __nv_bfloat16* orow = p.out + (tok * p.heads + h) * kHeadDim;
#pragma unroll
    for (int jn = 0; jn < 16; ++jn) {
      const int col = 8 * jn + 2 * quad;
      *reinterpret_cast<__nv_bfloat162*>(orow + col) =
          __float22bfloat162_rn(norm.pair(o[4 * jn + 2 * r], o[4 * jn + 2 * r + 1], inv, col));
    }
    if (quad == 0) p.lse[h * p.To + tok] = OutNorm<kVTile>::lse(m[r], lsum);
  }
}

// The persistent kernels' epilogue: write_rows' values, the consumer warpgroup's 64 rows of out
// through its staging tile (two boxes of 64 rows x 64 channels, 128-byte swizzle, written with
// stmatrix) and two TMA stores by its thread 0, instead of 32 4-byte stores per thread (ncu,
// 128-token sequences: they held 35% of the consumers' stall samples). Where some of the 64 rows lie
// past the sequence's end (rows of the next sequence: a box cannot skip them), write_rows. The tile
// is rewritten only once the previous item's stores have read it (bulk_wait_read by the thread that
// issued them, then the warpgroup's barrier).
template <bool kVTile, bool kCausal = false>
__device__ __forceinline__ void write_rows_staged(const FwdParams& p, const CUtensorMap* tm_o, uint8_t* stage,
                                                  int cw, int warp, int lane, const float (&o)[64],
                                                  const float (&l)[2], const float (&m)[2], const VTileUnit& vunit,
                                                  int b, int h, int64_t tok_base, int row0, int Lq,
                                                  const int (&rows)[2], int quad) {
  const int first = row0 + cw * kRowsPerConsumer;  // the warpgroup's first row of the sequence
  if (first + kRowsPerConsumer > Lq) {
    write_rows<kVTile, kCausal>(p, o, l, m, vunit, b, h, tok_base, row0, Lq, rows, quad);
    return;
  }
  const bool issuer = warp == 0 && lane == 0;
  const int barrier = kStageBarrier0 + cw;
  attn::staging_acquire(issuer, barrier);
  const OutNorm<kVTile> norm(p, b, h, vunit.e_ref);
  uint32_t packed[2][16];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const float inv = inv_sum<kCausal>(lsum);
#pragma unroll
    for (int jn = 0; jn < 16; ++jn) {
      const float2 v = norm.pair(o[4 * jn + 2 * r], o[4 * jn + 2 * r + 1], inv, 8 * jn + 2 * quad);
      packed[r][jn] = attn::bf16x2_bits(v.x, v.y);
    }
    if (quad == 0) p.lse[h * p.To + tok_base + row0 + rows[r]] = OutNorm<kVTile>::lse(m[r], lsum);
  }
  attn::stage_and_store(tm_o, stage, issuer, barrier, warp, lane, packed, h, int(tok_base + first));
}

// A consumer warpgroup on one item: S, softmax, P.V over its K/V tiles, then O and LSE. Q from
// q_tile, complete at phase q_phase of q_full; `it`: K/V tiles this CTA consumed before (persistent
// CTAs; 0 otherwise). kPersistent: the rows' Q scales from qs (shared memory, written with Q).
// Storage: SharedStorage or SharedStorage2P.
template <int kVariant, bool kPersistent, typename Storage>
__device__ __forceinline__ void consume_item(Storage& s, const uint8_t* q_tile, uint64_t* q_full, uint32_t q_phase,
                                             const float* qs, const FwdParams& p, const WorkItem& w, int cw, int warp,
                                             int lane, int quad, const int (&rows)[2], int it,
                                             const CUtensorMap* tm_o = nullptr, uint8_t* o_stage = nullptr) {
  static_assert((kVariant & kVariantVTile) == 0 || (kVariant & kVariantOverlap) != 0,
                "per-tile V scales are applied by the overlapped schedule's promotion only");
  const int h = w.h, b = w.b, m_block = w.m_block, qb = w.qb, Lq = w.Lq, Lk = w.Lk, n_tiles = w.n_tiles;
  const int64_t q_row = w.q_row;
  const int64_t tok_base = p.broadcast_q ? int64_t(b) * Lq : p.cu_q[qb];

  if (n_tiles == 0) {  // no keys: out = 0, lse = -inf
    write_keyless_rows(p, h, tok_base, m_block * kTile, Lq, rows, quad);
    return;
  }

  float row_mult[2];
  if constexpr (kPersistent) {
    sm90::mbar_wait(q_full, q_phase);
    for (int r = 0; r < 2; ++r) row_mult[r] = sm90::ld_shared_f32(&qs[rows[r]]) * p.scale_log2;
  } else {
    for (int r = 0; r < 2; ++r) row_mult[r] = p.q_scale[q_row + rows[r]] * p.scale_log2;
  }

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  if constexpr (!kPersistent) sm90::mbar_wait(q_full, q_phase);
  const uint64_t desc_q = sm90::make_desc_k128b(q_tile + cw * kRowsPerConsumer * kHeadDim);
  // Stage n's K and V tiles: the stage-0 descriptors plus n stages in the 16-byte address field.
  const uint64_t desc_k0 = sm90::make_desc_k128b(s.k[0]), desc_v0 = sm90::make_desc_k128b(s.v[0]);
  constexpr uint64_t kStageDesc = kTileBytes >> 4;
  constexpr bool kTrace = (kVariant & kVariantTrace) != 0;
  const int trace_row =
      kTrace && !kPersistent && warp == 0 && lane == 0 ? trace_cta_slot(blockIdx.x, 0, 700, 1400, 1900) : -1;
  auto stamp = [&](int j, int event) {
    if constexpr (kTrace) trace_stamp(trace_row, cw, j, event);
  };
  constexpr bool kCausal = (kVariant & kVariantCausal) != 0;
  const auto sm = make_softmax<(kVariant & kVariantTree) != 0, kCausal>(p, row_mult, Lq, Lk, m_block * kTile,
                                                                        cw * kRowsPerConsumer, quad);

  constexpr int kDiag = variant_diag(kVariant);
  auto wait_full = [&](int j) {
    if (kDiag != 2 || j < kStages) sm90::mbar_wait(&s.full[stage_of(it + j)], phase_of(it + j));
  };
  auto gemm_s = [&](float (&sc)[64], int stage) {
    if constexpr (kDiag == 3) {
#pragma unroll
      for (int i = 0; i < 64; ++i) sc[i] = 0.f;
    } else {
      issue_s(sc, desc_q, desc_k0 + uint64_t(stage) * kStageDesc);
    }
  };
  auto gemm_pv = [&](float (&ot)[64], const uint32_t (&pa)[16], int stage) {
    if constexpr (kDiag != 3) issue_pv(ot, pa, desc_v0 + uint64_t(stage) * kStageDesc);
  };
  // The K tile scale of tile j, from its stage (valid once wait_full(j) returned).
  auto k_tile_scale = [&](int j) { return sm90::ld_shared_f32(&s.k_scale[stage_of(it + j)]); };
  auto softmax = [&](float (&sc)[64], int j, float ks, float (&alpha)[2], uint32_t (&pa)[16]) {
    if constexpr (kDiag == 1) {
      alpha[0] = alpha[1] = 1.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) pa[i] = 0x30303030u ^ __float_as_uint(sc[4 * i]);
    } else {
      sm.run(sc, j, ks, m, l, alpha, pa);
    }
  };
  // Ping-pong: the two consumer warpgroups take turns issuing their GEMMs (named barriers), so one
  // warpgroup's softmax runs while the other's GEMMs occupy the tensor cores. P.V of tile j-1 is
  // issued in the same turn as S of tile j.
  const int my_turn = kTurnBarrier0 + cw, other_turn = kTurnBarrier0 + (1 - cw);
  constexpr int kTurnThreads = 2 * kWarpgroupThreads;
  constexpr bool kTurns = (kVariant & kVariantNoTurn) == 0;
  if (kTurns && cw == 1) sm90::named_barrier_arrive(other_turn, kTurnThreads);  // warpgroup 0 goes first
  // Warpgroup 1 gave one turn in advance, so it skips the hand-over after its last issue.
  auto hand_over = [&](int j) {
    if (kTurns && !(cw == 1 && j == n_tiles - 1)) sm90::named_barrier_arrive(other_turn, kTurnThreads);
  };
  auto take_turn = [&] {
    if constexpr (kTurns) sm90::named_barrier_sync(my_turn, kTurnThreads);
  };
  // kVariantExpTurn: the exponentials of tiles 1.. alternate between the warpgroups, warpgroup 0
  // first (warpgroup 1 arrives once in advance and skips its hand-over after its last tile).
  constexpr bool kExpTurns = (kVariant & kVariantExpTurn) != 0;
  if (kExpTurns && cw == 1 && n_tiles > 1) sm90::named_barrier_arrive(kExpBarrier0, kTurnThreads);
  // Taking the turn adds the zero loaded after the barrier to the rows' maxima, which the
  // exponentials read: that keeps ptxas from moving them above the barrier.
  auto take_exp_turn = [&](auto& rows) {
    if constexpr (kExpTurns) {
      sm90::named_barrier_sync(kExpBarrier0 + cw, kTurnThreads);
      const float z = sm90::ld_shared_f32(&s.turn_zero);
      rows.m_new[0] += z;
      rows.m_new[1] += z;
    }
  };
  auto hand_over_exp = [&](int j) {
    if constexpr (kExpTurns) {
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(sm90::smem_u32(&s.turn_sink[cw * kWarpgroupThreads + warp * 32 + lane])),
                   "f"(l[0] + l[1]) : "memory");
      if (!(cw == 1 && j == n_tiles - 1)) sm90::named_barrier_arrive(kExpBarrier0 + 1 - cw, kTurnThreads);
    }
  };
  VTileUnit vunit;  // kVariantVTile: O's unit (promote_vtile)
  uint32_t pa[16];
  float alpha[2];
  float ot[64];  // P.V accumulators of one tile (each P.V starts them from zero)
  // O = O alpha + the P.V of the tile in `stage`, and the stage released (kVariantVTile, overlapped
  // schedule only: V's tile scale from the stage, read before its release).
  auto promote = [&](int stage) {
    if constexpr ((kVariant & kVariantVTile) != 0) {
      const float vs = sm90::ld_shared_f32(&s.v_scale[stage]);
      sm90::mbar_arrive(&s.empty[stage]);
      promote_vtile(o, ot, alpha, vs, vunit);
    } else {
      sm90::mbar_arrive(&s.empty[stage]);
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] = fmaf(o[i], alpha[(i % 4) / 2], ot[i]);
    }
  };
  {
    wait_full(0);
    const float ks = k_tile_scale(0);
    float sc[64];
    take_turn();
    gemm_s(sc, stage_of(it));
    hand_over(0);
    sm90::wgmma_wait<0>();
    fence_all(sc);
    softmax(sc, 0, ks, alpha, pa);
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) ot[i] = 0.f;
  constexpr bool kPackEarly = (kVariant & kVariantPackEarly) != 0;
  static_assert(!kPackEarly || ((kVariant & kVariantOverlap) != 0 && kDiag == 0),
                "P packed early: the overlapped schedule");
  // The GEMMs of iteration j in this warpgroup's turn: S(j) into sc, P.V(j-1) from p_in.
  auto issue = [&](int j, float (&sc)[64], const uint32_t (&p_in)[16]) {
    const int stage = stage_of(it + j), prev = stage_of(it + j - 1);
    wait_full(j);
    take_turn();
    gemm_s(sc, stage);
    gemm_pv(ot, p_in, prev);
    hand_over(j);
  };
  // The overlapped schedule's softmax of tile j, while P.V(j-1) may still run: the row maxima and
  // the exponentials, left in sc (packed later) or, with kVariantPackEarly, packed into p_out as
  // they come out.
  auto softmax_under_pv = [&](int j, float (&sc)[64], uint32_t (&p_out)[16], float (&alpha_new)[2]) {
    sm90::wgmma_wait<1>();  // S of tile j done; P.V of tile j-1 may still run
    fence_all(sc);
    stamp(j, 2);
    // Read where the row maxima need it: a value held across the GEMMs' issue is one more register
    // live next to the P.V in flight (register pressure is what moves that P.V's wait; below).
    const float ks = k_tile_scale(j);
    // The wait for P.V(j-1) stays out of the masked / unmasked branches (the caller's): inside them,
    // ptxas reused registers of P(j-1) (still read by that P.V) early and hoisted the wait above the
    // softmax, which then no longer overlapped the P.V (docs/attention.md;
    // tests/sass/check_fwd_schedule.py guards this).
    if (sm.masked_tile(j)) {
      auto rows = sm.template max_phase<true>(sc, j, ks, m, l, alpha_new);
      take_exp_turn(rows);
      sm.template exp_phase<true, 64, !kPackEarly>(sc, j, rows, l, p_out);
      hand_over_exp(j);
    } else {
      auto rows = sm.template max_phase<false>(sc, j, ks, m, l, alpha_new);
      stamp(j, 3);
      take_exp_turn(rows);
      sm.template exp_phase<false, 64, !kPackEarly>(sc, j, rows, l, p_out);
      hand_over_exp(j);
    }
  };
  uint32_t pb[16];          // kVariantPackEarly: P of odd tiles
  bool last_in_pb = false;  // kVariantPackEarly: the last tile's P is in pb
  if constexpr (kPackEarly) {
    // P of tile j goes into the register set P(j-1) does not use, so nothing but the promotion
    // waits for P.V(j-1): even tiles' P in pa, odd tiles' in pb, the loop unrolled by two.
    auto iteration = [&](int j, uint32_t (&p_in)[16], uint32_t (&p_out)[16]) {
      float sc[64], alpha_new[2];
      stamp(j, 0);
      issue(j, sc, p_in);
      stamp(j, 1);
      softmax_under_pv(j, sc, p_out, alpha_new);
      stamp(j, 4);
      sm90::wgmma_wait<0>();
      fence_all(ot);
      stamp(j, 5);
#pragma unroll
      for (int i = 0; i < 16; ++i) sm90::fence_regs(p_in[i]);  // P of tile j-1 was read until here
      promote(stage_of(it + j - 1));
      stamp(j, 6);
      alpha[0] = alpha_new[0];
      alpha[1] = alpha_new[1];
    };
    int j = 1;
    for (; j + 1 < n_tiles; j += 2) {
      iteration(j, pa, pb);
      iteration(j + 1, pb, pa);
    }
    if (j < n_tiles) {
      iteration(j, pa, pb);
      last_in_pb = true;
    }
  } else {
    for (int j = 1; j < n_tiles; ++j) {
      float sc[64];
      issue(j, sc, pa);
      if constexpr ((kVariant & kVariantOverlap) != 0) {
        // FA3's order (the default): the softmax of tile j, exponentials left in the S registers,
        // runs while the P.V of tile j-1 is in flight; P of tile j is packed into P(j-1)'s
        // registers only after that P.V is done (docs/attention.md).
        static_assert(kDiag == 0, "the diagnostics apply to the schedule without overlap");
        float alpha_new[2];
        softmax_under_pv(j, sc, pa, alpha_new);
        sm90::wgmma_wait<0>();
        fence_all(ot);
        fence_all(sc);
#pragma unroll
        for (int i = 0; i < 16; ++i) sm90::fence_regs(pa[i]);  // P of tile j-1 was read until here
        promote(stage_of(it + j - 1));
        sm.pack(sc, pa);
        alpha[0] = alpha_new[0];
        alpha[1] = alpha_new[1];
      } else {
        // Variants 0, 1 and the diagnostics: wait for S and P.V together.
        sm90::wgmma_wait<0>();
        fence_all(sc);
        fence_all(ot);
        const float ks = k_tile_scale(j);
        promote(stage_of(it + j - 1));
        softmax(sc, j, ks, alpha, pa);
      }
    }
  }
  const int last = stage_of(it + n_tiles - 1);
  if (kPackEarly && last_in_pb)  // (no register copy: a move into a wgmma operand serializes them)
    gemm_pv(ot, pb, last);
  else
    gemm_pv(ot, pa, last);
  sm90::wgmma_wait<0>();
  fence_all(ot);
  promote(last);

  // ---------------------------------------------------------------------------- epilogue
  if (kPersistent && tm_o != nullptr)  // (kernel2p: out staged for TMA stores)
    write_rows_staged<(kVariant & kVariantVTile) != 0, kCausal>(p, tm_o, o_stage, cw, warp, lane, o, l, m, vunit, b,
                                                                h, tok_base, m_block * kTile, Lq, rows, quad);
  else
    write_rows<(kVariant & kVariantVTile) != 0, kCausal>(p, o, l, m, vunit, b, h, tok_base, m_block * kTile, Lq, rows,
                                                         quad);
}

// The main kernels start as programmatic dependents of the work list's upload (launch_main): no
// thread reads the list, the item counter or anything after them before this returns. (A no-op
// after an ordinary launch.) Every earlier writer of the stream (the operands' quantizer, the
// prepare passes) finished before the upload started.
__device__ __forceinline__ void wait_for_work_list() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// The mbarriers and the exponential turns' zero, then a CTA barrier (init_pipeline).
__device__ __forceinline__ void init_barriers(SharedStorage& s) {
  if (threadIdx.x == 0) s.turn_zero = 0.f;
  init_pipeline(&s.q_full, s.full, s.empty, kConsumerWarpgroups);
}

template <int kVariant>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                         const __grid_constant__ CUtensorMap tm_v, const FwdParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s = aligned_shared<SharedStorage>(smem_raw);
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % kWarpgroupThreads;
  wait_for_work_list();
  const WorkItem w = work_item(p, blockIdx.x);
  init_barriers(s);

  if (wg == 0) {  // ------------------------------------------------------------ producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0 && w.n_tiles > 0) produce_item<kVariant>(s, &tm_q, &tm_k, &tm_v, p, w, 0);
    return;
  }

  // ------------------------------------------------------------------------------ consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;
  const int warp = tid / 32, lane = tid % 32, quad = lane % 4;
  const int r0 = cw * kRowsPerConsumer + warp * 16 + lane / 4;  // rows r0 and r0 + 8 of the Q tile
  const int rows[2] = {r0, r0 + 8};
  consume_item<kVariant, false>(s, s.q, &s.q_full, 0, nullptr, p, w, cw, warp, lane, quad, rows, 0);
}

// Three consumer warpgroups (attention_fwd_kernel3; the operands kernel where Q's tiles of 192 rows
// pad little, see three_consumers): Q tiles of 192 rows, 64 per consumer, each consumer running S,
// softmax, P.V and the promotion of a K/V tile in series, with no intra-warpgroup overlap and no
// turns. Three warpgroups' serial chains interleave on the SM instead of two overlapped ones.
// Registers: 160 a consumer (O 64 + P.V 64 + P 16 at the P.V; O 64 + S 64 at the softmax), 24 for
// the producer. The arithmetic per row is the two-consumer kernel's (the same wgmma shapes, softmax
// and promotion in the same order), so both give the same bytes (GPU tests).
inline constexpr int kConsumers3 = 3;
inline constexpr int kQTile3 = kRowsPerConsumer * kConsumers3;
inline constexpr int kThreads3 = kWarpgroupThreads * (1 + kConsumers3);
inline constexpr int kConsumerRegs3 = 160;
// The three-consumer kernels' producer warpgroup: what the consumers leave of the register file
// (32 x 128 + 3 x 160 x 128 = 65536); at 24 the persistent producer spilled its item state around
// every wait. (The two-consumer kernels leave nothing over 24.)
inline constexpr int kProducerRegs3 = 32;
static_assert(kProducerRegs3 * kWarpgroupThreads + kConsumerRegs3 * kWarpgroupThreads * kConsumers3 <= 65536,
              "register budget exceeds the register file");
// Bit 28 (experiments builds, with kVariantTrace's code): the trace's clock reads and stores with no
// CTA traced. Measured +3% on llm-long against the kernel without them (the same SASS but for those
// predicated instructions and the register allocation around them); not understood, so not the
// default (docs/attention.md).
inline constexpr int kVariantTracePin = 1 << 28;
// Bit 27 (S of the next tile issued at the end of a tile, in two 64-key halves, the last tile
// peeled: the same bytes, 1-2% slower) and bits 22-23 (2, 4 or 6 of each 16 exponentials on the FMA
// pipe by a polynomial: 1.5, 3 and 6% slower) were measured 2026-11-30 and removed
// (docs/attention.md).
// Bit 29 (P.V in two 64-channel halves, the first promoted while the second runs) is the kernel's
// schedule since 2026-11-30 (+4-6%). Bit 30 (S in two 64-key halves, the first half's row maxima
// taken while the second runs) measured 3% slower and was removed (docs/attention.md).
// 6 K/V stages instead of 4 (+-0) and a first form of bit 27 (the next tile's S issued under a
// condition inside the loop: ptxas serialized every wgmma and spilled ~900 bytes): removed
// (docs/attention.md).

struct SharedStorage3 {
  alignas(1024) uint8_t q[kQTile3 * kHeadDim];
  alignas(1024) uint8_t k[kStages][kTileBytes];
  alignas(1024) uint8_t v[kStages][kTileBytes];
  float k_scale[kStages];  // each stage's K and V tile scales, stored by the producer before it arms `full`
  float v_scale[kStages];
  alignas(8) uint64_t q_full;
  uint64_t full[kStages];
  uint64_t empty[kStages];
};
inline constexpr size_t kSmemBytes3 = sizeof(SharedStorage3) + 1024;

// Part q of the split items (SplitParams): part q % parts of item first + q / parts, its K/V tiles
// [part n / parts, (part + 1) n / parts) of the item's n, its partial state in slot q.
__device__ __forceinline__ WorkItem work_part3(const FwdParams& p, const SplitParams& sp, unsigned q) {
  const unsigned first = unsigned(sp.first), parts = unsigned(sp.parts);
  WorkItem w = work_item<kQTile3>(p, first + q / parts);
  const int part = int(q % parts), n = w.n_tiles;
  w.j0 = part * n / int(parts);
  w.n_tiles = (part + 1) * n / int(parts) - w.j0;
  w.slot = int(q);
  return w;
}

// A split item's part: this consumer thread's accumulators (O in units of 2^e_ref) and its rows'
// maxima, sums and unit, for merge_parts3.
__device__ __forceinline__ void write_partial3(const SplitParams& sp, int slot, int cw, int tid, const float (&o)[64],
                                               const float (&l)[2], const float (&m)[2], const VTileUnit& u) {
  float4* po = sp.part_o + (int64_t(slot) * kConsumers3 + cw) * (16 * kWarpgroupThreads) + tid;
#pragma unroll
  for (int i = 0; i < 16; ++i) po[i * kWarpgroupThreads] = make_float4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
  const int row = tid / 32 * 16 + tid % 32 / 4;
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    if (tid % 4 == 0)
      sp.part_rows[(int64_t(slot) * kConsumers3 + cw) * kRowsPerConsumer + row + 8 * r] =
          make_float4(m[r], lsum, float(u.e_ref), 0.f);
  }
}

// Split item q's out and lse for consumer warpgroup cw's rows, this thread's the rows and
// accumulators of the consumer thread of the same index: the parts' partial states combined in part
// order (deterministic): m = max m_p, l = sum l_p 2^(m_p - m), O = sum O_p 2^(m_p - m) 2^(e_p - e)
// in the largest unit 2^e, then normalized and written as write_rows does (OutNorm), four
// accumulators at a time: the merge runs in the persistent kernel's epilogue too, where
// a whole O in registers disturbed the allocation of its tile loop (R2UR and spills in the SASS
// check). The states are read from L2 (ld.global.cg): the other parts' CTAs wrote them during this
// grid.
constexpr int kMaxParts = 4;  // split_parts' largest count (merge_parts3 keeps a factor pair per part)
template <bool kVTile>
__device__ __forceinline__ void merge_parts3(const FwdParams& p, const SplitParams& sp, int q, int cw, int tid) {
  const int parts = sp.parts;
  const WorkItem w = work_item<kQTile3>(p, unsigned(sp.first + q));
  const int warp = tid / 32, lane = tid % 32, quad = lane % 4;
  const int r0 = cw * kRowsPerConsumer + warp * 16 + lane / 4;
  const int rows[2] = {r0, r0 + 8};
  const int row0 = w.m_block * kQTile3;
  const int64_t tok_base = p.broadcast_q ? int64_t(w.b) * w.Lq : p.cu_q[w.qb];
  if (w.n_tiles == 0) {  // no keys in any part
    write_keyless_rows(p, w.h, tok_base, row0, w.Lq, rows, quad);
    return;
  }
  auto rows_of = [&](int part, int r) {
    return __ldcg(&sp.part_rows[(int64_t(q * parts + part) * kConsumers3 + cw) * kRowsPerConsumer + r0 -
                                cw * kRowsPerConsumer + 8 * r]);
  };
  float m[2] = {-INFINITY, -INFINITY};
  int e = -1000;
#pragma unroll
  for (int part = 0; part < kMaxParts; ++part) {
    if (part >= parts) break;
    for (int r = 0; r < 2; ++r) m[r] = fmaxf(m[r], rows_of(part, r).x);
    e = max(e, int(rows_of(part, 0).z));
  }
  float l[2] = {0.f, 0.f}, f[kMaxParts][2];
#pragma unroll
  for (int part = 0; part < kMaxParts; ++part) {
    for (int r = 0; r < 2; ++r) {
      f[part][r] = 0.f;
      if (part >= parts) continue;
      const float4 info = rows_of(part, r);
      const float g = exp2f(info.x - m[r]);
      l[r] += info.y * g;
      f[part][r] = g * pow2i_exact(int(info.z) - e);
    }
  }
  const OutNorm<kVTile> norm(p, w.b, w.h, e);
  const float inv[2] = {1.f / l[0], 1.f / l[1]};
  const float4* po = sp.part_o + int64_t(q * parts) * kConsumers3 * (16 * kWarpgroupThreads) +
                     cw * (16 * kWarpgroupThreads) + tid;
  constexpr int64_t kPartStride = int64_t(kConsumers3) * 16 * kWarpgroupThreads;
#pragma unroll 4
  for (int jn = 0; jn < 16; ++jn) {
    float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int part = 0; part < kMaxParts; ++part) {
      if (part >= parts) break;
      const float4 v = __ldcg(&po[part * kPartStride + jn * kWarpgroupThreads]);
      o[0] = fmaf(v.x, f[part][0], o[0]);
      o[1] = fmaf(v.y, f[part][0], o[1]);
      o[2] = fmaf(v.z, f[part][1], o[2]);
      o[3] = fmaf(v.w, f[part][1], o[3]);
    }
    const int col = 8 * jn + 2 * quad;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row0 + rows[r];
      if (i >= w.Lq) continue;
      *reinterpret_cast<__nv_bfloat162*>(p.out + ((tok_base + i) * p.heads + w.h) * kHeadDim + col) =
          __float22bfloat162_rn(norm.pair(o[2 * r], o[2 * r + 1], inv[r], col));
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + rows[r];
    if (i >= w.Lq) continue;
    if (quad == 0) p.lse[w.h * p.To + tok_base + i] = OutNorm<kVTile>::lse(m[r], l[r]);
  }
}

// After a part's consumer warpgroup cw has written its partial state (or, with no rows, nothing):
// the last of the item's parts to arrive merges them (merge_parts3). Each thread's stores are made
// visible device-wide (fence), the warpgroup meets, then one thread counts the part in, the
// warpgroup meets again to learn whether it was the last, and the last arrival's warpgroup fences
// again before it reads the others' states. (A first form counted before the first meeting: under
// racecheck's serialized schedule a part merged states not yet written, caught by the byte
// comparison of ForwardSplitTailBesidePersistentWholeItems.)
// slot: the part's (the item's sequence and rows are read again from the work list, so that no more
// than the slot stays live through the part's loop).
template <bool kVTile>
__device__ __forceinline__ void merge_when_last3(const FwdParams& p, const SplitParams& sp, int slot, int cw, int tid) {
  const int q = slot / sp.parts;
  const WorkItem w = work_item<kQTile3>(p, unsigned(sp.first + q));
  // Warpgroups with no rows merge nothing (and write no state in the parts of a keyed item).
  if (w.m_block * kQTile3 + cw * kRowsPerConsumer >= w.Lq) return;
  __threadfence();
  sm90::named_barrier_sync(kStageBarrier0 + cw, kWarpgroupThreads);  // every thread's state written and fenced
  bool last = false;
  if (tid == 0) last = atomicAdd(&sp.arrivals[q * kConsumers3 + cw], 1u) == unsigned(sp.parts - 1);
  if (!sm90::named_barrier_or(kStageBarrier0 + cw, kWarpgroupThreads, last)) return;
  __threadfence();
  merge_parts3<kVTile>(p, sp, q, cw, tid);
}

// One K/V tile of a three-consumer warpgroup, from its S (issued, in flight, into sc) to its
// promotion into o and the release of its stage: the serial chain consume_item3 runs per tile (a
// function of its own so that other schedules can run the same chain: branch exp/fwd-pairs).
// desc_v: the stage's V' tile.
template <bool kVTile, typename Storage, typename Softmax, typename Stamp>
__device__ __forceinline__ void tile3(Storage& s, float (&sc)[64], int j, int stage, uint64_t desc_v, const Softmax& sm,
                                      float (&o)[64], float (&m)[2], float (&l)[2], VTileUnit& vunit, Stamp& stamp) {
  constexpr uint64_t kHalfDesc = (kRowsPerConsumer * kHeadDim) >> 4;  // 64 rows of a V' tile
  sm90::wgmma_wait<0>();
  fence_all(sc);
  stamp(j, 2);
  // The tile's scales, read here: V's read next to the P.V issue put its R2UR (the promotion's
  // uniform arithmetic) between the wgmmas, behind the shared-memory load.
  const float ks = sm90::ld_shared_f32(&s.k_scale[stage]);
  const float vs = kVTile ? sm90::ld_shared_f32(&s.v_scale[stage]) : 0.f;
  uint32_t pa[16];
  float alpha[2];
  if constexpr (!kVTile) {
    // The keys past the sequence's end set to -inf in place, then the one unmasked softmax: the
    // two compiled softmax paths of the form below spilled a register in this instantiation.
    if (sm.masked_tile(j)) {
#pragma unroll
      for (int i = 0; i < 64; ++i) sc[i] = sm.template value<true>(sc, j, i);
    }
    const auto rs = sm.template max_phase<false>(sc, j, ks, m, l, alpha);
    stamp(j, 3);
    sm.template exp_phase<false>(sc, j, rs, l, pa);
  } else if (sm.masked_tile(j)) {
    const auto rs = sm.template max_phase<true>(sc, j, ks, m, l, alpha);
    sm.template exp_phase<true>(sc, j, rs, l, pa);
  } else {
    const auto rs = sm.template max_phase<false>(sc, j, ks, m, l, alpha);
    stamp(j, 3);
    sm.template exp_phase<false>(sc, j, rs, l, pa);
  }
  // P.V in two 64-channel halves (two commit groups): the first half is promoted while the
  // second runs.
  float ot_lo[32], ot_hi[32];  // channels 0..63 and 64..127 (O's accumulators 0..31, 32..63)
  sm90::wgmma_fence();
  sm90::wgmma_rs_steps<kTile / 32>(ot_lo, pa, desc_v, true);
  sm90::wgmma_commit();
  sm90::wgmma_rs_steps<kTile / 32>(ot_hi, pa, desc_v + kHalfDesc, true);
  sm90::wgmma_commit();
  stamp(j, 4);
  const VTilePromotion pr = kVTile ? promote_vtile_prepare(alpha, vs, vunit) : plain_promotion(alpha);
  sm90::wgmma_wait<1>();
  fence_all(ot_lo);
  promote_vtile_apply<32>(o, ot_lo, pr);
  sm90::wgmma_wait<0>();
  fence_all(ot_hi);
#pragma unroll
  for (int i = 0; i < 16; ++i) sm90::fence_regs(pa[i]);  // P was read until here
  stamp(j, 5);
  sm90::mbar_arrive(&s.empty[stage]);
  promote_vtile_apply<32>(o + 32, ot_hi, pr);
  stamp(j, 6);
}

// kParts = false: CTA i runs item i whole (items 0 .. sp.first - 1). kParts = true: CTA q runs part
// q of the split items (work_part3) and writes its partial state, and the item's last part to finish
// merges the item's states into out and lse (merge_when_last3); that grid is launched as the first
// one's programmatic dependent, so its CTAs start on the SMs the first grid's last wave leaves idle,
// and completes only after the first grid (its producer thread waits for it), so that whatever
// follows finds out and lse complete. Two
// instantiations rather than a branch on the CTA index: with the split's epilogue in the same
// kernel ptxas scheduled the main loop differently, 1.3% slower on llm (H200, same run).
// A consumer warpgroup (cw) of a three-consumer CTA on item w: S, softmax, P.V and the promotion of
// each K/V tile in series, then the epilogue (kParts: the part's partial state). Q from q_tile,
// complete at phase q_phase of q_full; `it` K/V tiles consumed before (persistent CTAs, else 0).
// kPersistent: the rows' Q scales from qs (shared memory, written with Q; rows past the sequence
// 0), and items with no keys are the caller's.
template <int kVariant, bool kParts, bool kPersistent, typename Storage>
__device__ __forceinline__ void consume_item3(Storage& s, const uint8_t* q_tile, uint64_t* q_full, uint32_t q_phase,
                                              const float* qs, const FwdParams& p, const SplitParams& sp,
                                              const WorkItem& w, int cw, int tid, int it,
                                              const CUtensorMap* tm_o = nullptr, const int* slot_at = nullptr) {
  // kVTile: V' with one scale per 128-key tile (the operands), folded into every promotion; else
  // V's per-(sequence, channel) scales (the MX tensors' prepare pass), applied in the epilogue.
  constexpr bool kVTile = (kVariant & kVariantVTile) != 0;
  const int h = w.h, b = w.b, n_tiles = w.n_tiles;
  const int warp = tid / 32, lane = tid % 32, quad = lane % 4;
  const int r0 = cw * kRowsPerConsumer + warp * 16 + lane / 4;  // rows r0 and r0 + 8 of the Q tile
  const int rows[2] = {r0, r0 + 8};
  const int Lq = w.Lq, Lk = w.Lk - w.j0 * kTile;  // keys from the first K/V tile of this CTA on
  const int row0 = w.m_block * kQTile3;  // the tile's first row within its Q sequence
  const int64_t tok_base = p.broadcast_q ? int64_t(b) * Lq : p.cu_q[w.qb];
  if (!kPersistent && n_tiles == 0) {  // no keys: out = 0, lse = -inf (a split item's part: an empty partial state)
    if constexpr (kParts) {
      float o[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] = 0.f;
      const float l[2] = {0.f, 0.f}, m[2] = {-INFINITY, -INFINITY};
      write_partial3(sp, w.slot, cw, tid, o, l, m, VTileUnit{});
    } else {
      write_keyless_rows(p, h, tok_base, row0, Lq, rows, quad);
    }
    return;
  }
  if (row0 + cw * kRowsPerConsumer >= Lq) {  // no rows in this warpgroup: release the stages only
    for (int j = 0; j < n_tiles; ++j) {
      sm90::mbar_wait(&s.full[stage_of(it + j)], phase_of(it + j));
      sm90::mbar_arrive(&s.empty[stage_of(it + j)]);
    }
    return;
  }
  float row_mult[2];  // rows past Lq (their Q row scale may lie past the array) get 0
  if constexpr (kPersistent) {
    sm90::mbar_wait(q_full, q_phase);
    for (int r = 0; r < 2; ++r) row_mult[r] = sm90::ld_shared_f32(&qs[rows[r]]) * p.scale_log2;
  } else {
    for (int r = 0; r < 2; ++r)
      row_mult[r] = (row0 + rows[r] < Lq ? p.q_scale[w.q_row + rows[r]] : 0.f) * p.scale_log2;
  }
  constexpr bool kCausal = (kVariant & kVariantCausal) != 0;
  static_assert(!kCausal || !kParts, "the causal mask runs without a split tail");
  const auto sm = make_softmax<(kVariant & kVariantTree) != 0, kCausal>(p, row_mult, Lq, Lk, row0, cw * kRowsPerConsumer,
                                                                        quad);

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  VTileUnit vunit;
  if constexpr (!kPersistent) sm90::mbar_wait(q_full, q_phase);
  const uint64_t desc_q = sm90::make_desc_k128b(q_tile + cw * kRowsPerConsumer * kHeadDim);
  const uint64_t desc_k0 = sm90::make_desc_k128b(s.k[0]), desc_v0 = sm90::make_desc_k128b(s.v[0]);
  constexpr uint64_t kStageDesc = kTileBytes >> 4;
  // kVariantTrace: the per-tile clock trace (slot = K/V tile; events as the two-consumer kernel's,
  // scripts/attn_trace.py); kVariantTracePin: the same code with no CTA traced.
  constexpr bool kTrace = (kVariant & (kVariantTrace | kVariantTracePin)) != 0;
  const unsigned none = (kVariant & kVariantTracePin) != 0 ? unsigned(p.num_items) : 0u;  // past every CTA
  const int trace_row = kTrace && warp == 0 && lane == 0
                            ? trace_cta_slot(blockIdx.x, none ? none : 0u, none ? none : 700u, none ? none : 1400u,
                                             none ? none : 1900u)
                            : -1;
  auto stamp = [&](int j, int event) {
    if constexpr (kTrace) trace_stamp(trace_row, cw, j, event);
  };
  // Tile j from its S (issued, in flight) to its promotion.
  auto tile = [&](float(&sc)[64], int j) {
    const int stage = stage_of(it + j);
    tile3<kVTile>(s, sc, j, stage, desc_v0 + uint64_t(stage) * kStageDesc, sm, o, m, l, vunit, stamp);
  };
  // kCausal: the item's last tiles may lie past every row of this warpgroup (its rows are the tile's
  // first 64 or 128): the warpgroup releases them unread (its O, l and m would not change).
  [[maybe_unused]] const int keys_last =
      kCausal ? causal_row_keys(row0 + cw * kRowsPerConsumer + kRowsPerConsumer - 1, causal_off(p.causal_br, Lq, Lk), Lk)
              : 0;
  for (int j = 0; j < n_tiles; ++j) {
    const int stage = stage_of(it + j);
    stamp(j, 0);
    float sc[64];
    sm90::mbar_wait(&s.full[stage], phase_of(it + j));
    if (kCausal && j * kTile >= keys_last) {
      sm90::mbar_arrive(&s.empty[stage]);
      continue;
    }
    issue_s(sc, desc_q, desc_k0 + uint64_t(stage) * kStageDesc);
    stamp(j, 1);
    tile(sc, j);
  }

  // ---------------------------------------------------------------------------- epilogue
  if constexpr (kParts) {
    write_partial3(sp, w.slot, cw, tid, o, l, m, vunit);
  } else if constexpr (kPersistent) {  // out staged for TMA stores (kernel3p, out 16-byte aligned)
    // A split item's part (kernel3p runs them after the whole items): its slot read here from the
    // published item (warp-uniform, as the branch around wgmma code must be), so that it does not
    // stay live through the loop.
    const int slot = slot_at != nullptr ? __shfl_sync(0xFFFFFFFFu, *slot_at, 0) : -1;
    if (slot >= 0) {
      write_partial3(sp, slot, cw, tid, o, l, m, vunit);
      merge_when_last3<kVTile>(p, sp, slot, cw, tid);
    } else if (tm_o != nullptr)
      write_rows_staged<kVTile, kCausal>(p, tm_o, s.o_stage[cw], cw, warp, lane, o, l, m, vunit, b, h, tok_base, row0,
                                         Lq, rows, quad);
    else
      write_rows<kVTile, kCausal>(p, o, l, m, vunit, b, h, tok_base, row0, Lq, rows, quad);
  } else {
    write_rows<kVTile>(p, o, l, m, vunit, b, h, tok_base, row0, Lq, rows, quad);
  }
}


template <int kVariant, bool kParts = false>
__global__ void __launch_bounds__(kThreads3, 1)
    attention_fwd_kernel3(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const FwdParams p, const SplitParams sp) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage3& s = aligned_shared<SharedStorage3>(smem_raw);
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % kWarpgroupThreads;
  // (The parts' grid follows an upload as an ordinary launch, or this kernel's whole-item grid as a
  // programmatic dependent: that grid has waited for the list before its CTAs let the parts start.)
  if constexpr (!kParts) wait_for_work_list();
  const WorkItem w = kParts ? work_part3(p, sp, blockIdx.x) : work_item<kQTile3>(p, blockIdx.x);
  if constexpr (!kParts) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  init_pipeline(&s.q_full, s.full, s.empty, kConsumers3);
  const int n_tiles = w.n_tiles;

  if (wg == 0) {  // ------------------------------------------------------------ producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    // Q in three boxes of 64 rows (the map's box); rows past the sequence's padded end belong to
    // the next sequence or head, or lie past the tensor (zero-filled): only their own rows of S
    // see them, and those rows are never written.
    if (tid == 0 && n_tiles > 0) produce_item<kVariant, kConsumers3, kRowsPerConsumer>(s, &tm_q, &tm_k, &tm_v, p, w, 0);
    if (kParts && tid == 0) asm volatile("griddepcontrol.wait;" ::: "memory");  // complete after the first grid
    return;
  }

  // ------------------------------------------------------------------------------ consumers
  sm90::setmaxnreg_inc<kConsumerRegs3>();
  consume_item3<kVariant, kParts, false>(s, s.q, &s.q_full, 0, nullptr, p, sp, w, wg - 1, tid, 0);
  if constexpr (kParts) merge_when_last3<(kVariant & kVariantVTile) != 0>(p, sp, w.slot, wg - 1, tid);
}

// The persistent three-consumer kernel (attention_fwd_kernel3p, persistent_ctas on the host): one
// CTA per SM runs whole items 0 .. sp.first - 1, CTA c item c first, then each the first item not
// yet taken (`next_item`, a counter zeroed with the work list's upload), so items of unequal length
// (jagged batches, longest first) balance as the CTA-per-item kernel's do; static strides measured
// 1-3% slower on jagged. Per item the CTA-per-item kernel pays its launch, the barriers' set-up, the
// first loads' latency and an epilogue that no other warpgroup's work covers. Here the K/V stages run
// on across items, and the producer warp publishes each item (its WorkItem, Q and the rows' Q
// scales) through one of two buffers an item ahead, freed when all three consumers are done with it:
// the consumers read no global memory between items, and each goes on to its next item as soon as
// it has written its rows. Every item is computed whole by one CTA, in the same order as by
// attention_fwd_kernel3: the same bytes (GPU tests). A first form with a second producer warp
// polling for the buffers and the consumers computing each WorkItem from global memory ran 1-3%
// slower than a CTA per item on 2048-8192 keys; re-synchronizing the consumers at each item (a
// named barrier) gained nothing.
inline constexpr int kQBuffers = 2;  // the persistent kernels' item buffers (3 measured the same or 1% slower)
struct SharedStorage3P {
  alignas(1024) uint8_t q[kQBuffers][kQTile3 * kHeadDim];
  alignas(1024) uint8_t k[kStages][kTileBytes];
  alignas(1024) uint8_t v[kStages][kTileBytes];
  float k_scale[kStages];
  float v_scale[kStages];
  float qs[kQBuffers][kQTile3];  // each buffer's row scales (rows past the sequence: 0)
  WorkItem item[kQBuffers];      // each buffer's item; n_tiles < 0: no more items
  alignas(8) uint64_t q_full[kQBuffers];
  uint64_t q_empty[kQBuffers];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  alignas(1024) uint8_t o_stage[kConsumers3][kStageBytes];  // write_rows_staged
};
inline constexpr size_t kSmemBytes3P = sizeof(SharedStorage3P) + 1024;
static_assert(kSmemBytes3P <= 227 * 1024, "the persistent three-consumer kernel's shared memory (sm_90: 227 KB)");
// The two-consumer kernel's (attention_fwd_kernel2p): the same, with its exponential turns' words.
struct SharedStorage2P {
  alignas(1024) uint8_t q[kQBuffers][kTileBytes];
  alignas(1024) uint8_t k[kStages][kTileBytes];
  alignas(1024) uint8_t v[kStages][kTileBytes];
  float k_scale[kStages];
  float v_scale[kStages];
  float qs[kQBuffers][kTile];
  WorkItem item[kQBuffers];
  alignas(8) uint64_t q_full[kQBuffers];
  uint64_t q_empty[kQBuffers];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  float turn_zero;
  float turn_sink[kConsumerWarpgroups * kWarpgroupThreads];
  alignas(1024) uint8_t o_stage[kConsumerWarpgroups][kStageBytes];  // write_rows_staged
};
inline constexpr size_t kSmemBytes2P = sizeof(SharedStorage2P) + 1024;

// An item read from shared memory, made known to the compiler as warp-uniform (lane 0's): as
// attn::warp_uniform, without the fields the consumers do not take from registers (j0: the producer
// publishes a part's keys from its first tile on; slot: read after the loop from shared memory),
// which kept the persistent kernels' loops as measured.
__device__ __forceinline__ WorkItem warp_uniform_item(const WorkItem& x) {
  WorkItem w;
  w.h = __shfl_sync(0xFFFFFFFFu, x.h, 0);
  w.b = __shfl_sync(0xFFFFFFFFu, x.b, 0);
  w.m_block = __shfl_sync(0xFFFFFFFFu, x.m_block, 0);
  w.qb = __shfl_sync(0xFFFFFFFFu, x.qb, 0);
  w.Lq = __shfl_sync(0xFFFFFFFFu, x.Lq, 0);
  w.Lk = __shfl_sync(0xFFFFFFFFu, x.Lk, 0);
  w.n_tiles = __shfl_sync(0xFFFFFFFFu, x.n_tiles, 0);
  w.q_row = __shfl_sync(0xFFFFFFFFu, x.q_row, 0);
  return w;
}

// Thread 0 of a persistent kernel (Storage: SharedStorage3P or SharedStorage2P, consumer_warpgroups
// consumers): its barriers, init_pipeline's and the Q buffers'.
template <typename Storage>
__device__ __forceinline__ void init_persistent(Storage& s, int consumer_warpgroups) {
  constexpr int kQArrivals = 32;  // the producer warp's lanes (lane 0's with Q's expect_tx)
  if (threadIdx.x == 0) {
    for (int i = 1; i < kQBuffers; ++i) sm90::mbar_init(&s.q_full[i], kQArrivals);
    for (int i = 0; i < kQBuffers; ++i) sm90::mbar_init(&s.q_empty[i], consumer_warpgroups * kWarpgroupThreads);
  }
  init_pipeline(&s.q_full[0], s.full, s.empty, consumer_warpgroups, kQArrivals);
}

// The producer warp of a persistent kernel: items of kQRows rows (Q in kQBoxes boxes), CTA c item c
// first, then the first not yet taken (next_item); units past the `items` whole items are the split
// items' parts (sp, three consumers: work_part3), `units` in all. Each is published in Q buffer n % kQBuffers (its
// WorkItem, Q and its rows' Q scales, rows past the sequence 0) once the consumers have freed it,
// then its K/V tiles into the stages; an item with n_tiles = -1 at the end. The item's global reads
// (the work list, the sequence bounds, the rows' Q scales and its first K/V tile's scales: a chain
// of dependent loads) are made before the wait for the buffer, so that only stores and TMA issues
// follow the consumers' release.
template <int kVariant, int kQRows, int kQBoxes, typename Storage>
__device__ __forceinline__ void produce_persistent(Storage& s, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                                   const CUtensorMap* tm_v, const FwdParams& p, unsigned items,
                                                   unsigned units, const SplitParams& sp, unsigned* next_item,
                                                   int lane) {
  constexpr int kRowsPerLane = kQRows / 32;
  int it = 0;  // K/V tiles loaded before
  for (unsigned n = 0, index = blockIdx.x;; ++n) {
    const unsigned qb = n % kQBuffers;
    const bool more = index < units;
    unsigned next = 0;  // the CTA's next item: the first not yet taken
    WorkItem w{};
    float qs[kRowsPerLane];
    float2 first_scales = make_float2(0.f, 0.f);
    if (more) {
      if (lane == 0) next = gridDim.x + atomicAdd(next_item, 1u);
      w = index < items ? work_item<kQRows, (kVariant & kVariantCausal) != 0>(p, index) : work_part3(p, sp, index - items);
      const int row0 = w.m_block * kQRows;
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int r = lane + 32 * i;
        qs[i] = w.n_tiles > 0 && row0 + r < w.Lq ? p.q_scale[w.q_row + r] : 0.f;
      }
      if (lane == 0 && w.n_tiles > 0) first_scales = kv_tile_scales<kVariant>(p, w, 0);
    }
    sm90::mbar_wait(&s.q_empty[qb], ((n / kQBuffers) & 1u) ^ 1u);
    if (!more) {  // the end
      if (lane == 0) s.item[qb].n_tiles = -1;
      sm90::mbar_arrive(&s.q_full[qb]);
      return;
    }
    if (w.n_tiles > 0)
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) s.qs[qb][lane + 32 * i] = qs[i];
    if (lane == 0) {
      WorkItem published = w;  // a part's keys from its first K/V tile on (the consumers take no j0)
      published.Lk -= w.j0 * kTile;
      published.j0 = 0;
      s.item[qb] = published;
      if (w.n_tiles > 0) {
        produce_q<kQBoxes, kQRows / kQBoxes>(s.q[qb], &s.q_full[qb], tm_q, w);
      } else {
        sm90::mbar_arrive(&s.q_full[qb]);
      }
    } else {
      sm90::mbar_arrive(&s.q_full[qb]);
    }
    if (lane == 0 && w.n_tiles > 0) produce_kv<kVariant>(s, tm_k, tm_v, p, w, it, &first_scales);
    it += max(w.n_tiles, 0);
    index = __shfl_sync(0xFFFFFFFFu, next, 0);
  }
}

// A consumer warpgroup (cw) of a persistent kernel: the published items in turn; items with no keys
// get out = 0 and lse = -inf, the others consume(w, Q buffer, its phase, K/V tiles consumed before).
// kParts (three consumers): the units past the whole items are split items' parts, consumed even
// when the part has no K/V tile (consume_item3 then writes an empty state).
template <int kQRows, bool kParts, typename Storage, typename Consume>
__device__ __forceinline__ void consume_persistent(Storage& s, const FwdParams& p, int cw, int tid, Consume&& consume) {
  int it = 0;
  for (unsigned n = 0;; ++n) {
    const int qb = int(n % kQBuffers);
    const uint32_t phase = (n / kQBuffers) & 1u;
    sm90::mbar_wait(&s.q_full[qb], phase);
    const WorkItem w = warp_uniform_item(s.item[qb]);
    if (w.n_tiles < 0) break;
    if (w.n_tiles == 0 && !(kParts && __shfl_sync(0xFFFFFFFFu, s.item[qb].slot, 0) >= 0)) {  // no keys: out = 0, lse = -inf (a part: its state)
      const int warp = tid / 32, lane = tid % 32;
      const int r0 = cw * kRowsPerConsumer + warp * 16 + lane / 4;
      const int rows[2] = {r0, r0 + 8};
      const int64_t tok_base = p.broadcast_q ? int64_t(w.b) * w.Lq : p.cu_q[w.qb];
      write_keyless_rows(p, w.h, tok_base, w.m_block * kQRows, w.Lq, rows, lane % 4);
    } else {
      consume(w, qb, phase, it);
      it += w.n_tiles;
    }
    sm90::mbar_arrive(&s.q_empty[qb]);
  }
}

template <int kVariant, bool kStaged>
__global__ void __launch_bounds__(kThreads3, 1)
    attention_fwd_kernel3p(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                           const __grid_constant__ CUtensorMap tm_v, const FwdParams p, const SplitParams sp,
                           unsigned* next_item, const __grid_constant__ CUtensorMap tm_o) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage3P& s = aligned_shared<SharedStorage3P>(smem_raw);
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % kWarpgroupThreads;
  wait_for_work_list();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  init_persistent(s, kConsumers3);
  if (wg == 0) {  // ------------------------------------------------------------ producer
    sm90::setmaxnreg_dec<kProducerRegs3>();
    if (tid < 32)
      produce_persistent<kVariant, kQTile3, kConsumers3>(s, &tm_q, &tm_k, &tm_v, p, unsigned(sp.first),
                                                         unsigned(sp.first + sp.slots), sp, next_item, tid);
    return;
  }
  // ------------------------------------------------------------------------------ consumers
  sm90::setmaxnreg_inc<kConsumerRegs3>();
  const int cw = wg - 1;
  consume_persistent<kQTile3, true>(s, p, cw, tid, [&](const WorkItem& w, int qb, uint32_t phase, int it) {
    consume_item3<kVariant, false, true>(s, s.q[qb], &s.q_full[qb], phase, s.qs[qb], p, sp, w, cw, tid, it,
                                         kStaged ? &tm_o : nullptr, &s.item[qb].slot);
  });
  if (kStaged && tid == 0) sm90::bulk_wait<0>();  // the last stores done before the shared memory goes
}

// The persistent two-consumer kernel (persistent_ctas on the host): attention_fwd_kernel3p's scheme
// (items published by the producer warp, the K/V stages running on across items) around the
// two-consumer kernel's consumers, whose exponential turns start afresh with each item.
template <int kVariant>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_kernel2p(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                           const __grid_constant__ CUtensorMap tm_v, const FwdParams p, unsigned* next_item,
                           const __grid_constant__ CUtensorMap tm_o, bool staged) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage2P& s = aligned_shared<SharedStorage2P>(smem_raw);
  const int wg = warpgroup_index();
  const int tid = threadIdx.x % kWarpgroupThreads;
  wait_for_work_list();
  if (threadIdx.x == 0) s.turn_zero = 0.f;
  init_persistent(s, kConsumerWarpgroups);
  if (wg == 0) {  // ------------------------------------------------------------ producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid < 32)
      produce_persistent<kVariant, kTile, 1>(s, &tm_q, &tm_k, &tm_v, p, unsigned(p.num_items), unsigned(p.num_items),
                                             SplitParams{}, next_item, tid);
    return;
  }
  // ------------------------------------------------------------------------------ consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 1;
  const int warp = tid / 32, lane = tid % 32, quad = lane % 4;
  const int r0 = cw * kRowsPerConsumer + warp * 16 + lane / 4;  // rows r0 and r0 + 8 of the Q tile
  const int rows[2] = {r0, r0 + 8};
  const CUtensorMap* out_map = staged ? &tm_o : nullptr;  // staged: out 16-byte aligned (TMA)
  consume_persistent<kTile, false>(s, p, cw, tid, [&](const WorkItem& w, int qb, uint32_t phase, int it) {
    consume_item<kVariant, true>(s, s.q[qb], &s.q_full[qb], phase, s.qs[qb], p, w, cw, warp, lane, quad, rows, it,
                                 out_map, s.o_stage[cw]);
  });
  if (staged && tid == 0) sm90::bulk_wait<0>();  // the last stores done before the shared memory goes
}

}  // namespace attn

namespace {

// Tree reductions + FA3's intra-warpgroup order (H200, same run as variant 1: +4-7% on every
// preset). The kernel on operands in the execution layout (V per tile) also packs P as it is
// computed (kVariantPackEarly, 2026-11-29 evening: +4-5% against the same loop without it, same
// run); on the MX tensors' operands that form gained ~1% but keeps a spilled register in its loop
// (tests/sass/check_fwd_schedule.py), so that path stays without it.
// Since 2026-11-29 night the operands kernel also has its warpgroups take turns for their
// exponentials instead of for their GEMMs (kVariantExpTurn | kVariantNoTurn: +1-2% on every
// preset against kPrevDefaultVariantVTile in two same-binary runs, docs/attention.md).
constexpr int kDefaultVariant = attn::kVariantTree | attn::kVariantOverlap;
constexpr int kPrevDefaultVariantVTile = kDefaultVariant | attn::kVariantVTile | attn::kVariantPackEarly;
constexpr int kDefaultVariantVTile = kPrevDefaultVariantVTile | attn::kVariantExpTurn | attn::kVariantNoTurn;

#if MXFLASH_FWD_EXPERIMENTS
// MXFLASH_FWD_VARIANT (experiment builds only): the attn kernel variant to launch (see kVariantTree
// and variant_diag); -1 or unset = the default.
int experiment_variant() {
  static const int v = [] {
    const char* e = std::getenv("MXFLASH_FWD_VARIANT");
    return e ? std::atoi(e) : -1;
  }();
  return v;
}
#endif

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

struct WorkspaceLayout {
  size_t q, k, v, q_scale, k_scale, v_byte, v_scale, tiles, total;
};

// tiles_bytes: the work list and, right behind it, the split tail's partial states
// (exec_workspace_bytes).
WorkspaceLayout layout_of(int batch, int64_t heads, int64_t Pq, int64_t Pk, size_t tiles_bytes) {
  WorkspaceLayout w;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  w.q = take(size_t(heads) * Pq * kHeadDim);
  w.k = take(size_t(heads) * Pk * kHeadDim);
  w.v = take(size_t(heads) * Pk * kHeadDim);
  w.q_scale = take(size_t(heads) * Pq * sizeof(float));
  w.k_scale = take(size_t(heads) * (Pk / attn::kTile) * sizeof(float));
  w.v_byte = take(size_t(batch) * heads * kHeadDim);
  w.v_scale = take(size_t(batch) * heads * kHeadDim * sizeof(float));
  w.tiles = take(tiles_bytes);
  w.total = off;
  return w;
}

// The work list (FwdParams::tiles): the Q tiles of every sequence, the sequences facing the most
// keys first.
std::vector<int2> schedule(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, int batch,
                           bool broadcast_q, int q_tile = attn::kTile) {
  std::vector<int> tiles_of(static_cast<size_t>(batch)), keys_of(static_cast<size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    const int qb = broadcast_q ? 0 : b;
    tiles_of[size_t(b)] = (cu_q[qb + 1] - cu_q[qb] + q_tile - 1) / q_tile;
    keys_of[size_t(b)] = cu_k[b + 1] - cu_k[b];
  }
  return attn::work_list(tiles_of, keys_of);
}

}  // namespace

namespace {
// The driver's cuTensorMapEncodeTiled, looked up once.
Status tensor_map_encoder(PFN_cuTensorMapEncodeTiled_v12000* out) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    MXFLASH_RETURN_IF_ERROR(cuda_error(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q),
        "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)"));
    if (q != cudaDriverEntryPointSuccess || !fn) return Status::Cuda("cuTensorMapEncodeTiled not found in the driver");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  *out = encode;
  return Status::Ok();
}
Status encode_result(CUresult r) {
  if (r != CUDA_SUCCESS) return Status::Cuda("cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)));
  return Status::Ok();
}
}  // namespace

// A 2-D uint8 tensor map (rows of `inner` bytes) loading 128 x 128 tiles with the 128-byte swizzle.
Status make_tile_map(CUtensorMap* map, void* base, uint64_t inner, uint64_t rows, uint32_t box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  MXFLASH_RETURN_IF_ERROR(tensor_map_encoder(&encode));
  const cuuint64_t dims[2] = {inner, rows};
  const cuuint64_t strides[1] = {inner};
  const cuuint32_t box[2] = {attn::kTile, box_rows};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return encode_result(r);
}

namespace {
// A 3-D map of a (rows, heads, 128) tensor of `elem_bytes`-byte elements (`type`), boxes of
// box_channels x 1 head x box_rows with the 128-byte swizzle (box_channels x elem_bytes = 128).
Status make_rows_map(CUtensorMap* map, void* base, CUtensorMapDataType type, uint64_t elem_bytes, uint64_t rows,
                     uint64_t heads, uint32_t box_channels, uint32_t box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  MXFLASH_RETURN_IF_ERROR(tensor_map_encoder(&encode));
  const cuuint64_t dims[3] = {kHeadDim, heads, rows};
  const cuuint64_t strides[2] = {kHeadDim * elem_bytes, heads * kHeadDim * elem_bytes};
  const cuuint32_t box[3] = {box_channels, 1, box_rows};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode(map, type, 3, base, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return encode_result(r);
}

}  // namespace

Status make_bf16_rows_map(CUtensorMap* map, void* base, uint64_t rows, uint64_t heads) {
  return make_rows_map(map, base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, std::max<uint64_t>(rows, 1), heads, 64,
                       attn::kStagedRows);
}


namespace {
// Whether the forward (on operands or on MX tensors, H200 2026-11-30: llm 613 against 565 TFLOP/s on
// MX tensors, llm-long 822 against 767) runs with three consumer warpgroups (Q tiles of 192 rows,
// attention_fwd_kernel3) instead of two (128 rows): when the 192-row tiles pad Q's sequences to at
// most 5% more rows than the 128-row tiles do (H200, 2026-11-30: llm's 2048-row sequences, 3% more
// rows, ran 5-6% faster on three), or to at most 15% more where the three-consumer items fill at
// least 20 rounds of the SMs: a 512-row Q's third tile has one idle consumer, which costs less
// than a third of a tile, but the fewer, larger items leave a longer partial last round (cross:
// 576 items, 4.4 rounds, 5% slower on three even with the split tail; jagged: 6912 items, 52
// rounds, faster on three in three calls: 811 against 783, 774-776 against 743, and with this rule
// 793 against 782 forced onto two, TFLOP/s).
// MXFLASH_FWD_CONSUMERS=2|3 forces one (tests, A/B runs), read at every call; else, in experiments
// builds, a set MXFLASH_FWD_VARIANT decides (three with bit kThreeConsumerVariant), so the GPU
// tests' comparison of both counts compares the default two-consumer kernel with the variant.
#if MXFLASH_FWD_EXPERIMENTS
constexpr int kThreeConsumerVariant = 1 << 26;
#endif
// sms: the device's SM count (0: no device).
bool three_consumers(const std::vector<int32_t>& cu_q, int batch, int64_t heads, bool broadcast_q, int sms) {
  if (const char* e = std::getenv("MXFLASH_FWD_CONSUMERS")) {
    if (std::string(e) == "2") return false;
    if (std::string(e) == "3") return true;
  }
#if MXFLASH_FWD_EXPERIMENTS
  if (experiment_variant() >= 0) return (experiment_variant() & kThreeConsumerVariant) != 0;
#endif
  int64_t rows2 = 0, rows3 = 0;
  for (int b = 0; b < (broadcast_q ? 1 : batch); ++b) {
    const int64_t n = cu_q[size_t(b) + 1] - cu_q[size_t(b)];
    rows2 += (n + attn::kTile - 1) / attn::kTile * attn::kTile;
    rows3 += (n + attn::kQTile3 - 1) / attn::kQTile3 * attn::kQTile3;
  }
  if (rows3 * 100 <= rows2 * 105) return true;
  if (rows3 * 100 > rows2 * 115 || sms <= 0) return false;
  const int64_t items3 = rows3 / attn::kQTile3 * heads * (broadcast_q ? batch : 1);
  return items3 >= 20 * int64_t(sms);
}

// The split tail of the three-consumer kernel. Its CTAs (one per SM: registers and shared memory
// allow no second) run the work list's items in order, so with items of equal work a last, partial
// wave of r = items mod SMs CTAs leaves the other SMs idle for a whole item (llm-long: 1376 items on
// 132 SMs, 10.4 waves of work in 11 rounds). Those last r items then run as `parts` CTAs each, one
// contiguous share of the item's K/V tiles per CTA, and the last part of each item to finish
// combines their partial states (merge_when_last3; a merge kernel of its own until 2026-11-30:
// 11.5 us under ncu on llm-long): the tail takes ceil(r parts / SMs) / parts of a round instead of one. parts in 2..4 where
// that shortens the tail, at most 2 x SMs parts in all (the partial states' workspace), and parts
// of at least kSplitMinTiles K/V tiles of the tail's longest item (a part of a shorter item may get
// no tile: it writes an empty state); 1 otherwise. H200, 2026-11-30: llm-long (64 K/V tiles, 2
// parts) 1.9% faster, llm (16 tiles, 3 parts) 2.5% slower: a part's start (Q, the first K/V
// tiles) and the merge cost more than a third of a short item saves. MXFLASH_FWD_SPLIT=1..4 forces a part count (A/B runs and tests; still
// at most that tile count), read at every call. Splitting changes the summation order (each part
// quantizes P against its own running row maxima), so out and lse depend, in their last bits, on
// which items are split: on the work list's order and on the device's SM count.
constexpr int kSplitMinTiles = 16;
int split_parts(int64_t r, int sms, int max_tiles) {
  if (r == 0) return 1;
  if (const char* e = std::getenv("MXFLASH_FWD_SPLIT")) {
    const int forced = std::atoi(e);
    if (forced >= 1 && forced <= attn::kMaxParts) return std::max(1, std::min(forced, max_tiles));
  }
  int best = 1;
  double rounds = 1.0;  // the tail's length in item rounds
  for (int k = 2; k <= attn::kMaxParts && k * kSplitMinTiles <= max_tiles && r * k <= 2 * int64_t(sms); ++k) {
    const double t = double((r * k + sms - 1) / sms) / k;
    if (t < rounds - 1e-9) rounds = t, best = k;
  }
  return best;
}

// How many CTAs of the persistent kernels (attention_fwd_kernel3p, attention_fwd_kernel2p) run the
// forward's whole items: one per SM (sms), or 0 for one CTA per item (attention_fwd_kernel3,
// attention_fwd_kernel). A CTA per item pays per item what the persistent kernels hide (the CTA's
// start, the first loads' latency, an epilogue no other warpgroup's work covers): ~2.6 K/V tiles'
// time on the H200 (2026-11-30, the time's intercept against the K/V length at a fixed item count).
// Persistent where the longest K/V sequence has at most kPersistentMaxTiles tiles (either consumer
// count). H200, same calls, TFLOP/s on operands against a CTA per item:
// three consumers: 512-token sequences 587 against 479, 1024 698 against 639, llm (2048) 777
// against 752, 4096 keys +1.3%, 8192 (llm-long) -0.4 to 0%, jagged (up to 16384) equal; two
// consumers: 128-token sequences 198 against 160, 256 374 against 290, 1024 keys +4%, 16384 keys
// (cross) -4.5%; since the staged epilogue (2026-11-30 05:38 UTC, broadcast Lq=512, H=3, two rounds)
// 4096 keys (B=256) 748 against 739, 8192 (B=128) 761-765 against 782, 2048 (B=512) equal: two
// consumers up to 32 tiles too.
// MXFLASH_FWD_PERSISTENT forces it, read at every call: 0 = off, 1 = one CTA per SM, n >= 2 = at
// most n CTAs (tests: each CTA then walks many items).
// Where items are split (three consumers; split_parts), the whole items run persistent at any
// length: the split tail then ends a persistent grid instead of CTAs of an item each. H200,
// 2026-11-30 19:48 UTC, llm-long (8192 keys, 1320 whole items, 56 split in 2 parts), same call, two
// rounds: 901-903 TFLOP/s against 882 for a CTA per whole item (cuDNN FP8 916); persistent without
// the split 870-873. jagged (split too) 810 against 807-808.
constexpr int kPersistentMaxTiles = 32;
// The persistent grid's CTAs, 0 for a CTA per item: `wanted` by the rule above (items split, or no
// K/V sequence longer than kPersistentMaxTiles tiles), unless MXFLASH_FWD_PERSISTENT says otherwise.
int persistent_ctas(int sms, bool wanted) {
  if (const char* e = std::getenv("MXFLASH_FWD_PERSISTENT")) {
    const int n = std::atoi(e);
    if (n == 0) return 0;
    return n >= 2 ? std::min(n, sms) : sms;
  }
  return wanted ? sms : 0;
}

// How the forward (on operands or MX tensors alike) runs a problem: the consumer count, the work
// list (Q tiles of 128 or, three consumers, 192 rows) and the split tail.
struct ExecPlan {
  bool three = false;
  std::vector<int2> tiles;
  int64_t items = 0;        // tiles x heads
  int64_t split_first = 0;  // items from here on run in split_parts parts each (= items: none)
  int split_parts = 1;
  int persistent = 0;  // > 0: the (whole) items on attention_fwd_kernel3p / 2p, at most `persistent` CTAs
  int64_t longest_lk = 0;  // keys of the longest K/V sequence
  int64_t slots() const { return (items - split_first) * (split_parts > 1 ? split_parts : 0); }
  // The counters after the work list: the persistent kernels' item counter, then the split items'
  // arrivals (one per consumer warpgroup).
  size_t counters() const { return 1 + size_t(split_parts > 1 ? (items - split_first) * attn::kConsumers3 : 0); }
};
// A part's partial state (FwdParams::part_o, part_rows) per slot.
constexpr size_t kSplitSlotBytes =
    attn::kConsumers3 * (16 * attn::kWarpgroupThreads + attn::kRowsPerConsumer) * sizeof(float4);

// The causal mask (kVariantCausal) runs on the persistent kernels only (MXFLASH_FWD_PERSISTENT=0 is
// not taken; n >= 2 is), two or three consumers by the same rule, without a split tail: its items
// are of unequal work, and the persistent CTAs' first-not-taken order balances them as it does
// jagged batches. H200, 2026-12-01, causal forward, same binary, two rounds, TFLOP/s three / two
// consumers: L=2048 B=8 H=16 671-672 / 632, L=8192 B=2 834 / 760-765, L=1024 B=32 561-562 /
// 523-525, L=512 B=64 434 / 384, L=256 B=128 252 / 267: the rule's choice wins on each.
ExecPlan exec_plan(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, int batch, int64_t heads,
                   bool broadcast_q, CausalMask causal = CausalMask::kNone) {
  int sms = 0;
  if (!sm_count(&sms).ok()) {  // no device (sizes asked on a CPU machine): nothing to launch, no split
    cudaGetLastError();
    sms = 0;
  }
  ExecPlan e;
  e.three = three_consumers(cu_q, batch, heads, broadcast_q, sms);
  for (int b = 0; b < batch; ++b) e.longest_lk = std::max<int64_t>(e.longest_lk, cu_k[size_t(b) + 1] - cu_k[size_t(b)]);
  const bool short_keys = (e.longest_lk + attn::kTile - 1) / attn::kTile <= kPersistentMaxTiles;
  e.persistent = sms > 0 ? persistent_ctas(sms, short_keys) : 0;
  e.tiles = schedule(cu_q, cu_k, batch, broadcast_q, e.three ? attn::kQTile3 : attn::kTile);
  e.items = int64_t(e.tiles.size()) * heads;
  e.split_first = e.items;
  if (causal != CausalMask::kNone) {
    const int n = sms > 0 ? persistent_ctas(sms, true) : 0;
    e.persistent = n > 0 ? n : sms;
    return e;
  }
  if (!e.three || e.items == 0 || sms <= 0) return e;
  const int64_t r = e.items % sms;
  int max_tiles = 0;
  for (int64_t i = e.items - r; i < e.items; ++i) {
    const int b = e.tiles[size_t(i / heads)].x;
    max_tiles = std::max(max_tiles, (cu_k[size_t(b) + 1] - cu_k[size_t(b)] + attn::kTile - 1) / attn::kTile);
  }
  e.split_parts = split_parts(r, sms, max_tiles);
  if (e.split_parts > 1) {
    e.split_first = e.items - r;
    e.persistent = persistent_ctas(sms, /*wanted=*/true);
  }
  return e;
}

// The work list, then the persistent kernel's item counter (zero at the start of every launch: it is
// uploaded with the list), then the split tail's partial states.
size_t exec_workspace_bytes(const ExecPlan& e) {
  return align256(attn::work_list_bytes(e.tiles.size(), e.counters())) + size_t(e.slots()) * kSplitSlotBytes;
}

// The main kernel over operands in the execution layout, run as `plan` says; `ws` receives the
// work list and the split tail's partial states (exec_workspace_bytes).
// kG: attn::kVariantGqa (grouped-query operands, Hkv < H) or 0, in the operand kernels' variants.
template <int kG>
Status launch_main_v(const AttentionFwdProblem& p, const FwdExecOperands& ops, const ExecPlan& plan, uint8_t* ws,
                     cudaStream_t stream) {
  const std::vector<int2>& tiles = plan.tiles;
  if (tiles.empty()) return Status::Ok();
  const int64_t H = p.heads, Hkv = kv_heads_of(p);  // (Hkv < H: grouped-query attention)
  if (H * (H / Hkv) >= (int64_t(1) << 16))
    return Status::Unsupported("ops.k: grouped-query attention needs heads x (heads / K/V heads) below 65536, got " +
                               std::to_string(H) + " x " + std::to_string(H / Hkv));
  const bool three = plan.three;
  uint8_t* const tiles_ws = ws;
  unsigned* next_item = nullptr;  // the persistent kernels' item counter, zeroed with the list
  MXFLASH_RETURN_IF_ERROR(attn::upload_work_list(tiles_ws, tiles, stream, &next_item, plan.counters()));
  CUtensorMap tm_q, tm_k, tm_v;
  MXFLASH_RETURN_IF_ERROR(
      make_tile_map(&tm_q, ops.q, kHeadDim, uint64_t(H * p.Pq), three ? attn::kRowsPerConsumer : attn::kTile));
  // A batch whose K/V sequences are all empty still needs valid (unused) maps.
  MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_k, ops.k, kHeadDim, uint64_t(std::max<int64_t>(Hkv * p.Pk, attn::kTile))));
  MXFLASH_RETURN_IF_ERROR(
      make_tile_map(&tm_v, ops.v, uint64_t(std::max<int64_t>(p.Pk, attn::kTile)), uint64_t(Hkv * kHeadDim)));
  attn::FwdParams fp;
  fp.cu_q = p.cu_q;
  fp.cu_q_sf = p.cu_q_sf;
  fp.cu_k = p.cu_k;
  fp.cu_k_sf = p.cu_k_sf;
  fp.q_scale = ops.q_scale;
  fp.k_scale = ops.k_scale;
  fp.v_scale = ops.v_scale;
  fp.tiles = reinterpret_cast<const int2*>(tiles_ws);
  fp.heads = p.heads;
  fp.kv_magic = attn::kv_magic(H / Hkv);
  // K and V, e4m3. The causal mask: heads in turn whatever the K/V bytes (a sequence's Q tiles run
  // heaviest first, so each round's items are of one weight across the heads). H200, 2026-12-01,
  // same binary, two rounds: llm-long causal 827-830 TFLOP/s against 770-773 with each head's tiles
  // in a row (the rule's choice there by bytes); llm the same either way.
  fp.heads_inner = attn::heads_in_turn(H, p.causal != CausalMask::kNone ? 0 : plan.longest_lk * 2 * kHeadDim);
  fp.Pq = p.Pq;
  fp.Pk = p.Pk;
  fp.To = p.To;
  fp.scale_log2 = p.softmax_scale * attn::kLog2e;
  fp.broadcast_q = p.broadcast_q;
  fp.causal_br = p.causal == CausalMask::kBottomRight;
  fp.out = static_cast<__nv_bfloat16*>(p.out);
  fp.lse = p.lse;
  attn::SplitParams sp;
  sp.first = int(plan.split_first);
  sp.parts = plan.split_parts;
  sp.slots = int(plan.slots());
  sp.part_o = reinterpret_cast<float4*>(ws + align256(attn::work_list_bytes(tiles.size(), plan.counters())));
  sp.part_rows = sp.part_o + plan.slots() * (attn::kConsumers3 * 16 * attn::kWarpgroupThreads);
  sp.arrivals = next_item + 1;
  int64_t persistent = plan.persistent;
  // The persistent kernels write out through shared memory and TMA stores (write_rows_staged)
  // where it is 16-byte aligned (the API asks 4).
  const bool staged = persistent > 0 && is_aligned(p.out, 16);
  CUtensorMap tm_o{};
  if (staged) MXFLASH_RETURN_IF_ERROR(make_bf16_rows_map(&tm_o, p.out, uint64_t(p.To), uint64_t(H)));
  // V scales per 128-key tile: folded into every promotion (kVariantVTile).
  auto kernel = ops.v_per_tile ? attn::attention_fwd_kernel<kDefaultVariantVTile | kG>
                               : attn::attention_fwd_kernel<kDefaultVariant>;
  // The three-consumer kernel takes only the tree reductions and the V-tile bits of a variant.
  constexpr int kV3 = kDefaultVariantVTile | kG, kM3 = kDefaultVariantVTile & ~attn::kVariantVTile;
  auto kernel3 = !three ? nullptr : ops.v_per_tile ? attn::attention_fwd_kernel3<kV3> : attn::attention_fwd_kernel3<kM3>;
  // The persistent three-consumer kernel with the variant bits `extra` (the causal mask's or none):
  // out staged for TMA stores, or (out not 16-byte aligned) its direct stores.
  auto pick3p = [&](auto extra) {
    constexpr int kX = decltype(extra)::value;
    if (ops.v_per_tile)
      return staged ? attn::attention_fwd_kernel3p<kV3 | kX, true> : attn::attention_fwd_kernel3p<kV3 | kX, false>;
    return staged ? attn::attention_fwd_kernel3p<kM3 | kX, true> : attn::attention_fwd_kernel3p<kM3 | kX, false>;
  };
  auto kernel3p = pick3p(std::integral_constant<int, 0>{});
  auto parts3 = ops.v_per_tile ? attn::attention_fwd_kernel3<kV3, true> : attn::attention_fwd_kernel3<kM3, true>;
  // Without the exponential turns where every K/V sequence has at most kNoTurnMaxTiles tiles: an
  // item's one or two exponential phases gain nothing from alternating, and the second warpgroup
  // waits out the first's. H200, same run, two rounds, TFLOP/s: 128-token self-attention (B=512,
  // H=16) 232 against 226-227, 256 tokens 423 against 414; 1024 keys (8 tiles) and 2048 equal.
  constexpr int kNoTurnMaxTiles = 2;
  auto kernel2p = !ops.v_per_tile ? attn::attention_fwd_kernel2p<kDefaultVariant>
                  : plan.longest_lk <= kNoTurnMaxTiles * attn::kTile
                      ? attn::attention_fwd_kernel2p<(kDefaultVariantVTile & ~attn::kVariantExpTurn) | kG>
                      : attn::attention_fwd_kernel2p<kDefaultVariantVTile | kG>;
#if MXFLASH_FWD_EXPERIMENTS
  if constexpr (kG == 0) {
  if (three && ops.v_per_tile) {
    constexpr int kV = kDefaultVariantVTile;
    switch (experiment_variant() & (attn::kVariantTrace | attn::kVariantTracePin)) {
      case attn::kVariantTrace: kernel3 = attn::attention_fwd_kernel3<kV | attn::kVariantTrace>; break;
      case attn::kVariantTracePin: kernel3 = attn::attention_fwd_kernel3<kV | attn::kVariantTracePin>; break;
      default: break;
    }
  }
  if (ops.v_per_tile) switch (experiment_variant()) {
    case 81 | attn::kVariantNoTurn: kernel = attn::attention_fwd_kernel<81 | attn::kVariantNoTurn>; break;
    case 81: kernel = attn::attention_fwd_kernel<81>; break;
    // The default with the consumer trace (bit 18).
    case kDefaultVariantVTile | attn::kVariantTrace:
      kernel = attn::attention_fwd_kernel<kDefaultVariantVTile | attn::kVariantTrace>;
      break;
    // The default before the exponential turns (GEMM turns instead), and its trace.
    case kPrevDefaultVariantVTile: kernel = attn::attention_fwd_kernel<kPrevDefaultVariantVTile>; break;
    case kPrevDefaultVariantVTile | attn::kVariantTrace:
      kernel = attn::attention_fwd_kernel<kPrevDefaultVariantVTile | attn::kVariantTrace>;
      break;
    default: break;
  }
  if (!ops.v_per_tile) switch (experiment_variant()) {
    case 0: kernel = attn::attention_fwd_kernel<0>; break;
    case 1: kernel = attn::attention_fwd_kernel<1>; break;
    case 3: kernel = attn::attention_fwd_kernel<3>; break;
    case 5: kernel = attn::attention_fwd_kernel<5>; break;
    case 7: kernel = attn::attention_fwd_kernel<7>; break;
    case 17: kernel = attn::attention_fwd_kernel<17>; break;
    case 145: kernel = attn::attention_fwd_kernel<kDefaultVariant>; break;
    case 17 | attn::kVariantNoTurn: kernel = attn::attention_fwd_kernel<17 | attn::kVariantNoTurn>; break;
    case 17 | attn::kVariantPackEarly: kernel = attn::attention_fwd_kernel<17 | attn::kVariantPackEarly>; break;
    case 17 | attn::kVariantExpTurn | attn::kVariantNoTurn:
      kernel = attn::attention_fwd_kernel<17 | attn::kVariantExpTurn | attn::kVariantNoTurn>;
      break;
    default: break;
  }
  if (experiment_variant() >= 0 && !three) persistent = 0;  // a two-consumer variant: a CTA per item
  }
#endif
  if (p.causal != CausalMask::kNone) {  // the persistent kernels with the mask (exec_plan: no split tail)
    constexpr int kC = attn::kVariantCausal;
    kernel3p = pick3p(std::integral_constant<int, kC>{});
    kernel2p = ops.v_per_tile ? attn::attention_fwd_kernel2p<kDefaultVariantVTile | kC | kG>
                              : attn::attention_fwd_kernel2p<kDefaultVariant | kC>;
    if (persistent <= 0 || plan.slots() > 0)
      return Status::Internal("attention_forward: a causal plan without persistent CTAs or with a split tail");
  }
  fp.num_items = int(plan.items);
  // The main kernel's launch and set-up under the upload (wait_for_work_list).
  const bool pdl = pdl_after_setup();
  if (kernel3) {
    if (persistent > 0) {  // the whole items, then the split items' parts, on a CTA per SM
      MXFLASH_RETURN_IF_ERROR(cuda_error(
          cudaFuncSetAttribute(kernel3p, cudaFuncAttributeMaxDynamicSharedMemorySize, int(attn::kSmemBytes3P)),
          "cudaFuncSetAttribute(smem)"));
      const unsigned grid = unsigned(std::min<int64_t>(plan.split_first + plan.slots(), persistent));
      MXFLASH_RETURN_IF_ERROR(cuda_error(launch_programmatic(pdl, kernel3p, dim3(grid), dim3(attn::kThreads3),
                                                             attn::kSmemBytes3P, stream, tm_q, tm_k, tm_v, fp, sp,
                                                             next_item, tm_o),
                                         "attention_fwd_kernel3p launch"));
    } else {
      if (plan.split_first > 0) {  // the whole items, a CTA each
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            cudaFuncSetAttribute(kernel3, cudaFuncAttributeMaxDynamicSharedMemorySize, int(attn::kSmemBytes3)),
            "cudaFuncSetAttribute(smem)"));
        MXFLASH_RETURN_IF_ERROR(cuda_error(launch_programmatic(pdl, kernel3, dim3(unsigned(plan.split_first)),
                                                               dim3(attn::kThreads3), attn::kSmemBytes3, stream, tm_q,
                                                               tm_k, tm_v, fp, sp),
                                           "attention_fwd_kernel3 launch"));
      }
      if (plan.slots() > 0) {  // the split items' parts, the last of each item's merging them
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            cudaFuncSetAttribute(parts3, cudaFuncAttributeMaxDynamicSharedMemorySize, int(attn::kSmemBytes3)),
            "cudaFuncSetAttribute(smem)"));
        // Every item split (no whole-item grid): the parts follow the stream's previous work (the
        // operands' writers) as an ordinary launch, since they read its output before any wait.
        MXFLASH_RETURN_IF_ERROR(cuda_error(
            launch_programmatic(plan.split_first > 0, parts3, dim3(unsigned(plan.slots())), dim3(attn::kThreads3),
                                attn::kSmemBytes3, stream, tm_q, tm_k, tm_v, fp, sp),
            "attention_fwd_kernel3 (parts) launch"));
      }
    }
  } else if (persistent > 0) {  // two consumers, a CTA per SM
    MXFLASH_RETURN_IF_ERROR(cuda_error(
        cudaFuncSetAttribute(kernel2p, cudaFuncAttributeMaxDynamicSharedMemorySize, int(attn::kSmemBytes2P)),
        "cudaFuncSetAttribute(smem)"));
    const unsigned grid = unsigned(std::min<int64_t>(plan.items, persistent));
    MXFLASH_RETURN_IF_ERROR(cuda_error(launch_programmatic(pdl, kernel2p, dim3(grid), dim3(attn::kThreads),
                                                           attn::kSmemBytes2P, stream, tm_q, tm_k, tm_v, fp, next_item,
                                                           tm_o, staged),
                                       "attention_fwd_kernel2p launch"));
  } else {
    MXFLASH_RETURN_IF_ERROR(cuda_error(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(attn::kSmemBytes)),
        "cudaFuncSetAttribute(smem)"));
    MXFLASH_RETURN_IF_ERROR(cuda_error(launch_programmatic(pdl, kernel, dim3(unsigned(plan.items)),
                                                           dim3(attn::kThreads), attn::kSmemBytes, stream, tm_q, tm_k,
                                                           tm_v, fp),
                                       "attention_fwd_kernel launch"));
  }
#if MXFLASH_FWD_EXPERIMENTS
  if (experiment_variant() >= 0 && (experiment_variant() & attn::kVariantTrace) != 0) {
    static int calls = 0;  // the consumers' timeline of the traced CTAs (kVariantTrace)
    MXFLASH_RETURN_IF_ERROR(attn::dump_trace_when_due(calls, 30, "MXFLASH_FWD_TRACE", stream));
  }
#endif
  return Status::Ok();
}

// The forward's workspace (with_workspace): any alignment.
constexpr WorkspaceRule kFwdWorkspace = {"attention_forward workspace", "", 0, ""};
// The main kernel over operands in the execution layout (launch_main_v), grouped-query or not.
Status launch_main(const AttentionFwdProblem& p, const FwdExecOperands& ops, const ExecPlan& plan, uint8_t* ws,
                   cudaStream_t stream) {
  if (kv_heads_of(p) != p.heads) {
    if (!ops.v_per_tile) return Status::Internal("attention_forward: grouped-query attention on MX-tensor operands");
    return launch_main_v<attn::kVariantGqa>(p, ops, plan, ws, stream);
  }
  return launch_main_v<0>(p, ops, plan, ws, stream);
}

}  // namespace

size_t attention_fwd_exec_workspace_bytes(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                                          int batch, int64_t heads, bool broadcast_q, CausalMask causal) {
  return exec_workspace_bytes(exec_plan(cu_q, cu_k, batch, heads, broadcast_q, causal));
}

size_t attention_fwd_workspace_bytes(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, int batch,
                                     int64_t heads, int64_t Pq, int64_t Pk, bool broadcast_q, CausalMask causal) {
  const ExecPlan plan = exec_plan(cu_q, cu_k, batch, heads, broadcast_q, causal);
  return layout_of(batch, heads, Pq, Pk, exec_workspace_bytes(plan)).total;
}

Status attention_forward_exec(const AttentionFwdProblem& p, const FwdExecOperands& ops, void* workspace,
                              size_t workspace_bytes, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const ExecPlan plan = exec_plan(*p.host_cu_q, *p.host_cu_k, p.batch, p.heads, p.broadcast_q, p.causal);
  return with_workspace(workspace, workspace_bytes, exec_workspace_bytes(plan), stream, kFwdWorkspace,
                        [&](uint8_t* ws) { return launch_main(p, ops, plan, ws, stream); });
}

Status attention_forward(const AttentionFwdProblem& p, void* workspace, size_t workspace_bytes, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const ExecPlan plan = exec_plan(*p.host_cu_q, *p.host_cu_k, p.batch, p.heads, p.broadcast_q, p.causal);
  const WorkspaceLayout w = layout_of(p.batch, p.heads, p.Pq, p.Pk, exec_workspace_bytes(plan));
  return with_workspace(workspace, workspace_bytes, w.total, stream, kFwdWorkspace, [&](uint8_t* ws) -> Status {
    const int64_t H = p.heads;
    bool prepare = true;
#if MXFLASH_FWD_EXPERIMENTS
    // kVariantNoPrepare: prepared once per workspace, so the timed calls read real data (a kernel
    // fed zeros runs at a higher clock).
    static std::set<const void*> prepared;
    prepare = experiment_variant() < 0 || (experiment_variant() & attn::kVariantNoPrepare) == 0 ||
              prepared.insert(ws).second;
#endif
    if (prepare) {
      if (p.Pq > 0)
        attn::prepare_rows_kernel<true><<<dim3(unsigned(p.Pq / attn::kTile), unsigned(H)), attn::kRowThreads, 0, stream>>>(
            attn::MxRowSource{p.q.payload, p.q.scales, p.q.scale_layout, H, p.Pq}, p.cu_q, p.cu_q_sf,
            p.broadcast_q ? 1 : p.batch, p.Pq, ws + w.q, reinterpret_cast<float*>(ws + w.q_scale));
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "prepare Q launch"));
      if (p.Pk > 0) {
        attn::prepare_rows_kernel<false><<<dim3(unsigned(p.Pk / attn::kTile), unsigned(H)), attn::kRowThreads, 0, stream>>>(
            attn::MxRowSource{p.k.payload, p.k.scales, p.k.scale_layout, H, p.Pk}, p.cu_k, p.cu_k_sf, p.batch, p.Pk,
            ws + w.k, reinterpret_cast<float*>(ws + w.k_scale));
        MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "prepare K launch"));
      }
      attn::prepare_v_scale_kernel<<<unsigned(int64_t(p.batch) * H), attn::kVScaleSlices * kHeadDim, 0, stream>>>(
          p.v.scales, p.v.scale_layout, p.cu_k, p.cu_k_sf, H, p.Pk, ws + w.v_byte, reinterpret_cast<float*>(ws + w.v_scale));
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "prepare V scales launch"));
      if (p.Pk > 0) {
        attn::prepare_v_kernel<<<dim3(unsigned(p.Pk / attn::kTile), unsigned(H)), attn::kVThreads, 0, stream>>>(
            p.v.payload, p.v.payload_layout, p.v.scales, p.v.scale_layout, p.cu_k, p.cu_k_sf, p.batch, H, p.Pk,
            ws + w.v_byte, ws + w.v);
        MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "prepare V launch"));
      }
    }
    const FwdExecOperands ops{ws + w.q, ws + w.k, ws + w.v, reinterpret_cast<float*>(ws + w.q_scale),
                              reinterpret_cast<float*>(ws + w.k_scale), reinterpret_cast<float*>(ws + w.v_scale),
                              /*v_per_tile=*/false};
    return launch_main(p, ops, plan, ws + w.tiles, stream);
  });
}

}  // namespace mxflash::cuda
