// gemm_quantize on CUDA (include/mxflash/fused.h): y = A W^T quantized to MX along n.
//
// Two paths (src/common/gemm_rules.h defines both arithmetics):
//  exact:  the MX definition, one warp per (row, 32-column output block), fp64 partial sums per
//          32-block in the CPU reference's order: the CPU's bytes. Any shape; the oracle.
//  coarse: the fast path. W is re-expressed against one scale per output channel by a small kernel
//          into a workspace (N x K bytes, once per call); A is re-expressed against one scale per
//          row inside the GEMM, in shared memory. Persistent CTAs of four warpgroups walk 128 x 128
//          output tiles: a producer thread issues the TMA loads kStages ahead (A tiles, the tile
//          rows' block scales by one bulk copy, W tiles or the CTA's resident W panel); the
//          re-expression warpgroup shifts each A tile in place, one row a thread (each block's bytes
//          down by its scale's distance below the row's largest: one subtraction per 4 bytes in the
//          common case, f16x2 conversions otherwise) and hands the stage to the consumers through
//          named barriers; two consumer warpgroups multiply 64 rows each by the 128 channels with
//          FP8 wgmma from shared memory (m64n128k32), promoting into fp32 registers every 512 of K
//          (two-level accumulation), then scale by 2^(row) * 2^(channel), quantize along n in
//          registers (the block's amax over the four lanes of a quad, two shuffles) and store 8 bytes
//          a lane after a quad transpose. Three pipelines (run_coarse picks one): A rows (K <= 1024;
//          gemm_arows_kernel: a CTA owns row tiles and re-expresses each A panel once for all
//          channel tiles), the resident W panel (K <= 768) and streaming (gemm_coarse_kernel; A
//          re-expressed up front by gemm_prep_rows_kernel where that copy is at most 256 MB).
//          Speed: docs/fused.md.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/gemm_rules.h"
#include "cuda/attention/tma_map.h"
#include "cuda/common/e4m3_shift.cuh"
#include "cuda/common/launch_utils.cuh"
#include "cuda/common/sm90_primitives.cuh"
#include "cuda/common/workspace.h"
#include "cuda/fused/fused_cuda.h"
#include "cuda/quantize/mx_device.cuh"

namespace mxflash::cuda {
namespace {

// ------------------------------------------------------------------ exact path
constexpr int kExactWarps = 8;

__global__ void __launch_bounds__(kExactWarps * 32)
    gemm_exact_kernel(const uint8_t* __restrict__ a, const uint8_t* __restrict__ sa, const uint8_t* __restrict__ w,
                      const uint8_t* __restrict__ sw, int64_t M, int64_t N, int64_t K, ScalingMode mode,
                      uint8_t* __restrict__ payload, uint8_t* __restrict__ scales) {
  const int lane = threadIdx.x % 32;
  const int64_t nblk_out = N / kBlockSize, blocks = K / kBlockSize;
  const int64_t item = int64_t(blockIdx.x) * kExactWarps + threadIdx.x / 32;
  if (item >= M * nblk_out) return;
  const int64_t m = item / nblk_out, n = (item % nblk_out) * kBlockSize + lane;
  const uint8_t* arow = a + m * K;
  const uint8_t* wrow = w + n * K;
  double s = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    double dot = 0.0;  // exact (gemm_rules.h)
    for (int i = 0; i < kBlockSize; ++i)
      dot = __dadd_rn(dot, __dmul_rn(double(e4m3_to_float(arow[b * kBlockSize + i])),
                                     double(e4m3_to_float(wrow[b * kBlockSize + i]))));
    const uint8_t ea = sa[m * blocks + b], ew = sw[n * blocks + b];
    const double scale = (ea == kE8m0Nan || ew == kE8m0Nan)
                             ? __longlong_as_double(0x7FF8000000000000ll)
                             : __dmul_rn(ldexp(1.0, int(ea) - 127), ldexp(1.0, int(ew) - 127));
    s = __dadd_rn(s, __dmul_rn(dot, scale));
  }
  const float y = __double2float_rn(s);
  float amax = fabsf(y);
  // amax_nan over the warp: NaN wins.
  uint32_t bits = __float_as_uint(amax);
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, d));
  const uint8_t sb = e8m0_scale_byte(__uint_as_float(bits), mode);
  payload[m * N + n] = quantize_produced_element(y, e8m0_inv_scale(sb));
  if (lane == 0) scales[m * nblk_out + n / kBlockSize] = sb;
}

// ------------------------------------------------------------------ row re-expression
// One warp per row of an MX operand (W's output channels; A's rows for the streaming pipeline): its
// coarse exponent, its K bytes shifted, and the row's scale as an fp32 (2^(e - 127), NaN for 0xFF)
// for the GEMM's epilogue.
constexpr int kPrepWarps = 8;

__global__ void __launch_bounds__(kPrepWarps * 32)
    gemm_prep_rows_kernel(const uint8_t* __restrict__ w, const uint8_t* __restrict__ sw, int64_t N, int64_t K,
                       uint8_t* __restrict__ wq, float* __restrict__ wscale) {
  const int lane = threadIdx.x % 32;
  const int64_t n = int64_t(blockIdx.x) * kPrepWarps + threadIdx.x / 32;
  if (n >= N) return;
  const int64_t blocks = K / kBlockSize;
  const uint8_t* srow = sw + n * blocks;
  uint32_t e = 0;
  for (int64_t b = lane; b < blocks; b += 32) e = max(e, uint32_t(srow[b]));
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) e = max(e, __shfl_xor_sync(0xFFFFFFFFu, e, d));
  if (lane == 0) wscale[n] = e8m0_to_float(uint8_t(e));
  // 16-byte chunks: half a block each.
  const uint4* src = reinterpret_cast<const uint4*>(w + n * K);
  uint4* dst = reinterpret_cast<uint4*>(wq + n * K);
  for (int64_t c = lane; c < K / 16; c += 32) {
    const uint32_t d = block_shift(e, srow[c / 2]);
    uint4 v = src[c];
    v.x = e4m3x4_shift_down(v.x, d);
    v.y = e4m3x4_shift_down(v.y, d);
    v.z = e4m3x4_shift_down(v.z, d);
    v.w = e4m3x4_shift_down(v.w, d);
    dst[c] = v;
  }
}

// ------------------------------------------------------------------ coarse (wgmma) path
constexpr int kTileM = 128, kTileN = 128, kTileK = 128;
// Warpgroups: 0 producer (one thread issues the TMA loads), 1 the re-expression of A (each stage's
// A tile shifted in shared memory, one tile row a thread), 2 and 3 consumers (64 tile rows each,
// FP8 wgmma with both operands in shared memory).
constexpr int kThreads = 512;
// Registers a thread: a consumer holds two 64-float accumulators. The CTA starts with 128 a thread
// (__launch_bounds__(512, 1)); setmaxnreg.inc draws only on what the other warpgroups' dec returned
// to the CTA's pool (more would block forever).
constexpr int kLaunchRegs = 128, kProducerRegs = 24, kShiftRegs = 88, kConsumerRegs = 200;
static_assert((kLaunchRegs - kProducerRegs) * 128 + (kLaunchRegs - kShiftRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * 256,
              "register pool");
constexpr int kTileBytes = kTileM * kTileK;  // an A or W tile: 16 KB
// k tiles per accumulation chain: FP8 wgmma keeps ~14 significant bits while it adds (DeepSeek-V3,
// and tests/gpu/test_gemm_gpu.cpp), far more than the e4m3 output keeps (3), so a chain runs 512
// deep before its promotion.
constexpr int kChainTiles = 4;
// The A tile's block scales, all K / 32 of each of its 128 rows, loaded with each stage (one bulk
// copy: the rows' scales are contiguous) when the slab holds them and the tile is whole; otherwise
// the re-expression reads them from global memory.
//
// The streaming and W-panel pipelines (gemm_coarse_kernel, template kResident; the A-rows pipeline's
// layout is ARowsPipe below):
//  streaming: each stage holds an A tile and a W tile (32 KB) and an 8 KB slab (K <= 2048), 4 stages;
//    CTAs walk tiles channels-fastest, so that CTAs running together share A tiles in L2.
//  resident (K <= 768): the CTA's 128-channel W panel (K x 128 bytes, at most 96 KB) is loaded once
//    and stays; stages hold only A tiles (16 KB) and 3 KB slabs, 6 stages. Each CTA keeps one
//    channel panel and walks row tiles. Half the bytes a stage brings from L2 per FLOP (H200: +3% at
//    K = 384 over streaming, docs/fused.md).
constexpr int kResidentMaxK = 768;
template <bool kResident>
struct Pipe {
  static constexpr int kStages = kResident ? 6 : 4;
  static constexpr int kStageBytes = kResident ? kTileBytes : 2 * kTileBytes;
  static constexpr int kSlabMaxK = kResident ? kResidentMaxK : 2048;
  static constexpr int kSlabBytes = kTileM * kSlabMaxK / kBlockSize;
  static constexpr int kPanelBytes = kResident ? kTileBytes * (kResidentMaxK / kTileK) : 0;
  // Per stage: the tile, its slab, and its rows' coarse exponents (written by the re-expression at a
  // tile's first k tile, read by the consumers' epilogue).
  static constexpr int kSmemBytes =
      kPanelBytes + kStages * (kStageBytes + kSlabBytes + kTileM) + (2 * kStages + 1) * 8 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static_assert(1 + 2 * kStages <= 16, "named barriers");
};

// The largest of a row's `blocks` scale bytes (gemm_rules.h coarse_exponent), 4 at a time where
// `aligned` says the row starts 4-byte aligned and blocks is a multiple of 4.
__device__ __forceinline__ uint32_t row_max_scale(const uint8_t* srow, int blocks, bool aligned) {
  uint32_t e = 0;
  if (aligned) {
    uint32_t m = 0;
    for (int b = 0; b < blocks; b += 4) m = __vmaxu4(m, *reinterpret_cast<const uint32_t*>(srow + b));
    e = max(max(m & 0xFFu, (m >> 8) & 0xFFu), max((m >> 16) & 0xFFu, m >> 24));
  } else {
    for (int b = 0; b < blocks; ++b) e = max(e, uint32_t(srow[b]));
  }
  return e;
}

// Re-expression of one A tile row's 128 bytes in shared memory (thread t of the re-expression
// warpgroup, tile row t), k block j shifted down by d[j]. Skipped when no row of the warp shifts;
// otherwise all 8 chunks loaded, then each shifted (one subtraction per word in shift_word_test's
// common case; a chunk with a word outside it in f16x2 arithmetic, e4m3_shift.cuh, this lane only:
// NaN bytes may come out 0x7F for 0xFF, the products are NaN either way) and stored where its shift
// is not 0. k chunk c of row t sits at chunk c ^ (t % 8) under the 128-byte swizzle (a warp's
// accesses to one k chunk hit eight bank groups); k chunks 2j and 2j + 1 are block j.
__device__ __forceinline__ void shift_row_ktile(uint8_t* row, const uint32_t (&d)[4], int t) {
  if (!__any_sync(0xFFFFFFFFu, (d[0] | d[1] | d[2] | d[3]) != 0)) return;
  uint4* rowp = reinterpret_cast<uint4*>(row);
  uint4 v[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) v[c] = rowp[c ^ (t & 7)];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const uint32_t dj = d[c / 2];
    const ShiftWordTest st = shift_word_test(dj);
    const uint32_t mx = v[c].x & 0x7F7F7F7Fu, my = v[c].y & 0x7F7F7F7Fu, mz = v[c].z & 0x7F7F7F7Fu,
                   mw = v[c].w & 0x7F7F7F7Fu;
    const uint32_t ge = (mx + st.ge_add) & (my + st.ge_add) & (mz + st.ge_add) & (mw + st.ge_add);
    const uint32_t nan = (mx + st.nan_add) | (my + st.nan_add) | (mz + st.nan_add) | (mw + st.nan_add);
    uint4 r;
    if ((ge & 0x80808080u) != 0x80808080u || (nan & 0x80808080u) != 0) {
      const uint32_t m2 = f16x2_pow2_neg(int(dj));
      r = make_uint4(e4m3x4_times_f16x2(v[c].x, m2), e4m3x4_times_f16x2(v[c].y, m2), e4m3x4_times_f16x2(v[c].z, m2),
                     e4m3x4_times_f16x2(v[c].w, m2));
    } else {
      const uint32_t sub = (dj << 3) * 0x01010101u;
      r = make_uint4(v[c].x - sub, v[c].y - sub, v[c].z - sub, v[c].w - sub);
    }
    if (dj != 0) rowp[c ^ (t & 7)] = r;
  }
}

constexpr int kReadyBarrier0 = 1;  // named barriers 1 + 2 s + w: slot s re-expressed, for consumer w

// Arrivals that free a stage or panel for the producer's next load into it: the 8 consumer warps
// (lane 0 of each, after their wgmmas on it) and every thread of the re-expression (after its
// hand-over). Each re-expression thread releases its own reads of the slab (not one lane per warp,
// nor through the consumers' release), which is the ordering compute-sanitizer's racecheck follows.
constexpr uint32_t kStageReaders = 8 + 128;

// The re-expression warpgroup's hand-over of slot s (a stage or a panel) to both consumer
// warpgroups: its shifted bytes made visible to their wgmma, then a named barrier per consumer (this
// warpgroup arrives, the consumer waits without issuing), then this thread's release of the slot
// for the producer (`empty`: one of its kStageReaders arrivals). The consumers' release of the slot
// (through the producer's next load into it) orders the barrier's next use.
__device__ __forceinline__ void hand_over(int s, uint64_t* empty) {
  sm90::fence_proxy_async_smem();
  sm90::named_barrier_arrive(kReadyBarrier0 + 2 * s, 256);
  sm90::named_barrier_arrive(kReadyBarrier0 + 2 * s + 1, 256);
  sm90::mbar_arrive(empty);  // this thread is done with the slot's bytes and slab
}

struct CoarseParams {
  const uint8_t* a_scales;
  const float* wscale;  // (N) channel scales
  uint8_t* payload;
  uint8_t* scales;
  int M, N, K;
  int k_tiles, n_tiles, tiles;
  int m_tiles, groups;  // resident: CTAs b, b + n_tiles, ... share channel panel b % n_tiles (groups of them)
  bool slab;  // K fits the pipeline's slab and a_scales is 16-byte aligned
  bool scales_aligned;  // a_scales 4-byte aligned and K a multiple of 128: every row's and k tile's scales too
  bool a_prepped;  // A re-expressed up front (the TMA reads the shifted copy; the re-expression warpgroup only
                   // computes the rows' coarse exponents)
  ScalingMode mode;
};

// Whether the tile at row m0 gets its rows' scales with each stage or panel (a slab): the producer's
// expected bytes and the re-expression's reads both follow this.
__device__ __forceinline__ bool tile_has_slab(const CoarseParams& p, int m0) { return p.slab && m0 + kTileM <= p.M; }

// This CTA's tiles: how many, and the origin of its i-th.
template <bool kResident>
__device__ __forceinline__ int tiles_of_cta(const CoarseParams& p) {
  const int b = int(blockIdx.x);
  if constexpr (kResident) {
    const int first = b / p.n_tiles;
    return first < p.m_tiles ? (p.m_tiles - first + p.groups - 1) / p.groups : 0;
  } else {
    return p.tiles > b ? (p.tiles - b + int(gridDim.x) - 1) / int(gridDim.x) : 0;
  }
}
template <bool kResident>
__device__ __forceinline__ void tile_origin(const CoarseParams& p, int i, int& m0, int& n0) {
  const int b = int(blockIdx.x);
  if constexpr (kResident) {
    m0 = (b / p.n_tiles + i * p.groups) * kTileM;
    n0 = (b % p.n_tiles) * kTileN;
  } else {
    const int tile = b + i * int(gridDim.x);
    m0 = (tile / p.n_tiles) * kTileM;
    n0 = (tile % p.n_tiles) * kTileN;
  }
}

// Four elements to e4m3 (saturating, round to nearest even), a in bits 0-7 ... d in bits 24-31:
// e4m3x2_satfinite twice, packed by the conversions themselves (no masks).
__device__ __forceinline__ uint32_t e4m3x4_satfinite(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

// Quad transpose of 16-bit items: lane q of a quad holds items c = 0..3 (w0 = c0 | c1 << 16,
// w1 = c2 | c3 << 16), each the two bytes at columns 8c + 2q, 8c + 2q + 1 of a 32-column block;
// returns in (o0, o1) the 8 bytes of columns 8q .. 8q + 7 (item q of lanes 0..3).
__device__ __forceinline__ void quad_transpose(uint32_t w0, uint32_t w1, int q, uint32_t& o0, uint32_t& o1) {
  const bool b = (q & 2) != 0, a = (q & 1) != 0;
  const uint32_t keep = b ? w1 : w0;
  const uint32_t recv = __shfl_xor_sync(0xFFFFFFFFu, b ? w0 : w1, 2);
  const uint32_t A = b ? recv : keep;  // items c = 2b, 2b + 1 from lane (q & 1)
  const uint32_t B = b ? keep : recv;  // ... from lane (q & 1) | 2
  const uint32_t send = a ? ((A & 0xFFFFu) | (B << 16)) : ((A >> 16) | (B & 0xFFFF0000u));
  const uint32_t r = __shfl_xor_sync(0xFFFFFFFFu, send, 1);
  if (a) {
    o0 = (r & 0xFFFFu) | (A & 0xFFFF0000u);
    o1 = (r >> 16) | (B & 0xFFFF0000u);
  } else {
    o0 = (A & 0xFFFFu) | (r << 16);
    o1 = (B & 0xFFFFu) | (r & 0xFFFF0000u);
  }
}

// A consumer's epilogue: y = (acc * 2^row) * 2^channel for its rows row0, row0 + 8 (coarse
// exponents e0, e1) and the tile's 128 channels from n0, quantized along n in 32-blocks (the block's
// amax over the four lanes of a quad, two shuffles), 8 bytes a lane after a quad transpose, and the
// rows' four scale bytes.
__device__ __forceinline__ void store_tile(const float (&acc)[64], uint32_t e0, uint32_t e1, int row0, int n0, int q,
                                           const CoarseParams& p) {
  const int row1 = row0 + 8;
  const float sa0 = e8m0_to_float(uint8_t(e0)), sa1 = e8m0_to_float(uint8_t(e1));
  uint32_t sc0 = 0, sc1 = 0;  // the four blocks' scale bytes of rows row0, row1
#pragma unroll
  for (int bb = 0; bb < kTileN / kBlockSize; ++bb) {
    float y[2][8];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int i = 4 * bb + c;
      const float2 ws = __ldg(reinterpret_cast<const float2*>(p.wscale + n0 + 8 * i + 2 * q));
      y[0][2 * c] = (acc[4 * i] * sa0) * ws.x;
      y[0][2 * c + 1] = (acc[4 * i + 1] * sa0) * ws.y;
      y[1][2 * c] = (acc[4 * i + 2] * sa1) * ws.x;
      y[1][2 * c + 1] = (acc[4 * i + 3] * sa1) * ws.y;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t amax = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = max(amax, __float_as_uint(y[h][e]) & kAbsMask);
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      const uint32_t sb = scale_byte_from_amax_bits(amax, p.mode);
      const float inv = e8m0_inv_scale(uint8_t(sb));
      // Bytes of columns 8c + 2q, + 1 (c = 0..3): w[0] holds c = 0, 1, w[1] c = 2, 3.
      uint32_t w[2];
#pragma unroll
      for (int k = 0; k < 2; ++k)
        w[k] = e4m3x4_satfinite(y[h][4 * k] * inv, y[h][4 * k + 1] * inv, y[h][4 * k + 2] * inv, y[h][4 * k + 3] * inv);
      if (sb == kE8m0Nan) {  // inf or NaN in the block: those elements' bytes by the rule
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const uint32_t u = __float_as_uint(y[h][e]);  // inf: sign | 448; NaN: 0x7F (the rule)
          const uint32_t byte = is_nan_bits(u) ? uint32_t(kE4m3Nan) : (((u >> 24) & 0x80u) | kE4m3MaxFinite);
          const int sh = 8 * (e % 4);
          if ((u & kExpAllOnes) == kExpAllOnes) w[e / 4] = (w[e / 4] & ~(0xFFu << sh)) | (byte << sh);
        }
      }
      uint32_t o0, o1;
      quad_transpose(w[0], w[1], q, o0, o1);
      const int row = h == 0 ? row0 : row1;
      if (row < p.M)
        *reinterpret_cast<uint2*>(p.payload + int64_t(row) * p.N + n0 + kBlockSize * bb + 8 * q) = make_uint2(o0, o1);
      if (h == 0)
        sc0 |= sb << (8 * bb);
      else
        sc1 |= sb << (8 * bb);
    }
  }
  const int sstride = p.N / kBlockSize;
  if (q == 0) {
    if (row0 < p.M) *reinterpret_cast<uint32_t*>(p.scales + int64_t(row0) * sstride + n0 / kBlockSize) = sc0;
    if (row1 < p.M) *reinterpret_cast<uint32_t*>(p.scales + int64_t(row1) * sstride + n0 / kBlockSize) = sc1;
  }
}

template <bool kResident>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_coarse_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_w,
                       const CoarseParams p) {
  using P = Pipe<kResident>;
  constexpr int kStages = P::kStages;
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte aligned (the 128-byte swizzle's period); pointer arithmetic keeps the shared state space
  // visible to the compiler (LDS/STS rather than generic accesses).
  uint8_t* panel = smem_raw + ((1024u - (sm90::smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* smem = panel + P::kPanelBytes;             // the stages
  uint8_t* slabs = smem + kStages * P::kStageBytes;   // [stage][128 rows][K / 32]
  uint8_t* rowexp = slabs + kStages * P::kSlabBytes;  // [stage][128 rows]
  uint64_t* full = reinterpret_cast<uint64_t*>(rowexp + kStages * kTileM);  // TMA -> re-expression
  uint64_t* empty = full + kStages;  // readers -> producer (kStageReaders arrivals)
  uint64_t* panel_full = empty + kStages;
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], kStageReaders);
    }
    sm90::mbar_init(panel_full, 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const int my_tiles = tiles_of_cta<kResident>(p);
  const int steps = my_tiles * p.k_tiles;
  const int ablocks = p.K / kBlockSize;
  const uint32_t slab_bytes = uint32_t(kTileM * ablocks);

  if (wg == 0) {
    // ---------------------------------------------------------- producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid != 0) return;
    if constexpr (kResident) {
      if (my_tiles > 0) {
        int m0, n0;
        tile_origin<kResident>(p, 0, m0, n0);
        sm90::mbar_arrive_expect_tx(panel_full, uint32_t(p.k_tiles * kTileBytes));
        for (int kt = 0; kt < p.k_tiles; ++kt)
          sm90::tma_load_2d(panel + kt * kTileBytes, &tm_w, panel_full, kt * kTileK, n0);
      }
    }
    for (int step = 0; step < steps; ++step) {
      const int i = step / p.k_tiles, kt = step - i * p.k_tiles;
      const int s = step % kStages, use = step / kStages;
      if (use > 0) sm90::mbar_wait(&empty[s], (use - 1) & 1);
      uint8_t* base = smem + s * P::kStageBytes;
      int m0, n0;
      tile_origin<kResident>(p, i, m0, n0);
      const bool slab = tile_has_slab(p, m0);
      sm90::mbar_arrive_expect_tx(&full[s], P::kStageBytes + (slab ? slab_bytes : 0u));
      sm90::tma_load_2d(base, &tm_a, &full[s], kt * kTileK, m0);
      if constexpr (!kResident) sm90::tma_load_2d(base + kTileBytes, &tm_w, &full[s], kt * kTileK, n0);
      if (slab) sm90::bulk_load(slabs + s * P::kSlabBytes, p.a_scales + int64_t(m0) * ablocks, slab_bytes, &full[s]);
    }
    return;
  }

  if (wg == 1) {
    // ---------------------------------------------------------- re-expression of A
    // Thread t owns tile row t: at a tile's first k tile its coarse exponent (the row's largest block
    // scale), then in every k tile its 128 bytes shifted in place, 16 at a time. Under the 128-byte
    // swizzle k chunk c of row t sits at chunk c ^ (t % 8) (so a warp's accesses to one k chunk hit
    // eight different bank groups); k chunks 2b and 2b + 1 are the tile's k block b.
    sm90::setmaxnreg_dec<kShiftRegs>();
    const int t = tid - 128;
    int step = 0;
    for (int it = 0; it < my_tiles; ++it) {
      int m0, n0;
      tile_origin<kResident>(p, it, m0, n0);
      const int row = m0 + t;
      const bool live = row < p.M;
      const bool slab = tile_has_slab(p, m0);
      const uint8_t* grow = p.a_scales + int64_t(live ? row : 0) * ablocks;  // the row's scales in global memory
      uint32_t e = 0;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++step) {
        const int s = step % kStages;
        const uint8_t* srow = slab ? slabs + s * P::kSlabBytes + t * ablocks : grow;
        // The k tile's four block scales: one 4-byte load where K is a multiple of 128 and the scales
        // are aligned (from global memory issued before the stage's wait), else byte loads.
        const bool word_scales = p.scales_aligned;
        uint32_t sw4 = 0;
        if (!slab && live && word_scales && !p.a_prepped)
          sw4 = *reinterpret_cast<const uint32_t*>(grow + kt * (kTileK / kBlockSize));
        sm90::mbar_wait(&full[s], (step / kStages) & 1);
        if (kt == 0) {
          e = live ? row_max_scale(srow, ablocks, word_scales) : 0u;
          rowexp[s * kTileM + t] = uint8_t(e);
        }
        if (!p.a_prepped) {
          if (slab && live && word_scales) sw4 = *reinterpret_cast<const uint32_t*>(srow + kt * (kTileK / kBlockSize));
          uint32_t d[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int b = kt * (kTileK / kBlockSize) + j;
            const uint32_t sb = word_scales ? (sw4 >> (8 * j)) & 0xFFu : (b < ablocks ? srow[b] : 0u);
            d[j] = live && b < ablocks ? block_shift(e, sb) : 0u;  // past K: zeros from the TMA
          }
          shift_row_ktile(smem + s * P::kStageBytes + t * kTileK, d, t);
        }
        hand_over(s, &empty[s]);
      }
    }
    return;
  }

  // ------------------------------------------------------------ consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 2;  // 64-row half of the tile
  const int warp = (tid % 128) / 32, lane = tid % 32, q = lane % 4;
  const int r0 = cw * 64 + warp * 16 + lane / 4;  // tile rows r0 and r0 + 8
  // acc: the tile's first accumulation chain (kChainTiles k tiles) and the fp32 sum; part: each
  // later chain, added into acc when it ends (two-level accumulation).
  float acc[64], part[64];
  int step = 0;
  if (kResident && my_tiles > 0) sm90::mbar_wait(panel_full, 0);
  for (int it = 0; it < my_tiles; ++it) {
    int m0, n0;
    tile_origin<kResident>(p, it, m0, n0);
    uint32_t e0 = 0, e1 = 0;  // the rows' coarse exponents
    for (int kt = 0; kt < p.k_tiles; ++kt, ++step) {
      const int s = step % kStages;
      sm90::named_barrier_sync(kReadyBarrier0 + 2 * s + cw, 256);
      if (kt == 0) {
        e0 = rowexp[s * kTileM + r0];
        e1 = rowexp[s * kTileM + r0 + 8];
      }
      const uint8_t* base = smem + s * P::kStageBytes;
      const uint64_t da = sm90::make_desc_k128b(base + cw * 64 * kTileK);
      const uint64_t db = sm90::make_desc_k128b(kResident ? panel + kt * kTileBytes : base + kTileBytes);
      sm90::wgmma_fence();
      const bool first = kt % kChainTiles == 0;
      if (kt < kChainTiles) {
#pragma unroll
        for (int kk = 0; kk < kTileK / 32; ++kk)
          sm90::wgmma_m64n128k32_ss(acc, da + 2 * kk, db + 2 * kk, first && kk == 0 ? 0 : 1);
      } else {
#pragma unroll
        for (int kk = 0; kk < kTileK / 32; ++kk)
          sm90::wgmma_m64n128k32_ss(part, da + 2 * kk, db + 2 * kk, first && kk == 0 ? 0 : 1);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      if (kt > 0) {  // the previous k tile's wgmmas are done: its stage is free
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(&empty[(step + kStages - 1) % kStages]);
      }
      const bool chain_end = (kt + 1) % kChainTiles == 0 || kt + 1 == p.k_tiles;
      if (kt >= kChainTiles && chain_end) {
        sm90::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] += part[i];
      }
    }
    sm90::wgmma_wait<0>();
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(&empty[(step + kStages - 1) % kStages]);
    store_tile(acc, e0, e1, m0 + r0, n0, q, p);
  }
}


// ------------------------------------------------------------------ the A-rows pipeline
// For K <= 1024 with many row tiles: each CTA owns row tiles (b, b + grid, ...) and multiplies each
// by every 128-channel tile of W, so an A tile is re-expressed once for all N (the other pipelines
// re-express it once per channel tile); W tiles stream through their own stages. The A panel (the
// row tile's whole K) is double-buffered for K <= 512: the producer loads the next one, and the
// re-expression shifts it, while the consumers work through the current one. For K <= 1024 one
// panel fits: the next row tile's panel loads when the consumers are done with the current one.
template <int kPanelCount>
struct ARowsPipe {
  static constexpr int kPanels = kPanelCount;
  static constexpr int kMaxK = kPanels == 2 ? 512 : 1024;
  static constexpr int kPanelBytes = kTileBytes * (kMaxK / kTileK);  // 64 or 128 KB
  static constexpr int kSlabBytes = kTileM * kMaxK / kBlockSize;     // 2 or 4 KB
  static constexpr int kWStages = 5;
  static constexpr int kSmemBytes =
      kPanels * (kPanelBytes + kSlabBytes + kTileM) + kWStages * kTileBytes + (2 * kPanels + 2 * kWStages) * 8 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static_assert(1 + 2 * kPanels <= 16, "named barriers");
};

template <int kPanels>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_arows_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_w,
                      const CoarseParams p) {
  using P = ARowsPipe<kPanels>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* panels = smem_raw + ((1024u - (sm90::smem_u32(smem_raw) & 1023u)) & 1023u);  // as gemm_coarse_kernel
  uint8_t* wst = panels + P::kPanels * P::kPanelBytes;    // W stages
  uint8_t* slabs = wst + P::kWStages * kTileBytes;        // [panel][128 rows][K / 32]
  uint8_t* rowexp = slabs + P::kPanels * P::kSlabBytes;   // [panel][128 rows]
  uint64_t* pfull = reinterpret_cast<uint64_t*>(rowexp + P::kPanels * kTileM);  // TMA -> re-expression
  uint64_t* pempty = pfull + P::kPanels;   // readers -> producer (kStageReaders arrivals)
  uint64_t* wfull = pempty + P::kPanels;   // TMA -> consumers
  uint64_t* wempty = wfull + P::kWStages;  // consumers -> producer
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    for (int b = 0; b < P::kPanels; ++b) {
      sm90::mbar_init(&pfull[b], 1);
      sm90::mbar_init(&pempty[b], kStageReaders);
    }
    for (int s = 0; s < P::kWStages; ++s) {
      sm90::mbar_init(&wfull[s], 1);
      sm90::mbar_init(&wempty[s], 8);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const int cta = int(blockIdx.x), grid = int(gridDim.x);
  const int my_tiles = p.m_tiles > cta ? (p.m_tiles - cta + grid - 1) / grid : 0;
  const int ablocks = p.K / kBlockSize;
  const uint32_t slab_bytes = uint32_t(kTileM * ablocks);

  if (wg == 0) {
    // ---------------------------------------------------------- producer
    sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid != 0) return;
    auto load_panel = [&](int i) {
      const int b = i % P::kPanels;
      if (i >= P::kPanels) sm90::mbar_wait(&pempty[b], (i / P::kPanels - 1) & 1);
      const int m0 = (cta + i * grid) * kTileM;
      const bool slab = tile_has_slab(p, m0);
      sm90::mbar_arrive_expect_tx(&pfull[b], uint32_t(p.k_tiles * kTileBytes) + (slab ? slab_bytes : 0u));
      for (int kt = 0; kt < p.k_tiles; ++kt)
        sm90::tma_load_2d(panels + b * P::kPanelBytes + kt * kTileBytes, &tm_a, &pfull[b], kt * kTileK, m0);
      if (slab) sm90::bulk_load(slabs + b * P::kSlabBytes, p.a_scales + int64_t(m0) * ablocks, slab_bytes, &pfull[b]);
    };
    if (my_tiles > 0) load_panel(0);
    int ws = 0;
    for (int i = 0; i < my_tiles; ++i)
      for (int j = 0; j < p.n_tiles; ++j)
        for (int kt = 0; kt < p.k_tiles; ++kt, ++ws) {
          const int s = ws % P::kWStages, use = ws / P::kWStages;
          if (use > 0) sm90::mbar_wait(&wempty[s], (use - 1) & 1);
          sm90::mbar_arrive_expect_tx(&wfull[s], kTileBytes);
          sm90::tma_load_2d(wst + s * kTileBytes, &tm_w, &wfull[s], kt * kTileK, j * kTileN);
          // The next panel: with two buffers once this one's first channel tile is on its way (its
          // buffer frees when the consumers finish the row tile before this one); with one after
          // this row tile's last W load (it waits for the consumers to finish this row tile).
          if (j == (kPanels == 2 ? 0 : p.n_tiles - 1) && kt == p.k_tiles - 1 && i + 1 < my_tiles) load_panel(i + 1);
        }
    return;
  }

  if (wg == 1) {
    // ---------------------------------------------------------- re-expression of A
    sm90::setmaxnreg_dec<kShiftRegs>();
    const int t = tid - 128;
    for (int i = 0; i < my_tiles; ++i) {
      const int b = i % P::kPanels;
      const int m0 = (cta + i * grid) * kTileM, row = m0 + t;
      const bool live = row < p.M;
      const uint8_t* srow = tile_has_slab(p, m0) ? slabs + b * P::kSlabBytes + t * ablocks
                                                 : p.a_scales + int64_t(live ? row : 0) * ablocks;
      sm90::mbar_wait(&pfull[b], (i / P::kPanels) & 1);
      const uint32_t e = live ? row_max_scale(srow, ablocks, p.scales_aligned) : 0u;
      rowexp[b * kTileM + t] = uint8_t(e);
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        uint32_t d[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int blk = kt * (kTileK / kBlockSize) + j;
          d[j] = live && blk < ablocks ? block_shift(e, srow[blk]) : 0u;  // past K: zeros from the TMA
        }
        shift_row_ktile(panels + b * P::kPanelBytes + kt * kTileBytes + t * kTileK, d, t);
      }
      hand_over(b, &pempty[b]);
    }
    return;
  }

  // ------------------------------------------------------------ consumers
  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = wg - 2;  // 64-row half of the tile
  const int warp = (tid % 128) / 32, lane = tid % 32, q = lane % 4;
  const int r0 = cw * 64 + warp * 16 + lane / 4;  // tile rows r0 and r0 + 8
  // acc: the first accumulation chain (kChainTiles k tiles) and the fp32 sum; part (K > 512 only):
  // the second chain, added into acc when it ends (two-level accumulation).
  constexpr bool kTwoChains = P::kMaxK > kChainTiles * kTileK;
  static_assert(P::kMaxK <= 2 * kChainTiles * kTileK, "at most two chains");
  float acc[64], part[kTwoChains ? 64 : 1];
  int ws = 0;
  for (int i = 0; i < my_tiles; ++i) {
    const int b = i % P::kPanels;
    const int m0 = (cta + i * grid) * kTileM;
    sm90::named_barrier_sync(kReadyBarrier0 + 2 * b + cw, 256);
    const uint32_t e0 = rowexp[b * kTileM + r0], e1 = rowexp[b * kTileM + r0 + 8];
    const uint8_t* pa = panels + b * P::kPanelBytes + cw * 64 * kTileK;
    for (int j = 0; j < p.n_tiles; ++j) {
      for (int kt = 0; kt < p.k_tiles; ++kt, ++ws) {
        const int s = ws % P::kWStages;
        sm90::mbar_wait(&wfull[s], (ws / P::kWStages) & 1);
        const uint64_t da = sm90::make_desc_k128b(pa + kt * kTileBytes);
        const uint64_t db = sm90::make_desc_k128b(wst + s * kTileBytes);
        sm90::wgmma_fence();
        if (!kTwoChains || kt < kChainTiles) {
#pragma unroll
          for (int kk = 0; kk < kTileK / 32; ++kk)
            sm90::wgmma_m64n128k32_ss(acc, da + 2 * kk, db + 2 * kk, kt == 0 && kk == 0 ? 0 : 1);
        } else if constexpr (kTwoChains) {
#pragma unroll
          for (int kk = 0; kk < kTileK / 32; ++kk)
            sm90::wgmma_m64n128k32_ss(part, da + 2 * kk, db + 2 * kk, kt == kChainTiles && kk == 0 ? 0 : 1);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>();
        if (kt > 0) {  // the previous k tile's wgmmas are done: its W stage is free
          __syncwarp();
          if (lane == 0) sm90::mbar_arrive(&wempty[(ws + P::kWStages - 1) % P::kWStages]);
        }
      }
      sm90::wgmma_wait<0>();
      if constexpr (kTwoChains) {
        if (p.k_tiles > kChainTiles) {
#pragma unroll
          for (int r = 0; r < 64; ++r) acc[r] += part[r];
        }
      }
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(&wempty[(ws + P::kWStages - 1) % P::kWStages]);
      store_tile(acc, e0, e1, m0 + r0, j * kTileN, q, p);
    }
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(&pempty[b]);  // this warp is done with the panel
  }
}

Status run_exact(const detail::GemmQuantizeProblem& p, cudaStream_t s) {
  const int64_t items = p.m * (p.n / kBlockSize);
  const int64_t grid = (items + kExactWarps - 1) / kExactWarps;
  if (grid > 0x7FFFFFFF) return Status::Invalid("a: M x N / 32 too large for the exact path");
  gemm_exact_kernel<<<unsigned(grid), kExactWarps * 32, 0, s>>>(p.a, p.a_scales, p.w, p.w_scales, p.m, p.n, p.k,
                                                                p.mode, p.payload, p.scales);
  return check_launch("gemm_exact_kernel");
}

enum class Pipeline { kARows, kWPanel, kStream };
constexpr size_t kPrepAMaxBytes = size_t(1) << 28;  // the largest A the streaming pipeline copies re-expressed

Status run_coarse(const detail::GemmQuantizeProblem& p, cudaStream_t s) {
  const size_t wbytes = size_t(p.n) * size_t(p.k), ws_bytes = wbytes + size_t(p.n) * sizeof(float);
  void* ws = nullptr;
  MXFLASH_RETURN_IF_ERROR(workspace_alloc(ws_bytes, s, &ws, "gemm_quantize workspace"));
  uint8_t* wq = static_cast<uint8_t*>(ws);
  float* wscale = reinterpret_cast<float*>(wq + wbytes);  // N K is a multiple of 4096: aligned
  void* aws = nullptr;  // A re-expressed up front (streaming, small enough), and its row scales
  Status st = [&]() -> Status {
    gemm_prep_rows_kernel<<<unsigned((p.n + kPrepWarps - 1) / kPrepWarps), kPrepWarps * 32, 0, s>>>(
        p.w, p.w_scales, p.n, p.k, wq, wscale);
    MXFLASH_RETURN_IF_ERROR(check_launch("gemm_prep_rows_kernel"));
    CUtensorMap tm_a, tm_w;
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_w, wq, uint64_t(p.k), uint64_t(p.n), kTileN));
    CoarseParams cp;
    cp.a_scales = p.a_scales;
    cp.wscale = wscale;
    cp.payload = p.payload;
    cp.scales = p.scales;
    cp.M = int(p.m);
    cp.N = int(p.n);
    cp.K = int(p.k);
    cp.k_tiles = int((p.k + kTileK - 1) / kTileK);
    cp.n_tiles = int(p.n / kTileN);
    const int64_t tiles = ((p.m + kTileM - 1) / kTileM) * cp.n_tiles;
    if (tiles > 0x7FFFFFFF) return Status::Invalid("a: too many output tiles");
    cp.tiles = int(tiles);
    cp.mode = p.mode;
    int sms = 0;
    MXFLASH_RETURN_IF_ERROR(sm_count(&sms));
    cp.m_tiles = int((p.m + kTileM - 1) / kTileM);
    // The pipeline: A rows (two panels for K <= 512 with at least two channel tiles, one panel for
    // K <= 1024 with at least four; and two row tiles per SM), else the resident W panel
    // (K <= 768), else streaming. MXFLASH_GEMM_PIPE=arows|wpanel|stream forces one where the shape
    // allows it (A/B runs, tests).
    const bool arows_ok = p.k <= ARowsPipe<1>::kMaxK, wpanel_ok = p.k <= kResidentMaxK && cp.n_tiles <= sms;
    const bool two_panels = p.k <= ARowsPipe<2>::kMaxK;
    Pipeline pipe = arows_ok && cp.n_tiles >= (two_panels ? 2 : 4) && cp.m_tiles >= 2 * sms ? Pipeline::kARows
                    : wpanel_ok                                                              ? Pipeline::kWPanel
                                                                                             : Pipeline::kStream;
    if (const char* env = std::getenv("MXFLASH_GEMM_PIPE")) {
      const std::string v(env);
      if (v == "arows" && arows_ok) pipe = Pipeline::kARows;
      if (v == "wpanel" && wpanel_ok) pipe = Pipeline::kWPanel;
      if (v == "stream") pipe = Pipeline::kStream;
    }
    const int slab_max_k = pipe == Pipeline::kARows    ? (two_panels ? ARowsPipe<2>::kMaxK : ARowsPipe<1>::kMaxK)
                           : pipe == Pipeline::kWPanel ? Pipe<true>::kSlabMaxK
                                                       : Pipe<false>::kSlabMaxK;
    cp.scales_aligned = is_aligned(p.a_scales, 4) && p.k % kTileK == 0;
    cp.slab = p.k <= slab_max_k && is_aligned(p.a_scales, 16);
    // Streaming re-expresses A once up front where the copy is at most kPrepAMaxBytes: in the
    // kernel each A tile would be shifted once per channel tile (the re-expression warpgroup is
    // the critical path at large K, docs/fused.md).
    cp.a_prepped = pipe == Pipeline::kStream && size_t(p.m) * size_t(p.k) <= kPrepAMaxBytes;
    if (cp.a_prepped) {
      const size_t abytes = size_t(p.m) * size_t(p.k);
      MXFLASH_RETURN_IF_ERROR(
          workspace_alloc(abytes + size_t(p.m) * sizeof(float), s, &aws, "gemm_quantize A workspace"));
      uint8_t* aq = static_cast<uint8_t*>(aws);
      gemm_prep_rows_kernel<<<unsigned((p.m + kPrepWarps - 1) / kPrepWarps), kPrepWarps * 32, 0, s>>>(
          p.a, p.a_scales, p.m, p.k, aq, reinterpret_cast<float*>(aq + abytes));  // M K: a multiple of 32
      MXFLASH_RETURN_IF_ERROR(check_launch("gemm_prep_rows_kernel (A)"));
    }
    MXFLASH_RETURN_IF_ERROR(make_tile_map(&tm_a, cp.a_prepped ? aws : const_cast<uint8_t*>(p.a), uint64_t(p.k),
                                          uint64_t(p.m), kTileM));
    auto launch = [&](auto kernel, int smem, int grid) -> Status {
      MXFLASH_RETURN_IF_ERROR(cuda_error(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                                         "cudaFuncSetAttribute(gemm_quantize kernel)"));
      kernel<<<grid, kThreads, smem, s>>>(tm_a, tm_w, cp);
      return Status::Ok();
    };
    if (pipe == Pipeline::kARows) {
      cp.groups = 0;
      if (two_panels)
        MXFLASH_RETURN_IF_ERROR(launch(gemm_arows_kernel<2>, ARowsPipe<2>::kSmemBytes, std::min(cp.m_tiles, sms)));
      else
        MXFLASH_RETURN_IF_ERROR(launch(gemm_arows_kernel<1>, ARowsPipe<1>::kSmemBytes, std::min(cp.m_tiles, sms)));
    } else if (pipe == Pipeline::kWPanel) {
      cp.groups = std::min(sms / cp.n_tiles, cp.m_tiles);
      MXFLASH_RETURN_IF_ERROR(launch(gemm_coarse_kernel<true>, Pipe<true>::kSmemBytes, cp.groups * cp.n_tiles));
    } else {
      cp.groups = 0;
      MXFLASH_RETURN_IF_ERROR(launch(gemm_coarse_kernel<false>, Pipe<false>::kSmemBytes,
                                     int(std::min<int64_t>(tiles, sms))));
    }
    return check_launch("gemm_coarse_kernel");
  }();
  const Status freed = workspace_free(ws, s, "gemm_quantize workspace free");
  const Status afreed = aws != nullptr ? workspace_free(aws, s, "gemm_quantize A workspace free") : Status::Ok();
  MXFLASH_RETURN_IF_ERROR(st);
  MXFLASH_RETURN_IF_ERROR(freed);
  return afreed;
}

}  // namespace

bool gemm_coarse_supported(const detail::GemmQuantizeProblem& p) {
  return p.n % kTileN == 0 && p.k >= kTileK && p.m >= kTileM && is_aligned(p.a, 16) && is_aligned(p.w, 16) &&
         is_aligned(p.payload, 8) && is_aligned(p.scales, 4);
}

Status gemm_quantize(const detail::GemmQuantizeProblem& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.path == GemmPath::kCoarse) return run_coarse(p, s);
  return run_exact(p, s);
}

}  // namespace mxflash::cuda
