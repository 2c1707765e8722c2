#include <cuda_runtime.h>

#include <string>

#include "launch/device_runtime.h"
#include "mxflash/jagged.h"

namespace mxflash::detail {
namespace {
Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // a failed call leaves its error pending; the next launch would report it as its own
  return Status::Cuda(std::string(what) + ": " + cudaGetErrorString(e));
}
}  // namespace

bool cuda_built() { return true; }

Status check_current_device(int device_id, const char* name) {
  int cur = -1;
  MXFLASH_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&cur), "cudaGetDevice"));
  if (cur == device_id) return Status::Ok();
  return Status::Invalid(std::string(name) + ": lives on cuda:" + std::to_string(device_id) +
                         " but the current device is cuda:" + std::to_string(cur));
}

Status device_alloc(size_t bytes, void** out) { return cuda_status(cudaMalloc(out, bytes), "cudaMalloc"); }
void device_free(void* p) { cudaFree(p); }
Status copy_to_device(void* dst, const void* src, size_t bytes) {
  return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}
Status copy_to_host(void* dst, const void* src, size_t bytes) {
  return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

}  // namespace mxflash::detail
