// Random MX operands for the gemm_quantize tests (CPU and GPU): e4m3 bytes of N(0, 1) * 2^6 values
// and block scales 120 - [0, spread] (2^-7 and below), so that blocks of a row sit up to `spread`
// binades below the row's coarse scale.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "mxflash/fused.h"
#include "mxflash/mx.h"
#include "mxflash/tensor.h"

namespace mxtest {

struct GemmOperand {
  int64_t rows = 0, k = 0;
  std::vector<uint8_t> payload, scales;
};

//  uniform_rows: every block of a row gets the row's one scale (re-expression is then exact).
//  zero_blocks:  every 97th row from row 3 has one all-zero block with scale byte 0, as the host
//                quantizer writes a zero block.
inline GemmOperand make_gemm_operand(int64_t rows, int64_t k, uint32_t seed, int spread, bool uniform_rows = false,
                                     bool zero_blocks = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_int_distribution<int> shift(0, spread);
  GemmOperand o;
  o.rows = rows;
  o.k = k;
  o.payload.resize(size_t(rows * k));
  o.scales.resize(size_t(rows * (k / 32)));
  for (auto& b : o.payload) b = mxflash::float_to_e4m3(n01(rng) * 64.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int row_shift = shift(rng);
    for (int64_t b = 0; b < k / 32; ++b)
      o.scales[size_t(r * (k / 32) + b)] = uint8_t(120 - (uniform_rows ? row_shift : shift(rng)));
  }
  if (zero_blocks) {
    for (int64_t r = 3; r < rows; r += 97) {
      const int64_t b = r % (k / 32);
      o.scales[size_t(r * (k / 32) + b)] = 0;
      std::fill_n(o.payload.begin() + r * k + b * 32, 32, uint8_t(0));
    }
  }
  return o;
}

// gemm_quantize on CPU tensors: y = a w^T into payload and scales, which are filled with `poison`
// first (so that a byte the call does not write is seen).
struct GemmOutputs {
  std::vector<uint8_t> payload, scales;
};
inline mxflash::Status gemm_quantize_cpu(const GemmOperand& a, const GemmOperand& w, mxflash::GemmPath path,
                                         mxflash::ScalingMode mode, uint8_t poison, GemmOutputs* out) {
  using mxflash::DType;
  using mxflash::make_view;
  constexpr mxflash::Device kCpu = mxflash::Device::kCPU;
  const int64_t M = a.rows, N = w.rows, K = a.k;
  out->payload.assign(size_t(M * N), poison);
  out->scales.assign(size_t(M * N / 32), poison);
  mxflash::GemmQuantizeOptions opt;
  opt.path = path;
  opt.mode = mode;
  return mxflash::gemm_quantize(make_view(const_cast<uint8_t*>(a.payload.data()), DType::kE4M3, kCpu, {M, K}),
                                make_view(const_cast<uint8_t*>(a.scales.data()), DType::kE8M0, kCpu, {M, K / 32}),
                                make_view(const_cast<uint8_t*>(w.payload.data()), DType::kE4M3, kCpu, {N, w.k}),
                                make_view(const_cast<uint8_t*>(w.scales.data()), DType::kE8M0, kCpu, {N, w.k / 32}),
                                opt, make_view(out->payload.data(), DType::kE4M3, kCpu, {M, N}),
                                make_view(out->scales.data(), DType::kE8M0, kCpu, {M, N / 32}));
}

}  // namespace mxtest
