// Host MX operands for the attention API tests: a library-quantized (T, H, 128) tensor as an
// MxTensor over owned buffers, plus the poison byte and the dummy device pointer the tests use.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mxflash/attention.h"

namespace mxflash::test {

constexpr uint8_t kPoison = 0xA5;
// CUDA-tagged views carry it: a launcher that dereferenced one before rejecting it would crash.
// Values rounded to bf16 bits, and bf16 bits as doubles.
inline std::vector<uint16_t> to_bf16_bits(const std::vector<double>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16(float(x[i]));
  return b;
}
inline std::vector<double> bf16_values(const std::vector<uint16_t>& b) {
  std::vector<double> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_to_float(b[i]);
  return x;
}

inline void* const kDummyDevicePtr = reinterpret_cast<void*>(uintptr_t(0x1000));

struct HostMx {
  std::vector<uint8_t> payload, scales;
  MxTensor t;
};

// x (T, H, 128) fp32 quantized by the library (RCEIL) in the given layouts.
inline HostMx quantize_host(const std::vector<float>& x, const JaggedMeta& m, int64_t H, Orientation o,
                            PayloadLayout pl = PayloadLayout::kTokenMajor, ScaleLayout sl = ScaleLayout::kPlain) {
  HostMx r;
  int64_t ps[3];
  payload_shape(m, H, pl, ps);
  const ScaleShape ss = scale_shape(m, H, o, sl);
  r.payload.assign(size_t(ps[0] * ps[1] * ps[2]), 0);
  r.scales.assign(size_t(ss.numel()), 0);
  r.t.payload = make_view(r.payload.data(), DType::kE4M3, Device::kCPU, 3, ps);
  r.t.scales = make_view(r.scales.data(), DType::kE8M0, Device::kCPU, ss.ndim, ss.dims);
  r.t.orientation = o;
  r.t.scale_layout = sl;
  r.t.payload_layout = pl;
  QuantizeOptions qo;
  qo.scale_layout = sl;
  qo.payload_layout = pl;
  const Status st = quantize(make_view(const_cast<float*>(x.data()), DType::kFloat32, Device::kCPU,
                                       {m.total_tokens(), H, kHeadDim}),
                             m, o, qo, r.t.payload, r.t.scales);
  EXPECT_TRUE(st.ok()) << st.message();
  return r;
}

// Forward operands in the execution layout (AttentionFwdOperands) over owned host buffers, every
// byte set to `fill`.
struct HostOperands {
  std::vector<uint8_t> parts[kAttentionFwdOperandCount];  // q, k, v, q_scale, k_scale, v_scale
  std::vector<uint8_t>&q = parts[0], &k = parts[1], &v = parts[2], &q_scale = parts[3], &k_scale = parts[4],
                      &v_scale = parts[5];
  AttentionFwdOperands ops;
  // kv_heads: K and V's heads (0: H; grouped-query attention: a divisor of H).
  HostOperands(const JaggedMeta& qm, const JaggedMeta& km, int64_t H, uint8_t fill = kPoison, int64_t kv_heads = 0) {
    size_t bytes[kAttentionFwdOperandCount];
    void* ptr[kAttentionFwdOperandCount];
    attention_fwd_operand_bytes(qm, km, H, bytes, kv_heads);
    for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
      parts[i].assign(bytes[i] + 16, fill);  // + 16: room for misaligned views
      ptr[i] = parts[i].data();
    }
    ops = attention_fwd_operand_views(qm, km, H, ptr, Device::kCPU, 0, kv_heads);
  }
  HostOperands(const HostOperands&) = delete;
};

// Backward operands in the execution layout (AttentionBwdOperands) over owned host buffers, every
// byte set to `fill`.
struct HostBwdOperands {
  std::vector<uint8_t> parts[kAttentionBwdOperandCount];  // q, k, v, qt, kt, then their scales
  AttentionBwdOperands ops;
  HostBwdOperands(const JaggedMeta& qm, const JaggedMeta& km, int64_t H, uint8_t fill = kPoison, int64_t kv_heads = 0) {
    size_t bytes[kAttentionBwdOperandCount];
    void* ptr[kAttentionBwdOperandCount];
    attention_bwd_operand_bytes(qm, km, H, bytes, kv_heads);
    for (int i = 0; i < kAttentionBwdOperandCount; ++i) {
      parts[i].assign(bytes[i], fill);
      ptr[i] = parts[i].data();
    }
    ops = attention_bwd_operand_views(qm, km, H, ptr, Device::kCPU, 0, kv_heads);
  }
  HostBwdOperands(const HostBwdOperands&) = delete;
};

// Grouped-query attention's expectations: per-head slabs (heads x `bytes` / heads) with each slab
// repeated g times (an operand of K/V repeated per Q head), and bf16 (T, Hkv x g, 128) gradients
// summed per group of g heads in fp32, in head order, rounded once (dK, dV of grouped operands).
inline std::vector<uint8_t> repeat_slabs(const std::vector<uint8_t>& x, size_t bytes, int64_t heads, int64_t g) {
  const size_t slab = bytes / size_t(heads);
  std::vector<uint8_t> y;
  for (int64_t h = 0; h < heads * g; ++h)
    y.insert(y.end(), x.begin() + ptrdiff_t(size_t(h / g) * slab), x.begin() + ptrdiff_t(size_t(h / g + 1) * slab));
  return y;
}
// x (T, Hkv, 128) with each head repeated g times: (T, Hkv x g, 128), head h = x's h / g (K or V
// as the repeated inputs give them).
template <typename T>
std::vector<T> repeat_rows(const std::vector<T>& x, int64_t Hkv, int64_t g) {
  const size_t rows = x.size() / size_t(Hkv * kHeadDim);
  std::vector<T> y(x.size() * size_t(g));
  for (size_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < Hkv * g; ++h)
      std::copy_n(x.begin() + ptrdiff_t((t * size_t(Hkv) + size_t(h / g)) * kHeadDim), kHeadDim,
                  y.begin() + ptrdiff_t((t * size_t(Hkv * g) + size_t(h)) * kHeadDim));
  return y;
}
inline std::vector<uint16_t> group_sums(const std::vector<uint16_t>& x, int64_t Hkv, int64_t g) {
  const size_t rows = x.size() / size_t(Hkv * g * kHeadDim);
  std::vector<uint16_t> y(rows * size_t(Hkv * kHeadDim));
  for (size_t t = 0; t < rows; ++t)
    for (int64_t kh = 0; kh < Hkv; ++kh)
      for (int d = 0; d < kHeadDim; ++d) {
        float s = 0.f;
        for (int64_t j = 0; j < g; ++j) s += bf16_to_float(x[(t * size_t(Hkv * g) + size_t(kh * g + j)) * kHeadDim + d]);
        y[(t * size_t(Hkv) + size_t(kh)) * kHeadDim + size_t(d)] = float_to_bf16(s);
      }
  return y;
}

}  // namespace mxflash::test
