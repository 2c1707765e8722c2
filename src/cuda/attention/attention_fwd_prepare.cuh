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

// Index of the sequence owning padded token tp: the largest b with cu_sf[b] <= tp.
__device__ __forceinline__ int sequence_of_padded(const int32_t* cu_sf, int batch, int64_t tp) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_sf[mid] <= tp) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Four e4m3 bytes (one 32-bit word), each shifted down by `shift` bits (>= 0) and rounded to
// nearest even: e4m3x2 -> f16x2 -> f32 are exact, the multiply by 2^-shift is exact in f32, and the
// conversion back rounds once. NaN stays NaN (0x7F with either sign).
__device__ __forceinline__ uint32_t shift_e4m3x4(uint32_t word, int shift) {
  if (shift == 0) return word;
  const float f = __int_as_float((127 - (shift > 30 ? 30 : shift)) << 23);  // 2^-shift
  uint32_t out = 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(uint16_t(word >> (16 * half))));
    const float lo = __half2float(__ushort_as_half(uint16_t(h2))) * f;
    const float hi = __half2float(__ushort_as_half(uint16_t(h2 >> 16))) * f;
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));  // first source -> upper byte
    out |= uint32_t(r) << (16 * half);
  }
  return out;
}

__device__ __forceinline__ int64_t hdim_scale_index(ScaleLayout l, int64_t t, int64_t tp, int64_t h, int k,
                                                    int64_t H, int64_t P) {
  return l == ScaleLayout::kPlain ? hdim_plain_offset(t, h, k, H) : hdim_blocked_offset(h, tp, k, P);
}

// Q and K: one CTA of 128 threads per (128-token tile, head); thread = token row.
// kPerRow: group = row (Q), else group = the whole tile (K).
template <bool kPerRow>
__global__ void __launch_bounds__(kTile) prepare_rows_kernel(const uint8_t* __restrict__ payload,
                                                             const uint8_t* __restrict__ scales, ScaleLayout layout,
                                                             const int32_t* __restrict__ cu, const int32_t* __restrict__ cu_sf,
                                                             int batch, int64_t H, int64_t P,
                                                             uint8_t* __restrict__ out, float* __restrict__ group_scale) {
  __shared__ int tile_max;
  const int64_t tile = blockIdx.x, h = blockIdx.y;
  const int64_t tp = tile * kTile + threadIdx.x;
  const int b = sequence_of_padded(cu_sf, batch, tile * kTile);
  const int64_t i = tp - cu_sf[b];
  const bool valid = i < int64_t(cu[b + 1]) - cu[b];
  const int64_t t = cu[b] + i;
  uint32_t s[4] = {0, 0, 0, 0};
  int row_max = 0;
  if (valid) {
    for (int k = 0; k < 4; ++k) {
      s[k] = scales[hdim_scale_index(layout, t, tp, h, k, H, P)];
      row_max = max(row_max, int(s[k]));
    }
  }
  int group = row_max;
  if (!kPerRow) {
    if (threadIdx.x == 0) tile_max = 0;
    __syncthreads();
    atomicMax(&tile_max, row_max);
    __syncthreads();
    group = tile_max;
  }
  uint4 words[8];
  const uint4* src = reinterpret_cast<const uint4*>(payload + (t * H + h) * kHeadDim);
#pragma unroll
  for (int w = 0; w < 8; ++w) words[w] = valid ? src[w] : make_uint4(0, 0, 0, 0);
  if (valid) {
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      const int shift = group - int(s[w / 2]);  // 16 bytes per word, 32 per block
      uint32_t* x = reinterpret_cast<uint32_t*>(&words[w]);
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = shift_e4m3x4(x[j], shift);
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(out + (h * P + tp) * kHeadDim);
#pragma unroll
  for (int w = 0; w < 8; ++w) dst[w] = words[w];
  const float scale = e8m0_to_float(uint8_t(group));
  if (kPerRow) {
    group_scale[h * P + tp] = valid ? scale : 1.f;
  } else if (threadIdx.x == 0) {
    group_scale[h * (P / kTile) + tile] = scale;
  }
}

// V, step 1: per (sequence, head, channel) the largest seq-block scale byte of the sequence.
// One CTA per (sequence, head): kSlices x 128 threads, slice i takes groups i, i + kSlices, ...
inline constexpr int kVScaleSlices = 8;
__global__ void __launch_bounds__(kVScaleSlices * kHeadDim)
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

// V, step 2: one CTA of 128 threads per (128-token tile, head): the tile goes through shared memory
// and each thread writes one channel's 128 tokens, permuted and re-expressed.
__global__ void __launch_bounds__(kTile) prepare_v_kernel(const uint8_t* __restrict__ payload, PayloadLayout playout,
                                                          const uint8_t* __restrict__ scales, ScaleLayout slayout,
                                                          const int32_t* __restrict__ cu, const int32_t* __restrict__ cu_sf,
                                                          int batch, int64_t H, int64_t P,
                                                          const uint8_t* __restrict__ channel_byte,
                                                          uint8_t* __restrict__ out) {
  constexpr int kPitch = kHeadDim + 16;  // bytes per token row in shared memory (bank spread)
  __shared__ __align__(16) uint8_t tile_bytes[kTile * kPitch];
  const int64_t tile = blockIdx.x, h = blockIdx.y;
  const int b = sequence_of_padded(cu_sf, batch, tile * kTile);
  const int64_t len = int64_t(cu[b + 1]) - cu[b];
  const int64_t first = tile * kTile - cu_sf[b];  // first token of the tile within its sequence
  const int64_t rem = len - first;
  const int valid_tokens = rem <= 0 ? 0 : (rem >= kTile ? kTile : int(rem));
  if (playout == PayloadLayout::kTokenMajor) {
    // thread = token row: 128 contiguous bytes
    const int r = threadIdx.x;
    uint4* dst = reinterpret_cast<uint4*>(tile_bytes + r * kPitch);
    const uint4* src = reinterpret_cast<const uint4*>(payload + ((cu[b] + first + r) * H + h) * kHeadDim);
#pragma unroll
    for (int w = 0; w < 8; ++w) dst[w] = r < valid_tokens ? src[w] : make_uint4(0, 0, 0, 0);
  } else {
    // thread = channel: 128 contiguous tokens of (H, 128, P)
    const int d = threadIdx.x;
    const uint8_t* src = payload + (h * kHeadDim + d) * P + tile * kTile;
    for (int r = 0; r < kTile; ++r) tile_bytes[r * kPitch + d] = r < valid_tokens ? src[r] : 0;
  }
  __syncthreads();
  const int d = threadIdx.x;
  const int top = channel_byte[(int64_t(b) * H + h) * kHeadDim + d];
  uint8_t* dst = out + (h * kHeadDim + d) * P + tile * kTile;
  for (int g = 0; g < kTile / kBlockSize; ++g) {
    const int64_t pg = (tile * kTile) / kBlockSize + g;
    int shift = 0;
    if (g * kBlockSize < valid_tokens) {
      const int64_t o = slayout == ScaleLayout::kPlain ? seq_plain_offset(pg, h, d, H) : seq_blocked_offset(h, d, pg, P);
      shift = top - int(scales[o]);
    }
    uint32_t words[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      uint32_t o = 0;
#pragma unroll
      for (int byte = 0; byte < 4; ++byte) {
        const int r = g * kBlockSize + permuted_token(4 * w + byte);
        o |= uint32_t(tile_bytes[r * kPitch + d]) << (8 * byte);
      }
      words[w] = shift_e4m3x4(o, shift);
    }
    uint4* d16 = reinterpret_cast<uint4*>(dst + g * kBlockSize);
    d16[0] = make_uint4(words[0], words[1], words[2], words[3]);
    d16[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
}

}  // namespace mxflash::cuda::attn
