// CPU reference of rmsnorm_quantize (include/mxflash/fused.h): the arithmetic and its order are
// those of src/common/rmsnorm_rules.h, which the CUDA kernel follows too.
#include "reference/fused_ref.h"

#include <cmath>
#include <vector>

#include "common/rmsnorm_rules.h"

namespace mxflash::ref {
namespace {

float element(const void* base, bool bf16, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
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
  for (int d = L / 2; d >= 1; d /= 2) {
    float next[kRmsMaxLanes];
    for (int i = 0; i < L; ++i) next[i] = lane[i] + lane[i ^ d];
    for (int i = 0; i < L; ++i) lane[i] = next[i];
  }
  return lane[0];
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
    for (int64_t k = 0; k < C / kBlockSize; ++k) {
      const float* blk = y.data() + k * kBlockSize;
      float amax = 0.f;
      for (int e = 0; e < kBlockSize; ++e) amax = amax_nan(amax, blk[e]);
      const uint8_t s = e8m0_scale_byte(amax, p.mode);
      p.scales[t * (C / kBlockSize) + k] = s;
      const float inv = e8m0_inv_scale(s);
      for (int e = 0; e < kBlockSize; ++e)
        p.payload[t * C + k * kBlockSize + e] = rms_quantize_element(blk[e], inv);
    }
  }
}

}  // namespace mxflash::ref
