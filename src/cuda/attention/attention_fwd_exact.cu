// The exact-MX forward on the GPU: every 32-block scale applied to every product, FP64 sums, P
// rounded as e4m3(256 p) from the final row max: the same arithmetic, step for step, as the CPU
// reference's exact-MX method (src/reference/attention_ref.cpp), so results agree with it to the
// last bit except where a double sum's order or a libm last bit flips an fp32 rounding. Slow on
// purpose (one warp per output row, two passes over the keys): the oracle for shapes the CPU
// reference cannot reach in a test. The causal mask as the reference applies it: row i reads keys
// 0 .. causal_keys(causal, i, Lq, Lk) - 1 only (the row max, the row sum and P.V over those), and a
// row facing no key gets O = 0, LSE = -inf.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/attention/attention_exact_common.cuh"
#include "cuda/attention/attention_fwd.h"
#include "mxflash/jagged.h"

namespace mxflash::cuda {
namespace {
using exact::hdim_value;
using exact::seq_value;
using exact::sequence_of;
using exact::warp_sum;

constexpr int kWarpsPerBlock = 4;

constexpr int kDimsPerLane = kHeadDim / 32;  // lane l holds head dims 4l..4l+3 (block l/8)

struct ExactParams {
  const int32_t* cu_q;
  const int32_t* cu_q_sf;
  const int32_t* cu_k;
  const int32_t* cu_k_sf;
  MxOperand q, k, v;
  int batch;
  int64_t H, Pq, Pk, To;
  double softmax_scale;
  bool broadcast_q;
  CausalMask causal;
  __nv_bfloat16* out;
  float* lse;
};

__global__ void __launch_bounds__(kWarpsPerBlock * 32) attention_fwd_exact_kernel(const ExactParams p) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t h = blockIdx.y;
  const int lane = threadIdx.x % 32;
  if (row >= p.To) return;
  // Output row -> (K/V sequence b, query i, Q token).
  int b;
  int64_t i, tq;
  if (p.broadcast_q) {
    const int64_t lq = p.cu_q[1] - p.cu_q[0];
    b = int(row / lq);
    i = row % lq;
    tq = p.cu_q[0] + i;
  } else {
    b = sequence_of(p.cu_q, p.batch, row);
    i = row - p.cu_q[b];
    tq = row;
  }
  const int qb = p.broadcast_q ? 0 : b;
  const int64_t tq_p = p.cu_q_sf[qb] + i, lq = p.cu_q[qb + 1] - p.cu_q[qb];
  const int64_t k0 = p.cu_k[b], k0_p = p.cu_k_sf[b];
  // The keys the row sees: 0 .. nk - 1 of its K/V sequence (all of them without a causal mask).
  const int64_t nk = causal_keys(p.causal, i, lq, p.cu_k[b + 1] - k0);
  __nv_bfloat16* o = p.out + (row * p.H + h) * kHeadDim;
  if (nk == 0) {  // no key (an empty K/V sequence, or the mask): O = 0, LSE = -inf
    for (int d = lane; d < kHeadDim; d += 32) o[d] = __float2bfloat16_rn(0.f);
    if (lane == 0) p.lse[h * p.To + row] = -INFINITY;
    return;
  }
  float q[kDimsPerLane];
  for (int e = 0; e < kDimsPerLane; ++e) q[e] = hdim_value(p.q, tq, tq_p, h, kDimsPerLane * lane + e, p.H, p.Pq);
  auto score = [&](int64_t j) {  // S_j * softmax_scale, S_j rounded to fp32 as the kernels' accumulators
    double part = 0.0;
    for (int e = 0; e < kDimsPerLane; ++e)
      part += double(q[e]) * double(hdim_value(p.k, k0 + j, k0_p + j, h, kDimsPerLane * lane + e, p.H, p.Pk));
    return double(float(warp_sum(part))) * p.softmax_scale;
  };
  double m = -INFINITY;
  for (int64_t j = 0; j < nk; ++j) m = fmax(m, score(j));
  double l = 0.0, acc[kDimsPerLane] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t j = 0; j < nk; ++j) {
    const double pj = double(float(exp(score(j) - m)));
    l += pj;
    const double pq = double(e4m3_to_float(float_to_e4m3(float(pj) * 256.f))) / 256.0;
    if (pq == 0.0) continue;
    for (int e = 0; e < kDimsPerLane; ++e)
      acc[e] += pq * double(seq_value(p.v, k0 + j, k0_p + j, h, kDimsPerLane * lane + e, p.H, p.Pk));
  }
  l = double(float(l));
  for (int e = 0; e < kDimsPerLane; ++e) o[kDimsPerLane * lane + e] = __float2bfloat16_rn(float(acc[e] / l));
  if (lane == 0) p.lse[h * p.To + row] = float(m + log(l));
}

}  // namespace

Status attention_forward_exact(const AttentionFwdProblem& p, void* stream) {
  ExactParams e;
  exact::copy_common(p, &e);
  e.q = p.q;
  e.k = p.k;
  e.v = p.v;
  e.batch = p.batch;
  e.out = static_cast<__nv_bfloat16*>(p.out);
  e.lse = p.lse;
  const dim3 grid(unsigned((p.To + kWarpsPerBlock - 1) / kWarpsPerBlock), unsigned(p.heads));
  attention_fwd_exact_kernel<<<grid, kWarpsPerBlock * 32, 0, static_cast<cudaStream_t>(stream)>>>(e);
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string("attention_fwd_exact_kernel launch: ") + cudaGetErrorString(err));
}

}  // namespace mxflash::cuda
