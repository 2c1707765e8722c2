// Device helpers of the exact-MX GPU paths (attention_fwd_exact.cu, attention_bwd_exact.cu): the
// dequantized value of one element of an MX operand, the sequence owning a token, warp sums.
#pragma once
#include <cstdint>

#include "cuda/attention/attention_fwd.h"
#include "mxflash/jagged.h"
#include "mxflash/mx.h"

namespace mxflash::cuda::exact {

// The largest b with cu[b] <= t: the sequence owning token t (empty sequences are skipped).
__device__ __forceinline__ int sequence_of(const int32_t* cu, int batch, int64_t t) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}
__device__ __forceinline__ float hdim_value(const MxOperand& x, int64_t t, int64_t tp, int64_t h, int d, int64_t H,
                                            int64_t P) {
  const uint8_t s = x.scales[x.scale_layout == ScaleLayout::kPlain ? hdim_plain_offset(t, h, d / kBlockSize, H)
                                                               : hdim_blocked_offset(h, tp, d / kBlockSize, P)];
  return dequantize_element(x.payload[(t * H + h) * kHeadDim + d], s);
}

__device__ __forceinline__ float seq_value(const MxOperand& x, int64_t t, int64_t tp, int64_t h, int d, int64_t H,
                                           int64_t P) {
  const int64_t g = tp / kBlockSize;
  const int64_t so = x.scale_layout == ScaleLayout::kPlain ? seq_plain_offset(g, h, d, H) : seq_blocked_offset(h, d, g, P);
  const int64_t po = x.payload_layout == PayloadLayout::kTokenMajor ? (t * H + h) * kHeadDim + d
                                                                     : (h * kHeadDim + d) * P + tp;
  return dequantize_element(x.payload[po], x.scales[so]);
}

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

// The metadata and shared shape fields of a problem (AttentionFwdProblem / AttentionBwdProblem)
// copied into an exact kernel's parameters.
template <typename Params, typename Problem>
void copy_common(const Problem& p, Params* e) {
  e->cu_q = p.cu_q;
  e->cu_q_sf = p.cu_q_sf;
  e->cu_k = p.cu_k;
  e->cu_k_sf = p.cu_k_sf;
  e->H = p.heads;
  e->Pq = p.Pq;
  e->Pk = p.Pk;
  e->To = p.To;
  e->softmax_scale = p.softmax_scale;
  e->broadcast_q = p.broadcast_q;
  e->causal = p.causal;
}

}  // namespace mxflash::cuda::exact
