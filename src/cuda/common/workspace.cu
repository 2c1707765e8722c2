// The library's stream-ordered workspace pool (workspace.h).
#include "cuda/common/workspace.h"

#include <mutex>
#include <string>

#include "cuda/common/launch_utils.cuh"

namespace mxflash::cuda {
namespace {

constexpr int kMaxDevices = 64;

// The current device's pool, created on first use (never destroyed: it lives as long as the
// process, as the default pool does).
Status pool_of_current_device(cudaMemPool_t* out) {
  static std::mutex mu;
  static cudaMemPool_t pools[kMaxDevices] = {};
  int dev = 0;
  MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetDevice(&dev), "cudaGetDevice (workspace pool)"));
  if (dev < 0 || dev >= kMaxDevices) return Status::Invalid("workspace pool: device index out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (pools[dev] == nullptr) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    cudaMemPool_t pool = nullptr;
    MXFLASH_RETURN_IF_ERROR(cuda_error(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate (workspace pool)"));
    uint64_t keep = kWorkspacePoolKeep;
    const Status st = cuda_error(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
                                 "cudaMemPoolSetAttribute (workspace pool)");
    if (!st.ok()) {
      cudaMemPoolDestroy(pool);
      return st;
    }
    pools[dev] = pool;
  }
  *out = pools[dev];
  return Status::Ok();
}

}  // namespace

Status workspace_alloc(size_t bytes, cudaStream_t stream, void** out, const char* what) {
  cudaMemPool_t pool = nullptr;
  MXFLASH_RETURN_IF_ERROR(pool_of_current_device(&pool));
  return cuda_error(cudaMallocFromPoolAsync(out, bytes, pool, stream), what);
}

Status workspace_free(void* p, cudaStream_t stream, const char* what) {
  return cuda_error(cudaFreeAsync(p, stream), what);
}

}  // namespace mxflash::cuda
