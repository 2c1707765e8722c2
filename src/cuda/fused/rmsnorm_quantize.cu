// rmsnorm_quantize on CUDA (include/mxflash/fused.h): the arithmetic of src/common/rmsnorm_rules.h
// (so the bytes equal the CPU reference's), memory-bound by design. A row belongs to L =
// rms_lanes(C) lanes (32 / L rows side by side in a warp), each holding C / (8 L) chunks of 8
// values, so every lane has work for every C (C = 384: 16 lanes of 3 chunks, two rows a warp).
// x is read once from DRAM and held in registers as loaded (raw bf16 or fp32 words) between the sum
// of squares and the quantization (1, 2, 3, 4, 6 or 8 chunks a lane: C up to 2048; other rows are
// read a second time, from L1/L2); payload and scales are written once. A warp takes several rounds of
// rows when a lane holds few chunks, all loads issued before any arithmetic, so that each lane
// keeps six to eight 16-byte loads in flight.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/rmsnorm_rules.h"
#include "cuda/common/launch_utils.cuh"
#include "cuda/fused/fused_cuda.h"
#include "cuda/fused/rms_device.cuh"
#include "cuda/quantize/mx_device.cuh"

namespace mxflash::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroupLanes = kBlockSize / kRmsChunk;  // lanes sharing an MX block: 4
static_assert(kRmsMaxLanes == 32, "a row's lanes are at most one warp's");

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
  int lanes;  // L = rms_lanes(cols)
  int per_lane;  // chunks a lane: cols / (8 L)
};

template <typename T>
__device__ __forceinline__ float add_squares(const Raw<T>& r, float ss) {
  float v[kRmsChunk];
  widen(r, v);
#pragma unroll
  for (int e = 0; e < kRmsChunk; ++e) ss = fmaf(v[e], v[e], ss);
  return ss;
}

// Chunk c of a row (x as loaded): y, its MX block's scale (the block's four lanes agree through two
// shuffles, which every lane of the warp executes: `valid` only guards memory), e4m3 bytes. Without
// a weight (kWeight false) y = x * rstd, which is what (x * rstd) * 1 is. The weights are loaded
// here for each row (L1 hits after the first): held in registers across a warp's rows they cost
// more warps an SM than the loads they save (measured).
//  prow, srow: the row's payload and scale bytes.
template <typename In, typename W, bool kWeight>
__device__ __forceinline__ void emit_chunk(const RmsParams& p, uint8_t* prow, uint8_t* srow, int c, bool valid,
                                           int lane, const Raw<In>& raw, float rstd) {
  float xv[kRmsChunk], w[kRmsChunk];
  widen(raw, xv);
  if constexpr (kWeight) {
    Raw<W> wraw{};
    if (valid) wraw = load_raw(static_cast<const W*>(p.weight), int64_t(c) * kRmsChunk);
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
  if (!valid) return;
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
      const uint32_t b = quantize_produced_element(y[e], inv);
      const int sh = 8 * (e % 4);
      q[e / 4] = (q[e / 4] & ~(0xFFu << sh)) | (b << sh);
    }
  }
  *reinterpret_cast<uint2*>(prow + int64_t(c) * kRmsChunk) = make_uint2(q[0], q[1]);
  if (lane % kGroupLanes == 0) srow[c / kGroupLanes] = uint8_t(s);
}

// The butterfly of rmsnorm_rules.h over the row's L lanes (xor d < L stays in the row's lane
// group), then rstd, written by the group's first lane when requested and the row is real.
template <int kLanes>
__device__ __forceinline__ float row_rstd(const RmsParams& p, float ss, int64_t row, bool valid, int q) {
  const float rstd = rms_rstd(rms_lane_sum<kLanes>(ss, p.lanes), p.cols, p.eps);
  if (p.rstd != nullptr && valid && q == 0) p.rstd[row] = rstd;
  return rstd;
}

// Lane `lane` serves row (row0 + round * G + lane / L) with chunks q + L i (q = lane % L,
// i < per_lane), G = 32 / L rows a round. kChunks > 0: a lane's chunks of kRounds rounds are held in
// registers (launched where per_lane == kChunks: the loops have no bounds to test), all loaded
// before any arithmetic (rows past the end read the last row; nothing of theirs is stored).
// kChunks == 0: one round, each chunk read twice.
// kLanes: L at compile time (32, the common case), or 0: p.lanes.
// Forms of up to 4 chunks a lane are held to 64 registers (4 CTAs, 32 warps an SM).
template <typename In, typename W, bool kWeight, int kChunks, int kRounds, int kLanes>
__global__ void __launch_bounds__(kThreads, (kChunks > 0 && kChunks <= 4) ? 4 : 1)
    rmsnorm_quantize_kernel(const RmsParams p) {
  const int lane = int(threadIdx.x % 32);
  const int L = kLanes > 0 ? kLanes : p.lanes, G = 32 / L, q = lane % L;
  const int64_t warp_row0 = (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * kRounds * G;
  if (warp_row0 >= p.rows) return;  // whole warps
  const In* x = static_cast<const In*>(p.x);
  auto row_of = [&](int round) { return warp_row0 + int64_t(round) * G + lane / L; };
  auto payload_row = [&](int64_t row) { return p.payload + row * p.cols; };
  auto scale_row = [&](int64_t row) { return p.scales + row * (p.cols / kBlockSize); };
  if constexpr (kChunks > 0) {
    Raw<In> v[kRounds][kChunks];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const In* xr = x + min(row_of(r), p.rows - 1) * p.cols;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) v[r][i] = load_raw(xr, int64_t(q + L * i) * kRmsChunk);
    }
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      if (warp_row0 + int64_t(r) * G >= p.rows) break;  // warp-uniform
      const int64_t row = row_of(r);
      const bool valid = row < p.rows;
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) ss = add_squares(v[r][i], ss);
      const float rstd = row_rstd<kLanes>(p, ss, row, valid, q);
      uint8_t* prow = payload_row(row);
      uint8_t* srow = scale_row(row);
#pragma unroll
      for (int i = 0; i < kChunks; ++i)
        emit_chunk<In, W, kWeight>(p, prow, srow, q + L * i, valid, lane, v[r][i], rstd);
    }
  } else {
    const int K = p.per_lane;
    const int64_t row = row_of(0);
    const bool valid = row < p.rows;
    const In* xr = x + min(row, p.rows - 1) * p.cols;
    float ss = 0.f;
    for (int i = 0; i < K; ++i) ss = add_squares(load_raw(xr, int64_t(q + L * i) * kRmsChunk), ss);
    const float rstd = row_rstd<kLanes>(p, ss, row, valid, q);
    uint8_t* prow = payload_row(row);
    uint8_t* srow = scale_row(row);
    for (int i = 0; i < K; ++i)
      emit_chunk<In, W, kWeight>(p, prow, srow, q + L * i, valid, lane, load_raw(xr, int64_t(q + L * i) * kRmsChunk),
                                 rstd);
  }
}

template <typename In, typename W, int kChunks, int kRounds>
Status launch_form(const RmsParams& p, cudaStream_t s) {
  const int64_t per_cta = int64_t(kWarps) * kRounds * (32 / p.lanes);
  const int64_t grid = (p.rows + per_cta - 1) / per_cta;
  if (grid > int64_t(0x7FFFFFFF)) return Status::Invalid("x: too many rows for one launch");
  const dim3 g{static_cast<unsigned>(grid)}, b{unsigned(kThreads)};
  const bool full = p.lanes == 32;  // a row a warp: L known at compile time
  if (p.weight != nullptr) {
    if (full)
      rmsnorm_quantize_kernel<In, W, true, kChunks, kRounds, 32><<<g, b, 0, s>>>(p);
    else
      rmsnorm_quantize_kernel<In, W, true, kChunks, kRounds, 0><<<g, b, 0, s>>>(p);
  } else {
    if (full)
      rmsnorm_quantize_kernel<In, W, false, kChunks, kRounds, 32><<<g, b, 0, s>>>(p);
    else
      rmsnorm_quantize_kernel<In, W, false, kChunks, kRounds, 0><<<g, b, 0, s>>>(p);
  }
  return check_launch("rmsnorm_quantize_kernel");
}

// The form whose chunk count is a lane's, for 1 to 8 chunks (C up to 2048 where L = 32),
// with 2 to 8 rounds of rows where a lane holds 1 to 4 chunks, so that each lane has 6 to 8 loads in
// flight; other counts read each chunk twice. Measured (H200, docs/fused.md): a 16-chunk register
// form ran C = 4096 in 0.99 ms against 0.57 read twice (24% occupancy at 94-114 registers); a form
// with more chunks than a lane's, its loops testing the count, ran as slowly.
template <typename In, typename W>
Status launch_typed(const RmsParams& p, cudaStream_t s) {
  switch (p.per_lane) {
    case 1: return launch_form<In, W, 1, 8>(p, s);
    case 2: return launch_form<In, W, 2, 4>(p, s);
    case 3: return launch_form<In, W, 3, 2>(p, s);
    case 4: return launch_form<In, W, 4, 2>(p, s);
    case 6: return launch_form<In, W, 6, 1>(p, s);
    case 8: return launch_form<In, W, 8, 1>(p, s);
    default: return launch_form<In, W, 0, 1>(p, s);
  }
}

}  // namespace

Status rmsnorm_quantize(const detail::RmsNormQuantizeProblem& p, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.x, 16, "x"));
  if (p.weight != nullptr) MXFLASH_RETURN_IF_ERROR(check_aligned(p.weight, 16, "weight"));
  MXFLASH_RETURN_IF_ERROR(check_aligned(p.payload, 8, "payload"));
  const int lanes = rms_lanes(p.cols);
  const RmsParams k{p.x,   p.weight, p.payload, p.scales, p.rstd, p.rows, int(p.cols), p.eps, p.mode,
                    lanes, int(p.cols / kRmsChunk / lanes)};
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.x_bf16)
    return p.weight_bf16 ? launch_typed<uint16_t, uint16_t>(k, s) : launch_typed<uint16_t, float>(k, s);
  return p.weight_bf16 ? launch_typed<float, uint16_t>(k, s) : launch_typed<float, float>(k, s);
}

}  // namespace mxflash::cuda
