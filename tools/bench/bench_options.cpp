#include "bench_options.h"

#include "common/strings.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>

namespace mxflash::bench {
namespace {

// splitmix64: a tiny, portable, well-mixed generator (std:: distributions differ between
// standard libraries, which would make "seeded" lengths machine-dependent).
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), unbiased (Lemire's multiply-and-reject).
  uint64_t below(uint64_t n) {
    for (;;) {
      const unsigned __int128 m = (unsigned __int128)next() * n;
      const uint64_t low = uint64_t(m);
      if (low >= n || low >= (-n) % n) return uint64_t(m >> 64);
    }
  }
};

using detail::split;

bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  for (size_t i = 0; i < s.size(); ++i)
    if (!(s[i] >= '0' && s[i] <= '9') && !(i == 0 && s[i] == '-' && s.size() > 1)) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool parse_double(const std::string& s, double lo, double hi, double* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v) || v < lo || v > hi) return false;
  *out = v;
  return true;
}

std::string fmt_double(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

constexpr int64_t kMaxLen = int64_t(1) << 24;
constexpr int64_t kMaxBatch = 1 << 20;

// A comma list whose items must come from `allowed` (plus optional expansions); keeps the order of
// `allowed` and drops duplicates.
bool parse_name_list(const std::string& flag, const std::string& text, const std::vector<std::string>& allowed,
                     std::vector<std::string>* out, std::string* err) {
  out->clear();
  if (text.empty()) {
    *err = flag + ": expected a comma-separated list of " + join(allowed, ", ") + ", got an empty value";
    return false;
  }
  std::vector<std::string> got;
  for (const std::string& item : split(text, ',')) {
    if (!contains(allowed, item)) {
      *err = flag + ": unknown value '" + item + "' (expected " + join(allowed, ", ") + ")";
      return false;
    }
    got.push_back(item);
  }
  for (const std::string& a : allowed)
    if (contains(got, a)) out->push_back(a);
  return true;
}

}  // namespace

// ---------------------------------------------------------------- lengths

std::string LengthSpec::to_string() const {
  switch (kind) {
    case Kind::kUniform: return std::to_string(value);
    case Kind::kSame: return "same";
    case Kind::kJagged: return "jagged:" + fmt_double(fill) + ":" + std::to_string(max);
    case Kind::kList: {
      std::string s;
      for (size_t i = 0; i < list.size(); ++i) s += (i ? "," : "") + std::to_string(list[i]);
      return s;
    }
  }
  return "?";
}

bool parse_length_spec(const std::string& text, bool allow_same, LengthSpec* out, std::string* err) {
  LengthSpec s;
  if (text == "same") {
    if (!allow_same) {
      *err = "'same' is only valid for --lk";
      return false;
    }
    s.kind = LengthSpec::Kind::kSame;
  } else if (text.rfind("jagged:", 0) == 0) {
    const std::vector<std::string> p = split(text.substr(7), ':');
    if (p.size() != 2 || !parse_double(p[0], 1e-6, 1.0, &s.fill) || !parse_int(p[1], 1, kMaxLen, &s.max)) {
      *err = "expected jagged:FILL:MAX with FILL in (0, 1] and MAX in [1, " + std::to_string(kMaxLen) + "], got '" +
             text + "'";
      return false;
    }
    s.kind = LengthSpec::Kind::kJagged;
  } else if (text.find(',') != std::string::npos || text.rfind("list:", 0) == 0) {
    const std::string body = text.rfind("list:", 0) == 0 ? text.substr(5) : text;
    for (const std::string& item : split(body, ',')) {
      int64_t v = 0;
      if (!parse_int(item, 0, kMaxLen, &v)) {
        *err = "expected a list of lengths in [0, " + std::to_string(kMaxLen) + "], got '" + item + "' in '" + text +
               "'";
        return false;
      }
      s.list.push_back(v);
    }
    s.kind = LengthSpec::Kind::kList;
  } else {
    if (!parse_int(text, 1, kMaxLen, &s.value)) {
      *err = "expected a length in [1, " + std::to_string(kMaxLen) + "], a list a,b,c, or jagged:FILL:MAX, got '" +
             text + "'";
      return false;
    }
    s.kind = LengthSpec::Kind::kUniform;
  }
  *out = s;
  return true;
}

std::vector<int64_t> jagged_lengths(int64_t batch, double fill, int64_t max_len, uint64_t seed, int64_t min_len) {
  std::vector<int64_t> len(size_t(std::max<int64_t>(batch, 0)));
  if (batch <= 0) return len;
  min_len = std::clamp<int64_t>(min_len, 0, max_len);
  // A uniform draw whose expectation is the target mean, then an exact correction of the sum.
  const int64_t twice_mean = std::llround(2.0 * fill * double(max_len));
  int64_t lo = min_len, hi = max_len;
  if (twice_mean <= max_len + min_len) {
    hi = std::clamp<int64_t>(twice_mean - min_len, min_len, max_len);
  } else {
    lo = std::clamp<int64_t>(twice_mean - max_len, min_len, max_len);
  }
  SplitMix64 rng{seed ^ 0x6A09E667F3BCC908ull};
  int64_t sum = 0;
  for (auto& l : len) {
    l = lo + int64_t(rng.below(uint64_t(hi - lo + 1)));
    sum += l;
  }
  const int64_t target =
      std::clamp<int64_t>(std::llround(fill * double(max_len) * double(batch)), min_len * batch, max_len * batch);
  int64_t diff = target - sum;
  while (diff != 0) {
    int64_t per = diff / batch;
    if (per == 0) per = diff > 0 ? 1 : -1;
    bool moved = false;
    for (auto& l : len) {
      if (diff == 0) break;
      const int64_t want = std::llabs(per) > std::llabs(diff) ? diff : per;
      const int64_t nl = std::clamp<int64_t>(l + want, min_len, max_len);
      diff -= nl - l;
      moved |= nl != l;
      l = nl;
    }
    if (!moved) break;
  }
  return len;
}

bool realize_lengths(const CaseSpec& spec, CaseLengths* out, std::string* err) {
  int64_t batch = spec.batch;
  auto list_batch = [&](const LengthSpec& s, const char* side) -> bool {
    if (s.kind != LengthSpec::Kind::kList) return true;
    const int64_t n = int64_t(s.list.size());
    if (batch == 0) batch = n;
    if (batch != n) {
      *err = std::string(side) + ": the list has " + std::to_string(n) + " lengths but the batch is " +
             std::to_string(batch);
      return false;
    }
    return true;
  };
  if (!list_batch(spec.lq, "--lq") || !list_batch(spec.lk, "--lk")) return false;
  if (batch <= 0) batch = 1;
  if (spec.heads < 1) {
    *err = "--heads: must be >= 1";
    return false;
  }
  if (spec.head_dim != kHeadDim) {
    *err = "head dim must be 128";
    return false;
  }
  if (spec.broadcast_q && spec.lq.kind != LengthSpec::Kind::kUniform) {
    *err = "--lq: broadcast Q needs one uniform Q length (the shared query sequence)";
    return false;
  }
  auto expand = [&](const LengthSpec& s, uint64_t seed, std::vector<int64_t>* v) {
    switch (s.kind) {
      case LengthSpec::Kind::kUniform: v->assign(size_t(batch), s.value); break;
      case LengthSpec::Kind::kList: *v = s.list; break;
      case LengthSpec::Kind::kJagged: *v = jagged_lengths(batch, s.fill, s.max, seed); break;
      case LengthSpec::Kind::kSame: break;
    }
  };
  if (spec.lq.kind == LengthSpec::Kind::kSame) {
    *err = "--lq: 'same' is only valid for --lk";
    return false;
  }
  expand(spec.lq, spec.seed, &out->lq);
  if (spec.lk.kind == LengthSpec::Kind::kSame) {
    out->lk = out->lq;
  } else {
    expand(spec.lk, spec.seed ^ 0xA5A5A5A55A5A5A5Aull, &out->lk);
  }
  return true;
}

int64_t sum_lq_lk(const CaseLengths& l) {
  int64_t s = 0;
  for (size_t b = 0; b < l.lq.size() && b < l.lk.size(); ++b) s += l.lq[b] * l.lk[b];
  return s;
}

int64_t attended_pairs(const CaseLengths& l, CausalMask mask) {
  int64_t s = 0;
  for (size_t b = 0; b < l.lq.size() && b < l.lk.size(); ++b) {
    const int64_t lq = l.lq[b], lk = l.lk[b];
    if (mask == CausalMask::kNone) {
      s += lq * lk;
      continue;
    }
    // causal_keys(mask, i, lq, lk) = clamp(i + a, 0, lk) for i = 0 .. lq - 1, a = 1 (+ lk - lq for
    // bottom_right): the sum of x clamped to [0, lk] over x in [a, a + lq - 1].
    const int64_t lo = 1 + (mask == CausalMask::kBottomRight ? lk - lq : 0), hi = lo + lq - 1;
    const int64_t l1 = std::max<int64_t>(lo, 0), h1 = std::min(hi, lk);  // 0 <= x <= lk: x
    if (l1 <= h1) s += (l1 + h1) * (h1 - l1 + 1) / 2;
    const int64_t l2 = std::max(lo, lk + 1);  // x > lk: lk
    if (l2 <= hi) s += lk * (hi - l2 + 1);
  }
  return s;
}

double attention_flops(const CaseLengths& l, int64_t heads, int64_t head_dim, bool backward, CausalMask mask) {
  return (backward ? 10.0 : 4.0) * double(heads) * double(head_dim) * double(attended_pairs(l, mask));
}

// ---------------------------------------------------------------- presets

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> v = {"llm", "llm-long", "cross", "jagged"};
  return v;
}

const std::vector<std::string>& impl_names() {
  static const std::vector<std::string> v = {"cudnn-bf16", "cudnn-fp8", "mxfp8", "mxfp8-exec"};
  return v;
}

const std::vector<std::string>& quant_orientation_names() {
  static const std::vector<std::string> v = {"hdim", "seq", "square32", "hdim+seq", "fwd-operands", "bwd-operands",
                                              "training-operands"};
  return v;
}

bool preset_cases(const std::string& name, std::vector<CaseSpec>* out) {
  auto uniform = [](int64_t v) {
    LengthSpec s;
    s.kind = LengthSpec::Kind::kUniform;
    s.value = v;
    return s;
  };
  CaseSpec c;
  c.name = name;
  c.head_dim = kHeadDim;
  if (name == "all") {
    for (const std::string& n : preset_names()) preset_cases(n, out);
    return true;
  } else if (name == "llm") {
    c.batch = 8, c.heads = 16, c.lq = uniform(2048), c.lk = uniform(2048);
  } else if (name == "llm-long") {
    c.batch = 2, c.heads = 16, c.lq = uniform(8192), c.lk = uniform(8192);
  } else if (name == "cross") {
    c.batch = 64, c.heads = 3, c.lq = uniform(512), c.lk = uniform(16384), c.broadcast_q = true;
  } else if (name == "jagged") {
    c.batch = 768, c.heads = 3, c.lq = uniform(512), c.broadcast_q = true;
    c.lk.kind = LengthSpec::Kind::kJagged, c.lk.fill = 0.5, c.lk.max = 16384;
    c.seed = 1234;
  } else {
    return false;
  }
  out->push_back(c);
  return true;
}

// ---------------------------------------------------------------- command line

std::string usage() {
  return R"(mxflash-bench: attention and MX-quantize benchmarks, peers side by side (REFERENCE.md §6).

Usage: mxflash-bench [options]

Workloads and shapes
  --preset LIST        llm (B=8 L=2048 H=16), llm-long (B=2 L=8192 H=16),
                       cross (B=64 Lq=512 broadcast Lk=16384 H=3),
                       jagged (B=768 Lq=512 broadcast, Lk jagged fill 0.5 max 16384, H=3),
                       all (= the four; the default when no shape flag is given)
  --workload LIST      fwd, bwd, both (= fwd,bwd; default), quantize, all (= fwd,bwd,quantize)
  --batch N            batch (overrides the presets' value)
  --heads N            heads
  --lq SPEC            Q lengths: N | a,b,c | jagged:FILL:MAX
  --lk SPEC            K/V lengths: N | a,b,c | jagged:FILL:MAX | same (default: same as Q)
  --broadcast-q        one shared Q sequence (uniform Lq) attends to each of the B K/V sequences
  --no-broadcast-q
  --causal [ALIGN]     causal mask for every impl: top_left (the default ALIGN: row i attends keys
                       j <= i, torch's is_causal), bottom_right (j <= i + Lk - Lq, FlashAttention's)
                       or none; FLOPs count the unmasked (row, key) pairs only. A cuDNN peer that
                       cannot apply the mask to a case is reported unsupported, not run unmasked
  --seed N             seed of jagged lengths and input data (default 1234)
Implementations
  --impl LIST          cudnn-bf16, cudnn-fp8, mxfp8, mxfp8-exec (default: all)
  --cudnn-layout L     auto (default: dense for uniform lengths; jagged: BF16 ragged, FP8 padded),
                       padded, ragged
Protocol
  --warmup-s X         warm-up time per measurement (default 1)
  --window-s X         measurement window of CUDA-event samples (default 5)
  --launches N         launches per sample (default 5)
  --check              compare every impl's outputs with cuDNN BF16 (cosine > 0.99), outside timing,
                       under the case's causal mask (O, dQ on the rows that attend a key)
  --device N           CUDA device (default 0)
Quantize workload (ours, through include/mxflash/quantize.h)
  --quant-gib X        BF16 input size in GiB (default 1)
  --quant-heads N      heads (default 3)
  --quant-lengths SPEC token lengths (default jagged:0.5:16384; the batch is sized to --quant-gib)
  --quant-orient LIST  hdim, seq, square32, hdim+seq, fwd-operands, bwd-operands, training-operands
                       (default: all; fwd-operands / bwd-operands / training-operands:
                       quantize_attention_forward / _backward / _training with x as Q, K and V)
  --quant-scale-layout plain | blocked (default blocked)
  --quant-payload-layout token-major | token-contiguous (seq, square32; default token-major)
Output
  --json FILE          raw samples, shapes, lengths, environment, reproduce command
  -h, --help
The table (TFLOP/s or GB/s, median ms, ratios to each peer) is printed last on stdout; progress on stderr.
)";
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") ==
                        std::string::npos)
    return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string join_command_line(int argc, const char* const* argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) s += (i ? " " : "") + shell_quote(argv[i] ? argv[i] : "");
  return s;
}

ParseResult parse_args(int argc, const char* const* argv, Options* opt) {
  ParseResult r;
  auto fail = [&](std::string msg) {
    r.ok = false;
    r.error = std::move(msg);
    return r;
  };
  *opt = Options();
  opt->command_line = join_command_line(argc, argv);
  opt->quant_lengths.kind = LengthSpec::Kind::kJagged;
  opt->quant_lengths.fill = 0.5;
  opt->quant_lengths.max = 16384;
  opt->quant_orients = quant_orientation_names();
  opt->impls = impl_names();

  std::vector<std::string> presets;
  std::optional<int64_t> batch, heads, seed;
  std::optional<LengthSpec> lq, lk;
  std::optional<bool> broadcast;
  std::optional<CausalMask> causal;
  std::vector<std::string> workloads = {"fwd", "bwd"};

  const std::vector<std::string> value_flags = {
      "--preset",    "--workload",        "--impl",       "--batch",        "--heads",
      "--lq",        "--lk",              "--seed",       "--warmup-s",     "--window-s",
      "--launches",  "--json",            "--cudnn-layout", "--device",     "--quant-gib",
      "--quant-heads", "--quant-lengths", "--quant-orient", "--quant-scale-layout", "--quant-payload-layout"};
  const std::vector<std::string> bool_flags = {"--broadcast-q", "--no-broadcast-q", "--check", "--help", "-h"};

  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i] ? argv[i] : "";
    std::string val;
    bool has_val = false;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      val = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_val = true;
    }
    if (arg == "--causal") {  // an optional value: --causal (top_left), --causal=ALIGN or --causal ALIGN
      // (the binary takes no positional arguments, so a next word not starting with '-' is the value)
      if (!has_val && i + 1 < argc && argv[i + 1] && argv[i + 1][0] != '-') {
        val = argv[++i];
        has_val = true;
      }
      CausalMask m = CausalMask::kTopLeft;
      if (has_val && !parse_causal(val, &m))
        return fail(arg + ": expected top_left, bottom_right or none, got '" + val + "'");
      causal = m;
      continue;
    }
    if (contains(bool_flags, arg)) {
      if (has_val) return fail(arg + ": takes no value");
      if (arg == "--help" || arg == "-h") opt->help = true;
      if (arg == "--broadcast-q") broadcast = true;
      if (arg == "--no-broadcast-q") broadcast = false;
      if (arg == "--check") opt->check = true;
      continue;
    }
    if (!contains(value_flags, arg)) return fail(arg + ": unknown flag (see --help)");
    if (!has_val) {
      if (i + 1 >= argc) return fail(arg + ": missing value");
      val = argv[++i] ? argv[i] : "";
    }
    std::string err;
    int64_t iv = 0;
    double dv = 0;
    if (arg == "--preset") {
      std::vector<std::string> allowed = preset_names();
      allowed.push_back("all");
      std::vector<std::string> got;
      if (!parse_name_list(arg, val, allowed, &got, &err)) return fail(err);
      presets = got;
    } else if (arg == "--workload") {
      std::vector<std::string> got;
      if (!parse_name_list(arg, val, {"fwd", "bwd", "both", "quantize", "all"}, &got, &err)) return fail(err);
      workloads.clear();
      for (const std::string& w : got) {
        if (w == "both" || w == "all") workloads.insert(workloads.end(), {"fwd", "bwd"});
        if (w == "all") workloads.push_back("quantize");
        if (w == "fwd" || w == "bwd" || w == "quantize") workloads.push_back(w);
      }
    } else if (arg == "--impl") {
      if (!parse_name_list(arg, val, impl_names(), &opt->impls, &err)) return fail(err);
    } else if (arg == "--batch") {
      if (!parse_int(val, 1, kMaxBatch, &iv))
        return fail(arg + ": expected an integer in [1, " + std::to_string(kMaxBatch) + "], got '" + val + "'");
      batch = iv;
    } else if (arg == "--heads") {
      if (!parse_int(val, 1, 1024, &iv)) return fail(arg + ": expected an integer in [1, 1024], got '" + val + "'");
      heads = iv;
    } else if (arg == "--lq" || arg == "--lk") {
      LengthSpec s;
      if (!parse_length_spec(val, arg == "--lk", &s, &err)) return fail(arg + ": " + err);
      (arg == "--lq" ? lq : lk) = s;
    } else if (arg == "--seed") {
      if (!parse_int(val, 0, INT64_MAX, &iv)) return fail(arg + ": expected a non-negative integer, got '" + val + "'");
      seed = iv;
    } else if (arg == "--warmup-s") {
      if (!parse_double(val, 0.0, 600.0, &dv)) return fail(arg + ": expected seconds in [0, 600], got '" + val + "'");
      opt->warmup_s = dv;
    } else if (arg == "--window-s") {
      if (!parse_double(val, 1e-3, 3600.0, &dv))
        return fail(arg + ": expected seconds in [0.001, 3600], got '" + val + "'");
      opt->window_s = dv;
    } else if (arg == "--launches") {
      if (!parse_int(val, 1, 10000, &iv)) return fail(arg + ": expected an integer in [1, 10000], got '" + val + "'");
      opt->launches = int(iv);
    } else if (arg == "--json") {
      if (val.empty()) return fail(arg + ": expected a file name");
      opt->json_path = val;
    } else if (arg == "--cudnn-layout") {
      if (val != "auto" && val != "padded" && val != "ragged")
        return fail(arg + ": expected auto, padded or ragged, got '" + val + "'");
      opt->cudnn_layout = val;
    } else if (arg == "--device") {
      if (!parse_int(val, 0, 1023, &iv)) return fail(arg + ": expected a device index, got '" + val + "'");
      opt->device = int(iv);
    } else if (arg == "--quant-gib") {
      if (!parse_double(val, 1e-6, 64.0, &dv)) return fail(arg + ": expected GiB in (0, 64], got '" + val + "'");
      opt->quant_gib = dv;
    } else if (arg == "--quant-heads") {
      if (!parse_int(val, 1, 1024, &iv)) return fail(arg + ": expected an integer in [1, 1024], got '" + val + "'");
      opt->quant_heads = iv;
    } else if (arg == "--quant-lengths") {
      if (!parse_length_spec(val, false, &opt->quant_lengths, &err)) return fail(arg + ": " + err);
    } else if (arg == "--quant-orient") {
      if (!parse_name_list(arg, val, quant_orientation_names(), &opt->quant_orients, &err)) return fail(err);
    } else if (arg == "--quant-scale-layout") {
      if (val != "plain" && val != "blocked") return fail(arg + ": expected plain or blocked, got '" + val + "'");
      opt->quant_scale_layout = val;
    } else if (arg == "--quant-payload-layout") {
      if (val != "token-major" && val != "token-contiguous")
        return fail(arg + ": expected token-major or token-contiguous, got '" + val + "'");
      opt->quant_payload_layout = val;
    }
  }
  if (opt->help) return r;

  opt->run_fwd = contains(workloads, "fwd");
  opt->run_bwd = contains(workloads, "bwd");
  opt->run_quantize = contains(workloads, "quantize");
  const bool attention = opt->run_fwd || opt->run_bwd;
  const bool shape_flags = batch || heads || lq || lk || broadcast;
  const bool masked = causal && *causal != CausalMask::kNone;  // changes a preset's problem

  if (attention) {
    if (presets.empty() && !shape_flags) presets = {"all"};
    for (const std::string& p : presets) preset_cases(p, &opt->cases);
    if (presets.empty()) {
      if (!lq) return fail("--lq: required for a custom shape (or pick a --preset)");
      CaseSpec c;
      c.name = "custom";
      c.lk.kind = LengthSpec::Kind::kSame;
      opt->cases.push_back(c);
    }
    for (CaseSpec& c : opt->cases) {
      const bool changed = !presets.empty() && (shape_flags || seed || masked);
      if (batch) c.batch = *batch;
      if (heads) c.heads = *heads;
      if (lq) c.lq = *lq;
      if (lk) c.lk = *lk;
      if (broadcast) c.broadcast_q = *broadcast;
      if (causal) c.causal = *causal;
      if (seed) c.seed = uint64_t(*seed);
      if (changed) c.name += "*";
      CaseLengths l;
      std::string err;
      if (!realize_lengths(c, &l, &err)) return fail(err + " (case " + c.name + ")");
    }
  } else if (!presets.empty() || shape_flags || causal) {
    return fail("--preset/--batch/--heads/--lq/--lk/--causal: attention shapes need --workload fwd, bwd or both");
  }
  if (seed) opt->quant_seed = uint64_t(*seed);
  return r;
}

bool quantize_lengths(const Options& opt, std::vector<int64_t>* lengths, std::string* err) {
  const LengthSpec& s = opt.quant_lengths;
  const double token_bytes = double(opt.quant_heads) * double(kHeadDim) * 2.0;
  const double target_tokens = opt.quant_gib * 1073741824.0 / token_bytes;
  if (s.kind == LengthSpec::Kind::kList) {
    *lengths = s.list;
  } else if (s.kind == LengthSpec::Kind::kUniform) {
    const int64_t b = std::max<int64_t>(1, std::llround(target_tokens / double(s.value)));
    lengths->assign(size_t(b), s.value);
  } else if (s.kind == LengthSpec::Kind::kJagged) {
    const int64_t b = std::max<int64_t>(1, std::llround(target_tokens / (s.fill * double(s.max))));
    *lengths = jagged_lengths(b, s.fill, s.max, opt.quant_seed);
  } else {
    *err = "--quant-lengths: 'same' is not valid here";
    return false;
  }
  int64_t total = 0;
  for (int64_t l : *lengths) total += l;
  if (total < 1) {
    *err = "--quant-lengths: the batch holds no tokens";
    return false;
  }
  if (total > INT32_MAX - int64_t(lengths->size()) * 128) {
    *err = "--quant-gib: too many tokens for int32 offsets";
    return false;
  }
  return true;
}

}  // namespace mxflash::bench
