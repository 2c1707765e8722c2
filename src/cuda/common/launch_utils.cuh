// Host-side helpers shared by the CUDA launchers: CUDA error -> Status, alignment checks,
// grid sizing for grid-stride kernels.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "mxflash/status.h"

namespace mxflash::cuda {

inline Status cuda_error(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(what) + ": " + cudaGetErrorString(e));
}

// After a <<<>>> launch: configuration errors surface here, not at the launch statement.
inline Status check_launch(const char* kernel) { return cuda_error(cudaGetLastError(), kernel); }

// The kernels move 4-, 8- or 16-byte vectors; a view whose data pointer is offset inside its
// allocation can break that (the launcher checks only contiguity). Rejected before any launch, so
// nothing is written.
inline bool is_aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; }
inline Status check_aligned(const void* p, int bytes, const char* name) {
  if (is_aligned(p, bytes)) return Status::Ok();
  return Status::Invalid(std::string(name) + ": the CUDA kernels need a " + std::to_string(bytes) +
                         "-byte aligned data pointer");
}

// The current device's SM count.
inline Status sm_count(int* sms) {
  int dev = 0;
  MXFLASH_RETURN_IF_ERROR(cuda_error(cudaGetDevice(&dev), "cudaGetDevice"));
  return cuda_error(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
}

// Whether the attention kernels start as programmatic dependents of the small kernels before them
// (the work list's upload, dO's preprocess), each executing griddepcontrol.wait before it reads
// their output: their launch and set-up then overlap those kernels instead of following them.
// MXFLASH_PDL=0 turns it off (A/B measurements); read once.
inline bool pdl_after_setup() {
  static const bool on = [] {
    const char* e = std::getenv("MXFLASH_PDL");
    return !(e != nullptr && e[0] == '0');
  }();
  return on;
}

// Launches `kernel` on `stream`, as a programmatic dependent of the kernel launched before it there
// when `programmatic` (programmatic stream serialization: its CTAs may start once every CTA of that
// kernel has executed griddepcontrol.launch_dependents or exited, and it must execute
// griddepcontrol.wait before reading what that kernel writes), else as an ordinary launch.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_programmatic(bool programmatic, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = programmatic ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Grid for a grid-stride kernel: every CTA resident at once (a second wave of CTAs would each
// carry a full share of the work and double the run time), capped by the work available.
// Occupancy is cached per kernel: it depends only on the kernel and the architecture.
template <auto Kernel>
Status grid_size(int threads, int64_t work_items, int* grid) {
  static const int blocks_per_sm = [threads] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, 0) != cudaSuccess) {
      cudaGetLastError();  // only a sizing hint: clear it so the launch check does not report it
      n = 1;
    }
    return n > 0 ? n : 1;
  }();
  int sms = 0;
  MXFLASH_RETURN_IF_ERROR(sm_count(&sms));
  const int64_t resident = int64_t(sms) * blocks_per_sm;
  *grid = int(work_items < resident ? work_items : resident);
  if (*grid < 1) *grid = 1;
  return Status::Ok();
}

}  // namespace mxflash::cuda
