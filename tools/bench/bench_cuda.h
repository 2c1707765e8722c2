// mxflash-bench device helpers: owned device buffers, CUDA error checks, and the kernels that fill
// inputs with seeded normal data, take their amax, and compare two outputs (bench_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mxflash/status.h"

namespace mxflash::bench {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(what) + ": " + cudaGetErrorString(e));
}
#define BENCH_CUDA(expr) MXFLASH_RETURN_IF_ERROR(::mxflash::bench::cuda_status((expr), #expr))

// Owned device allocation (cudaMalloc: plain device memory, never managed).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  Status alloc(size_t bytes) {
    reset();
    if (bytes == 0) bytes = 256;  // keep pointers valid and aligned for empty tensors
    const cudaError_t e = cudaMalloc(&p_, bytes);
    if (e != cudaSuccess) {
      p_ = nullptr;
      return Status::Cuda("cudaMalloc(" + std::to_string(bytes) + " bytes): " + cudaGetErrorString(e));
    }
    n_ = bytes;
    return Status::Ok();
  }
  template <typename T>
  Status upload(const std::vector<T>& v) {
    MXFLASH_RETURN_IF_ERROR(alloc(v.size() * sizeof(T)));
    return cuda_status(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

enum class Elem : int { kBF16 = 0, kE4M3 = 1 };

// Where each sequence of a (rows, H*D) tensor lives, and which logical rows its values come from.
//  row b starts at dst_row[b]; it holds len[b] real rows; rows [len[b], pad_rows) are padding
//  (written as zeros by fill; pad_rows = 0 for packed tensors).
//  key_row[b]: the logical row of the generator where sequence b starts, so that two layouts of the
//  same logical tensor (padded FP8, ragged BF16, a broadcast Q materialized B times: key_row = 0)
//  hold the same values.
struct SeqLayout {
  int batch = 0;
  int64_t row_elems = 0;  // H * D
  int64_t max_len = 0;    // max over len (for the launch grid)
  int64_t pad_rows = 0;   // padded layouts: rows per sequence; packed: 0
  const int64_t* dst_row = nullptr;  // device, [batch]
  const int64_t* key_row = nullptr;  // device, [batch]
  const int32_t* len = nullptr;      // device, [batch]
};

// Owns the device arrays behind a SeqLayout.
class SeqLayoutBuffer {
 public:
  // packed: dst_row = prefix sums of len; padded (pad_rows > 0): dst_row[b] = b * pad_rows.
  // key_rows: one per sequence (prefix sums of the logical tensor's lengths, or zeros for broadcast).
  Status init(const std::vector<int64_t>& len, const std::vector<int64_t>& key_rows, int64_t row_elems,
              int64_t pad_rows);
  const SeqLayout& layout() const { return l_; }
  int64_t rows() const { return rows_; }  // rows the buffer must hold

 private:
  DeviceBuffer dst_, key_, len_;
  SeqLayout l_;
  int64_t rows_ = 0;
};

// Normal(0, 1) values from a counter-based hash of (seed, tensor, logical element), times `scale`,
// converted to `e` (E4M3 saturates to +-448). Padding rows get zeros.
Status fill_normal(void* dst, Elem e, float scale, const SeqLayout& l, uint64_t seed, uint64_t tensor,
                   cudaStream_t s);
// max |value| of the same generated values (before scale): for per-tensor FP8 scales.
Status amax_normal(const SeqLayout& l, uint64_t seed, uint64_t tensor, float* d_amax, cudaStream_t s);
// Accumulates, over the real rows, sum(a*b), sum(a*a), sum(b*b), sum((a-b)^2) into d_acc[4] (double),
// where a = scale_a * A, b = scale_b * B decoded from their element types and layouts.
// d_skip_rows (device, one per sequence, or null): leading rows of each sequence left out (query
// rows that attend no key under a causal mask, whose output a peer may leave undefined).
Status compare(const void* a, Elem ea, float scale_a, const SeqLayout& la, const void* b, Elem eb, float scale_b,
               const SeqLayout& lb, double* d_acc, cudaStream_t s, const int32_t* d_skip_rows = nullptr);

}  // namespace mxflash::bench
