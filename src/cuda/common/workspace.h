// Internal (CUDA sources only): the device workspaces a launcher allocates for itself, in stream
// order (gemm_quantize, rmsnorm_backward, the attention calls given no workspace).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "mxflash/status.h"

namespace mxflash::cuda {

// cudaMallocFromPoolAsync / cudaFreeAsync on the library's own memory pool of the current device,
// which keeps up to kWorkspacePoolKeep bytes across synchronizations. (The device's default pool
// keeps none: every synchronization hands its memory back to the driver, and the next allocation
// maps it again, ~0.17 ms of host time a call measured inside a training step, during which the GPU
// waits for the next launch.) The user's default pool is left as it is. Under stream capture the
// allocation becomes a graph allocation node, as with cudaMallocAsync. `what` names the call in
// errors.
inline constexpr size_t kWorkspacePoolKeep = size_t(256) << 20;
Status workspace_alloc(size_t bytes, cudaStream_t stream, void** out, const char* what);
Status workspace_free(void* p, cudaStream_t stream, const char* what);

}  // namespace mxflash::cuda
