// mxflash::attention_forward on CPU tensors (the exact-MX reference path) and its argument checks:
// every rule gives a failed Status naming the argument, and the poisoned outputs stay untouched.
// CUDA-tagged views carry dummy pointers: a launcher that dereferenced one before rejecting it
// would crash the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "mxflash/attention.h"
#include "attention_host_mx.h"
#include "reference/attention_ref.h"

namespace mxflash {
namespace {

using test::HostMx;
using test::kDummyDevicePtr;
using test::kPoison;
using test::quantize_host;

class AttentionApi : public ::testing::Test {
 protected:
  static constexpr int64_t H = 2;
  void SetUp() override {
    ASSERT_TRUE(JaggedMeta::FromLengths({40, 0, 70}, &qm).ok());
    ASSERT_TRUE(JaggedMeta::FromLengths({33, 5, 0}, &km).ok());
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    auto draw = [&](int64_t T) {
      std::vector<float> v(size_t(T * H * kHeadDim));
      for (auto& x : v) x = nd(rng);
      return v;
    };
    qf = draw(qm.total_tokens());
    kf = draw(km.total_tokens());
    vf = draw(km.total_tokens());
    q = quantize_host(qf, qm, H, Orientation::kHdim);
    k = quantize_host(kf, km, H, Orientation::kHdim);
    v = quantize_host(vf, km, H, Orientation::kSeq);
    out.assign(size_t(qm.total_tokens() * H * kHeadDim * 2), kPoison);
    lse.assign(size_t(qm.total_tokens() * H * 4), kPoison);
  }
  TensorView out_view() { return make_view(out.data(), DType::kBFloat16, Device::kCPU, {qm.total_tokens(), H, kHeadDim}); }
  TensorView lse_view() { return make_view(lse.data(), DType::kFloat32, Device::kCPU, {H, qm.total_tokens()}); }
  Status call(const MxTensor& qq, const MxTensor& kk, const MxTensor& vv, AttentionOptions opt = {}) {
    return attention_forward(qq, kk, vv, qm, km, opt, out_view(), lse_view());
  }
  bool untouched() const {
    auto clean = [](const std::vector<uint8_t>& b) {
      return std::all_of(b.begin(), b.end(), [](uint8_t x) { return x == kPoison; });
    };
    return clean(out) && clean(lse);
  }
  void expect_rejected(const Status& st, const char* arg, const char* rule) {
    EXPECT_FALSE(st.ok());
    EXPECT_EQ(st.message().rfind(arg, 0), 0u) << "message should start with '" << arg << "': " << st.message();
    EXPECT_NE(st.message().find(rule), std::string::npos) << st.message();
    EXPECT_TRUE(untouched()) << "outputs were written by a rejected call";
  }

  JaggedMeta qm, km;
  std::vector<float> qf, kf, vf;
  HostMx q, k, v;
  std::vector<uint8_t> out, lse;
};

TEST_F(AttentionApi, CpuPathMatchesFp64AndHandlesEmptyKeys) {
  const Status st = call(q.t, k.t, v.t);
  ASSERT_TRUE(st.ok()) << st.message();
  const ref::AttnProblem p = ref::make_problem(qm, km, H, qf.data(), kf.data(), vf.data());
  ref::AttnForwardResult exact;
  ASSERT_TRUE(ref::attention_forward(p, ref::AttnMethod::kFp64, &exact).ok());
  double s = 0, n = 0;
  for (size_t i = 0; i < exact.out.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, out.data() + 2 * i, 2);
    const double o = bf16_to_float(b), r = exact.out[i];
    s += r * r;
    n += (o - r) * (o - r);
  }
  EXPECT_GT(10 * std::log10(s / n), 20.0);  // e4m3 operands and P: about 25 dB on normal data
  // Sequence 2 has no keys: its 70 rows are 0 with LSE -inf.
  for (int64_t t = 40; t < 110; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float l;
      std::memcpy(&l, lse.data() + 4 * (h * qm.total_tokens() + t), 4);
      EXPECT_TRUE(std::isinf(l) && l < 0) << "row " << t;
      for (int64_t d = 0; d < kHeadDim; ++d) {
        uint16_t b;
        std::memcpy(&b, out.data() + 2 * ((t * H + h) * kHeadDim + d), 2);
        ASSERT_EQ(bf16_to_float(b), 0.f);
      }
    }
}

TEST_F(AttentionApi, RejectsWrongOrientations) {
  MxTensor bad = q.t;
  bad.orientation = Orientation::kSeq;
  expect_rejected(call(bad, k.t, v.t), "q.orientation", "must be hdim");
  bad = v.t;
  bad.orientation = Orientation::kHdim;
  expect_rejected(call(q.t, k.t, bad), "v.orientation", "must be seq");
  bad = k.t;
  bad.payload_layout = PayloadLayout::kTokenContiguous;
  expect_rejected(call(q.t, bad, v.t), "k.payload_layout", "token_major");
}

TEST_F(AttentionApi, RejectsDtypesShapesAndHeads) {
  MxTensor bad = q.t;
  bad.payload.dtype = DType::kBFloat16;
  expect_rejected(call(bad, k.t, v.t), "q.payload", "dtype");
  bad = k.t;
  bad.scales.dtype = DType::kFloat32;
  expect_rejected(call(q.t, bad, v.t), "k.scales", "dtype");
  bad = k.t;
  bad.payload.shape[1] = 1;  // one head where q has two
  expect_rejected(call(q.t, bad, v.t), "k.payload", "heads");
  bad = q.t;
  bad.payload.shape[2] = 64;
  expect_rejected(call(bad, k.t, v.t), "q.payload", "shape");
  bad = v.t;
  bad.scales.shape[0] -= 1;
  expect_rejected(call(q.t, k.t, bad), "v.scales", "shape");
  bad = q.t;
  bad.payload.stride[0] = 2 * H * kHeadDim;
  expect_rejected(call(bad, k.t, v.t), "q.payload", "contiguous");
  bad = q.t;
  bad.payload.data = static_cast<uint8_t*>(bad.payload.data) + 1;
  expect_rejected(call(bad, k.t, v.t), "q.payload", "aligned");
}

TEST_F(AttentionApi, RejectsOutputsAndOptions) {
  TensorView o = out_view();
  o.dtype = DType::kFloat32;
  expect_rejected(attention_forward(q.t, k.t, v.t, qm, km, {}, o, lse_view()), "out", "dtype");
  TensorView l = lse_view();
  l.shape[0] = 1;
  expect_rejected(attention_forward(q.t, k.t, v.t, qm, km, {}, out_view(), l), "lse", "shape");
  AttentionOptions opt;
  opt.softmax_scale = -1.f;
  expect_rejected(call(q.t, k.t, v.t, opt), "softmax_scale", "positive");
  opt.softmax_scale = INFINITY;
  expect_rejected(call(q.t, k.t, v.t, opt), "softmax_scale", "positive");
  opt = {};
  opt.broadcast_q = true;  // q_meta holds three sequences
  expect_rejected(call(q.t, k.t, v.t, opt), "q_meta", "exactly one Q sequence");
}

TEST_F(AttentionApi, RejectsMetadataMismatch) {
  JaggedMeta two;
  ASSERT_TRUE(JaggedMeta::FromLengths({33, 5}, &two).ok());
  HostMx k2 = quantize_host(kf, two, H, Orientation::kHdim);
  HostMx v2 = quantize_host(vf, two, H, Orientation::kSeq);
  expect_rejected(attention_forward(q.t, k2.t, v2.t, qm, two, {}, out_view(), lse_view()), "q_meta", "sequences");
  JaggedMeta empty;
  expect_rejected(attention_forward(q.t, k.t, v.t, empty, km, {}, out_view(), lse_view()), "q_meta", "empty");
}

TEST_F(AttentionApi, RejectsMixedDevicesAndCudaWithoutUpload) {
  TensorView odd = lse_view();
  odd.device = Device(7);  // neither cpu nor cuda: must not be routed to the CUDA path
  expect_rejected(attention_forward(q.t, k.t, v.t, qm, km, {}, out_view(), odd), "lse", "device must be cpu or cuda");
  MxTensor bad = v.t;
  bad.payload.device = Device::kCUDA;
  bad.payload.data = kDummyDevicePtr;
  expect_rejected(call(q.t, k.t, bad), "v.payload", "same device");
  // Every tensor on CUDA: a CPU-only build says CUDA is not built; a CUDA build wants the
  // metadata uploaded first. Neither touches the dummy pointers.
  auto cuda = [](MxTensor t) {
    t.payload.device = t.scales.device = Device::kCUDA;
    t.payload.data = t.scales.data = kDummyDevicePtr;
    return t;
  };
  TensorView o = out_view(), l = lse_view();
  o.device = l.device = Device::kCUDA;
  o.data = l.data = kDummyDevicePtr;
  const Status st = attention_forward(cuda(q.t), cuda(k.t), cuda(v.t), qm, km, {}, o, l);
  EXPECT_FALSE(st.ok());
#ifdef MXFLASH_WITH_CUDA
  // Without a device the current-device query fails first; with one, the missing upload does.
  EXPECT_TRUE(st.code() == StatusCode::kCudaError || st.message().rfind("q_meta", 0) == 0) << st.message();
#else
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.message();
#endif
  EXPECT_TRUE(untouched());
}

// ---------------------------------------------------- forward operands in the execution layout
using test::HostOperands;

TEST_F(AttentionApi, OperandsForwardMatchesMxForwardAndWritesEveryByte) {
  HostOperands ho(qm, km, H);
  auto x = [](std::vector<float>& f, const JaggedMeta& m) {
    return make_view(f.data(), DType::kFloat32, Device::kCPU, {m.total_tokens(), H, kHeadDim});
  };
  Status st = quantize_attention_forward(x(qf, qm), x(kf, km), x(vf, km), qm, km, ho.ops);
  ASSERT_TRUE(st.ok()) << st.message();
  // Every byte written: padding rows zero, q_scale 1 there (rows 40..127 of sequence 0's tile).
  const int64_t Pq = qm.padded_tokens();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 40; r < 128; ++r) {
      float sc;
      std::memcpy(&sc, ho.q_scale.data() + 4 * (h * Pq + r), 4);
      EXPECT_EQ(sc, 1.f);
      for (int d = 0; d < kHeadDim; ++d) ASSERT_EQ(ho.q[size_t((h * Pq + r) * kHeadDim + d)], 0) << "row " << r;
    }
  // The forward on the operands against the forward on MX tensors (the same values up to the
  // re-expression's rounding below e4m3's subnormal floor).
  ASSERT_TRUE(call(q.t, k.t, v.t).ok());
  const std::vector<uint8_t> out_mx = out, lse_mx = lse;
  std::fill(out.begin(), out.end(), test::kPoison);
  std::fill(lse.begin(), lse.end(), test::kPoison);
  st = attention_forward(ho.ops, qm, km, {}, out_view(), lse_view());
  ASSERT_TRUE(st.ok()) << st.message();
  double s = 0, n = 0;
  for (size_t i = 0; i < out.size() / 2; ++i) {
    uint16_t a, b;
    std::memcpy(&a, out_mx.data() + 2 * i, 2);
    std::memcpy(&b, out.data() + 2 * i, 2);
    const double r = bf16_to_float(a), o = bf16_to_float(b);
    ASSERT_TRUE(std::isfinite(o)) << "out[" << i << "]";
    s += r * r;
    n += (o - r) * (o - r);
  }
  EXPECT_GT(10 * std::log10(s / std::max(n, 1e-300)), 40.0);
  for (size_t i = 0; i < lse.size() / 4; ++i) {
    float a, b;
    std::memcpy(&a, lse_mx.data() + 4 * i, 4);
    std::memcpy(&b, lse.data() + 4 * i, 4);
    if (std::isinf(a)) EXPECT_EQ(a, b) << "lse[" << i << "]";
    else EXPECT_NEAR(a, b, 1e-3f * std::max(1.f, std::fabs(a))) << "lse[" << i << "]";
  }
  // bf16 inputs give the bytes fp32 inputs of the same values give.
  auto bf = [](const std::vector<float>& f) {
    std::vector<uint16_t> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = float_to_bf16(f[i]);
    return b;
  };
  auto widen = [](const std::vector<uint16_t>& b) {
    std::vector<float> f(b.size());
    for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
    return f;
  };
  std::vector<uint16_t> qb = bf(qf), kb = bf(kf), vb = bf(vf);
  std::vector<float> qw = widen(qb), kw = widen(kb), vw = widen(vb);
  HostOperands from_bf16(qm, km, H), from_f32(qm, km, H, 0x5A);
  auto xb = [](std::vector<uint16_t>& b, const JaggedMeta& m) {
    return make_view(b.data(), DType::kBFloat16, Device::kCPU, {m.total_tokens(), H, kHeadDim});
  };
  ASSERT_TRUE(quantize_attention_forward(xb(qb, qm), xb(kb, km), xb(vb, km), qm, km, from_bf16.ops).ok());
  ASSERT_TRUE(quantize_attention_forward(x(qw, qm), x(kw, km), x(vw, km), qm, km, from_f32.ops).ok());
  for (const auto& [a, b] : {std::pair{&from_bf16.q, &from_f32.q}, std::pair{&from_bf16.k, &from_f32.k},
                             std::pair{&from_bf16.v, &from_f32.v}, std::pair{&from_bf16.q_scale, &from_f32.q_scale},
                             std::pair{&from_bf16.k_scale, &from_f32.k_scale},
                             std::pair{&from_bf16.v_scale, &from_f32.v_scale}})
    EXPECT_TRUE(std::equal(a->begin(), a->end() - 16, b->begin()));
}

TEST_F(AttentionApi, OperandsRejectBadInput) {
  HostOperands ho(qm, km, H);
  auto x = [](std::vector<float>& f, const JaggedMeta& m) {
    return make_view(f.data(), DType::kFloat32, Device::kCPU, {m.total_tokens(), H, kHeadDim});
  };
  ASSERT_TRUE(quantize_attention_forward(x(qf, qm), x(kf, km), x(vf, km), qm, km, ho.ops).ok());
  auto fwd = [&](const AttentionFwdOperands& o, AttentionOptions opt = {}) {
    return attention_forward(o, qm, km, opt, out_view(), lse_view());
  };
  AttentionFwdOperands bad = ho.ops;
  bad.v_scale.shape[1] += 1;
  expect_rejected(fwd(bad), "ops.v_scale", "shape");
  bad = ho.ops;
  bad.k.dtype = DType::kFloat32;
  expect_rejected(fwd(bad), "ops.k", "dtype");
  bad = ho.ops;
  bad.v.data = static_cast<uint8_t*>(bad.v.data) + 1;
  expect_rejected(fwd(bad), "ops.v", "align");
  bad = ho.ops;
  bad.q_scale.device = Device::kCUDA;
  bad.q_scale.data = kDummyDevicePtr;
  expect_rejected(fwd(bad), "ops.q_scale", "same device");
  AttentionOptions exact;
  exact.exact_mx = true;
  expect_rejected(fwd(ho.ops, exact), "opt.exact_mx", "MX tensors");
  // Operands of another head count than the outputs.
  HostOperands three(qm, km, 3);
  expect_rejected(fwd(three.ops), "out", "shape");
  // The quantizer's inputs: mixed dtypes, head counts, devices.
  HostOperands dst(qm, km, H);
  std::vector<uint16_t> kb(kf.size());
  const TensorView kbf = make_view(kb.data(), DType::kBFloat16, Device::kCPU, {km.total_tokens(), H, kHeadDim});
  Status st = quantize_attention_forward(x(qf, qm), kbf, x(vf, km), qm, km, dst.ops);
  EXPECT_EQ(st.message().rfind("k:", 0), 0u) << st.message();
  st = quantize_attention_forward(x(qf, qm), x(kf, km), x(vf, km), qm, km, three.ops);
  EXPECT_EQ(st.message().rfind("ops.q", 0), 0u) << st.message();
  JaggedMeta two;  // neither one shared Q sequence nor one per K/V sequence (km has 3)
  ASSERT_TRUE(JaggedMeta::FromLengths({40, 70}, &two).ok());
  std::vector<float> q2(size_t(110 * H * kHeadDim), 0.f);
  st = quantize_attention_forward(x(q2, two), x(kf, km), x(vf, km), two, km, dst.ops);
  EXPECT_EQ(st.message().rfind("q_meta", 0), 0u) << st.message();
  TensorView vc = x(vf, km);
  vc.device = Device::kCUDA;
  vc.data = kDummyDevicePtr;
  st = quantize_attention_forward(x(qf, qm), x(kf, km), vc, qm, km, dst.ops);
  EXPECT_EQ(st.message().rfind("v", 0), 0u) << st.message();
  EXPECT_TRUE(std::all_of(dst.q.begin(), dst.q.end(), [](uint8_t b) { return b == test::kPoison; }))
      << "a rejected quantize wrote its output";
}

}  // namespace
}  // namespace mxflash

namespace mxflash {
namespace {

TEST(AttentionWorkspace, ZeroForMetadataTheLauncherRejects) {
  JaggedMeta one, three;
  ASSERT_TRUE(JaggedMeta::FromLengths({64}, &one).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths({64, 0, 300}, &three).ok());
  AttentionOptions opt;
  EXPECT_EQ(attention_forward_workspace_size(one, three, 2, opt), 0u);  // batch mismatch
  opt.broadcast_q = true;
  EXPECT_EQ(attention_forward_workspace_size(three, three, 2, opt), 0u);  // broadcast needs one Q sequence
#ifdef MXFLASH_WITH_CUDA
  EXPECT_GT(attention_forward_workspace_size(one, three, 2, opt), 0u);
  opt.broadcast_q = false;
  EXPECT_GT(attention_forward_workspace_size(three, three, 2, opt), 0u);
#endif
}

TEST(AttentionWorkspace, OperandsFormNeedsOnlyItsWorkList) {
  JaggedMeta one, three;
  ASSERT_TRUE(JaggedMeta::FromLengths({64}, &one).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths({64, 0, 300}, &three).ok());
  AttentionOptions opt;
  EXPECT_EQ(attention_forward_operands_workspace_size(one, three, 2, opt), 0u);  // batch mismatch
  opt.broadcast_q = true;
  EXPECT_EQ(attention_forward_operands_workspace_size(three, three, 2, opt), 0u);
#ifdef MXFLASH_WITH_CUDA
  // One shared 64-row Q sequence against 3 K/V sequences: 3 Q tiles of 8 bytes, rounded to 256.
  EXPECT_EQ(attention_forward_operands_workspace_size(one, three, 2, opt), 256u);
  opt.broadcast_q = false;
  EXPECT_EQ(attention_forward_operands_workspace_size(three, three, 2, opt), 256u);
  EXPECT_LT(attention_forward_operands_workspace_size(three, three, 2, opt),
            attention_forward_workspace_size(three, three, 2, opt));
#else
  EXPECT_EQ(attention_forward_operands_workspace_size(one, three, 2, opt), 0u);
#endif
}

TEST(AttentionWorkspace, BackwardZeroForRejectedMetadataAndGrowsWithOptions) {
  JaggedMeta one, three;
  ASSERT_TRUE(JaggedMeta::FromLengths({64}, &one).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths({64, 0, 300}, &three).ok());
  AttentionBackwardOptions opt;
  EXPECT_EQ(attention_backward_workspace_size(one, three, 2, opt), 0u);  // batch mismatch
  EXPECT_EQ(attention_backward_workspace_size(three, three, 0, opt), 0u);  // no heads
  opt.broadcast_q = true;
  EXPECT_EQ(attention_backward_workspace_size(three, three, 2, opt), 0u);  // broadcast needs one Q sequence
#ifdef MXFLASH_WITH_CUDA
  const size_t bcast = attention_backward_workspace_size(one, three, 2, opt);
  opt.broadcast_q = false;
  const size_t plain = attention_backward_workspace_size(three, three, 2, opt);
  EXPECT_GT(plain, 0u);
  EXPECT_GT(bcast, 0u);
  opt.output_mxfp8_dkv = true;  // fp32 dK, dV before their quantization: 2 x 4 x Tk x H x 128 more
  EXPECT_GE(attention_backward_workspace_size(three, three, 2, opt), plain + 2 * 4 * 364 * 2 * 128);
  EXPECT_GT(attention_backward_workspace_size(three, three, 4, opt), attention_backward_workspace_size(three, three, 2, opt));
#endif
}

}  // namespace
}  // namespace mxflash
