// JaggedMeta's device copy, through the runtime services (stubbed without CUDA).
#include <vector>

#include "launch/device_runtime.h"
#include "mxflash/jagged.h"

namespace mxflash {

Status JaggedMeta::upload() {
  if (device_) return Status::Ok();
  if (cu_seqlens_.empty()) return Status::Invalid("meta: empty metadata (build it with FromLengths/FromCuSeqlens)");
  const size_t n = cu_seqlens_.size();
  std::vector<int32_t> both(cu_seqlens_);
  both.insert(both.end(), cu_seqlens_sf_.begin(), cu_seqlens_sf_.end());
  void* p = nullptr;
  MXFLASH_RETURN_IF_ERROR(detail::device_alloc(2 * n * sizeof(int32_t), &p));
  Status st = detail::copy_to_device(p, both.data(), 2 * n * sizeof(int32_t));
  if (!st.ok()) {
    detail::device_free(p);
    return st;
  }
  device_ = std::shared_ptr<int32_t>(static_cast<int32_t*>(p), [](int32_t* q) { detail::device_free(q); });
  return Status::Ok();
}

Status JaggedMeta::CheckDeviceCopy(const JaggedMeta& meta, const int32_t* d_cu, const int32_t* d_sf) {
  const size_t n = meta.cu_seqlens().size();
  std::vector<int32_t> cu(n), sf(n);
  MXFLASH_RETURN_IF_ERROR(detail::copy_to_host(cu.data(), d_cu, n * sizeof(int32_t)));
  MXFLASH_RETURN_IF_ERROR(detail::copy_to_host(sf.data(), d_sf, n * sizeof(int32_t)));
  if (cu != meta.cu_seqlens()) return Status::Invalid("cu_seqlens: device copy differs from the host copy");
  if (sf != meta.cu_seqlens_sf()) return Status::Invalid("cu_seqlens_sf: device copy differs from the host copy");
  return Status::Ok();
}

}  // namespace mxflash
