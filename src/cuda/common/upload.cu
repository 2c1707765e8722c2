// Host data -> device through kernel parameters (upload.h).
#include "cuda/common/upload.h"

#include <cstdint>
#include <cstring>

#include "cuda/common/launch_utils.cuh"

namespace mxflash::cuda {
namespace {

// kWords 32-bit words by value: a small form (4 KB of parameters, the classic limit) for short
// lists and a large one for long lists (CUDA 12.1+ kernels take up to 32764 bytes of parameters).
template <int kWords>
struct WordChunk {
  uint32_t w[kWords];
};

template <int kWords>
__global__ void upload_kernel(const __grid_constant__ WordChunk<kWords> c, int n, uint32_t* __restrict__ dst) {
  // A kernel launched next with programmatic stream serialization may start now: it executes
  // griddepcontrol.wait before it reads what this writes (the attention kernels after their work list).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = c.w[i];
}

template <int kWords>
Status upload_chunk(uint32_t* dst, const uint32_t* src, int n, cudaStream_t stream) {
  WordChunk<kWords> c;
  std::memcpy(c.w, src, size_t(n) * sizeof(uint32_t));
  upload_kernel<kWords><<<1, 256, 0, stream>>>(c, n, dst);
  return check_launch("upload_kernel");
}

}  // namespace

Status upload_to_device(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes % 4 != 0 || reinterpret_cast<uintptr_t>(dst) % 4 != 0 || reinterpret_cast<uintptr_t>(src) % 4 != 0)
    return Status::Invalid("upload_to_device: needs a multiple of 4 bytes at 4-byte aligned addresses");
  constexpr int kSmall = 960, kLarge = 7936;  // 3840 and 31744 bytes of words
  auto* d = static_cast<uint32_t*>(dst);
  const auto* s = static_cast<const uint32_t*>(src);
  size_t left = bytes / 4;
  while (left > 0) {
    const int n = int(left < size_t(kLarge) ? left : size_t(kLarge));
    MXFLASH_RETURN_IF_ERROR(n <= kSmall ? upload_chunk<kSmall>(d, s, n, stream) : upload_chunk<kLarge>(d, s, n, stream));
    d += n;
    s += n;
    left -= size_t(n);
  }
  return Status::Ok();
}

}  // namespace mxflash::cuda
