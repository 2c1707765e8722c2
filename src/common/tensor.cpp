#include "mxflash/tensor.h"

#include <cstdint>
#include <string>

namespace mxflash {

const char* to_string(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kE4M3: return "float8_e4m3fn";
    case DType::kE8M0: return "float8_e8m0fnu";
    case DType::kInt32: return "int32";
    case DType::kUInt8: return "uint8";
  }
  return "?";
}
const char* to_string(Device d) { return d == Device::kCPU ? "cpu" : "cuda"; }
std::string device_string(const TensorView& t) {
  return t.device == Device::kCPU ? "cpu" : "cuda:" + std::to_string(t.device_id);
}

int dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    default: return 1;
  }
}

namespace {
// Views with more dimensions than kMaxDims keep their ndim (so every shape check rejects them)
// but only kMaxDims extents are ever read or written.
int stored_dims(int ndim) { return ndim < kMaxDims ? ndim : kMaxDims; }
}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < stored_dims(ndim); ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // no element to address; frameworks report arbitrary strides
  int64_t expect = 1;
  for (int i = stored_dims(ndim) - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string s = "(";
  for (int i = 0; i < stored_dims(ndim); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  if (ndim > kMaxDims) s += ", ...";
  return s + (ndim == 1 ? ",)" : ")");
}

TensorView make_view(void* data, DType dtype, Device device, int ndim, const int64_t* shape, int device_id) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_id = device_id;
  v.ndim = ndim;
  int64_t s = 1;
  for (int i = stored_dims(ndim) - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    v.stride[i] = s;
    s *= shape[i];
  }
  return v;
}

TensorView make_view(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape, int device_id) {
  return make_view(data, dtype, device, int(shape.size()), shape.begin(), device_id);
}

Status check_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed) {
  std::string list;
  for (DType a : allowed) {
    if (t.dtype == a) return Status::Ok();
    list += (list.empty() ? "" : " or ") + std::string(to_string(a));
  }
  return Status::Invalid(std::string(name) + ": dtype must be " + list + ", got " + to_string(t.dtype));
}

Status check_shape(const TensorView& t, const char* name, int ndim, const int64_t* expected) {
  bool ok = t.ndim == ndim;
  for (int i = 0; ok && i < ndim; ++i) ok = t.shape[i] == expected[i];
  if (ok) return Status::Ok();
  TensorView e;
  e.ndim = ndim;
  for (int i = 0; i < ndim; ++i) e.shape[i] = expected[i];
  return Status::Invalid(std::string(name) + ": shape must be " + e.shape_string() + ", got " + t.shape_string());
}

Status check_contiguous(const TensorView& t, const char* name) {
  if (t.is_contiguous()) return Status::Ok();
  return Status::Invalid(std::string(name) + ": must be contiguous (row-major, no gaps)");
}

Status check_not_null(const TensorView& t, const char* name) {
  if (t.data != nullptr || t.numel() == 0) return Status::Ok();
  return Status::Invalid(std::string(name) + ": data pointer is null");
}

Status check_dense(const TensorView& t, const char* name, std::initializer_list<DType> allowed, int ndim,
                   const int64_t* expected) {
  MXFLASH_RETURN_IF_ERROR(check_dtype(t, name, allowed));
  MXFLASH_RETURN_IF_ERROR(check_shape(t, name, ndim, expected));
  MXFLASH_RETURN_IF_ERROR(check_contiguous(t, name));
  return check_not_null(t, name);
}

Status check_alignment(const TensorView& t, const char* name, int bytes) {
  if (reinterpret_cast<uintptr_t>(t.data) % uintptr_t(bytes) == 0) return Status::Ok();
  return Status::Invalid(std::string(name) + ": data pointer must be " + std::to_string(bytes) + "-byte aligned");
}

Status check_same_device(std::initializer_list<NamedView> views, Device* device) {
  const NamedView& first = *views.begin();
  for (const NamedView& v : views) {
    // Any value but kCPU would otherwise be routed to the CUDA backend unchecked.
    if (v.view->device != Device::kCPU && v.view->device != Device::kCUDA)
      return Status::Invalid(std::string(v.name) + ": device must be cpu or cuda, got " +
                             std::to_string(int(v.view->device)));
    if (v.view->device != first.view->device || v.view->device_id != first.view->device_id)
      return Status::Invalid(std::string(v.name) + ": must be on the same device as " + first.name + " (" +
                             device_string(*first.view) + "), got " + device_string(*v.view));
  }
  *device = first.view->device;
  return Status::Ok();
}

}  // namespace mxflash
