// The arithmetic of rmsnorm_quantize, shared by the CPU reference and the CUDA kernel so that both
// give the same bits (include/mxflash/fused.h).
//
// A row of C values is read in chunks of kRmsChunk consecutive values, shared by L = rms_lanes(C)
// lanes: the largest power of two from 4 to 32 that divides the chunk count C / 8, so that every
// lane has the same number of chunks (C = 384: 48 chunks, 16 lanes of 3; C = 512: 32 lanes of 2).
// Chunk i belongs to lane i % L. Each lane sums the squares of its chunks' values in order (chunk by
// chunk, value by value), one fused multiply-add each, from 0. The lanes' sums are then combined by
// a butterfly: for d = L/2, ..., 2, 1 every lane adds the sum of lane (its index xor d) to its own
// (fp32 addition commutes, so all lanes end with the same bits). The CUDA kernel runs 32 / L rows
// side by side in a warp this way. An MX block (4 chunks, C a multiple of 32) lies on 4 consecutive
// lanes.
#pragma once
#include <cstdint>

#include "mxflash/mx.h"

namespace mxflash {

inline constexpr int kRmsChunk = 8;      // values a lane reads at once (16 bytes of bf16)
inline constexpr int kRmsMaxLanes = 32;  // lanes sharing a row, at most (a warp)
inline constexpr int kRmsMaxCols = 65536;

// L for a row of `cols` values (a multiple of 32).
MXFLASH_HD int rms_lanes(int64_t cols) {
  const int64_t chunks = cols / kRmsChunk;
  int lanes = kRmsMaxLanes;
  while (lanes > 4 && chunks % lanes != 0) lanes /= 2;
  return lanes;
}

// rstd = 1 / sqrt(ss / C + eps), each step rounded to nearest (no fast-math forms). A NaN result
// is the quiet NaN 0x7FC00000 (CPU and GPU arithmetic make NaNs of different bits).
// NaN as the quiet NaN 0x7FC00000 (CPU and GPU arithmetic make NaNs of different bits), else v.
MXFLASH_HD float rms_canonical(float v) { return is_nan_bits(float_bits(v)) ? bits_float(0x7FC00000u) : v; }

MXFLASH_HD float rms_rstd(float ss, int64_t cols, float eps) {
#if defined(__CUDA_ARCH__)
  const float r = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, float(cols)), eps)));
#else
  volatile float mean = ss / float(cols);  // volatile: no contraction or reassociation by the host compiler
  volatile float v = mean + eps;
  volatile float root = __builtin_sqrtf(v);
  const float r = 1.f / root;
#endif
  return rms_canonical(r);
}

// y = (x * rstd) * w, two rounded multiplies (w = 1 without a weight gives x * rstd exactly).
MXFLASH_HD float rms_apply(float x, float rstd, float w) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__fmul_rn(x, rstd), w);
#else
  volatile float xr = x * rstd;
  return xr * w;
#endif
}

// ---- The backward (rmsnorm_backward): given x, weight w, the forward's rstd and dy = dL/dy,
//   xh = x * rstd,  gy = dy * w,  dot = sum_c gy * xh,
//   dx = (gy - xh * (dot / C)) * rstd,   dweight[c] = sum_t dy[t, c] * xh[t, c].
// Each product rounded once (xh and gy as rms_apply's multiplies; gy = dy without a weight). dot is
// summed over the row's L = rms_lanes(C) lanes and chunks exactly as the forward's sum of squares
// (fma(gy, xh, acc) in place of fma(x, x, acc)), then the butterfly; dx is one fma (gy - xh * m, m =
// dot / C rounded) and one rounded multiply by rstd. dweight: the rows are taken in groups of
// rms_bwd_group_rows(T) (a multiple of 512 that makes at most 8192 groups); each group's column sum
// runs over its rows in order, fma(dy, xh, acc) from 0; the groups' sums are then added in blocks of
// kRmsBwdSumBlock consecutive groups, each block in group order from 0, and the blocks' sums in block
// order from 0. (Many groups let the CUDA pass that writes dx also sum them, one group a slot of
// lanes, with enough slots to fill the GPU; the blocks keep their sum parallel.)
inline constexpr int64_t kRmsBwdGroupQuantum = 512;
inline constexpr int64_t kRmsBwdMaxGroups = 8192;
inline constexpr int64_t kRmsBwdSumBlock = 256;

MXFLASH_HD int64_t rms_bwd_group_rows(int64_t rows) {
  const int64_t span = kRmsBwdGroupQuantum * kRmsBwdMaxGroups;
  const int64_t k = (rows + span - 1) / span;
  return kRmsBwdGroupQuantum * (k > 1 ? k : 1);
}

MXFLASH_HD float rms_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}

MXFLASH_HD float rms_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

// dx of one value: (gy - xh * m) * rstd, m = dot / C; NaN canonical (rms_canonical).
MXFLASH_HD float rms_bwd_dx(float gy, float xh, float m, float rstd) {
  return rms_canonical(rms_mul(rms_fma(-xh, m, gy), rstd));
}

MXFLASH_HD float rms_bwd_mean(float dot, int64_t cols) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(dot, float(cols));
#else
  volatile float m = dot / float(cols);
  return m;
#endif
}

}  // namespace mxflash
