// mxflash-overlap-probe: do Hopper's tensor cores and the MUFU / FMA pipes run at full rate at the
// same time? One CTA per SM of four warpgroups, each running one fixed stream of work for a fixed
// count, timed by its own SM clock reads:
//   warpgroup 0: FP8 wgmma chains (m64n128k32, operands in shared memory; `rs`: A in registers;
//                the `n64` / `n32` runs: m64n64k32 / m64n32k32, the shapes of narrower tiles),
//   warpgroup 1: MUFU.EX2 (16 independent chains per thread, one FMUL each),
//   warpgroup 2: FFMA (16 independent chains per thread),
//   warpgroup 3: a second MUFU stream,
//   or, with `cvt`, warpgroup 3 runs F2FP (cvt.rn.satfinite.e4m3x2.f32, 16 independent pairs per
//   thread; `cvt16`: cvt.rn.f16x2.f32) and with `alu` warpgroup 2 runs integer ALU work (LEA + PRMT chains) instead of FFMA:
//   which pipe the forward's P packing uses, and whether integer work collides with the GEMMs;
//   or, with `l2 read` / `dram read`, warpgroup 1's thread 0 streams 32 KB bulk copies (TMA,
//   cp.async.bulk, four in flight) into shared memory instead of MUFU work: from a 16 MB window
//   that stays in L2, or sweeping a 4 GB buffer (DRAM): what the attention kernels' operand loads
//   cost in energy per byte, beside the GEMMs or alone; `l2 mcast`: the same bytes delivered to
//   each CTA, in clusters of two whose CTAs each load half of every chunk with TMA multicast into
//   both (what two CTAs sharing their K/V or Q-side tiles would pay); `l2 reduce`: the same thread
//   adds 32 KB of shared memory into global memory by bulk reductions (cp.reduce.async.bulk .add,
//   f32 or with `f16` f16, four in flight) over a 16 MB window that stays in L2 (`hot`: every CTA
//   into the same 256 KB; `deep`: 16 in flight), what a fused backward's dQ reductions pay; `dsmem push`: in clusters of
//   two, each CTA's thread sends 32 KB chunks into its peer's shared memory (cp.async.bulk
//   shared::cluster, four slots, the receiver returning a credit per slot by a remote mbarrier
//   arrive), what a cluster's partial dQ sums through distributed shared memory would pay.
// With `--energy S`, each run is also repeated for S seconds while a thread reads the board's energy
// counter (NVML; tools/common/nvml.h): its mean power, SM clock and, for a run of one stream, the
// board's energy per unit of that stream's work (per FP8 FLOP, per MUFU.EX2 or FFMA lane
// operation, per F2FP pair, per ALU element, per byte loaded), and first the idle board's power.
// A run names the streams that work (the others return at once); each stream's rate is printed, so
// a stream's rate alone and beside another shows what running together costs it. The attention
// forward's per-tile trace (docs/attention.md) suggested that its exponentials slow down while the
// tensor cores run; this measures that without the attention kernel around it.
// `tensor f16acc` / `tensor n256 f16acc`: the tensor stream with an f16 accumulator (m64n128k32,
// m64n256k32), run with `--random 2` (signed operand bytes whose sums stay in f16's range) against
// the f32 one. `--sm-census` instead prints the SM each block of a one-CTA-per-SM cooperative grid
// lands on.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <string>
#include <vector>

#include "cuda/common/sm90_primitives.cuh"
#include "nvml.h"

namespace {

constexpr int kWarpgroups = 4, kThreads = 128 * kWarpgroups;
// k32 steps per commit group; every group accumulates into the same registers (a group that
// started from zero would let the compiler drop the groups before it as dead).
constexpr int kWgmmaPerGroup = 8;
enum Stream : int {
  kTensor = 1, kMufu = 2, kFma = 4, kMufu2 = 8, kRs = 16, kCvt = 32, kAlu = 64, kCvt16 = 128,
  kN64 = 256, kN32 = 512,  // the tensor stream's N (default 128)
  kLoad = 1024, kDram = 2048,  // warpgroup 1 streams bulk copies (from L2, or with kDram from DRAM)
  kMcast = 4096,  // the loads in clusters of two CTAs: each loads half of a chunk, multicast to both
  kReduce = 8192, kF16 = 16384, kHot = 32768,  // bulk reductions into L2 (f32, or f16; hot: one 256 KB)
  kDsmem = 65536,  // chunks pushed into the cluster peer's shared memory (clusters of two)
  kDeep = 131072,  // the reductions with 16 in flight instead of 4 (from the same four buffers)
  kF16Acc = 262144,  // the tensor stream with an f16 accumulator (m64n128k32: 32 registers)
  kN256 = 524288     // with kF16Acc: m64n256k32 (64 registers; an f32 one would need 128)
};
constexpr int kCluster = kMcast | kDsmem;  // the runs launched in clusters of two
constexpr int kLoadSlots = 4;
constexpr uint32_t kLoadChunk = 32768;
constexpr size_t kL2Window = size_t(16) << 20, kDramBytes = size_t(4) << 30;

struct alignas(1024) Smem {
  uint8_t a[64 * 128];   // 64 rows x 128 bytes, 128-byte swizzle (contents: e4m3 1.0)
  uint8_t b[256 * 128];  // 256 rows x 128 bytes (N = 256: all; else the first 128)
  alignas(128) uint8_t ld[kLoadSlots][kLoadChunk];  // the load stream's destinations
  alignas(128) uint8_t out[kLoadChunk];              // the push stream's source
  uint64_t bar[kLoadSlots];
  uint64_t credit[kLoadSlots];  // dsmem push: the peer has taken the chunk in this slot
};

// This CTA's shared-memory address `a` as the address of the same variable in cluster CTA `rank`.
__device__ __forceinline__ uint32_t peer_addr(uint32_t a, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}

// D(64x32, fp32) (+)= A(64x32 e4m3, shared) * B(32x32 e4m3, shared)^T (only the probe uses this shape).
__device__ __forceinline__ void wgmma_m64n32k32_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D(64xN, f16) (+)= A(64x32 e4m3, shared) * B(Nx32 e4m3, shared)^T, N = 128 or 256 (the accumulator
// as f16 pairs, N / 4 registers).
template <int kN>
__device__ __forceinline__ void wgmma_f16acc_ss(uint32_t (&d)[kN / 4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(kN == 128 || kN == 256, "m64n128k32 or m64n256k32");
  if constexpr (kN == 128) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f16.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f16.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
          "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
          "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
          "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
          "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
}

// n_tensor commit groups of kWgmmaPerGroup wgmma steps, each group waited for: step(k, scale_d)
// issues step k of a group (the A and B descriptors' k32 offset k % 4), scale_d 0 only for the very
// first (every group accumulates into the same registers: kWgmmaPerGroup's note).
template <typename Step>
__device__ __forceinline__ void tensor_groups(int n_tensor, Step&& step) {
  for (int it = 0; it < n_tensor; ++it) {
    mxflash::sm90::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kWgmmaPerGroup; ++k) step(k, (it | k) != 0);
    mxflash::sm90::wgmma_commit();
    mxflash::sm90::wgmma_wait<0>();
  }
}

// The f16-accumulator tensor stream (kF16Acc): as tensor_stream, N = 128 or 256.
template <int kN>
__device__ __forceinline__ float tensor_stream_f16(int n_tensor, uint64_t da, uint64_t db) {
  uint32_t d[kN / 4];
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) d[i] = 0u;
  tensor_groups(n_tensor,
                [&](int k, int scale_d) { wgmma_f16acc_ss<kN>(d, da + 2 * (k % 4), db + 2 * (k % 4), scale_d); });
  uint32_t acc = 0u;
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) acc ^= d[i];
  return float(acc & 0xffffu);
}

// The tensor stream: n_tensor commit groups of kWgmmaPerGroup m64nNk32 steps, N = kN (128, 64 or
// 32), operands in shared memory, or with kRsA (N = 128 only) A in registers.
template <int kN, bool kRsA>
__device__ __forceinline__ float tensor_stream(int n_tensor, uint64_t da, uint64_t db) {
  static_assert(!kRsA || kN == 128, "the register-A stream is m64n128k32");
  float d[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) d[i] = 0.f;
  const uint32_t a[4] = {0x38383838u, 0x38383838u, 0x38383838u, 0x38383838u};
  tensor_groups(n_tensor, [&](int k, int scale_d) {
    const uint64_t a_k = da + 2 * (k % 4), b_k = db + 2 * (k % 4);
    if constexpr (kRsA)
      mxflash::sm90::wgmma_m64n128k32_rs(d, a, b_k, scale_d);
    else if constexpr (kN == 128)
      mxflash::sm90::wgmma_m64n128k32_ss(d, a_k, b_k, scale_d);
    else if constexpr (kN == 64)
      mxflash::sm90::wgmma_m64n64k32_ss(d, a_k, b_k, scale_d);
    else
      wgmma_m64n32k32_ss(d, a_k, b_k, scale_d);
  });
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc += d[i];
  return acc;
}

__device__ __forceinline__ uint64_t clock64_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}

template <bool kRsA>
__global__ void __launch_bounds__(kThreads, 1)
    probe_kernel(int streams, int n_tensor, int n_mufu, int n_fma, int n_load, const uint8_t* src,
                 unsigned long long* cycles, float* sink, int random) {
  extern __shared__ uint8_t raw[];
  Smem& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  for (int i = threadIdx.x; i < int((sizeof(s.a) + sizeof(s.b)) / 4); i += blockDim.x)
    reinterpret_cast<uint32_t*>(&s)[i] =
        random == 2   ? (((uint32_t(i) * 2654435761u) ^ (uint32_t(i) >> 3) * 0x9E3779B9u) & 0x8F8F8F8Fu) | 0x30303030u
        : random == 1 ? (uint32_t(i) * 2654435761u) & 0x77777777u
                      : 0x38383838u;
  for (int i = threadIdx.x; i < int((sizeof(s.ld) + sizeof(s.out)) / 4); i += blockDim.x)
    reinterpret_cast<uint32_t*>(s.ld)[i] = 0x14001400u;  // f16 pairs of 2^-10 (tiny f32): sums stay finite
  if (threadIdx.x == 0) {
    for (int i = 0; i < kLoadSlots; ++i) mxflash::sm90::mbar_init(&s.bar[i], 1);
    for (int i = 0; i < kLoadSlots; ++i) mxflash::sm90::mbar_init(&s.credit[i], 1);
    mxflash::sm90::fence_barrier_init();
  }
  mxflash::sm90::fence_proxy_async_smem();
  __syncthreads();
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const bool on = wg == 0   ? (streams & kTensor)
                  : wg == 1 ? (streams & (kMufu | kLoad | kReduce | kDsmem))
                  : wg == 2 ? (streams & (kFma | kAlu))
                            : (streams & (kMufu2 | kCvt));
  const bool mcast = (streams & kCluster) != 0;  // (every clustered run: the syncs below)
  auto cluster_sync = [] {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
  };
  if (mcast) cluster_sync();  // the peer's barriers initialized before any multicast into it
  if (!on) {
    if (mcast) cluster_sync();  // (the working threads' final sync)
    return;
  }
  float acc = 0.f;
  const uint64_t t0 = clock64_now();
  if (wg == 0) {
    const uint64_t da = mxflash::sm90::make_desc_k128b(s.a), db = mxflash::sm90::make_desc_k128b(s.b);
    if constexpr (kRsA)
      acc = tensor_stream<128, true>(n_tensor, da, db);
    else if (streams & kF16Acc)
      acc = (streams & kN256) ? tensor_stream_f16<256>(n_tensor, da, db) : tensor_stream_f16<128>(n_tensor, da, db);
    else
      acc = (streams & kN64)   ? tensor_stream<64, false>(n_tensor, da, db)
            : (streams & kN32) ? tensor_stream<32, false>(n_tensor, da, db)
                               : tensor_stream<128, false>(n_tensor, da, db);
  } else if (wg == 1 && (streams & kLoad)) {
    if (t == 0) {  // one thread issues; chunk c of the window (L2) or of the whole buffer (DRAM)
      const size_t chunks = ((streams & kDram) ? kDramBytes : kL2Window) / kLoadChunk;
      for (int it = 0; it < n_load; ++it) {
        const int slot = it % kLoadSlots;
        if (it >= kLoadSlots) mxflash::sm90::mbar_wait(&s.bar[slot], uint32_t((it / kLoadSlots - 1) & 1));
        mxflash::sm90::mbar_arrive_expect_tx(&s.bar[slot], kLoadChunk);
        if (streams & kMcast) {  // this CTA's half of the pair's chunk, into both CTAs' slot
          uint32_t rank;
          asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
          const size_t c = (size_t(blockIdx.x / 2) * 4 + size_t(it)) % chunks;
          const uint32_t half = kLoadChunk / 2;
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, "
              "[%3], %4;" ::"r"(mxflash::sm90::smem_u32(s.ld[slot] + rank * half)),
              "l"(src + c * kLoadChunk + rank * half), "r"(half), "r"(mxflash::sm90::smem_u32(&s.bar[slot])),
              "h"(uint16_t(3))
              : "memory");
        } else {
          const size_t c = (streams & kDram) ? (size_t(it) * gridDim.x + blockIdx.x) % chunks
                                             : (size_t(blockIdx.x) * 4 + size_t(it)) % chunks;
          mxflash::sm90::bulk_load(s.ld[slot], src + c * kLoadChunk, kLoadChunk, &s.bar[slot]);
        }
      }
      for (int it = std::max(0, n_load - kLoadSlots); it < n_load; ++it)
        mxflash::sm90::mbar_wait(&s.bar[it % kLoadSlots], uint32_t((it / kLoadSlots) & 1));
      acc = float(s.ld[0][t]);
    }
  } else if (wg == 1 && (streams & kReduce)) {
    if (t == 0) {  // 32 KB of shared memory added into chunk c of the window, four reductions in flight
      const size_t chunks = kL2Window / kLoadChunk;
      uint8_t* dst = const_cast<uint8_t*>(src);
      for (int it = 0; it < n_load; ++it) {
        if (streams & kDeep) {
          if (it >= 16) mxflash::sm90::bulk_wait_read<15>();  // (only read: the sources never change)
        } else if (it >= kLoadSlots) {
          mxflash::sm90::bulk_wait_read<kLoadSlots - 1>();
        }
        const size_t c = (streams & kHot) ? size_t(it % 8) : (size_t(blockIdx.x) * 4 + size_t(it)) % chunks;
        const uint32_t from = mxflash::sm90::smem_u32(s.ld[it % kLoadSlots]);
        if (streams & kF16)
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [%0], [%1], %2;" ::"l"(
                           dst + c * kLoadChunk),
                       "r"(from), "r"(kLoadChunk)
                       : "memory");
        else
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                           dst + c * kLoadChunk),
                       "r"(from), "r"(kLoadChunk)
                       : "memory");
        mxflash::sm90::bulk_commit();
      }
      mxflash::sm90::bulk_wait<0>();
      acc = float(s.ld[0][t]);
    }
  } else if (wg == 1 && (streams & kDsmem)) {
    if (t == 0) {  // chunk it into the peer's slot it % 4; the peer's chunk it into ours
      uint32_t rank;
      asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
      const uint32_t peer = rank ^ 1u;
      for (int it = 0; it < n_load; ++it) {
        const int slot = it % kLoadSlots;
        const uint32_t k = uint32_t(it / kLoadSlots);
        if (it >= kLoadSlots) mxflash::sm90::mbar_wait(&s.credit[slot], (k - 1) & 1);  // the peer took chunk it - 4
        asm volatile(
            "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                peer_addr(mxflash::sm90::smem_u32(s.ld[slot]), peer)),
            "r"(mxflash::sm90::smem_u32(s.out)), "r"(kLoadChunk),
            "r"(peer_addr(mxflash::sm90::smem_u32(&s.bar[slot]), peer))
            : "memory");
        mxflash::sm90::mbar_arrive_expect_tx(&s.bar[slot], kLoadChunk);
        mxflash::sm90::mbar_wait(&s.bar[slot], k & 1);  // the peer's chunk it has landed here
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(
                         peer_addr(mxflash::sm90::smem_u32(&s.credit[slot]), peer))
                     : "memory");
      }
      acc = float(s.ld[0][t]);
    }
  } else if (wg == 2 && (streams & kAlu)) {
    uint32_t x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = uint32_t(t * 16 + i) * 2654435761u;
    for (int it = 0; it < n_fma; ++it) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        uint32_t y;
        asm volatile("{ .reg .u32 t; shl.b32 t, %1, 4; add.u32 %0, t, 0x800000; }" : "=r"(y) : "r"(x[i]));
        x[i] = __byte_perm(y, x[i], 0x7531);
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) acc += float(x[i] & 1u);
  } else if (wg == 3 && (streams & kCvt)) {
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = 0.01f * float((t + i) % 64);
    uint32_t h[4] = {0, 0, 0, 0};
    for (int it = 0; it < n_mufu; ++it) {
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        uint16_t r;
        if (streams & kCvt16) {
          uint32_t r32;
          asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r32) : "f"(x[i]), "f"(x[i + 1]));
          r = uint16_t(r32 ^ (r32 >> 16));
        } else {
          asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x[i]), "f"(x[i + 1]));
        }
        h[(i / 2) % 4] ^= r;
      }
    }
    acc += float((h[0] ^ h[1] ^ h[2] ^ h[3]) & 1u);
  } else if (wg == 2) {
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = 0.001f * float(t + i);
    for (int it = 0; it < n_fma; ++it) {
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = fmaf(x[i], 0.999f, 0.001f);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) acc += x[i];
  } else {
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = 0.01f * float((t + i) % 64);
    for (int it = 0; it < n_mufu; ++it) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float y;
        asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[i]));
        x[i] = y * 0.5f;  // [0.5, 1) stays in [0.5, 1)
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) acc += x[i];
  }
  const uint64_t t1 = clock64_now();
  if (mcast) cluster_sync();  // no CTA leaves while its peer's multicasts may still write into it
  if (t == 0) cycles[blockIdx.x * kWarpgroups + wg] = t1 - t0;
  if (acc == 12345.f) sink[0] = acc;  // keeps the streams alive
}

__global__ void fill_kernel(uint32_t* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = (uint32_t(i) * 2654435761u ^ uint32_t(i >> 7) * 40503u) & 0x77777777u;
}

// A launch of the probe: one CTA per SM; clusters of two for the multicast runs.
cudaError_t launch(bool rs, int sms, size_t smem, int streams, int n_tensor, int n_mufu, int n_fma, int n_load,
                   const uint8_t* src, unsigned long long* cycles, float* sink, int random) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned((streams & kCluster) ? sms & ~1 : sms));
  cfg.blockDim = dim3(unsigned(kThreads));
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (streams & kCluster) ? 2 : 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return rs ? cudaLaunchKernelEx(&cfg, probe_kernel<true>, streams, n_tensor, n_mufu, n_fma, n_load, src, cycles, sink,
                                 random)
            : cudaLaunchKernelEx(&cfg, probe_kernel<false>, streams, n_tensor, n_mufu, n_fma, n_load, src, cycles,
                                 sink, random);
}

// --sm-census: the SM each block of a grid of one CTA per SM lands on (shared memory forces one), the
// placement the ring backward's roles inherit from their block ranges (docs/backward.md).
__global__ void census_kernel(unsigned* sm_of_block) {
  extern __shared__ uint8_t keep[];
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    keep[0] = uint8_t(sm);
    sm_of_block[blockIdx.x] = sm;
  }
  __nanosleep(100000);  // every block resident at once
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "overlap_probe: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int n_tensor = 2000, n_mufu = 8000, n_fma = 60000, n_load = 800;
  std::string only;  // --only a,b: only the runs of these names
  // --random 1: operand bytes from a hash (finite positive e4m3) instead of all 1.0; 2: signed bytes of
  // magnitude 0.5 to 1.875 (sums stay in an f16 accumulator's range: the kF16Acc runs against f32)
  int random = 0;
  double energy_s = 0;  // --energy S: each run's power and energy per unit of work over S seconds
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--random")) random = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--energy")) energy_s = std::atof(argv[i + 1]);
    if (!std::strcmp(argv[i], "--tensor")) n_tensor = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--mufu")) n_mufu = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--fma")) n_fma = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--load")) n_load = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
  }
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "SM count");
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sm-census") != 0) continue;
    unsigned* d = nullptr;
    check(cudaMalloc(&d, sizeof(unsigned) * size_t(sms)), "malloc");
    const int smem = 200 * 1024;
    check(cudaFuncSetAttribute(census_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem");
    void* args[] = {&d};
    check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(census_kernel), dim3(unsigned(sms)), dim3(384), args,
                                      size_t(smem), nullptr),
          "census launch");
    check(cudaDeviceSynchronize(), "census");
    std::vector<unsigned> h(static_cast<size_t>(sms));
    check(cudaMemcpy(h.data(), d, h.size() * sizeof(unsigned), cudaMemcpyDeviceToHost), "copy");
    std::printf("block -> SM (%d blocks, cooperative, one per SM):", sms);
    for (unsigned v : h) std::printf(" %u", v);
    std::printf("\n");
    return 0;
  }
  if (energy_s > 0) {
    char bus[64] = {0};
    check(cudaDeviceGetPCIBusId(bus, sizeof bus, 0), "PCI bus id");
    if (!mxflash::tools::nvml_bind(bus)) {
      std::fprintf(stderr, "overlap_probe: --energy needs NVML (libnvidia-ml.so.1)\n");
      return 1;
    }
    mxflash::tools::EnergyWindow idle;
    idle.start();
    std::this_thread::sleep_for(std::chrono::duration<double>(energy_s));
    const auto r = idle.stop();
    std::printf("idle board: %.0f W, SM clock %d MHz (%lld counter steps over %.1f s)\n", r.watts(),
                mxflash::tools::nvml_clock_mhz(mxflash::tools::kNvmlClockSm, false), (long long)r.steps, energy_s);
  }
  const size_t smem = sizeof(Smem) + 1024;
  check(cudaFuncSetAttribute(probe_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "smem");
  check(cudaFuncSetAttribute(probe_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "smem");
  unsigned long long* d_cycles = nullptr;
  float* d_sink = nullptr;
  check(cudaMalloc(&d_cycles, sizeof(unsigned long long) * sms * kWarpgroups), "malloc");
  check(cudaMalloc(&d_sink, sizeof(float)), "malloc");
  uint8_t* d_src = nullptr;  // the load stream's source: random bytes (as operands), never zeros
  check(cudaMalloc(&d_src, kDramBytes), "malloc");
  fill_kernel<<<sms * 8, 256>>>(reinterpret_cast<uint32_t*>(d_src), kDramBytes / 4);
  check(cudaGetLastError(), "fill launch");
  check(cudaDeviceSynchronize(), "fill");
  struct Run { const char* name; int streams; };
  const Run runs[] = {
      {"tensor (SS)", kTensor}, {"tensor (RS)", kTensor | kRs}, {"mufu", kMufu}, {"fma", kFma},
      {"mufu + mufu", kMufu | kMufu2}, {"tensor (SS) + mufu", kTensor | kMufu},
      {"tensor (RS) + mufu", kTensor | kRs | kMufu}, {"tensor (SS) + fma", kTensor | kFma},
      {"tensor (RS) + fma", kTensor | kRs | kFma}, {"tensor (SS) + mufu + mufu", kTensor | kMufu | kMufu2},
      {"tensor (SS) + mufu + fma", kTensor | kMufu | kFma},
      // F2FP (wg 3: cvt pairs per thread) and integer ALU work (wg 2: LEA + PRMT per element).
      {"cvt", kCvt}, {"alu", kAlu}, {"mufu + cvt", kMufu | kCvt}, {"tensor (SS) + cvt", kTensor | kCvt},
      {"tensor (SS) + mufu + cvt", kTensor | kMufu | kCvt}, {"tensor (SS) + alu", kTensor | kAlu},
      {"tensor (SS) + mufu + alu", kTensor | kMufu | kAlu}, {"cvt16", kCvt | kCvt16},
      {"mufu + cvt16", kMufu | kCvt | kCvt16}, {"tensor (SS) + mufu + cvt16", kTensor | kMufu | kCvt | kCvt16},
      // Narrower GEMM shapes (m64n64k32, m64n32k32, operands in shared memory), alone and beside FFMA.
      {"tensor n64 (SS)", kTensor | kN64}, {"tensor n32 (SS)", kTensor | kN32},
      {"tensor n64 (SS) + fma", kTensor | kN64 | kFma}, {"tensor n32 (SS) + fma", kTensor | kN32 | kFma},
      // Bulk copies into shared memory (wg 1's thread 0): from L2, from DRAM, beside the GEMMs.
      {"l2 read", kLoad}, {"dram read", kLoad | kDram}, {"tensor (SS) + l2 read", kTensor | kLoad},
      {"l2 mcast", kLoad | kMcast}, {"tensor (SS) + l2 mcast", kTensor | kLoad | kMcast},
      // Bulk reductions into L2 (f32, f16, every CTA into one 256 KB) and pushes to a cluster peer.
      {"l2 reduce", kReduce}, {"l2 reduce f16", kReduce | kF16}, {"l2 reduce hot", kReduce | kHot},
      {"l2 reduce deep", kReduce | kDeep},
      {"tensor (SS) + l2 reduce", kTensor | kReduce}, {"tensor (SS) + l2 reduce f16", kTensor | kReduce | kF16},
      {"dsmem push", kDsmem}, {"tensor (SS) + dsmem push", kTensor | kDsmem},
      // The accumulator's width: f16 instead of f32 (half the registers), and m64n256k32 with f16.
      {"tensor f16acc (SS)", kTensor | kF16Acc}, {"tensor n256 f16acc (SS)", kTensor | kF16Acc | kN256},
      {"tensor f16acc (SS) + mufu", kTensor | kF16Acc | kMufu},
  };
  auto selected = [&](const char* name) {
    if (only.empty()) return true;
    size_t b = 0;
    while (b <= only.size()) {
      const size_t e = std::min(only.find(',', b), only.size());
      if (e > b && only.substr(b, e - b) == name) return true;
      b = e + 1;
    }
    return false;
  };
  std::printf("%-28s %14s %14s %14s %14s   (per SM and cycle, medians over %d SMs)\n", "streams", "tensor FLOP",
              "mufu|load (wg1)", "ffma|alu (wg2)", "mufu|cvt (wg3)", sms);
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  for (const Run& r : runs) {
    if (!selected(r.name)) continue;
    float ms = 0.f;
    for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
      check(cudaEventRecord(e0), "event");
      check(launch((r.streams & kRs) != 0, sms, smem, r.streams, n_tensor, n_mufu, n_fma, n_load, d_src, d_cycles,
                   d_sink, random),
            "launch");
      check(cudaEventRecord(e1), "event");
      check(cudaDeviceSynchronize(), "run");
      check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    }
    std::vector<unsigned long long> c(size_t(sms) * kWarpgroups);
    check(cudaMemcpy(c.data(), d_cycles, c.size() * sizeof(c[0]), cudaMemcpyDeviceToHost), "copy");
    auto median = [&](int wg) {
      std::vector<unsigned long long> v;
      for (int b = 0; b < sms; ++b) v.push_back(c[size_t(b) * kWarpgroups + size_t(wg)]);
      std::sort(v.begin(), v.end());
      return double(v[v.size() / 2]);
    };
    const int n = (r.streams & kN64) ? 64 : (r.streams & kN32) ? 32 : (r.streams & kN256) ? 256 : 128;  // the tensor stream's N
    const double work[kWarpgroups] = {double(n_tensor) * kWgmmaPerGroup * 64 * n * 32 * 2,
                                      (r.streams & (kLoad | kReduce | kDsmem)) ? double(n_load) * kLoadChunk
                                                                               : double(n_mufu) * 16 * 128,
                                      double(n_fma) * 16 * 128,
                                      double(n_mufu) * ((r.streams & kCvt) ? 8 : 16) * 128};
    const int bit[kWarpgroups] = {kTensor, kMufu | kLoad | kReduce | kDsmem, kFma | kAlu, kMufu2 | kCvt};
    std::printf("%-28s", r.name);
    for (int wg = 0; wg < kWarpgroups; ++wg) {
      if (r.streams & bit[wg]) std::printf(" %14.1f", work[wg] / median(wg));
      else std::printf(" %14s", "-");
    }
    // Wall-clock cross-check: the tensor stream's TFLOP/s over the whole launch, and the SM clock
    // that the cycle counts imply.
    const double max_cycles = [&] {
      double m = 0;
      for (int wg = 0; wg < kWarpgroups; ++wg)
        if (r.streams & bit[wg]) m = std::max(m, median(wg));
      return m;
    }();
    std::printf("   %.3f ms, %.2f GHz", ms, max_cycles / (ms * 1e6));
    if (r.streams & kTensor) std::printf(", tensor %.0f TFLOP/s", work[0] * sms / (ms * 1e9));
    std::printf("\n");
    if (energy_s > 0) {
      // The run again for energy_s seconds, launches enqueued in batches of ~50 ms so that the
      // stream stays busy between the host's synchronizations.
      const int batch = std::max(1, int(50.0 / std::max(ms, 0.01f)));
      mxflash::tools::EnergyWindow window;
      window.start();
      const auto t0 = std::chrono::steady_clock::now();
      int64_t launches = 0;
      double clock_sum = 0;
      int clock_n = 0;
      double elapsed = 0;
      do {
        for (int i = 0; i < batch; ++i)
          check(launch((r.streams & kRs) != 0, sms, smem, r.streams, n_tensor, n_mufu, n_fma, n_load, d_src, d_cycles,
                       d_sink, random),
                "launch");
        check(cudaDeviceSynchronize(), "run");
        launches += batch;
        const int mhz = mxflash::tools::nvml_clock_mhz(mxflash::tools::kNvmlClockSm, false);
        if (mhz > 0) clock_sum += mhz, ++clock_n;
        elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } while (elapsed < energy_s);
      const auto e = window.stop();
      int active = 0, which = -1;
      for (int wg = 0; wg < kWarpgroups; ++wg)
        if (r.streams & bit[wg]) ++active, which = wg;
      // Energy per launch: mean power x the launches' mean time; per unit: over the launch's work
      // on all SMs (one stream only).
      const double joules = e.watts() * elapsed / double(launches);
      static const char* const kUnit[kWarpgroups] = {"FP8 FLOP", "MUFU.EX2", "FFMA", "MUFU.EX2"};
      const char* unit = which == 1 && (r.streams & (kLoad | kReduce | kDsmem)) ? "byte"
                         : which == 2 && (r.streams & kAlu) ? "ALU element"
                         : which == 3 && (r.streams & kCvt) ? "F2FP pair"
                         : which >= 0                      ? kUnit[which]
                                                           : "?";
      std::printf("    energy: %.0f W, SM clock %.0f MHz, %.3f mJ a launch", e.watts(),
                  clock_n ? clock_sum / clock_n : -1.0, joules * 1e3);
      if (active == 1 && e.valid()) std::printf(", %.3f pJ per %s", joules / (work[which] * sms) * 1e12, unit);
      std::printf("  (%lld launches, %lld counter steps)\n", (long long)launches, (long long)e.steps);
    }
  }
  return 0;
}
