// Internal (CUDA sources only): the device workspaces a launcher allocates for itself, in stream
// order (gemm_quantize, rmsnorm_backward, the attention calls given no workspace).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

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

// The caller's workspace checks and the call's own workspace, shared by the attention launchers.
struct WorkspaceRule {
  const char* what;      // the call's name in allocation errors, e.g. "attention_backward workspace"
  const char* size_fn;   // appended to the short-workspace message, e.g. " (attention_backward_workspace_size)"
  size_t align;          // a caller's workspace must be aligned to it (0: any)
  const char* align_msg; // the message for a misaligned one
};

// body(ws) on `workspace` (at least `need` bytes, aligned as `rule` says) or, where it is null, on a
// workspace allocated for the call and freed behind it on the stream.
template <typename Body>
Status with_workspace(void* workspace, size_t workspace_bytes, size_t need, cudaStream_t stream,
                      const WorkspaceRule& rule, Body body) {
  bool owned = false;
  if (!workspace) {
    MXFLASH_RETURN_IF_ERROR(workspace_alloc(need, stream, &workspace, rule.what));
    owned = true;
  } else if (workspace_bytes < need) {
    return Status::Invalid("workspace: " + std::to_string(workspace_bytes) + " bytes given, " + std::to_string(need) +
                           " needed" + rule.size_fn);
  } else if (rule.align > 0 && reinterpret_cast<uintptr_t>(workspace) % rule.align != 0) {
    return Status::Invalid(rule.align_msg);
  }
  Status st = body(static_cast<uint8_t*>(workspace));
  if (owned) {
    const Status fr = workspace_free(workspace, stream, rule.what);
    if (st.ok()) st = fr;
  }
  return st;
}

}  // namespace mxflash::cuda
