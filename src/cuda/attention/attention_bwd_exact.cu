// The exact-MX backward on the GPU: the CPU reference's exact-MX method (ref::attention_backward,
// src/reference/attention_ref.cpp) step for step — operands dequantized from their MX blocks, dO
// quantized in 32x32 blocks, P = exp2(min(S·scale·log2e − LSE·log2e, 20)) rounded as e4m3(256 p),
// D = rowsum(O∘dO), dS = P∘(dP − D) quantized in-kernel style in 1x32 blocks along Q tokens (dK) and
// 32x32 blocks (dQ), fp32 roundings where the reference has them, FP64 sums. Sums are associated
// differently (FP64 atomics across Q blocks), so results agree with the reference to the last bit
// except where that order flips an fp32 / bf16 rounding. Slow on purpose: the oracle for the fast
// backward on shapes the CPU cannot reach. The causal mask as the reference applies it: P = dS = 0
// exactly for the keys a row does not see (j >= causal_keys(causal, i, Lq, Lk)), a row facing exactly
// one key gets dS = 0, and a Q block whose rows see no key is not launched (its dQ stays 0).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/attention/attention_bwd.h"
#include "cuda/attention/attention_exact_common.cuh"
#include "cuda/common/launch_utils.cuh"
#include "cuda/common/upload.h"
#include "cuda/common/workspace.h"

namespace mxflash::cuda {
namespace {
using exact::hdim_value;
using exact::seq_value;

constexpr int kRows = kBlockSize;  // Q rows per CTA: one dS block along Q tokens
constexpr int kKeys = kBlockSize;  // keys per chunk: one 32x32 dS block
constexpr int kBwdThreads = 256;
constexpr double kLog2eD = 1.4426950408889634074;  // as the reference
constexpr double kPClamp = 20.0;                    // backward P = exp2(min(x, 20))

struct BwdExactParams {
  const int32_t* cu_q;
  const int32_t* cu_q_sf;
  const int32_t* cu_k;
  const int32_t* cu_k_sf;
  MxOperand q, q_seq, k, k_seq, v;
  const __nv_bfloat16* out;
  const __nv_bfloat16* dout;
  const float* lse;
  const int4* blocks;  // (K/V sequence b, first row i0, rows n, Q sequence qb)
  int64_t H, Pq, Pk, To;
  double softmax_scale;
  bool broadcast_q;
  CausalMask causal;
  double* dq_acc;  // (Tq, H, 128)
  double* dk_acc;  // (Tk, H, 128)
  double* dv_acc;  // (Tk, H, 128)
};

struct BwdSmem {
  float q_s[kRows][kHeadDim];   // Q along hdim (S)
  float q_dk[kRows][kHeadDim];  // Q along seq (dK)
  float dog[kRows][kHeadDim];   // dO in 32x32 blocks (dP, dV)
  float k_s[kKeys][kHeadDim];   // K chunk along hdim (S)
  float k_dq[kKeys][kHeadDim];  // K chunk along seq (dQ)
  float v_dp[kKeys][kHeadDim];  // V chunk along hdim (dP)
  double ps[kRows][kKeys];      // P as e4m3(256 p) / 256
  double dsk[kRows][kKeys];     // dS, 1x32 blocks along Q tokens
  double dsq[kRows][kKeys];     // dS, one 32x32 block
  double lse[kRows], dsum[kRows];
};

// The reference's dot128: four interleaved partial sums.
__device__ __forceinline__ double dot128(const float* a, const float* b) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int d = 0; d < kHeadDim; d += 4) {
    s0 += double(a[d]) * double(b[d]);
    s1 += double(a[d + 1]) * double(b[d + 1]);
    s2 += double(a[d + 2]) * double(b[d + 2]);
    s3 += double(a[d + 3]) * double(b[d + 3]);
  }
  return (s0 + s1) + (s2 + s3);
}

__device__ __forceinline__ double to_f32(double x) { return double(float(x)); }

// In-kernel MX rounding of a block's values (RCEIL, zero block byte 127), given its amax.
__device__ __forceinline__ double mx_round(double x, float amax) {
  const uint8_t s = e8m0_scale_byte(amax, ScalingMode::kRceil, kE8m0One);
  return double(dequantize_element(quantize_element(float(x), e8m0_inv_scale(s)), s));
}

__global__ void __launch_bounds__(kBwdThreads) attention_bwd_exact_kernel(const BwdExactParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  BwdSmem& sm = *reinterpret_cast<BwdSmem*>(smem_raw);
  const int4 blk = p.blocks[blockIdx.x];
  const int b = blk.x, i0 = blk.y, n = blk.z, qb = blk.w;
  const int64_t h = blockIdx.y;
  const int tid = threadIdx.x;
  const int64_t q0 = p.cu_q[qb], q0p = p.cu_q_sf[qb], lq = p.cu_q[qb + 1] - q0;
  const int64_t o0 = p.broadcast_q ? int64_t(b) * lq : q0;  // output token of the sequence's row 0
  const int64_t k0 = p.cu_k[b], k0p = p.cu_k_sf[b], lk = p.cu_k[b + 1] - k0;

  // Rows: Q in both orientations, dO (bf16), LSE, D = rowsum(O∘dO) rounded to fp32.
  for (int e = tid; e < kRows * kHeadDim; e += kBwdThreads) {
    const int r = e / kHeadDim, d = e % kHeadDim;
    float qs = 0.f, qd = 0.f, g = 0.f;
    if (r < n) {
      const int64_t i = i0 + r;
      qs = hdim_value(p.q, q0 + i, q0p + i, h, d, p.H, p.Pq);
      qd = seq_value(p.q_seq, q0 + i, q0p + i, h, d, p.H, p.Pq);
      g = __bfloat162float(p.dout[((o0 + i) * p.H + h) * kHeadDim + d]);
    }
    sm.q_s[r][d] = qs;
    sm.q_dk[r][d] = qd;
    sm.dog[r][d] = g;
  }
  __syncthreads();
  if (tid < kRows) {
    const int r = tid;
    double lse = 0.0, dsum = 0.0;
    if (r < n) {
      const int64_t to = o0 + i0 + r;
      lse = double(p.lse[h * p.To + to]);
      float o[kHeadDim];
      for (int d = 0; d < kHeadDim; ++d) o[d] = __bfloat162float(p.out[(to * p.H + h) * kHeadDim + d]);
      dsum = to_f32(dot128(o, sm.dog[r]));  // the fp32 dO, before its quantization
    }
    sm.lse[r] = lse;
    sm.dsum[r] = dsum;
  }
  __syncthreads();
  // dO in 32x32 blocks (the library quantizer's rule: RCEIL, amax over the block's valid rows).
  if (tid < kHeadDim) {  // warp w quantizes block w, lane = column
    const int d = tid;
    float amax = 0.f;
    for (int r = 0; r < n; ++r) amax = amax_nan(amax, sm.dog[r][d]);
    for (int o = 16; o > 0; o /= 2) amax = amax_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const uint8_t s = e8m0_scale_byte(amax, ScalingMode::kRceil, 0);
    const float inv = e8m0_inv_scale(s);
    for (int r = 0; r < n; ++r) sm.dog[r][d] = dequantize_element(quantize_element(sm.dog[r][d], inv), s);
  }
  __syncthreads();

  constexpr int kPer = kRows * kHeadDim / kBwdThreads;  // dQ outputs per thread
  double dq[kPer];
  for (int k = 0; k < kPer; ++k) dq[k] = 0.0;

  // Keys beyond the block's last row's (causal_keys grows with the row) are masked for every row.
  const int64_t keys_end = causal_keys(p.causal, i0 + n - 1, lq, lk);
  for (int64_t j0 = 0; j0 < keys_end; j0 += kKeys) {
    const int nk = int(lk - j0 < kKeys ? lk - j0 : kKeys);
    for (int e = tid; e < kKeys * kHeadDim; e += kBwdThreads) {
      const int c = e / kHeadDim, d = e % kHeadDim;
      float ks = 0.f, kd = 0.f, vd = 0.f;
      if (c < nk) {
        const int64_t j = j0 + c;
        ks = hdim_value(p.k, k0 + j, k0p + j, h, d, p.H, p.Pk);
        kd = seq_value(p.k_seq, k0 + j, k0p + j, h, d, p.H, p.Pk);
        vd = hdim_value(p.v, k0 + j, k0p + j, h, d, p.H, p.Pk);
      }
      sm.k_s[c][d] = ks;
      sm.k_dq[c][d] = kd;
      sm.v_dp[c][d] = vd;
    }
    __syncthreads();
    // P, dS of the 32 x 32 chunk.
    for (int e = tid; e < kRows * kKeys; e += kBwdThreads) {
      const int r = e / kKeys, c = e % kKeys;
      double pq = 0.0, ds = 0.0;
      const int64_t row_keys = r < n ? causal_keys(p.causal, i0 + r, lq, lk) : 0;  // the row's keys
      if (r < n && j0 + c < row_keys) {  // (c < nk follows: row_keys <= lk)
        const double lse = sm.lse[r];
        const double x = to_f32(dot128(sm.q_s[r], sm.k_s[c])) * p.softmax_scale * kLog2eD - lse * kLog2eD;
        const double pij = lse == -INFINITY ? 0.0 : to_f32(exp2(fmin(x, kPClamp)));
        const double dp = to_f32(dot128(sm.dog[r], sm.v_dp[c]));
        ds = row_keys == 1 ? 0.0 : to_f32(pij * (dp - sm.dsum[r]));  // one key: dS = 0 exactly
        pq = double(e4m3_to_float(float_to_e4m3(float(pij) * 256.f, /*saturate=*/true))) / 256.0;
      }
      sm.ps[r][c] = pq;
      sm.dsk[r][c] = ds;
      sm.dsq[r][c] = ds;
    }
    __syncthreads();
    if (tid < kKeys) {  // dS for dK: 1x32 blocks along Q tokens (column c over the block's rows)
      const int c = tid;
      float amax = 0.f;
      for (int r = 0; r < n; ++r) amax = amax_nan(amax, float(sm.dsk[r][c]));
      for (int r = 0; r < n; ++r) sm.dsk[r][c] = mx_round(sm.dsk[r][c], amax);
    } else if (tid < 2 * kKeys) {  // dS for dQ: the 32x32 block; lane = row
      const int r = tid - kKeys;
      float amax = 0.f;
      if (r < n)
        for (int c = 0; c < nk; ++c) amax = amax_nan(amax, float(sm.dsq[r][c]));
      for (int o = 16; o > 0; o /= 2) amax = amax_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      if (r < n)
        for (int c = 0; c < nk; ++c) sm.dsq[r][c] = mx_round(sm.dsq[r][c], amax);
    }
    __syncthreads();
    // dV += Pᵀ dO, dK += dSᵀ Q (over this block's rows), dQ += dS K (over this chunk's keys).
    for (int e = tid; e < kKeys * kHeadDim; e += kBwdThreads) {
      const int c = e / kHeadDim, d = e % kHeadDim;
      if (c >= nk) continue;
      double sv = 0.0, sk = 0.0;
      for (int r = 0; r < n; ++r) {
        sv += sm.ps[r][c] * double(sm.dog[r][d]);
        sk += sm.dsk[r][c] * double(sm.q_dk[r][d]);
      }
      const int64_t at = ((k0 + j0 + c) * p.H + h) * kHeadDim + d;
      atomicAdd(p.dv_acc + at, sv);
      atomicAdd(p.dk_acc + at, sk);
    }
    for (int k = 0; k < kPer; ++k) {
      const int e = tid + k * kBwdThreads, r = e / kHeadDim, d = e % kHeadDim;
      double s = 0.0;
      for (int c = 0; c < nk; ++c) s += sm.dsq[r][c] * double(sm.k_dq[c][d]);
      dq[k] += s;
    }
    __syncthreads();
  }
  for (int k = 0; k < kPer; ++k) {
    const int e = tid + k * kBwdThreads, r = e / kHeadDim, d = e % kHeadDim;
    if (r < n) atomicAdd(p.dq_acc + ((q0 + i0 + r) * p.H + h) * kHeadDim + d, dq[k]);
  }
}

// x · scale rounded to bf16 through fp32, as the reference finishes dQ, dK, dV.
__global__ void finish_kernel(const double* acc, double scale, int64_t n, __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(float(acc[i] * scale));
}

}  // namespace

Status attention_backward_exact(const AttentionBwdProblem& p, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // The 32-row Q blocks of every (K/V sequence, Q sequence) pair that has keys and queries, less
  // those whose rows the causal mask shows no key (their last row sees the most).
  std::vector<int4> blocks;
  const std::vector<int32_t>& cq = *p.host_cu_q;
  const std::vector<int32_t>& ck = *p.host_cu_k;
  for (int b = 0; b < p.batch; ++b) {
    const int qb = p.broadcast_q ? 0 : b;
    const int lq = cq[qb + 1] - cq[qb], lk = ck[b + 1] - ck[b];
    if (lk == 0) continue;
    for (int i0 = 0; i0 < lq; i0 += kRows) {
      const int n = std::min(kRows, lq - i0);
      if (causal_keys(p.causal, i0 + n - 1, lq, lk) > 0) blocks.push_back(make_int4(b, i0, n, qb));
    }
  }
  const int64_t nq = p.Tq * p.heads * kHeadDim, nk = p.Tk * p.heads * kHeadDim;
  const size_t acc_bytes = size_t(nq + 2 * nk) * sizeof(double), list_bytes = blocks.size() * sizeof(int4);
  void* ws = nullptr;
  MXFLASH_RETURN_IF_ERROR(
      workspace_alloc(acc_bytes + list_bytes + 16, stream, &ws, "attention_backward (exact) workspace"));
  auto run = [&]() -> Status {
    double* acc = static_cast<double*>(ws);
    int4* list = reinterpret_cast<int4*>(static_cast<uint8_t*>(ws) + acc_bytes);
    MXFLASH_RETURN_IF_ERROR(cuda_error(cudaMemsetAsync(acc, 0, acc_bytes, stream), "cudaMemsetAsync"));
    if (!blocks.empty()) {
      MXFLASH_RETURN_IF_ERROR(upload_to_device(list, blocks.data(), list_bytes, stream));
      BwdExactParams e;
      exact::copy_common(p, &e);
      e.q = p.q;
      e.q_seq = p.q_seq;
      e.k = p.k;
      e.k_seq = p.k_seq;
      e.v = p.v;
      e.out = static_cast<const __nv_bfloat16*>(p.out);
      e.dout = static_cast<const __nv_bfloat16*>(p.dout);
      e.lse = p.lse;
      e.blocks = list;
      e.dq_acc = acc;
      e.dk_acc = acc + nq;
      e.dv_acc = acc + nq + nk;
      const int smem = int(sizeof(BwdSmem));
      MXFLASH_RETURN_IF_ERROR(cuda_error(
          cudaFuncSetAttribute(attention_bwd_exact_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
          "cudaFuncSetAttribute(attention_bwd_exact_kernel)"));
      attention_bwd_exact_kernel<<<dim3(unsigned(blocks.size()), unsigned(p.heads)), kBwdThreads, smem, stream>>>(e);
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "attention_bwd_exact_kernel launch"));
    }
    const double scale = p.softmax_scale;
    const struct {
      const double* acc;
      double scale;
      int64_t n;
      void* out;
    } outs[] = {{acc, scale, nq, p.dq}, {acc + nq, scale, nk, p.dk}, {acc + nq + nk, 1.0, nk, p.dv}};
    for (const auto& o : outs) {
      if (o.n == 0) continue;
      const unsigned grid = unsigned(std::min<int64_t>((o.n + 255) / 256, 4096));
      finish_kernel<<<grid, 256, 0, stream>>>(o.acc, o.scale, o.n, static_cast<__nv_bfloat16*>(o.out));
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetLastError(), "finish_kernel launch"));
    }
    return Status::Ok();
  };
  Status st = run();
  const Status fr = workspace_free(ws, stream, "attention_backward (exact) workspace free");
  return st.ok() ? fr : st;
}

}  // namespace mxflash::cuda
