// Host launchers of the fused producers: validate every argument, then run the CPU reference or the
// CUDA kernel, whichever device the tensors live on.
#include "mxflash/fused.h"

#include <cmath>
#include <string>

#include "common/gemm_rules.h"
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

namespace {

bool overlaps(const TensorView& a, const TensorView& b) {
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

}  // namespace

Status rmsnorm_backward(const TensorView& x, const TensorView& weight, const TensorView& rstd, const TensorView& dy,
                        TensorView dx, TensorView dweight, void* stream) {
  int64_t T = 0, C = 0;
  MXFLASH_RETURN_IF_ERROR(check_x(x, &T, &C));
  const int64_t xshape[2] = {T, C}, rshape[1] = {T}, wshape[1] = {C};
  if (!absent(weight))
    MXFLASH_RETURN_IF_ERROR(check_dense(weight, "weight", {DType::kFloat32, DType::kBFloat16}, 1, wshape));
  MXFLASH_RETURN_IF_ERROR(check_dense(rstd, "rstd", {DType::kFloat32}, 1, rshape));
  MXFLASH_RETURN_IF_ERROR(check_dense(dy, "dy", {x.dtype}, 2, xshape));
  MXFLASH_RETURN_IF_ERROR(check_dense(dx, "dx", {x.dtype}, 2, xshape));
  if (!absent(dweight)) {
    if (absent(weight)) return Status::Invalid("dweight: must be empty when there is no weight");
    MXFLASH_RETURN_IF_ERROR(check_dense(dweight, "dweight", {DType::kFloat32}, 1, wshape));
  }
  if (T > 0 && (overlaps(dx, x) || overlaps(dx, dy)))
    return Status::Invalid("dx: must not overlap x or dy");
  Device dev;
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&x, "x"}, {&rstd, "rstd"}, {&dy, "dy"}, {&dx, "dx"}}, &dev));
  if (!absent(weight)) MXFLASH_RETURN_IF_ERROR(check_same_device({{&x, "x"}, {&weight, "weight"}}, &dev));
  if (!absent(dweight)) MXFLASH_RETURN_IF_ERROR(check_same_device({{&x, "x"}, {&dweight, "dweight"}}, &dev));
  if (dev == Device::kCUDA) MXFLASH_RETURN_IF_ERROR(detail::check_cuda_ready(x.device_id, "x"));

  detail::RmsNormBackwardProblem p;
  p.x = x.data;
  p.bf16 = x.dtype == DType::kBFloat16;
  p.weight = absent(weight) ? nullptr : weight.data;
  p.weight_bf16 = !absent(weight) && weight.dtype == DType::kBFloat16;
  p.rstd = rstd.ptr<float>();
  p.dy = dy.data;
  p.rows = T;
  p.cols = C;
  p.dx = dx.data;
  p.dweight = absent(dweight) ? nullptr : dweight.ptr<float>();
  if (dev == Device::kCPU) {
    ref::rmsnorm_backward(p);
    return Status::Ok();
  }
  return cuda::rmsnorm_backward(p, stream);
}

namespace {

// A 2-D MX operand blocked along K: payload (rows, K) and plain scales (rows, K / 32).
Status check_operand(const TensorView& x, const TensorView& scales, const char* name, const char* scales_name,
                     int64_t* rows, int64_t* k) {
  MXFLASH_RETURN_IF_ERROR(check_dtype(x, name, {DType::kE4M3, DType::kUInt8}));
  if (x.ndim != 2) return Status::Invalid(std::string(name) + ": must be 2-D, got " + x.shape_string());
  const int64_t K = x.shape[1];
  if (K < kBlockSize || K % kBlockSize != 0 || K > kGemmMaxDim)
    return Status::Invalid(std::string(name) + ": K (axis 1) must be a multiple of 32 from 32 to " +
                           std::to_string(kGemmMaxDim) + ", got " + std::to_string(K));
  MXFLASH_RETURN_IF_ERROR(check_contiguous(x, name));
  MXFLASH_RETURN_IF_ERROR(check_not_null(x, name));
  const int64_t sshape[2] = {x.shape[0], K / kBlockSize};
  MXFLASH_RETURN_IF_ERROR(check_dense(scales, scales_name, {DType::kE8M0, DType::kUInt8}, 2, sshape));
  *rows = x.shape[0];
  *k = K;
  return Status::Ok();
}

}  // namespace

Status gemm_quantize(const TensorView& a, const TensorView& a_scales, const TensorView& w, const TensorView& w_scales,
                     const GemmQuantizeOptions& opt, TensorView payload, TensorView scales, void* stream) {
  if (int(opt.mode) < 0 || int(opt.mode) > 1) return Status::Invalid("mode: must be rceil or floor");
  if (int(opt.path) < 0 || int(opt.path) > 2) return Status::Invalid("path: must be auto, exact or coarse");
  int64_t M = 0, K = 0, N = 0, Kw = 0;
  MXFLASH_RETURN_IF_ERROR(check_operand(a, a_scales, "a", "a_scales", &M, &K));
  MXFLASH_RETURN_IF_ERROR(check_operand(w, w_scales, "w", "w_scales", &N, &Kw));
  if (Kw != K)
    return Status::Invalid("w: K (axis 1) must equal a's K (" + std::to_string(K) + "), got " + std::to_string(Kw));
  if (N < kBlockSize || N % kBlockSize != 0 || N > kGemmMaxDim)
    return Status::Invalid("w: N (axis 0) must be a multiple of 32 from 32 to " + std::to_string(kGemmMaxDim) +
                           ", got " + std::to_string(N));
  if (M >= (int64_t(1) << 31)) return Status::Invalid("a: M (axis 0) must be below 2^31, got " + std::to_string(M));
  const int64_t pshape[2] = {M, N}, sshape[2] = {M, N / kBlockSize};
  MXFLASH_RETURN_IF_ERROR(check_dense(payload, "payload", {DType::kE4M3, DType::kUInt8}, 2, pshape));
  MXFLASH_RETURN_IF_ERROR(check_dense(scales, "scales", {DType::kE8M0, DType::kUInt8}, 2, sshape));
  Device dev;
  MXFLASH_RETURN_IF_ERROR(check_same_device({{&a, "a"}, {&a_scales, "a_scales"}, {&w, "w"}, {&w_scales, "w_scales"},
                                             {&payload, "payload"}, {&scales, "scales"}},
                                            &dev));
  if (dev == Device::kCUDA) MXFLASH_RETURN_IF_ERROR(detail::check_cuda_ready(a.device_id, "a"));

  detail::GemmQuantizeProblem p;
  p.a = a.ptr<uint8_t>();
  p.a_scales = a_scales.ptr<uint8_t>();
  p.w = w.ptr<uint8_t>();
  p.w_scales = w_scales.ptr<uint8_t>();
  p.m = M;
  p.n = N;
  p.k = K;
  p.mode = opt.mode;
  p.payload = payload.ptr<uint8_t>();
  p.scales = scales.ptr<uint8_t>();
  if (dev == Device::kCPU) {
    p.path = opt.path == GemmPath::kCoarse ? GemmPath::kCoarse : GemmPath::kExact;
    if (M > 0) ref::gemm_quantize(p);
    return Status::Ok();
  }
  if (M == 0) return Status::Ok();
  const bool coarse_ok = cuda::gemm_coarse_supported(p);
  if (opt.path == GemmPath::kCoarse && !coarse_ok)
    return Status::Invalid(
        "path: coarse on CUDA needs N a multiple of 128, M and K at least 128, a and w 16-byte aligned, payload "
        "8-byte and scales 4-byte aligned; got M " + std::to_string(M) + ", K " + std::to_string(K) + ", N " +
        std::to_string(N));
  p.path = opt.path == GemmPath::kExact || !coarse_ok ? GemmPath::kExact : GemmPath::kCoarse;
  return cuda::gemm_quantize(p, stream);
}

}  // namespace mxflash
