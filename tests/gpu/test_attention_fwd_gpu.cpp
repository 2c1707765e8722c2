// The sm_90a MXFP8 attention forward against the exact-MX CPU reference (same public API on CPU
// tensors) and the FP64 reference on the unquantized inputs: output SQNR within 0.3 dB of the
// exact-MX reference's, LSE to 1e-3, every output element written, empty rows 0 / -inf, the same
// bytes in either work-list order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention_device_mx.h"
#include "gpu_test_util.h"
#include "mxflash/attention.h"
#include "mxflash/quantize.h"
#include "reference/attention_ref.h"

namespace mxflash {
namespace {
using gputest::DeviceBuffer;
using gputest::sqnr_db;

using test::HostMx;
using test::quantize_host;

using gputest::DeviceMx;

struct Case {
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t heads;
  bool broadcast_q;
  PayloadLayout v_layout;
  ScaleLayout scale_layout;
  float q_gain = 1.f;  // > 1 sharpens the softmax
  // V of tokens 0..31 of each sequence times 2^60 and of tokens 32..63 times 2^-70: their MX scales
  // lie ~130 binades apart in each channel (the prepare pass shifts the small block by more than
  // an int8 holds; it must become zeros, not wrap).
  bool v_extreme_blocks = false;
  CausalMask causal = CausalMask::kNone;
};

void run_case(const Case& c, uint64_t seed) {
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths(c.q_lengths, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths(c.k_lengths, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t H = c.heads, Tq = qm.total_tokens(), Tk = km.total_tokens();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(Tq * H * kHeadDim)), k(size_t(Tk * H * kHeadDim)), v(k.size());
  for (auto& x : q) x = nd(rng) * c.q_gain;
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  if (c.v_extreme_blocks)
    for (int b = 0; b < int(km.batch()); ++b)
      for (int64_t t = 0; t < std::min<int64_t>(km.length(b), 64); ++t)
        for (int64_t i = 0; i < H * kHeadDim; ++i)
          v[size_t((km.cu_seqlens()[size_t(b)] + t) * H * kHeadDim + i)] *= std::ldexp(1.f, t < 32 ? 60 : -70);

  const HostMx hq = quantize_host(q, qm, H, Orientation::kHdim, PayloadLayout::kTokenMajor, c.scale_layout);
  const HostMx hk = quantize_host(k, km, H, Orientation::kHdim, PayloadLayout::kTokenMajor, c.scale_layout);
  const HostMx hv = quantize_host(v, km, H, Orientation::kSeq, c.v_layout, c.scale_layout);
  AttentionOptions opt;
  opt.broadcast_q = c.broadcast_q;
  opt.causal = c.causal;
  const int64_t To = c.broadcast_q ? km.batch() * Tq : Tq;

  // CPU exact MX through the public API.
  std::vector<uint16_t> out_cpu(size_t(To * H * kHeadDim));
  std::vector<float> lse_cpu(size_t(H * To));
  Status st = attention_forward(hq.t, hk.t, hv.t, qm, km, opt,
                                make_view(out_cpu.data(), DType::kBFloat16, Device::kCPU, {To, H, kHeadDim}),
                                make_view(lse_cpu.data(), DType::kFloat32, Device::kCPU, {H, To}));
  ASSERT_TRUE(st.ok()) << st.message();

  // GPU, outputs poisoned.
  DeviceMx dq(hq), dk(hk), dv(hv);
  DeviceBuffer out_gpu(out_cpu.size() * 2), lse_gpu(lse_cpu.size() * 4);
  out_gpu.fill(gputest::kDevicePoison);
  lse_gpu.fill(gputest::kDevicePoison);
  st = attention_forward(dq.view, dk.view, dv.view, qm, km, opt,
                         make_view(out_gpu.get(), DType::kBFloat16, Device::kCUDA, {To, H, kHeadDim}),
                         make_view(lse_gpu.get(), DType::kFloat32, Device::kCUDA, {H, To}));
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  const std::vector<double> og = gputest::checked_forward_out(out_gpu, lse_gpu, lse_cpu);
  ASSERT_FALSE(og.empty());
  auto rerun = [&] {
    return attention_forward(dq.view, dk.view, dv.view, qm, km, opt,
                             make_view(out_gpu.get(), DType::kBFloat16, Device::kCUDA, {To, H, kHeadDim}),
                             make_view(lse_gpu.get(), DType::kFloat32, Device::kCUDA, {H, To}));
  };
  gputest::expect_same_bytes_in_every_work_order({&out_gpu, &lse_gpu}, rerun);
  gputest::expect_same_bytes_with_every_forward_kernel({&out_gpu, &lse_gpu}, rerun);
  std::vector<double> oc(out_cpu.size());
  for (size_t i = 0; i < oc.size(); ++i) oc[i] = bf16_to_float(out_cpu[i]);
  // FP64 ground truth on the unquantized inputs.
  ref::AttnProblem p = ref::make_problem(qm, km, H, q.data(), k.data(), v.data(), ref::kDefaultSoftmaxScale,
                                         c.broadcast_q);
  p.causal = c.causal;
  ref::AttnForwardResult exact;
  ASSERT_TRUE(ref::attention_forward(p, ref::AttnMethod::kFp64, &exact).ok());
  const double s_gpu = sqnr_db(exact.out, og), s_cpu = sqnr_db(exact.out, oc), s_agree = sqnr_db(oc, og);
  std::printf("    out SQNR vs fp64: gpu %.2f dB, exact MX %.2f dB; gpu vs exact MX %.2f dB\n", s_gpu, s_cpu, s_agree);
  // The MX tensors' forward runs two or three consumers as the operands' does (the split tail too).
  auto workspace = [&] { return attention_forward_workspace_size(qm, km, H, opt); };
  EXPECT_GT(s_gpu, s_cpu - 0.3) << "fast kernel loses more than 0.3 dB against exact MX";
  EXPECT_GT(s_agree, gputest::forward_splits(workspace) ? gputest::kSplitAgreeDb : 30.0)
      << "fast kernel disagrees with exact MX";
  if (c.causal != CausalMask::kNone) {
    // The causal mask runs without a split tail: a forced part count changes neither the
    // workspace nor a byte.
    EXPECT_EQ(workspace(), gputest::unsplit_workspace_bytes(workspace)) << "a causal plan with a split tail";
    gputest::expect_same_bytes_under_env("MXFLASH_FWD_SPLIT", {"2", "4"}, {&out_gpu, &lse_gpu}, rerun);
  } else {
    gputest::expect_split_forward_close(out_gpu, lse_gpu, lse_cpu, oc, exact.out, s_cpu, km, workspace, rerun);
  }
}

class AttentionFwdGpu : public ::testing::Test {
 protected:
  void SetUp() override { MXFLASH_SKIP_WITHOUT_CUDA_DEVICE(); }
};

TEST_F(AttentionFwdGpu, UniformBatch) {
  run_case({{256, 256}, {256, 256}, 2, false, PayloadLayout::kTokenMajor, ScaleLayout::kPlain}, 1);
}

TEST_F(AttentionFwdGpu, JaggedHostileLengths) {
  run_case({{1, 17, 127, 128, 129, 0, 300}, {1, 17, 127, 128, 129, 5, 1000}, 3, false, PayloadLayout::kTokenMajor,
            ScaleLayout::kPlain},
           2);
}

TEST_F(AttentionFwdGpu, CrossLengthsAndEmptyKeys) {
  // Lq != Lk per sequence, a sequence with no keys (out 0, lse -inf), token-contiguous V, blocked scales.
  run_case({{200, 64, 33}, {1000, 0, 129}, 3, false, PayloadLayout::kTokenContiguous, ScaleLayout::kBlocked128x4}, 3);
}

TEST_F(AttentionFwdGpu, BroadcastQ) {
  run_case({{300}, {129, 0, 1000, 64}, 3, true, PayloadLayout::kTokenMajor, ScaleLayout::kPlain}, 4);
}

TEST_F(AttentionFwdGpu, PeakedSoftmaxLongKeys) {
  run_case({{128}, {4096}, 1, false, PayloadLayout::kTokenMajor, ScaleLayout::kPlain, 8.f}, 5);
}

// V blocks ~130 binades apart in one channel, both payload layouts (the prepare pass's shift of the
// small block saturates to zeros instead of wrapping around).
TEST_F(AttentionFwdGpu, ExtremeVScaleRange) {
  for (PayloadLayout vl : {PayloadLayout::kTokenMajor, PayloadLayout::kTokenContiguous})
    run_case({{70, 100}, {200, 64}, 2, false, vl, ScaleLayout::kBlocked128x4, 1.f, true}, 6);
}

// The causal mask (both alignments; rows facing no key with the bottom-right one where Lq > Lk),
// on the persistent three-consumer kernel, blocked scales and token-contiguous V.
TEST_F(AttentionFwdGpu, CausalJaggedAndCross) {
  for (CausalMask m : {CausalMask::kTopLeft, CausalMask::kBottomRight}) {
    Case c{{1, 17, 127, 128, 129, 0, 300, 1000}, {1, 17, 127, 128, 129, 5, 300, 1000}, 3, false,
           PayloadLayout::kTokenMajor, ScaleLayout::kPlain};
    c.causal = m;
    run_case(c, 7);
    Case x{{200, 64, 33, 700}, {1000, 0, 129, 250}, 2, false, PayloadLayout::kTokenContiguous,
           ScaleLayout::kBlocked128x4};
    x.causal = m;
    run_case(x, 8);
    Case bq{{300}, {129, 0, 1000, 64}, 2, true, PayloadLayout::kTokenMajor, ScaleLayout::kPlain};
    bq.causal = m;
    run_case(bq, 9);
  }
}

// Runs the forward on device copies of host MX operands; returns out (as doubles) and lse.
void run_gpu(const HostMx& hq, const HostMx& hk, const HostMx& hv, const JaggedMeta& qm, const JaggedMeta& km,
             const AttentionOptions& opt, int64_t H, std::vector<double>* out, std::vector<float>* lse) {
  const int64_t To = opt.broadcast_q ? km.batch() * qm.total_tokens() : qm.total_tokens();
  DeviceMx dq(hq), dk(hk), dv(hv);
  DeviceBuffer o(size_t(To * H * kHeadDim * 2)), l(size_t(To * H * 4));
  o.fill(gputest::kDevicePoison);
  l.fill(gputest::kDevicePoison);
  const Status st = attention_forward(dq.view, dk.view, dv.view, qm, km, opt,
                                      make_view(o.get(), DType::kBFloat16, Device::kCUDA, {To, H, kHeadDim}),
                                      make_view(l.get(), DType::kFloat32, Device::kCUDA, {H, To}));
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  const std::vector<uint8_t> ob = o.download(), lb = l.download();
  out->resize(size_t(To * H * kHeadDim));
  for (size_t i = 0; i < out->size(); ++i) {
    uint16_t h16;
    std::memcpy(&h16, ob.data() + 2 * i, 2);
    (*out)[i] = bf16_to_float(h16);
  }
  lse->resize(size_t(To * H));
  std::memcpy(lse->data(), lb.data(), lb.size());
}

std::vector<float> normal_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

// The exact-MX GPU path against the exact-MX CPU reference: the same arithmetic step for step, so
// bf16 outputs agree bit for bit except where a double sum's order flips an fp32 rounding.
TEST_F(AttentionFwdGpu, ExactPathMatchesCpuReference) {
  for (const bool bcast : {false, true}) {
    JaggedMeta qm, km;
    ASSERT_TRUE(JaggedMeta::FromLengths(bcast ? std::vector<int64_t>{77} : std::vector<int64_t>{1, 130, 0, 64}, &qm).ok());
    ASSERT_TRUE(JaggedMeta::FromLengths({40, 0, 300, 33}, &km).ok());
    ASSERT_TRUE(qm.upload().ok());
    ASSERT_TRUE(km.upload().ok());
    const int64_t H = 3;
    const HostMx hq = quantize_host(normal_values(qm.total_tokens() * H * kHeadDim, 11), qm, H, Orientation::kHdim,
                                    PayloadLayout::kTokenMajor, ScaleLayout::kBlocked128x4);
    const HostMx hk = quantize_host(normal_values(km.total_tokens() * H * kHeadDim, 12), km, H, Orientation::kHdim,
                                    PayloadLayout::kTokenMajor, ScaleLayout::kPlain);
    const HostMx hv = quantize_host(normal_values(km.total_tokens() * H * kHeadDim, 13), km, H, Orientation::kSeq,
                                    PayloadLayout::kTokenContiguous, ScaleLayout::kPlain);
    AttentionOptions opt;
    opt.broadcast_q = bcast;
    const int64_t To = bcast ? km.batch() * qm.total_tokens() : qm.total_tokens();
    std::vector<uint16_t> oc(size_t(To * H * kHeadDim));
    std::vector<float> lc(size_t(To * H));
    ASSERT_TRUE(attention_forward(hq.t, hk.t, hv.t, qm, km, opt,
                                  make_view(oc.data(), DType::kBFloat16, Device::kCPU, {To, H, kHeadDim}),
                                  make_view(lc.data(), DType::kFloat32, Device::kCPU, {H, To}))
                    .ok());
    opt.exact_mx = true;
    std::vector<double> og;
    std::vector<float> lg;
    run_gpu(hq, hk, hv, qm, km, opt, H, &og, &lg);
    size_t differ = 0;
    for (size_t i = 0; i < og.size(); ++i) {
      const double c = bf16_to_float(oc[i]);
      if (og[i] != c) {
        ++differ;
        ASSERT_NEAR(og[i], c, 1e-2 * std::max(1.0, std::fabs(c))) << "out[" << i << "]";  // one bf16 ulp
      }
    }
    EXPECT_LE(differ, og.size() / 1000) << differ << " of " << og.size() << " outputs differ";
    for (size_t i = 0; i < lg.size(); ++i) {
      if (std::isinf(lc[i])) {
        ASSERT_TRUE(std::isinf(lg[i]) && lg[i] < 0) << "lse[" << i << "]";
      } else {
        ASSERT_NEAR(lg[i], lc[i], 1e-6 * std::max(1.f, std::fabs(lc[i]))) << "lse[" << i << "]";
      }
    }
  }
}

// A shape the CPU reference would take minutes on: the fast kernel against the exact GPU path.
TEST_F(AttentionFwdGpu, FastKernelAgainstExactPathLongSequence) {
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths({8192, 3000}, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths({8192, 5000}, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t H = 2;
  const HostMx hq = quantize_host(normal_values(qm.total_tokens() * H * kHeadDim, 21), qm, H, Orientation::kHdim,
                                  PayloadLayout::kTokenMajor, ScaleLayout::kPlain);
  const HostMx hk = quantize_host(normal_values(km.total_tokens() * H * kHeadDim, 22), km, H, Orientation::kHdim,
                                  PayloadLayout::kTokenMajor, ScaleLayout::kPlain);
  const HostMx hv = quantize_host(normal_values(km.total_tokens() * H * kHeadDim, 23), km, H, Orientation::kSeq,
                                  PayloadLayout::kTokenMajor, ScaleLayout::kPlain);
  AttentionOptions opt;
  std::vector<double> fast, exact;
  std::vector<float> lf, le;
  run_gpu(hq, hk, hv, qm, km, opt, H, &fast, &lf);
  opt.exact_mx = true;
  run_gpu(hq, hk, hv, qm, km, opt, H, &exact, &le);
  const double agree = sqnr_db(exact, fast);
  std::printf("    long sequences: fast vs exact-MX GPU path %.2f dB\n", agree);
  EXPECT_GT(agree, 30.0);
  for (size_t i = 0; i < le.size(); ++i) ASSERT_NEAR(lf[i], le[i], 1e-3 * std::max(1.f, std::fabs(le[i])));
}

// The split tail beside the persistent kernel's whole items (gputest::split_tail_lengths): the same
// bytes with every kernel for the whole items, and against the exact-MX GPU path as a split forward
// agrees with exact MX (kSplitAgreeDb), LSE to 1e-3.
TEST_F(AttentionFwdGpu, SplitTailBesidePersistentWholeItems) {
  const int64_t H = 2;
  const gputest::SplitTailLengths n = gputest::split_tail_lengths(H);
  JaggedMeta qm, km;
  ASSERT_TRUE(gputest::split_tail_metas(n, &qm, &km));
  const HostMx hq = quantize_host(normal_values(n.q * H * kHeadDim, 31), qm, H, Orientation::kHdim,
                                  PayloadLayout::kTokenMajor, ScaleLayout::kPlain);
  const HostMx hk = quantize_host(normal_values(n.k * H * kHeadDim, 32), km, H, Orientation::kHdim,
                                  PayloadLayout::kTokenMajor, ScaleLayout::kPlain);
  const HostMx hv = quantize_host(normal_values(n.k * H * kHeadDim, 33), km, H, Orientation::kSeq,
                                  PayloadLayout::kTokenMajor, ScaleLayout::kPlain);
  AttentionOptions opt;
  std::vector<double> exact;
  std::vector<float> le;
  opt.exact_mx = true;
  run_gpu(hq, hk, hv, qm, km, opt, H, &exact, &le);
  opt.exact_mx = false;
  const gputest::ScopedEnv three("MXFLASH_FWD_CONSUMERS", "3");
  DeviceMx dq(hq), dk(hk), dv(hv);
  DeviceBuffer o(exact.size() * 2), l(le.size() * 4);
  auto launch = [&] {
    return attention_forward(dq.view, dk.view, dv.view, qm, km, opt,
                             make_view(o.get(), DType::kBFloat16, Device::kCUDA, {n.q, H, kHeadDim}),
                             make_view(l.get(), DType::kFloat32, Device::kCUDA, {H, n.q}));
  };
  auto workspace = [&] { return attention_forward_workspace_size(qm, km, H, opt); };
  const double agree = gputest::split_beside_every_whole_item_kernel(o, l, exact, le, workspace, launch);
  std::printf("    split tail beside persistent whole items: fast vs exact-MX GPU path %.2f dB\n", agree);
  EXPECT_GT(agree, gputest::kSplitAgreeDb);
}

TEST_F(AttentionFwdGpu, SixteenHeads) {
  run_case({{127, 257}, {127, 257}, 16, false, PayloadLayout::kTokenMajor, ScaleLayout::kPlain}, 6);
}

}  // namespace
}  // namespace mxflash
