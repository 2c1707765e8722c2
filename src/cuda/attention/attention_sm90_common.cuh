// Register-level helpers shared by the sm_90a attention kernels (forward and backward): e4m3
// packing of wgmma A fragments, exp2 on the MUFU unit, quad reductions over the 4 threads that hold
// one accumulator row, compiler fences on accumulator arrays.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/sm90_primitives.cuh"

namespace mxflash::cuda::attn {

// The thread's warpgroup (of 128 threads), broadcast from lane 0 so the compiler knows it is
// warp-uniform: descriptors and barrier ids derived from it then live in uniform registers
// instead of being moved there (R2UR) before every wgmma.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xFFFFFFFFu, int(threadIdx.x) / 128, 0); }

// A struct of 32-bit words (a work item read from shared memory) as lane 0 holds it, made known to
// the compiler as warp-uniform, so that what derives from it may live in uniform registers.
template <typename T>
__device__ __forceinline__ T warp_uniform(const T& x) {
  static_assert(sizeof(T) % 4 == 0, "a struct of 32-bit words");
  T w;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&x);
  uint32_t* dst = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 4); ++i) dst[i] = __shfl_sync(0xFFFFFFFFu, src[i], 0);
  return w;
}

// The dynamic shared memory as a T, its start rounded up to 1024 bytes (the 128-byte swizzle's
// atom; the launches ask for 1024 bytes more than sizeof(T)).
template <typename T>
__device__ __forceinline__ T& aligned_shared(uint8_t* raw) {
  return *reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
}

// Thread 0 initializes a TMA pipeline's mbarriers: `once` (the per-item operand, `once_count`
// arrivals: by default the producer's expect_tx alone) and each stage's `full` (one arrival) and
// `empty` (every thread of `consumer_warpgroups`), fences them, then a CTA barrier. Barriers the
// caller's thread 0 initializes before the call are covered by the same fence.
template <int kStages>
__device__ __forceinline__ void init_pipeline(uint64_t* once, uint64_t (&full)[kStages], uint64_t (&empty)[kStages],
                                              int consumer_warpgroups, int once_count = 1) {
  if (threadIdx.x == 0) {
    sm90::mbar_init(once, once_count);
    for (int i = 0; i < kStages; ++i) {
      sm90::mbar_init(&full[i], 1);
      sm90::mbar_init(&empty[i], consumer_warpgroups * 128);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
}

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// Four floats to e4m3 (round to nearest even, saturating), a first in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// A fragment chunk c (32 keys of a wgmma k32 step) from the 16 accumulator values x[0..15] that
// one thread holds for those keys (accumulators 16c..16c+15). The B operand stores each 32-token
// group in the matching order (permuted_token, attention_fwd_prepare.cuh).
template <int M>
__device__ __forceinline__ void pack_chunk(const float* x, int c, uint32_t (&pa)[M]) {
  pa[4 * c + 0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
  pa[4 * c + 1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
  pa[4 * c + 2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
  pa[4 * c + 3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
}

// 2^x on the MUFU unit, subnormal results flushed: P below 2^-126 is far under e4m3's 2^-17 floor
// (256 p < 2^-9), so flushing changes no quantized P.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xFFFFFFFFu, x, 1);
  return x + __shfl_xor_sync(0xFFFFFFFFu, x, 2);
}

// Staged epilogues (the forward's persistent kernels, the backward's dK/dV kernel): a consumer
// warpgroup writes its 64 rows x 128 channels of bf16 into its own staging tile in shared memory,
// two boxes of 64 rows x 64 channels with the 128-byte swizzle (kStageBytes), and its issuer thread
// (warp 0, lane 0) writes the tile out with two TMA stores (a map from make_bf16_rows_map, boxes of
// 64 channels x 1 head x 64 rows), instead of 32 4-byte stores per thread and tensor.
inline constexpr int kStagedRows = 64;
inline constexpr int kStageBytes = 2 * kStagedRows * 128;

// Before the warpgroup rewrites its tile: the issuer's earlier stores have read it, then the
// warpgroup meets at its named barrier.
__device__ __forceinline__ void staging_acquire(bool issuer, int barrier) {
  if (issuer) sm90::bulk_wait_read<0>();
  sm90::named_barrier_sync(barrier, 128);
}

// The rows into the tile and out: packed[r][jn] is the bf16 pair of this thread's row
// warp * 16 + lane / 4 + 8 r, channels 8 jn + 2 (lane % 4) and + 1 (the m64n128 accumulator
// layout), written with 8 stmatrix.x4 (stmatrix j of four: row half j % 2, 8-channel group jn + j / 2;
// this lane's address: row lane % 8 of matrix lane / 8); then a proxy fence, the barrier, and the
// issuer's two stores to rows tok.. of head h, committed as one bulk group. The caller waits for
// them (bulk_wait<0>) before the CTA's shared memory goes. `box_stride`: bytes from the first box
// to the second (by default they are adjacent; each box 1024-byte aligned).
__device__ __forceinline__ void stage_and_store(const CUtensorMap* map, uint8_t* stage, bool issuer, int barrier,
                                                int warp, int lane, const uint32_t (&packed)[2][16], int h, int tok,
                                                uint32_t box_stride = kStagedRows * 128) {
  const uint32_t base = sm90::smem_u32(stage);
  const int mi = lane / 8, i = lane % 8, rr = warp * 16 + 8 * (mi % 2) + i;
#pragma unroll
  for (int jn = 0; jn < 16; jn += 2) {
    const int g = jn + mi / 2;  // this lane's matrix's 8-channel group
    const uint32_t at = base + (g / 8) * box_stride + rr * 128 + ((uint32_t(g % 8) ^ uint32_t(i)) << 4);
    sm90::stmatrix_x4(at, packed[0][jn], packed[1][jn], packed[0][jn + 1], packed[1][jn + 1]);
  }
  sm90::fence_proxy_async_smem();
  sm90::named_barrier_sync(barrier, 128);
  if (issuer) {
#pragma unroll
    for (int box = 0; box < 2; ++box) sm90::tma_store_3d(map, stage + box * box_stride, box * 64, h, tok);
    sm90::bulk_commit();
  }
}

// Two floats as a bf16 pair (round to nearest even), as a 32-bit word (low half: a).
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

template <int N>
__device__ __forceinline__ void fence_all(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) sm90::fence_regs(r[i]);
}

// The causal mask in the kernels' int arithmetic (causal_keys, mxflash/attention.h): the alignment's
// offset of the diagonal (bottom-right: Lk - Lq; top-left: 0), and the keys row i faces given it.
__host__ __device__ __forceinline__ int causal_off(bool bottom_right, int Lq, int Lk) { return bottom_right ? Lk - Lq : 0; }
__host__ __device__ __forceinline__ int causal_row_keys(int i, int off, int Lk) { return min(Lk, max(i + 1 + off, 0)); }

}  // namespace mxflash::cuda::attn
