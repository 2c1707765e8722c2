// A host MX operand (tests/cpu/attention_host_mx.h) copied to the device, with a CUDA MxTensor view.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
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

}  // namespace mxflash::gputest
