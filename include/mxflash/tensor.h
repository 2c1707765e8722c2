// Non-owning tensor views passed across the host API. Strides are in elements.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "mxflash/status.h"

namespace mxflash {

enum class DType : int { kFloat32 = 0, kBFloat16, kFloat16, kE4M3, kE8M0, kInt32, kUInt8 };
enum class Device : int { kCPU = 0, kCUDA = 1 };

const char* to_string(DType t);
const char* to_string(Device d);
int dtype_size(DType t);
struct TensorView;
// "cpu" or "cuda:N".
std::string device_string(const TensorView& t);

inline constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int device_id = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};

  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_size(dtype); }
  bool is_contiguous() const;
  std::string shape_string() const;
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// A contiguous view of `data` with the given shape.
TensorView make_view(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape,
                     int device_id = 0);
TensorView make_view(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
                     int device_id = 0);

// Argument checks shared by every launcher. Each names the argument and the rule it breaks.
Status check_dtype(const TensorView& t, const char* name, std::initializer_list<DType> allowed);
Status check_shape(const TensorView& t, const char* name, int ndim, const int64_t* expected);
Status check_contiguous(const TensorView& t, const char* name);
Status check_not_null(const TensorView& t, const char* name);
// A dense tensor: one of the allowed dtypes, exactly this shape, contiguous, data present.
Status check_dense(const TensorView& t, const char* name, std::initializer_list<DType> allowed, int ndim,
                   const int64_t* expected);
Status check_alignment(const TensorView& t, const char* name, int bytes);

struct NamedView {
  const TensorView* view;
  const char* name;
};
// Every view on one device, cpu or cuda (the same id as the first); *device gets that device.
Status check_same_device(std::initializer_list<NamedView> views, Device* device);

}  // namespace mxflash
