// Re-expression of e4m3 bytes against a coarser power-of-two scale on the GPU, in f16x2 arithmetic:
// the forward's prepare pass (cuda/attention/attention_fwd_prepare.cuh), the backward's operand
// re-expression and gemm_quantize's A tiles. The rule is mx.h's (the byte's value times 2^-shift,
// rounded to nearest even); tests/gpu/test_prepare_shift_gpu.cu checks every byte and shift.
#pragma once
#include <cstdint>

namespace mxflash::cuda {

// Four e4m3 bytes (one 32-bit word), each shifted down by `shift` bits (>= 0) and rounded to
// nearest even, in the f16x2 domain: e4m3x2 -> f16x2 is exact; the multiply by 2^-shift is exact
// for every product that can round to a nonzero e4m3 (such a product is >= 2^-10 with at most 4
// significant bits, so its lowest bit is >= 2^-13, far above f16's 2^-24; a product that f16 must
// round is below 2^-20 and becomes +-0 in e4m3 either way, as it does when 2^-shift itself is
// below f16's range); the conversion back rounds once. NaN stays NaN. 3 instructions per byte
// pair (the f32 form took 8).
// 2^-shift (shift >= 0) as f16x2 (subnormal from 2^-15 down to 2^-24, 0 beyond): the factor of
// e4m3x4_times_f16x2 for shift_e4m3x4.
__device__ __forceinline__ uint32_t f16x2_pow2_neg(int shift) {
  const uint32_t m = shift > 24 ? 0u : (shift <= 14 ? uint32_t(15 - shift) << 10 : 1u << (24 - shift));
  return m | (m << 16);
}
// Four e4m3 bytes times the f16x2 factor m2 (a power of two <= 1 in both halves), rounded once.
__device__ __forceinline__ uint32_t e4m3x4_times_f16x2(uint32_t word, uint32_t m2) {
  uint32_t out = 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(uint16_t(word >> (16 * half))));
    asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(h2) : "r"(m2));
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(h2));
    out |= uint32_t(r) << (16 * half);
  }
  return out;
}
__device__ __forceinline__ uint32_t shift_e4m3x4(uint32_t word, int shift) {
  if (shift == 0) return word;
  return e4m3x4_times_f16x2(word, f16x2_pow2_neg(shift));
}

}  // namespace mxflash::cuda
