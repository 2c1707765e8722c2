// CPU-only build: every CUDA service reports that CUDA was not built.
#include "launch/device_runtime.h"

namespace mxflash::detail {
namespace {
Status no_cuda() { return Status::Unsupported("mxflash was built without CUDA"); }
}  // namespace
bool cuda_built() { return false; }
Status check_current_device(int, const char*) { return no_cuda(); }
Status device_alloc(size_t, void**) { return no_cuda(); }
void device_free(void*) {}
Status copy_to_device(void*, const void*, size_t) { return no_cuda(); }
Status copy_to_host(void*, const void*, size_t) { return no_cuda(); }
}  // namespace mxflash::detail
