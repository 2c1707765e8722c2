// A host MX operand (tests/cpu/attention_host_mx.h) copied to the device, with a CUDA MxTensor view.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "cpu/attention_host_mx.h"
#include "gpu_test_util.h"

namespace mxflash::gputest {
using test::HostMx;
using test::quantize_host;

struct DeviceMx {
  DeviceBuffer payload, scales;
  MxTensor view;
  explicit DeviceMx(const HostMx& h) : payload(h.payload), scales(h.scales), view(h.t) {
    view.payload.data = payload.get();
    view.payload.device = Device::kCUDA;
    view.scales.data = scales.get();
    view.scales.device = Device::kCUDA;
  }
};

// Device buffers of the backward's ten operands (poisoned, sized as want's) with CUDA views; with
// fwd, their Q', K' and scales are fwd's (quantize_attention_training writes those once).
struct DeviceBwdParts {
  std::vector<std::unique_ptr<DeviceBuffer>> parts;
  AttentionBwdOperands ops;
  DeviceBwdParts(const test::HostBwdOperands& want, const JaggedMeta& qm, const JaggedMeta& km, int64_t H,
                 const AttentionFwdOperands* fwd = nullptr) {
    void* ptr[kAttentionBwdOperandCount];
    for (int i = 0; i < kAttentionBwdOperandCount; ++i) {
      parts.push_back(std::make_unique<DeviceBuffer>(want.parts[i].size()));
      parts.back()->fill(kDevicePoison);
      ptr[i] = parts.back()->get();
    }
    int dev = 0;
    cudaGetDevice(&dev);
    ops = attention_bwd_operand_views(qm, km, H, ptr, Device::kCUDA, dev);
    if (fwd != nullptr) ops.q = fwd->q, ops.q_scale = fwd->q_scale, ops.k = fwd->k, ops.k_scale = fwd->k_scale;
  }
};

// 10 log10(|ref|^2 / |out - ref|^2), 300 when equal.
inline double sqnr_db(const std::vector<double>& ref, const std::vector<double>& out) {
  double s = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    s += ref[i] * ref[i];
    n += (out[i] - ref[i]) * (out[i] - ref[i]);
  }
  return n == 0 ? 300.0 : 10 * std::log10(s / n);
}

// A GPU forward's outputs, checked against the CPU's LSE: every out element finite (so written:
// the buffers were poisoned), rows without keys -inf alike, finite LSE to 1e-3 relative. Returns
// out as doubles (empty after a failure).
inline std::vector<double> checked_forward_out(const DeviceBuffer& out_gpu, const DeviceBuffer& lse_gpu,
                                               const std::vector<float>& lse_cpu) {
  const std::vector<uint8_t> ob = out_gpu.download(), lb = lse_gpu.download();
  std::vector<double> og(ob.size() / 2);
  for (size_t i = 0; i < og.size(); ++i) {
    uint16_t h16;
    std::memcpy(&h16, ob.data() + 2 * i, 2);
    og[i] = bf16_to_float(h16);
    if (!std::isfinite(og[i])) {
      ADD_FAILURE() << "out[" << i << "] = " << og[i] << " (unwritten or NaN)";
      return {};
    }
  }
  for (size_t i = 0; i < lse_cpu.size(); ++i) {
    float g;
    std::memcpy(&g, lb.data() + 4 * i, 4);
    const bool ok = std::isinf(lse_cpu[i]) ? std::isinf(g) && g < 0
                                           : std::fabs(g - lse_cpu[i]) <= 1e-3 * std::max(1.f, std::fabs(lse_cpu[i]));
    if (!ok) {
      ADD_FAILURE() << "lse[" << i << "] = " << g << ", cpu " << lse_cpu[i];
      return {};
    }
  }
  return og;
}

// The least agreement, in dB, of a forward whose items are split (the three-consumer kernel's split
// tail, docs/attention.md) with the CPU forward, which sums every item whole: P quantized against a
// part's row maxima instead of the whole item's moves the bf16 outputs by up to ~2 dB of agreement
// (H200: 29.9 against 32.2 dB on 4096 keys in 4 parts, the SQNR against FP64 the same or better).
inline constexpr double kSplitAgreeDb = 26.0;

// The forward's workspace (`workspace_bytes()`) with the split tail off (MXFLASH_FWD_SPLIT=1).
inline size_t unsplit_workspace_bytes(const std::function<size_t()>& workspace_bytes) {
  const ScopedEnv no_split("MXFLASH_FWD_SPLIT", "1");
  return workspace_bytes();
}

// The forward again on three consumers with each part count of the split tail forced
// (MXFLASH_FWD_SPLIT=2, 3, 4; every item of a small problem lies in the last, partial wave, so all
// run as parts, some with no K/V tile, sequences with no keys too), out and lse poisoned first:
// lse against the CPU's (`lse_cpu`), out within 0.3 dB of `mx_db` (exact MX's SQNR against
// `exact`) and within kSplitAgreeDb of the CPU forward (`cpu`). Where some K sequence of `k_meta`
// has more than one tile, the workspace (`workspace_bytes()`) must grow by the parts' states.
inline void expect_split_forward_close(DeviceBuffer& out, DeviceBuffer& lse, const std::vector<float>& lse_cpu,
                                       const std::vector<double>& cpu, const std::vector<double>& exact, double mx_db,
                                       const JaggedMeta& k_meta, const std::function<size_t()>& workspace_bytes,
                                       const std::function<Status()>& launch) {
  bool multi_tile = false;
  for (int b = 0; b < k_meta.batch(); ++b) multi_tile = multi_tile || k_meta.length(b) > kHeadDim;
  const ScopedEnv three("MXFLASH_FWD_CONSUMERS", "3");
  const size_t whole = unsplit_workspace_bytes(workspace_bytes);
  for (const char* parts : {"2", "3", "4"}) {
    const ScopedEnv split("MXFLASH_FWD_SPLIT", parts);
    if (multi_tile) EXPECT_GT(workspace_bytes(), whole) << "no split in " << parts << " parts";
    launch_under_env("MXFLASH_FWD_SPLIT", parts, {&out, &lse}, launch);
    if (::testing::Test::HasFatalFailure()) return;
    const std::vector<double> os = checked_forward_out(out, lse, lse_cpu);
    ASSERT_FALSE(os.empty()) << "split in " << parts << " parts";
    const double s_exact = sqnr_db(exact, os), s_cpu = sqnr_db(cpu, os);
    std::printf("    split in %s parts: out SQNR vs fp64 %.2f dB; vs the cpu forward %.2f dB\n", parts, s_exact, s_cpu);
    EXPECT_GT(s_exact, mx_db - 0.3) << "split in " << parts << " parts";
    EXPECT_GT(s_cpu, kSplitAgreeDb) << "split in " << parts << " parts";
  }
}

// Whether the forward's plan splits items as it stands (its workspace, `workspace_bytes()`, larger
// than with the split off).
inline bool forward_splits(const std::function<size_t()>& workspace_bytes) {
  return workspace_bytes() > unsplit_workspace_bytes(workspace_bytes);
}

// Lengths of a problem whose three-consumer items the forward splits beside whole items on this
// device: one Q sequence of ~1.5 rounds of 192-row tiles over `heads` heads (the last tile partial)
// against one K/V sequence of 32 tiles (two parts of 16), so that the plan runs a round of whole
// items and the rest as parts.
struct SplitTailLengths {
  int64_t q, k;
};
inline SplitTailLengths split_tail_lengths(int64_t heads) {
  int dev = 0, sms = 0;
  EXPECT_EQ(cudaGetDevice(&dev), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  const int64_t tiles = (3 * int64_t(sms) / 2 + heads - 1) / heads;
  return {tiles * 192 - 50, 32 * 128 - 30};
}
// One Q and one K/V sequence of those lengths, uploaded (false on any failure).
inline bool split_tail_metas(const SplitTailLengths& n, JaggedMeta* qm, JaggedMeta* km) {
  return JaggedMeta::FromLengths({n.q}, qm).ok() && JaggedMeta::FromLengths({n.k}, km).ok() && qm->upload().ok() &&
         km->upload().ok();
}

// The split tail beside the persistent kernel's whole items (the plan's default wherever items are
// split, docs/attention.md) against a CTA per whole item and against the persistent kernel on 2 and
// 5 CTAs, which walk many items each: the same bytes (every whole item summed in the same order, the
// same items split). Then the persistent run on every SM again, its out checked against `ref_lse`
// (checked_forward_out) and compared with `ref`: returns that SQNR in dB (-1 after a failure).
// Three consumers forced by the caller.
inline double split_beside_every_whole_item_kernel(DeviceBuffer& out, DeviceBuffer& lse, const std::vector<double>& ref,
                                                   const std::vector<float>& ref_lse,
                                                   const std::function<size_t()>& workspace_bytes,
                                                   const std::function<Status()>& launch) {
  EXPECT_TRUE(forward_splits(workspace_bytes)) << "the plan must split this problem's last items";
  if (::testing::Test::HasFailure()) return -1;
  launch_under_env("MXFLASH_FWD_PERSISTENT", "1", {&out, &lse}, launch);
  if (::testing::Test::HasFatalFailure()) return -1;
  expect_same_bytes_under_env("MXFLASH_FWD_PERSISTENT", {"0", "2", "5"}, {&out, &lse}, launch);
  launch_under_env("MXFLASH_FWD_PERSISTENT", "1", {&out, &lse}, launch);
  if (::testing::Test::HasFatalFailure()) return -1;
  const std::vector<double> got = checked_forward_out(out, lse, ref_lse);
  return got.empty() ? -1 : sqnr_db(ref, got);
}

}  // namespace mxflash::gputest
