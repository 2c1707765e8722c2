// Helpers of the GPU tests: device detection (tests skip, saying so, without a device), device
// buffers, views and byte-for-byte comparison.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "mxflash/mx.h"
#include "mxflash/status.h"
#include "mxflash/tensor.h"

namespace mxflash::gputest {

inline bool cuda_device_present() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();  // a failed query must not look like a later kernel's error
  return ok;
}

#define MXFLASH_SKIP_WITHOUT_CUDA_DEVICE()                                                              \
  do {                                                                                                  \
    if (!::mxflash::gputest::cuda_device_present()) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

// Outputs are filled with these before every run, so an unwritten byte shows up as a difference.
inline constexpr uint8_t kDevicePoison = 0xA5;
inline constexpr uint8_t kHostPoison = 0x5A;

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes ? bytes : 1), cudaSuccess) << "cudaMalloc of " << bytes << " bytes";
  }
  DeviceBuffer(const std::vector<uint8_t>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  void upload(const std::vector<uint8_t>& host) {
    EXPECT_EQ(host.size(), bytes_);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void fill(uint8_t value) { EXPECT_EQ(cudaMemset(ptr_, value, bytes_), cudaSuccess); }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

inline TensorView view_of(void* data, DType t, Device d, const std::vector<int64_t>& shape) {
  return make_view(data, t, d, int(shape.size()), shape.data());
}

inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Waits for the device and checks that nothing failed asynchronously.
inline ::testing::AssertionResult device_ok() {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "CUDA error: " << cudaGetErrorString(e);
}

// SQNR (dB) of bf16 values `got` against `want` (300 when equal); *nonfinite counts non-finite got.
inline double sqnr_bf16(const std::vector<uint16_t>& want, const std::vector<uint16_t>& got, size_t* nonfinite) {
  double s = 0, n = 0;
  *nonfinite = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = bf16_to_float(want[i]), g = bf16_to_float(got[i]);
    *nonfinite += !std::isfinite(g);
    s += w * w;
    n += (g - w) * (g - w);
  }
  return n == 0 ? 300.0 : 10 * std::log10(s / n);
}

// fp32 values as a kernel input: bf16 bits (bf16) or the fp32 bytes.
inline std::vector<uint8_t> input_bytes(const std::vector<float>& x, bool bf16) {
  std::vector<uint8_t> bytes(x.size() * (bf16 ? 2 : 4));
  if (bf16)
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t b = float_to_bf16(x[i]);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    }
  else
    std::memcpy(bytes.data(), x.data(), bytes.size());
  return bytes;
}

inline ::testing::AssertionResult same_bytes(const std::vector<uint8_t>& cpu, const std::vector<uint8_t>& gpu) {
  if (cpu.size() != gpu.size())
    return ::testing::AssertionFailure() << "sizes differ: cpu " << cpu.size() << ", gpu " << gpu.size();
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (cpu[i] != gpu[i] && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%zu of %zu bytes differ; first at byte %zu: cpu 0x%02X, gpu 0x%02X", bad, cpu.size(),
                first, cpu[first], gpu[first]);
  return ::testing::AssertionFailure() << buf;
}

// Sets the environment variable `name` to `value` (nullptr: unsets it) for the object's lifetime.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) saved_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, saved_.c_str(), 1);
    else unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string saved_;
};

// `outputs` poisoned, then `launch` with the environment variable `name` set to `value` (restored
// after); the launch must succeed.
inline void launch_under_env(const char* name, const char* value, const std::vector<DeviceBuffer*>& outputs,
                             const std::function<Status()>& launch) {
  for (DeviceBuffer* b : outputs) b->fill(kDevicePoison);
  Status st;
  {
    const ScopedEnv env(name, value);
    st = launch();
  }
  ASSERT_TRUE(st.ok()) << name << "=" << value << ": " << st.message();
  ASSERT_TRUE(device_ok());
}

// `launch` again with the environment variable `name` set to each of `values` (restored after):
// the outputs must equal, byte for byte, what they held before the call (poisoned in between).
inline void expect_same_bytes_under_env(const char* name, std::initializer_list<const char*> values,
                                        const std::vector<DeviceBuffer*>& outputs, const std::function<Status()>& launch) {
  std::vector<std::vector<uint8_t>> want;
  for (DeviceBuffer* b : outputs) want.push_back(b->download());
  for (const char* value : values) {
    launch_under_env(name, value, outputs, launch);
    if (::testing::Test::HasFatalFailure()) return;
    for (size_t i = 0; i < outputs.size(); ++i)
      EXPECT_TRUE(same_bytes(want[i], outputs[i]->download())) << name << "=" << value << ", output " << i;
  }
}

// The same, from a first run of `launch` under the same variable set to `first`, with the forward's
// split tail off (MXFLASH_FWD_SPLIT=1): which items the three-consumer kernel splits depends on the
// work list's order, and a split item sums in another order (docs/attention.md).
inline void expect_same_bytes_from(const char* name, const char* first, std::initializer_list<const char*> values,
                                   const std::vector<DeviceBuffer*>& outputs, const std::function<Status()>& launch) {
  const ScopedEnv no_split("MXFLASH_FWD_SPLIT", "1");
  launch_under_env(name, first, outputs, launch);
  if (::testing::Test::HasFatalFailure()) return;
  expect_same_bytes_under_env(name, values, outputs, launch);
}

// Runs `launch` once in each work-list order of the attention kernels (MXFLASH_WORK_ORDER=heads
// and =tiles, src/cuda/attention/work_list.cuh: the order chosen by problem size), `outputs`
// poisoned first, and expects the same bytes from both: the order only moves work items between
// CTAs and in time, so no value may depend on it (the forward's split tail off). The outputs are
// left as the last run wrote them.
inline void expect_same_bytes_in_every_work_order(const std::vector<DeviceBuffer*>& outputs,
                                                  const std::function<Status()>& launch) {
  expect_same_bytes_from("MXFLASH_WORK_ORDER", "heads", {"tiles"}, outputs, launch);
}

// The backward's dQ kernel runs a CTA per item or persistent (MXFLASH_BWD_DQ_PERSISTENT: 0 = a CTA
// per item, 1 = a CTA per SM, n >= 2 = at most n CTAs, each walking many items; docs/backward.md):
// each item is summed whole in the same order, so the outputs must keep their bytes.
inline void expect_same_bytes_with_either_dq_kernel(const std::vector<DeviceBuffer*>& outputs,
                                                    const std::function<Status()>& launch) {
  expect_same_bytes_under_env("MXFLASH_BWD_DQ_PERSISTENT", {"0", "1", "2", "5"}, outputs, launch);
}

// The forward runs with two or three consumer warpgroups (MXFLASH_FWD_CONSUMERS forces one;
// docs/attention.md), each with a CTA per item or on its persistent kernel (MXFLASH_FWD_PERSISTENT:
// 0 = a CTA per item, 1 = a CTA per SM, n >= 2 = at most n CTAs, each walking many items): all do
// the same arithmetic per row and must give the same bytes (the three-consumer kernel's split tail
// off).
inline void expect_same_bytes_with_every_forward_kernel(const std::vector<DeviceBuffer*>& outputs,
                                                         const std::function<Status()>& launch) {
  expect_same_bytes_from("MXFLASH_FWD_CONSUMERS", "2", {"3"}, outputs, launch);
  const ScopedEnv no_split("MXFLASH_FWD_SPLIT", "1");
  for (const char* consumers : {"2", "3"}) {
    if (::testing::Test::HasFatalFailure()) return;
    const ScopedEnv count("MXFLASH_FWD_CONSUMERS", consumers);
    expect_same_bytes_under_env("MXFLASH_FWD_PERSISTENT", {"0", "1", "2", "5"}, outputs, launch);
  }
}

// Dequantized MXFP8 dK or dV (output_mxfp8_dkv) as bf16 bits: payload (T, H, 128) e4m3, scales
// (T, H, 4) e8m0 per token row.
inline std::vector<uint16_t> dequantize_rows(const std::vector<uint8_t>& payload, const std::vector<uint8_t>& scales) {
  std::vector<uint16_t> x(payload.size());
  for (size_t i = 0; i < payload.size(); ++i)
    x[i] = float_to_bf16(e4m3_to_float(payload[i]) * e8m0_to_float(scales[(i / kHeadDim) * 4 + (i % kHeadDim) / 32]));
  return x;
}

}  // namespace mxflash::gputest
