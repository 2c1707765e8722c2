// Input generation, amax and output comparison for mxflash-bench. All of this runs outside timing.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "bench_cuda.h"

namespace mxflash::bench {
namespace {

constexpr int kThreads = 256;
constexpr float kTwoPow24Inv = 1.0f / 16777216.0f;

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Box-Muller on two 24-bit uniforms of one 64-bit hash: |z| <= 5.9, enough for benchmark data.
__device__ __forceinline__ float normal_at(uint64_t seed, uint64_t tensor, uint64_t idx) {
  const uint64_t h = mix64(seed * 0x9E3779B97F4A7C15ull + tensor * 0xD1B54A32D192ED03ull + idx + 0x632BE59BD9B4E019ull);
  const float u1 = (float((h >> 40) & 0xFFFFFF) + 0.5f) * kTwoPow24Inv;
  const float u2 = (float((h >> 8) & 0xFFFFFF) + 0.5f) * kTwoPow24Inv;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__device__ __forceinline__ float load_elem(const void* p, Elem e, int64_t i) {
  if (e == Elem::kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  const __nv_fp8_storage_t q = static_cast<const __nv_fp8_storage_t*>(p)[i];
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)));
}

// Grid: x over elements of one sequence (grid-stride), y = sequence.
__global__ void fill_kernel(void* dst, Elem e, float scale, SeqLayout l, uint64_t seed, uint64_t tensor) {
  const int b = blockIdx.y;
  const int64_t len = l.len[b];
  const int64_t rows = l.pad_rows > 0 ? l.pad_rows : len;
  const int64_t n = rows * l.row_elems;
  const int64_t base = l.dst_row[b] * l.row_elems;
  const int64_t key = l.key_row[b] * l.row_elems;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const bool real = i < len * l.row_elems;
    const float v = real ? normal_at(seed, tensor, uint64_t(key + i)) * scale : 0.f;
    if (e == Elem::kBF16) {
      static_cast<__nv_bfloat16*>(dst)[base + i] = __float2bfloat16_rn(v);
    } else {
      static_cast<__nv_fp8_storage_t*>(dst)[base + i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

__global__ void amax_kernel(SeqLayout l, uint64_t seed, uint64_t tensor, float* amax) {
  const int b = blockIdx.y;
  const int64_t n = int64_t(l.len[b]) * l.row_elems;
  const int64_t key = l.key_row[b] * l.row_elems;
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(normal_at(seed, tensor, uint64_t(key + i))));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  // Non-negative floats order like their bit patterns.
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(m));
}

__global__ void compare_kernel(const void* a, Elem ea, float sa, SeqLayout la, const void* bp, Elem eb, float sb,
                               SeqLayout lb, const int32_t* skip, double* acc) {
  const int b = blockIdx.y;
  const int64_t n = int64_t(min(la.len[b], lb.len[b])) * la.row_elems;
  const int64_t first = skip ? int64_t(skip[b]) * la.row_elems : 0;
  const int64_t base_a = la.dst_row[b] * la.row_elems;
  const int64_t base_b = lb.dst_row[b] * lb.row_elems;
  double d[4] = {0, 0, 0, 0};
  for (int64_t i = first + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double x = double(load_elem(a, ea, base_a + i) * sa);
    const double y = double(load_elem(bp, eb, base_b + i) * sb);
    d[0] += x * y;
    d[1] += x * x;
    d[2] += y * y;
    d[3] += (x - y) * (x - y);
  }
  for (int k = 0; k < 4; ++k) {
    double v = d[k];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(acc + k, v);
  }
}

dim3 grid_for(const SeqLayout& l, int64_t rows) {
  const int64_t per_seq = std::max<int64_t>(1, rows * l.row_elems);
  const int64_t blocks = std::min<int64_t>((per_seq + kThreads * 4 - 1) / (kThreads * 4), 4096);
  return dim3(unsigned(std::max<int64_t>(blocks, 1)), unsigned(l.batch));
}

}  // namespace

Status SeqLayoutBuffer::init(const std::vector<int64_t>& len, const std::vector<int64_t>& key_rows, int64_t row_elems,
                             int64_t pad_rows) {
  const size_t B = len.size();
  if (B == 0 || key_rows.size() != B) return Status::Invalid("SeqLayoutBuffer: empty batch or key_rows size mismatch");
  if (B > 65535) return Status::Invalid("SeqLayoutBuffer: batch above 65535 is not supported by the fill kernels");
  std::vector<int64_t> dst(B);
  std::vector<int32_t> len32(B);
  int64_t row = 0, mx = 0;
  for (size_t b = 0; b < B; ++b) {
    dst[b] = pad_rows > 0 ? int64_t(b) * pad_rows : row;
    row += len[b];
    len32[b] = int32_t(len[b]);
    mx = std::max(mx, len[b]);
  }
  rows_ = pad_rows > 0 ? int64_t(B) * pad_rows : row;
  MXFLASH_RETURN_IF_ERROR(dst_.upload(dst));
  MXFLASH_RETURN_IF_ERROR(key_.upload(key_rows));
  MXFLASH_RETURN_IF_ERROR(len_.upload(len32));
  l_.batch = int(B);
  l_.row_elems = row_elems;
  l_.max_len = mx;
  l_.pad_rows = pad_rows;
  l_.dst_row = dst_.as<int64_t>();
  l_.key_row = key_.as<int64_t>();
  l_.len = len_.as<int32_t>();
  return Status::Ok();
}

Status fill_normal(void* dst, Elem e, float scale, const SeqLayout& l, uint64_t seed, uint64_t tensor,
                   cudaStream_t s) {
  fill_kernel<<<grid_for(l, l.pad_rows > 0 ? l.pad_rows : l.max_len), kThreads, 0, s>>>(dst, e, scale, l, seed,
                                                                                       tensor);
  return cuda_status(cudaGetLastError(), "fill_kernel launch");
}

Status amax_normal(const SeqLayout& l, uint64_t seed, uint64_t tensor, float* d_amax, cudaStream_t s) {
  BENCH_CUDA(cudaMemsetAsync(d_amax, 0, sizeof(float), s));
  amax_kernel<<<grid_for(l, l.max_len), kThreads, 0, s>>>(l, seed, tensor, d_amax);
  return cuda_status(cudaGetLastError(), "amax_kernel launch");
}

Status compare(const void* a, Elem ea, float scale_a, const SeqLayout& la, const void* b, Elem eb, float scale_b,
               const SeqLayout& lb, double* d_acc, cudaStream_t s, const int32_t* d_skip_rows) {
  if (la.batch != lb.batch || la.row_elems != lb.row_elems)
    return Status::Invalid("compare: the two layouts describe different tensors");
  BENCH_CUDA(cudaMemsetAsync(d_acc, 0, 4 * sizeof(double), s));
  compare_kernel<<<grid_for(la, la.max_len), kThreads, 0, s>>>(a, ea, scale_a, la, b, eb, scale_b, lb, d_skip_rows,
                                                               d_acc);
  return cuda_status(cudaGetLastError(), "compare_kernel launch");
}

}  // namespace mxflash::bench
