// A host MX operand (tests/cpu/attention_host_mx.h) copied to the device, with a CUDA MxTensor view.
#pragma once
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

}  // namespace mxflash::gputest
