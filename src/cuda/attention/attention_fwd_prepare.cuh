// Prepare pass of the forward: MX block scales re-expressed relative to coarser power-of-two
// scales so that the main kernel keeps every scale out of its wgmma loops (ARCHITECTURE.md §4).
//  Q: per (head, row)          -> scale folds into the row's softmax multiplier.
//  K: per (head, 128-key tile) -> one scalar per tile, folds into the same multiplier.
//  V: per (sequence, head, channel) -> applied once in the epilogue.
// A block whose scale is 2^s inside a group of scale 2^S (S >= s) is shifted down by S - s bits and
// rounded to nearest even: exact unless values fall below e4m3's subnormal floor (2^-9 of 2^S).
// Outputs use private layouts: Q', K' (H, P, 128) and V' (H, 128, Pk) with padding rows zero; V'
// stores each 32-token group in the order the P register fragment of wgmma expects (see
// kPermutedToken), which spares the main kernel any register shuffles of P.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/e4m3_shift.cuh"
#include "mxflash/jagged.h"
#include "mxflash/mx.h"

namespace mxflash::cuda::attn {

inline constexpr int kTile = 128;  // tokens per Q tile / K,V tile; also the sequence padding

// Position k (0..31) of a 32-token group in V' holds token kPermutedToken(k) of the group: the
// token whose S accumulator value lands in A-fragment position k when each thread packs its own
// accumulators (cols 2q, 2q+1, 8+2q, 9+2q | 16+2q, ... ) into its fragment slots (k 4q..4q+3 | 16+4q..).
__host__ __device__ __forceinline__ int permuted_token(int k) {
  return 16 * (k / 16) + 8 * ((k % 4) / 2) + 2 * ((k % 16) / 4) + (k % 2);
}

// Index of the sequence owning padded token tp: the largest b with cu_sf[b] <= tp (with cu instead
// of cu_sf: the sequence of packed token tp). sequence_of_padded_warp: the same for a tp shared by
// the whole warp (all 32 lanes present), one round of loads per 32 sequences (a ballot) instead
// of log2(batch) dependent ones.
__device__ __forceinline__ int sequence_of_padded_warp(const int32_t* cu_sf, int batch, int64_t tp) {
  const int lane = int(threadIdx.x) % 32;
  int count = 0;  // sequences b with cu_sf[b] <= tp: a prefix, cu_sf being non-decreasing
  for (int base = 0; base < batch; base += 32) {
    const unsigned le = __ballot_sync(0xFFFFFFFFu, base + lane < batch && cu_sf[base + lane] <= tp);
    count += __popc(le);
    if (le != 0xFFFFFFFFu) break;
  }
  return max(count - 1, 0);
}
__device__ __forceinline__ int sequence_of_padded(const int32_t* cu_sf, int batch, int64_t tp) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_sf[mid] <= tp) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ int64_t hdim_scale_index(ScaleLayout l, int64_t t, int64_t tp, int64_t h, int k,
                                                    int64_t H, int64_t P) {
  return l == ScaleLayout::kPlain ? hdim_plain_offset(t, h, k, H) : hdim_blocked_offset(h, tp, k, P);
}

// Source of prepare_rows_kernel: 16 bytes of a row (half of its 32-block `chunk / 2`) and that
// block's scale byte, here from an MX payload and its scales. Called by every thread of the CTA
// (a source may shuffle); invalid rows give zeros.
struct MxRowSource {
  const uint8_t* payload;
  const uint8_t* scales;
  ScaleLayout layout;
  int64_t H, P;
  __device__ __forceinline__ void operator()(bool valid, int64_t t, int64_t tp, int64_t h, int chunk, uint4* words,
                                             int* s) const {
    *words = valid ? *reinterpret_cast<const uint4*>(payload + (t * H + h) * kHeadDim + chunk * 16) : make_uint4(0, 0, 0, 0);
    *s = valid ? int(scales[hdim_scale_index(layout, t, tp, h, chunk / 2, H, P)]) : 0;
  }
};

// Q and K: one CTA of 256 threads per (128-token tile, head). Eight threads per token row, 16 bytes
// (half a 32-block) each, four passes of 32 rows: every warp load and store covers whole 128-byte
// rows. kPerRow: group = row (Q), else group = the whole tile (K). Source: MxRowSource (the prepare
// pass) or a quantizer of the unquantized input (attention_fwd_operands.cu).
inline constexpr int kRowThreads = 256;
// The body of prepare_rows_kernel for the (tile, h) tile, on a CTA of kRowThreads threads (also run
// by the fused operand kernel, attention_fwd_operands.cu); warp_max: kRowThreads / 32 shared ints.
template <bool kPerRow, typename Source>
__device__ __forceinline__ void rows_tile(const Source& source, const int32_t* __restrict__ cu,
                                          const int32_t* __restrict__ cu_sf, int batch, int64_t P,
                                          uint8_t* __restrict__ out, float* __restrict__ group_scale, int* warp_max,
                                          int64_t tile, int64_t h) {
  constexpr int kPasses = kTile * 8 / kRowThreads;
  const int b = sequence_of_padded_warp(cu_sf, batch, tile * kTile);
  const int64_t len = int64_t(cu[b + 1]) - cu[b];
  const int64_t first = tile * kTile - cu_sf[b];  // first token of the tile within its sequence
  const int chunk = threadIdx.x % 8;             // 16-byte chunk of the row: 32-block chunk / 2
  const int row0 = threadIdx.x / 8;
  uint4 words[kPasses];
  int s[kPasses], group[kPasses];
  bool valid[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = row0 + pass * (kRowThreads / 8);
    valid[pass] = first + r < len;
    source(valid[pass], cu[b] + first + r, tile * kTile + r, h, chunk, &words[pass], &s[pass]);
    int m = s[pass];  // the row's largest block scale: over its 8 consecutive lanes
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    group[pass] = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
  }
  if (!kPerRow) {
    int m = group[0];
#pragma unroll
    for (int pass = 1; pass < kPasses; ++pass) m = max(m, group[pass]);
#pragma unroll
    for (int o = 8; o < 32; o *= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kRowThreads / 32; ++w) m = max(m, warp_max[w]);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) group[pass] = m;
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = row0 + pass * (kRowThreads / 8);
    const int shift = valid[pass] ? group[pass] - s[pass] : 0;
    uint32_t* x = reinterpret_cast<uint32_t*>(&words[pass]);
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = shift_e4m3x4(x[j], shift);
    *reinterpret_cast<uint4*>(out + (h * P + tile * kTile + r) * kHeadDim + chunk * 16) = words[pass];
    if (kPerRow && chunk == 0)
      group_scale[h * P + tile * kTile + r] = valid[pass] ? e8m0_to_float(uint8_t(group[pass])) : 1.f;
  }
  if (!kPerRow && threadIdx.x == 0) group_scale[h * (P / kTile) + tile] = e8m0_to_float(uint8_t(group[0]));
}

template <bool kPerRow, typename Source>
__global__ void __launch_bounds__(kRowThreads) prepare_rows_kernel(Source source, const int32_t* __restrict__ cu,
                                                                   const int32_t* __restrict__ cu_sf, int batch,
                                                                   int64_t P, uint8_t* __restrict__ out,
                                                                   float* __restrict__ group_scale) {
  __shared__ int warp_max[kRowThreads / 32];
  rows_tile<kPerRow>(source, cu, cu_sf, batch, P, out, group_scale, warp_max, blockIdx.x, blockIdx.y);
}

// V, step 1: per (sequence, head, channel) the largest seq-block scale byte of the sequence.
// One CTA per (sequence, head): kSlices x 128 threads, slice i takes groups i, i + kSlices, ...
inline constexpr int kVScaleSlices = 8;
// static: each including .cu file gets its own copy (a header kernel with external linkage would be
// defined twice).
static __global__ void __launch_bounds__(kVScaleSlices * kHeadDim)
    prepare_v_scale_kernel(const uint8_t* __restrict__ scales, ScaleLayout layout, const int32_t* __restrict__ cu,
                           const int32_t* __restrict__ cu_sf, int64_t H, int64_t P,
                           uint8_t* __restrict__ channel_byte, float* __restrict__ channel_scale) {
  __shared__ int slice_max[kVScaleSlices][kHeadDim];
  const int b = blockIdx.x / int(H);
  const int64_t h = blockIdx.x % H;
  const int d = threadIdx.x % kHeadDim, slice = threadIdx.x / kHeadDim;
  const int64_t len = int64_t(cu[b + 1]) - cu[b];
  const int64_t g0 = cu_sf[b] / kBlockSize, groups = (len + kBlockSize - 1) / kBlockSize;
  int m = 0;
  for (int64_t g = g0 + slice; g < g0 + groups; g += kVScaleSlices) {
    const int64_t o = layout == ScaleLayout::kPlain ? seq_plain_offset(g, h, d, H) : seq_blocked_offset(h, d, g, P);
    m = max(m, int(scales[o]));
  }
  slice_max[slice][d] = m;
  __syncthreads();
  if (slice == 0) {
    for (int i = 1; i < kVScaleSlices; ++i) m = max(m, slice_max[i][d]);
    const int64_t idx = (int64_t(b) * H + h) * kHeadDim + d;
    channel_byte[idx] = uint8_t(m);
    channel_scale[idx] = e8m0_to_float(uint8_t(m));
  }
}

// Output word w (0..7) of a 32-token group in V' holds, in its bytes 0..3, the tokens
// v_word_base(w) + {0, 1, 8, 9} of the group (permuted_token of positions 4w..4w+3).
__host__ __device__ __forceinline__ int v_word_base(int w) { return 16 * (w / 4) + 2 * (w % 4); }

// Word w (0..7) of a 32-token group of V', from the group's 8 words in token order (tokens
// 4k..4k+3 in word k), shifted down by `shift` bits (shift_e4m3x4).
__device__ __forceinline__ uint32_t permuted_word(const uint32_t (&in)[8], int w, int shift) {
  const int base = v_word_base(w);  // even: tokens base, base + 1 in word base / 4, + 8 two words on
  return shift_e4m3x4(__byte_perm(in[base / 4], in[base / 4 + 2], base % 4 == 0 ? 0x5410 : 0x7632), shift);
}

// V' rows of a tile staged in shared memory (kVRowPitch words per channel row: bank spread),
// stored whole: 8 threads x 16 bytes per 128-byte row, the CTA's kThreads threads in turn (a fixed
// trip count: one pointer step per store).
inline constexpr int kVRowPitch = kTile / 4 + 1;
template <int kThreads>
__device__ __forceinline__ void store_v_rows(const uint32_t (*rows)[kVRowPitch], uint8_t* dst, int64_t P) {
  static_assert(kHeadDim * 8 % kThreads == 0 && kThreads % 8 == 0, "whole rounds of whole rows");
  const int c16 = int(threadIdx.x) % 8, d0 = int(threadIdx.x) / 8;
  uint8_t* out = dst + d0 * P + c16 * 16;
#pragma unroll
  for (int k = 0; k < kHeadDim * 8 / kThreads; ++k) {
    const uint32_t* row = &rows[d0 + k * (kThreads / 8)][4 * c16];
    *reinterpret_cast<uint4*>(out + k * (kThreads / 8) * P) = make_uint4(row[0], row[1], row[2], row[3]);
  }
}

// Bytes i of a0..a3, as one word (a 4x4 byte transpose, one output word per call).
__device__ __forceinline__ void transpose_bytes4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t (&o)[4]) {
  const uint32_t lo01 = __byte_perm(a0, a1, 0x5140), hi01 = __byte_perm(a0, a1, 0x7362);
  const uint32_t lo23 = __byte_perm(a2, a3, 0x5140), hi23 = __byte_perm(a2, a3, 0x7362);
  o[0] = __byte_perm(lo01, lo23, 0x5410);
  o[1] = __byte_perm(lo01, lo23, 0x7632);
  o[2] = __byte_perm(hi01, hi23, 0x5410);
  o[3] = __byte_perm(hi01, hi23, 0x7632);
}

// V, step 2: one CTA of 256 threads per (128-token tile, head) writes V'(h, 128 channels, the tile's
// 128 tokens): tokens permuted within each 32-group (permuted_token) and re-expressed relative to
// the channel's sequence-wide scale (step 1). Token-major input goes through shared memory (rows
// loaded whole, 4x4 byte transposes, channel rows stored whole); token-contiguous input is permuted
// in registers. Tokens past the sequence's end are written as zeros.
inline constexpr int kVThreads = 256;
static __global__ void __launch_bounds__(kVThreads) prepare_v_kernel(const uint8_t* __restrict__ payload, PayloadLayout playout,
                                                              const uint8_t* __restrict__ scales, ScaleLayout slayout,
                                                              const int32_t* __restrict__ cu, const int32_t* __restrict__ cu_sf,
                                                              int batch, int64_t H, int64_t P,
                                                              const uint8_t* __restrict__ channel_byte,
                                                              uint8_t* __restrict__ out) {
  constexpr int kGroups = kTile / kBlockSize;  // 4
  __shared__ uint32_t in_rows[kTile][kVRowPitch];   // token-major input: token rows
  __shared__ uint32_t out_rows[kHeadDim][kVRowPitch];  // V' rows: channels
  __shared__ int8_t shift_of[kGroups][kHeadDim];
  const int64_t tile = blockIdx.x, h = blockIdx.y;
  const int b = sequence_of_padded_warp(cu_sf, batch, tile * kTile);
  const int64_t len = int64_t(cu[b + 1]) - cu[b];
  const int64_t first = tile * kTile - cu_sf[b];  // first token of the tile within its sequence
  const int64_t rem = len - first;
  const int valid_tokens = rem <= 0 ? 0 : (rem >= kTile ? kTile : int(rem));
  // shift per (group, channel): the channel's sequence-wide scale over the block's (0 past the end)
  for (int i = threadIdx.x; i < kGroups * kHeadDim; i += kVThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    int shift = 0;
    if (g * kBlockSize < valid_tokens) {
      const int64_t pg = tile * kGroups + g;
      const int64_t o = slayout == ScaleLayout::kPlain ? seq_plain_offset(pg, h, d, H) : seq_blocked_offset(h, d, pg, P);
      shift = int(channel_byte[(int64_t(b) * H + h) * kHeadDim + d]) - int(scales[o]);
    }
    shift_of[g][d] = int8_t(min(shift, 127));  // past 24 every byte becomes +-0 alike; int8 must not wrap
  }
  uint8_t* dst = out + h * kHeadDim * P + tile * kTile;  // + d * P: channel row d of the tile

  if (playout == PayloadLayout::kTokenContiguous) {
    __syncthreads();
    // thread = (channel, 32-group): 32 input bytes -> 8 output words, in registers
    for (int i = threadIdx.x; i < kHeadDim * kGroups; i += kVThreads) {
      const int d = i / kGroups, g = i % kGroups;
      const uint8_t* src = payload + (h * kHeadDim + d) * P + tile * kTile + g * kBlockSize;
      uint32_t in[8];
      const uint4 lo = *reinterpret_cast<const uint4*>(src), hi = *reinterpret_cast<const uint4*>(src + 16);
      in[0] = lo.x, in[1] = lo.y, in[2] = lo.z, in[3] = lo.w, in[4] = hi.x, in[5] = hi.y, in[6] = hi.z, in[7] = hi.w;
      const int vg = min(max(valid_tokens - g * kBlockSize, 0), kBlockSize);  // valid tokens of the group
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int keep = min(max(vg - 4 * k, 0), 4);  // bytes of word k inside the sequence
        in[k] &= keep == 4 ? 0xFFFFFFFFu : (1u << (8 * keep)) - 1u;
      }
      const int shift = shift_of[g][d];
      uint32_t o[8];
#pragma unroll
      for (int w = 0; w < 8; ++w) o[w] = permuted_word(in, w, shift);
      uint4* d16 = reinterpret_cast<uint4*>(dst + d * P + g * kBlockSize);
      d16[0] = make_uint4(o[0], o[1], o[2], o[3]);
      d16[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
    return;
  }

  // Token-major: load the tile's token rows (8 threads x 16 bytes per row).
  for (int i = threadIdx.x; i < kTile * 8; i += kVThreads) {
    const int r = i / 8, c16 = i % 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < valid_tokens)
      v = *reinterpret_cast<const uint4*>(payload + ((cu[b] + first + r) * H + h) * kHeadDim + c16 * 16);
    in_rows[r][4 * c16 + 0] = v.x;
    in_rows[r][4 * c16 + 1] = v.y;
    in_rows[r][4 * c16 + 2] = v.z;
    in_rows[r][4 * c16 + 3] = v.w;
  }
  __syncthreads();
  // unit = (output word position p of the tile, channel quad cq): 4 token words in, 4 channel words out
  for (int i = threadIdx.x; i < (kTile / 4) * (kHeadDim / 4); i += kVThreads) {
    const int cq = i % (kHeadDim / 4), p = i / (kHeadDim / 4);
    const int g = p / 8, t0 = g * kBlockSize + v_word_base(p % 8);
    uint32_t o[4];
    transpose_bytes4(in_rows[t0][cq], in_rows[t0 + 1][cq], in_rows[t0 + 8][cq], in_rows[t0 + 9][cq], o);
#pragma unroll
    for (int c = 0; c < 4; ++c) out_rows[4 * cq + c][p] = shift_e4m3x4(o[c], shift_of[g][4 * cq + c]);
  }
  __syncthreads();
  store_v_rows<kVThreads>(out_rows, dst, P);
}

}  // namespace mxflash::cuda::attn
