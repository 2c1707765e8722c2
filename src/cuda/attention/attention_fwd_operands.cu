// The forward's operands in the main kernel's execution layout, written from the unquantized Q, K, V
// in one pass each (no MX tensor in between, no prepare pass): every element is quantized to MX
// exactly as the quantizer does (RCEIL, 32-blocks, hardware e4m3 conversion, non-finite patching)
// and its byte then re-expressed to the coarser power-of-two scale of its group, exactly as the
// prepare pass does (shift_e4m3x4):
//   Q: per (head, row); K: per (head, 128-key tile)  -> prepare_rows_kernel with XRowSource;
//   V: per (head, 128-key tile, channel)             -> operand_v_kernel.
// A group never spans more than one 128-token strip, the unit each CTA reads once. The bytes equal
// ref::attention_fwd_operands (the CPU: the MX quantizer, then the same re-expression).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/attention/attention_fwd.h"
#include "cuda/attention/attention_fwd_prepare.cuh"
#include "cuda/common/launch_utils.cuh"
#include "cuda/quantize/quantize_kernel.cuh"

namespace mxflash::cuda {
namespace attn {
namespace {

// prepare_rows_kernel's source: 16 elements of a row of x (half of the 32-block chunk / 2; the
// other half is in the neighbouring lane) quantized to MX bytes, and the block's scale byte.
template <typename In>
struct XRowSource {
  const In* x;
  int64_t H;
  static constexpr int kLoads = int(16 * sizeof(In) / sizeof(uint4));  // 2 (bf16) or 4 (fp32)
  using Map = QuantTileMap<In>;
  __device__ __forceinline__ void operator()(bool valid, int64_t t, int64_t, int64_t h, int chunk, uint4* words,
                                             int* s) const {
    const In* row = x + (t * H + h) * kHeadDim + chunk * 16;
    uint4 v[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) v[i] = valid ? reinterpret_cast<const uint4*>(row)[i] : make_uint4(0, 0, 0, 0);
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) amax = max(amax, chunk_amax_bits<In>(v[i]));
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));  // the block's other 16 elements
    const uint32_t sb = scale_byte_from_amax_bits(amax, ScalingMode::kRceil);
    float inv[Map::kElems];
#pragma unroll
    for (int e = 0; e < Map::kElems; ++e) inv[e] = e8m0_inv_scale(uint8_t(sb));
    uint32_t q[4];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      uint32_t part[Map::kOutWords];
      quantize_chunk<In>(v[i], inv, part);
#pragma unroll
      for (int o = 0; o < Map::kOutWords; ++o) q[i * Map::kOutWords + o] = part[o];
    }
    if (sb == kE8m0Nan) {  // rare: inf / NaN elements (only in such blocks) get the quantizer's bytes
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const uint32_t u = x_bits<In>(row, e);
        if ((u & kExpAllOnes) == kExpAllOnes)
          q[e / 4] = (q[e / 4] & ~(0xFFu << (8 * (e % 4)))) | (e4m3_nonfinite_byte(u) << (8 * (e % 4)));
      }
    }
    *words = make_uint4(q[0], q[1], q[2], q[3]);
    *s = int(sb);
  }
};

// V: one CTA of 256 threads per (128-token tile, head). Thread (g, dp) quantizes channels 2 dp and
// 2 dp + 1 over the 32 tokens of group g (one MX block each; a warp reads 128 or 256 contiguous
// bytes per token), the tile's channel scale is the largest of its 4 block scales (shared memory),
// and each channel's 32 bytes leave re-expressed and permuted (permuted_token) as 32 contiguous
// bytes of V' row d. Tokens past the sequence end are zeros; tile_scale gets e8m0 of the channel
// scale.
inline constexpr int kOperandVThreads = 256;
template <typename In>
__global__ void __launch_bounds__(kOperandVThreads) operand_v_kernel(const In* __restrict__ x,
                                                                     const int32_t* __restrict__ cu,
                                                                     const int32_t* __restrict__ cu_sf, int batch,
                                                                     int64_t H, int64_t P, uint8_t* __restrict__ out,
                                                                     float* __restrict__ tile_scale) {
  constexpr int kGroups = kTile / kBlockSize;  // 4
  __shared__ uint8_t scale_of[kGroups][kHeadDim];
  const int64_t tile = blockIdx.x, h = blockIdx.y;
  const int b = sequence_of_padded(cu_sf, batch, tile * kTile);
  const int64_t len = int64_t(cu[b + 1]) - cu[b];
  const int64_t first = tile * kTile - cu_sf[b];
  const int64_t rem = len - first;
  const int valid_tokens = rem <= 0 ? 0 : (rem >= kTile ? kTile : int(rem));
  const int g = int(threadIdx.x) / (kHeadDim / 2), dp = int(threadIdx.x) % (kHeadDim / 2);
  const int d0 = 2 * dp;
  const In* src = x + ((cu[b] + first + g * kBlockSize) * H + h) * kHeadDim + d0;
  // The group's tokens of the two channels (zeros past the end): bf16 pairs as loaded (one
  // register per token), fp32 as two registers.
  constexpr bool kBf16 = sizeof(In) == 2;
  uint32_t xa[kBlockSize], xb[kBf16 ? 1 : kBlockSize];
  const int valid = min(max(valid_tokens - g * kBlockSize, 0), kBlockSize);  // tokens of the group
  const uint32_t stride = uint32_t(H * kHeadDim * sizeof(In));               // bytes per token
  const char* at = reinterpret_cast<const char*>(src);
#pragma unroll
  for (int i = 0; i < kBlockSize; ++i, at += stride) {
    if constexpr (kBf16) {
      xa[i] = i < valid ? *reinterpret_cast<const uint32_t*>(at) : 0u;
    } else {
      const float2 w = i < valid ? *reinterpret_cast<const float2*>(at) : make_float2(0.f, 0.f);
      xa[i] = __float_as_uint(w.x);
      xb[i] = __float_as_uint(w.y);
    }
  }
  // fp32 bits of token i of channel d0 + c
  auto elem = [&](int c, int i) -> uint32_t {
    if constexpr (kBf16) return c == 0 ? xa[i] << 16 : xa[i] & 0xFFFF0000u;
    else return c == 0 ? xa[i] : xb[i];
  };
  uint32_t sb[2];
  uint32_t q[2][kBlockSize / 4];  // per channel: 8 words, tokens 4w..4w+3 of the group
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kBlockSize; ++i) amax = max(amax, elem(c, i) & kAbsMask);
    sb[c] = scale_byte_from_amax_bits(amax, ScalingMode::kRceil);
    const float inv = e8m0_inv_scale(uint8_t(sb[c]));
#pragma unroll
    for (int w = 0; w < kBlockSize / 4; ++w) {
      const uint32_t lo = e4m3x2_satfinite(__uint_as_float(elem(c, 4 * w)) * inv, __uint_as_float(elem(c, 4 * w + 1)) * inv);
      const uint32_t hi =
          e4m3x2_satfinite(__uint_as_float(elem(c, 4 * w + 2)) * inv, __uint_as_float(elem(c, 4 * w + 3)) * inv);
      q[c][w] = lo | (hi << 16);
    }
    if (sb[c] == kE8m0Nan) {  // rare: inf / NaN elements get the quantizer's bytes
#pragma unroll
      for (int i = 0; i < kBlockSize; ++i)
        if ((elem(c, i) & kExpAllOnes) == kExpAllOnes) {
          const int sh = 8 * (i % 4);
          q[c][i / 4] = (q[c][i / 4] & ~(0xFFu << sh)) | (e4m3_nonfinite_byte(elem(c, i)) << sh);
        }
    }
    scale_of[g][d0 + c] = uint8_t(sb[c]);
  }
  __syncthreads();
  uint8_t* dst = out + h * kHeadDim * P + tile * kTile + g * kBlockSize;  // + d * P: channel row d
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int d = d0 + c;
    int tile_max = 0;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) tile_max = max(tile_max, int(scale_of[k][d]));
    const int shift = tile_max - int(sb[c]);
    uint32_t o[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      const int base = v_word_base(w);  // tokens base, base + 1 (word base / 4), base + 8, base + 9
      o[w] = shift_e4m3x4(__byte_perm(q[c][base / 4], q[c][base / 4 + 2], base % 4 == 0 ? 0x5410 : 0x7632), shift);
    }
    uint4* d16 = reinterpret_cast<uint4*>(dst + int64_t(d) * P);
    d16[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d16[1] = make_uint4(o[4], o[5], o[6], o[7]);
    if (g == 0) tile_scale[(h * (P / kTile) + tile) * kHeadDim + d] = e8m0_to_float(uint8_t(tile_max));
  }
}

template <typename In>
Status launch_operands(const AttentionFwdProblem& p, const In* q, const In* k, const In* v, const FwdExecOperands& out,
                       cudaStream_t stream) {
  const int64_t H = p.heads;
  if (p.Pq > 0) {
    prepare_rows_kernel<true><<<dim3(unsigned(p.Pq / kTile), unsigned(H)), kRowThreads, 0, stream>>>(
        XRowSource<In>{q, H}, p.cu_q, p.cu_q_sf, p.broadcast_q ? 1 : p.batch, p.Pq, out.q, out.q_scale);
    MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "quantize_attention_forward: Q launch"));
  }
  if (p.Pk > 0) {
    prepare_rows_kernel<false><<<dim3(unsigned(p.Pk / kTile), unsigned(H)), kRowThreads, 0, stream>>>(
        XRowSource<In>{k, H}, p.cu_k, p.cu_k_sf, p.batch, p.Pk, out.k, out.k_scale);
    MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "quantize_attention_forward: K launch"));
    operand_v_kernel<In><<<dim3(unsigned(p.Pk / kTile), unsigned(H)), kOperandVThreads, 0, stream>>>(
        v, p.cu_k, p.cu_k_sf, p.batch, H, p.Pk, out.v, out.v_scale);
    MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "quantize_attention_forward: V launch"));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace attn

Status quantize_attention_fwd_operands(const AttentionFwdProblem& p, const void* q, const void* k, const void* v,
                                       bool x_fp32, const FwdExecOperands& out, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (x_fp32)
    return attn::launch_operands(p, static_cast<const float*>(q), static_cast<const float*>(k),
                                 static_cast<const float*>(v), out, s);
  return attn::launch_operands(p, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                               static_cast<const uint16_t*>(v), out, s);
}

}  // namespace mxflash::cuda
