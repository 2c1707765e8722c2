// rmsnorm_quantize on CUDA (include/mxflash/fused.h): one warp per row, the arithmetic of
// src/common/rmsnorm_rules.h (so the bytes equal the CPU reference's), memory-bound by design:
// x is read once from DRAM and held in registers as loaded (raw bf16 or fp32 words) between the
// sum of squares and the quantization (rows of up to 4096 bf16 or 2048 fp32 values; longer rows are
// read a second time, from L1/L2); payload and scales are written once. Short rows are taken
// several to a warp, all loads issued before any arithmetic, so that each lane keeps six to eight
// 16-byte loads in flight.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/rmsnorm_rules.h"
#include "cuda/common/launch_utils.cuh"
#include "cuda/fused/fused_cuda.h"
#include "cuda/quantize/mx_device.cuh"

namespace mxflash::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroupLanes = kBlockSize / kRmsChunk;  // lanes sharing an MX block: 4
static_assert(kRmsLanes == 32, "a row's lanes are one warp's");

struct RmsParams {
  const void* x;
  const void* weight;  // null: no weight
  uint8_t* payload;
  uint8_t* scales;
  float* rstd;  // null: not written
  int64_t rows;
  int cols;
  float eps;
  ScalingMode mode;
};

// A chunk of 8 values as loaded: one 16-byte word of bf16, two of fp32.
template <typename T>
struct Raw {
  static constexpr int kWords = int(sizeof(T)) / 2;
  uint4 w[kWords];
};

template <typename T>
__device__ __forceinline__ Raw<T> load_raw(const T* base, int64_t i) {
  Raw<T> r;
#pragma unroll
  for (int k = 0; k < Raw<T>::kWords; ++k) r.w[k] = __ldg(reinterpret_cast<const uint4*>(base + i) + k);
  return r;
}

// The chunk's 8 values as fp32 (bf16 widens exactly by a shift).
template <typename T>
__device__ __forceinline__ void widen(const Raw<T>& r, float (&v)[kRmsChunk]) {
  if constexpr (sizeof(T) == 2) {
    const uint32_t w[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  } else {
    const uint32_t w[8] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w, r.w[1].x, r.w[1].y, r.w[1].z, r.w[1].w};
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __uint_as_float(w[k]);
  }
}

template <typename T>
__device__ __forceinline__ float add_squares(const Raw<T>& r, float ss) {
  float v[kRmsChunk];
  widen(r, v);
#pragma unroll
  for (int e = 0; e < kRmsChunk; ++e) ss = fmaf(v[e], v[e], ss);
  return ss;
}

// Chunk c of the row (x as loaded): y, its MX block's scale (the block's four lanes agree through
// two shuffles, which every lane of the warp executes: `active` only guards memory), e4m3 bytes.
// Without a weight (kWeight false) y = x * rstd, which is what (x * rstd) * 1 is. The weights are
// loaded here for each row (L1 hits after the first): held in registers across a warp's rows they
// cost more warps an SM than the loads they save (measured).
template <typename In, typename W, bool kWeight>
__device__ __forceinline__ void emit_chunk(const RmsParams& p, int64_t row, int c, bool active, int lane,
                                           const Raw<In>& raw, float rstd) {
  float xv[kRmsChunk], w[kRmsChunk];
  widen(raw, xv);
  if constexpr (kWeight) {
    Raw<W> wraw{};
    if (active) wraw = load_raw(static_cast<const W*>(p.weight), int64_t(c) * kRmsChunk);
    widen(wraw, w);
  }
  float y[kRmsChunk];
  uint32_t amax = 0;
#pragma unroll
  for (int e = 0; e < kRmsChunk; ++e) {
    y[e] = kWeight ? rms_apply(xv[e], rstd, w[e]) : __fmul_rn(xv[e], rstd);
    amax = max(amax, __float_as_uint(y[e]) & kAbsMask);  // integer max: NaN ranks above inf
  }
  amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  if (!active) return;
  const uint32_t s = scale_byte_from_amax_bits(amax, p.mode);
  const float inv = e8m0_inv_scale(uint8_t(s));
  uint32_t q[2];
#pragma unroll
  for (int o = 0; o < 2; ++o)
    q[o] = e4m3x2_satfinite(y[4 * o] * inv, y[4 * o + 1] * inv) |
           (e4m3x2_satfinite(y[4 * o + 2] * inv, y[4 * o + 3] * inv) << 16);
  if (s == kE8m0Nan) {  // the block holds inf or NaN: those elements' bytes by the rule
#pragma unroll 1
    for (int e = 0; e < kRmsChunk; ++e) {
      const uint32_t u = __float_as_uint(y[e]);
      if ((u & kExpAllOnes) != kExpAllOnes) continue;
      const uint32_t b = rms_quantize_element(y[e], inv);
      const int sh = 8 * (e % 4);
      q[e / 4] = (q[e / 4] & ~(0xFFu << sh)) | (b << sh);
    }
  }
  const int64_t base = row * p.cols + int64_t(c) * kRmsChunk;
  *reinterpret_cast<uint2*>(p.payload + base) = make_uint2(q[0], q[1]);
  if (lane % kGroupLanes == 0) p.scales[base / kBlockSize] = uint8_t(s);
}

// The butterfly of rmsnorm_rules.h, then rstd (written by lane 0 when requested).
__device__ __forceinline__ float row_rstd(const RmsParams& p, float ss, int64_t row, int lane) {
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, d));
  const float rstd = rms_rstd(ss, p.cols, p.eps);
  if (p.rstd != nullptr && lane == 0) p.rstd[row] = rstd;
  return rstd;
}

// kChunks > 0: each of the warp's kRows rows is held in registers (cols <= kChunks * 256), all of
// them loaded before any arithmetic. kChunks == 0: one row a warp, read twice.
template <typename In, typename W, bool kWeight, int kChunks, int kRows>
__global__ void __launch_bounds__(kThreads) rmsnorm_quantize_kernel(const RmsParams p) {
  const int lane = int(threadIdx.x % 32);
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * kRows;
  if (row0 >= p.rows) return;  // whole warps
  const int nchunks = p.cols / kRmsChunk;
  const int iters = (nchunks + 31) / 32;
  if constexpr (kChunks > 0) {
    Raw<In> v[kRows][kChunks];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int c = lane + 32 * i;
        if (row0 + r < p.rows && c < nchunks) v[r][i] = load_raw(static_cast<const In*>(p.x) + (row0 + r) * p.cols, int64_t(c) * kRmsChunk);
      }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= p.rows) break;  // warp-uniform
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kChunks; ++i)
        if (lane + 32 * i < nchunks) ss = add_squares(v[r][i], ss);
      const float rstd = row_rstd(p, ss, row0 + r, lane);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        if (i >= iters) break;  // warp-uniform
        const int c = lane + 32 * i;
        emit_chunk<In, W, kWeight>(p, row0 + r, c, c < nchunks, lane, v[r][i], rstd);
      }
    }
  } else {
    const In* xr = static_cast<const In*>(p.x) + row0 * p.cols;
    float ss = 0.f;
    for (int i = 0; i < iters; ++i) {
      const int c = lane + 32 * i;
      if (c < nchunks) ss = add_squares(load_raw(xr, int64_t(c) * kRmsChunk), ss);
    }
    const float rstd = row_rstd(p, ss, row0, lane);
    for (int i = 0; i < iters; ++i) {
      const int c = lane + 32 * i;
      const bool active = c < nchunks;
      Raw<In> raw{};
      if (active) raw = load_raw(xr, int64_t(c) * kRmsChunk);
      emit_chunk<In, W, kWeight>(p, row0, c, active, lane, raw, rstd);
    }
  }
}

template <typename In, typename W, int kChunks, int kRows>
Status launch_form(const RmsParams& p, cudaStream_t s) {
  const int64_t per_cta = int64_t(kWarps) * kRows;
  const int64_t grid = (p.rows + per_cta - 1) / per_cta;
  if (grid > int64_t(0x7FFFFFFF)) return Status::Invalid("x: too many rows for one launch");
  const dim3 g{static_cast<unsigned>(grid)}, b{unsigned(kThreads)};
  if (p.weight != nullptr)
    rmsnorm_quantize_kernel<In, W, true, kChunks, kRows><<<g, b, 0, s>>>(p);
  else
    rmsnorm_quantize_kernel<In, W, false, kChunks, kRows><<<g, b, 0, s>>>(p);
  return check_launch("rmsnorm_quantize_kernel");
}

// The smallest form that holds a row: chunks a lane (rows of up to 4096 bf16 / 2048 fp32 values;
// more registers a thread leave too few warps on an SM to keep its loads in flight), with rows of at
// most 1024 values taken 2 to 8 to a warp, so that each lane has 6 to 8 loads in flight.
template <typename In, typename W>
Status launch_typed(const RmsParams& p, cudaStream_t s) {
  const int iters = (p.cols / kRmsChunk + 31) / 32;
  constexpr bool kBf16 = sizeof(In) == 2;
  if (iters <= 1) return launch_form<In, W, 1, 8>(p, s);
  if (iters <= 2) return launch_form<In, W, 2, 4>(p, s);
  if (iters <= 3) return launch_form<In, W, 3, 2>(p, s);
  if (iters <= 4) return launch_form<In, W, 4, 2>(p, s);
  if (iters <= 6) return launch_form<In, W, 6, 1>(p, s);
  if (iters <= 8) return launch_form<In, W, 8, 1>(p, s);
  if (kBf16 && iters <= 12) return launch_form<In, W, kBf16 ? 12 : 1, 1>(p, s);
  if (kBf16 && iters <= 16) return launch_form<In, W, kBf16 ? 16 : 1, 1>(p, s);
  return launch_form<In, W, 0, 1>(p, s);
}

}  // namespace

Status rmsnorm_quantize(const detail::RmsNormQuantizeProblem& p, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.x, 16, "x"));
  if (p.weight != nullptr) MXFLASH_RETURN_IF_ERROR(check_aligned(p.weight, 16, "weight"));
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.payload, 8, "payload"));
  const RmsParams k{p.x, p.weight, p.payload, p.scales, p.rstd, p.rows, int(p.cols), p.eps, p.mode};
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.x_bf16)
    return p.weight_bf16 ? launch_typed<uint16_t, uint16_t>(k, s) : launch_typed<uint16_t, float>(k, s);
  return p.weight_bf16 ? launch_typed<float, uint16_t>(k, s) : launch_typed<float, float>(k, s);
}

}  // namespace mxflash::cuda
