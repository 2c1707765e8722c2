// E4M3 / E8M0 codecs, scale-byte rules and amax of mx.h against the independent oracle
// (mx_oracle.h) and against hand-checked values from REFERENCE.md §2.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>

#include "mx_oracle.h"
#include "mxflash/mx.h"

namespace mxflash {
namespace {

using mxtest::bits_of;
using mxtest::float_of;

constexpr float kInf = std::numeric_limits<float>::infinity();
float pow2f(int e) { return float(std::ldexp(1.0, e)); }

// ---------------------------------------------------------------- E4M3 decode

TEST(E4m3, DecodeAllBytesMatchesFormula) {
  for (int b = 0; b < 256; ++b) {
    const float got = e4m3_to_float(uint8_t(b));
    const double want = mxtest::e4m3_value(uint8_t(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "byte " << b;
      EXPECT_EQ(std::signbit(got), bool(b & 0x80)) << "byte " << b;
    } else {
      EXPECT_EQ(double(got), want) << "byte " << b;
      EXPECT_EQ(std::signbit(got), bool(b & 0x80)) << "byte " << b;
    }
  }
  // Hand-checked anchors.
  EXPECT_EQ(e4m3_to_float(0x7E), 448.f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.f);
  EXPECT_EQ(e4m3_to_float(0x08), pow2f(-6));   // smallest normal
  EXPECT_EQ(e4m3_to_float(0x07), 7 * pow2f(-9));  // largest subnormal
  EXPECT_EQ(e4m3_to_float(0x01), pow2f(-9));   // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x77), 240.f);
  EXPECT_EQ(e4m3_to_float(0x78), 256.f);
  EXPECT_EQ(bits_of(e4m3_to_float(0x80)), 0x80000000u);  // -0
  EXPECT_EQ(bits_of(e4m3_to_float(0x00)), 0u);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

// The positive finite values are monotone in the byte: byte i is the i-th smallest (0..0x7E).
TEST(E4m3, PositiveValuesAreMonotoneInByte) {
  for (int b = 0; b < 0x7E; ++b) EXPECT_LT(e4m3_to_float(uint8_t(b)), e4m3_to_float(uint8_t(b + 1))) << b;
}

// ---------------------------------------------------------------- E4M3 encode

TEST(E4m3, EncodeOfDecodeIsIdentity) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    const float v = e4m3_to_float(uint8_t(b));
    EXPECT_EQ(float_to_e4m3(v, true), b) << "byte " << b;
    EXPECT_EQ(float_to_e4m3(v, false), b) << "byte " << b;
    EXPECT_EQ(mxtest::e4m3_encode(v, true), b) << "oracle, byte " << b;
  }
}

// Midpoints between every pair of adjacent e4m3 values round to the even byte (mantissa LSB 0);
// one fp32 ulp either side rounds to the nearer value. Both signs, both saturation modes.
TEST(E4m3, TiesToEvenAtEveryMidpoint) {
  for (int b = 0; b < 0x7E; ++b) {
    const double lo = mxtest::e4m3_value(uint8_t(b)), hi = mxtest::e4m3_value(uint8_t(b + 1));
    const float mid = float((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2) << "midpoint not exact in fp32";
    const uint8_t even = (b % 2 == 0) ? uint8_t(b) : uint8_t(b + 1);
    for (bool sat : {true, false}) {
      EXPECT_EQ(float_to_e4m3(mid, sat), even) << "mid of " << b << "," << b + 1;
      EXPECT_EQ(float_to_e4m3(-mid, sat), 0x80 | even) << "-mid of " << b << "," << b + 1;
      EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 0.f), sat), b) << b;
      EXPECT_EQ(float_to_e4m3(std::nextafter(mid, kInf), sat), b + 1) << b;
      EXPECT_EQ(float_to_e4m3(-std::nextafter(mid, 0.f), sat), 0x80 | b) << b;
      EXPECT_EQ(float_to_e4m3(-std::nextafter(mid, kInf), sat), 0x80 | (b + 1)) << b;
    }
    EXPECT_EQ(mxtest::e4m3_encode(mid), even) << "oracle, mid of " << b;
  }
}

TEST(E4m3, Subnormals) {
  const float u = pow2f(-9);  // one subnormal step
  EXPECT_EQ(float_to_e4m3(u), 0x01);
  EXPECT_EQ(float_to_e4m3(pow2f(-10)), 0x00);       // 0.5 step: tie to even 0
  EXPECT_EQ(float_to_e4m3(3 * pow2f(-10)), 0x02);   // 1.5 steps -> 2
  EXPECT_EQ(float_to_e4m3(5 * pow2f(-10)), 0x02);   // 2.5 -> 2
  EXPECT_EQ(float_to_e4m3(7 * pow2f(-10)), 0x04);   // 3.5 -> 4
  EXPECT_EQ(float_to_e4m3(13 * pow2f(-10)), 0x06);  // 6.5 -> 6
  EXPECT_EQ(float_to_e4m3(15 * pow2f(-10)), 0x08);  // 7.5 -> 8 = 2^-6, the smallest normal
  EXPECT_EQ(float_to_e4m3(std::nextafter(pow2f(-10), 1.f)), 0x01);
  EXPECT_EQ(float_to_e4m3(pow2f(-11)), 0x00);
  EXPECT_EQ(float_to_e4m3(6 * u), 0x06);
  EXPECT_EQ(float_to_e4m3(-3 * pow2f(-10)), 0x82);
  EXPECT_EQ(float_to_e4m3(-pow2f(-10)), 0x80);
  // fp32 subnormal inputs
  EXPECT_EQ(float_to_e4m3(float_of(1)), 0x00);
  EXPECT_EQ(float_to_e4m3(float_of(0x007FFFFF)), 0x00);
  EXPECT_EQ(float_to_e4m3(float_of(0x80000001)), 0x80);
}

TEST(E4m3, ZerosAndTinyNegatives) {
  EXPECT_EQ(float_to_e4m3(0.f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.f), 0x80);
  EXPECT_EQ(float_to_e4m3(-0.f, false), 0x80);
  for (float t : {1e-30f, 1e-5f, pow2f(-11), pow2f(-10), FLT_MIN, float_of(1)}) {
    EXPECT_EQ(float_to_e4m3(-t), 0x80) << t;
    EXPECT_EQ(float_to_e4m3(t), 0x00) << t;
  }
}

TEST(E4m3, SaturationAndNaN) {
  for (bool sat : {true, false}) {
    EXPECT_EQ(float_to_e4m3(448.f, sat), 0x7E);
    EXPECT_EQ(float_to_e4m3(-448.f, sat), 0xFE);
    EXPECT_EQ(float_to_e4m3(449.f, sat), 0x7E);
    EXPECT_EQ(float_to_e4m3(463.99f, sat), 0x7E);
    EXPECT_EQ(float_to_e4m3(464.f, sat), 0x7E);  // tie between 448 (even) and 480 (not e4m3fn)
    EXPECT_EQ(float_to_e4m3(-464.f, sat), 0xFE);
  }
  const float above = std::nextafter(464.f, kInf);
  for (float v : {above, 480.f, 1000.f, 1e30f, FLT_MAX, kInf}) {
    EXPECT_EQ(float_to_e4m3(v, true), 0x7E) << v;
    EXPECT_EQ(float_to_e4m3(-v, true), 0xFE) << v;
    EXPECT_EQ(float_to_e4m3(v, false), 0x7F) << v;
    EXPECT_EQ(float_to_e4m3(-v, false), 0xFF) << v;
  }
  // NaN keeps its sign, quiet or signalling, any payload.
  for (bool sat : {true, false}) {
    EXPECT_EQ(float_to_e4m3(float_of(0x7FC00000), sat), 0x7F);
    EXPECT_EQ(float_to_e4m3(float_of(0xFFC00000), sat), 0xFF);
    EXPECT_EQ(float_to_e4m3(float_of(0x7F800001), sat), 0x7F);
    EXPECT_EQ(float_to_e4m3(float_of(0xFF800001), sat), 0xFF);
    EXPECT_EQ(float_to_e4m3(float_of(0xFFFFFFFF), sat), 0xFF);
    EXPECT_EQ(float_to_e4m3(float_of(0x7FFFFFFF), sat), 0x7F);
  }
}

TEST(E4m3, CarryIntoNextBinade) {
  EXPECT_EQ(float_to_e4m3(250.f), 0x78);  // 240 < 250 < 256, nearer 256: exponent bumps
  EXPECT_EQ(float_to_e4m3(248.f), 0x78);  // tie 240 (0x77, odd) / 256 (0x78, even)
  EXPECT_EQ(float_to_e4m3(std::nextafter(248.f, 0.f)), 0x77);
  EXPECT_EQ(float_to_e4m3(1.9375f), 0x40);  // tie 1.875 (0x3F) / 2 (0x40)
  EXPECT_EQ(float_to_e4m3(pow2f(-6) - pow2f(-10)), 0x08);  // tie 7*2^-9 / 2^-6 across the subnormal edge
}

// The oracle encoder itself against a brute-force nearest search (keeps the oracle honest).
TEST(E4m3, OracleMatchesBruteForceNearest) {
  std::vector<double> vals;
  for (int b = 0; b <= 0x7E; ++b) vals.push_back(mxtest::e4m3_value(uint8_t(b)));
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> ex(-14, 9.5);
  for (int i = 0; i < 200000; ++i) {
    const double a = double(float(std::exp2(ex(rng))));
    int best = 0;
    for (int b = 1; b <= 0x7E; ++b) {
      const double db = std::fabs(vals[b] - a), dbest = std::fabs(vals[best] - a);
      if (db < dbest || (db == dbest && b % 2 == 0)) best = b;
    }
    if (a > 464) best = 0x7E;
    ASSERT_EQ(mxtest::e4m3_encode(a), best) << a;
  }
}

// Random fp32 bit patterns (every magnitude, subnormals, NaN, inf) against the oracle.
TEST(E4m3, RandomFloatsMatchOracle) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = uint32_t(rng());
    if (i & 1) u = (u & 0x80000000u) | (0x3C000000u + (u & 0x07FFFFFFu));  // |x| near e4m3 range
    const float f = float_of(u);
    ASSERT_EQ(float_to_e4m3(f, true), mxtest::e4m3_encode(f, true)) << std::hex << u;
    ASSERT_EQ(float_to_e4m3(f, false), mxtest::e4m3_encode(f, false)) << std::hex << u;
  }
}

// ---------------------------------------------------------------- E8M0

TEST(E8m0, DecodeAllBytes) {
  EXPECT_EQ(bits_of(e8m0_to_float(0)), 0x00400000u);  // 2^-127, an fp32 subnormal
  EXPECT_EQ(e8m0_to_float(127), 1.f);
  EXPECT_EQ(e8m0_to_float(254), pow2f(127));
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
  for (int b = 0; b < 255; ++b) EXPECT_EQ(double(e8m0_to_float(uint8_t(b))), std::ldexp(1.0, b - 127)) << b;
}

TEST(E8m0, InvScaleIsClampedReciprocal) {
  for (int b = 0; b < 256; ++b)
    EXPECT_EQ(double(e8m0_inv_scale(uint8_t(b))), 1.0 / mxtest::divisor(uint8_t(b))) << b;
  EXPECT_EQ(e8m0_inv_scale(0), pow2f(126));  // byte 0 divides by 2^-126
  EXPECT_EQ(e8m0_inv_scale(1), pow2f(126));
  EXPECT_EQ(e8m0_inv_scale(127), 1.f);
  EXPECT_EQ(e8m0_inv_scale(128), 0.5f);
  EXPECT_EQ(bits_of(e8m0_inv_scale(254)), 0x00400000u);  // 2^-127
  EXPECT_EQ(bits_of(e8m0_inv_scale(255)), 0x00400000u);
}

TEST(E8m0, SpecialAmax) {
  for (ScalingMode m : {ScalingMode::kRceil, ScalingMode::kFloor}) {
    EXPECT_EQ(e8m0_scale_byte(0.f, m), 0);
    EXPECT_EQ(e8m0_scale_byte(0.f, m, 127), 127);
    EXPECT_EQ(e8m0_scale_byte(-0.f, m, 127), 127);
    EXPECT_EQ(e8m0_scale_byte(kInf, m), 0xFF);
    EXPECT_EQ(e8m0_scale_byte(kInf, m, 127), 0xFF);
    EXPECT_EQ(e8m0_scale_byte(std::numeric_limits<float>::quiet_NaN(), m), 0xFF);
    EXPECT_EQ(e8m0_scale_byte(float_of(0xFFC00000), m), 0xFF);
    EXPECT_EQ(e8m0_scale_byte(float_of(0x7F800001), m), 0xFF);
  }
}

// amax = 448 * 2^k: ratio is exactly 2^k, byte 127 + k; the next float up has mantissa bits: +1.
TEST(E8m0, RceilPowerOfTwoEdges) {
  for (int k = -126; k <= 119; ++k) {
    const float amax = float(std::ldexp(448.0, k));
    ASSERT_EQ(double(amax), std::ldexp(448.0, k));
    EXPECT_EQ(e8m0_scale_byte(amax, ScalingMode::kRceil), 127 + k) << "k=" << k;
    EXPECT_EQ(e8m0_scale_byte(std::nextafter(amax, kInf), ScalingMode::kRceil), 128 + k) << "k=" << k;
    EXPECT_EQ(e8m0_scale_byte(std::nextafter(amax, 0.f), ScalingMode::kRceil), 127 + k) << "k=" << k;
  }
  EXPECT_EQ(e8m0_scale_byte(448.f, ScalingMode::kRceil), 127);
  EXPECT_EQ(e8m0_scale_byte(449.f, ScalingMode::kRceil), 128);
  EXPECT_EQ(e8m0_scale_byte(1.f, ScalingMode::kRceil), 127 - 8);  // 1/448 in (2^-9, 2^-8]
  EXPECT_EQ(e8m0_scale_byte(FLT_MAX, ScalingMode::kRceil), 247);  // ~2^119.2
}

// A nonzero ratio below 2^-126 is an fp32 subnormal: the spec's bit rule ("biased exponent, +1 if
// mantissa bits") gives byte 1 (scale 2^-126, consistent with the 2^-126 divisor), never 0, even
// where ceil(log2) alone would give 2^-127 or less. A ratio that underflows to zero gives 0.
TEST(E8m0, RceilSubnormalRatio) {
  EXPECT_EQ(e8m0_scale_byte(float(std::ldexp(448.0, -127)), ScalingMode::kRceil), 1);  // ratio 2^-127
  EXPECT_EQ(e8m0_scale_byte(float(std::ldexp(448.0, -134)), ScalingMode::kRceil), 1);
  EXPECT_EQ(e8m0_scale_byte(FLT_MIN, ScalingMode::kRceil), 1);
  EXPECT_EQ(e8m0_scale_byte(float_of(0x00001000), ScalingMode::kRceil), 1);  // subnormal amax
  // amax = 2^-149: 2^-149/448 < 2^-150 rounds to 0 in fp32.
  EXPECT_EQ(e8m0_scale_byte(float_of(1), ScalingMode::kRceil), 0);
  EXPECT_EQ(e8m0_scale_byte(float_of(1), ScalingMode::kRceil, 127), 0);
}

// ~1e6 amax log-uniform over all positive finite fp32 (uniform bit patterns: every binade and the
// subnormals), plus an extra subnormal-only sample: byte equals the oracle and brackets the ratio.
TEST(E8m0, RceilRandomMatchesOracleAndBracketsRatio) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = 1 + uint32_t(rng() % 0x7F7FFFFFu);           // (0, FLT_MAX]
    if (i % 8 == 0) u = 1 + uint32_t(rng() % 0x007FFFFFu);     // subnormal amax
    const float amax = float_of(u);
    const uint8_t b = e8m0_scale_byte(amax, ScalingMode::kRceil);
    ASSERT_EQ(b, mxtest::rceil_byte(amax)) << std::hex << u;
    const float ratio = amax / 448.f;
    ASSERT_GE(double(e8m0_to_float(b)), double(ratio)) << std::hex << u;
    // Minimal scale, except where the byte rule floors subnormal ratios at byte 1 (see above).
    if (b >= 2 || double(ratio) > std::ldexp(1.0, -127)) {
      ASSERT_LT(double(e8m0_to_float(uint8_t(b - 1))), double(ratio)) << std::hex << u;
    }
    // The block max then never exceeds 448 after division (RCEIL never clips).
    ASSERT_LE(double(amax) / mxtest::divisor(b), 448.0) << std::hex << u;
  }
}

TEST(E8m0, FloorRandomMatchesOracle) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = 1 + uint32_t(rng() % 0x7F7FFFFFu);
    if (i % 8 == 0) u = 1 + uint32_t(rng() % 0x007FFFFFu);
    const float amax = float_of(u);
    const uint8_t b = e8m0_scale_byte(amax, ScalingMode::kFloor);
    ASSERT_EQ(b, mxtest::floor_byte(amax)) << std::hex << u;
    int e;
    std::frexp(double(amax), &e);
    const int unclamped = e - 1 - 8 + 127;
    if (unclamped >= 0) {
      // block max lands in [256, 512) * scale
      const double r = double(amax) / mxtest::e8m0_value(b);
      ASSERT_GE(r, 256.0) << std::hex << u;
      ASSERT_LT(r, 512.0) << std::hex << u;
    } else {
      ASSERT_EQ(b, 0) << std::hex << u;
    }
  }
}

TEST(E8m0, FloorEdges) {
  EXPECT_EQ(e8m0_scale_byte(256.f, ScalingMode::kFloor), 127);
  EXPECT_EQ(e8m0_scale_byte(500.f, ScalingMode::kFloor), 127);
  EXPECT_EQ(e8m0_scale_byte(std::nextafter(512.f, 0.f), ScalingMode::kFloor), 127);
  EXPECT_EQ(e8m0_scale_byte(512.f, ScalingMode::kFloor), 128);
  EXPECT_EQ(e8m0_scale_byte(std::nextafter(256.f, 0.f), ScalingMode::kFloor), 126);
  EXPECT_EQ(e8m0_scale_byte(1.f, ScalingMode::kFloor), 119);
  for (int j = -149; j <= 127; ++j) {
    const float a = pow2f(j);
    const int want = std::clamp(j - 8 + 127, 0, 254);
    EXPECT_EQ(e8m0_scale_byte(a, ScalingMode::kFloor), want) << j;
    if (j > -149) {
      EXPECT_EQ(e8m0_scale_byte(std::nextafter(a, 0.f), ScalingMode::kFloor), std::max(0, want - 1)) << j;
    }
  }
  EXPECT_EQ(e8m0_scale_byte(FLT_MAX, ScalingMode::kFloor), 127 - 8 + 127);
  EXPECT_EQ(e8m0_scale_byte(pow2f(-119), ScalingMode::kFloor), 0);  // lowest unclamped
  EXPECT_EQ(e8m0_scale_byte(pow2f(-120), ScalingMode::kFloor), 0);  // clamped
}

// STYLE.md §5's exact-value block: block max 500.
TEST(MxBlock, Max500FloorClipsRceilRoundsTo256) {
  // FLOOR: floor(log2 500) = 8, 8 - 8 = 0 -> scale 2^0 (byte 127); 500 > 448 clips to 448.
  const uint8_t fb = e8m0_scale_byte(500.f, ScalingMode::kFloor);
  EXPECT_EQ(fb, 127);
  EXPECT_EQ(quantize_element(500.f, e8m0_inv_scale(fb)), 0x7E);
  EXPECT_EQ(dequantize_element(0x7E, fb), 448.f);
  // RCEIL: 500/448 = 1.116 -> ceil(log2) = 1 -> scale 2 (byte 128); 500/2 = 250 -> e4m3 256.
  const uint8_t rb = e8m0_scale_byte(500.f, ScalingMode::kRceil);
  EXPECT_EQ(rb, 128);
  EXPECT_EQ(e8m0_to_float(rb), 2.f);
  EXPECT_EQ(quantize_element(500.f, e8m0_inv_scale(rb)), 0x78);
  EXPECT_EQ(dequantize_element(0x78, rb), 512.f);
  EXPECT_EQ(quantize_element(-1.f, e8m0_inv_scale(rb)), 0xB0);  // -0.5
}

TEST(MxBlock, QuantizeElementIsScaledEncode) {
  std::mt19937_64 rng(4);
  for (int i = 0; i < 200000; ++i) {
    const float x = mxtest::random_finite_float(rng);
    const uint8_t b = uint8_t(rng());
    ASSERT_EQ(quantize_element(x, e8m0_inv_scale(b)), mxtest::quant_elem(x, b)) << x << " byte " << int(b);
  }
}

// ---------------------------------------------------------------- amax

TEST(Amax, NanPropagatesAbsTaken) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(amax_nan(0.f, -3.f), 3.f);
  EXPECT_EQ(amax_nan(5.f, -3.f), 5.f);
  EXPECT_EQ(amax_nan(5.f, -7.f), 7.f);
  EXPECT_EQ(amax_nan(0.f, -kInf), kInf);
  EXPECT_EQ(bits_of(amax_nan(0.f, -0.f)), 0u);
  EXPECT_TRUE(std::isnan(amax_nan(0.f, nan)));
  EXPECT_TRUE(std::isnan(amax_nan(nan, 1.f)));
  EXPECT_TRUE(std::isnan(amax_nan(kInf, float_of(0xFFC00000))));
  EXPECT_TRUE(std::isnan(amax_nan(0.f, float_of(0x7F800001))));  // signalling NaN too
  // A NaN anywhere in a fold survives later finite values.
  const float xs[] = {1.f, nan, 1000.f, -2.f};
  float a = 0.f;
  for (float x : xs) a = amax_nan(a, x);
  EXPECT_TRUE(std::isnan(a));
  EXPECT_EQ(bits_of(amax_nan(0.f, float_of(0x80000001))), 1u);  // |negative subnormal|
}

// ---------------------------------------------------------------- bf16 helpers

TEST(Bf16, RoundTripAndRounding) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_float(uint16_t(h));
    EXPECT_EQ(bits_of(f), h << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(float_to_bf16(f), h);
    }
  }
  EXPECT_EQ(float_to_bf16(float_of(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(float_to_bf16(float_of(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(float_of(0x3F808001)), 0x3F81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(float_of(0x7F800001)))));  // sNaN stays NaN
}

}  // namespace
}  // namespace mxflash
