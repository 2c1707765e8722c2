// quantize_attention_backward on CUDA against its CPU reference (byte for byte, every byte of the ten
// outputs, poisoned first), quantize_attention_training likewise (both operand sets from one call), and attention_backward on those operands (the fast kernels without their
// prepare passes) against the same public call on the CPU operands (the exact-MX reference on their
// values) and against the fast backward on MX tensors of the same inputs; deterministic across runs
// and work-list orders; a short workspace and bad operands refused before anything is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attention_device_mx.h"
#include "gpu_test_util.h"
#include "mxflash/attention.h"

namespace mxflash {
namespace {
using gputest::DeviceBuffer;
using gputest::DeviceMx;
using test::HostBwdOperands;

std::vector<uint16_t> bits_of(const std::vector<uint8_t>& b) {
  std::vector<uint16_t> x(b.size() / 2);
  std::memcpy(x.data(), b.data(), b.size());
  return x;
}

// SQNR (dB) of `got` against `want` (bf16 bits), printed; every value finite.
double sqnr_of(const char* what, const std::vector<uint16_t>& want, const std::vector<uint16_t>& got) {
  size_t nonfinite = 0;
  const double db = gputest::sqnr_bf16(want, got, &nonfinite);
  EXPECT_EQ(nonfinite, 0u) << what;
  std::printf("    %s: %.2f dB\n", what, db);
  return db;
}

struct Case {
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t heads;
  bool broadcast_q;
  bool bf16;
  bool ring = false;  // the backward's ring forced (MXFLASH_BWD_RING=1; else unset: small shapes run without)
  // Per 128-token K/V tile of a sequence (cycled): V times 2^v_exp[j], K times 2^(j % 4 - 1), so that
  // dS's scale jumps from one K tile to the next; then only the fast backward's checks against the
  // CPU reference and its determinism are run.
  std::vector<int> v_exp = {};
  CausalMask causal = CausalMask::kNone;
};

void run_case(const Case& c, uint64_t seed) {
  const gputest::ScopedEnv ring_env("MXFLASH_BWD_RING", c.ring ? "1" : nullptr);
  JaggedMeta qm, km;
  ASSERT_TRUE(JaggedMeta::FromLengths(c.q_lengths, &qm).ok());
  ASSERT_TRUE(JaggedMeta::FromLengths(c.k_lengths, &km).ok());
  ASSERT_TRUE(qm.upload().ok());
  ASSERT_TRUE(km.upload().ok());
  const int64_t H = c.heads, Tq = qm.total_tokens(), Tk = km.total_tokens(), row = H * kHeadDim;
  const int64_t To = c.broadcast_q ? km.batch() * Tq : Tq;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  auto draw = [&](int64_t T) {
    std::vector<float> x(size_t(T * row));
    for (auto& e : x) e = nd(rng);
    return x;
  };
  std::vector<float> q = draw(Tq), k = draw(Tk), v = draw(Tk), g = draw(To);
  if (!c.v_exp.empty())
    for (int64_t b = 0; b < km.batch(); ++b)
      for (int64_t t = km.cu_seqlens()[size_t(b)]; t < km.cu_seqlens()[size_t(b) + 1]; ++t) {
        const int64_t j = (t - km.cu_seqlens()[size_t(b)]) / 128;
        const float sv = std::ldexp(1.f, c.v_exp[size_t(j) % c.v_exp.size()]), sk = std::ldexp(1.f, int(j % 4) - 1);
        for (int64_t i = 0; i < row; ++i) v[size_t(t * row + i)] *= sv, k[size_t(t * row + i)] *= sk;
      }
  if (c.bf16)
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = bf16_to_float(float_to_bf16(e));

  // The operands: CPU reference, then the CUDA quantizer on device inputs, byte for byte.
  auto host = [&](std::vector<float>& x, int64_t T) {
    return make_view(x.data(), DType::kFloat32, Device::kCPU, {T, H, kHeadDim});
  };
  HostBwdOperands want(qm, km, H);
  Status st = quantize_attention_backward(host(q, Tq), host(k, Tk), host(v, Tk), qm, km, want.ops);
  ASSERT_TRUE(st.ok()) << st.message();
  DeviceBuffer xq(gputest::input_bytes(q, c.bf16)), xk(gputest::input_bytes(k, c.bf16)), xv(gputest::input_bytes(v, c.bf16));
  const DType dt = c.bf16 ? DType::kBFloat16 : DType::kFloat32;
  auto dev_in = [&](DeviceBuffer& b, int64_t T) { return make_view(b.get(), dt, Device::kCUDA, {T, H, kHeadDim}); };
  gputest::DeviceBwdParts dparts(want, qm, km, H);
  const std::vector<std::unique_ptr<DeviceBuffer>>& parts = dparts.parts;
  const AttentionBwdOperands ops = dparts.ops;
  int dev = 0;
  cudaGetDevice(&dev);
  st = quantize_attention_backward(dev_in(xq, Tq), dev_in(xk, Tk), dev_in(xv, Tk), qm, km, ops);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  const char* names[kAttentionBwdOperandCount] = {"q",       "k",       "v",       "qt",       "kt",
                                                  "q_scale", "k_scale", "v_scale", "qt_scale", "kt_scale"};
  for (int i = 0; i < kAttentionBwdOperandCount; ++i)
    EXPECT_TRUE(gputest::same_bytes(want.parts[i], parts[size_t(i)]->download())) << names[i];
  {  // write_qk = false: Q', K' (q, k, q_scale, k_scale) left alone, the other six the same bytes
    for (auto& b : parts) b->fill(gputest::kDevicePoison);
    st = quantize_attention_backward(dev_in(xq, Tq), dev_in(xk, Tk), dev_in(xv, Tk), qm, km, ops, nullptr, false);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    for (int i = 0; i < kAttentionBwdOperandCount; ++i) {
      const std::vector<uint8_t> got = parts[size_t(i)]->download();
      if (i == 0 || i == 1 || i == 5 || i == 6)
        EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == gputest::kDevicePoison; }))
            << names[i] << " written with write_qk = false";
      else
        EXPECT_TRUE(gputest::same_bytes(want.parts[i], got)) << names[i] << " (write_qk = false)";
    }
    st = quantize_attention_backward(dev_in(xq, Tq), dev_in(xk, Tk), dev_in(xv, Tk), qm, km, ops);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  {  // quantize_attention_training: the forward's operands (against the CPU forward quantizer) and
     // the backward's (against `want`) from one call, every output poisoned first.
    test::HostOperands want_fwd(qm, km, H);
    st = quantize_attention_forward(host(q, Tq), host(k, Tk), host(v, Tk), qm, km, want_fwd.ops);
    ASSERT_TRUE(st.ok()) << st.message();
    std::vector<std::unique_ptr<DeviceBuffer>> fparts;
    void* fptr[kAttentionFwdOperandCount];
    size_t fbytes[kAttentionFwdOperandCount];
    attention_fwd_operand_bytes(qm, km, H, fbytes);
    for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
      fparts.push_back(std::make_unique<DeviceBuffer>(fbytes[i]));
      fparts.back()->fill(gputest::kDevicePoison);
      fptr[i] = fparts.back()->get();
    }
    for (auto& b : parts) b->fill(gputest::kDevicePoison);
    const AttentionFwdOperands fops = attention_fwd_operand_views(qm, km, H, fptr, Device::kCUDA, dev);
    AttentionBwdOperands bops = ops;
    bops.q = fops.q, bops.q_scale = fops.q_scale, bops.k = fops.k, bops.k_scale = fops.k_scale;
    st = quantize_attention_training(dev_in(xq, Tq), dev_in(xk, Tk), dev_in(xv, Tk), qm, km, fops, bops);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    const char* fnames[kAttentionFwdOperandCount] = {"q", "k", "v", "q_scale", "k_scale", "v_scale"};
    for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
      std::vector<uint8_t> w(want_fwd.parts[i].begin(), want_fwd.parts[i].begin() + ptrdiff_t(fbytes[i]));
      EXPECT_TRUE(gputest::same_bytes(w, fparts[size_t(i)]->download())) << "training: fwd " << fnames[i];
    }
    for (int i : {2, 3, 4, 7, 8, 9})
      EXPECT_TRUE(gputest::same_bytes(want.parts[i], parts[size_t(i)]->download())) << "training: bwd " << names[i];
    st = quantize_attention_backward(dev_in(xq, Tq), dev_in(xk, Tk), dev_in(xv, Tk), qm, km, ops);
    ASSERT_TRUE(st.ok()) << st.message();
  }

  // out and lse from the CPU forward on MX tensors; dO in bf16.
  const test::HostMx hq = test::quantize_host(q, qm, H, Orientation::kHdim);
  const test::HostMx hqs = test::quantize_host(q, qm, H, Orientation::kSeq);
  const test::HostMx hk = test::quantize_host(k, km, H, Orientation::kHdim);
  const test::HostMx hks = test::quantize_host(k, km, H, Orientation::kSeq);
  const test::HostMx hv = test::quantize_host(v, km, H, Orientation::kHdim);
  const test::HostMx hvs = test::quantize_host(v, km, H, Orientation::kSeq);
  AttentionOptions fo;
  fo.broadcast_q = c.broadcast_q;
  fo.causal = c.causal;
  std::vector<uint16_t> out(size_t(To * row)), dout(out.size());
  std::vector<float> lse(size_t(H * To));
  ASSERT_TRUE(attention_forward(hq.t, hk.t, hvs.t, qm, km, fo,
                                make_view(out.data(), DType::kBFloat16, Device::kCPU, {To, H, kHeadDim}),
                                make_view(lse.data(), DType::kFloat32, Device::kCPU, {H, To}))
                  .ok());
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = float_to_bf16(g[i]);

  // The CPU backward on the CPU operands: the reference of the fast kernels on the GPU operands.
  AttentionBackwardOptions bo;
  bo.broadcast_q = c.broadcast_q;
  bo.causal = c.causal;
  std::vector<uint16_t> dq(size_t(Tq * row)), dk(size_t(Tk * row)), dv(dk.size());
  auto cpu_bf16 = [&](std::vector<uint16_t>& x, int64_t T) {
    return make_view(x.data(), DType::kBFloat16, Device::kCPU, {T, H, kHeadDim});
  };
  st = attention_backward(want.ops, cpu_bf16(out, To), cpu_bf16(dout, To),
                          make_view(lse.data(), DType::kFloat32, Device::kCPU, {H, To}), qm, km, bo, cpu_bf16(dq, Tq),
                          cpu_bf16(dk, Tk), cpu_bf16(dv, Tk));
  ASSERT_TRUE(st.ok()) << st.message();

  auto bytes16 = [](const std::vector<uint16_t>& x) {
    std::vector<uint8_t> b(x.size() * 2);
    std::memcpy(b.data(), x.data(), b.size());
    return b;
  };
  DeviceBuffer d_out(bytes16(out)), d_dout(bytes16(dout)), d_lse(lse.size() * 4);
  ASSERT_EQ(cudaMemcpy(d_lse.get(), lse.data(), lse.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  DeviceBuffer d_dq(dq.size() * 2), d_dk(dk.size() * 2), d_dv(dv.size() * 2);
  auto dev_bf16 = [&](const DeviceBuffer& b, int64_t T) {
    return make_view(b.get(), DType::kBFloat16, Device::kCUDA, {T, H, kHeadDim});
  };
  const TensorView d_lse_view = make_view(d_lse.get(), DType::kFloat32, Device::kCUDA, {H, To});
  auto run = [&](const AttentionBwdOperands& o, void* ws, size_t ws_bytes) {
    return attention_backward(o, dev_bf16(d_out, To), dev_bf16(d_dout, To), d_lse_view, qm, km, bo, dev_bf16(d_dq, Tq),
                              dev_bf16(d_dk, Tk), dev_bf16(d_dv, Tk), {}, {}, ws, ws_bytes);
  };
  auto untouched = [&] {
    for (const DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) {
      const std::vector<uint8_t> x = b->download();
      if (!std::all_of(x.begin(), x.end(), [](uint8_t y) { return y == gputest::kDevicePoison; })) return false;
    }
    return true;
  };

  // Refused before anything is written: a workspace one byte short, an operand of the wrong shape.
  const size_t ws_bytes = attention_backward_operands_workspace_size(qm, km, H, bo);
  ASSERT_GT(ws_bytes, 0u);
  {  // (the ring's blocks aside, which only the operands' backward runs)
    const gputest::ScopedEnv off("MXFLASH_BWD_RING", "0");
    const size_t plain = attention_backward_operands_workspace_size(qm, km, H, bo);
    EXPECT_LT(plain, attention_backward_workspace_size(qm, km, H, bo)) << "the operands need no workspace room";
    if (c.ring) EXPECT_GT(ws_bytes, plain) << "the ring's blocks take workspace";
  }
  DeviceBuffer ws(ws_bytes + 256);
  for (DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) b->fill(gputest::kDevicePoison);
  st = run(ops, ws.get(), ws_bytes - 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_EQ(st.message().rfind("workspace", 0), 0u) << st.message();
  st = run(ops, static_cast<uint8_t*>(ws.get()) + 128, ws_bytes);  // long enough, off 256 bytes
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("256-byte aligned"), std::string::npos) << st.message();
  AttentionBwdOperands bad = ops;
  bad.kt = make_view(parts[4]->get(), DType::kE4M3, Device::kCUDA, {H, km.padded_tokens(), kHeadDim}, dev);
  st = run(bad, nullptr, 0);
  EXPECT_EQ(st.message().rfind("ops.kt", 0), 0u) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_TRUE(untouched()) << "a refused call wrote an output";

  // The fast backward on the operands, twice (its own workspace, then the caller's): identical bits,
  // close to the CPU backward on the same operands.
  std::vector<uint8_t> first[3];
  for (int r = 0; r < 2; ++r) {
    for (DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) b->fill(gputest::kDevicePoison);
    st = run(ops, r == 1 ? ws.get() : nullptr, r == 1 ? ws_bytes : 0);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    const std::vector<uint8_t> got[3] = {d_dq.download(), d_dk.download(), d_dv.download()};
    if (r == 0) {
      // Floor as the MX-tensor tests' (the fast kernels quantize dO and dS with coarser scales than
      // the reference; a wrong index or scale gives ~0 dB or less).
      EXPECT_GT(sqnr_of("fast dQ on operands vs the CPU reference on them", dq, bits_of(got[0])), 20.0);
      EXPECT_GT(sqnr_of("fast dK on operands vs the CPU reference on them", dk, bits_of(got[1])), 20.0);
      EXPECT_GT(sqnr_of("fast dV on operands vs the CPU reference on them", dv, bits_of(got[2])), 20.0);
      for (int i = 0; i < 3; ++i) first[i] = got[i];
    } else {
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(got[i] == first[i]) << "fast backward output " << i << " not deterministic";
    }
  }
  if (!c.v_exp.empty()) return;
  {  // dQ, dK, dV 4 bytes past a 16-byte boundary (the API asks 4): the staged epilogues (TMA stores)
     // need 16, so the kernels' direct stores run for every row: the same bytes.
    DeviceBuffer s_dq(dq.size() * 2 + 16), s_dk(dk.size() * 2 + 16), s_dv(dv.size() * 2 + 16);
    for (DeviceBuffer* b : {&s_dq, &s_dk, &s_dv}) b->fill(gputest::kDevicePoison);
    auto shifted = [&](DeviceBuffer& b, int64_t T) {
      return make_view(static_cast<uint8_t*>(b.get()) + 4, DType::kBFloat16, Device::kCUDA, {T, H, kHeadDim});
    };
    st = attention_backward(ops, dev_bf16(d_out, To), dev_bf16(d_dout, To), d_lse_view, qm, km, bo, shifted(s_dq, Tq),
                            shifted(s_dk, Tk), shifted(s_dv, Tk));
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_TRUE(gputest::device_ok());
    for (const auto& [b, want, name] : {std::tuple{&s_dq, &first[0], "dQ"}, std::tuple{&s_dk, &first[1], "dK"},
                                        std::tuple{&s_dv, &first[2], "dV"}}) {
      const std::vector<uint8_t> x = b->download();
      EXPECT_TRUE(std::equal(want->begin(), want->end(), x.begin() + 4))
          << name << " written 4 bytes past a 16-byte boundary differs";
      EXPECT_TRUE(std::all_of(x.begin(), x.begin() + 4, [](uint8_t y) { return y == gputest::kDevicePoison; }) &&
                  std::all_of(x.begin() + 4 + want->size(), x.end(), [](uint8_t y) { return y == gputest::kDevicePoison; }))
          << name << ": bytes written outside the tensor";
    }
  }
  gputest::expect_same_bytes_in_every_work_order({&d_dq, &d_dk, &d_dv}, [&] { return run(ops, nullptr, 0); });
  gputest::expect_same_bytes_with_either_dq_kernel({&d_dq, &d_dk, &d_dv}, [&] { return run(ops, nullptr, 0); });
  if (c.ring) {
    // Against the two kernels one after the other (the ring off): the ring's dK/dV role takes dS as the
    // dQ role quantized it (one scale per 64 queries x 128 keys, where the dK/dV kernel has one per
    // key), so dK differs in the last bits (and shows that the ring ran), ~80 dB apart.
    auto outputs = [&](const char* ring, const char* dq_ctas) {
      const gputest::ScopedEnv r("MXFLASH_BWD_RING", ring), d("MXFLASH_BWD_RING_DQ_CTAS", dq_ctas);
      for (DeviceBuffer* b : {&d_dq, &d_dk, &d_dv}) b->fill(gputest::kDevicePoison);
      st = run(ops, nullptr, 0);
      EXPECT_TRUE(st.ok()) << st.message();
      EXPECT_TRUE(gputest::device_ok());
      return std::vector<std::vector<uint8_t>>{d_dq.download(), d_dk.download(), d_dv.download()};
    };
    const std::vector<std::vector<uint8_t>> two = outputs("0", nullptr);
    // The dQ role on as few CTAs as the ring allows (the tiles a sequence, n: its items then walked
    // several a CTA, each CTA's barriers set up anew per item, as on llm's 27 a CTA): the same bytes.
    // (The rectangular ring: one bundle of n dQ CTAs, then two, whose steps run on across their
    // groups.)
    const int n_q = int((c.q_lengths[0] + 127) / 128);
    for (const int ctas : {n_q, 2 * n_q}) {
      const std::string n_tiles = std::to_string(ctas);
      EXPECT_EQ(outputs("1", n_tiles.c_str()), (std::vector<std::vector<uint8_t>>{first[0], first[1], first[2]}))
          << "the ring with its dQ role on " << n_tiles << " CTAs differs";
    }
    {  // output_mxfp8_dkv: the ring's dK, dV in fp32, then the 32x32 quantizer; dV the two kernels'
       // bytes (the same P bytes), dK as close as in bf16.
      AttentionBackwardOptions mo = bo;
      mo.output_mxfp8_dkv = true;
      auto mx_outputs = [&](const char* ring) {
        const gputest::ScopedEnv r("MXFLASH_BWD_RING", ring);
        DeviceBuffer pk(size_t(Tk * row)), pv(size_t(Tk * row)), sk(size_t(Tk * H * 4)), sv(size_t(Tk * H * 4));
        for (DeviceBuffer* b : {&pk, &pv, &sk, &sv}) b->fill(gputest::kDevicePoison);
        auto pay = [&](DeviceBuffer& b) { return make_view(b.get(), DType::kE4M3, Device::kCUDA, {Tk, H, kHeadDim}); };
        auto sc = [&](DeviceBuffer& b) { return make_view(b.get(), DType::kE8M0, Device::kCUDA, {Tk, H, kHeadDim / 32}); };
        st = attention_backward(ops, dev_bf16(d_out, To), dev_bf16(d_dout, To), d_lse_view, qm, km, mo, dev_bf16(d_dq, Tq),
                                pay(pk), pay(pv), sc(sk), sc(sv));
        EXPECT_TRUE(st.ok()) << st.message();
        EXPECT_TRUE(gputest::device_ok());
        return std::vector<std::vector<uint8_t>>{pk.download(), sk.download(), pv.download(), sv.download()};
      };
      const auto ring_mx = mx_outputs("1"), two_mx = mx_outputs("0");
      EXPECT_TRUE(ring_mx[2] == two_mx[2] && ring_mx[3] == two_mx[3]) << "MXFP8 dV differs from the two kernels'";
      EXPECT_GT(sqnr_of("ring MXFP8 dK vs two kernels", gputest::dequantize_rows(two_mx[0], two_mx[1]),
                        gputest::dequantize_rows(ring_mx[0], ring_mx[1])),
                40.0);
      EXPECT_GT(sqnr_of("ring MXFP8 dK vs its bf16 dK", bits_of(first[1]), gputest::dequantize_rows(ring_mx[0], ring_mx[1])),
                20.0);
    }
    // A ring grid the device cannot hold at once: the cooperative launch is refused and the call
    // runs the two kernels instead, their bytes.
    EXPECT_EQ(outputs("1", "1000000"), two) << "the ring's fallback differs from the two kernels";
    EXPECT_GT(sqnr_of("ring dQ vs two kernels", bits_of(two[0]), bits_of(first[0])), 40.0);
    EXPECT_GT(sqnr_of("ring dK vs two kernels", bits_of(two[1]), bits_of(first[1])), 40.0);
    EXPECT_GT(sqnr_of("ring dV vs two kernels", bits_of(two[2]), bits_of(first[2])), 40.0);
    EXPECT_NE(two[1], first[1]) << "dK the two kernels' bytes: did the ring run?";
    std::printf("    ring against two kernels: dQ %s, dV %s\n", two[0] == first[0] ? "same bytes" : "differs",
                two[2] == first[2] ? "same bytes" : "differs");
  }

  // Against the fast backward on MX tensors of the same inputs: the two differ only in Qᵀ' and Kᵀ'
  // (per 128-token tile here, per (sequence, channel) there), which for these inputs changes few
  // bytes.
  const DeviceMx mq(hq), mqs(hqs), mk(hk), mks(hks), mv(hv);
  DeviceBuffer m_dq(dq.size() * 2), m_dk(dk.size() * 2), m_dv(dv.size() * 2);
  st = attention_backward(mq.view, mqs.view, mk.view, mks.view, mv.view, dev_bf16(d_out, To), dev_bf16(d_dout, To),
                          d_lse_view, qm, km, bo, dev_bf16(m_dq, Tq), dev_bf16(m_dk, Tk), dev_bf16(m_dv, Tk));
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_TRUE(gputest::device_ok());
  EXPECT_GT(sqnr_of("fast dQ: operands vs MX tensors", bits_of(m_dq.download()), bits_of(first[0])), 40.0);
  EXPECT_GT(sqnr_of("fast dK: operands vs MX tensors", bits_of(m_dk.download()), bits_of(first[1])), 40.0);
  EXPECT_EQ(m_dv.download(), first[2]) << "dV does not read Qᵀ' or Kᵀ': it must not change";
}

class AttentionBwdOperandsGpu : public ::testing::Test {
 protected:
  void SetUp() override { MXFLASH_SKIP_WITHOUT_CUDA_DEVICE(); }
};

TEST_F(AttentionBwdOperandsGpu, JaggedHostileLengthsBf16) {
  // several Q and K/V tiles per sequence, partial last tiles, one-key and empty sequences on either side
  run_case({{300, 1, 700, 0, 129, 64}, {257, 1000, 1, 64, 0, 383}, 2, false, true}, 11);
}

TEST_F(AttentionBwdOperandsGpu, UniformLengthsBf16) {
  // every sequence 1024 tokens on both sides (8 full tiles): the shape of the llm presets (too small
  // for the ring by default: its two kernels one after the other)
  run_case({{1024, 1024}, {1024, 1024}, 2, false, true}, 13);
}

TEST_F(AttentionBwdOperandsGpu, RingUniformLengthsBf16) {
  // the backward's ring forced (its default takes it from 8 tiles a sequence and 256 tiles in all):
  // 8 tiles a sequence (8 steps, 56 dK/dV CTAs); with its dQ role on 8 CTAs, 4 items a CTA
  run_case({{1024, 1024}, {1024, 1024}, 2, false, true, true}, 14);
}

TEST_F(AttentionBwdOperandsGpu, RingShortestSequencesFp32) {
  // the ring's shortest sequences (4 tiles, 4 steps), 9 groups in flight at once
  run_case({{512, 512, 512}, {512, 512, 512}, 3, false, false, true}, 15);
}

TEST_F(AttentionBwdOperandsGpu, RingScaleJumpsBetweenKTilesBf16) {
  // V's tiles 2^0 .. 2^+-100 apart and K's 2^-1 .. 2^2 (Case::v_exp), square ring of 8 tiles: dS's
  // scale (one per 64 queries x 128 keys) changes by many binades from one K tile to the next and
  // D reaches ~2^100; then the rectangular ring on a broadcast Q over K/V of several lengths.
  run_case({{1024, 1024}, {1024, 1024}, 2, false, true, true, {0, 60, -60, 100, -100, 20, -20, 7}}, 18);
  run_case({{300}, {700, 0, 129, 1000}, 2, true, true, true, {0, -40, 40, 90, -90, 3}}, 19);
}

TEST_F(AttentionBwdOperandsGpu, RectRingBroadcastJaggedBf16) {
  // the rectangular ring forced (broadcast Q of 3 tiles, the last partial; K/V sequences of every
  // kind: several tiles, partial, one key, empty), 2 heads: 12 groups on 12 bundles, then on 1 and 2
  run_case({{300}, {700, 0, 129, 1, 1000, 384}, 2, true, true, true}, 16);
}

TEST_F(AttentionBwdOperandsGpu, RectRingUniformQJaggedKFp32) {
  // the rectangular ring forced without broadcast: every Q sequence 256 tokens (2 tiles), K/V
  // lengths that differ (the square ring needs them equal), 3 heads
  run_case({{256, 256, 256, 256}, {1000, 17, 0, 513}, 3, false, false, true}, 17);
}

TEST_F(AttentionBwdOperandsGpu, RingTakenByDefaultWhereItMeasuredFaster) {
  // The ring's blocks take workspace only where it runs. By default its rectangular form (Q
  // sequences of one length, 4 to 16 tiles, K/V of any lengths, 8 tiles on average, at least 8
  // groups a bundle) ahead of the square one: llm (8 x 2048 tokens, 16 heads; 5 bundles of 16),
  // 8 x 2000 (not a multiple of 512, so no square ring), broadcast Q of 512 tokens over 64 x 16384
  // keys (cross) or 64 x 1024; not over 64 x 512, nor for 128-token Q (1 tile), nor on 2 x 2048 x 8
  // heads (16 groups) where the square one runs (from 8 tiles a sequence and 256 tiles in all), nor
  // on 32 x 512 x 16 heads (4 tiles) or 2 x 1024 x 8 heads (128 tiles), where neither does.
  // MXFLASH_BWD_RING=1 takes the square one wherever it can, else the rectangular; =2 the
  // rectangular wherever it can (1 to 64 Q tiles); =0 neither.
  auto ws = [](const std::vector<int64_t>& q, const std::vector<int64_t>& k, int64_t H, bool broadcast,
               const char* ring) {
    const gputest::ScopedEnv env("MXFLASH_BWD_RING", ring);
    JaggedMeta qm, km;
    EXPECT_TRUE(JaggedMeta::FromLengths(q, &qm).ok());
    EXPECT_TRUE(JaggedMeta::FromLengths(k, &km).ok());
    AttentionBackwardOptions bo;
    bo.broadcast_q = broadcast;
    return attention_backward_operands_workspace_size(qm, km, H, bo);
  };
  const std::vector<int64_t> llm(8, 2048), small(2, 2048), short4(32, 512), few(2, 1024), odd(8, 2000),
      k64(64, 16384);
  EXPECT_GT(ws(llm, llm, 16, false, nullptr), ws(llm, llm, 16, false, "0"));
  EXPECT_GT(ws(small, small, 8, false, nullptr), ws(small, small, 8, false, "0"));
  EXPECT_EQ(ws(short4, short4, 16, false, nullptr), ws(short4, short4, 16, false, "0"));
  EXPECT_GT(ws(short4, short4, 16, false, "1"), ws(short4, short4, 16, false, "0"));
  EXPECT_EQ(ws(few, few, 8, false, nullptr), ws(few, few, 8, false, "0"));
  EXPECT_GT(ws(few, few, 8, false, "1"), ws(few, few, 8, false, "0"));
  EXPECT_GT(ws(odd, odd, 16, false, nullptr), ws(odd, odd, 16, false, "0"));
  EXPECT_GT(ws(odd, odd, 16, false, "1"), ws(odd, odd, 16, false, "0"));
  const std::vector<int64_t> k8(64, 1024), k4(64, 512), k16(64, 2048);
  EXPECT_GT(ws({512}, k64, 3, true, nullptr), ws({512}, k64, 3, true, "0"));
  EXPECT_GT(ws({512}, k8, 3, true, nullptr), ws({512}, k8, 3, true, "0"));
  EXPECT_EQ(ws({512}, k4, 3, true, nullptr), ws({512}, k4, 3, true, "0"));
  EXPECT_GT(ws({512}, k4, 3, true, "1"), ws({512}, k4, 3, true, "0"));
  EXPECT_EQ(ws({128}, k16, 3, true, nullptr), ws({128}, k16, 3, true, "0"));
  EXPECT_GT(ws({128}, k16, 3, true, "2"), ws({128}, k16, 3, true, "0"));
  EXPECT_GT(ws(short4, short4, 16, false, "2"), ws(short4, short4, 16, false, "0"));
  EXPECT_GT(ws(few, few, 8, false, "2"), ws(few, few, 8, false, "0"));
  // llm: the rectangular form by default (its blocks: 5 bundles x 8 steps x 16 tiles, 21 MB), the
  // square one with =1 (6 groups x 8 steps x 16 tiles, 25 MB)
  EXPECT_NE(ws(llm, llm, 16, false, nullptr), ws(llm, llm, 16, false, "1"));
  EXPECT_EQ(ws(llm, llm, 16, false, nullptr), ws(llm, llm, 16, false, "2"));
  const std::vector<int64_t> long2(2, 8192);  // llm-long: 64 Q tiles, the square form only
  EXPECT_EQ(ws(long2, long2, 16, false, nullptr), ws(long2, long2, 16, false, "1"));
}

// The causal mask on the operands (the training path; the two kernels, never the ring): both
// alignments, jagged and uniform lengths (uniform ones would take the ring without the mask).
TEST_F(AttentionBwdOperandsGpu, CausalBf16AndFp32) {
  uint64_t seed = 50;
  for (CausalMask m : {CausalMask::kTopLeft, CausalMask::kBottomRight}) {
    Case c{{300, 1, 700, 0, 129, 64}, {257, 1000, 1, 64, 0, 383}, 2, false, true};
    c.causal = m;
    run_case(c, seed++);
    Case u{{1024, 1024}, {1024, 1024}, 2, false, false};
    u.causal = m;
    run_case(u, seed++);
    Case b{{300}, {700, 0, 129, 1}, 3, true, true};
    b.causal = m;
    run_case(b, seed++);
  }
}

TEST_F(AttentionBwdOperandsGpu, BroadcastQFp32) {
  run_case({{300}, {700, 0, 129, 1}, 3, true, false}, 12);
}

}  // namespace
}  // namespace mxflash
