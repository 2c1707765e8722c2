// CPU reference of the fused producers (include/mxflash/fused.h): rmsnorm_quantize in the arithmetic and
// order of src/common/rmsnorm_rules.h, gemm_quantize in those of src/common/gemm_rules.h, which the
// CUDA kernels follow too.
#include "reference/fused_ref.h"

#include <cmath>
#include <vector>

#include "common/gemm_rules.h"
#include "common/rmsnorm_rules.h"

namespace mxflash::ref {
namespace {

float element(const void* base, bool bf16, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// rmsnorm_rules.h's butterfly over the row's L lanes' sums: what every lane ends with.
float lane_butterfly(float (&lane)[kRmsMaxLanes], int L) {
  for (int d = L / 2; d >= 1; d /= 2) {
    float next[kRmsMaxLanes];
    for (int i = 0; i < L; ++i) next[i] = lane[i] + lane[i ^ d];
    for (int i = 0; i < L; ++i) lane[i] = next[i];
  }
  return lane[0];
}

}  // namespace

float rms_sum_of_squares(const float* row, int64_t cols) {
  const int L = rms_lanes(cols);
  float lane[kRmsMaxLanes] = {};
  for (int64_t c = 0; c < cols / kRmsChunk; ++c) {
    float& acc = lane[c % L];
    for (int e = 0; e < kRmsChunk; ++e) {
      const float v = row[c * kRmsChunk + e];
      acc = std::fma(v, v, acc);
    }
  }
  return lane_butterfly(lane, L);
}

void rmsnorm_quantize(const detail::RmsNormQuantizeProblem& p) {
  const int64_t C = p.cols;
  std::vector<float> x(static_cast<size_t>(C)), w(static_cast<size_t>(C), 1.f), y(static_cast<size_t>(C));
  if (p.weight)
    for (int64_t c = 0; c < C; ++c) w[size_t(c)] = element(p.weight, p.weight_bf16, c);
  for (int64_t t = 0; t < p.rows; ++t) {
    for (int64_t c = 0; c < C; ++c) x[size_t(c)] = element(p.x, p.x_bf16, t * C + c);
    const float rstd = rms_rstd(rms_sum_of_squares(x.data(), C), C, p.eps);
    if (p.rstd) p.rstd[t] = rstd;
    for (int64_t c = 0; c < C; ++c) y[size_t(c)] = rms_apply(x[size_t(c)], rstd, w[size_t(c)]);
    quantize_row_blocks(y.data(), C, p.mode, p.payload + t * C, p.scales + t * (C / kBlockSize));
  }
}


void rmsnorm_backward(const detail::RmsNormBackwardProblem& p) {
  const int64_t C = p.cols;
  const int L = rms_lanes(C);
  const int64_t group_rows = rms_bwd_group_rows(p.rows);
  const size_t n = static_cast<size_t>(C);
  std::vector<float> w(n, 1.f), xh(n), gy(n), group(n, 0.f), block(n, 0.f), total(n, 0.f);
  int64_t groups_done = 0;
  if (p.weight)
    for (int64_t c = 0; c < C; ++c) w[size_t(c)] = element(p.weight, p.weight_bf16, c);
  for (int64_t t = 0; t < p.rows; ++t) {
    const float rstd = p.rstd[t];
    float lane[kRmsMaxLanes] = {};
    for (int64_t c = 0; c < C; ++c) {
      const float dy = element(p.dy, p.bf16, t * C + c);
      xh[size_t(c)] = rms_mul(element(p.x, p.bf16, t * C + c), rstd);
      gy[size_t(c)] = p.weight ? rms_mul(dy, w[size_t(c)]) : dy;
      float& acc = lane[(c / kRmsChunk) % L];
      acc = rms_fma(gy[size_t(c)], xh[size_t(c)], acc);
      if (p.dweight) group[size_t(c)] = rms_fma(dy, xh[size_t(c)], group[size_t(c)]);
    }
    const float m = rms_bwd_mean(lane_butterfly(lane, L), C);
    for (int64_t c = 0; c < C; ++c) {
      const float v = rms_bwd_dx(gy[size_t(c)], xh[size_t(c)], m, rstd);
      if (p.bf16)
        static_cast<uint16_t*>(p.dx)[t * C + c] = float_to_bf16(v);
      else
        static_cast<float*>(p.dx)[t * C + c] = v;
    }
    if (p.dweight && ((t + 1) % group_rows == 0 || t + 1 == p.rows)) {  // a group ends: into its block
      ++groups_done;
      const bool block_ends = groups_done % kRmsBwdSumBlock == 0 || t + 1 == p.rows;
      for (int64_t c = 0; c < C; ++c) {
        volatile float sum = block[size_t(c)] + group[size_t(c)];
        block[size_t(c)] = sum;
        group[size_t(c)] = 0.f;
        if (block_ends) {
          volatile float all = total[size_t(c)] + block[size_t(c)];
          total[size_t(c)] = all;
          block[size_t(c)] = 0.f;
        }
      }
    }
  }
  if (p.dweight)
    for (int64_t c = 0; c < C; ++c) p.dweight[c] = rms_canonical(total[size_t(c)]);
}

void quantize_row_blocks(const float* y, int64_t n, ScalingMode mode, uint8_t* payload, uint8_t* scales) {
  for (int64_t b = 0; b < n / kBlockSize; ++b) {
    const float* blk = y + b * kBlockSize;
    float amax = 0.f;
    for (int e = 0; e < kBlockSize; ++e) amax = amax_nan(amax, blk[e]);
    const uint8_t s = e8m0_scale_byte(amax, mode);
    scales[b] = s;
    const float inv = e8m0_inv_scale(s);
    for (int e = 0; e < kBlockSize; ++e) payload[b * kBlockSize + e] = quantize_produced_element(blk[e], inv);
  }
}

void reexpress_rows(const uint8_t* src, const uint8_t* scales, int64_t rows, int64_t k, uint8_t* dst,
                    uint8_t* coarse) {
  const int64_t blocks = k / kBlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* srow = scales + r * blocks;
    const uint32_t e = coarse_exponent(srow, blocks);
    coarse[r] = uint8_t(e);
    for (int64_t i = 0; i < k; ++i)
      dst[r * k + i] = e4m3_shift_down(src[r * k + i], block_shift(e, srow[i / kBlockSize]));
  }
}

namespace {

std::vector<double> decoded(const uint8_t* x, int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = double(e4m3_to_float(x[i]));
  return v;
}

// sum_k a[k] w[k] over [k0, k1) in fp64: exact for one 32-block (see gemm_rules.h).
double dot(const double* a, const double* w, int64_t k0, int64_t k1) {
  double s = 0.0;
  for (int64_t i = k0; i < k1; ++i) s += a[i] * w[i];
  return s;
}

double e8m0_double(uint8_t b) { return b == kE8m0Nan ? std::nan("") : std::ldexp(1.0, int(b) - 127); }

}  // namespace

void gemm_quantize(const detail::GemmQuantizeProblem& p) {
  const int64_t M = p.m, N = p.n, K = p.k, blocks = K / kBlockSize;
  std::vector<float> y(static_cast<size_t>(N));
  if (p.path == GemmPath::kCoarse) {
    std::vector<uint8_t> a(static_cast<size_t>(M * K)), w(static_cast<size_t>(N * K)), ea(static_cast<size_t>(M)),
        ew(static_cast<size_t>(N));
    reexpress_rows(p.a, p.a_scales, M, K, a.data(), ea.data());
    reexpress_rows(p.w, p.w_scales, N, K, w.data(), ew.data());
    const std::vector<double> wd = decoded(w.data(), N * K);
    for (int64_t m = 0; m < M; ++m) {
      const std::vector<double> ad = decoded(a.data() + m * K, K);
      const float sa = e8m0_to_float(ea[size_t(m)]);
      for (int64_t n = 0; n < N; ++n) {
        const float acc = float(dot(ad.data(), wd.data() + n * K, 0, K));
        y[size_t(n)] = (acc * sa) * e8m0_to_float(ew[size_t(n)]);
      }
      quantize_row_blocks(y.data(), N, p.mode, p.payload + m * N, p.scales + m * (N / kBlockSize));
    }
    return;
  }
  const std::vector<double> wd = decoded(p.w, N * K);
  for (int64_t m = 0; m < M; ++m) {
    const std::vector<double> ad = decoded(p.a + m * K, K);
    for (int64_t n = 0; n < N; ++n) {
      double s = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        const double scale = e8m0_double(p.a_scales[m * blocks + b]) * e8m0_double(p.w_scales[n * blocks + b]);
        s += dot(ad.data(), wd.data() + n * K, b * kBlockSize, (b + 1) * kBlockSize) * scale;
      }
      y[size_t(n)] = float(s);
    }
    quantize_row_blocks(y.data(), N, p.mode, p.payload + m * N, p.scales + m * (N / kBlockSize));
  }
}

}  // namespace mxflash::ref
