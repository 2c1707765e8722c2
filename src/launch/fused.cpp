// Host launchers of the fused producers: validate every argument, then run the CPU reference or the
// CUDA kernel, whichever device the tensors live on.
#include "mxflash/fused.h"

#include <cmath>
#include <string>

#include "common/rmsnorm_rules.h"
#include "cuda/fused/fused_cuda.h"
#include "launch/device_runtime.h"
#include "reference/fused_ref.h"

namespace mxflash {
namespace {

// An optional argument is an empty view: no data and no dimensions.
bool absent(const TensorView& t) { return t.data == nullptr && t.ndim == 0; }

Status check_x(const TensorView& x, int64_t* rows, int64_t* cols) {
  MXFLASH_RETURN_IF_ERROR(check_dtype(x, "x", {DType::kBFloat16, DType::kFloat32}));
  if (x.ndim != 2) return Status::Invalid("x: must be 2-D (T, C), got " + x.shape_string());
  const int64_t C = x.shape[1];
  if (C < kBlockSize || C % kBlockSize != 0 || C > kRmsMaxCols)
    return Status::Invalid("x: row length C (axis 1) must be a multiple of 32 from 32 to " +
                           std::to_string(kRmsMaxCols) + ", got " + std::to_string(C));
  MXFLASH_RETURN_IF_ERROR(check_contiguous(x, "x"));
  MXFLASH_RETURN_IF_ERROR(check_not_null(x, "x"));
  *rows = x.shape[0];
  *cols = C;
  return Status::Ok();
}

Status check_devices(const TensorView& x, const TensorView& weight, const TensorView& payload,
                     const TensorView& scales, const TensorView& rstd, Device* dev) {
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&x, "x"}, {&payload, "payload"}, {&scales, "scales"}}, dev));
  if (!absent(weight)) MXFLASH_RETURN_IF_ERROR(check_same_device({{&x, "x"}, {&weight, "weight"}}, dev));
  if (!absent(rstd)) MXFLASH_RETURN_IF_ERROR(check_same_device({{&x, "x"}, {&rstd, "rstd"}}, dev));
  if (*dev == Device::kCUDA) MXFLASH_RETURN_IF_ERROR(detail::check_cuda_ready(x.device_id, "x"));
  return Status::Ok();
}

}  // namespace

Status rmsnorm_quantize(const TensorView& x, const TensorView& weight, const RmsNormQuantizeOptions& opt,
                        TensorView payload, TensorView scales, TensorView rstd, void* stream) {
  if (int(opt.mode) < 0 || int(opt.mode) > 1) return Status::Invalid("mode: must be rceil or floor");
  if (!std::isfinite(opt.eps) || opt.eps < 0.f)
    return Status::Invalid("eps: must be finite and >= 0, got " + std::to_string(opt.eps));
  int64_t T = 0, C = 0;
  MXFLASH_RETURN_IF_ERROR(check_x(x, &T, &C));
  if (!absent(weight)) {
    const int64_t wshape[1] = {C};
    MXFLASH_RETURN_IF_ERROR(check_dense(weight, "weight", {DType::kFloat32, DType::kBFloat16}, 1, wshape));
  }
  const int64_t pshape[2] = {T, C}, sshape[2] = {T, C / kBlockSize}, rshape[1] = {T};
  MXFLASH_RETURN_IF_ERROR(check_dense(payload, "payload", {DType::kE4M3, DType::kUInt8}, 2, pshape));
  MXFLASH_RETURN_IF_ERROR(check_dense(scales, "scales", {DType::kE8M0, DType::kUInt8}, 2, sshape));
  if (!absent(rstd)) MXFLASH_RETURN_IF_ERROR(check_dense(rstd, "rstd", {DType::kFloat32}, 1, rshape));
  Device dev;
  MXFLASH_RETURN_IF_ERROR(check_devices(x, weight, payload, scales, rstd, &dev));

  detail::RmsNormQuantizeProblem p;
  p.x = x.data;
  p.x_bf16 = x.dtype == DType::kBFloat16;
  p.weight = absent(weight) ? nullptr : weight.data;
  p.weight_bf16 = !absent(weight) && weight.dtype == DType::kBFloat16;
  p.rows = T;
  p.cols = C;
  p.eps = opt.eps;
  p.mode = opt.mode;
  p.payload = payload.ptr<uint8_t>();
  p.scales = scales.ptr<uint8_t>();
  p.rstd = absent(rstd) ? nullptr : rstd.ptr<float>();
  if (T == 0) return Status::Ok();
  if (dev == Device::kCPU) {
    ref::rmsnorm_quantize(p);
    return Status::Ok();
  }
  return cuda::rmsnorm_quantize(p, stream);
}

}  // namespace mxflash
