// quantize_attention_forward on CUDA against its CPU reference (byte for byte, every byte of the six
// outputs, poisoned first; quantize_attention_training's twelve likewise on the quantizer cases), and attention_forward on those operands against the CPU forward on the
// same operands, the exact-MX forward and FP64: out SQNR within 0.3 dB of exact MX, LSE to 1e-3; the
// same bytes in either work order and with either consumer count (two or three warpgroups).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "attention_device_mx.h"
#include "gpu_test_util.h"
#include "mxflash/attention.h"
#include "reference/attention_ref.h"

namespace mxflash {
namespace {
using gputest::DeviceBuffer;
using gputest::sqnr_db;
using test::HostOperands;

// Device copies of HostOperands' buffers (poisoned), with CUDA views.
struct DeviceOperands {
  DeviceBuffer q, k, v, q_scale, k_scale, v_scale;
  AttentionFwdOperands ops;
  DeviceOperands(const HostOperands& h, const JaggedMeta& qm, const JaggedMeta& km)
      : q(h.q.size()), k(h.k.size()), v(h.v.size()), q_scale(h.q_scale.size()), k_scale(h.k_scale.size()),
        v_scale(h.v_scale.size()) {
    DeviceBuffer* parts[kAttentionFwdOperandCount] = {&q, &k, &v, &q_scale, &k_scale, &v_scale};
    void* ptr[kAttentionFwdOperandCount];
    for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
      parts[i]->fill(gputest::kDevicePoison);
      ptr[i] = parts[i]->get();
    }
    int dev = 0;
    cudaGetDevice(&dev);
    ops = attention_fwd_operand_views(qm, km, h.ops.q.shape[0], ptr, Device::kCUDA, dev);
  }
};

struct Case {
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t heads;
  bool broadcast_q = false;
  bool bf16 = true;
  bool extreme = false;    // blocks 130 binades apart in Q, K and V (shifts past the e4m3 range)
  bool extreme_v = false;  // the same in V alone (finite logits)
  bool nonfinite = false;  // a few inf / NaN elements (operand bytes only: attention would be NaN)
  // The first 128 keys of every K/V sequence: V 2^100 larger, and scores ~150 under the others
  // (Q >= 0, K = -16), so their P is 0 (even in fp64, to 2^-200) while their V scale is ~100
  // binades over the later tiles': the forward's O-unit guard (promote_vtile) then takes its slow
  // path on every later tile, and only that path decides the output.
  bool v_scale_drop = false;
  CausalMask causal = CausalMask::kNone;
};

// Bytes of `got` against the first n of `want` (fp32 scales: NaN matches any NaN).
void compare(const char* name, const std::vector<uint8_t>& want, size_t n, const DeviceBuffer& got, bool floats) {
  const std::vector<uint8_t> g = got.download();
  int bad = 0;
  for (size_t i = 0; i < n; i += floats ? 4 : 1) {
    bool same;
    if (floats) {
      float a, b;
      std::memcpy(&a, want.data() + i, 4);
      std::memcpy(&b, g.data() + i, 4);
      same = (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
    } else {
      same = want[i] == g[i];
    }
    if (!same && bad++ < 5)
      ADD_FAILURE() << name << " byte " << i << ": gpu 0x" << std::hex << int(g[i]) << ", cpu 0x" << int(want[i]);
  }
  EXPECT_EQ(bad, 0) << name << ": bytes differ from the CPU reference";
}

const char* const kFwdNames[kAttentionFwdOperandCount] = {"q", "k", "v", "q_scale", "k_scale", "v_scale"};
const char* const kBwdNames[kAttentionBwdOperandCount] = {"bwd.q",       "bwd.k",       "bwd.v",      "bwd.qt",
                                                          "bwd.kt",      "bwd.q_scale", "bwd.k_scale", "bwd.v_scale",
                                                          "bwd.qt_scale", "bwd.kt_scale"};

// quantize_attention_training on MX K and V (hdim, plain) on CUDA against the CPU overload (the
// bf16 quantizer on their bf16 values): the forward's six outputs and the backward's V rows, Qᵀ',
// Kᵀ' and their scales, byte for byte, every output poisoned first. q: fp32 values (bf16 ones when
// q_bf16), passed in that dtype.
void expect_mx_kv_training_matches_cpu(std::vector<float>& q, bool q_bf16, const JaggedMeta& qm, const JaggedMeta& km,
                                       int64_t H, const test::HostMx& mk, const test::HostMx& mv) {
  const int64_t Tq = qm.total_tokens();
  HostOperands want(qm, km, H);
  test::HostBwdOperands want_bwd(qm, km, H);
  {
    AttentionBwdOperands hb = want_bwd.ops;
    hb.q = want.ops.q, hb.q_scale = want.ops.q_scale, hb.k = want.ops.k, hb.k_scale = want.ops.k_scale;
    const Status st = quantize_attention_training(
        make_view(q.data(), DType::kFloat32, Device::kCPU, {Tq, H, kHeadDim}), mk.t, mv.t, qm, km, want.ops, hb);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  DeviceBuffer xq(gputest::input_bytes(q, q_bf16));
  const gputest::DeviceMx dk(mk), dv(mv);
  DeviceOperands mf(want, qm, km);
  gputest::DeviceBwdParts tb(want_bwd, qm, km, H, &mf.ops);
  const Status st = quantize_attention_training(
      make_view(xq.get(), q_bf16 ? DType::kBFloat16 : DType::kFloat32, Device::kCUDA, {Tq, H, kHeadDim}),
      dk.view, dv.view, qm, km, mf.ops, tb.ops);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  const std::vector<uint8_t>* wf[kAttentionFwdOperandCount] = {&want.q, &want.k, &want.v,
                                                                &want.q_scale, &want.k_scale, &want.v_scale};
  const DeviceBuffer* gf[kAttentionFwdOperandCount] = {&mf.q, &mf.k, &mf.v, &mf.q_scale, &mf.k_scale, &mf.v_scale};
  for (int i = 0; i < kAttentionFwdOperandCount; ++i)
    compare(kFwdNames[i], *wf[i], wf[i]->size() - 16, *gf[i], i >= 3);  // - 16: HostOperands' slack
  for (int i : {2, 3, 4, 7, 8, 9})
    compare(kBwdNames[i], want_bwd.parts[i], want_bwd.parts[i].size(), *tb.parts[size_t(i)], i >= 5);
}

std::vector<float> draw(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& e : x) e = nd(rng);
  return x;
}

void run_case(const Case& c, uint64_t seed, bool attention) {
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths(c.q_lengths, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths(c.k_lengths, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t H = c.heads, Tq = qm.total_tokens(), Tk = km.total_tokens(), row = H * kHeadDim;
  std::mt19937_64 rng(seed);
  std::vector<float> q = draw(Tq * row, rng), k = draw(Tk * row, rng), v = draw(Tk * row, rng);
  // every 32-token block of the first 128 tokens alternately 2^60 / 2^-70 larger
  for (auto* x : {&q, &k, &v})
    if (c.extreme || (c.extreme_v && x == &v))
      for (size_t i = 0; i < x->size(); ++i) {
        const int64_t t = int64_t(i) / row;
        if (t < 128) (*x)[i] *= std::ldexp(1.f, (t / 32) % 2 == 0 ? 60 : -70);
      }
  if (c.v_scale_drop) {
    for (auto& e : q) e = std::fabs(e);
    for (int64_t b = 0; b < km.batch(); ++b)
      for (int64_t t = km.cu_seqlens()[b]; t < std::min<int64_t>(km.cu_seqlens()[b] + 128, km.cu_seqlens()[b + 1]); ++t)
        for (int64_t i = t * row; i < (t + 1) * row; ++i) {
          k[size_t(i)] = -16.f;
          v[size_t(i)] *= std::ldexp(1.f, 100);
        }
  }
  if (c.nonfinite)
    for (auto* x : {&q, &k, &v}) {
      (*x)[5] = INFINITY;
      (*x)[x->size() / 2] = -INFINITY;
      (*x)[x->size() - 7] = NAN;
    }
  if (c.bf16)
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = bf16_to_float(float_to_bf16(e));
  // Inputs as the kernels take them.
  DeviceBuffer xq(gputest::input_bytes(q, c.bf16)), xk(gputest::input_bytes(k, c.bf16)), xv(gputest::input_bytes(v, c.bf16));
  const DType dt = c.bf16 ? DType::kBFloat16 : DType::kFloat32;
  auto view = [&](DeviceBuffer& b, int64_t T) { return make_view(b.get(), dt, Device::kCUDA, {T, H, kHeadDim}); };

  HostOperands want(qm, km, H);
  Status st = quantize_attention_forward(make_view(q.data(), DType::kFloat32, Device::kCPU, {Tq, H, kHeadDim}),
                                         make_view(k.data(), DType::kFloat32, Device::kCPU, {Tk, H, kHeadDim}),
                                         make_view(v.data(), DType::kFloat32, Device::kCPU, {Tk, H, kHeadDim}), qm, km,
                                         want.ops);
  ASSERT_TRUE(st.ok()) << st.message();
  DeviceOperands got(want, qm, km);
  st = quantize_attention_forward(view(xq, Tq), view(xk, Tk), view(xv, Tk), qm, km, got.ops);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  const struct {
    const char* name;
    const std::vector<uint8_t>* want;
    const DeviceBuffer* got;
    bool floats;
  } outs[] = {{"q", &want.q, &got.q, false},           {"k", &want.k, &got.k, false},
              {"v", &want.v, &got.v, false},           {"q_scale", &want.q_scale, &got.q_scale, true},
              {"k_scale", &want.k_scale, &got.k_scale, true}, {"v_scale", &want.v_scale, &got.v_scale, true}};
  for (const auto& o : outs) compare(o.name, *o.want, o.want->size() - 16, *o.got, o.floats);  // - 16: HostOperands' slack
  if (!attention) {
    // quantize_attention_training on the same inputs: the forward's operands as above and the
    // backward's V rows, Qᵀ', Kᵀ' as the CPU quantize_attention_backward writes them (the fused
    // kernels' inf / NaN and extreme-range paths), every output poisoned first.
    auto host = [&](std::vector<float>& x, int64_t T) {
      return make_view(x.data(), DType::kFloat32, Device::kCPU, {T, H, kHeadDim});
    };
    test::HostBwdOperands want_bwd(qm, km, H);
    st = quantize_attention_backward(host(q, Tq), host(k, Tk), host(v, Tk), qm, km, want_bwd.ops);
    ASSERT_TRUE(st.ok()) << st.message();
    DeviceOperands tf(want, qm, km);
    gputest::DeviceBwdParts tb(want_bwd, qm, km, H, &tf.ops);
    st = quantize_attention_training(view(xq, Tq), view(xk, Tk), view(xv, Tk), qm, km, tf.ops, tb.ops);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    const DeviceBuffer* tparts[kAttentionFwdOperandCount] = {&tf.q, &tf.k, &tf.v, &tf.q_scale, &tf.k_scale, &tf.v_scale};
    for (int i = 0; i < kAttentionFwdOperandCount; ++i)
      compare(outs[i].name, *outs[i].want, outs[i].want->size() - 16, *tparts[i], outs[i].floats);
    for (int i : {2, 3, 4, 7, 8, 9})
      compare(kBwdNames[i], want_bwd.parts[i], want_bwd.parts[i].size(), *tb.parts[size_t(i)], i >= 5);

    // The overload on MX K and V (hdim, plain): the fused kernels reading the MX bytes once give the
    // CPU definition's bytes (the bf16 quantizer on their bf16 values), outputs poisoned again.
    expect_mx_kv_training_matches_cpu(q, c.bf16, qm, km, H, test::quantize_host(k, km, H, Orientation::kHdim),
                                      test::quantize_host(v, km, H, Orientation::kHdim));
    return;
  }

  // The forward on the GPU operands vs the CPU forward on the CPU operands, exact MX and FP64.
  AttentionOptions opt;
  opt.broadcast_q = c.broadcast_q;
  opt.causal = c.causal;
  const int64_t To = c.broadcast_q ? km.batch() * Tq : Tq;
  std::vector<uint16_t> out_cpu(size_t(To * row)), out_mx(out_cpu.size());
  std::vector<float> lse_cpu(size_t(H * To)), lse_mx(lse_cpu.size());
  st = attention_forward(want.ops, qm, km, opt, make_view(out_cpu.data(), DType::kBFloat16, Device::kCPU, {To, H, kHeadDim}),
                         make_view(lse_cpu.data(), DType::kFloat32, Device::kCPU, {H, To}));
  ASSERT_TRUE(st.ok()) << st.message();
  const test::HostMx hq = test::quantize_host(q, qm, H, Orientation::kHdim);
  const test::HostMx hk = test::quantize_host(k, km, H, Orientation::kHdim);
  const test::HostMx hv = test::quantize_host(v, km, H, Orientation::kSeq);
  st = attention_forward(hq.t, hk.t, hv.t, qm, km, opt,
                         make_view(out_mx.data(), DType::kBFloat16, Device::kCPU, {To, H, kHeadDim}),
                         make_view(lse_mx.data(), DType::kFloat32, Device::kCPU, {H, To}));
  ASSERT_TRUE(st.ok()) << st.message();
  DeviceBuffer out_gpu(out_cpu.size() * 2), lse_gpu(lse_cpu.size() * 4);
  out_gpu.fill(gputest::kDevicePoison);
  lse_gpu.fill(gputest::kDevicePoison);
  st = attention_forward(got.ops, qm, km, opt, make_view(out_gpu.get(), DType::kBFloat16, Device::kCUDA, {To, H, kHeadDim}),
                         make_view(lse_gpu.get(), DType::kFloat32, Device::kCUDA, {H, To}));
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  const std::vector<double> og = gputest::checked_forward_out(out_gpu, lse_gpu, lse_cpu);
  ASSERT_FALSE(og.empty());
  auto rerun = [&] {
    return attention_forward(got.ops, qm, km, opt,
                             make_view(out_gpu.get(), DType::kBFloat16, Device::kCUDA, {To, H, kHeadDim}),
                             make_view(lse_gpu.get(), DType::kFloat32, Device::kCUDA, {H, To}));
  };
  gputest::expect_same_bytes_in_every_work_order({&out_gpu, &lse_gpu}, rerun);
  gputest::expect_same_bytes_with_every_forward_kernel({&out_gpu, &lse_gpu}, rerun);
  {  // out 4 bytes past a 16-byte boundary (the API asks 4): the persistent kernel's TMA-store
     // epilogue needs 16, so its direct stores run; the same bytes as a default run (the kernel
     // comparisons above leave out from a run with the split tail off).
    ASSERT_TRUE(rerun().ok());
    const std::vector<uint8_t> want_out = out_gpu.download();
    DeviceBuffer shifted(want_out.size() + 16);
    shifted.fill(gputest::kDevicePoison);
    uint8_t* at = static_cast<uint8_t*>(shifted.get()) + 4;
    st = attention_forward(got.ops, qm, km, opt, make_view(at, DType::kBFloat16, Device::kCUDA, {To, H, kHeadDim}),
                           make_view(lse_gpu.get(), DType::kFloat32, Device::kCUDA, {H, To}));
    ASSERT_TRUE(st.ok()) << st.message();
    const std::vector<uint8_t> got_out = shifted.download();
    EXPECT_TRUE(std::equal(want_out.begin(), want_out.end(), got_out.begin() + 4))
        << "out written 4 bytes past a 16-byte boundary differs";
  }
  std::vector<double> oc(og.size()), om(og.size());
  for (size_t i = 0; i < og.size(); ++i) {
    oc[i] = bf16_to_float(out_cpu[i]);
    om[i] = bf16_to_float(out_mx[i]);
  }
  ref::AttnProblem p = ref::make_problem(qm, km, H, q.data(), k.data(), v.data(), ref::kDefaultSoftmaxScale,
                                         c.broadcast_q);
  p.causal = c.causal;
  ref::AttnForwardResult exact;
  ASSERT_TRUE(ref::attention_forward(p, ref::AttnMethod::kFp64, &exact).ok());
  const double s_gpu = sqnr_db(exact.out, og), s_mx = sqnr_db(exact.out, om), s_agree = sqnr_db(oc, og);
  std::printf("    out SQNR vs fp64: gpu (operands) %.2f dB, exact MX %.2f dB; gpu vs cpu on the operands %.2f dB\n",
              s_gpu, s_mx, s_agree);
  // Where the plan splits items (the split tail), they differ more from the CPU forward, which sums
  // every item whole.
  auto workspace = [&] { return attention_forward_operands_workspace_size(qm, km, H, opt); };
  EXPECT_GT(s_gpu, s_mx - 0.3) << "the operands' forward loses more than 0.3 dB against exact MX";
  EXPECT_GT(s_agree, gputest::forward_splits(workspace) ? gputest::kSplitAgreeDb : 30.0)
      << "the GPU forward disagrees with the CPU forward on the same operands";
  if (c.causal != CausalMask::kNone) {
    // The causal mask runs without a split tail: a forced part count changes neither the
    // workspace nor a byte.
    EXPECT_EQ(workspace(), gputest::unsplit_workspace_bytes(workspace)) << "a causal plan with a split tail";
    gputest::expect_same_bytes_under_env("MXFLASH_FWD_SPLIT", {"2", "4"}, {&out_gpu, &lse_gpu}, rerun);
  } else {
    gputest::expect_split_forward_close(out_gpu, lse_gpu, lse_cpu, oc, exact.out, s_mx, km, workspace, rerun);
  }
}

class AttentionFwdOperandsGpu : public ::testing::Test {
 protected:
  void SetUp() override { MXFLASH_SKIP_WITHOUT_CUDA_DEVICE(); }
};

TEST_F(AttentionFwdOperandsGpu, QuantizerMatchesCpuOnHostileLengthsBf16AndFp32) {
  const Case c{{1, 17, 127, 128, 129, 0, 300}, {1, 17, 127, 128, 129, 5, 1000}, 3};
  run_case(c, 11, false);
  Case f = c;
  f.bf16 = false;
  run_case(f, 12, false);
}

// MX K and V written directly rather than by a quantizer: any finite bytes (subnormals, +-0,
// all-zero blocks, blocks whose largest byte is tiny, so that the bf16 values' own block scales drop
// 11-16 binades under the MX ones), block scales spread 12 or 13 binades within a tile, at 31-33 and
// 228-241, a NaN byte; partial and one-token tiles. The CUDA overload against the CPU one.
TEST_F(AttentionFwdOperandsGpu, MxKvWrittenDirectlyMatchesCpu) {
  const std::vector<int64_t> lengths = {1000, 128, 7, 300, 0, 129, 520, 1};
  JaggedMeta km;
  ASSERT_TRUE(JaggedMeta::FromLengths(lengths, &km).ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t H = 2, T = km.total_tokens();
  std::mt19937_64 rng(77);
  std::vector<float> zeros(size_t(T * H * kHeadDim), 0.f);
  auto make = [&](int salt) {
    test::HostMx m = test::quantize_host(zeros, km, H, Orientation::kHdim);
    std::uniform_int_distribution<int> byte(0, 255), tiny(0, 7), small(0, 0x20);
    for (int64_t b = 0; b < km.batch(); ++b) {
      const int64_t t0 = km.cu_seqlens()[size_t(b)], len = km.cu_seqlens()[size_t(b) + 1] - t0;
      for (int64_t tile = 0; tile * 128 < len; ++tile) {
        const int regime = int((b * 7 + tile + salt) % 9);
        const int lo = regime == 2 || regime == 3 ? 32 : regime == 4 || regime == 5 ? 228 : 40 + int(rng() % 180);
        const int spread = regime == 1 ? 13 : 12;
        const int64_t n = std::min<int64_t>(128, len - tile * 128);
        for (int64_t t = t0 + tile * 128; t < t0 + tile * 128 + n; ++t)
          for (int64_t h = 0; h < H; ++h) {
            for (int blk = 0; blk < 4; ++blk) {
              int sc = lo + int(rng() % uint64_t(spread + 1));
              if (regime == 3 && rng() % 50 == 0) sc = 31;
              if (regime == 5 && rng() % 50 == 0) sc = 241;
              m.scales[size_t((t * H + h) * 4 + blk)] = uint8_t(std::min(sc, 254));
            }
            for (int d = 0; d < kHeadDim; ++d) {
              int v = regime == 6 ? tiny(rng) | (byte(rng) & 0x80) : regime == 7 ? small(rng) | (byte(rng) & 0x80) : byte(rng);
              if ((v & 0x7F) == 0x7F) v &= 0xFE;  // finite
              if (regime == 7 && d < 32 && t % 3 == 0) v = t % 2 == 0 ? 0 : 0x80;  // an all-zero block
              m.payload[size_t((t * H + h) * kHeadDim + d)] = uint8_t(v);
            }
          }
        if (regime == 8) m.payload[size_t(((t0 + tile * 128 + n / 2) * H + 1) * kHeadDim + 77)] = 0x7F;
      }
    }
    return m;
  };
  std::vector<float> q = draw(T * H * kHeadDim, rng);
  for (auto& e : q) e = bf16_to_float(float_to_bf16(e));
  expect_mx_kv_training_matches_cpu(q, true, km, km, H, make(0), make(4));
}

TEST_F(AttentionFwdOperandsGpu, QuantizerMatchesCpuOnExtremeAndNonFiniteValues) {
  Case c{{130, 300}, {200, 257}, 2};
  c.extreme = true;
  c.nonfinite = true;
  run_case(c, 13, false);
  c.bf16 = false;
  run_case(c, 14, false);
}

TEST_F(AttentionFwdOperandsGpu, ForwardJaggedHostileLengths) {
  run_case({{1, 17, 127, 128, 129, 0, 300}, {1, 17, 127, 128, 129, 5, 1000}, 3}, 21, true);
}

// Every K/V sequence of at most two tiles: the persistent two-consumer kernel without exponential
// turns (the launcher's rule), whose bytes the comparison across kernels checks.
TEST_F(AttentionFwdOperandsGpu, ForwardShortKeys) {
  run_case({{1, 17, 127, 128, 129, 0, 300}, {1, 17, 127, 128, 129, 5, 256}, 3}, 27, true);
}

TEST_F(AttentionFwdOperandsGpu, ForwardCrossLengthsEmptyKeysFp32) {
  Case c{{200, 64, 33}, {1000, 0, 129}, 3};
  c.bf16 = false;
  run_case(c, 22, true);
}

TEST_F(AttentionFwdOperandsGpu, ForwardBroadcastQ) {
  Case c{{300}, {1000, 64, 513}, 2};
  c.broadcast_q = true;
  run_case(c, 23, true);
}

TEST_F(AttentionFwdOperandsGpu, ForwardExtremeBlockRanges) {
  Case c{{256}, {700}, 2};
  c.extreme_v = true;
  run_case(c, 24, true);
}

TEST_F(AttentionFwdOperandsGpu, ForwardVScaleFallsFarAfterTheFirstTile) {
  Case c{{200, 64}, {700, 300}, 2};
  c.v_scale_drop = true;
  run_case(c, 26, true);
}

// V's tile scales replaced by values that are no powers of two (operands a caller wrote: zero,
// negative, subnormal), after the quantizer wrote them. O is linear in each tile's scale, so where a
// row's keys lie in one tile (per_tile: every K/V sequence <= 128 keys, a factor per (head, tile)),
// or all tiles of a head share one factor, the forward on the scaled operands must give factor x the
// forward on the operands as written, to the bf16 rounding of both; LSE bit for bit.
void run_scaled_v(const std::vector<int64_t>& q_lengths, const std::vector<int64_t>& k_lengths, int64_t H,
                  bool per_tile, uint64_t seed) {
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths(q_lengths, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths(k_lengths, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t Tq = qm.total_tokens(), Tk = km.total_tokens(), row = H * kHeadDim;
  std::mt19937_64 rng(seed);
  const std::vector<float> q = draw(Tq * row, rng), k = draw(Tk * row, rng), v = draw(Tk * row, rng);
  auto bytes = [](const std::vector<float>& x) {
    std::vector<uint8_t> b(x.size() * 4);
    std::memcpy(b.data(), x.data(), b.size());
    return b;
  };
  DeviceBuffer xq(bytes(q)), xk(bytes(k)), xv(bytes(v));
  auto view = [&](DeviceBuffer& b, int64_t T) {
    return make_view(b.get(), DType::kFloat32, Device::kCUDA, {T, H, kHeadDim});
  };
  const HostOperands sizes(qm, km, H);
  DeviceOperands got(sizes, qm, km);
  ASSERT_TRUE(quantize_attention_forward(view(xq, Tq), view(xk, Tk), view(xv, Tk), qm, km, got.ops).ok());
  DeviceBuffer out(size_t(Tq * row) * 2), lse(size_t(H * Tq) * 4);
  auto forward = [&](std::vector<uint8_t>* o, std::vector<uint8_t>* l) {
    out.fill(gputest::kDevicePoison);
    lse.fill(gputest::kDevicePoison);
    const Status st = attention_forward(got.ops, qm, km, AttentionOptions{},
                                        make_view(out.get(), DType::kBFloat16, Device::kCUDA, {Tq, H, kHeadDim}),
                                        make_view(lse.get(), DType::kFloat32, Device::kCUDA, {H, Tq}));
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    *o = out.download();
    *l = lse.download();
  };
  std::vector<uint8_t> out0, lse0, out1, lse1;
  forward(&out0, &lse0);
  if (::testing::Test::HasFatalFailure()) return;
  // Factors: none a power of two but the control 1/8; zero; negative; one that makes the scale
  // subnormal (1.5 x 2^-125 x the quantizer's ~2^-6 for unit normal data) with O still in bf16's
  // range.
  const float kFactors[] = {-0.75f, 3.f, 0.f, 0.125f, -1.5f, 0x1.8p-125f};
  std::vector<uint8_t> vs = got.v_scale.download();
  const size_t n = (vs.size() - 16) / 4, per_head = n / size_t(H);
  std::vector<float> factor(n);
  for (size_t i = 0; i < n; ++i) {
    factor[i] = kFactors[(per_tile ? i : i / per_head) % 6];
    float f;
    std::memcpy(&f, vs.data() + 4 * i, 4);
    f *= factor[i];
    std::memcpy(vs.data() + 4 * i, &f, 4);
  }
  got.v_scale.upload(vs);
  forward(&out1, &lse1);
  if (::testing::Test::HasFatalFailure()) return;
  gputest::expect_same_bytes_with_every_forward_kernel({&out, &lse}, [&] {
    return attention_forward(got.ops, qm, km, AttentionOptions{},
                             make_view(out.get(), DType::kBFloat16, Device::kCUDA, {Tq, H, kHeadDim}),
                             make_view(lse.get(), DType::kFloat32, Device::kCUDA, {H, Tq}));
  });
  EXPECT_EQ(std::memcmp(lse0.data(), lse1.data(), lse0.size()), 0) << "LSE changed with V's scales";
  int bad = 0, zeros = 0;
  for (int64_t b = 0; b < qm.batch(); ++b)
    for (int64_t t = qm.cu_seqlens()[b]; t < qm.cu_seqlens()[b + 1]; ++t)
      for (int64_t h = 0; h < H; ++h) {
        // the tile (column of v_scale) this row's keys lie in: sequence b's only one (per_tile)
        const size_t tile = per_tile ? std::min(size_t(km.cu_seqlens_sf()[b] / 128), per_head - 1) : 0;
        ASSERT_TRUE(!per_tile || km.length(int(b)) <= 128);
        const float f = factor[size_t(h) * per_head + tile];
        for (int64_t c = 0; c < kHeadDim; ++c) {
          const size_t i = size_t((t * H + h) * kHeadDim + c);
          uint16_t a, g;
          std::memcpy(&a, out0.data() + 2 * i, 2);
          std::memcpy(&g, out1.data() + 2 * i, 2);
          const double want = double(f) * bf16_to_float(a), is = bf16_to_float(g);
          const bool ok = f == 0.f ? is == 0.0 : std::fabs(is - want) <= 0x1p-7 * std::fabs(want) + 0x1p-132;
          zeros += f == 0.f;
          if (!ok && bad++ < 5)
            ADD_FAILURE() << "token " << t << " head " << h << " channel " << c << ": " << is << ", want " << f
                          << " x " << bf16_to_float(a);
        }
      }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(zeros, 0) << "the case has no row with a zero factor";
}

TEST_F(AttentionFwdOperandsGpu, ForwardVScalesThatAreNoPowersOfTwoPerTile) {
  // one tile per K/V sequence (empty ones included), a factor per (head, tile)
  run_scaled_v({70, 1, 128, 200, 5, 33, 129}, {128, 1, 0, 100, 77, 128, 3}, 3, true, 27);
}

TEST_F(AttentionFwdOperandsGpu, ForwardVScalesThatAreNoPowersOfTwoPerHead) {
  // many tiles per K/V sequence, one factor per head: every promotion takes the multiply path
  run_scaled_v({200, 64, 129}, {700, 300, 1025}, 6, false, 28);
}

// The split tail beside the persistent kernel's whole items on operands quantized on the GPU
// (gputest::split_tail_lengths): the same bytes with every kernel for the whole items, and against
// the forward with the split off (every item whole, a CTA each: the bytes the other cases check
// against the CPU) as closely as a split forward agrees with the CPU's (kSplitAgreeDb), LSE to 1e-3.
TEST_F(AttentionFwdOperandsGpu, ForwardSplitTailBesidePersistentWholeItems) {
  const int64_t H = 2, row = H * kHeadDim;
  const gputest::SplitTailLengths n = gputest::split_tail_lengths(H);
  JaggedMeta qm, km;
  ASSERT_TRUE(gputest::split_tail_metas(n, &qm, &km));
  std::mt19937_64 rng(41);
  DeviceBuffer xq(gputest::input_bytes(draw(n.q * row, rng), true)), xk(gputest::input_bytes(draw(n.k * row, rng), true)),
      xv(gputest::input_bytes(draw(n.k * row, rng), true));
  auto view = [&](DeviceBuffer& b, int64_t T) { return make_view(b.get(), DType::kBFloat16, Device::kCUDA, {T, H, kHeadDim}); };
  const HostOperands sizes(qm, km, H);
  DeviceOperands got(sizes, qm, km);
  ASSERT_TRUE(quantize_attention_forward(view(xq, n.q), view(xk, n.k), view(xv, n.k), qm, km, got.ops).ok());
  const gputest::ScopedEnv three("MXFLASH_FWD_CONSUMERS", "3");
  AttentionOptions opt;
  DeviceBuffer o(size_t(n.q * row * 2)), l(size_t(n.q * H * 4));
  auto launch = [&] {
    return attention_forward(got.ops, qm, km, opt, make_view(o.get(), DType::kBFloat16, Device::kCUDA, {n.q, H, kHeadDim}),
                             make_view(l.get(), DType::kFloat32, Device::kCUDA, {H, n.q}));
  };
  std::vector<double> whole;
  std::vector<float> lse_whole(size_t(n.q * H));
  {
    const gputest::ScopedEnv no_split("MXFLASH_FWD_SPLIT", "1");
    gputest::launch_under_env("MXFLASH_FWD_PERSISTENT", "0", {&o, &l}, launch);
    if (HasFatalFailure()) return;
    const std::vector<uint8_t> lb = l.download();
    std::memcpy(lse_whole.data(), lb.data(), lb.size());
    whole = gputest::checked_forward_out(o, l, lse_whole);
    ASSERT_FALSE(whole.empty());
  }
  auto workspace = [&] { return attention_forward_operands_workspace_size(qm, km, H, opt); };
  const double agree = gputest::split_beside_every_whole_item_kernel(o, l, whole, lse_whole, workspace, launch);
  std::printf("    split tail beside persistent whole items: against every item whole %.2f dB\n", agree);
  EXPECT_GT(agree, gputest::kSplitAgreeDb);
  EXPECT_LT(agree, 300.0) << "no item was split";
}

TEST_F(AttentionFwdOperandsGpu, ForwardLongSequences) {
  run_case({{4096}, {4096}, 1}, 25, true);
}

// The causal mask on the operands (the training path): both alignments, Lq = Lk jagged, Lq != Lk
// with rows facing no key (bottom-right, Lq > Lk) and an empty K/V sequence, broadcast Q, fp32
// inputs, a long sequence (many tiles per item, the diagonal crossing two K/V tiles where Lk - Lq is
// no multiple of 128).
TEST_F(AttentionFwdOperandsGpu, ForwardCausal) {
  uint64_t seed = 40;
  for (CausalMask m : {CausalMask::kTopLeft, CausalMask::kBottomRight}) {
    Case c{{1, 17, 127, 128, 129, 0, 300, 1000}, {1, 17, 127, 128, 129, 5, 300, 1000}, 3};
    c.causal = m;
    run_case(c, seed++, true);
    Case x{{200, 64, 33, 700}, {1000, 0, 129, 250}, 2};
    x.causal = m;
    x.bf16 = false;
    run_case(x, seed++, true);
    Case bq{{300}, {1000, 64, 513}, 2};
    bq.broadcast_q = true;
    bq.causal = m;
    run_case(bq, seed++, true);
    Case lng{{2000}, {4096}, 1};
    lng.causal = m;
    run_case(lng, seed++, true);
  }
}

}  // namespace
}  // namespace mxflash
