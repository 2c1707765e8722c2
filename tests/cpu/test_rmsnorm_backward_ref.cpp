// rmsnorm_backward (include/mxflash/fused.h) on CPU tensors: dx and dweight against the RMSNorm's
// gradient in FP64 (written here from the formula, and checked by a finite difference of the FP64
// forward), no weight, no rows, and argument validation (a failed Status naming the argument,
// nothing written).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mx_oracle.h"
#include "mxflash/fused.h"
#include "mxflash/tensor.h"

namespace mxflash {
namespace {

uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Problem {
  int64_t T, C;
  bool bf16, has_w;
  std::vector<float> x, w, dy, rstd;  // values as the operation sees them
  std::vector<uint16_t> xb, dyb, dxb;
  std::vector<float> dxf, dw;

  TensorView view(std::vector<float>& f, std::vector<uint16_t>& b, std::initializer_list<int64_t> shape) {
    return bf16 ? make_view(b.data(), DType::kBFloat16, Device::kCPU, shape)
                : make_view(f.data(), DType::kFloat32, Device::kCPU, shape);
  }
  Status run(bool want_dw = true) {
    dxb.assign(size_t(T * C), 0xA5A5);
    dxf.assign(size_t(T * C), -7.f);
    dw.assign(size_t(C), -7.f);
    std::vector<uint16_t> unused;
    return rmsnorm_backward(view(x, xb, {T, C}), has_w ? make_view(w.data(), DType::kFloat32, Device::kCPU, {C}) : TensorView{},
                            make_view(rstd.data(), DType::kFloat32, Device::kCPU, {T}), view(dy, dyb, {T, C}),
                            bf16 ? make_view(dxb.data(), DType::kBFloat16, Device::kCPU, {T, C})
                                 : make_view(dxf.data(), DType::kFloat32, Device::kCPU, {T, C}),
                            (has_w && want_dw) ? make_view(dw.data(), DType::kFloat32, Device::kCPU, {C}) : TensorView{});
  }
  double dx_at(int64_t i) const { return bf16 ? from_bf16(dxb[size_t(i)]) : dxf[size_t(i)]; }
};

Problem make(int64_t T, int64_t C, bool bf16, bool has_w, uint32_t seed) {
  Problem p{T, C, bf16, has_w, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_real_distribution<float> binade(-8.f, 8.f);
  auto as_seen = [&](float v, std::vector<uint16_t>& b) {
    if (!bf16) return v;
    b.push_back(to_bf16(v));
    return from_bf16(b.back());
  };
  for (int64_t t = 0; t < T; ++t) {
    const float sx = std::exp2(binade(rng)), sd = std::exp2(binade(rng));
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) {
      p.x.push_back(as_seen(n01(rng) * sx, p.xb));
      ss += double(p.x.back()) * p.x.back();
      p.dy.push_back(as_seen(n01(rng) * sd, p.dyb));
    }
    p.rstd.push_back(float(1.0 / std::sqrt(ss / double(C) + 1e-6)));
  }
  for (int64_t c = 0; c < C; ++c) p.w.push_back(has_w ? 1.f + 0.5f * n01(rng) : 1.f);
  return p;
}

// The gradient in FP64 from the same rstd: dx = rstd (g - xh mean(g xh)), g = dy w, xh = x rstd.
void fp64_grad(const Problem& p, std::vector<double>& dx, std::vector<double>& dw) {
  dx.assign(size_t(p.T * p.C), 0);
  dw.assign(size_t(p.C), 0);
  for (int64_t t = 0; t < p.T; ++t) {
    double dot = 0;
    const double r = p.rstd[size_t(t)];
    for (int64_t c = 0; c < p.C; ++c) dot += double(p.dy[size_t(t * p.C + c)]) * p.w[size_t(c)] * p.x[size_t(t * p.C + c)] * r;
    for (int64_t c = 0; c < p.C; ++c) {
      const double xh = p.x[size_t(t * p.C + c)] * r, g = double(p.dy[size_t(t * p.C + c)]) * p.w[size_t(c)];
      dx[size_t(t * p.C + c)] = r * (g - xh * dot / double(p.C));
      dw[size_t(c)] += double(p.dy[size_t(t * p.C + c)]) * xh;
    }
  }
}

TEST(RmsNormBackwardRef, MatchesFp64) {
  struct Shape {
    int64_t T, C;
    bool bf16, has_w;
  };
  const Shape shapes[] = {{37, 384, true, true}, {5, 32, false, true}, {9, 96, true, false},
                          {3, 4096, false, true}, {1100, 64, true, true}, {2, 2080, false, false}};
  uint32_t seed = 5;
  for (const Shape& s : shapes) {
    Problem p = make(s.T, s.C, s.bf16, s.has_w, seed++);
    ASSERT_TRUE(p.run().ok());
    std::vector<double> dx, dw;
    fp64_grad(p, dx, dw);
    const std::string what = "T=" + std::to_string(s.T) + " C=" + std::to_string(s.C);
    // Per row: the error relative to the row's largest |dx| (cancellation in g - xh m is the
    // gradient's own conditioning), within a few units of the output's precision.
    const double tol = s.bf16 ? 1.0 / 128 : 1e-5;
    for (int64_t t = 0; t < s.T; ++t) {
      double big = 0, err = 0;
      for (int64_t c = 0; c < s.C; ++c) {
        big = std::max(big, std::fabs(dx[size_t(t * s.C + c)]));
        err = std::max(err, std::fabs(p.dx_at(t * s.C + c) - dx[size_t(t * s.C + c)]));
      }
      ASSERT_LE(err, tol * big) << what << " row " << t;
    }
    if (s.has_w) {
      double big = 0, err = 0;
      for (int64_t c = 0; c < s.C; ++c) big = std::max(big, std::fabs(dw[size_t(c)]));
      for (int64_t c = 0; c < s.C; ++c) err = std::max(err, std::fabs(p.dw[size_t(c)] - dw[size_t(c)]));
      EXPECT_LE(err, 1e-4 * big) << what << ": dweight";
    } else {
      EXPECT_TRUE(std::all_of(p.dw.begin(), p.dw.end(), [](float v) { return v == -7.f; })) << what;
    }
  }
}

TEST(RmsNormBackwardRef, IsTheGradientOfTheForward) {
  // A central finite difference of the FP64 RMSNorm (rstd recomputed) in one coordinate of x and
  // one of w, against the fp32 backward: the formula above is the forward's gradient.
  Problem p = make(3, 64, false, true, 42);
  ASSERT_TRUE(p.run().ok());
  auto loss = [&](const std::vector<float>& x, const std::vector<float>& w) {
    double l = 0;
    for (int64_t t = 0; t < p.T; ++t) {
      double ss = 0;
      for (int64_t c = 0; c < p.C; ++c) ss += double(x[size_t(t * p.C + c)]) * x[size_t(t * p.C + c)];
      const double r = 1.0 / std::sqrt(ss / double(p.C) + 1e-6);
      for (int64_t c = 0; c < p.C; ++c) l += double(p.dy[size_t(t * p.C + c)]) * x[size_t(t * p.C + c)] * r * w[size_t(c)];
    }
    return l;
  };
  for (int64_t i : {int64_t(5), int64_t(70), int64_t(150)}) {
    std::vector<float> xp = p.x, xm = p.x;
    const float h = std::max(1e-3f * std::fabs(p.x[size_t(i)]), 1e-6f);
    xp[size_t(i)] += h;
    xm[size_t(i)] -= h;
    const double fd = (loss(xp, p.w) - loss(xm, p.w)) / double(xp[size_t(i)] - xm[size_t(i)]);
    EXPECT_NEAR(p.dx_at(i), fd, 1e-3 * std::fabs(fd) + 1e-6) << "x[" << i << "]";
  }
  std::vector<float> wp = p.w, wm = p.w;
  wp[7] += 1e-3f;
  wm[7] -= 1e-3f;
  const double fd = (loss(p.x, wp) - loss(p.x, wm)) / double(wp[7] - wm[7]);
  EXPECT_NEAR(p.dw[7], fd, 1e-3 * std::fabs(fd));
}

TEST(RmsNormBackwardRef, NoRowsGivesZeroDweight) {
  Problem p = make(0, 64, true, true, 1);
  ASSERT_TRUE(p.run().ok());
  EXPECT_TRUE(std::all_of(p.dw.begin(), p.dw.end(), [](float v) { return v == 0.f; }));
}

TEST(RmsNormBackwardRef, BadArgumentsAreNamedAndNothingIsWritten) {
  const int64_t T = 4, C = 64;
  std::vector<uint16_t> x(T * C, 0x3F80), dy(T * C, 0x3F80), dx(T * C + C, 0xA5A5);
  std::vector<float> w(C, 1.f), rstd(T, 1.f), dw(C + 8, -7.f), dyf(T * C, 1.f);
  const TensorView xv = make_view(x.data(), DType::kBFloat16, Device::kCPU, {T, C});
  const TensorView wv = make_view(w.data(), DType::kFloat32, Device::kCPU, {C});
  const TensorView rv = make_view(rstd.data(), DType::kFloat32, Device::kCPU, {T});
  const TensorView dyv = make_view(dy.data(), DType::kBFloat16, Device::kCPU, {T, C});
  const TensorView dxv = make_view(dx.data(), DType::kBFloat16, Device::kCPU, {T, C});
  const TensorView dwv = make_view(dw.data(), DType::kFloat32, Device::kCPU, {C});
  struct Bad {
    const char* prefix;
    TensorView x, w, r, dy, dx, dw;
  };
  const Bad bad[] = {
      {"x:", make_view(x.data(), DType::kBFloat16, Device::kCPU, {T, 48}), wv, rv, dyv, dxv, dwv},
      {"weight:", xv, make_view(w.data(), DType::kFloat32, Device::kCPU, {C - 32}), rv, dyv, dxv, dwv},
      {"rstd:", xv, wv, make_view(rstd.data(), DType::kFloat32, Device::kCPU, {T - 1}), dyv, dxv, dwv},
      {"dy:", xv, wv, rv, make_view(dyf.data(), DType::kFloat32, Device::kCPU, {T, C}), dxv, dwv},
      {"dx:", xv, wv, rv, dyv, make_view(dx.data(), DType::kBFloat16, Device::kCPU, {T, C + 32}), dwv},
      {"dx:", xv, wv, rv, dyv, make_view(dy.data(), DType::kBFloat16, Device::kCPU, {T, C}), dwv},  // aliases dy
      {"dweight:", xv, wv, rv, dyv, dxv, make_view(dw.data(), DType::kFloat32, Device::kCPU, {C + 8})},
      {"dweight:", xv, TensorView{}, rv, dyv, dxv, dwv},  // no weight, yet dweight requested
  };
  for (const Bad& b : bad) {
    const Status st = rmsnorm_backward(b.x, b.w, b.r, b.dy, b.dx, b.dw);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.prefix << " " << st.message();
    EXPECT_EQ(st.message().rfind(b.prefix, 0), 0u) << st.message();
    EXPECT_TRUE(std::all_of(dx.begin(), dx.end(), [](uint16_t v) { return v == 0xA5A5; })) << b.prefix;
    EXPECT_TRUE(std::all_of(dw.begin(), dw.end(), [](float v) { return v == -7.f; })) << b.prefix;
    EXPECT_TRUE(std::all_of(dy.begin(), dy.end(), [](uint16_t v) { return v == 0x3F80; })) << b.prefix;
  }
}

}  // namespace
}  // namespace mxflash
