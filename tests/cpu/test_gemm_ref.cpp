// gemm_quantize (include/mxflash/fused.h) on CPU tensors: the re-expression rule against the spec
// codecs of mx_oracle.h, the exact path against an FP64 product of the dequantized operands, the
// coarse path against the exact one (identical bytes where every row and channel has one scale,
// close elsewhere), the non-finite rules, and argument validation (a failed Status naming the
// argument, nothing written).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/gemm_rules.h"
#include "gemm_operands.h"
#include "mx_oracle.h"
#include "mxflash/fused.h"
#include "mxflash/tensor.h"

namespace mxflash {
namespace {

constexpr uint8_t kPoison = 0xA5;

using Operand = mxtest::GemmOperand;
using mxtest::make_gemm_operand;

using Out = mxtest::GemmOutputs;
Status run(const Operand& a, const Operand& w, GemmPath path, ScalingMode mode, Out* out) {
  return mxtest::gemm_quantize_cpu(a, w, path, mode, kPoison, out);
}

double sqnr_db(const std::vector<double>& ref, const std::vector<double>& got) {
  double s = 0, e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    s += ref[i] * ref[i];
    e += (got[i] - ref[i]) * (got[i] - ref[i]);
  }
  return 10.0 * std::log10(s / e);
}

std::vector<double> dequantized(const Out& o, int64_t M, int64_t N) {
  std::vector<double> v(size_t(M * N));
  for (int64_t i = 0; i < M * N; ++i)
    v[size_t(i)] = mxtest::e4m3_value(o.payload[size_t(i)]) * mxtest::e8m0_value(o.scales[size_t(i / 32)]);
  return v;
}

// y = A W^T in FP64 from the dequantized operands.
std::vector<double> fp64_product(const Operand& a, const Operand& w) {
  std::vector<double> y(size_t(a.rows * w.rows));
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t n = 0; n < w.rows; ++n) {
      double s = 0;
      for (int64_t k = 0; k < a.k; ++k)
        s += mxtest::e4m3_value(a.payload[size_t(m * a.k + k)]) * mxtest::e8m0_value(a.scales[size_t(m * (a.k / 32) + k / 32)]) *
             mxtest::e4m3_value(w.payload[size_t(n * w.k + k)]) * mxtest::e8m0_value(w.scales[size_t(n * (w.k / 32) + k / 32)]);
      y[size_t(m * w.rows + n)] = s;
    }
  return y;
}

TEST(GemmQuantizeRules, ShiftDownIsDivisionRoundedOnTheE4m3Grid) {
  for (int b = 0; b < 256; ++b) {
    for (uint32_t d = 0; d < 40; ++d) {
      const uint8_t got = e4m3_shift_down(uint8_t(b), d);
      if ((b & 0x7F) == 0x7F) {
        EXPECT_EQ(got, b) << "NaN byte " << b << " d " << d;
        continue;
      }
      const double want_v = std::ldexp(mxtest::e4m3_value(uint8_t(b)), -int(d));
      const uint8_t want = mxtest::e4m3_encode(want_v);
      EXPECT_EQ(got, want) << "byte " << b << " d " << d;
    }
  }
}

TEST(GemmQuantizeRules, FourBytesAtOnceEqualTheByteRule) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    uint32_t w = rng();
    if (i % 3 == 0) w |= 0x70707070u;  // mostly large normals: the one-subtraction form
    const uint32_t d = i % 21;
    uint32_t want = 0;
    for (int j = 0; j < 4; ++j) want |= uint32_t(e4m3_shift_down(uint8_t(w >> (8 * j)), d)) << (8 * j);
    ASSERT_EQ(e4m3x4_shift_down(w, d), want) << std::hex << "word " << w << " d " << std::dec << d;
  }
}

TEST(GemmQuantizeRef, ExactPathIsTheFp64ProductQuantized) {
  for (ScalingMode mode : {ScalingMode::kRceil, ScalingMode::kFloor}) {
    const Operand a = make_gemm_operand(37, 96, 1, 6), w = make_gemm_operand(64, 96, 2, 6);
    Out o;
    const Status st = run(a, w, GemmPath::kExact, mode, &o);
    ASSERT_TRUE(st.ok()) << st.message();
    const std::vector<double> y = fp64_product(a, w);
    int64_t diff = 0;
    for (int64_t m = 0; m < 37; ++m)
      for (int64_t b = 0; b < 2; ++b) {
        float amax = 0;
        for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(float(y[size_t(m * 64 + b * 32 + e)])));
        const uint8_t s = mxtest::scale_byte(amax, mode);
        ASSERT_EQ(o.scales[size_t(m * 2 + b)], s) << "row " << m << " block " << b;
        for (int e = 0; e < 32; ++e) {
          const size_t i = size_t(m * 64 + b * 32 + e);
          diff += o.payload[i] != mxtest::quant_elem(float(y[i]), s);
        }
      }
    // fp64 sums in another order may round a value that sits on a rounding boundary of fp32 the
    // other way: a handful of bytes at most.
    EXPECT_LE(diff, 2) << "mode " << int(mode);
  }
}

TEST(GemmQuantizeRef, CoarseEqualsExactWhereEveryRowHasOneScale) {
  const Operand a = make_gemm_operand(50, 160, 3, 5, /*uniform_rows=*/true), w = make_gemm_operand(96, 160, 4, 5, true);
  Out exact, coarse;
  ASSERT_TRUE(run(a, w, GemmPath::kExact, ScalingMode::kRceil, &exact).ok());
  ASSERT_TRUE(run(a, w, GemmPath::kCoarse, ScalingMode::kRceil, &coarse).ok());
  EXPECT_EQ(exact.payload, coarse.payload);
  EXPECT_EQ(exact.scales, coarse.scales);
}

TEST(GemmQuantizeRef, CoarseIsCloseToExactWhenBlockScalesDiffer) {
  // Blocks of a row up to 6 binades apart: the shifted blocks lose only what falls below 2^-9 of the
  // row's scale, so the result's SQNR against FP64 matches the exact path's to a few hundredths of a dB.
  const Operand a = make_gemm_operand(64, 384, 5, 6), w = make_gemm_operand(128, 384, 6, 3);
  Out exact, coarse;
  ASSERT_TRUE(run(a, w, GemmPath::kExact, ScalingMode::kRceil, &exact).ok());
  ASSERT_TRUE(run(a, w, GemmPath::kCoarse, ScalingMode::kRceil, &coarse).ok());
  const std::vector<double> y = fp64_product(a, w);
  const double se = sqnr_db(y, dequantized(exact, 64, 128)), sc = sqnr_db(y, dequantized(coarse, 64, 128));
  EXPECT_GT(se, 28.0);
  EXPECT_NEAR(sc, se, 0.1);
  EXPECT_NE(exact.payload, coarse.payload);  // the shifts did change something
}

TEST(GemmQuantizeRef, NanScaleGivesANanRowAndChannel) {
  Operand a = make_gemm_operand(4, 64, 8, 2), w = make_gemm_operand(32, 64, 9, 2);
  a.scales[size_t(1 * 2 + 1)] = 0xFF;  // row 1, block 1
  w.scales[size_t(5 * 2 + 0)] = 0xFF;  // channel 5, block 0
  for (GemmPath path : {GemmPath::kExact, GemmPath::kCoarse}) {
    Out o;
    ASSERT_TRUE(run(a, w, path, ScalingMode::kRceil, &o).ok());
    for (int64_t n = 0; n < 32; ++n) EXPECT_EQ(o.payload[size_t(1 * 32 + n)], 0x7F) << "row 1 col " << n;
    EXPECT_EQ(o.scales[1], 0xFF);
    for (int64_t m = 0; m < 4; ++m) {
      EXPECT_EQ(o.payload[size_t(m * 32 + 5)], 0x7F) << "row " << m << " channel 5";
      EXPECT_EQ(o.scales[size_t(m)], 0xFF);
    }
  }
}

TEST(GemmQuantizeRef, BadArgumentsAreNamedAndNothingIsWritten) {
  const Operand a = make_gemm_operand(8, 64, 10, 1), w = make_gemm_operand(32, 64, 11, 1), w96 = make_gemm_operand(32, 96, 12, 1);
  std::vector<uint8_t> pay(8 * 32, kPoison), sc(8, kPoison);
  auto av = make_view(const_cast<uint8_t*>(a.payload.data()), DType::kE4M3, Device::kCPU, {8, 64});
  auto asv = make_view(const_cast<uint8_t*>(a.scales.data()), DType::kE8M0, Device::kCPU, {8, 2});
  auto wv = make_view(const_cast<uint8_t*>(w.payload.data()), DType::kE4M3, Device::kCPU, {32, 64});
  auto wsv = make_view(const_cast<uint8_t*>(w.scales.data()), DType::kE8M0, Device::kCPU, {32, 2});
  auto pv = make_view(pay.data(), DType::kE4M3, Device::kCPU, {8, 32});
  auto sv = make_view(sc.data(), DType::kE8M0, Device::kCPU, {8, 1});
  struct Bad {
    std::string expect;
    Status st;
  };
  GemmQuantizeOptions opt;
  GemmQuantizeOptions bad_mode;
  bad_mode.mode = ScalingMode(5);
  GemmQuantizeOptions bad_path;
  bad_path.path = GemmPath(9);
  std::vector<Bad> cases;
  cases.push_back({"mode", gemm_quantize(av, asv, wv, wsv, bad_mode, pv, sv)});
  cases.push_back({"path", gemm_quantize(av, asv, wv, wsv, bad_path, pv, sv)});
  cases.push_back({"a:", gemm_quantize(make_view(const_cast<uint8_t*>(a.payload.data()), DType::kFloat32, Device::kCPU, {8, 16}),
                                       asv, wv, wsv, opt, pv, sv)});
  cases.push_back({"a:", gemm_quantize(make_view(const_cast<uint8_t*>(a.payload.data()), DType::kE4M3, Device::kCPU, {16, 64}),
                                       make_view(const_cast<uint8_t*>(a.scales.data()), DType::kE8M0, Device::kCPU, {16, 2}),
                                       wv, wsv, opt, pv, sv)});  // M 16 against the outputs' 8: payload
  cases.back().expect = "payload";
  cases.push_back({"a:", gemm_quantize(make_view(const_cast<uint8_t*>(a.payload.data()), DType::kE4M3, Device::kCPU, {32, 16}),
                                       asv, wv, wsv, opt, pv, sv)});  // K 16
  cases.push_back({"a_scales", gemm_quantize(av, make_view(const_cast<uint8_t*>(a.scales.data()), DType::kE8M0, Device::kCPU, {8, 1}),
                                             wv, wsv, opt, pv, sv)});
  cases.push_back({"w:", gemm_quantize(av, asv, make_view(const_cast<uint8_t*>(w96.payload.data()), DType::kE4M3, Device::kCPU, {32, 96}),
                                       make_view(const_cast<uint8_t*>(w96.scales.data()), DType::kE8M0, Device::kCPU, {32, 3}),
                                       opt, pv, sv)});  // K differs from a's
  cases.push_back({"w:", gemm_quantize(av, asv, make_view(const_cast<uint8_t*>(w.payload.data()), DType::kE4M3, Device::kCPU, {16, 64}),
                                       make_view(const_cast<uint8_t*>(w.scales.data()), DType::kE8M0, Device::kCPU, {16, 2}),
                                       opt, pv, sv)});  // N 16
  cases.push_back({"w_scales", gemm_quantize(av, asv, wv, make_view(const_cast<uint8_t*>(w.scales.data()), DType::kBFloat16, Device::kCPU, {32, 1}),
                                             opt, pv, sv)});
  cases.push_back({"scales", gemm_quantize(av, asv, wv, wsv, opt, pv, make_view(sc.data(), DType::kE8M0, Device::kCPU, {8, 2}))});
  TensorView on_gpu = pv;
  on_gpu.device = Device::kCUDA;
  cases.push_back({"payload", gemm_quantize(av, asv, wv, wsv, opt, on_gpu, sv)});
  for (const Bad& b : cases) {
    EXPECT_FALSE(b.st.ok()) << b.expect;
    EXPECT_NE(b.st.message().find(b.expect), std::string::npos) << "want '" << b.expect << "' in: " << b.st.message();
  }
  for (uint8_t v : pay) ASSERT_EQ(v, kPoison);
  for (uint8_t v : sc) ASSERT_EQ(v, kPoison);
}

}  // namespace
}  // namespace mxflash
