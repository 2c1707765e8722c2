// bf16-input variants of the quantization kernel (one translation unit per input type).
#include "cuda/quantize/quantize_launch.cuh"

namespace mxflash::cuda {
template Status launch_quantize<uint16_t>(const QuantizeParams&, const detail::QuantizeProblem&, cudaStream_t);
}  // namespace mxflash::cuda
