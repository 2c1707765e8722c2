// Internal: the few CUDA runtime services the host layer needs, stubbed out in CPU-only builds.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "mxflash/status.h"

namespace mxflash::detail {

bool cuda_built();
// Checks that `device_id` is the current CUDA device.
Status check_current_device(int device_id, const char* name);
// A CUDA tensor can be worked on: CUDA is built and its device is the current one.
inline Status check_cuda_ready(int device_id, const char* name) {
  if (!cuda_built()) return Status::Unsupported(std::string(name) + ": CUDA tensors need a CUDA build");
  return check_current_device(device_id, name);
}
Status device_alloc(size_t bytes, void** out);
void device_free(void* p);
Status copy_to_device(void* dst, const void* src, size_t bytes);
Status copy_to_host(void* dst, const void* src, size_t bytes);

}  // namespace mxflash::detail
