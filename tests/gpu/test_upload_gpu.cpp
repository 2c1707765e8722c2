// upload_to_device (src/cuda/common/upload.h): host bytes reach the device exactly, across the
// small/large kernel-parameter chunk sizes, and a CUDA graph captured around an upload replays the
// data of capture time after the host buffer is gone.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cuda/common/upload.h"
#include "gpu_test_util.h"

namespace mxflash::gputest {
namespace {

std::vector<uint8_t> random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

TEST(UploadGpu, CopiesEveryByteAndNothingPast) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  // around the chunk limits: 960 words (3840 B) small, 7936 words (31744 B) large
  for (size_t bytes : {size_t(4), size_t(3836), size_t(3840), size_t(3844), size_t(31744), size_t(31748), size_t(200004)}) {
    const std::vector<uint8_t> host = random_bytes(bytes, unsigned(bytes));
    DeviceBuffer dev(bytes + 64);
    dev.fill(kDevicePoison);
    ASSERT_TRUE(cuda::upload_to_device(dev.get(), host.data(), bytes, nullptr).ok()) << bytes;
    ASSERT_TRUE(device_ok());
    const std::vector<uint8_t> got = dev.download();
    EXPECT_TRUE(same_bytes(host, std::vector<uint8_t>(got.begin(), got.begin() + long(bytes)))) << bytes << " bytes";
    for (size_t i = bytes; i < got.size(); ++i) ASSERT_EQ(got[i], kDevicePoison) << "byte " << i << " past " << bytes;
  }
}

TEST(UploadGpu, RejectsSizesAndAddressesOffFourBytes) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  DeviceBuffer dev(64);
  dev.fill(kDevicePoison);
  const std::vector<uint8_t> host = random_bytes(64, 1);
  const Status a = cuda::upload_to_device(dev.get(), host.data(), 6, nullptr);
  const Status b = cuda::upload_to_device(static_cast<uint8_t*>(dev.get()) + 2, host.data(), 8, nullptr);
  EXPECT_FALSE(a.ok());
  EXPECT_FALSE(b.ok());
  EXPECT_NE(a.message().find("multiple of 4"), std::string::npos) << a.message();
  ASSERT_TRUE(device_ok());
  for (uint8_t x : dev.download()) ASSERT_EQ(x, kDevicePoison);
}

TEST(UploadGpu, CapturedGraphReplaysTheBytesOfCaptureTime) {
  MXFLASH_SKIP_WITHOUT_CUDA_DEVICE();
  const size_t bytes = 40000;  // two launches: a large chunk and a small one
  auto host = std::make_unique<std::vector<uint8_t>>(random_bytes(bytes, 7));
  const std::vector<uint8_t> want = *host;
  DeviceBuffer dev(bytes);
  dev.fill(kDevicePoison);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status st = cuda::upload_to_device(dev.get(), host->data(), bytes, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_TRUE(device_ok());
  for (uint8_t x : dev.download()) ASSERT_EQ(x, kDevicePoison) << "capture must not copy";
  std::memset(host->data(), 0x11, bytes);  // the host buffer changes, then goes
  host.reset();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(same_bytes(want, dev.download()));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace mxflash::gputest
