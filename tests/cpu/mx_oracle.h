// Test oracle: an independent statement of the MX rules (REFERENCE.md §2-3), written from the
// spec with double-precision arithmetic and frexp/ldexp/nearbyint instead of the bit manipulation
// in mx.h, so a mistake in the library and one here are unlikely to coincide. Nothing here calls
// mxflash code except for types.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mxflash/jagged.h"
#include "mxflash/mx.h"

namespace mxtest {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------- E4M3 (e4m3fn)
// s.eeee.mmm, bias 7: normal (1 + m/8) 2^(e-7), subnormal m 2^-9, 0x7F/0xFF NaN, no infinity.
inline double e4m3_value(uint8_t b) {
  const bool neg = b & 0x80;
  const int e = (b >> 3) & 0xF, m = b & 0x7;
  if (e == 0xF && m == 0x7) return neg ? -std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(double(8 + m), e - 10);
  return neg ? -mag : mag;
}

// Round-to-nearest-even encode. |y| > 464 (half an ulp above 448) and infinities go to 448
// (saturate) or NaN; NaN keeps its sign.
inline uint8_t e4m3_encode(double y, bool saturate = true) {
  const uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  if (std::isnan(y)) return sign | 0x7F;
  const double a = std::fabs(y);
  if (a > 464.0) return sign | (saturate ? 0x7E : 0x7F);
  if (a < std::ldexp(1.0, -6)) return sign | uint8_t(std::nearbyint(a * 512.0));  // units of 2^-9
  int e;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): unbiased exponent e - 1
  const int E = e - 1;
  const int q = int(std::nearbyint(std::ldexp(a, 3 - E)));  // 8..16 (16 = carry into next binade)
  return sign | uint8_t(((E + 7) << 3) + (q - 8));
}

// ---------------------------------------------------------------- E8M0
inline double e8m0_value(uint8_t b) {
  return b == 0xFF ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, int(b) - 127);
}

// RCEIL: ratio = amax / 448 rounded to fp32 (the spec computes it in FP32); byte = ceil(log2 ratio)
// + 127. A nonzero ratio below 2^-126 is an fp32 subnormal whose biased exponent is 0 and which has
// mantissa bits, so the spec's byte rule gives 1 (scale 2^-126, the same divisor the quantizer
// uses), not the 0 that ceil(log2) would give for ratio <= 2^-127. A ratio that underflows to 0 gives 0.
inline uint8_t rceil_byte(float amax, uint8_t zero_byte = 0) {
  if (std::isnan(amax) || std::isinf(amax)) return 0xFF;
  if (amax == 0.f) return zero_byte;
  const float ratio = std::fabs(amax) / 448.f;
  if (ratio == 0.f) return 0;
  int e;
  const double m = std::frexp(double(ratio), &e);  // ratio = m 2^e, m in [0.5, 1)
  const int c = (m == 0.5) ? e - 1 : e;            // ceil(log2 ratio), exact
  return uint8_t(std::clamp(c + 127, 1, 254));
}

// FLOOR: byte = floor(log2 amax) - 8 + 127, clamped to [0, 254].
inline uint8_t floor_byte(float amax, uint8_t zero_byte = 0) {
  if (std::isnan(amax) || std::isinf(amax)) return 0xFF;
  if (amax == 0.f) return zero_byte;
  int e;
  std::frexp(double(std::fabs(amax)), &e);  // floor(log2 amax) = e - 1 (double keeps fp32 subnormals normal)
  return uint8_t(std::clamp(e - 1 - 8 + 127, 0, 254));
}

inline uint8_t scale_byte(float amax, mxflash::ScalingMode mode) {
  return mode == mxflash::ScalingMode::kRceil ? rceil_byte(amax) : floor_byte(amax);
}

// The divisor the host quantizer uses: the scale clamped to [2^-126, 2^127].
inline double divisor(uint8_t b) { return std::ldexp(1.0, std::clamp(int(b) - 127, -126, 127)); }

inline uint8_t quant_elem(float x, uint8_t scale) { return e4m3_encode(double(x) / divisor(scale), true); }

// Block amax: max |x|, any NaN makes it NaN.
inline float block_amax(const float* v, int n, int stride = 1) {
  float a = 0.f;
  for (int i = 0; i < n; ++i) {
    const float x = v[i * stride];
    if (std::isnan(x)) return std::numeric_limits<float>::quiet_NaN();
    a = std::max(a, std::fabs(x));
  }
  return a;
}

// bf16 -> fp32 is a 16-bit shift.
inline float bf16_value(uint16_t h) { return float_of(uint32_t(h) << 16); }

// fp32 of a double that is exact in fp32 unless it overflows (a short binary fraction): +-inf
// past the fp32 range (a plain cast of an out-of-range double is undefined).
inline float float_of_exact(double v) {
  if (std::fabs(v) >= std::ldexp(1.0, 128)) return v > 0 ? std::numeric_limits<float>::infinity()
                                                          : -std::numeric_limits<float>::infinity();
  return float(v);
}

// Nearest bf16 (RNE) of a finite double that is a short binary fraction (e4m3 value times a power
// of two): exact in bf16's normal range (4 significant bits <= 8), rounded in its subnormal range
// (multiples of 2^-133), overflow to inf.
inline uint16_t bf16_of_exact(double v) {
  if (std::isnan(v)) return 0;  // callers handle NaN separately
  float f;
  if (std::fabs(v) < std::ldexp(1.0, -126))
    f = float(std::ldexp(std::nearbyint(std::ldexp(v, 133)), -133));
  else
    f = float_of_exact(v);
  if (f == 0.f && std::signbit(v)) f = -0.f;
  return uint16_t(bits_of(f) >> 16);
}

// ---------------------------------------------------------------- layouts (REFERENCE.md §3)
// Blocked 128x4 atom address of hdim-style scales: R = h P + tp.
inline int64_t ref_hdim_blocked(int64_t h, int64_t tp, int64_t k, int64_t P) {
  const int64_t R = h * P + tp;
  return 512 * (R / 128) + 16 * (R % 32) + 4 * ((R % 128) / 32) + k;
}
// seq scales: atom h P/128 + g/4, row d, column g mod 4.
inline int64_t ref_seq_blocked(int64_t h, int64_t d, int64_t g, int64_t P) {
  return 512 * (h * (P / 128) + g / 4) + 16 * (d % 32) + 4 * (d / 32) + (g % 4);
}

// ---------------------------------------------------------------- random helpers
inline float random_finite_float(std::mt19937_64& rng) {
  for (;;) {
    const float f = float_of(uint32_t(rng()));
    if (std::isfinite(f)) return f;
  }
}

// Compares byte arrays; on mismatch reports the count and the first few positions.
inline std::string diff_bytes(const std::vector<uint8_t>& want, const uint8_t* got, size_t n) {
  if (want.size() != n) return "size mismatch: want " + std::to_string(want.size()) + " got " + std::to_string(n);
  size_t bad = 0;
  std::string first;
  for (size_t i = 0; i < n; ++i) {
    if (want[i] == got[i]) continue;
    if (bad < 5)
      first += " [" + std::to_string(i) + "] want " + std::to_string(want[i]) + " got " + std::to_string(got[i]) + ";";
    ++bad;
  }
  if (!bad) return "";
  return std::to_string(bad) + " of " + std::to_string(n) + " bytes differ:" + first;
}

}  // namespace mxtest
