// mxflash-bench host logic that needs no GPU: the command line, presets, sequence lengths
// (uniform, explicit, seeded jagged) and FLOP counts. Built into mxflash_bench_core so the CPU tests
// exercise exactly what the binary runs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mxflash/attention.h"  // CausalMask, causal_keys: the library's mask rule, for FLOPs and impls

namespace mxflash::bench {

inline constexpr int64_t kHeadDim = 128;  // the only head dim of the peers and of the library so far

// How one side's (Q or K/V) sequence lengths are given.
//  uniform  "2048"               every sequence has that length
//  list     "17,0,129"           one length per sequence (sets the batch when --batch is absent)
//  jagged   "jagged:0.5:16384"   seeded random lengths with mean fill*max, all in [1, max]
//  same     (K only)             the Q lengths (self-attention)
struct LengthSpec {
  enum class Kind { kUniform, kList, kJagged, kSame };
  Kind kind = Kind::kUniform;
  int64_t value = 0;
  std::vector<int64_t> list;
  double fill = 0.5;
  int64_t max = 0;
  std::string to_string() const;
};

// Parses the forms above ("same" only when allow_same). On failure `err` names the problem.
bool parse_length_spec(const std::string& text, bool allow_same, LengthSpec* out, std::string* err);

// One attention problem to benchmark.
struct CaseSpec {
  std::string name;    // preset name, "custom", or preset name + "*" when flags changed it
  int64_t batch = 0;   // 0: taken from a list spec
  int64_t heads = 16;
  int64_t head_dim = kHeadDim;
  LengthSpec lq, lk;
  bool broadcast_q = false;  // one shared Q sequence of length Lq attends to each of B K/V sequences
  // --causal: query row i of a sequence attends keys j < causal_keys(causal, i, Lq, Lk) only
  // (include/mxflash/attention.h); every impl runs with the mask, FLOPs count the unmasked pairs.
  CausalMask causal = CausalMask::kNone;
  uint64_t seed = 1234;      // jagged lengths and input data
};

// The causal mask's names: mxflash::causal_name, mxflash::parse_causal (attention.h).

// Realized lengths: one entry per batch element on each side (with broadcast_q, lq holds B copies
// of the shared length: that is how FLOPs count and how cuDNN, which has no broadcast, runs it).
struct CaseLengths {
  std::vector<int64_t> lq, lk;
};

// Expands the spec into lengths; false + `err` when the spec is inconsistent (list length vs batch,
// broadcast with non-uniform Q, ...).
bool realize_lengths(const CaseSpec& spec, CaseLengths* out, std::string* err);

// Seeded jagged lengths: B values in [min_len, max_len] whose mean is fill*max_len (the sum is
// corrected to round(fill*max_len*B) after a uniform draw, so the mean is exact up to rounding).
// Deterministic across platforms (own splitmix64 generator, no std:: distributions).
std::vector<int64_t> jagged_lengths(int64_t batch, double fill, int64_t max_len, uint64_t seed,
                                    int64_t min_len = 1);

// sum_b Lq_b * Lk_b (with broadcast_q: Lq * sum_b Lk_b, the same number).
int64_t sum_lq_lk(const CaseLengths& l);
// The (query row, key) pairs a mask leaves: sum_b sum_{i < Lq_b} causal_keys(mask, i, Lq_b, Lk_b)
// (closed form per sequence); sum_lq_lk for kNone.
int64_t attended_pairs(const CaseLengths& l, CausalMask mask);
// REFERENCE.md §6: forward 4*H*D*P, backward 10*H*D*P, P = attended_pairs(l, mask): sum(Lq*Lk)
// without a mask, exactly the unmasked pairs with one (no work is counted for masked-out pairs).
double attention_flops(const CaseLengths& l, int64_t heads, int64_t head_dim, bool backward,
                       CausalMask mask = CausalMask::kNone);

// Presets: llm, llm-long, cross, jagged; "all" = the four. False for an unknown name.
bool preset_cases(const std::string& name, std::vector<CaseSpec>* out);
const std::vector<std::string>& preset_names();  // the four, in order

// Implementations the binary knows.
const std::vector<std::string>& impl_names();  // cudnn-bf16, cudnn-fp8, mxfp8, mxfp8-exec
// Quantize orientations: hdim, seq, square32, hdim+seq.
const std::vector<std::string>& quant_orientation_names();

struct Options {
  std::vector<CaseSpec> cases;  // attention cases, in order
  bool run_fwd = true;
  bool run_bwd = true;
  bool run_quantize = false;
  std::vector<std::string> impls;  // subset of impl_names(), in that order
  double warmup_s = 1.0;
  double window_s = 5.0;
  int launches = 5;  // launches per CUDA-event sample
  std::string json_path;
  bool check = false;
  std::string cudnn_layout = "auto";  // auto | padded | ragged
  int device = 0;
  // quantize workload
  double quant_gib = 1.0;  // BF16 input size; the batch is sized to it unless the lengths are a list
  int64_t quant_heads = 3;
  LengthSpec quant_lengths;  // default jagged:0.5:16384
  uint64_t quant_seed = 1234;
  std::vector<std::string> quant_orients;
  std::string quant_scale_layout = "blocked";       // plain | blocked
  std::string quant_payload_layout = "token-major";  // token-major | token-contiguous (seq, square32)
  bool help = false;
  std::string command_line;  // shell-quoted argv, to reproduce the run
};

struct ParseResult {
  bool ok = true;
  std::string error;  // names the offending flag
};

// Parses argv (argv[0] is the program). Errors name the flag and what was expected; the binary
// prints them and exits with status 2.
ParseResult parse_args(int argc, const char* const* argv, Options* opt);
std::string usage();
std::string shell_quote(const std::string& s);
std::string join_command_line(int argc, const char* const* argv);

// Quantize workload lengths: the batch sized so that T*H*128*2 bytes is about quant_gib GiB.
bool quantize_lengths(const Options& opt, std::vector<int64_t>* lengths, std::string* err);

}  // namespace mxflash::bench
