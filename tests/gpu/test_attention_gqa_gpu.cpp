// Grouped-query attention on the operand path (K and V with Hkv heads, a divisor of Q's H): the
// quantizers' K-side operands at Hkv heads are the bytes of the same quantizers on K and V repeated per
// Q head (head h = K/V head h / g), on CUDA and against the CPU reference; the forward on them gives
// the bytes of the forward on the repeated operands (its kernels read K/V head h / g); the backward
// gives dQ's bytes and, for dK and dV (Tk, Hkv, 128), each group's fp32 sum in head order of the
// repeated backward's per-head bf16 gradients, rounded once; on every backward form (two kernels,
// square ring, rectangular ring, causal masks) and within 20 dB of the CPU backward on the grouped
// operands. Refused: output_mxfp8_dkv with grouped operands, a K/V head count that does not divide
// Q's, a workspace sized for Hkv = H.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu/attention_host_mx.h"
#include "gpu_test_util.h"
#include "mxflash/attention.h"

namespace mxflash {
namespace {
using gputest::DeviceBuffer;

std::vector<uint16_t> bits_of(const std::vector<uint8_t>& b) {
  std::vector<uint16_t> x(b.size() / 2);
  std::memcpy(x.data(), b.data(), b.size());
  return x;
}

// A training step's operand sets (forward and backward, bwd's Q' and K' viewing fwd's) on `device`,
// for H Q heads and Hkv K/V heads, every byte poisoned.
struct OperandSets {
  std::vector<std::unique_ptr<DeviceBuffer>> fparts, bparts;
  std::vector<std::vector<uint8_t>> host_f, host_b;
  AttentionFwdOperands fwd;
  AttentionBwdOperands bwd;
  OperandSets(const JaggedMeta& qm, const JaggedMeta& km, int64_t H, int64_t Hkv, Device device) {
    size_t fb[kAttentionFwdOperandCount], bb[kAttentionBwdOperandCount];
    attention_fwd_operand_bytes(qm, km, H, fb, Hkv);
    attention_bwd_operand_bytes(qm, km, H, bb, Hkv);
    void* fp[kAttentionFwdOperandCount];
    void* bp[kAttentionBwdOperandCount];
    for (int i = 0; i < kAttentionFwdOperandCount; ++i) fp[i] = alloc(fb[i], device, &fparts, &host_f);
    for (int i = 0; i < kAttentionBwdOperandCount; ++i) bp[i] = alloc(bb[i], device, &bparts, &host_b);
    int dev = 0;
    if (device == Device::kCUDA) cudaGetDevice(&dev);
    fwd = attention_fwd_operand_views(qm, km, H, fp, device, dev, Hkv);
    bwd = attention_bwd_operand_views(qm, km, H, bp, device, dev, Hkv);
    bwd.q = fwd.q, bwd.q_scale = fwd.q_scale, bwd.k = fwd.k, bwd.k_scale = fwd.k_scale;
  }
  static void* alloc(size_t n, Device device, std::vector<std::unique_ptr<DeviceBuffer>>* d,
                     std::vector<std::vector<uint8_t>>* h) {
    if (device == Device::kCUDA) {
      d->push_back(std::make_unique<DeviceBuffer>(n));
      d->back()->fill(gputest::kDevicePoison);
      return d->back()->get();
    }
    h->emplace_back(n, gputest::kHostPoison);
    return h->back().data();
  }
  // The bytes of a device set's part (fwd: q, k, v, q_scale, k_scale, v_scale; bwd: q, k, v, qt, kt,
  // q_scale, k_scale, v_scale, qt_scale, kt_scale).
  std::vector<uint8_t> f(int i) const { return fparts.empty() ? host_f[size_t(i)] : fparts[size_t(i)]->download(); }
  std::vector<uint8_t> b(int i) const { return bparts.empty() ? host_b[size_t(i)] : bparts[size_t(i)]->download(); }
};

// The grouped expectations on device bytes (test::repeat_slabs, test::group_sums).
std::vector<uint8_t> repeat_slabs(const std::vector<uint8_t>& x, int64_t heads, int64_t g) {
  return test::repeat_slabs(x, x.size(), heads, g);
}
std::vector<uint8_t> group_sums(const std::vector<uint8_t>& full, int64_t Hkv, int64_t g) {
  const std::vector<uint16_t> y = test::group_sums(bits_of(full), Hkv, g);
  std::vector<uint8_t> b(y.size() * 2);
  std::memcpy(b.data(), y.data(), b.size());
  return b;
}

struct Case {
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t heads, kv_heads;
  bool broadcast_q = false;
  const char* ring = "0";  // MXFLASH_BWD_RING: 0 (two kernels), 1 (square ring where it can), 2 (rectangular)
  CausalMask causal = CausalMask::kNone;
};

void run_case(const Case& c, uint64_t seed) {
  const gputest::ScopedEnv ring_env("MXFLASH_BWD_RING", c.ring);
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths(c.q_lengths, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths(c.k_lengths, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t H = c.heads, Hkv = c.kv_heads, g = H / Hkv, Tq = qm.total_tokens(), Tk = km.total_tokens();
  const int64_t To = c.broadcast_q ? km.batch() * Tq : Tq;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  auto draw = [&](int64_t T, int64_t heads) {
    std::vector<uint16_t> x(size_t(T * heads * kHeadDim));
    for (auto& e : x) e = float_to_bf16(nd(rng));
    return x;
  };
  std::vector<uint16_t> q = draw(Tq, H), k = draw(Tk, Hkv), v = draw(Tk, Hkv), dout = draw(To, H);
  const std::vector<uint16_t> kr = test::repeat_rows(k, Hkv, g), vr = test::repeat_rows(v, Hkv, g);
  auto bytes16 = [](const std::vector<uint16_t>& x) {
    std::vector<uint8_t> b(x.size() * 2);
    std::memcpy(b.data(), x.data(), b.size());
    return b;
  };
  DeviceBuffer dq_in(bytes16(q)), dk_in(bytes16(k)), dv_in(bytes16(v)), dkr_in(bytes16(kr)), dvr_in(bytes16(vr));
  auto dview = [](const DeviceBuffer& b, int64_t T, int64_t heads) {
    return make_view(b.get(), DType::kBFloat16, Device::kCUDA, {T, heads, kHeadDim});
  };

  // The operands: grouped (Hkv) and repeated (H) on CUDA, grouped on the CPU.
  OperandSets grouped(qm, km, H, Hkv, Device::kCUDA), full(qm, km, H, H, Device::kCUDA);
  Status st = quantize_attention_training(dview(dq_in, Tq, H), dview(dk_in, Tk, Hkv), dview(dv_in, Tk, Hkv), qm, km,
                                          grouped.fwd, grouped.bwd);
  ASSERT_TRUE(st.ok()) << st.message();
  st = quantize_attention_training(dview(dq_in, Tq, H), dview(dkr_in, Tk, H), dview(dvr_in, Tk, H), qm, km, full.fwd,
                                   full.bwd);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  OperandSets cpu(qm, km, H, Hkv, Device::kCPU);
  {
    std::vector<uint16_t> hq = q, hk = k, hv = v;
    st = quantize_attention_training(make_view(hq.data(), DType::kBFloat16, Device::kCPU, {Tq, H, kHeadDim}),
                                     make_view(hk.data(), DType::kBFloat16, Device::kCPU, {Tk, Hkv, kHeadDim}),
                                     make_view(hv.data(), DType::kBFloat16, Device::kCPU, {Tk, Hkv, kHeadDim}), qm, km,
                                     cpu.fwd, cpu.bwd);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  const char* fnames[] = {"q", "k", "v", "q_scale", "k_scale", "v_scale"};
  for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
    const bool kside = i == 1 || i == 2 || i == 4 || i == 5;
    EXPECT_TRUE(gputest::same_bytes(cpu.f(i), grouped.f(i))) << "fwd." << fnames[i] << ": CUDA vs CPU";
    EXPECT_TRUE(full.f(i) == (kside ? repeat_slabs(grouped.f(i), Hkv, g) : grouped.f(i)))
        << "fwd." << fnames[i] << ": grouped vs repeated inputs";
  }
  const char* bnames[] = {"q", "k", "v", "qt", "kt", "q_scale", "k_scale", "v_scale", "qt_scale", "kt_scale"};
  for (int i : {2, 4, 7, 9}) {  // (the others view fwd's)
    EXPECT_TRUE(gputest::same_bytes(cpu.b(i), grouped.b(i))) << "bwd." << bnames[i] << ": CUDA vs CPU";
    EXPECT_TRUE(full.b(i) == repeat_slabs(grouped.b(i), Hkv, g)) << "bwd." << bnames[i] << ": grouped vs repeated";
  }
  for (int i : {3, 8}) EXPECT_TRUE(full.b(i) == grouped.b(i)) << "bwd." << bnames[i];

  // The forward: the repeated operands' bytes (every forward kernel).
  AttentionOptions fo;
  fo.broadcast_q = c.broadcast_q;
  fo.causal = c.causal;
  DeviceBuffer out_g(size_t(To * H * kHeadDim * 2)), lse_g(size_t(H * To * 4)), out_f(out_g.size()), lse_f(lse_g.size());
  auto fwd = [&](const AttentionFwdOperands& ops, DeviceBuffer& o, DeviceBuffer& l) {
    return attention_forward(ops, qm, km, fo, dview(o, To, H),
                             make_view(l.get(), DType::kFloat32, Device::kCUDA, {H, To}));
  };
  for (DeviceBuffer* b : {&out_g, &lse_g, &out_f, &lse_f}) b->fill(gputest::kDevicePoison);
  st = fwd(full.fwd, out_f, lse_f);
  ASSERT_TRUE(st.ok()) << st.message();
  gputest::expect_same_bytes_with_every_forward_kernel({&out_g, &lse_g}, [&] { return fwd(grouped.fwd, out_g, lse_g); });
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_TRUE(out_g.download() == out_f.download()) << "grouped forward's out differs from the repeated one's";
  EXPECT_TRUE(lse_g.download() == lse_f.download()) << "grouped forward's lse differs from the repeated one's";

  // The backward: dQ the repeated call's bytes, dK and dV its per-head gradients summed per group.
  AttentionBackwardOptions bo;
  bo.broadcast_q = c.broadcast_q;
  bo.causal = c.causal;
  DeviceBuffer d_dout(bytes16(dout));
  const TensorView lse_view = make_view(lse_f.get(), DType::kFloat32, Device::kCUDA, {H, To});
  DeviceBuffer dq_f(size_t(Tq * H * kHeadDim * 2)), dk_f(size_t(Tk * H * kHeadDim * 2)), dv_f(dk_f.size());
  DeviceBuffer dq_g(dq_f.size()), dk_g(size_t(Tk * Hkv * kHeadDim * 2)), dv_g(dk_g.size());
  auto bwd = [&](const AttentionBwdOperands& ops, DeviceBuffer& dq, DeviceBuffer& dk, DeviceBuffer& dv, int64_t kvh,
                 void* ws, size_t ws_bytes, const AttentionBackwardOptions& o) {
    return attention_backward(ops, dview(out_f, To, H), dview(d_dout, To, H), lse_view, qm, km, o, dview(dq, Tq, H),
                              dview(dk, Tk, kvh), dview(dv, Tk, kvh), {}, {}, ws, ws_bytes);
  };
  for (DeviceBuffer* b : {&dq_f, &dk_f, &dv_f, &dq_g, &dk_g, &dv_g}) b->fill(gputest::kDevicePoison);
  st = bwd(full.bwd, dq_f, dk_f, dv_f, H, nullptr, 0, bo);
  ASSERT_TRUE(st.ok()) << st.message();

  // Refused, nothing written: a workspace sized for Hkv = H (short), output_mxfp8_dkv.
  const size_t ws_bytes = attention_backward_operands_workspace_size(qm, km, H, bo, Hkv);
  ASSERT_GT(ws_bytes, attention_backward_operands_workspace_size(qm, km, H, bo));
  DeviceBuffer ws(ws_bytes);
  st = bwd(grouped.bwd, dq_g, dk_g, dv_g, Hkv, ws.get(), attention_backward_operands_workspace_size(qm, km, H, bo), bo);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_EQ(st.message().rfind("workspace", 0), 0u) << st.message();
  {
    AttentionBackwardOptions mo = bo;
    mo.output_mxfp8_dkv = true;
    DeviceBuffer sk(size_t(Tk * Hkv * 4)), sv(sk.size());
    st = attention_backward(grouped.bwd, dview(out_f, To, H), dview(d_dout, To, H), lse_view, qm, km, mo,
                            dview(dq_g, Tq, H), make_view(dk_g.get(), DType::kE4M3, Device::kCUDA, {Tk, Hkv, kHeadDim}),
                            make_view(dv_g.get(), DType::kE4M3, Device::kCUDA, {Tk, Hkv, kHeadDim}),
                            make_view(sk.get(), DType::kE8M0, Device::kCUDA, {Tk, Hkv, 4}),
                            make_view(sv.get(), DType::kE8M0, Device::kCUDA, {Tk, Hkv, 4}));
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.message();
    EXPECT_EQ(st.message().rfind("output_mxfp8_dkv", 0), 0u) << st.message();
  }
  ASSERT_TRUE(gputest::device_ok());
  for (const DeviceBuffer* b : {&dq_g, &dk_g, &dv_g}) {
    const std::vector<uint8_t> x = b->download();
    EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](uint8_t y) { return y == gputest::kDevicePoison; }))
        << "a refused call wrote an output";
  }
  for (int r = 0; r < 2; ++r) {  // its own workspace, then the caller's
    for (DeviceBuffer* b : {&dq_g, &dk_g, &dv_g}) b->fill(gputest::kDevicePoison);
    st = bwd(grouped.bwd, dq_g, dk_g, dv_g, Hkv, r ? ws.get() : nullptr, r ? ws_bytes : 0, bo);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    EXPECT_TRUE(dq_g.download() == dq_f.download()) << "dQ differs from the repeated backward's (run " << r << ")";
    EXPECT_TRUE(dk_g.download() == group_sums(dk_f.download(), Hkv, g)) << "dK is not the group sums (run " << r << ")";
    EXPECT_TRUE(dv_g.download() == group_sums(dv_f.download(), Hkv, g)) << "dV is not the group sums (run " << r << ")";
  }

  // Against the CPU backward on the grouped operands (the reference repeats K and V itself).
  std::vector<uint16_t> h_out = bits_of(out_f.download()), h_dout = dout;
  std::vector<float> h_lse(size_t(H * To));
  std::memcpy(h_lse.data(), lse_f.download().data(), h_lse.size() * 4);
  std::vector<uint16_t> c_dq(size_t(Tq * H * kHeadDim)), c_dk(size_t(Tk * Hkv * kHeadDim)), c_dv(c_dk.size());
  auto hview = [](std::vector<uint16_t>& x, int64_t T, int64_t heads) {
    return make_view(x.data(), DType::kBFloat16, Device::kCPU, {T, heads, kHeadDim});
  };
  st = attention_backward(cpu.bwd, hview(h_out, To, H), hview(h_dout, To, H),
                          make_view(h_lse.data(), DType::kFloat32, Device::kCPU, {H, To}), qm, km, bo,
                          hview(c_dq, Tq, H), hview(c_dk, Tk, Hkv), hview(c_dv, Tk, Hkv));
  ASSERT_TRUE(st.ok()) << st.message();
  const std::pair<const std::vector<uint16_t>*, const DeviceBuffer*> pairs[] = {{&c_dq, &dq_g}, {&c_dk, &dk_g},
                                                                                {&c_dv, &dv_g}};
  const char* gnames[] = {"dQ", "dK", "dV"};
  for (int i = 0; i < 3; ++i) {
    size_t nonfinite = 0;
    const double db = gputest::sqnr_bf16(*pairs[i].first, bits_of(pairs[i].second->download()), &nonfinite);
    std::printf("    grouped %s vs the CPU reference on the grouped operands: %.2f dB\n", gnames[i], db);
    EXPECT_EQ(nonfinite, 0u) << gnames[i];
    EXPECT_GT(db, 20.0) << gnames[i];
  }
}

class AttentionGqaGpu : public ::testing::Test {
 protected:
  void SetUp() override { MXFLASH_SKIP_WITHOUT_CUDA_DEVICE(); }
};

TEST_F(AttentionGqaGpu, JaggedTwoKernels) {
  // hostile lengths (partial tiles, one-key and empty sequences), 4 Q heads on 2 K/V heads, then MQA
  run_case({{300, 1, 700, 0, 129, 64}, {257, 1000, 1, 64, 0, 383}, 4, 2}, 71);
  run_case({{300, 1, 700, 0, 129, 64}, {257, 1000, 1, 64, 0, 383}, 3, 1}, 72);
}

TEST_F(AttentionGqaGpu, SquareRing) {
  run_case({{1024, 1024}, {1024, 1024}, 6, 2, false, "1"}, 73);
}

TEST_F(AttentionGqaGpu, RectRingBroadcastQ) {
  run_case({{300}, {700, 0, 129, 1, 1000, 384}, 4, 1, true, "2"}, 74);
}

TEST_F(AttentionGqaGpu, CausalBothAlignments) {
  run_case({{300, 1, 700, 0, 129, 64}, {257, 1000, 1, 64, 0, 383}, 4, 2, false, "0", CausalMask::kTopLeft}, 75);
  run_case({{1024, 1024}, {1024, 1024}, 8, 2, false, "0", CausalMask::kBottomRight}, 76);
}

TEST_F(AttentionGqaGpu, HeadCountThatDoesNotDivideIsRefused) {
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths({200}, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths({300}, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  DeviceBuffer q(200 * 4 * 128 * 2), k(300 * 3 * 128 * 2), v(k.size());
  OperandSets ops(qm, km, 4, 4, Device::kCUDA);
  const Status st = quantize_attention_forward(
      make_view(q.get(), DType::kBFloat16, Device::kCUDA, {200, 4, 128}),
      make_view(k.get(), DType::kBFloat16, Device::kCUDA, {300, 3, 128}),
      make_view(v.get(), DType::kBFloat16, Device::kCUDA, {300, 3, 128}), qm, km, ops.fwd);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "k: has 3 heads, which must divide q's 4 (the same count, or a grouped-query share of it)");
  ASSERT_TRUE(gputest::device_ok());
  for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
    const std::vector<uint8_t> x = ops.f(i);
    EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](uint8_t y) { return y == gputest::kDevicePoison; }));
  }
}

}  // namespace
}  // namespace mxflash
