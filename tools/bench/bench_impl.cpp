// AttnProblem helpers and the factories of implementations that do not exist in this build.
#include <algorithm>

#include "bench_impl.h"

namespace mxflash::bench {

bool AttnProblem::uniform() const {
  return std::all_of(lq.begin(), lq.end(), [&](int64_t x) { return x == lq.front(); }) &&
         std::all_of(lk.begin(), lk.end(), [&](int64_t x) { return x == lk.front(); });
}
int64_t AttnProblem::max_lq() const { return lq.empty() ? 0 : *std::max_element(lq.begin(), lq.end()); }
int64_t AttnProblem::max_lk() const { return lk.empty() ? 0 : *std::max_element(lk.begin(), lk.end()); }
int64_t AttnProblem::total_q() const {
  int64_t s = 0;
  for (int64_t x : lq) s += x;
  return s;
}
int64_t AttnProblem::total_k() const {
  int64_t s = 0;
  for (int64_t x : lk) s += x;
  return s;
}

#ifndef MXFLASH_BENCH_CUDNN
std::unique_ptr<AttnImpl> make_cudnn_attention(const AttnProblem&, bool, std::string* why) {
  *why = "mxflash-bench was built without cuDNN (MXFLASH_CUDNN=OFF, or cuDNN / cudnn-frontend not found)";
  return nullptr;
}
int64_t cudnn_runtime_version() { return 0; }
int64_t cudnn_compiled_version() { return 0; }
std::string cudnn_frontend_version() { return ""; }
#endif

}  // namespace mxflash::bench
