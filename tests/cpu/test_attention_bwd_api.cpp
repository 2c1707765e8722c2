// mxflash::attention_backward on CPU tensors (the exact-MX reference path) and its argument checks:
// the public call on MX operands quantized by the library must give the reference's gradients
// bit for bit; every rejected call names the argument and leaves the poisoned outputs untouched.
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
using test::to_bf16_bits;


double sqnr_db(const std::vector<uint16_t>& out, const std::vector<double>& ref) {
  double s = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = bf16_to_float(out[i]) - ref[i];
    s += ref[i] * ref[i];
    n += e * e;
  }
  return 10 * std::log10(s / n);
}

class AttentionBwdApi : public ::testing::Test {
 protected:
  static constexpr int64_t H = 2;

  // Q lengths, K/V lengths, broadcast_q.
  void build(std::vector<int64_t> lq, std::vector<int64_t> lk, bool broadcast) {
    broadcast_q = broadcast;
    ASSERT_TRUE(JaggedMeta::FromLengths(lq, &qm).ok());
    ASSERT_TRUE(JaggedMeta::FromLengths(lk, &km).ok());
    std::mt19937 rng(11);
    std::normal_distribution<float> nd;
    auto draw = [&](int64_t T) {
      std::vector<float> v(size_t(T * H * kHeadDim));
      for (auto& x : v) x = nd(rng);
      return v;
    };
    // Q and K channels with magnitudes 2^-6..2^6: blocks along the head dim and along tokens then
    // get different scales and small channels fall into e4m3 subnormals in one orientation only,
    // so an operand fed in the wrong orientation changes the bits. Q is scaled down to keep the
    // scores moderate.
    auto spread = [](std::vector<float> v, float s) {
      for (size_t i = 0; i < v.size(); ++i) v[i] *= s * std::ldexp(1.f, int(i % kHeadDim) % 13 - 6);
      return v;
    };
    qf = spread(draw(qm.total_tokens()), 1.f / 256);
    kf = spread(draw(km.total_tokens()), 1.f);
    vf = draw(km.total_tokens());
    To = broadcast ? km.batch() * qm.total_tokens() : qm.total_tokens();
    doutf = draw(To);
    for (auto& x : doutf) x = bf16_to_float(float_to_bf16(x));  // dO arrives in bf16
    p = ref::make_problem(qm, km, H, qf.data(), kf.data(), vf.data(), ref::kDefaultSoftmaxScale, broadcast);
    ASSERT_TRUE(ref::attention_forward(p, ref::AttnMethod::kMx, &fwd).ok());
    q = quantize_host(qf, qm, H, Orientation::kHdim);
    q_seq = quantize_host(qf, qm, H, Orientation::kSeq);
    k = quantize_host(kf, km, H, Orientation::kHdim);
    k_seq = quantize_host(kf, km, H, Orientation::kSeq);
    v = quantize_host(vf, km, H, Orientation::kHdim);
    out_bits = to_bf16_bits(fwd.out);
    dout_bits.resize(doutf.size());
    for (size_t i = 0; i < doutf.size(); ++i) dout_bits[i] = float_to_bf16(doutf[i]);
    lse_f.assign(fwd.lse.begin(), fwd.lse.end());
    dq.assign(size_t(qm.total_tokens() * H * kHeadDim * 2), kPoison);
    dk.assign(size_t(km.total_tokens() * H * kHeadDim * 2), kPoison);
    dv.assign(size_t(km.total_tokens() * H * kHeadDim * 2), kPoison);
  }
  TensorView bf16_view(void* d, int64_t T) { return make_view(d, DType::kBFloat16, Device::kCPU, {T, H, kHeadDim}); }
  TensorView out_view() { return bf16_view(out_bits.data(), To); }
  TensorView dout_view() { return bf16_view(dout_bits.data(), To); }
  TensorView lse_view() { return make_view(lse_f.data(), DType::kFloat32, Device::kCPU, {H, To}); }
  TensorView dq_view() { return bf16_view(dq.data(), qm.total_tokens()); }
  TensorView dk_view() { return bf16_view(dk.data(), km.total_tokens()); }
  TensorView dv_view() { return bf16_view(dv.data(), km.total_tokens()); }
  AttentionBackwardOptions options() const {
    AttentionBackwardOptions o;
    o.broadcast_q = broadcast_q;
    return o;
  }
  Status call(const AttentionBackwardOptions& opt) {
    return attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, km, opt,
                              dq_view(), dk_view(), dv_view());
  }
  Status call() { return call(options()); }
  std::vector<uint16_t> bits(const std::vector<uint8_t>& b) const {
    std::vector<uint16_t> r(b.size() / 2);
    std::memcpy(r.data(), b.data(), b.size());
    return r;
  }
  bool untouched() const {
    auto clean = [](const std::vector<uint8_t>& b) {
      return std::all_of(b.begin(), b.end(), [](uint8_t x) { return x == kPoison; });
    };
    return clean(dq) && clean(dk) && clean(dv);
  }
  // An fp32 host input (qf, kf or vf) on the metadata m.
  TensorView x(std::vector<float>& v, const JaggedMeta& m) {
    return make_view(v.data(), DType::kFloat32, Device::kCPU, {m.total_tokens(), H, kHeadDim});
  }
  // The operand tests' batch: jagged with empty and one-key sequences, or broadcast Q.
  void build_operand_case(bool bcast) {
    if (bcast)
      build({70}, {33, 1, 0, 200}, true);
    else
      build({40, 17, 70, 129}, {33, 1, 0, 300}, false);
  }
  void expect_rejected(const Status& st, const char* arg, const char* rule) {
    EXPECT_FALSE(st.ok());
    EXPECT_EQ(st.message().rfind(arg, 0), 0u) << "message should start with '" << arg << "': " << st.message();
    EXPECT_NE(st.message().find(rule), std::string::npos) << st.message();
    EXPECT_TRUE(untouched()) << "outputs were written by a rejected call";
  }
  // The public call against the reference on the same fp32 inputs: identical bits, and a sane SQNR
  // against the FP64 gradients.
  void check_against_reference() {
    const Status st = call();
    ASSERT_TRUE(st.ok()) << st.message();
    ref::AttnBackwardResult mx, exact;
    ASSERT_TRUE(ref::attention_backward(p, ref::AttnMethod::kMx, fwd, doutf.data(), &mx).ok());
    EXPECT_EQ(bits(dq), to_bf16_bits(mx.dq));
    EXPECT_EQ(bits(dk), to_bf16_bits(mx.dk));
    EXPECT_EQ(bits(dv), to_bf16_bits(mx.dv));
    ref::AttnForwardResult fwd64;
    ASSERT_TRUE(ref::attention_forward(p, ref::AttnMethod::kFp64, &fwd64).ok());
    ASSERT_TRUE(ref::attention_backward(p, ref::AttnMethod::kFp64, fwd64, doutf.data(), &exact).ok());
    EXPECT_GT(sqnr_db(bits(dq), exact.dq), 10.0);  // REFERENCE §6 floors: dQ 10 dB, dK and dV 8 dB
    EXPECT_GT(sqnr_db(bits(dk), exact.dk), 10.0);
    EXPECT_GT(sqnr_db(bits(dv), exact.dv), 10.0);
  }

  bool broadcast_q = false;
  int64_t To = 0;
  JaggedMeta qm, km;
  std::vector<float> qf, kf, vf, doutf, lse_f;
  ref::AttnProblem p;
  ref::AttnForwardResult fwd;
  HostMx q, q_seq, k, k_seq, v;
  std::vector<uint16_t> out_bits, dout_bits;
  std::vector<uint8_t> dq, dk, dv;
};

TEST_F(AttentionBwdApi, CpuPathEqualsReferenceOnJaggedBatch) {
  // K/V sequence 1 has one key (dS = 0 exactly), sequence 2 none (zero gradients).
  build({40, 17, 70}, {33, 1, 0}, false);
  check_against_reference();
  const std::vector<uint16_t> g = bits(dq), gk = bits(dk);
  for (int64_t i = (40 + 17) * H * kHeadDim; i < int64_t(g.size()); ++i) ASSERT_EQ(bf16_to_float(g[size_t(i)]), 0.f);
  for (int64_t i = 33 * H * kHeadDim; i < 34 * H * kHeadDim; ++i) ASSERT_EQ(bf16_to_float(gk[size_t(i)]), 0.f);
  for (int64_t i = 40 * H * kHeadDim; i < 57 * H * kHeadDim; ++i) ASSERT_EQ(bf16_to_float(g[size_t(i)]), 0.f);
}

TEST_F(AttentionBwdApi, CpuPathEqualsReferenceWithBroadcastQ) {
  build({24}, {33, 1, 50}, true);
  check_against_reference();
}

TEST_F(AttentionBwdApi, RejectsOperandsAndTensors) {
  build({40, 17}, {33, 9}, false);
  expect_rejected(attention_backward(q.t, q.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, km,
                                     options(), dq_view(), dk_view(), dv_view()),
                  "q_seq.orientation", "must be seq");
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, k_seq.t, k_seq.t, out_view(), dout_view(), lse_view(), qm,
                                     km, options(), dq_view(), dk_view(), dv_view()),
                  "v.orientation", "must be hdim");
  TensorView bad = dout_view();
  bad.dtype = DType::kFloat32;
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), bad, lse_view(), qm, km, options(),
                                     dq_view(), dk_view(), dv_view()),
                  "dout", "dtype");
  TensorView short_dk = bf16_view(dk.data(), km.total_tokens() - 1);
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, km,
                                     options(), dq_view(), short_dk, dv_view()),
                  "dk", "shape");
  JaggedMeta other;
  ASSERT_TRUE(JaggedMeta::FromLengths({33}, &other).ok());
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, other,
                                     options(), dq_view(), dk_view(), dv_view()),
                  "q_meta", "sequences");
}

TEST_F(AttentionBwdApi, RejectsOptionsNotImplementedOrOutOfRange) {
  build({40}, {33}, false);
  AttentionBackwardOptions o = options();
  o.dq_accum = DqAccum(5);
  Status st = call(o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  expect_rejected(st, "dq_accum", "fp32 or fp16");
  o = options();
  o.p_scale = PScaleMode(7);
  expect_rejected(call(o), "p_scale", "constant or dynamic");
  o = options();
  o.dq_fp16_scale_log2 = 16;
  st = call(o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  expect_rejected(st, "dq_fp16_scale_log2", "0..15");
  o = options();
  o.softmax_scale = -1.f;
  expect_rejected(call(o), "softmax_scale", "positive");
}

// dq_accum = fp16 (the CPU reference's model of an fp16 accumulator with a static 2^k scale): close
// to the fp32 accumulation but not identical; too large a scale overflows to inf, as on a GPU.
TEST_F(AttentionBwdApi, Fp16DqAccumulationIsModelled) {
  build({40, 17, 300}, {33, 1, 400}, false);
  ASSERT_TRUE(call().ok());
  const std::vector<uint16_t> dq32 = bits(dq), dk32 = bits(dk);
  AttentionBackwardOptions o = options();
  o.dq_accum = DqAccum::kFp16;
  o.dq_fp16_scale_log2 = 4;  // this fixture's K channels reach 2^6: dQ beyond 2^12 of fp16's 65504
  const Status st = call(o);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(bits(dk), dk32) << "only dQ changes";
  std::vector<double> ref32(dq32.size());
  for (size_t i = 0; i < dq32.size(); ++i) ref32[i] = bf16_to_float(dq32[i]);
  EXPECT_NE(bits(dq), dq32) << "fp16 accumulation should round some dQ values differently";
  EXPECT_GT(sqnr_db(bits(dq), ref32), 30.0);
  // dO scaled by 2^10 and the accumulator by 2^15: dQ x 2^25 overflows fp16.
  for (auto& b : dout_bits) b = float_to_bf16(bf16_to_float(b) * 1024.f);
  o.dq_fp16_scale_log2 = 15;
  ASSERT_TRUE(call(o).ok());
  const std::vector<uint16_t> big = bits(dq);
  EXPECT_TRUE(std::any_of(big.begin(), big.end(), [](uint16_t b) { return std::isinf(bf16_to_float(b)); }));
}

// p_scale = dynamic: P for dV in 1x32 blocks with their own scales. Only dV changes.
TEST_F(AttentionBwdApi, DynamicPScalesChangeOnlyDv) {
  build({40, 17, 300}, {33, 1, 400}, false);
  ASSERT_TRUE(call().ok());
  const std::vector<uint16_t> dq0 = bits(dq), dk0 = bits(dk), dv0 = bits(dv);
  AttentionBackwardOptions o = options();
  o.p_scale = PScaleMode::kDynamic;
  ASSERT_TRUE(call(o).ok());
  EXPECT_EQ(bits(dq), dq0);
  EXPECT_EQ(bits(dk), dk0);
  EXPECT_NE(bits(dv), dv0) << "per-block P scales should round some P values differently";
  std::vector<double> ref0(dv0.size());
  for (size_t i = 0; i < dv0.size(); ++i) ref0[i] = bf16_to_float(dv0[i]);
  EXPECT_GT(sqnr_db(bits(dv), ref0), 30.0);
}

// output_mxfp8_dkv: dK, dV as E4M3 in 32x32 blocks (from each K sequence start) with per-token-row
// scales (Tk, H, 4); dQ unchanged. The dequantized values track the bf16 gradients to e4m3 precision.
TEST_F(AttentionBwdApi, Mxfp8DkDvOutputs) {
  build({40, 17, 300}, {33, 1, 400}, false);
  ASSERT_TRUE(call().ok());
  const std::vector<uint16_t> dq0 = bits(dq), dk0 = bits(dk), dv0 = bits(dv);
  const int64_t Tk = km.total_tokens();
  std::vector<uint8_t> pk(size_t(Tk * H * kHeadDim), kPoison), pv(pk.size(), kPoison);
  std::vector<uint8_t> sk(size_t(Tk * H * 4), kPoison), sv(sk.size(), kPoison);
  auto pay = [&](std::vector<uint8_t>& b) { return make_view(b.data(), DType::kE4M3, Device::kCPU, {Tk, H, kHeadDim}); };
  auto sc = [&](std::vector<uint8_t>& b) { return make_view(b.data(), DType::kE8M0, Device::kCPU, {Tk, H, 4}); };
  AttentionBackwardOptions o = options();
  o.output_mxfp8_dkv = true;
  const Status st = attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, km, o,
                                       dq_view(), pay(pk), pay(pv), sc(sk), sc(sv));
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(bits(dq), dq0);
  for (auto [payload, scales, ref_bits] : {std::tuple{&pk, &sk, &dk0}, std::tuple{&pv, &sv, &dv0}}) {
    std::vector<uint16_t> deq(payload->size());
    std::vector<double> ref(payload->size());
    for (int64_t t = 0; t < Tk; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int d = 0; d < kHeadDim; ++d) {
          const size_t i = size_t((t * H + h) * kHeadDim + d);
          deq[i] = float_to_bf16(dequantize_element((*payload)[i], (*scales)[size_t((t * H + h) * 4 + d / 32)]));
          ref[i] = bf16_to_float((*ref_bits)[i]);
        }
    EXPECT_GT(sqnr_db(deq, ref), 25.0);  // e4m3: 3 mantissa bits
    // Every token row of a 32-token block (from the sequence start) carries the block's scale.
    for (int b = 0; b < km.batch(); ++b)
      for (int64_t t = km.cu_seqlens()[b]; t < km.cu_seqlens()[b + 1]; ++t) {
        const int64_t first = km.cu_seqlens()[b] + (t - km.cu_seqlens()[b]) / 32 * 32;
        for (int64_t i = 0; i < H * 4; ++i) ASSERT_EQ((*scales)[size_t(t * H * 4 + i)], (*scales)[size_t(first * H * 4 + i)]);
      }
  }
  // Scale views are for output_mxfp8_dkv only; with it, they and E4M3 payloads are required.
  for (auto* b : {&dq, &dk, &dv}) std::fill(b->begin(), b->end(), kPoison);
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, km,
                                     options(), dq_view(), dk_view(), dv_view(), sc(sk)),
                  "dk_scales", "only with output_mxfp8_dkv");
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, km, o,
                                     dq_view(), dk_view(), dv_view(), sc(sk), sc(sv)),
                  "dk", "dtype");
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, k_seq.t, v.t, out_view(), dout_view(), lse_view(), qm, km, o,
                                     dq_view(), pay(pk), pay(pv)),
                  "dk_scales", "");
}

TEST_F(AttentionBwdApi, RejectsMixedDevicesAndCudaTensors) {
  build({40}, {33}, false);
  MxTensor bad = k_seq.t;
  bad.scales.device = Device::kCUDA;
  bad.scales.data = kDummyDevicePtr;
  expect_rejected(attention_backward(q.t, q_seq.t, k.t, bad, v.t, out_view(), dout_view(), lse_view(), qm, km,
                                     options(), dq_view(), dk_view(), dv_view()),
                  "k_seq.scales", "same device");
  auto cuda = [](MxTensor t) {
    t.payload.device = t.scales.device = Device::kCUDA;
    t.payload.data = t.scales.data = kDummyDevicePtr;
    return t;
  };
  auto cuda_view = [](TensorView t) {
    t.device = Device::kCUDA;
    t.data = kDummyDevicePtr;
    return t;
  };
  // Options the CUDA paths do not model are refused before anything touches the (fake) pointers,
  // on the fast kernel and on the exact GPU path alike.
  for (const bool exact : {false, true}) {
    AttentionBackwardOptions o = options();
    o.exact_mx = exact;
    o.dq_accum = DqAccum::kFp16;
    const Status st16 = attention_backward(cuda(q.t), cuda(q_seq.t), cuda(k.t), cuda(k_seq.t), cuda(v.t),
                                           cuda_view(out_view()), cuda_view(dout_view()), cuda_view(lse_view()), qm,
                                           km, o, cuda_view(dq_view()), cuda_view(dk_view()), cuda_view(dv_view()));
    EXPECT_EQ(st16.code(), StatusCode::kUnsupported) << st16.message();
    expect_rejected(st16, "dq_accum", exact ? "exact GPU path" : "fast CUDA kernel");
    o.dq_accum = DqAccum::kFp32;
    o.p_scale = PScaleMode::kDynamic;
    const Status stp = attention_backward(cuda(q.t), cuda(q_seq.t), cuda(k.t), cuda(k_seq.t), cuda(v.t),
                                          cuda_view(out_view()), cuda_view(dout_view()), cuda_view(lse_view()), qm, km,
                                          o, cuda_view(dq_view()), cuda_view(dk_view()), cuda_view(dv_view()));
    EXPECT_EQ(stp.code(), StatusCode::kUnsupported) << stp.message();
    expect_rejected(stp, "p_scale", "CPU reference only");
  }
}

// ------------------------------------------------------------ operands in the execution layout
// quantize_attention_backward on CPU tensors, and the backward on its operands: Q', K' are the
// forward's operands byte for byte; the gradients stay within 0.5 dB (vs FP64) of the backward on
// MX tensors and above the reference system's floors. A wrong layout or orientation of any operand
// (e.g. Qᵀ' read as rows, or a fragment-order slip) costs far more than that.
TEST_F(AttentionBwdApi, OperandsRoundTripOnJaggedBatch) {
  for (const bool bcast : {false, true}) {
    SCOPED_TRACE(bcast ? "broadcast_q" : "jagged");
    build_operand_case(bcast);
    test::HostBwdOperands ops(qm, km, H);
    Status st = quantize_attention_backward(x(qf, qm), x(kf, km), x(vf, km), qm, km, ops.ops);
    ASSERT_TRUE(st.ok()) << st.message();
    test::HostOperands fwd(qm, km, H);
    st = quantize_attention_forward(x(qf, qm), x(kf, km), x(vf, km), qm, km, fwd.ops);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_TRUE(std::equal(ops.parts[0].begin(), ops.parts[0].end(), fwd.q.begin())) << "Q' differs from the forward's";
    EXPECT_TRUE(std::equal(ops.parts[1].begin(), ops.parts[1].end(), fwd.k.begin())) << "K' differs from the forward's";
    EXPECT_TRUE(std::equal(ops.parts[5].begin(), ops.parts[5].end(), fwd.q_scale.begin()));
    EXPECT_TRUE(std::equal(ops.parts[6].begin(), ops.parts[6].end(), fwd.k_scale.begin()));
    for (int i = 0; i < kAttentionBwdOperandCount; ++i)  // every byte written (padding included)
      EXPECT_FALSE(std::all_of(ops.parts[i].begin(), ops.parts[i].end(), [](uint8_t b) { return b == kPoison; })) << i;
    // write_qk = false: Q', K' (the forward's, indices 0, 1, 5, 6) left alone, the rest identical.
    test::HostBwdOperands rest(qm, km, H);
    st = quantize_attention_backward(x(qf, qm), x(kf, km), x(vf, km), qm, km, rest.ops, nullptr, false);
    ASSERT_TRUE(st.ok()) << st.message();
    for (int i = 0; i < kAttentionBwdOperandCount; ++i) {
      const bool qk = i == 0 || i == 1 || i == 5 || i == 6;
      if (qk)
        EXPECT_TRUE(std::all_of(rest.parts[i].begin(), rest.parts[i].end(), [](uint8_t b) { return b == kPoison; }))
            << i << " written with write_qk = false";
      else
        EXPECT_EQ(rest.parts[i], ops.parts[i]) << i;
    }

    ASSERT_TRUE(call().ok());
    const std::vector<uint16_t> mx_dq = bits(dq), mx_dk = bits(dk), mx_dv = bits(dv);
    std::fill(dq.begin(), dq.end(), kPoison);
    std::fill(dk.begin(), dk.end(), kPoison);
    std::fill(dv.begin(), dv.end(), kPoison);
    st = attention_backward(ops.ops, out_view(), dout_view(), lse_view(), qm, km, options(), dq_view(), dk_view(),
                            dv_view());
    ASSERT_TRUE(st.ok()) << st.message();
    ref::AttnForwardResult fwd64;
    ref::AttnBackwardResult exact;
    ASSERT_TRUE(ref::attention_forward(p, ref::AttnMethod::kFp64, &fwd64).ok());
    ASSERT_TRUE(ref::attention_backward(p, ref::AttnMethod::kFp64, fwd64, doutf.data(), &exact).ok());
    const struct {
      const char* name;
      std::vector<uint16_t> mx, op;
      const std::vector<double>* ref;
    } grads[] = {{"dQ", mx_dq, bits(dq), &exact.dq}, {"dK", mx_dk, bits(dk), &exact.dk}, {"dV", mx_dv, bits(dv), &exact.dv}};
    for (const auto& g : grads) {
      const double a = sqnr_db(g.mx, *g.ref), b = sqnr_db(g.op, *g.ref);
      std::printf("    %s SQNR vs fp64: MX tensors %.2f dB, operands %.2f dB\n", g.name, a, b);
      EXPECT_GT(b, a - 0.5) << g.name;
      EXPECT_GT(b, 10.0) << g.name;
    }
  }
}

TEST_F(AttentionBwdApi, OperandsRejected) {
  build({40, 17}, {33, 65}, false);
  test::HostBwdOperands ops(qm, km, H);
  ASSERT_TRUE(quantize_attention_backward(x(qf, qm), x(kf, km), x(vf, km), qm, km, ops.ops).ok());
  auto run = [&](const AttentionBwdOperands& o, const AttentionBackwardOptions& opt) {
    return attention_backward(o, out_view(), dout_view(), lse_view(), qm, km, opt, dq_view(), dk_view(), dv_view());
  };
  AttentionBwdOperands bad = ops.ops;
  bad.qt = make_view(ops.parts[3].data(), DType::kE4M3, Device::kCPU, {H, qm.padded_tokens(), kHeadDim});
  expect_rejected(run(bad, options()), "ops.qt", "shape");
  bad = ops.ops;
  bad.kt_scale.dtype = DType::kBFloat16;
  expect_rejected(run(bad, options()), "ops.kt_scale", "dtype");
  bad = ops.ops;
  bad.v.data = nullptr;
  expect_rejected(run(bad, options()), "ops.v", "");
  bad = ops.ops;
  bad.k_scale.device = Device::kCUDA;
  bad.k_scale.data = kDummyDevicePtr;
  expect_rejected(run(bad, options()), "ops.k_scale", "same device");
  AttentionBackwardOptions o = options();
  o.exact_mx = true;
  const Status st = run(ops.ops, o);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.message();
  expect_rejected(st, "opt.exact_mx", "MX tensors");
  // Operands of another head count than out / dout / lse.
  test::HostBwdOperands three(qm, km, 3);
  expect_rejected(run(three.ops, options()), "out", "shape");
  // The quantizer: inputs and operands checked alike, nothing written on a failure.
  const Status qs = quantize_attention_backward(x(qf, qm), x(vf, km), x(kf, km), qm, km, three.ops);
  EXPECT_FALSE(qs.ok());
  EXPECT_EQ(qs.message().rfind("ops.q", 0), 0u) << qs.message();
  for (int i = 0; i < kAttentionBwdOperandCount; ++i)
    EXPECT_TRUE(std::all_of(three.parts[i].begin(), three.parts[i].end(), [](uint8_t b) { return b == kPoison; }));
}

// quantize_attention_training: both operand sets from one call, the same bytes as the two quantizers
// (the forward's, then the backward's with write_qk = false), bwd's Q', K' written once through fwd;
// a bwd that does not view fwd's Q', K', or any bad operand, refused before anything is written.
TEST_F(AttentionBwdApi, TrainingQuantizerWritesBothSets) {
  for (const bool bcast : {false, true}) {
    SCOPED_TRACE(bcast ? "broadcast_q" : "jagged");
    build_operand_case(bcast);
    test::HostOperands want_fwd(qm, km, H);
    test::HostBwdOperands want_bwd(qm, km, H);
    ASSERT_TRUE(quantize_attention_forward(x(qf, qm), x(kf, km), x(vf, km), qm, km, want_fwd.ops).ok());
    ASSERT_TRUE(quantize_attention_backward(x(qf, qm), x(kf, km), x(vf, km), qm, km, want_bwd.ops).ok());

    test::HostOperands fwd(qm, km, H);
    test::HostBwdOperands bwd(qm, km, H);
    AttentionBwdOperands b = bwd.ops;
    // Not views of fwd's Q', K': refused, nothing written.
    Status st = quantize_attention_training(x(qf, qm), x(kf, km), x(vf, km), qm, km, fwd.ops, b);
    expect_rejected(st, "bwd.q", "must view fwd.q");
    b.q = fwd.ops.q, b.q_scale = fwd.ops.q_scale, b.k = fwd.ops.k;
    expect_rejected(quantize_attention_training(x(qf, qm), x(kf, km), x(vf, km), qm, km, fwd.ops, b), "bwd.k_scale",
                    "must view fwd.k_scale");
    b.k_scale = fwd.ops.k_scale;
    AttentionBwdOperands bad = b;
    bad.qt = make_view(bwd.parts[3].data(), DType::kE4M3, Device::kCPU, {H, kHeadDim, 2 * qm.padded_tokens()});
    expect_rejected(quantize_attention_training(x(qf, qm), x(kf, km), x(vf, km), qm, km, fwd.ops, bad), "bwd.qt",
                    "shape");
    test::HostOperands three(qm, km, 3);
    expect_rejected(quantize_attention_training(x(qf, qm), x(kf, km), x(vf, km), qm, km, three.ops, b), "fwd.q",
                    "heads");
    auto poisoned = [](const std::vector<uint8_t>& v) {
      return std::all_of(v.begin(), v.end(), [](uint8_t c) { return c == kPoison; });
    };
    for (const auto& part : fwd.parts) EXPECT_TRUE(poisoned(part));
    for (const auto& part : bwd.parts) EXPECT_TRUE(poisoned(part));

    st = quantize_attention_training(x(qf, qm), x(kf, km), x(vf, km), qm, km, fwd.ops, b);
    ASSERT_TRUE(st.ok()) << st.message();
    for (int i = 0; i < kAttentionFwdOperandCount; ++i)
      EXPECT_EQ(fwd.parts[i], want_fwd.parts[i]) << "fwd part " << i;
    for (int i : {2, 3, 4, 7, 8, 9}) EXPECT_EQ(bwd.parts[i], want_bwd.parts[i]) << "bwd part " << i;
    for (int i : {0, 1, 5, 6}) EXPECT_TRUE(poisoned(bwd.parts[i])) << "bwd part " << i << ": written besides fwd's";
  }
}

}  // namespace
}  // namespace mxflash
