// Hostile random inputs for the GPU-vs-CPU quantization tests (no CUDA dependency).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "mxflash/jagged.h"
#include "mxflash/mx.h"

namespace mxflash::gputest {

// Values of x (T, H, 128) as fp32, with magnitudes that vary per 32-value block and per token
// (so seq blocks mix scales and produce e4m3 subnormals), plus:
//  - specials at a low rate: +-NaN (several payloads), +-inf, -0, fp32/bf16 subnormals, FLT_MAX;
//  - exact 448 * 2^k and values whose e4m3 rounding is a tie;
//  - all-zero hdim blocks and all-zero (group of 32 tokens, head) tiles, i.e. zero seq and
//    square32 blocks.
// Tiny and huge magnitude classes reach the clamps of both scaling modes.
inline std::vector<float> make_values(const JaggedMeta& meta, int64_t H, uint64_t seed) {
  const int64_t T = meta.total_tokens();
  std::vector<float> x(size_t(T * H * kHeadDim));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int blocks = kHeadDim / kBlockSize;
  std::vector<int> head_exp(size_t(H * blocks));
  for (int& e : head_exp) e = pick(-24, 24);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      for (int k = 0; k < blocks; ++k) {
        float* v = &x[size_t(((t * H + h) * kHeadDim) + k * kBlockSize)];
        const float cls = unit(rng);
        int e = head_exp[size_t(h * blocks + k)] + pick(-3, 3);  // mostly smooth along tokens
        if (cls < 0.04f)
          e = pick(-149, -120);  // subnormal / tiny
        else if (cls < 0.07f)
          e = pick(100, 127);  // huge
        else if (cls < 0.15f)
          e = pick(-60, 60);
        const bool zero_block = unit(rng) < 0.02f;
        for (int i = 0; i < kBlockSize; ++i) {
          float y = zero_block ? 0.f : std::ldexp(normal(rng), e);
          const float r = unit(rng);
          if (r < 0.002f)
            y = std::ldexp(448.f, pick(-20, 20)) * (unit(rng) < 0.5f ? -1.f : 1.f);
          else if (r < 0.004f)
            y = std::ldexp(float(pick(-31, 31)) + 0.5f, e - 4);  // ties after scaling
          else if (r < 0.005f)
            y = -0.f;
          else if (r < 0.0055f)
            y = std::ldexp(float(pick(1, 255)), -149 + pick(0, 16));  // fp32 subnormal
          else if (r < 0.0058f)
            y = (unit(rng) < 0.5f ? -1.f : 1.f) * std::numeric_limits<float>::max();
          else if (r < 0.0061f)
            y = (unit(rng) < 0.5f ? -1.f : 1.f) * std::numeric_limits<float>::infinity();
          else if (r < 0.0064f) {
            // NaN with a random sign and payload (quiet or signaling); bf16 keeps the top bits.
            uint32_t u = 0x7F800000u | (uint32_t(pick(1, 0x7FFF)) << 8) | uint32_t(pick(0, 255));
            if (unit(rng) < 0.5f) u |= 0x80000000u;
            std::memcpy(&y, &u, 4);
          }
          v[i] = y;
        }
      }
    }
  }
  // All-zero tiles: a few (group, head) pairs of real tokens.
  const auto& cu = meta.cu_seqlens();
  for (int b = 0; b < meta.batch(); ++b) {
    for (int64_t g0 = cu[b]; g0 < cu[b + 1]; g0 += kBlockSize) {
      if (unit(rng) >= 0.05f) continue;
      const int64_t h = pick(0, int(H - 1));
      for (int64_t t = g0; t < std::min<int64_t>(g0 + kBlockSize, cu[b + 1]); ++t)
        std::memset(&x[size_t((t * H + h) * kHeadDim)], 0, kHeadDim * sizeof(float));
    }
  }
  return x;
}

// Raw bytes of x in the requested input type (bf16: the fp32 values rounded to nearest even; NaN
// payloads truncated, sign kept).
inline std::vector<uint8_t> encode_input(const std::vector<float>& x, bool bf16) {
  std::vector<uint8_t> out(x.size() * (bf16 ? 2 : 4));
  if (!bf16) {
    std::memcpy(out.data(), x.data(), out.size());
    return out;
  }
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t h = float_to_bf16(x[i]);
    std::memcpy(&out[2 * i], &h, 2);
  }
  return out;
}

inline std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) out[i] = uint8_t(rng());
  return out;
}

inline std::vector<int64_t> random_lengths(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> lengths(size_t(std::uniform_int_distribution<int>(1, 7)(rng)));
  for (int64_t& l : lengths) {
    const int kind = std::uniform_int_distribution<int>(0, 3)(rng);
    l = kind == 0 ? 0 : std::uniform_int_distribution<int>(1, kind == 3 ? 700 : 140)(rng);
  }
  return lengths;
}

// Many sequences, most of them empty in runs of up to 48: the kernels' sequence lookup has to
// jump over more than 32 sequence starts at once.
inline std::vector<int64_t> sparse_lengths() {
  std::vector<int64_t> l;
  for (int i = 0; i < 400; ++i) l.push_back(i % 50 == 49 ? 1 + (i * 37) % 200 : (i % 7 == 3 ? i % 5 : 0));
  return l;
}

// Lengths that hit every boundary of the 32-token blocks and 128-token scale atoms.
inline const std::vector<int64_t>& hostile_lengths() {
  static const std::vector<int64_t> l = {0, 1, 31, 32, 33, 127, 128, 129, 1000, 4096};
  return l;
}

}  // namespace mxflash::gputest
