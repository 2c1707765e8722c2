// Internal (CUDA sources only): host data -> device memory in stream order, safe under CUDA-graph
// capture.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "mxflash/status.h"

namespace mxflash::cuda {

// Copies `bytes` (a multiple of 4; both pointers 4-byte aligned) from host memory to `dst` on
// `stream` by carrying them in the parameters of small copy kernels (up to ~32 KB a launch).
// Unlike cudaMemcpyAsync from pageable memory, this is captured into a CUDA graph as kernel nodes
// that hold their own copy of the data, so `src` may be freed at once and the graph replays it.
Status upload_to_device(void* dst, const void* src, size_t bytes, cudaStream_t stream);

}  // namespace mxflash::cuda
