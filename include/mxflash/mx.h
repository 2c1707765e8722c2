// MX format core: E4M3 (e4m3fn) elements, E8M0 power-of-two scales, 32-element blocks.
// Every function here is usable from host and device code, so the CPU reference and the CUDA
// kernels share one definition of each rule (REFERENCE.md §2).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MXFLASH_HD __host__ __device__ __forceinline__
#else
#define MXFLASH_HD inline
#endif

namespace mxflash {

inline constexpr int kBlockSize = 32;        // MX block: 32 elements share one E8M0 scale
inline constexpr int kHeadDim = 128;         // the only head dimension supported so far
inline constexpr int kSeqPad = 128;          // each sequence's scale rows start on a 128-row atom
inline constexpr float kE4m3Max = 448.f;     // largest finite e4m3fn magnitude
inline constexpr uint8_t kE4m3Nan = 0x7F;    // e4m3fn NaN (sign bit kept from the input)
inline constexpr uint8_t kE8m0Nan = 0xFF;
inline constexpr uint8_t kE8m0One = 127;     // biased exponent of 1.0
inline constexpr int kFloorTargetPow2 = 8;   // FLOOR: block max lands in [256, 512) * 2^e

enum class ScalingMode : int { kRceil = 0, kFloor = 1 };

// Where a 32-element block runs.
//  kHdim:     32 consecutive head-dim values of one token.
//  kSeq:      32 consecutive tokens of one sequence, one head-dim column; blocks start at the
//             sequence start, a partial last block is computed as if zero-padded.
//  kSquare32: 32 tokens x 32 head-dim values; one payload serves both contractions.
enum class Orientation : int { kHdim = 0, kSeq = 1, kSquare32 = 2 };

// Where scale bytes are stored (REFERENCE.md §3; byte formulas in jagged.h).
enum class ScaleLayout : int { kPlain = 0, kBlocked128x4 = 1 };

// Where payload bytes are stored.
//  kTokenMajor:      (T, H, 128), the interchange layout, never padded.
//  kTokenContiguous: (H, 128, P), tokens contiguous per (head, column), each sequence starting at
//                    its 128-padded offset cu_seqlens_sf[b], padding tokens zero. FP8 wgmma reads
//                    only K-major operands, so contractions over tokens (P.V, dS^T.Q, ...) need this.
//                    Valid for kSeq and kSquare32 payloads.
enum class PayloadLayout : int { kTokenMajor = 0, kTokenContiguous = 1 };

const char* to_string(ScalingMode m);
const char* to_string(Orientation o);
const char* to_string(ScaleLayout l);
const char* to_string(PayloadLayout l);

MXFLASH_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
MXFLASH_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
MXFLASH_HD bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

MXFLASH_HD float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }
// Round to nearest even; NaN stays NaN (quiet).
MXFLASH_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if (is_nan_bits(u)) return uint16_t((u >> 16) | 0x40);
  uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

// ---------------------------------------------------------------- E4M3 (e4m3fn)
// Layout s.eeee.mmm, bias 7, no infinity, 0x7F/0xFF NaN, max 448, min subnormal 2^-9.
MXFLASH_HD float e4m3_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xF;
  const uint32_t man = b & 0x7;
  if (exp == 0xF && man == 0x7) return bits_float(sign | 0x7FC00000u);
  if (exp == 0) {  // subnormal: man * 2^-9
    float v = float(man) * (1.f / 512.f);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120) << 23) | (man << 20));
}

// Float -> e4m3fn, round to nearest even. saturate=true clamps finite and infinite values to
// +-448 (what every quantizer uses: x/scale is clamped before rounding); saturate=false follows the
// plain conversion rule (magnitudes that round past 448, and infinities, become NaN), as ml_dtypes.
// NaN keeps its sign: 0x7F or 0xFF.
MXFLASH_HD uint8_t float_to_e4m3(float f, bool saturate = true) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  if (is_nan_bits(u)) return sign | kE4m3Nan;
  uint32_t a = u & 0x7FFFFFFFu;
  // 464 = 448 + half an ulp: ties round to even (448, mantissa 110), above becomes NaN.
  if (a > 0x43E80000u) return saturate ? uint8_t(sign | 0x7E) : uint8_t(sign | kE4m3Nan);
  const uint32_t exp = a >> 23;  // biased fp32 exponent
  if (exp < 121) {
    // Result is an e4m3 subnormal (or zero): value in units of 2^-9, rounded to nearest even.
    // a < 2^-6; scale by 2^9 exactly then round: units = a * 512.
    float v = bits_float(a) * 512.f;  // exact (power-of-two scaling, result >= 2^-117 or 0)
    uint32_t q = uint32_t(v);         // truncated
    float rem = v - float(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return sign | uint8_t(q);  // q == 8 encodes 2^-6, the smallest normal: bit pattern 0x08
  }
  // Normal range: keep 3 mantissa bits, round to nearest even on the 20 dropped bits.
  uint32_t man = a & 0x7FFFFFu;
  uint32_t e = exp - 120;  // e4m3 biased exponent, 1..15
  uint32_t q = (e << 3) | (man >> 20);
  uint32_t rest = man & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) ++q;  // carry may bump the exponent
  return sign | uint8_t(q);
}

// ---------------------------------------------------------------- E8M0
MXFLASH_HD float e8m0_to_float(uint8_t b) {
  if (b == kE8m0Nan) return bits_float(0x7FC00000u);
  if (b == 0) return bits_float(0x00400000u);  // 2^-127 is an fp32 subnormal
  return bits_float(uint32_t(b) << 23);
}

// Scale byte for a block whose largest magnitude is `amax` (amax >= 0 or NaN).
// RCEIL: scale = 2^ceil(log2(amax/448)), ratio computed in fp32; byte = biased exponent of the
//        ratio, +1 when the ratio has mantissa bits; capped at 254 (finite).
// FLOOR: scale = 2^(floor(log2 amax) - 8), clamped to [2^-127, 2^127].
// NaN or inf amax -> 0xFF. amax == 0 -> `zero_byte` (0 on the host path, 127 in-kernel).
MXFLASH_HD uint8_t e8m0_scale_byte(float amax, ScalingMode mode, uint8_t zero_byte = 0) {
  const uint32_t ua = float_bits(amax) & 0x7FFFFFFFu;
  if (ua >= 0x7F800000u) return kE8m0Nan;
  if (ua == 0) return zero_byte;
  if (mode == ScalingMode::kRceil) {
    const uint32_t r = float_bits(bits_float(ua) / kE4m3Max);
    uint32_t e = r >> 23;
    if (r & 0x7FFFFFu) ++e;
    return uint8_t(e > 254 ? 254 : e);
  }
  int e;
  if ((ua >> 23) == 0) {  // subnormal amax: floor(log2) = position of the leading bit - 149
    int lead = 31;
    while (!((ua >> lead) & 1u)) --lead;
    e = lead - 149 + 127;
  } else {
    e = int(ua >> 23);
  }
  e -= kFloorTargetPow2;
  return uint8_t(e < 0 ? 0 : (e > 254 ? 254 : e));
}

// 1/scale used when dividing elements: the scale is clamped to [2^-126, 2^127] (a zero block
// with byte 0 then gives zero payload; a NaN-scale block divides by 2^127).
MXFLASH_HD float e8m0_inv_scale(uint8_t b) {
  int e = int(b) - 127;
  if (e < -126) e = -126;
  if (e > 127) e = 127;
  // 2^-e for e in [-126, 127]: 2^-127 is subnormal, built from bits.
  return (e == 127) ? bits_float(0x00400000u) : bits_float(uint32_t(127 - e) << 23);
}

// Element of a block: x * (1/scale) (exact for power-of-two scales), clamp to +-448, RNE.
MXFLASH_HD uint8_t quantize_element(float x, float inv_scale) {
  return float_to_e4m3(x * inv_scale, /*saturate=*/true);
}

// An element a fused producer computed (rmsnorm_quantize's and gemm_quantize's y) in a block whose
// 1/scale is inv_scale: NaN -> 0x7F whatever its sign (CPU and GPU arithmetic give NaNs of different
// signs), else quantize_element (inf saturates to +-448).
MXFLASH_HD uint8_t quantize_produced_element(float y, float inv_scale) {
  if (is_nan_bits(float_bits(y))) return kE4m3Nan;
  return quantize_element(y, inv_scale);
}

// Decoded value of an element: e4m3 value times the block scale.
MXFLASH_HD float dequantize_element(uint8_t q, uint8_t scale) {
  return e4m3_to_float(q) * e8m0_to_float(scale);
}

// NaN-propagating |x| max, the amax every quantizer uses (fmaxf would drop NaN).
MXFLASH_HD float amax_nan(float acc, float x) {
  const float ax = bits_float(float_bits(x) & 0x7FFFFFFFu);
  if (is_nan_bits(float_bits(acc)) || is_nan_bits(float_bits(ax))) return bits_float(0x7FC00000u);
  return ax > acc ? ax : acc;
}

}  // namespace mxflash
