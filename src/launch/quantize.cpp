// Host launchers for quantization: validate every argument, then run the CPU reference or the
// CUDA kernels, whichever device the tensors live on.
#include "mxflash/quantize.h"

#include <string>
#include <vector>

#include "cuda/quantize/quantize_cuda.h"
#include "launch/device_runtime.h"
#include "reference/quantize_ref.h"

namespace mxflash {
namespace {

// All tensors on one device; for CUDA, that device is current and the metadata is uploaded.
Status check_devices(std::initializer_list<NamedView> args, const JaggedMeta& meta, Device* dev) {
  MXFLASH_RETURN_IF_ERROR(check_same_device(args, dev));
  if (*dev == Device::kCUDA) {
    const NamedView& first = *args.begin();
    MXFLASH_RETURN_IF_ERROR(detail::check_cuda_ready(first.view->device_id, first.name));
    if (!meta.on_device()) return Status::Invalid("meta: has no device copy; call meta.upload() before CUDA work");
  }
  return Status::Ok();
}

Status check_meta(const JaggedMeta& meta) {
  if (meta.batch() < 1) return Status::Invalid("meta: empty metadata (build it with FromLengths/FromCuSeqlens)");
  return Status::Ok();
}

Status check_input(const TensorView& x, const char* name, const JaggedMeta& meta, int64_t* heads,
                   std::initializer_list<DType> dtypes) {
  MXFLASH_RETURN_IF_ERROR(check_dtype(x, name, dtypes));
  if (x.ndim != 3) return Status::Invalid(std::string(name) + ": must be 3-D (T, H, 128), got " + x.shape_string());
  if (x.shape[2] != kHeadDim)
    return Status::Invalid(std::string(name) + ": head dim (last axis) must be 128, got " + std::to_string(x.shape[2]));
  if (x.shape[1] < 1) return Status::Invalid(std::string(name) + ": head count (axis 1) must be >= 1");
  if (x.shape[0] != meta.total_tokens())
    return Status::Invalid(std::string(name) + ": token count (axis 0) is " + std::to_string(x.shape[0]) +
                           " but meta holds " + std::to_string(meta.total_tokens()) + " tokens");
  MXFLASH_RETURN_IF_ERROR(check_contiguous(x, name));
  MXFLASH_RETURN_IF_ERROR(check_not_null(x, name));
  *heads = x.shape[1];
  return Status::Ok();
}

Status check_payload(const TensorView& t, const char* name, const JaggedMeta& meta, int64_t H, PayloadLayout l) {
  int64_t shape[3];
  payload_shape(meta, H, l, shape);
  return check_dense(t, name, {DType::kE4M3, DType::kUInt8}, 3, shape);
}

Status check_scales(const TensorView& t, const char* name, const JaggedMeta& meta, int64_t H, Orientation o,
                    ScaleLayout l) {
  const ScaleShape s = scale_shape(meta, H, o, l);
  return check_dense(t, name, {DType::kE8M0, DType::kUInt8}, s.ndim, s.dims);
}

Status check_enums(Orientation o, const QuantizeOptions& opt) {
  if (int(o) < 0 || int(o) > 2) return Status::Invalid("orientation: must be hdim, seq or square32");
  if (int(opt.mode) < 0 || int(opt.mode) > 1) return Status::Invalid("mode: must be rceil or floor");
  if (int(opt.scale_layout) < 0 || int(opt.scale_layout) > 1)
    return Status::Invalid("scale_layout: must be plain or blocked128x4");
  if (int(opt.payload_layout) < 0 || int(opt.payload_layout) > 1)
    return Status::Invalid("payload_layout: must be token_major or token_contiguous");
  if (o == Orientation::kHdim && opt.payload_layout != PayloadLayout::kTokenMajor)
    return Status::Invalid("payload_layout: hdim payloads are token_major only (token_contiguous is for seq and square32)");
  return Status::Ok();
}

detail::JaggedDims dims_of(const JaggedMeta& meta, int64_t H, Device dev) {
  detail::JaggedDims d;
  d.batch = meta.batch();
  d.T = meta.total_tokens();
  d.P = meta.padded_tokens();
  d.H = H;
  d.max_seqlen = meta.max_seqlen();
  const bool cuda = dev == Device::kCUDA;
  d.cu_seqlens = cuda ? meta.device_cu_seqlens() : meta.cu_seqlens().data();
  d.cu_seqlens_sf = cuda ? meta.device_cu_seqlens_sf() : meta.cu_seqlens_sf().data();
  return d;
}

bool empty_problem(const detail::JaggedDims& d) { return d.P == 0; }

Status run_quantize(detail::QuantizeProblem& p, Device dev, void* stream) {
  if (empty_problem(p.dims)) return Status::Ok();
  if (dev == Device::kCPU) {
    ref::quantize(p);
    return Status::Ok();
  }
  return cuda::quantize(p, stream);
}

}  // namespace

void payload_shape(const JaggedMeta& meta, int64_t H, PayloadLayout l, int64_t out[3]) {
  if (l == PayloadLayout::kTokenMajor) {
    out[0] = meta.total_tokens(), out[1] = H, out[2] = kHeadDim;
  } else {
    out[0] = H, out[1] = kHeadDim, out[2] = meta.padded_tokens();
  }
}

Status quantize(const TensorView& x, const JaggedMeta& meta, Orientation o, const QuantizeOptions& opt,
                TensorView payload, TensorView scales, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_meta(meta));
  MXFLASH_RETURN_IF_ERROR(check_enums(o, opt));
  int64_t H = 0;
  MXFLASH_RETURN_IF_ERROR(check_input(x, "x", meta, &H, {DType::kBFloat16, DType::kFloat32}));
  MXFLASH_RETURN_IF_ERROR(check_payload(payload, "payload", meta, H, opt.payload_layout));
  MXFLASH_RETURN_IF_ERROR(check_scales(scales, "scales", meta, H, o, opt.scale_layout));
  Device dev;
  MXFLASH_RETURN_IF_ERROR(check_devices({{&x, "x"}, {&payload, "payload"}, {&scales, "scales"}}, meta, &dev));

  detail::QuantizeProblem p;
  p.dims = dims_of(meta, H, dev);
  p.x = x.data;
  p.x_bf16 = x.dtype == DType::kBFloat16;
  p.mode = opt.mode;
  p.scale_layout = opt.scale_layout;
  if (o == Orientation::kHdim) {
    p.hdim_payload = payload.ptr<uint8_t>();
    p.hdim_scales = scales.ptr<uint8_t>();
  } else {
    p.tok_orientation = o;
    p.tok_payload_layout = opt.payload_layout;
    p.tok_payload = payload.ptr<uint8_t>();
    p.tok_scales = scales.ptr<uint8_t>();
  }
  return run_quantize(p, dev, stream);
}

Status quantize_hdim_seq(const TensorView& x, const JaggedMeta& meta, const QuantizeOptions& opt,
                         TensorView payload_hdim, TensorView scales_hdim, TensorView payload_seq,
                         TensorView scales_seq, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_meta(meta));
  MXFLASH_RETURN_IF_ERROR(check_enums(Orientation::kSeq, opt));
  int64_t H = 0;
  MXFLASH_RETURN_IF_ERROR(check_input(x, "x", meta, &H, {DType::kBFloat16, DType::kFloat32}));
  MXFLASH_RETURN_IF_ERROR(check_payload(payload_hdim, "payload_hdim", meta, H, PayloadLayout::kTokenMajor));
  MXFLASH_RETURN_IF_ERROR(check_scales(scales_hdim, "scales_hdim", meta, H, Orientation::kHdim, opt.scale_layout));
  MXFLASH_RETURN_IF_ERROR(check_payload(payload_seq, "payload_seq", meta, H, opt.payload_layout));
  MXFLASH_RETURN_IF_ERROR(check_scales(scales_seq, "scales_seq", meta, H, Orientation::kSeq, opt.scale_layout));
  Device dev;
  MXFLASH_RETURN_IF_ERROR(check_devices({{&x, "x"},
                                         {&payload_hdim, "payload_hdim"},
                                         {&scales_hdim, "scales_hdim"},
                                         {&payload_seq, "payload_seq"},
                                         {&scales_seq, "scales_seq"}},
                                        meta, &dev));
  detail::QuantizeProblem p;
  p.dims = dims_of(meta, H, dev);
  p.x = x.data;
  p.x_bf16 = x.dtype == DType::kBFloat16;
  p.mode = opt.mode;
  p.scale_layout = opt.scale_layout;
  p.hdim_payload = payload_hdim.ptr<uint8_t>();
  p.hdim_scales = scales_hdim.ptr<uint8_t>();
  p.tok_orientation = Orientation::kSeq;
  p.tok_payload_layout = opt.payload_layout;
  p.tok_payload = payload_seq.ptr<uint8_t>();
  p.tok_scales = scales_seq.ptr<uint8_t>();
  return run_quantize(p, dev, stream);
}

Status dequantize(const TensorView& payload, const TensorView& scales, const JaggedMeta& meta, Orientation o,
                  ScaleLayout scale_layout, PayloadLayout payload_layout, TensorView out, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_meta(meta));
  QuantizeOptions opt;
  opt.scale_layout = scale_layout;
  opt.payload_layout = payload_layout;
  MXFLASH_RETURN_IF_ERROR(check_enums(o, opt));
  int64_t H = 0;
  MXFLASH_RETURN_IF_ERROR(check_input(out, "out", meta, &H, {DType::kFloat32, DType::kBFloat16}));
  MXFLASH_RETURN_IF_ERROR(check_payload(payload, "payload", meta, H, payload_layout));
  MXFLASH_RETURN_IF_ERROR(check_scales(scales, "scales", meta, H, o, scale_layout));
  Device dev;
  MXFLASH_RETURN_IF_ERROR(check_devices({{&payload, "payload"}, {&scales, "scales"}, {&out, "out"}}, meta, &dev));
  detail::DequantizeProblem p;
  p.dims = dims_of(meta, H, dev);
  p.payload = payload.ptr<const uint8_t>();
  p.scales = scales.ptr<const uint8_t>();
  p.orientation = o;
  p.scale_layout = scale_layout;
  p.payload_layout = payload_layout;
  p.out = out.data;
  p.out_bf16 = out.dtype == DType::kBFloat16;
  if (empty_problem(p.dims)) return Status::Ok();
  if (dev == Device::kCPU) {
    ref::dequantize(p);
    return Status::Ok();
  }
  return cuda::dequantize(p, stream);
}

namespace {
using LayoutFn = void (*)(const detail::LayoutProblem&);
using CudaLayoutFn = Status (*)(const detail::LayoutProblem&, void*);

Status run_layout(const TensorView& src, const char* src_name, const TensorView& dst, const char* dst_name,
                  const JaggedMeta& meta, int64_t H, Orientation o, LayoutFn cpu, CudaLayoutFn gpu, void* stream) {
  Device dev;
  MXFLASH_RETURN_IF_ERROR(check_devices({{&src, src_name}, {&dst, dst_name}}, meta, &dev));
  detail::LayoutProblem p;
  p.dims = dims_of(meta, H, dev);
  p.src = src.ptr<const uint8_t>();
  p.dst = dst.ptr<uint8_t>();
  p.orientation = o;
  if (empty_problem(p.dims)) return Status::Ok();
  if (dev == Device::kCPU) {
    cpu(p);
    return Status::Ok();
  }
  return gpu(p, stream);
}

constexpr std::initializer_list<DType> kByteTypes = {DType::kE4M3, DType::kUInt8, DType::kE8M0};

Status heads_of(const TensorView& t, const char* name, int axis, int64_t* H) {
  if (t.ndim != 3) return Status::Invalid(std::string(name) + ": must be 3-D, got " + t.shape_string());
  *H = t.shape[axis];
  if (*H < 1) return Status::Invalid(std::string(name) + ": head count must be >= 1");
  return Status::Ok();
}
}  // namespace

Status to_token_contiguous(const TensorView& src, const JaggedMeta& meta, TensorView dst, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_meta(meta));
  int64_t H = 0, s[3], d[3];
  MXFLASH_RETURN_IF_ERROR(heads_of(src, "src", 1, &H));
  payload_shape(meta, H, PayloadLayout::kTokenMajor, s);
  payload_shape(meta, H, PayloadLayout::kTokenContiguous, d);
  MXFLASH_RETURN_IF_ERROR(check_dense(src, "src", kByteTypes, 3, s));
  MXFLASH_RETURN_IF_ERROR(check_dense(dst, "dst", kByteTypes, 3, d));
  return run_layout(src, "src", dst, "dst", meta, H, Orientation::kSeq, ref::to_token_contiguous,
                    cuda::to_token_contiguous, stream);
}

Status to_token_major(const TensorView& src, const JaggedMeta& meta, TensorView dst, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_meta(meta));
  int64_t H = 0, s[3], d[3];
  MXFLASH_RETURN_IF_ERROR(heads_of(src, "src", 0, &H));
  payload_shape(meta, H, PayloadLayout::kTokenContiguous, s);
  payload_shape(meta, H, PayloadLayout::kTokenMajor, d);
  MXFLASH_RETURN_IF_ERROR(check_dense(src, "src", kByteTypes, 3, s));
  MXFLASH_RETURN_IF_ERROR(check_dense(dst, "dst", kByteTypes, 3, d));
  return run_layout(src, "src", dst, "dst", meta, H, Orientation::kSeq, ref::to_token_major, cuda::to_token_major,
                    stream);
}

Status scales_to_blocked(const TensorView& plain, const JaggedMeta& meta, int64_t heads, Orientation o,
                         TensorView blocked, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_meta(meta));
  if (heads < 1) return Status::Invalid("heads: must be >= 1");
  MXFLASH_RETURN_IF_ERROR(check_enums(o, QuantizeOptions{}));
  MXFLASH_RETURN_IF_ERROR(check_scales(plain, "plain", meta, heads, o, ScaleLayout::kPlain));
  MXFLASH_RETURN_IF_ERROR(check_scales(blocked, "blocked", meta, heads, o, ScaleLayout::kBlocked128x4));
  return run_layout(plain, "plain", blocked, "blocked", meta, heads, o, ref::scales_to_blocked,
                    cuda::scales_to_blocked, stream);
}

Status scales_to_plain(const TensorView& blocked, const JaggedMeta& meta, int64_t heads, Orientation o,
                       TensorView plain, void* stream) {
  MXFLASH_RETURN_IF_ERROR(check_meta(meta));
  if (heads < 1) return Status::Invalid("heads: must be >= 1");
  MXFLASH_RETURN_IF_ERROR(check_enums(o, QuantizeOptions{}));
  MXFLASH_RETURN_IF_ERROR(check_scales(blocked, "blocked", meta, heads, o, ScaleLayout::kBlocked128x4));
  MXFLASH_RETURN_IF_ERROR(check_scales(plain, "plain", meta, heads, o, ScaleLayout::kPlain));
  return run_layout(blocked, "blocked", plain, "plain", meta, heads, o, ref::scales_to_plain,
                    cuda::scales_to_plain, stream);
}

}  // namespace mxflash
