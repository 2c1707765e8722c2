// rmsnorm_backward on CUDA (include/mxflash/fused.h): the arithmetic and order of
// src/common/rmsnorm_rules.h, so that dx and dweight equal the CPU reference's bits. bf16 rows of up
// to 3 chunks a lane with dweight wanted (the module's C = 384) take rmsnorm_backward_fused_kernel,
// which writes dx and dweight's group sums from one read of x and dy; the others these kernels:
// - rows: L = rms_lanes(C) lanes a row (32 / L rows side by side in a warp, as the forward), each
//   lane summing fma(gy, xh) over its chunks; the butterfly; then the lane reads its chunks again
//   (L1/L2 hits) and writes dx;
// - dweight's group sums: a thread per pair of columns and group of rows (rms_bwd_group_rows), its rows
//   in order (coalesced: a warp reads 64 consecutive columns of a row);
// - the groups' sums added in blocks of kRmsBwdSumBlock groups, then the blocks in order, a thread
//   per column (both paths).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/rmsnorm_rules.h"
#include "cuda/common/launch_utils.cuh"
#include "cuda/common/workspace.h"
#include "cuda/fused/fused_cuda.h"
#include "cuda/fused/rms_device.cuh"
#include "cuda/quantize/mx_device.cuh"

namespace mxflash::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

struct BwdParams {
  const void* x;
  const void* weight;  // null: w = 1
  const float* rstd;
  const void* dy;
  void* dx;
  int64_t rows;
  int cols;
  int lanes;     // L
  int per_lane;  // chunks a lane: cols / (8 L)
};

// Values i and i + 1 (i even: 4- or 8-byte aligned).
__device__ __forceinline__ float2 load2(const uint16_t* p, int64_t i) {
  const uint32_t u = __ldg(reinterpret_cast<const unsigned int*>(p + i));
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u));
}
__device__ __forceinline__ float2 load2(const float* p, int64_t i) { return __ldg(reinterpret_cast<const float2*>(p + i)); }

// 8 consecutive values from 16-byte aligned memory as fp32. bf16: the forward's load_raw and widen;
// fp32: two float4 loads (load_raw's form schedules the fp32 kernels with a bf16 or no weight
// differently: this is the form the GPU tests and the benchmark ran).
__device__ __forceinline__ void load8(const uint16_t* p, int64_t i, float (&v)[kRmsChunk]) {
  widen(load_raw(p, i), v);
}
__device__ __forceinline__ void load8(const float* p, int64_t i, float (&v)[kRmsChunk]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p + i)), b = __ldg(reinterpret_cast<const float4*>(p + i) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void store8(uint16_t* p, int64_t i, const float (&v)[kRmsChunk]) {
  *reinterpret_cast<uint4*>(p + i) = pack_bf16x8(v);
}
__device__ __forceinline__ void store8(float* p, int64_t i, const float (&v)[kRmsChunk]) {
  reinterpret_cast<float4*>(p + i)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p + i)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// xh and gy of a chunk (rmsnorm_rules.h).
template <typename T, typename W>
__device__ __forceinline__ void chunk_terms(const BwdParams& p, const T* xr, const T* dyr, int c, float rstd,
                                            float (&xh)[kRmsChunk], float (&gy)[kRmsChunk]) {
  const int64_t i = int64_t(c) * kRmsChunk;
  load8(xr, i, xh);
  load8(dyr, i, gy);
#pragma unroll
  for (int e = 0; e < kRmsChunk; ++e) xh[e] = rms_mul(xh[e], rstd);
  if constexpr (!std::is_void_v<W>) {
    float w[kRmsChunk];
    load8(static_cast<const W*>(p.weight), i, w);
#pragma unroll
    for (int e = 0; e < kRmsChunk; ++e) gy[e] = rms_mul(gy[e], w[e]);
  }
}

// Lane `lane` serves row (warp's first row + lane / L) with chunks q + L i (q = lane % L).
// kLanes: L at compile time (32), or 0: p.lanes. W void: no weight.
template <typename T, typename W, int kLanes>
__global__ void __launch_bounds__(kThreads) rmsnorm_backward_rows_kernel(const BwdParams p) {
  const int lane = int(threadIdx.x % 32);
  const int L = kLanes > 0 ? kLanes : p.lanes, G = 32 / L, q = lane % L;
  const int64_t warp_row0 = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * G;
  if (warp_row0 >= p.rows) return;  // whole warps
  const int64_t row = warp_row0 + lane / L;
  const bool valid = row < p.rows;
  const int64_t r = valid ? row : p.rows - 1;  // rows past the end read the last row, store nothing
  const T* xr = static_cast<const T*>(p.x) + r * p.cols;
  const T* dyr = static_cast<const T*>(p.dy) + r * p.cols;
  const float rstd = p.rstd[r];
  float dot = 0.f;
  for (int i = 0; i < p.per_lane; ++i) {
    float xh[kRmsChunk], gy[kRmsChunk];
    chunk_terms<T, W>(p, xr, dyr, q + L * i, rstd, xh, gy);
#pragma unroll
    for (int e = 0; e < kRmsChunk; ++e) dot = rms_fma(gy[e], xh[e], dot);
  }
  dot = rms_lane_sum<kLanes>(dot, L);
  if (!valid) return;
  const float m = rms_bwd_mean(dot, p.cols);
  T* dxr = static_cast<T*>(p.dx) + r * p.cols;
  for (int i = 0; i < p.per_lane; ++i) {
    const int c = q + L * i;
    float xh[kRmsChunk], gy[kRmsChunk], out[kRmsChunk];
    chunk_terms<T, W>(p, xr, dyr, c, rstd, xh, gy);
#pragma unroll
    for (int e = 0; e < kRmsChunk; ++e) out[e] = rms_bwd_dx(gy[e], xh[e], m, rstd);
    store8(dxr, int64_t(c) * kRmsChunk, out);
  }
}

// dx and dweight's group sums in one pass (bf16 x and dy, dweight requested, at most
// kFusedMaxPerLane chunks a lane): a slot of L lanes per row group (rms_bwd_group_rows), 32 / L slots
// a warp, each slot taking its group's rows in order, kFusedBatch at a time, the next batch loaded
// while one is computed. A lane keeps its chunks of the batch's rows in registers (dx needs no second
// read) and its columns' sums fma(dy, xh, acc) over the group's rows in order, the group kernel's
// arithmetic, which it writes to partial[group] at the end. dx is the rows kernel's, value for value.
constexpr int kFusedMaxPerLane = 3, kFusedWarps = 4, kFusedBatch = 2;

template <typename W, int kLanes>
__global__ void __launch_bounds__(kFusedWarps * 32)
    rmsnorm_backward_fused_kernel(const BwdParams p, int64_t group_rows, int64_t groups, float* partial) {
  constexpr int P = kFusedMaxPerLane;
  const int lane = int(threadIdx.x % 32);
  const int L = kLanes > 0 ? kLanes : p.lanes, q = lane % L;
  const int64_t slot0 = (int64_t(blockIdx.x) * kFusedWarps + threadIdx.x / 32) * (32 / L);
  if (slot0 >= groups) return;  // whole warps
  const int64_t group = slot0 + lane / L;
  const bool live = group < groups;
  const int64_t t0 = (live ? group : groups - 1) * group_rows, t1 = min(p.rows, t0 + group_rows);
  // Every slot of the warp takes as many steps as the longest (the butterfly needs the whole warp);
  // rows past a slot's group read its last row and count nowhere.
  const int n = int(__reduce_max_sync(0xFFFFFFFFu, unsigned(t1 - t0)));
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  const uint16_t* dy = static_cast<const uint16_t*>(p.dy);
  float w[P][kRmsChunk];
  if constexpr (!std::is_void_v<W>) {
#pragma unroll
    for (int c = 0; c < P; ++c)
      if (c < p.per_lane) load8(static_cast<const W*>(p.weight), int64_t(q + L * c) * kRmsChunk, w[c]);
  }
  float acc[P][kRmsChunk];
#pragma unroll
  for (int c = 0; c < P; ++c)
#pragma unroll
    for (int e = 0; e < kRmsChunk; ++e) acc[c][e] = 0.f;
  // A batch of rows as loaded (two named buffers, so that every index is static).
  struct Batch {
    Raw<uint16_t> x[kFusedBatch][P], dy[kFusedBatch][P];
    float rstd[kFusedBatch];
  };
  auto load = [&](int i, Batch& b) {
#pragma unroll
    for (int k = 0; k < kFusedBatch; ++k) {
      const int64_t t = min(t0 + i + k, t1 - 1);
      b.rstd[k] = __ldg(p.rstd + t);
#pragma unroll
      for (int c = 0; c < P; ++c)
        if (c < p.per_lane) {
          const int64_t at = t * p.cols + int64_t(q + L * c) * kRmsChunk;
          b.x[k][c] = load_raw(x, at);
          b.dy[k][c] = load_raw(dy, at);
        }
    }
  };
  // xh, gy and dy of chunk c of row k (the rows kernel's chunk_terms on the loaded words).
  auto terms = [&](const Batch& b, int k, int c, float (&xh)[kRmsChunk], float (&gy)[kRmsChunk],
                   float (&dv)[kRmsChunk]) {
    widen(b.x[k][c], xh);
    widen(b.dy[k][c], dv);
#pragma unroll
    for (int e = 0; e < kRmsChunk; ++e) {
      xh[e] = rms_mul(xh[e], b.rstd[k]);
      if constexpr (std::is_void_v<W>)
        gy[e] = dv[e];
      else
        gy[e] = rms_mul(dv[e], w[c][e]);
    }
  };
  auto compute = [&](int i, const Batch& b) {
    float dot[kFusedBatch];
#pragma unroll
    for (int k = 0; k < kFusedBatch; ++k) {
      dot[k] = 0.f;
#pragma unroll
      for (int c = 0; c < P; ++c) {
        if (c >= p.per_lane) continue;
        float xh[kRmsChunk], gy[kRmsChunk], dv[kRmsChunk];
        terms(b, k, c, xh, gy, dv);
#pragma unroll
        for (int e = 0; e < kRmsChunk; ++e) dot[k] = rms_fma(gy[e], xh[e], dot[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kFusedBatch; ++k) dot[k] = rms_lane_sum<kLanes>(dot[k], L);
#pragma unroll
    for (int k = 0; k < kFusedBatch; ++k) {
      const int64_t t = t0 + i + k;
      if (!live || t >= t1) continue;
      const float m = rms_bwd_mean(dot[k], p.cols);
      uint16_t* dxr = static_cast<uint16_t*>(p.dx) + t * p.cols;
#pragma unroll
      for (int c = 0; c < P; ++c) {
        if (c >= p.per_lane) continue;
        float xh[kRmsChunk], gy[kRmsChunk], dv[kRmsChunk], out[kRmsChunk];
        terms(b, k, c, xh, gy, dv);
#pragma unroll
        for (int e = 0; e < kRmsChunk; ++e) {
          out[e] = rms_bwd_dx(gy[e], xh[e], m, b.rstd[k]);
          acc[c][e] = rms_fma(dv[e], xh[e], acc[c][e]);
        }
        store8(dxr, int64_t(q + L * c) * kRmsChunk, out);
      }
    }
  };
  Batch cur, nxt;
  load(0, cur);
  for (int i = 0; i < n; i += 2 * kFusedBatch) {
    if (i + kFusedBatch < n) load(i + kFusedBatch, nxt);
    compute(i, cur);
    if (i + kFusedBatch >= n) break;
    if (i + 2 * kFusedBatch < n) load(i + 2 * kFusedBatch, cur);
    compute(i + kFusedBatch, nxt);
  }
  if (!live) return;
#pragma unroll
  for (int c = 0; c < P; ++c) {
    if (c >= p.per_lane) continue;
    float* dst = partial + group * p.cols + int64_t(q + L * c) * kRmsChunk;
    reinterpret_cast<float4*>(dst)[0] = make_float4(acc[c][0], acc[c][1], acc[c][2], acc[c][3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(acc[c][4], acc[c][5], acc[c][6], acc[c][7]);
  }
}

constexpr int kColThreads = 128;  // a CTA of the dweight kernels: 256 columns (two a thread)

// partial[g][c] = sum over group g's rows in order of fma(dy, xh); blockIdx.x = g, blockIdx.y the
// column block.
template <typename T>
__global__ void __launch_bounds__(kColThreads)
    rmsnorm_backward_group_kernel(const BwdParams p, int64_t group_rows, float* partial) {
  const int c = (int(blockIdx.y) * kColThreads + int(threadIdx.x)) * 2;
  if (c >= p.cols) return;
  const int64_t t0 = int64_t(blockIdx.x) * group_rows;
  const int64_t t1 = min(p.rows, t0 + group_rows);
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  float a0 = 0.f, a1 = 0.f;
#pragma unroll 8
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i = t * p.cols + c;
    const float rstd = __ldg(p.rstd + t);
    const float2 xv = load2(x, i), dv = load2(dy, i);
    a0 = rms_fma(dv.x, rms_mul(xv.x, rstd), a0);
    a1 = rms_fma(dv.y, rms_mul(xv.y, rstd), a1);
  }
  partial[int64_t(blockIdx.x) * p.cols + c] = a0;
  partial[int64_t(blockIdx.x) * p.cols + c + 1] = a1;
}

// The groups' sums added in blocks of kRmsBwdSumBlock (blockIdx.x the block, blockIdx.y the column
// block), each in group order from 0, into block_sum; then the blocks' in order, NaN canonical.
__global__ void __launch_bounds__(kColThreads)
    rmsnorm_backward_block_kernel(const float* partial, int64_t groups, int cols, float* block_sum) {
  const int c = int(blockIdx.y) * kColThreads + int(threadIdx.x);
  if (c >= cols) return;
  const int64_t g0 = int64_t(blockIdx.x) * kRmsBwdSumBlock, g1 = min(groups, g0 + kRmsBwdSumBlock);
  float s = 0.f;
#pragma unroll 8
  for (int64_t g = g0; g < g1; ++g) s = __fadd_rn(s, partial[g * cols + c]);
  block_sum[int64_t(blockIdx.x) * cols + c] = s;
}

__global__ void __launch_bounds__(kColThreads)
    rmsnorm_backward_sum_kernel(const float* block_sum, int64_t blocks, int cols, float* dweight) {
  const int c = int(blockIdx.x) * kColThreads + int(threadIdx.x);
  if (c >= cols) return;
  float s = 0.f;
#pragma unroll 8
  for (int64_t b = 0; b < blocks; ++b) s = __fadd_rn(s, block_sum[b * cols + c]);
  dweight[c] = rms_canonical(s);
}

template <typename T, typename W>
Status launch_rows(const BwdParams& p, cudaStream_t s) {
  const int64_t per_cta = int64_t(kWarps) * (32 / p.lanes);
  const int64_t grid = (p.rows + per_cta - 1) / per_cta;
  if (grid > int64_t(0x7FFFFFFF)) return Status::Invalid("x: too many rows for one launch");
  if (p.lanes == 32)
    rmsnorm_backward_rows_kernel<T, W, 32><<<unsigned(grid), kThreads, 0, s>>>(p);
  else
    rmsnorm_backward_rows_kernel<T, W, 0><<<unsigned(grid), kThreads, 0, s>>>(p);
  return check_launch("rmsnorm_backward_rows_kernel");
}

template <typename W>
void launch_fused(const BwdParams& p, int64_t group_rows, int64_t groups, float* partial, cudaStream_t s) {
  const int64_t per_cta = int64_t(kFusedWarps) * (32 / p.lanes);
  const unsigned grid = unsigned((groups + per_cta - 1) / per_cta);
  if (p.lanes == 32)
    rmsnorm_backward_fused_kernel<W, 32><<<grid, kFusedWarps * 32, 0, s>>>(p, group_rows, groups, partial);
  else
    rmsnorm_backward_fused_kernel<W, 0><<<grid, kFusedWarps * 32, 0, s>>>(p, group_rows, groups, partial);
}

// f(WeightType<W>{}) for the weight's element type W: void (no weight), uint16_t (bf16) or float.
template <typename W>
struct WeightType {
  using type = W;
};
template <typename F>
Status with_weight_type(const BwdParams& p, bool weight_bf16, F&& f) {
  if (p.weight == nullptr) return f(WeightType<void>{});
  return weight_bf16 ? f(WeightType<uint16_t>{}) : f(WeightType<float>{});
}

template <typename T>
Status launch_typed(const BwdParams& p, bool weight_bf16, float* dweight, cudaStream_t s) {
  // bf16 rows with dweight wanted and at most kFusedMaxPerLane chunks a lane (C <= 768 at 32 lanes,
  // C = 384 at 16): one fused pass writes dx and the group sums; else the rows kernel, then the group
  // kernel reads x and dy again.
  const bool fused = sizeof(T) == 2 && dweight != nullptr && p.rows > 0 && p.per_lane <= kFusedMaxPerLane;
  if (p.rows > 0 && !fused)
    MXFLASH_RETURN_IF_ERROR(with_weight_type(
        p, weight_bf16, [&](auto w) { return launch_rows<T, typename decltype(w)::type>(p, s); }));
  if (dweight == nullptr) return Status::Ok();
  if (p.rows == 0)
    return cuda_error(cudaMemsetAsync(dweight, 0, size_t(p.cols) * sizeof(float), s), "cudaMemsetAsync (dweight)");
  const int64_t group_rows = rms_bwd_group_rows(p.rows);
  const int64_t groups = (p.rows + group_rows - 1) / group_rows;
  const int64_t blocks = (groups + kRmsBwdSumBlock - 1) / kRmsBwdSumBlock;
  float* partial = nullptr;  // groups x C group sums, then blocks x C block sums
  MXFLASH_RETURN_IF_ERROR(workspace_alloc(size_t(groups + blocks) * size_t(p.cols) * sizeof(float), s,
                                          reinterpret_cast<void**>(&partial), "rmsnorm_backward workspace"));
  float* block_sum = partial + groups * p.cols;
  const unsigned col_blocks = unsigned((p.cols + kColThreads - 1) / kColThreads);
  const Status st = [&] {
    if (fused) {
      MXFLASH_RETURN_IF_ERROR(with_weight_type(p, weight_bf16, [&](auto w) {
        launch_fused<typename decltype(w)::type>(p, group_rows, groups, partial, s);
        return check_launch("rmsnorm_backward_fused_kernel");
      }));
    } else {
      const dim3 g1{unsigned(groups), unsigned((p.cols / 2 + kColThreads - 1) / kColThreads)};
      rmsnorm_backward_group_kernel<T><<<g1, kColThreads, 0, s>>>(p, group_rows, partial);
      MXFLASH_RETURN_IF_ERROR(check_launch("rmsnorm_backward_group_kernel"));
    }
    rmsnorm_backward_block_kernel<<<dim3(unsigned(blocks), col_blocks), kColThreads, 0, s>>>(partial, groups, p.cols,
                                                                                            block_sum);
    MXFLASH_RETURN_IF_ERROR(check_launch("rmsnorm_backward_block_kernel"));
    rmsnorm_backward_sum_kernel<<<col_blocks, kColThreads, 0, s>>>(block_sum, blocks, p.cols, dweight);
    return check_launch("rmsnorm_backward_sum_kernel");
  }();
  const Status freed = workspace_free(partial, s, "rmsnorm_backward workspace free");
  return st.ok() ? freed : st;
}

}  // namespace

Status rmsnorm_backward(const detail::RmsNormBackwardProblem& p, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.x, 16, "x"));
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.dy, 16, "dy"));
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.dx, 16, "dx"));
  if (p.weight != nullptr) MXFLASH_RETURN_IF_ERROR(check_aligned(p.weight, 16, "weight"));
  const int lanes = rms_lanes(p.cols);
  const BwdParams k{p.x, p.weight, p.rstd, p.dy, p.dx, p.rows, int(p.cols), lanes, int(p.cols / kRmsChunk / lanes)};
  const auto s = static_cast<cudaStream_t>(stream);
  return p.bf16 ? launch_typed<uint16_t>(k, p.weight_bf16, p.dweight, s)
                : launch_typed<float>(k, p.weight_bf16, p.dweight, s);
}

}  // namespace mxflash::cuda
