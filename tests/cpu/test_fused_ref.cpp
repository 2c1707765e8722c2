// rmsnorm_quantize (include/mxflash/fused.h) on CPU tensors: the normalization against FP64, the
// quantization against the oracle codecs of mx_oracle.h (written from the spec, not mx.h), the
// non-finite rules, and argument validation (a failed Status naming the argument, nothing written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mx_oracle.h"
#include "mxflash/fused.h"
#include "mxflash/tensor.h"

namespace mxflash {
namespace {

constexpr uint8_t kPoison = 0xA5;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Case {
  int64_t T = 0, C = 0;
  bool x_bf16 = true, has_weight = true, w_bf16 = false;
  std::vector<float> x, w;  // values as the operation sees them (bf16-exact when bf16)
  std::vector<uint16_t> xb, wb;
  std::vector<float> xf, wf;
  std::vector<uint8_t> payload, scales;
  std::vector<float> rstd;

  TensorView xv() {
    return x_bf16 ? make_view(xb.data(), DType::kBFloat16, Device::kCPU, {T, C})
                  : make_view(xf.data(), DType::kFloat32, Device::kCPU, {T, C});
  }
  TensorView wv() {
    if (!has_weight) return TensorView{};
    return w_bf16 ? make_view(wb.data(), DType::kBFloat16, Device::kCPU, {C})
                  : make_view(wf.data(), DType::kFloat32, Device::kCPU, {C});
  }
  Status run(const RmsNormQuantizeOptions& opt, bool with_rstd = true) {
    payload.assign(size_t(T * C), kPoison);
    scales.assign(size_t(T * C / 32), kPoison);
    rstd.assign(size_t(T), kNaN);
    return rmsnorm_quantize(xv(), wv(), opt, make_view(payload.data(), DType::kE4M3, Device::kCPU, {T, C}),
                            make_view(scales.data(), DType::kE8M0, Device::kCPU, {T, C / 32}),
                            with_rstd ? make_view(rstd.data(), DType::kFloat32, Device::kCPU, {T}) : TensorView{});
  }
};

// x ~ N(0, sigma) per row (sigma drawn per row over many binades), w ~ 1 + N(0, 0.3).
Case make_case(int64_t T, int64_t C, bool x_bf16, bool has_weight, bool w_bf16, uint32_t seed) {
  Case k;
  k.T = T, k.C = C, k.x_bf16 = x_bf16, k.has_weight = has_weight, k.w_bf16 = w_bf16;
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_real_distribution<float> binade(-12.f, 12.f);
  k.x.resize(size_t(T * C));
  for (int64_t t = 0; t < T; ++t) {
    const float sigma = std::exp2(binade(rng));
    for (int64_t c = 0; c < C; ++c) k.x[size_t(t * C + c)] = n01(rng) * sigma;
  }
  k.w.assign(size_t(C), 1.f);
  if (has_weight)
    for (auto& v : k.w) v = 1.f + 0.3f * n01(rng);
  auto store = [](std::vector<float>& vals, bool bf16, std::vector<uint16_t>& b, std::vector<float>& f) {
    if (bf16) {
      b.resize(vals.size());
      for (size_t i = 0; i < vals.size(); ++i) {
        b[i] = float_to_bf16(vals[i]);
        vals[i] = mxtest::bf16_value(b[i]);
      }
    } else {
      f = vals;
    }
  };
  store(k.x, x_bf16, k.xb, k.xf);
  store(k.w, w_bf16, k.wb, k.wf);
  return k;
}

// Every row against FP64 (rstd within 4 fp32 ulps) and every byte against the oracle codecs applied
// to y = (x * rstd) * w, the fp32 value the operation defines (NaN y -> 0x7F).
void expect_matches_oracle(const Case& k, ScalingMode mode, float eps, const std::string& what) {
  int bad_rstd = 0, bad_bytes = 0;
  for (int64_t t = 0; t < k.T; ++t) {
    double ss = 0;
    for (int64_t c = 0; c < k.C; ++c) ss += double(k.x[size_t(t * k.C + c)]) * k.x[size_t(t * k.C + c)];
    const double want = 1.0 / std::sqrt(ss / double(k.C) + double(eps));
    const float got = k.rstd[size_t(t)];
    // fp32 sums of squares: each lane adds C / 256 squares in turn, then five butterfly steps.
    const double tol = (double(k.C) / 32 + 8) * std::ldexp(want, -24);
    if (std::isnan(ss)) {
      if (!std::isnan(got)) ++bad_rstd;
    } else if (ss >= 0x1p128) {  // the fp32 sum overflows: rstd 0 (as fp32 RMSNorms do)
      if (got != 0.f) ++bad_rstd;
    } else if (!std::isfinite(want)) {
      if (got != float(want)) ++bad_rstd;
    } else if (!(std::fabs(double(got) - want) <= tol)) {
      ++bad_rstd;
    }
    for (int64_t b = 0; b < k.C / 32; ++b) {
      float y[32];
      for (int e = 0; e < 32; ++e) {
        const int64_t c = b * 32 + e;
        volatile float xr = k.x[size_t(t * k.C + c)] * got;
        y[e] = xr * k.w[size_t(c)];
      }
      const uint8_t s = mxtest::scale_byte(mxtest::block_amax(y, 32), mode);
      if (k.scales[size_t(t * k.C / 32 + b)] != s) ++bad_bytes;
      for (int e = 0; e < 32; ++e) {
        const uint8_t q = std::isnan(y[e]) ? uint8_t(0x7F) : mxtest::quant_elem(y[e], s);
        if (k.payload[size_t(t * k.C + b * 32 + e)] != q) ++bad_bytes;
      }
    }
  }
  EXPECT_EQ(bad_rstd, 0) << what << ": rows whose rstd is off FP64 by more than the fp32 sum's error";
  EXPECT_EQ(bad_bytes, 0) << what << ": payload / scale bytes that differ from the oracle";
}

TEST(RmsNormQuantizeRef, MatchesFp64AndTheOracleCodecs) {
  struct Shape {
    int64_t T, C;
    bool x_bf16, has_w, w_bf16;
  };
  const Shape shapes[] = {{37, 384, true, true, false}, {5, 32, true, true, true},   {9, 96, false, true, false},
                          {3, 4096, true, false, false}, {2, 2080, false, true, true}, {1, 65536, true, true, false}};
  uint32_t seed = 1;
  for (const Shape& s : shapes) {
    for (ScalingMode mode : {ScalingMode::kRceil, ScalingMode::kFloor}) {
      Case k = make_case(s.T, s.C, s.x_bf16, s.has_w, s.w_bf16, seed++);
      RmsNormQuantizeOptions opt;
      opt.mode = mode;
      opt.eps = 1e-6f;
      ASSERT_TRUE(k.run(opt).ok());
      expect_matches_oracle(k, mode, opt.eps,
                            "T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) + " mode=" + std::to_string(int(mode)));
    }
  }
}

TEST(RmsNormQuantizeRef, EpsDominatesTinyRowsAndRstdIsOptional) {
  Case k = make_case(4, 256, false, true, false, 77);
  for (auto& v : k.xf) v *= 1e-20f;  // mean(x^2) ~ 1e-40: eps decides
  k.x = k.xf;
  RmsNormQuantizeOptions opt;
  opt.eps = 1e-5f;
  ASSERT_TRUE(k.run(opt).ok());
  expect_matches_oracle(k, opt.mode, opt.eps, "tiny rows");
  const std::vector<uint8_t> payload = k.payload, scales = k.scales;
  ASSERT_TRUE(k.run(opt, /*with_rstd=*/false).ok());
  EXPECT_EQ(k.payload, payload);
  EXPECT_EQ(k.scales, scales);
  EXPECT_TRUE(std::isnan(k.rstd[0])) << "rstd written although not requested";
}

TEST(RmsNormQuantizeRef, NonFiniteRows) {
  // Row 0: a NaN (rstd NaN: every byte 0x7F, every scale 0xFF). Row 1: one inf (rstd 0: y is NaN
  // there and +-0 elsewhere). Row 2: all zero with eps 0 (rstd inf, y = 0 * inf = NaN). Row 3:
  // finite and huge (the fp32 sum of squares overflows: rstd 0, y 0).
  Case k = make_case(4, 64, false, false, false, 5);
  for (int64_t c = 0; c < 64; ++c) {
    k.xf[size_t(2 * 64 + c)] = 0.f;
    k.xf[size_t(3 * 64 + c)] = 3e38f;
  }
  k.xf[3] = kNaN;
  k.xf[64 + 40] = -kInf;
  k.x = k.xf;
  RmsNormQuantizeOptions opt;
  opt.eps = 0.f;
  ASSERT_TRUE(k.run(opt).ok());
  EXPECT_TRUE(std::isnan(k.rstd[0]));
  EXPECT_EQ(k.rstd[1], 0.f);
  EXPECT_EQ(k.rstd[2], kInf);
  EXPECT_EQ(k.rstd[3], 0.f);
  for (int64_t c = 0; c < 64; ++c) {
    EXPECT_EQ(k.payload[size_t(c)], 0x7F) << c;
    EXPECT_EQ(k.payload[size_t(64 + c)], c == 40 ? 0x7F : (k.xf[size_t(64 + c)] < 0 ? 0x80 : 0x00)) << c;
    EXPECT_EQ(k.payload[size_t(128 + c)], 0x7F) << c;
    EXPECT_EQ(k.payload[size_t(192 + c)], 0x00) << c;
  }
  const std::vector<uint8_t> want_scales = {0xFF, 0xFF, 0x00, 0xFF, 0xFF, 0xFF, 0x00, 0x00};
  EXPECT_EQ(k.scales, want_scales);
  expect_matches_oracle(k, opt.mode, opt.eps, "non-finite rows");  // the same rules through the oracle
}

TEST(RmsNormQuantizeRef, NoRowsIsANoOp) {
  Case k = make_case(0, 128, true, true, false, 3);
  ASSERT_TRUE(k.run(RmsNormQuantizeOptions{}).ok());
}

// ---------------------------------------------------------------- validation
struct Bad {
  std::string name;
  std::string prefix;  // the message must start with this
  std::function<Status(Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView&,
                       RmsNormQuantizeOptions&)>
      call;
};

TEST(RmsNormQuantizeRef, BadArgumentsAreNamedAndNothingIsWritten) {
  auto with = [](auto change) {
    return [change](Case& k, TensorView& x, TensorView& w, TensorView& p, TensorView& s, TensorView& r,
                    RmsNormQuantizeOptions& o) {
      change(k, x, w, p, s, r, o);
      return rmsnorm_quantize(x, w, o, p, s, r);
    };
  };
  const std::vector<Bad> bad = {
      {"x 3-D", "x:", with([](Case&, TensorView& x, auto&...) { x.ndim = 3, x.shape[2] = 1, x.stride[2] = 1; })},
      {"C not a multiple of 32", "x:", with([](Case&, TensorView& x, auto&...) { x.shape[1] = 48, x.stride[0] = 48; })},
      {"C too large", "x:", with([](Case&, TensorView& x, auto&...) { x.shape[0] = 1, x.shape[1] = 65568, x.stride[0] = 65568; })},
      {"x int32", "x:", with([](Case&, TensorView& x, auto&...) { x.dtype = DType::kInt32; })},
      {"x strided", "x:", with([](Case&, TensorView& x, auto&...) { x.stride[0] = 256; })},
      {"weight length", "weight:", with([](Case&, TensorView&, TensorView& w, auto&...) { w.shape[0] = 96; })},
      {"weight fp16", "weight:", with([](Case&, TensorView&, TensorView& w, auto&...) { w.dtype = DType::kFloat16; })},
      {"payload shape", "payload:", with([](Case&, TensorView&, TensorView&, TensorView& p, auto&...) { p.shape[1] = 64; })},
      {"payload fp32", "payload:", with([](Case&, TensorView&, TensorView&, TensorView& p, auto&...) { p.dtype = DType::kFloat32; })},
      {"scales shape", "scales:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView& s, auto&...) { s.shape[1] = 3; })},
      {"rstd bf16", "rstd:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView& r, auto&) { r.dtype = DType::kBFloat16; })},
      {"rstd length", "rstd:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView& r, auto&) { r.shape[0] = 3; })},
      {"eps negative", "eps:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView&, RmsNormQuantizeOptions& o) { o.eps = -1e-6f; })},
      {"eps NaN", "eps:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView&, RmsNormQuantizeOptions& o) { o.eps = kNaN; })},
      {"eps inf", "eps:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView&, RmsNormQuantizeOptions& o) { o.eps = kInf; })},
      {"mode", "mode:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView&, RmsNormQuantizeOptions& o) { o.mode = ScalingMode(7); })},
      {"weight on another device", "weight:", with([](Case&, TensorView&, TensorView& w, auto&...) { w.device = Device::kCUDA; })},
      {"rstd on another device", "rstd:", with([](Case&, TensorView&, TensorView&, TensorView&, TensorView&, TensorView& r, auto&) { r.device = Device::kCUDA; })},
  };
  for (const Bad& b : bad) {
    Case k = make_case(4, 128, true, true, false, 11);
    k.payload.assign(size_t(4 * 128), kPoison);
    k.scales.assign(size_t(4 * 4), kPoison);
    k.rstd.assign(4, kNaN);
    TensorView x = k.xv(), w = k.wv();
    TensorView p = make_view(k.payload.data(), DType::kE4M3, Device::kCPU, {4, 128});
    TensorView s = make_view(k.scales.data(), DType::kE8M0, Device::kCPU, {4, 4});
    TensorView r = make_view(k.rstd.data(), DType::kFloat32, Device::kCPU, {4});
    RmsNormQuantizeOptions o;
    const Status st = b.call(k, x, w, p, s, r, o);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.name << ": " << st.message();
    EXPECT_EQ(st.message().rfind(b.prefix, 0), 0u) << b.name << ": " << st.message();
    EXPECT_TRUE(std::all_of(k.payload.begin(), k.payload.end(), [](uint8_t v) { return v == kPoison; })) << b.name;
    EXPECT_TRUE(std::all_of(k.scales.begin(), k.scales.end(), [](uint8_t v) { return v == kPoison; })) << b.name;
    EXPECT_TRUE(std::all_of(k.rstd.begin(), k.rstd.end(), [](float v) { return std::isnan(v); })) << b.name;
  }
  // The baseline of those calls succeeds.
  Case k = make_case(4, 128, true, true, false, 11);
  EXPECT_TRUE(k.run(RmsNormQuantizeOptions{}).ok());
}

}  // namespace
}  // namespace mxflash
