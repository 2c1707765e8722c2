// Grouped-query attention on the operand path, CPU (the definition the CUDA path is tested against,
// tests/gpu/test_attention_gqa_gpu.cpp): K and V with Hkv heads (a divisor of Q's H) quantize to the
// bytes of the repeated inputs' head h / g; the forward on them gives the repeated forward's bytes;
// the backward dQ's bytes and, for dK and dV (Tk, Hkv, 128), each group's sum of the repeated
// backward's per-head bf16 gradients, rounded once. Bad head counts and options are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "attention_host_mx.h"
#include "mxflash/attention.h"

namespace mxflash {
namespace {

std::vector<uint16_t> draw(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(n);
  for (auto& e : x) e = float_to_bf16(nd(rng));
  return x;
}

TensorView bf16_view(std::vector<uint16_t>& x, int64_t T, int64_t heads) {
  return make_view(x.data(), DType::kBFloat16, Device::kCPU, {T, heads, kHeadDim});
}

using test::group_sums;
using test::repeat_slabs;

void run(const std::vector<int64_t>& q_lengths, const std::vector<int64_t>& k_lengths, int64_t H, int64_t Hkv,
         bool broadcast_q, CausalMask causal, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "H " << H << ", Hkv " << Hkv << ", causal " << int(causal));
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths(q_lengths, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths(k_lengths, &km).ok());
  const int64_t g = H / Hkv, Tq = qm.total_tokens(), Tk = km.total_tokens();
  const int64_t To = broadcast_q ? km.batch() * Tq : Tq;
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> q = draw(size_t(Tq * H * kHeadDim), rng), k = draw(size_t(Tk * Hkv * kHeadDim), rng),
                        v = draw(k.size(), rng), dout = draw(size_t(To * H * kHeadDim), rng);
  std::vector<uint16_t> kr = test::repeat_rows(k, Hkv, g), vr = test::repeat_rows(v, Hkv, g);

  test::HostOperands gf(qm, km, H, test::kPoison, Hkv), ff(qm, km, H);
  test::HostBwdOperands gb(qm, km, H, test::kPoison, Hkv), fb(qm, km, H);
  for (auto* b : {&gb, &fb}) {  // bwd's Q' and K' view fwd's
    const AttentionFwdOperands& f = b == &gb ? gf.ops : ff.ops;
    b->ops.q = f.q, b->ops.q_scale = f.q_scale, b->ops.k = f.k, b->ops.k_scale = f.k_scale;
  }
  Status st = quantize_attention_training(bf16_view(q, Tq, H), bf16_view(k, Tk, Hkv), bf16_view(v, Tk, Hkv), qm, km,
                                          gf.ops, gb.ops);
  ASSERT_TRUE(st.ok()) << st.message();
  st = quantize_attention_training(bf16_view(q, Tq, H), bf16_view(kr, Tk, H), bf16_view(vr, Tk, H), qm, km, ff.ops,
                                   fb.ops);
  ASSERT_TRUE(st.ok()) << st.message();
  size_t gbytes[kAttentionFwdOperandCount], fbytes[kAttentionFwdOperandCount];
  attention_fwd_operand_bytes(qm, km, H, gbytes, Hkv);
  attention_fwd_operand_bytes(qm, km, H, fbytes);
  for (int i = 0; i < kAttentionFwdOperandCount; ++i) {  // q, k, v, q_scale, k_scale, v_scale
    const bool kside = i == 1 || i == 2 || i == 4 || i == 5;
    const std::vector<uint8_t> want(ff.parts[i].begin(), ff.parts[i].begin() + ptrdiff_t(fbytes[i]));
    const std::vector<uint8_t> got = kside ? repeat_slabs(gf.parts[i], gbytes[i], Hkv, g)
                                           : std::vector<uint8_t>(gf.parts[i].begin(), gf.parts[i].begin() + ptrdiff_t(gbytes[i]));
    EXPECT_TRUE(got == want) << "fwd operand " << i;
  }
  size_t gbb[kAttentionBwdOperandCount];
  attention_bwd_operand_bytes(qm, km, H, gbb, Hkv);
  for (int i : {2, 4, 7, 9})  // v, kt, v_scale, kt_scale (K-side, written by the backward's passes)
    EXPECT_TRUE(repeat_slabs(gb.parts[i], gbb[i], Hkv, g) == fb.parts[i]) << "bwd operand " << i;
  for (int i : {3, 8}) EXPECT_TRUE(gb.parts[i] == fb.parts[i]) << "bwd operand " << i;

  // The forward: the repeated forward's bytes.
  AttentionOptions fo;
  fo.broadcast_q = broadcast_q;
  fo.causal = causal;
  std::vector<uint16_t> out_g(size_t(To * H * kHeadDim)), out_f(out_g.size());
  std::vector<float> lse_g(size_t(H * To)), lse_f(lse_g.size());
  for (auto& [ops, o, l] : {std::tuple{&gf.ops, &out_g, &lse_g}, std::tuple{&ff.ops, &out_f, &lse_f}}) {
    st = attention_forward(*ops, qm, km, fo, bf16_view(*o, To, H), make_view(l->data(), DType::kFloat32, Device::kCPU, {H, To}));
    ASSERT_TRUE(st.ok()) << st.message();
  }
  EXPECT_TRUE(out_g == out_f) << "grouped out";
  EXPECT_TRUE(std::memcmp(lse_g.data(), lse_f.data(), lse_g.size() * 4) == 0) << "grouped lse";

  // The backward: dQ the repeated one's bytes, dK and dV its per-head gradients' group sums.
  AttentionBackwardOptions bo;
  bo.broadcast_q = broadcast_q;
  bo.causal = causal;
  std::vector<uint16_t> dq_g(q.size(), 0xFFFF), dk_g(k.size(), 0xFFFF), dv_g(k.size(), 0xFFFF);
  std::vector<uint16_t> dq_f(q.size()), dk_f(kr.size()), dv_f(kr.size());
  const TensorView lse_view = make_view(lse_f.data(), DType::kFloat32, Device::kCPU, {H, To});
  st = attention_backward(fb.ops, bf16_view(out_f, To, H), bf16_view(dout, To, H), lse_view, qm, km, bo,
                          bf16_view(dq_f, Tq, H), bf16_view(dk_f, Tk, H), bf16_view(dv_f, Tk, H));
  ASSERT_TRUE(st.ok()) << st.message();
  {  // refused, nothing written: MXFP8 dK, dV with grouped operands; dk of H heads
    AttentionBackwardOptions mo = bo;
    mo.output_mxfp8_dkv = true;
    std::vector<uint8_t> pk(k.size()), pv(k.size()), sk(size_t(Tk * Hkv * 4)), sv(sk.size());
    auto e4 = [&](std::vector<uint8_t>& x) { return make_view(x.data(), DType::kE4M3, Device::kCPU, {Tk, Hkv, kHeadDim}); };
    auto e8 = [&](std::vector<uint8_t>& x) { return make_view(x.data(), DType::kE8M0, Device::kCPU, {Tk, Hkv, 4}); };
    st = attention_backward(gb.ops, bf16_view(out_f, To, H), bf16_view(dout, To, H), lse_view, qm, km, mo,
                            bf16_view(dq_g, Tq, H), e4(pk), e4(pv), e8(sk), e8(sv));
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.message();
    EXPECT_EQ(st.message().rfind("output_mxfp8_dkv: not with grouped-query attention", 0), 0u) << st.message();
    st = attention_backward(gb.ops, bf16_view(out_f, To, H), bf16_view(dout, To, H), lse_view, qm, km, bo,
                            bf16_view(dq_g, Tq, H), bf16_view(dk_f, Tk, H), bf16_view(dv_f, Tk, H));
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
    EXPECT_EQ(st.message().rfind("dk: shape must be", 0), 0u) << st.message();
    EXPECT_TRUE(std::all_of(dq_g.begin(), dq_g.end(), [](uint16_t x) { return x == 0xFFFF; }));
  }
  st = attention_backward(gb.ops, bf16_view(out_f, To, H), bf16_view(dout, To, H), lse_view, qm, km, bo,
                          bf16_view(dq_g, Tq, H), bf16_view(dk_g, Tk, Hkv), bf16_view(dv_g, Tk, Hkv));
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(dq_g == dq_f) << "grouped dQ";
  EXPECT_TRUE(dk_g == group_sums(dk_f, Hkv, g)) << "grouped dK";
  EXPECT_TRUE(dv_g == group_sums(dv_f, Hkv, g)) << "grouped dV";
}

TEST(AttentionGqa, OperandsForwardBackwardMatchRepeatedHeads) {
  run({40, 0, 129, 1, 200}, {70, 17, 129, 0, 256}, 4, 2, false, CausalMask::kNone, 1);
  run({40, 0, 129, 1, 200}, {70, 17, 129, 0, 256}, 3, 1, false, CausalMask::kTopLeft, 2);
  run({130}, {70, 0, 300}, 6, 3, true, CausalMask::kBottomRight, 3);
}

TEST(AttentionGqa, HeadCountsAreChecked) {
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths({20, 30}, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths({25, 5}, &km).ok());
  std::mt19937_64 rng(9);
  std::vector<uint16_t> q = draw(50 * 4 * kHeadDim, rng), k3 = draw(30 * 3 * kHeadDim, rng), k2 = draw(30 * 2 * kHeadDim, rng);
  test::HostOperands ops(qm, km, 4, test::kPoison, 2);
  Status st = quantize_attention_forward(bf16_view(q, 50, 4), bf16_view(k3, 30, 3), bf16_view(k3, 30, 3), qm, km, ops.ops);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "k: has 3 heads, which must divide q's 4 (the same count, or a grouped-query share of it)");
  std::vector<uint16_t> v3 = draw(30 * 3 * kHeadDim, rng);
  st = quantize_attention_forward(bf16_view(q, 50, 4), bf16_view(k2, 30, 2), bf16_view(v3, 30, 3), qm, km, ops.ops);
  EXPECT_EQ(st.message(), "v: shape must be (30, 2, 128), got (30, 3, 128)");
  test::HostOperands wrong(qm, km, 4);  // operands of 4 K/V heads for k of 2
  st = quantize_attention_forward(bf16_view(q, 50, 4), bf16_view(k2, 30, 2), bf16_view(k2, 30, 2), qm, km, wrong.ops);
  EXPECT_EQ(st.message(), "ops.k: has 4 heads, k has 2");
  for (const auto& p : ops.parts)
    EXPECT_TRUE(std::all_of(p.begin(), p.end(), [](uint8_t b) { return b == test::kPoison; })) << "written";
  // The size queries: 0 where the call would refuse.
  AttentionBackwardOptions bo;
  EXPECT_EQ(attention_backward_operands_workspace_size(qm, km, 4, bo, 3), 0u);
  bo.output_mxfp8_dkv = true;
  EXPECT_EQ(attention_backward_operands_workspace_size(qm, km, 4, bo, 2), 0u);
  const AttentionFwdOperandShapes s = attention_fwd_operand_shapes(qm, km, 4, 2);
  EXPECT_EQ(s.q[0], 4);
  EXPECT_EQ(s.k[0], 2);
  EXPECT_EQ(s.v[0], 2);
  EXPECT_EQ(s.v_scale[0], 2);
}

}  // namespace
}  // namespace mxflash
