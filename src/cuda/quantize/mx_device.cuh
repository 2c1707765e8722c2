// Device fast paths of the MX codecs in mx.h. Each one returns the same bytes as the mx.h rule it
// replaces, for every input; tests/gpu/test_mx_codec_gpu.cu checks that over every bit pattern.
#pragma once
#include <cstdint>

#include "mxflash/mx.h"

namespace mxflash::cuda {

// true: elements go through the hardware converter (cvt.rn.satfinite.e4m3x2.f32, two per
// instruction), equal to float_to_e4m3 for all 2^32 fp32 inputs on an H200 (test_mx_codec_gpu).
// false: mx.h's software float_to_e4m3 (same bytes, about 10x the instructions). Flip only if
// that test ever reports a difference on another architecture.
inline constexpr bool kHardwareE4m3Convert = true;

inline constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
inline constexpr uint32_t kBf16AbsMask2 = 0x7FFF7FFFu;  // |.| of two packed bf16
inline constexpr uint32_t kExpAllOnes = 0x7F800000u;    // fp32 inf; larger |bits| are NaN
inline constexpr uint32_t kE4m3MaxFinite = 0x7Eu;       // 448, what saturation gives for inf

// E8M0 scale byte of a block from the bits of its amax (non-negative, or any NaN):
// e8m0_scale_byte(amax, mode, /*zero_byte=*/0) without the division.
// RCEIL: fl(amax / 448) is a power of two only when amax = 1.75 * 2^e exactly (the quotient of a
// 24-bit mantissa by 7 rounds to 2^21 only for the mantissa 7 * 2^21), so
// ceil(log2(amax / 448)) = biased_exp(amax) - 8, plus 1 when amax's mantissa exceeds 1.75
// (0x600000): adding 0x1FFFFF carries into the exponent exactly then. Below 2^-118 the quotient is
// an fp32 subnormal: byte 1 unless it rounds to zero, i.e. amax <= 1.75 * 2^-142 (bits 0xE0).
// FLOOR: floor(log2 amax) - 8 is the biased exponent minus 8, at least 0 (subnormals give 0).
// Checked against the division for all 2^31 amax bit patterns (test_mx_codec_gpu).
inline constexpr uint32_t kRceilMantissaCarry = 0x1FFFFFu;  // 0x800000 - 0x600001
inline constexpr uint32_t kRceilZeroQuotientMax = 0xE0u;    // bits of 1.75 * 2^-142
MXFLASH_HD uint32_t scale_byte_from_amax_bits(uint32_t amax_bits, ScalingMode mode) {
  // Written without early returns so the compiler emits selects, not branches.
  const int rceil_exp = int((amax_bits + kRceilMantissaCarry) >> 23) - kFloorTargetPow2;
  const int rceil_min = amax_bits > kRceilZeroQuotientMax ? 1 : 0;
  const int rceil = rceil_exp > rceil_min ? rceil_exp : rceil_min;
  const int floor_exp = int(amax_bits >> 23) - kFloorTargetPow2;
  const int floor = floor_exp > 0 ? floor_exp : 0;
  const uint32_t byte = uint32_t(mode == ScalingMode::kRceil ? rceil : floor);
  return amax_bits >= kExpAllOnes ? uint32_t(kE8m0Nan) : byte;  // inf or NaN amax
}

// Two elements to e4m3 (saturating, round to nearest even): lo in bits 0-7, hi in bits 8-15.
// Equals float_to_e4m3 for finite inputs. Callers patch the bytes of inf and NaN inputs (which only
// occur in blocks with scale 0xFF), so the hardware's encodings of those never matter.
__device__ __forceinline__ uint32_t e4m3x2_satfinite(float lo, float hi) {
  if constexpr (kHardwareE4m3Convert) {
    uint16_t r;
    // The first source lands in the upper byte.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  } else {
    return uint32_t(float_to_e4m3(lo)) | (uint32_t(float_to_e4m3(hi)) << 8);
  }
}

// quantize_element for any x, as the CPU computes it: a NaN x keeps its sign (x86 and Arm multiply
// return the NaN operand; a GPU multiply returns the canonical positive NaN, so test x itself).
MXFLASH_HD uint32_t quantize_element_exact(float x, float inv_scale) {
  const uint32_t u = float_bits(x);
  if (is_nan_bits(u)) return ((u >> 24) & 0x80u) | kE4m3Nan;
  return float_to_e4m3(x * inv_scale, /*saturate=*/true);
}

// The e4m3 byte of an inf or NaN x for any finite scale: inf saturates to sign|448, NaN keeps
// x's sign (quantize_element_exact's result; the hardware path patches these bytes with it).
MXFLASH_HD uint32_t e4m3_nonfinite_byte(uint32_t x_bits) {
  return ((x_bits >> 24) & 0x80u) | (is_nan_bits(x_bits) ? kE4m3Nan : kE4m3MaxFinite);
}

// e8m0_inv_scale(0xFF): 2^-127 (bits 0x00400000). Scale bytes of finite blocks are at most 247,
// so among computed scales this 1/scale identifies the NaN scale.
inline constexpr uint32_t kInvScaleOfNan = 0x00400000u;

// Dequantized value with one defined NaN pattern: the payload's signed quiet NaN when the element
// is NaN, +qNaN when only the scale is (what ref::dequantize writes; see quantize_ref.cpp).
inline constexpr uint32_t kQuietNanBits = 0x7FC00000u;
MXFLASH_HD float dequantize_value(uint32_t q, uint32_t s) {
  if ((q & 0x7Fu) == kE4m3Nan) return bits_float(((q & 0x80u) << 24) | kQuietNanBits);
  if (s == kE8m0Nan) return bits_float(kQuietNanBits);
  return e4m3_to_float(uint8_t(q)) * e8m0_to_float(uint8_t(s));
}

#if defined(__CUDACC__)
// dequantize_value of 8 payload bytes (two words, byte 0 first) sharing the scale byte s. Fast path
// where no byte is NaN (low 7 bits all ones) and the scale is finite: e4m3x2 -> f16x2 and f16 -> f32
// are exact, and the product by 2^(s - 127) is the same fp32 multiply dequantize_value does.
__device__ __forceinline__ void dequantize8(uint32_t w0, uint32_t w1, uint32_t s, float (&v)[8]) {
  const uint32_t nan_bytes = (((w0 & 0x7F7F7F7Fu) + 0x01010101u) | ((w1 & 0x7F7F7F7Fu) + 0x01010101u)) & 0x80808080u;
  const uint32_t w[2] = {w0, w1};
  if (nan_bytes == 0 && s != kE8m0Nan) {
    const float scale = __uint_as_float(s != 0 ? s << 23 : 0x00400000u);  // 2^(s - 127), 2^-127 subnormal
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t h2;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(uint16_t(w[k / 2] >> (16 * (k % 2)))));
      float lo, hi;
      asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
          : "=f"(lo), "=f"(hi) : "r"(h2));
      v[2 * k] = lo * scale;
      v[2 * k + 1] = hi * scale;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = dequantize_value((w[e / 4] >> (8 * (e % 4))) & 0xFFu, s);
  }
}

// 8 values as bf16 (float_to_bf16 each), packed in order into 16 bytes.
__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
  uint32_t b[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) b[k] = uint32_t(float_to_bf16(v[2 * k])) | (uint32_t(float_to_bf16(v[2 * k + 1])) << 16);
  return make_uint4(b[0], b[1], b[2], b[3]);
}

// dequantize8 then pack_bf16x8, with the hardware's round-to-nearest-even conversion (one per pair)
// where no value can be NaN (the only inputs on which it and float_to_bf16 differ in bits).
__device__ __forceinline__ uint4 dequantize8_bf16(uint32_t w0, uint32_t w1, uint32_t s) {
  float v[8];
  dequantize8(w0, w1, s, v);
  const uint32_t nan_bytes = (((w0 & 0x7F7F7F7Fu) + 0x01010101u) | ((w1 & 0x7F7F7F7Fu) + 0x01010101u)) & 0x80808080u;
  if (nan_bytes != 0 || s == kE8m0Nan) return pack_bf16x8(v);
  uint32_t b[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b[k]) : "f"(v[2 * k + 1]), "f"(v[2 * k]));
  return make_uint4(b[0], b[1], b[2], b[3]);
}
#endif

}  // namespace mxflash::cuda
