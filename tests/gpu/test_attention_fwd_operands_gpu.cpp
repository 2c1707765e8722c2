// quantize_attention_forward on CUDA against its CPU reference (byte for byte, every byte of the six
// outputs, poisoned first), and attention_forward on those operands against the CPU forward on the
// same operands, the exact-MX forward and FP64: out SQNR within 0.3 dB of exact MX, LSE to 1e-3.
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
  // V's tile scales replaced, after the quantizer's bytes are checked, by values that are no powers
  // of two (x 0.75, one tile x -2.25): operands a caller wrote. The forward must apply them as the
  // CPU forward on the same operands does (a multiply); only that agreement is judged.
  bool scaled_v_scale = false;
};

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
  auto input = [&](const std::vector<float>& x) {
    std::vector<uint8_t> bytes(x.size() * (c.bf16 ? 2 : 4));
    if (c.bf16)
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t b = float_to_bf16(x[i]);
        std::memcpy(bytes.data() + 2 * i, &b, 2);
      }
    else
      std::memcpy(bytes.data(), x.data(), bytes.size());
    return bytes;
  };
  DeviceBuffer xq(input(q)), xk(input(k)), xv(input(v));
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
  for (const auto& o : outs) {
    const std::vector<uint8_t> g = o.got->download();
    const size_t n = o.want->size() - 16;  // HostOperands' alignment slack
    int bad = 0;
    for (size_t i = 0; i < n; i += o.floats ? 4 : 1) {
      bool same;
      if (o.floats) {
        float a, b;
        std::memcpy(&a, o.want->data() + i, 4);
        std::memcpy(&b, g.data() + i, 4);
        same = (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
      } else {
        same = (*o.want)[i] == g[i];
      }
      if (!same && bad++ < 5)
        ADD_FAILURE() << o.name << " byte " << i << ": gpu 0x" << std::hex << int(g[i]) << ", cpu 0x" << int((*o.want)[i]);
    }
    EXPECT_EQ(bad, 0) << o.name << ": bytes differ from the CPU reference";
  }
  if (!attention) return;
  if (c.scaled_v_scale) {
    const size_t n = (want.v_scale.size() - 16) / sizeof(float);
    ASSERT_GE(n, 2u);
    for (size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, want.v_scale.data() + 4 * i, 4);
      f *= i == 1 ? -2.25f : 0.75f;
      std::memcpy(want.v_scale.data() + 4 * i, &f, 4);
    }
    got.v_scale.upload(want.v_scale);
  }

  // The forward on the GPU operands vs the CPU forward on the CPU operands, exact MX and FP64.
  AttentionOptions opt;
  opt.broadcast_q = c.broadcast_q;
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
  std::vector<double> oc(og.size()), om(og.size());
  for (size_t i = 0; i < og.size(); ++i) {
    oc[i] = bf16_to_float(out_cpu[i]);
    om[i] = bf16_to_float(out_mx[i]);
  }
  const ref::AttnProblem p = ref::make_problem(qm, km, H, q.data(), k.data(), v.data(), ref::kDefaultSoftmaxScale,
                                               c.broadcast_q);
  ref::AttnForwardResult exact;
  ASSERT_TRUE(ref::attention_forward(p, ref::AttnMethod::kFp64, &exact).ok());
  const double s_gpu = sqnr_db(exact.out, og), s_mx = sqnr_db(exact.out, om), s_agree = sqnr_db(oc, og);
  std::printf("    out SQNR vs fp64: gpu (operands) %.2f dB, exact MX %.2f dB; gpu vs cpu on the operands %.2f dB\n",
              s_gpu, s_mx, s_agree);
  if (!c.scaled_v_scale) EXPECT_GT(s_gpu, s_mx - 0.3) << "the operands' forward loses more than 0.3 dB against exact MX";
  EXPECT_GT(s_agree, 30.0) << "the GPU forward disagrees with the CPU forward on the same operands";
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

TEST_F(AttentionFwdOperandsGpu, ForwardVScalesThatAreNoPowersOfTwo) {
  Case c{{200, 64}, {700, 300}, 2};
  c.scaled_v_scale = true;
  run_case(c, 27, true);
}

TEST_F(AttentionFwdOperandsGpu, ForwardLongSequences) {
  run_case({{4096}, {4096}, 1}, 25, true);
}

}  // namespace
}  // namespace mxflash
