// The extension point of mxflash-bench: an attention implementation is prepared once (inputs
// allocated, filled, quantized, plans built: all outside timing), then launched on a stream as often
// as the harness asks, rotating among input sets for a cold L2. cuDNN BF16/FP8 implement it today;
// "ours" (MXFP8 attention, impl_mxfp8.cpp) plugs in through make_mxfp8_attention().
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "bench_report.h"
#include "mxflash/attention.h"
#include "mxflash/status.h"

namespace mxflash::bench {

enum class Direction { kFwd, kBwd };
inline const char* to_string(Direction d) { return d == Direction::kFwd ? "fwd" : "bwd"; }

// One attention problem, lengths realized. With broadcast_q, lq holds B copies of the shared length.
struct AttnProblem {
  std::string name;
  int batch = 0;
  int heads = 0;
  int head_dim = 128;
  bool broadcast_q = false;
  // Row i of a Q sequence (with broadcast_q, of each copy) attends keys j < causal_keys(causal, i,
  // Lq_b, Lk_b); every impl applies the mask or reports itself unsupported (never runs unmasked).
  CausalMask causal = CausalMask::kNone;
  std::vector<int64_t> lq, lk;
  uint64_t seed = 0;
  float softmax_scale = 0.f;  // 1/sqrt(head_dim)
  bool need_fwd = true, need_bwd = true;
  std::string cudnn_layout = "auto";  // auto | padded | ragged
  bool uniform() const;
  int64_t max_lq() const;
  int64_t max_lk() const;
  int64_t total_q() const;
  int64_t total_k() const;
};

// A view of one output, for --check (outside timing). Values = scale * stored element.
struct OutputView {
  const void* data = nullptr;
  Elem elem = Elem::kBF16;
  float scale = 1.f;
  const SeqLayout* layout = nullptr;
};

class AttnImpl {
 public:
  virtual ~AttnImpl() = default;
  virtual std::string name() const = 0;
  // Bytes of the inputs one launch of `d` reads (for the cold-L2 rotation count).
  virtual int64_t input_set_bytes(Direction d) const = 0;
  // Allocate, fill, quantize, build plans, run the forward once per set when the backward needs its
  // O and LSE, calibrate scales: everything outside timing. `n_sets` input sets are made.
  virtual Status prepare(int n_sets, cudaStream_t s) = 0;
  // Enqueues one launch of `d` on input set `set` (no synchronization).
  virtual Status run(Direction d, int set, cudaStream_t s) = 0;
  // After run(d, 0): the output named "O" (fwd) or "dQ", "dK", "dV" (bwd).
  virtual Status output(Direction d, const std::string& which, OutputView* out) = 0;
  // Layout, dtypes, scales, plan names... recorded in the JSON and used in the table's footnotes.
  virtual Notes notes(Direction d) const = 0;
};

// Factories. Each returns nullptr and sets *why when it cannot serve the problem in this build.
std::unique_ptr<AttnImpl> make_cudnn_attention(const AttnProblem& p, bool fp8, std::string* why);
// exec: "mxfp8-exec", the forward on operands in the execution layout (quantize_attention_forward).
std::unique_ptr<AttnImpl> make_mxfp8_attention(const AttnProblem& p, bool exec, std::string* why);
// cuDNN version numbers for the report (0 when not built with cuDNN).
int64_t cudnn_runtime_version();
int64_t cudnn_compiled_version();
std::string cudnn_frontend_version();

}  // namespace mxflash::bench
