// The attention backward on the GPU against the same public call on CPU tensors (the exact-MX CPU
// reference) on the same MX operands, outputs poisoned first:
//  - the exact-MX GPU path (exact_mx): dQ, dK, dV agree bit for bit except where a differently
//    associated FP64 sum flips a rounding;
//  - the fast kernel: within its quantization differences (coarser power-of-two scales for dO and
//    dS, docs/attention.md), measured as SQNR against the reference, and bit-identical when run
//    twice (no atomics) and in either work-list order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention_device_mx.h"
#include "gpu_test_util.h"
#include "mxflash/attention.h"
#include "reference/attention_ref.h"

namespace mxflash {
namespace {
using gputest::DeviceBuffer;
using gputest::DeviceMx;
using gputest::sqnr_db;
using test::HostMx;
using test::quantize_host;

std::vector<uint8_t> bytes_of(const std::vector<uint16_t>& x) {
  std::vector<uint8_t> b(x.size() * 2);
  std::memcpy(b.data(), x.data(), b.size());
  return b;
}

std::vector<uint16_t> bits_of(const std::vector<uint8_t>& b) {
  std::vector<uint16_t> x(b.size() / 2);
  std::memcpy(x.data(), b.data(), b.size());
  return x;
}

// Fraction of differing bf16 values, and the SQNR of `got` against `want`.
void compare(const char* name, const std::vector<uint16_t>& want, const std::vector<uint16_t>& got) {
  ASSERT_EQ(want.size(), got.size()) << name;
  size_t differ = 0;
  double s = 0, n = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = bf16_to_float(want[i]), g = bf16_to_float(got[i]);
    differ += want[i] != got[i];
    s += w * w;
    n += (g - w) * (g - w);
  }
  const double db = n == 0 ? 300.0 : 10 * std::log10(s / n);
  std::printf("    %s: %zu of %zu bf16 values differ, GPU vs CPU %.1f dB\n", name, differ, want.size(), db);
  EXPECT_LE(double(differ), 1e-3 * double(want.size()) + 2) << name;
  EXPECT_GT(db, 60.0) << name;
}

// SQNR (dB) of `got` against `want`, printed; every value finite.
double sqnr_of(const char* name, const std::vector<uint16_t>& want, const std::vector<uint16_t>& got) {
  size_t nonfinite = 0;
  const double db = gputest::sqnr_bf16(want, got, &nonfinite);
  EXPECT_EQ(nonfinite, 0u) << name;
  std::printf("    fast %s: %.2f dB against the exact-MX reference\n", name, db);
  return db;
}

// Fast kernel against the reference: SQNR floors measured on the H200 with margin (a wrong index or
// scale gives ~0 dB or less).
constexpr double kFastMinDb = 20.0;

struct Case {
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t heads;
  bool broadcast_q;
  PayloadLayout seq_layout;  // of q_seq and k_seq
  ScaleLayout scale_layout;
  bool mxfp8_dkv = false;  // also compare output_mxfp8_dkv (fast kernel against the CPU reference)
  CausalMask causal = CausalMask::kNone;
};

void run_case(const Case& c, uint64_t seed) {
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths(c.q_lengths, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths(c.k_lengths, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t H = c.heads, Tq = qm.total_tokens(), Tk = km.total_tokens();
  const int64_t To = c.broadcast_q ? km.batch() * Tq : Tq;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  auto draw = [&](int64_t T) {
    std::vector<float> x(size_t(T * H * kHeadDim));
    for (auto& e : x) e = nd(rng);
    return x;
  };
  const std::vector<float> q = draw(Tq), k = draw(Tk), v = draw(Tk), g = draw(To);
  const HostMx hq = quantize_host(q, qm, H, Orientation::kHdim, PayloadLayout::kTokenMajor, c.scale_layout);
  const HostMx hqs = quantize_host(q, qm, H, Orientation::kSeq, c.seq_layout, c.scale_layout);
  const HostMx hk = quantize_host(k, km, H, Orientation::kHdim, PayloadLayout::kTokenMajor, c.scale_layout);
  const HostMx hks = quantize_host(k, km, H, Orientation::kSeq, c.seq_layout, c.scale_layout);
  const HostMx hv = quantize_host(v, km, H, Orientation::kHdim, PayloadLayout::kTokenMajor, c.scale_layout);
  const HostMx hvs = quantize_host(v, km, H, Orientation::kSeq, PayloadLayout::kTokenMajor, c.scale_layout);

  // Forward on the CPU (out, lse), dout in bf16.
  AttentionOptions fo;
  fo.broadcast_q = c.broadcast_q;
  fo.causal = c.causal;
  std::vector<uint16_t> out(size_t(To * H * kHeadDim)), dout(out.size());
  std::vector<float> lse(size_t(H * To));
  ASSERT_TRUE(attention_forward(hq.t, hk.t, hvs.t, qm, km, fo,
                                make_view(out.data(), DType::kBFloat16, Device::kCPU, {To, H, kHeadDim}),
                                make_view(lse.data(), DType::kFloat32, Device::kCPU, {H, To}))
                  .ok());
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = float_to_bf16(g[i]);

  AttentionBackwardOptions bo;
  bo.broadcast_q = c.broadcast_q;
  bo.causal = c.causal;
  std::vector<uint16_t> dq(size_t(Tq * H * kHeadDim)), dk(size_t(Tk * H * kHeadDim)), dv(dk.size());
  auto cpu_view = [&](std::vector<uint16_t>& x, int64_t T) {
    return make_view(x.data(), DType::kBFloat16, Device::kCPU, {T, H, kHeadDim});
  };
  Status st = attention_backward(hq.t, hqs.t, hk.t, hks.t, hv.t, cpu_view(out, To), cpu_view(dout, To),
                                 make_view(lse.data(), DType::kFloat32, Device::kCPU, {H, To}), qm, km, bo,
                                 cpu_view(dq, Tq), cpu_view(dk, Tk), cpu_view(dv, Tk));
  ASSERT_TRUE(st.ok()) << st.message();

  const DeviceMx dq_op(hq), dqs_op(hqs), dk_op(hk), dks_op(hks), dv_op(hv);
  DeviceBuffer d_out(bytes_of(out)), d_dout(bytes_of(dout)), d_lse(lse.size() * 4);
  ASSERT_EQ(cudaMemcpy(d_lse.get(), lse.data(), lse.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  DeviceBuffer d_dq(dq.size() * 2), d_dk(dk.size() * 2), d_dv(dv.size() * 2);
  for (DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) b->fill(gputest::kDevicePoison);
  auto dev_view = [&](const DeviceBuffer& b, int64_t T) {
    return make_view(b.get(), DType::kBFloat16, Device::kCUDA, {T, H, kHeadDim});
  };
  bo.exact_mx = true;
  st = attention_backward(dq_op.view, dqs_op.view, dk_op.view, dks_op.view, dv_op.view, dev_view(d_out, To),
                          dev_view(d_dout, To), make_view(d_lse.get(), DType::kFloat32, Device::kCUDA, {H, To}), qm,
                          km, bo, dev_view(d_dq, Tq), dev_view(d_dk, Tk), dev_view(d_dv, Tk));
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  compare("dQ", dq, bits_of(d_dq.download()));
  compare("dK", dk, bits_of(d_dk.download()));
  compare("dV", dv, bits_of(d_dv.download()));

  // The fast kernel, twice (its own workspace, then a caller's): identical bits (deterministic),
  // close to the reference. A workspace one byte short is refused before anything is written.
  bo.exact_mx = false;
  const size_t ws_bytes = attention_backward_workspace_size(qm, km, H, bo);
  ASSERT_GT(ws_bytes, 0u);
  DeviceBuffer ws(ws_bytes);
  for (DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) b->fill(gputest::kDevicePoison);
  st = attention_backward(dq_op.view, dqs_op.view, dk_op.view, dks_op.view, dv_op.view, dev_view(d_out, To),
                          dev_view(d_dout, To), make_view(d_lse.get(), DType::kFloat32, Device::kCUDA, {H, To}), qm, km,
                          bo, dev_view(d_dq, Tq), dev_view(d_dk, Tk), dev_view(d_dv, Tk), {}, {}, ws.get(), ws_bytes - 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_EQ(st.message().rfind("workspace", 0), 0u) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  for (const DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) {
    const std::vector<uint8_t> x = b->download();
    EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](uint8_t v) { return v == gputest::kDevicePoison; }))
        << "a refused call wrote an output";
  }
  std::vector<uint8_t> first[3];
  for (int run = 0; run < 2; ++run) {
    for (DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) b->fill(gputest::kDevicePoison);
    st = attention_backward(dq_op.view, dqs_op.view, dk_op.view, dks_op.view, dv_op.view, dev_view(d_out, To),
                            dev_view(d_dout, To), make_view(d_lse.get(), DType::kFloat32, Device::kCUDA, {H, To}), qm,
                            km, bo, dev_view(d_dq, Tq), dev_view(d_dk, Tk), dev_view(d_dv, Tk), {}, {},
                            run == 1 ? ws.get() : nullptr, run == 1 ? ws_bytes : 0);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    const std::vector<uint8_t> got[3] = {d_dq.download(), d_dk.download(), d_dv.download()};
    if (run == 0) {
      EXPECT_GT(sqnr_of("dQ", dq, bits_of(got[0])), kFastMinDb);
      EXPECT_GT(sqnr_of("dK", dk, bits_of(got[1])), kFastMinDb);
      EXPECT_GT(sqnr_of("dV", dv, bits_of(got[2])), kFastMinDb);
      for (int i = 0; i < 3; ++i) first[i] = got[i];
      if (c.causal != CausalMask::kNone) {
        // Against FP64 gradients of the unquantized inputs (the mask's ground truth, wherever its
        // diagonal falls): the fast kernel within 1 dB of the exact-MX CPU reference.
        ref::AttnProblem rp = ref::make_problem(qm, km, H, q.data(), k.data(), v.data(), ref::kDefaultSoftmaxScale,
                                                c.broadcast_q);
        rp.causal = c.causal;
        ref::AttnForwardResult f64;
        ref::AttnBackwardResult g64;
        ASSERT_TRUE(ref::attention_forward(rp, ref::AttnMethod::kFp64, &f64).ok());
        ASSERT_TRUE(ref::attention_backward(rp, ref::AttnMethod::kFp64, f64, g.data(), &g64).ok());
        const struct {
          const char* name;
          const std::vector<double>* truth;
          const std::vector<uint16_t>* cpu;
          const std::vector<uint8_t>* gpu;
        } grads[] = {{"dQ", &g64.dq, &dq, &got[0]}, {"dK", &g64.dk, &dk, &got[1]}, {"dV", &g64.dv, &dv, &got[2]}};
        for (const auto& x : grads) {
          std::vector<double> cpu(x.cpu->size()), gpu(x.cpu->size());
          const std::vector<uint16_t> gb = bits_of(*x.gpu);
          for (size_t i = 0; i < cpu.size(); ++i) cpu[i] = bf16_to_float((*x.cpu)[i]), gpu[i] = bf16_to_float(gb[i]);
          const double s_cpu = sqnr_db(*x.truth, cpu), s_gpu = sqnr_db(*x.truth, gpu);
          std::printf("    causal %s vs fp64: fast %.2f dB, exact MX %.2f dB\n", x.name, s_gpu, s_cpu);
          EXPECT_GT(s_gpu, s_cpu - 1.0) << x.name << ": the fast causal backward loses more than 1 dB to exact MX";
        }
      }
    } else {
      for (int i = 0; i < 3; ++i)
        EXPECT_TRUE(got[i] == first[i]) << "fast backward output " << i << " not deterministic";
      auto rerun = [&] {
        return attention_backward(dq_op.view, dqs_op.view, dk_op.view, dks_op.view, dv_op.view, dev_view(d_out, To),
                                  dev_view(d_dout, To), make_view(d_lse.get(), DType::kFloat32, Device::kCUDA, {H, To}),
                                  qm, km, bo, dev_view(d_dq, Tq), dev_view(d_dk, Tk), dev_view(d_dv, Tk));
      };
      gputest::expect_same_bytes_in_every_work_order({&d_dq, &d_dk, &d_dv}, rerun);
      gputest::expect_same_bytes_with_either_dq_kernel({&d_dq, &d_dk, &d_dv}, rerun);
    }
  }
  if (!c.mxfp8_dkv) return;
  // output_mxfp8_dkv: dK, dV as e4m3 + per-row scales of their 32x32 blocks, CPU reference vs fast.
  bo.output_mxfp8_dkv = true;
  std::vector<uint8_t> pk(size_t(Tk * H * kHeadDim)), pv(pk.size()), sk(size_t(Tk * H * 4)), sv(sk.size());
  auto pay = [&](std::vector<uint8_t>& x, Device d, void* ptr) {
    return make_view(ptr ? ptr : x.data(), DType::kE4M3, d, {Tk, H, kHeadDim});
  };
  auto sc = [&](std::vector<uint8_t>& x, Device d, void* ptr) {
    return make_view(ptr ? ptr : x.data(), DType::kE8M0, d, {Tk, H, kHeadDim / 32});
  };
  bo.exact_mx = false;
  st = attention_backward(hq.t, hqs.t, hk.t, hks.t, hv.t, cpu_view(out, To), cpu_view(dout, To),
                          make_view(lse.data(), DType::kFloat32, Device::kCPU, {H, To}), qm, km, bo, cpu_view(dq, Tq),
                          pay(pk, Device::kCPU, nullptr), pay(pv, Device::kCPU, nullptr), sc(sk, Device::kCPU, nullptr),
                          sc(sv, Device::kCPU, nullptr));
  ASSERT_TRUE(st.ok()) << st.message();
  DeviceBuffer g_pk(pk.size()), g_pv(pv.size()), g_sk(sk.size()), g_sv(sv.size());
  for (DeviceBuffer* b : {&g_pk, &g_pv, &g_sk, &g_sv}) b->fill(gputest::kDevicePoison);
  st = attention_backward(dq_op.view, dqs_op.view, dk_op.view, dks_op.view, dv_op.view, dev_view(d_out, To),
                          dev_view(d_dout, To), make_view(d_lse.get(), DType::kFloat32, Device::kCUDA, {H, To}), qm, km,
                          bo, dev_view(d_dq, Tq), pay(pk, Device::kCUDA, g_pk.get()), pay(pv, Device::kCUDA, g_pv.get()),
                          sc(sk, Device::kCUDA, g_sk.get()), sc(sv, Device::kCUDA, g_sv.get()));
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_GT(sqnr_of("MXFP8 dK", gputest::dequantize_rows(pk, sk), gputest::dequantize_rows(g_pk.download(), g_sk.download())), kFastMinDb);
  EXPECT_GT(sqnr_of("MXFP8 dV", gputest::dequantize_rows(pv, sv), gputest::dequantize_rows(g_pv.download(), g_sv.download())), kFastMinDb);
}

class AttentionBwdGpu : public ::testing::Test {
 protected:
  void SetUp() override { MXFLASH_SKIP_WITHOUT_CUDA_DEVICE(); }
};

TEST_F(AttentionBwdGpu, ExactPathMatchesCpuReferenceOnJaggedBatch) {
  // one key (dS = 0), no keys, tile and block edges
  run_case({{40, 17, 70, 129, 1}, {33, 1, 0, 300, 64}, 2, false, PayloadLayout::kTokenMajor, ScaleLayout::kPlain}, 1);
}

TEST_F(AttentionBwdGpu, ExactPathBroadcastQBlockedTokenContiguous) {
  run_case({{24}, {33, 1, 50}, 3, true, PayloadLayout::kTokenContiguous, ScaleLayout::kBlocked128x4}, 2);
}

TEST_F(AttentionBwdGpu, ExactPathLongerSequence) {
  run_case({{512}, {2048}, 1, false, PayloadLayout::kTokenMajor, ScaleLayout::kPlain}, 3);
}

TEST_F(AttentionBwdGpu, JaggedMultiTileBothSides) {
  // several Q and K/V tiles per sequence, partial last tiles, empty sequences on either side
  run_case({{300, 1, 700, 0, 129, 64}, {257, 1000, 1, 64, 0, 383}, 2, false, PayloadLayout::kTokenMajor,
            ScaleLayout::kBlocked128x4, /*mxfp8_dkv=*/true},
           4);
}

TEST_F(AttentionBwdGpu, BroadcastQMultiTile) {
  run_case({{300}, {700, 0, 129, 1}, 2, true, PayloadLayout::kTokenMajor, ScaleLayout::kPlain}, 5);
}

// The causal mask, both alignments: Lq = Lk and Lq != Lk (rows facing no key: bottom-right with
// Lq > Lk; keys no query faces: top-left with Lk > Lq), one-key rows (dS = 0), empty sequences,
// diagonals crossing two tiles, broadcast Q, MXFP8 dK/dV.
TEST_F(AttentionBwdGpu, Causal) {
  uint64_t seed = 30;
  for (CausalMask m : {CausalMask::kTopLeft, CausalMask::kBottomRight}) {
    Case c{{300, 1, 700, 0, 129, 64, 257}, {257, 1000, 1, 64, 0, 383, 257}, 2, false, PayloadLayout::kTokenMajor,
           ScaleLayout::kBlocked128x4, /*mxfp8_dkv=*/true};
    c.causal = m;
    run_case(c, seed++);
    Case b{{300}, {700, 0, 129, 1}, 2, true, PayloadLayout::kTokenContiguous, ScaleLayout::kPlain};
    b.causal = m;
    run_case(b, seed++);
  }
}

}  // namespace
}  // namespace mxflash
