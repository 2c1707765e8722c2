#include "reference/accuracy_suite.h"

#include "common/strings.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <ostream>
#include <sstream>
#include <thread>

namespace mxflash::accuracy {
namespace {

constexpr int kD = kHeadDim;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------- random numbers
// splitmix64 + Box-Muller: the same inputs on every platform and standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }  // (0, 1)
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(uniform())), a = 2.0 * M_PI * uniform();
    spare_ = r * std::sin(a);
    has_spare_ = true;
    return r * std::cos(a);
  }
  double student_t3() {
    const double z = normal(), a = normal(), b = normal(), c = normal();
    return z / std::sqrt((a * a + b * b + c * c) / 3.0);
  }

 private:
  uint64_t s_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

uint64_t mix(uint64_t seed, uint64_t stream) { return Rng(seed * 0x100000001B3ull + stream).next(); }

std::vector<float> draw(int64_t n, uint64_t seed, bool heavy) {
  Rng r(seed);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& e : x) e = float(heavy ? r.student_t3() : r.normal());
  return x;
}

std::string join_ints(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

using detail::split;

bool parse_int(const std::string& s, int64_t lo, int64_t* out) {
  if (s.empty()) return false;
  size_t pos = 0;
  long long v;
  try {
    v = std::stoll(s, &pos);
  } catch (...) {
    return false;
  }
  if (pos != s.size() || v < lo) return false;
  *out = v;
  return true;
}

bool parse_double(const std::string& s, double* out) {
  if (s.empty()) return false;
  size_t pos = 0;
  try {
    *out = std::stod(s, &pos);
  } catch (...) {
    return false;
  }
  return pos == s.size() && std::isfinite(*out);
}

const Floor* floor_of(Tensor t, const Thresholds& th) {
  switch (t) {
    case Tensor::kOut: return &th.out;
    case Tensor::kDq: return &th.dq;
    case Tensor::kDk: return &th.dk;
    case Tensor::kDv: return &th.dv;
    case Tensor::kLse: return nullptr;
  }
  return nullptr;
}
Floor* floor_of(Tensor t, Thresholds& th) { return const_cast<Floor*>(floor_of(t, static_cast<const Thresholds&>(th))); }

bool parse_tensor(const std::string& s, Tensor* t) {
  for (int i = 0; i < kNumTensors; ++i)
    if (s == to_string(Tensor(i))) {
      *t = Tensor(i);
      return true;
    }
  return false;
}

// "out=0.98:8,dq=0.97:10,lse=0.01"
Status parse_thresholds(const std::string& spec, Thresholds* th) {
  for (const std::string& item : split(spec, ',')) {
    const size_t eq = item.find('=');
    Tensor t;
    if (eq == std::string::npos || !parse_tensor(item.substr(0, eq), &t))
      return Status::Invalid("--thresholds: '" + item + "' is not TENSOR=COS:SQNR (TENSOR out, dq, dk, dv) or lse=MAXREL");
    const std::string val = item.substr(eq + 1);
    if (t == Tensor::kLse) {
      if (!parse_double(val, &th->lse_max_rel) || th->lse_max_rel < 0)
        return Status::Invalid("--thresholds: lse wants one number >= 0 (max relative error; 0 = no verdict), got '" + val + "'");
      continue;
    }
    const auto parts = split(val, ':');
    Floor f;
    if (parts.size() != 2 || !parse_double(parts[0], &f.cos) || !parse_double(parts[1], &f.sqnr_db))
      return Status::Invalid("--thresholds: " + std::string(to_string(t)) + " wants COS:SQNR_DB, got '" + val + "'");
    *floor_of(t, *th) = f;
  }
  return Status::Ok();
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string json_num(double x) {
  if (!std::isfinite(x)) return "null";  // JSON has no inf / NaN; "exact" or "mismatched" say why
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}

}  // namespace

// ---------------------------------------------------------------- metrics
ErrorStats compare(const std::vector<double>& ref, const std::vector<double>& out) {
  ErrorStats s;
  if (ref.size() != out.size()) {
    s.mismatched = int64_t(std::max(ref.size(), out.size()));
    s.sqnr_db = s.cosine = s.max_rel_err = kNaN;
    return s;
  }
  double rr = 0, ee = 0, oo = 0, ro = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double r = ref[i], o = out[i];
    if (!std::isfinite(r) || !std::isfinite(o)) {
      if (r != o) ++s.mismatched;  // NaN never equals itself: counted
      continue;
    }
    const double e = o - r;
    rr += r * r, ee += e * e, oo += o * o, ro += r * o;
    s.max_rel_err = std::max(s.max_rel_err, std::fabs(e) / std::max(std::fabs(r), 1.0));
    ++s.count;
  }
  if (s.mismatched > 0) {
    s.sqnr_db = s.cosine = s.max_rel_err = kNaN;
    return s;
  }
  s.sqnr_db = ee == 0 ? std::numeric_limits<double>::infinity() : 10.0 * std::log10(rr / ee);
  s.cosine = (rr == 0 && oo == 0) ? 1.0 : (rr == 0 || oo == 0) ? 0.0 : ro / std::sqrt(rr * oo);
  return s;
}

// ---------------------------------------------------------------- inputs
const char* to_string(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kKOutlier: return "k_outlier";
    case Dist::kHeavyTail: return "heavy_tail";
    case Dist::kSink: return "sink";
    case Dist::kPeaked: return "peaked";
    case Dist::kVOutlier: return "v_outlier";
    case Dist::kTiny: return "tiny";
    case Dist::kLong: return "long";
    case Dist::kJagged: return "jagged";
  }
  return "?";
}

std::vector<Dist> all_dists() {
  return {Dist::kNormal, Dist::kKOutlier, Dist::kHeavyTail, Dist::kSink, Dist::kPeaked,
          Dist::kVOutlier, Dist::kTiny,    Dist::kLong,      Dist::kJagged};
}

bool parse_dist(const std::string& name, Dist* d) {
  for (Dist x : all_dists())
    if (name == to_string(x)) {
      *d = x;
      return true;
    }
  return false;
}

std::vector<int64_t> jagged_lengths(bool quick) {
  std::vector<int64_t> l{0, 1, 31, 32, 33, 127, 128, 129, 1000, 4096};
  if (quick) l.pop_back();
  return l;
}

ref::AttnProblem Inputs::problem() const {
  return ref::make_problem(q_meta, k_meta, heads, q.data(), k.data(), v.data(), softmax_scale, broadcast_q, causal);
}

Status make_inputs(Dist d, const Shape& shape, int64_t heads, uint64_t seed, Inputs* in) {
  if (heads < 1) return Status::Invalid("heads: must be >= 1");
  MXFLASH_RETURN_IF_ERROR(JaggedMeta::FromLengths(shape.q_lengths, &in->q_meta));
  MXFLASH_RETURN_IF_ERROR(JaggedMeta::FromLengths(shape.k_lengths, &in->k_meta));
  in->heads = heads;
  in->broadcast_q = shape.broadcast_q;
  in->causal = shape.causal;
  if (shape.broadcast_q ? shape.q_lengths.size() != 1 : shape.q_lengths.size() != shape.k_lengths.size())
    return Status::Invalid("shape: Q needs one length per K/V sequence (one with broadcast_q)");
  const int64_t Tq = in->q_meta.total_tokens(), Tk = in->k_meta.total_tokens();
  const int64_t To = ref::out_tokens(in->problem());
  const uint64_t s = mix(seed, uint64_t(d) + 1);
  const bool heavy = d == Dist::kHeavyTail;
  in->q = draw(Tq * heads * kD, mix(s, 11), heavy);
  in->k = draw(Tk * heads * kD, mix(s, 12), heavy);
  in->v = draw(Tk * heads * kD, mix(s, 13), heavy);
  in->dout = draw(To * heads * kD, mix(s, 14), heavy);
  MXFLASH_RETURN_IF_ERROR(ref::check_problem(in->problem()));
  Rng r(mix(s, 15));
  switch (d) {
    case Dist::kKOutlier: {
      std::vector<int> ch;
      while (ch.size() < size_t(kKOutlierChannels)) {
        const int c = int(r.next() % kD);
        if (std::find(ch.begin(), ch.end(), c) == ch.end()) ch.push_back(c);
      }
      for (int64_t t = 0; t < Tk * heads; ++t)
        for (int c : ch) in->k[size_t(t * kD + c)] *= kKOutlierScale;
      break;
    }
    case Dist::kSink:
      for (int b = 0; b < in->k_meta.batch(); ++b) {
        if (in->k_meta.length(b) == 0) continue;
        const int64_t t = in->k_meta.cu_seqlens()[b];
        for (int64_t e = t * heads * kD; e < (t + 1) * heads * kD; ++e) in->k[size_t(e)] *= kSinkScale;
      }
      break;
    case Dist::kPeaked:
      for (float& x : in->q) x *= kPeakedQScale;
      break;
    case Dist::kVOutlier:
      for (int64_t t = 0; t < Tk; ++t)
        if (r.uniform() < kVOutlierProbability)
          for (int64_t e = t * heads * kD; e < (t + 1) * heads * kD; ++e) in->v[size_t(e)] *= kVOutlierScale;
      break;
    case Dist::kTiny:
      for (auto* x : {&in->q, &in->k, &in->v, &in->dout})
        for (float& e : *x) e *= kTinyScale;
      break;
    default:
      break;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- verdicts
const char* to_string(Tensor t) {
  switch (t) {
    case Tensor::kOut: return "out";
    case Tensor::kLse: return "lse";
    case Tensor::kDq: return "dq";
    case Tensor::kDk: return "dk";
    case Tensor::kDv: return "dv";
  }
  return "?";
}

const char* display_name(Tensor t) {
  switch (t) {
    case Tensor::kOut: return "O";
    case Tensor::kLse: return "LSE";
    case Tensor::kDq: return "dQ";
    case Tensor::kDk: return "dK";
    case Tensor::kDv: return "dV";
  }
  return "?";
}

const char* to_string(Verdict v) {
  switch (v) {
    case Verdict::kNone: return "-";
    case Verdict::kPass: return "pass";
    case Verdict::kBorderline: return "borderline";
    case Verdict::kFail: return "fail";
  }
  return "?";
}

Verdict judge(Tensor t, const ErrorStats& s, const Thresholds& th) {
  if (s.mismatched > 0) return Verdict::kFail;
  if (t == Tensor::kLse) {
    if (th.lse_max_rel <= 0) return Verdict::kNone;
    if (!(s.max_rel_err <= th.lse_max_rel)) return Verdict::kFail;
    return s.max_rel_err > 0.5 * th.lse_max_rel ? Verdict::kBorderline : Verdict::kPass;
  }
  const Floor& f = *floor_of(t, th);
  // NaN compares false: a NaN metric fails.
  if (!(s.cosine > f.cos) || !(s.sqnr_db > f.sqnr_db)) return Verdict::kFail;
  if (s.cosine <= f.cos + th.border_cos || s.sqnr_db <= f.sqnr_db + th.border_db) return Verdict::kBorderline;
  return Verdict::kPass;
}

// ---------------------------------------------------------------- configuration
const char* to_string(Method m) {
  switch (m) {
    case Method::kBf16: return "bf16";
    case Method::kFp8: return "fp8";
    case Method::kMx: return "mx";
    case Method::kGpu: return "gpu";
    case Method::kMx16: return "mx16";
    case Method::kMxDynP: return "mxdp";
    case Method::kMxHopper: return "mxhx";
    case Method::kMxHopperFusedDq: return "mxhf";
    case Method::kMxHopperDumpDq: return "mxhd";
    case Method::kMxHopperDkFromDq: return "mxhk";
    case Method::kMxHopperDsFromP8: return "mxhp";
    case Method::kMxHopperDsFromP16: return "mxhb";
    case Method::kMxFwdSeq: return "mxfs";
    case Method::kMxFwdTile: return "mxft";
    case Method::kMxFwdTileV: return "mxfv";
  }
  return "?";
}

bool parse_method(const std::string& name, Method* m) {
  for (Method x : {Method::kBf16, Method::kFp8, Method::kMx, Method::kGpu, Method::kMx16, Method::kMxDynP,
                   Method::kMxHopper, Method::kMxHopperFusedDq, Method::kMxFwdSeq, Method::kMxFwdTile, Method::kMxFwdTileV,
                   Method::kMxHopperDumpDq, Method::kMxHopperDkFromDq, Method::kMxHopperDsFromP8,
                   Method::kMxHopperDsFromP16})
    if (name == to_string(x)) {
      *m = x;
      return true;
    }
  return false;
}

bool has_verdict(Method m) { return m != Method::kBf16 && m != Method::kFp8; }

std::string usage() {
  return R"(usage: mxflash-accuracy [options]
Attention forward + backward accuracy on the ARCHITECTURE.md §3 distribution suite. Every method is
compared with an FP64 reference on the unquantized inputs: SQNR = 20 log10(|ref| / |out - ref|) dB and
cosine per tensor (O, LSE, dQ, dK, dV; LSE also max |err| / max(|lse|, 1)). The MX methods are judged
against floors (pass / borderline / fail). Runs on the CPU; no GPU needed.
  --dist LIST          distributions (default: all but long): normal,k_outlier,heavy_tail,sink,peaked,
                       v_outlier,tiny,long,jagged, or all
  --lengths LIST       K/V sequence lengths for the non-jagged distributions (default 256,512)
  --heads N            heads (default 2)
  --lq N               every Q sequence has N tokens (cross attention; default: Q lengths = K lengths,
                       and 1024 queries for long)
  --broadcast-q        one shared Q sequence of --lq tokens attends to every K/V sequence
  --causal [MASK]      the causal mask for every method, the reference and the gpu column: top_left
                       (the default MASK: key j <= row i), bottom_right (j <= i + Lk - Lq), or none
  --seed N             input seed (default 0)
  --methods LIST       bf16,fp8,mx,gpu (default) and mx16 (exact MX with dQ accumulated in fp16 at the
                       static scale 2^K of --dq16-scale K, 0..15, default 12), mxdp (exact MX with P for
                       dV in 1x32 blocks with their own scales), mxhx (the backward's Hopper execution
                       form: re-expressed operands, coarser dS blocks), mxhf (mxhx with dQ's dS in
                       64x128 blocks: the fused-dQ experiment), mxhd (mxhx with dQ's dS the dK
                       operand re-expressed per 128-key tile: the dS-dump experiment), mxhk (mxhx with dQ's and dK's dS
                       one operand in 64 x 128 blocks: a dK/dV kernel fed by the dQ kernel's
                       bytes), mxhp / mxhb (mxhk with dS computed from P's e4m3 bytes / from P
                       in bf16: a split whose dK/dV side computes dS), mxfs / mxft / mxfv (the forward's
                       Hopper execution form, V per (sequence, channel) / per (128-key tile, channel)
                       / per 128-key tile; use with --forward-only). fp8 = per-tensor FP8;
                       mx = exact MX; gpu = our GPU path (forward and backward, on a CUDA build with a GPU)
  --thresholds SPEC    floors, e.g. out=0.98:8,dq=0.97:10,dk=0.97:8,dv=0.97:8,lse=0.05
                       (TENSOR=COS:SQNR_DB; lse=MAX_REL_ERR, 0 = not judged).
                       Defaults: the REFERENCE.md §6 floors; LSE not judged
  --borderline DB:COS  borderline band above a floor (default 1:0.005)
  --softmax-scale X    (default 1/sqrt(128))
  --json FILE          write every number, the configuration and the summary as JSON
  --quick              jagged lengths without 4096
  --long               add the long-context distribution (16384 keys; slow on a CPU)
  --forward-only       O and LSE only: no backward (long shapes, the GPU forward's accuracy bars)
  --gpu-within-db X    the gpu column's O fails when its SQNR is more than X dB under mx's
  --gpu-bwd-within-db X  the gpu column's dQ, dK, dV fail when more than X dB under mx's
  --threads N          CPU worker threads (default: all cores)
  --gpu-exec           (mxflash-accuracy on a GPU) the gpu column's forward on execution-layout
                       operands: quantize_attention_forward, then attention_forward on them
Exit status: 0 no fail, 1 a judged tensor failed, 2 bad arguments.
)";
}

Status parse_args(const std::vector<std::string>& args, Config* cfg, bool* help) {
  *help = false;
  bool dists_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], val;
    bool has_val = false;
    const size_t eq = flag.find('=');
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      val = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_val = true;
    }
    auto value = [&](std::string* v) -> Status {
      if (has_val) {
        *v = val;
        return Status::Ok();
      }
      if (i + 1 >= args.size()) return Status::Invalid(flag + ": needs a value");
      *v = args[++i];
      return Status::Ok();
    };
    auto no_value = [&]() -> Status {
      return has_val ? Status::Invalid(flag + ": takes no value") : Status::Ok();
    };
    std::string v;
    int64_t n = 0;
    if (flag == "-h" || flag == "--help") {
      *help = true;
      return Status::Ok();
    } else if (flag == "--dist") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      cfg->dists.clear();
      dists_given = true;
      for (const std::string& s : split(v, ',')) {
        if (s == "all") {
          cfg->dists = all_dists();
          continue;
        }
        Dist d;
        if (!parse_dist(s, &d)) return Status::Invalid("--dist: unknown distribution '" + s + "'");
        if (std::find(cfg->dists.begin(), cfg->dists.end(), d) == cfg->dists.end()) cfg->dists.push_back(d);
      }
    } else if (flag == "--lengths") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      cfg->lengths.clear();
      for (const std::string& s : split(v, ',')) {
        if (!parse_int(s, 0, &n)) return Status::Invalid("--lengths: '" + s + "' is not a length >= 0");
        cfg->lengths.push_back(n);
      }
    } else if (flag == "--heads") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      if (!parse_int(v, 1, &n)) return Status::Invalid("--heads: wants an integer >= 1, got '" + v + "'");
      cfg->heads = n;
    } else if (flag == "--lq") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      if (!parse_int(v, 1, &n)) return Status::Invalid("--lq: wants an integer >= 1, got '" + v + "'");
      cfg->lq = n;
    } else if (flag == "--causal") {
      // The mask's name is optional: a bare --causal (followed by another flag, or last) is top_left.
      if (!has_val && (i + 1 >= args.size() || args[i + 1].rfind("-", 0) == 0)) {
        cfg->causal = CausalMask::kTopLeft;
        continue;
      }
      MXFLASH_RETURN_IF_ERROR(value(&v));
      if (!parse_causal(v, &cfg->causal))
        return Status::Invalid("--causal: wants none, top_left or bottom_right, got '" + v + "'");
    } else if (flag == "--broadcast-q") {
      MXFLASH_RETURN_IF_ERROR(no_value());
      cfg->broadcast_q = true;
    } else if (flag == "--dq16-scale") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      if (!parse_int(v, 0, &n) || n > 15) return Status::Invalid("--dq16-scale: wants an integer in 0..15, got '" + v + "'");
      cfg->dq16_scale_log2 = int(n);
    } else if (flag == "--seed") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      if (!parse_int(v, 0, &n)) return Status::Invalid("--seed: wants an integer >= 0, got '" + v + "'");
      cfg->seed = uint64_t(n);
    } else if (flag == "--methods") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      cfg->methods.clear();
      for (const std::string& s : split(v, ',')) {
        Method m;
        if (!parse_method(s, &m))
          return Status::Invalid("--methods: unknown method '" + s + "' (bf16, fp8, mx, gpu, mx16, mxdp, mxhx, mxhf, mxhd, mxhk, mxhp, mxhb, mxfs, mxft, mxfv)");
        if (std::find(cfg->methods.begin(), cfg->methods.end(), m) == cfg->methods.end()) cfg->methods.push_back(m);
      }
    } else if (flag == "--thresholds") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      MXFLASH_RETURN_IF_ERROR(parse_thresholds(v, &cfg->thresholds));
    } else if (flag == "--borderline") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      const auto parts = split(v, ':');
      double db, cs;
      if (parts.size() != 2 || !parse_double(parts[0], &db) || !parse_double(parts[1], &cs) || db < 0 || cs < 0)
        return Status::Invalid("--borderline: wants DB:COS (two non-negative numbers), got '" + v + "'");
      cfg->thresholds.border_db = db;
      cfg->thresholds.border_cos = cs;
    } else if (flag == "--softmax-scale") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      double x;
      if (!parse_double(v, &x) || x <= 0) return Status::Invalid("--softmax-scale: wants a number > 0, got '" + v + "'");
      cfg->softmax_scale = x;
    } else if (flag == "--json") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      if (v.empty()) return Status::Invalid("--json: wants a file name");
      cfg->json_path = v;
    } else if (flag == "--quick") {
      MXFLASH_RETURN_IF_ERROR(no_value());
      cfg->quick = true;
    } else if (flag == "--long") {
      MXFLASH_RETURN_IF_ERROR(no_value());
      cfg->long_ctx = true;
    } else if (flag == "--gpu-within-db") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      double x = 0;
      if (!parse_double(v, &x) || !(x > 0)) return Status::Invalid("--gpu-within-db: wants a number > 0, got '" + v + "'");
      cfg->gpu_within_db = x;
    } else if (flag == "--gpu-bwd-within-db") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      double x = 0;
      if (!parse_double(v, &x) || !(x > 0))
        return Status::Invalid("--gpu-bwd-within-db: wants a number > 0, got '" + v + "'");
      cfg->gpu_bwd_within_db = x;
    } else if (flag == "--forward-only") {
      MXFLASH_RETURN_IF_ERROR(no_value());
      cfg->forward_only = true;
    } else if (flag == "--threads") {
      MXFLASH_RETURN_IF_ERROR(value(&v));
      if (!parse_int(v, 1, &n)) return Status::Invalid("--threads: wants an integer >= 1, got '" + v + "'");
      cfg->threads = int(n);
    } else {
      return Status::Invalid("unknown argument '" + args[i] + "' (see --help)");
    }
  }
  if (cfg->methods.empty()) return Status::Invalid("--methods: empty list");
  if (cfg->lengths.empty()) return Status::Invalid("--lengths: empty list");
  if (cfg->broadcast_q && cfg->lq == 0) return Status::Invalid("--broadcast-q: needs --lq (the shared Q length)");
  if (dists_given && cfg->dists.empty()) return Status::Invalid("--dist: empty list");
  return Status::Ok();
}

std::vector<Dist> selected_dists(const Config& cfg) {
  if (!cfg.dists.empty()) return cfg.dists;
  std::vector<Dist> d;
  for (Dist x : all_dists())
    if (x != Dist::kLong || cfg.long_ctx) d.push_back(x);
  return d;
}

Shape shape_for(Dist d, const Config& cfg) {
  Shape s;
  s.broadcast_q = cfg.broadcast_q;
  s.causal = cfg.causal;
  s.k_lengths = d == Dist::kJagged ? jagged_lengths(cfg.quick) : d == Dist::kLong ? std::vector<int64_t>{kLongKeys}
                                                                                  : cfg.lengths;
  const int64_t lq = cfg.lq > 0 ? cfg.lq : d == Dist::kLong ? kLongQueriesDefault : 0;
  if (cfg.broadcast_q)
    s.q_lengths = {lq};
  else if (lq > 0)
    s.q_lengths.assign(s.k_lengths.size(), lq);
  else
    s.q_lengths = s.k_lengths;
  return s;
}

// ---------------------------------------------------------------- running
namespace {
ref::AttnMethod ref_method(Method m) {
  switch (m) {
    case Method::kBf16: return ref::AttnMethod::kBf16;
    case Method::kFp8: return ref::AttnMethod::kFp8PerTensor;
    default: return ref::AttnMethod::kMx;
  }
}

struct Outputs {
  ref::AttnForwardResult fwd;
  ref::AttnBackwardResult bwd;
  const std::vector<double>& get(Tensor t) const {
    switch (t) {
      case Tensor::kOut: return fwd.out;
      case Tensor::kLse: return fwd.lse;
      case Tensor::kDq: return bwd.dq;
      case Tensor::kDk: return bwd.dk;
      case Tensor::kDv: return bwd.dv;
    }
    return fwd.out;
  }
};

Status run_method(const Inputs& in, ref::AttnMethod m, const ref::AttnOptions& opt, bool forward_only, Outputs* o) {
  const ref::AttnProblem p = in.problem();
  MXFLASH_RETURN_IF_ERROR(ref::attention_forward(p, m, &o->fwd, opt));
  if (forward_only) return Status::Ok();
  return ref::attention_backward(p, m, o->fwd, in.dout.data(), &o->bwd, opt);
}
}  // namespace

Status run_suite(const Config& cfg, std::vector<Record>* records, std::ostream* progress) {
  ref::AttnOptions opt;
  opt.threads = cfg.threads > 0 ? cfg.threads : std::max(1, int(std::thread::hardware_concurrency()));
  for (Dist d : selected_dists(cfg)) {
    const auto t0 = std::chrono::steady_clock::now();
    Inputs in;
    in.softmax_scale = cfg.softmax_scale;
    MXFLASH_RETURN_IF_ERROR(make_inputs(d, shape_for(d, cfg), cfg.heads, cfg.seed, &in));
    Outputs ref_out;
    MXFLASH_RETURN_IF_ERROR(run_method(in, ref::AttnMethod::kFp64, opt, cfg.forward_only, &ref_out));
    for (Method m : cfg.methods) {
      Outputs o;
      const bool gpu = m == Method::kGpu, gpu_fwd = gpu && cfg.gpu_forward != nullptr;
      const bool gpu_bwd = gpu_fwd && cfg.gpu_backward != nullptr && !cfg.forward_only;
      ref::AttnOptions mopt = opt;
      if (m == Method::kMx16) mopt.dq_fp16_scale_log2 = cfg.dq16_scale_log2;
      mopt.dynamic_p = m == Method::kMxDynP;
      mopt.hopper_exec = m == Method::kMxHopper || m == Method::kMxHopperFusedDq || m == Method::kMxHopperDumpDq ||
                         m == Method::kMxHopperDkFromDq || m == Method::kMxHopperDsFromP8 ||
                         m == Method::kMxHopperDsFromP16;
      mopt.hopper_dk_from_dq = m == Method::kMxHopperDkFromDq || m == Method::kMxHopperDsFromP8 ||
                               m == Method::kMxHopperDsFromP16;
      mopt.hopper_ds_p = m == Method::kMxHopperDsFromP8 ? 1 : m == Method::kMxHopperDsFromP16 ? 2 : 0;
      mopt.hopper_dq_rows = m == Method::kMxHopperFusedDq ? 64 : m == Method::kMxHopperDumpDq ? 0 : 1;
      mopt.hopper_fwd = m == Method::kMxFwdSeq    ? ref::HopperFwd::kVPerSequenceChannel
                        : m == Method::kMxFwdTile ? ref::HopperFwd::kVPerTileChannel
                        : m == Method::kMxFwdTileV ? ref::HopperFwd::kVPerTile
                                                  : ref::HopperFwd::kNone;
      if (!gpu) MXFLASH_RETURN_IF_ERROR(run_method(in, ref_method(m), mopt, cfg.forward_only, &o));
      if (gpu_fwd) MXFLASH_RETURN_IF_ERROR(cfg.gpu_forward(in, &o.fwd.out, &o.fwd.lse));
      if (gpu_bwd) MXFLASH_RETURN_IF_ERROR(cfg.gpu_backward(in, o.fwd.out, o.fwd.lse, &o.bwd.dq, &o.bwd.dk, &o.bwd.dv));
      for (int t = 0; t < kNumTensors; ++t) {
        Record r;
        r.dist = d;
        r.method = m;
        r.tensor = Tensor(t);
        const bool forward_tensor = r.tensor == Tensor::kOut || r.tensor == Tensor::kLse;
        r.available = (!gpu || (gpu_fwd && (forward_tensor || gpu_bwd))) && (forward_tensor || !cfg.forward_only);
        r.missing = !forward_tensor && cfg.forward_only ? kForwardOnly : gpu_fwd ? kGpuBackwardNotBuilt : kGpuNotBuilt;
        if (r.available) {
          r.stats = compare(ref_out.get(r.tensor), o.get(r.tensor));
          if (has_verdict(m)) r.verdict = judge(r.tensor, r.stats, cfg.thresholds);
          const double within = r.tensor == Tensor::kOut ? cfg.gpu_within_db
                                : r.tensor == Tensor::kLse ? 0.0
                                                           : cfg.gpu_bwd_within_db;
          if (gpu && within > 0) {
            for (const Record& x : *records)  // the mx column of this distribution
              if (x.dist == d && x.method == Method::kMx && x.tensor == r.tensor && x.available &&
                  r.stats.sqnr_db < x.stats.sqnr_db - within)
                r.verdict = Verdict::kFail;
          }
        }
        records->push_back(r);
      }
    }
    if (progress) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      *progress << "mxflash-accuracy: " << to_string(d) << " done in " << fmt("%.1f", s) << " s\n" << std::flush;
    }
  }
  return Status::Ok();
}

Summary summarize(const std::vector<Record>& records) {
  Summary s;
  for (const Record& r : records) {
    s.pass += r.verdict == Verdict::kPass;
    s.borderline += r.verdict == Verdict::kBorderline;
    s.fail += r.verdict == Verdict::kFail;
  }
  return s;
}

// ---------------------------------------------------------------- reporting
namespace {
std::string cell(const Record& r) {
  if (!r.available) return r.missing;
  const ErrorStats& s = r.stats;
  if (s.mismatched > 0) return "MISMATCH (" + std::to_string(s.mismatched) + " non-finite)";
  const std::string db = std::isinf(s.sqnr_db) ? "  exact" : fmt("%7.2f", s.sqnr_db);
  if (r.tensor == Tensor::kLse) return db + " dB rel " + fmt("%.1e", s.max_rel_err);
  return db + " dB cos " + fmt("%.5f", s.cosine);
}

std::string shape_text(const Shape& s) {
  std::string t = "K/V lengths [" + join_ints(s.k_lengths) + "], Q ";
  if (s.broadcast_q)
    t += "broadcast, " + std::to_string(s.q_lengths[0]) + " tokens";
  else if (s.q_lengths == s.k_lengths)
    t += "= K";
  else
    t += "lengths [" + join_ints(s.q_lengths) + "]";
  if (s.causal != CausalMask::kNone) t += std::string(", causal ") + causal_name(s.causal);
  return t;
}

std::string pad(std::string s, size_t w) {
  if (s.size() < w) s.append(w - s.size(), ' ');
  return s;
}
}  // namespace

void print_table(std::ostream& os, const Config& cfg, const std::vector<Record>& records) {
  constexpr size_t kCell = 27;
  os << "mxflash-accuracy: heads " << cfg.heads << ", seed " << cfg.seed << ", softmax_scale "
     << fmt("%.6g", cfg.softmax_scale) << ". Reference: FP64 attention on the unquantized inputs.\n"
     << "Cells: SQNR dB and cosine vs the reference; LSE: SQNR and rel = max |err| / max(|lse|, 1).\n"
     << "fp8 = per-tensor FP8 (cuDNN/FA3 style), mx = exact MX, gpu = our GPU path, mx16 = exact MX with dQ\n"
     << "accumulated in fp16 (--dq16-scale), mxdp = exact MX with per-block P scales for dV, mxhx = the\n"
     << "backward's Hopper execution form (re-expressed operands, coarser dS blocks), mxhf = mxhx with\n"
     << "dQ's dS in 64x128 blocks (the fused-dQ experiment), mxhd = mxhx with dQ's dS the dK operand\n"
     << "re-expressed per 128-key tile (the dS-dump experiment), mxhk = mxhx with dQ's and dK's dS one\n"
     << "operand in 64x128 blocks (a dK/dV kernel fed by the dQ kernel), mxhp / mxhb = mxhk with dS from P's\n"
     << "e4m3 bytes / from P in bf16 (a dK/dV side that computes dS), mxfs / mxft / mxfv = the forward's Hopper\n"
     << "execution form with V per (sequence, channel) / per (128-key tile, channel) / per 128-key tile.\n"
     << "Verdict (mx; floors out " << cfg.thresholds.out.cos << "/" << cfg.thresholds.out.sqnr_db << " dB, dQ "
     << cfg.thresholds.dq.cos << "/" << cfg.thresholds.dq.sqnr_db << ", dK " << cfg.thresholds.dk.cos << "/"
     << cfg.thresholds.dk.sqnr_db << ", dV " << cfg.thresholds.dv.cos << "/" << cfg.thresholds.dv.sqnr_db
     << (cfg.thresholds.lse_max_rel > 0 ? ", LSE rel " + fmt("%g", cfg.thresholds.lse_max_rel) : ", LSE not judged")
     << "; borderline within " << cfg.thresholds.border_db << " dB / " << cfg.thresholds.border_cos << " cos)\n";
  for (Dist d : selected_dists(cfg)) {
    os << "\n" << to_string(d) << ": " << shape_text(shape_for(d, cfg)) << "\n";
    std::string head = pad("  tensor", 10);
    for (Method m : cfg.methods) head += pad(to_string(m), kCell);
    os << head << "verdict\n";
    for (int t = 0; t < kNumTensors; ++t) {
      std::string line = pad(std::string("  ") + display_name(Tensor(t)), 10);
      std::string verdict;
      for (Method m : cfg.methods)
        for (const Record& r : records)
          if (r.dist == d && r.method == m && r.tensor == Tensor(t)) {
            line += pad(cell(r), kCell);
            if (r.verdict != Verdict::kNone) verdict += (verdict.empty() ? "" : " ") + std::string(to_string(r.verdict));
          }
      os << line << (verdict.empty() ? "-" : verdict) << "\n";
    }
  }
  const Summary s = summarize(records);
  os << "\nsummary: " << s.pass << " pass / " << s.borderline << " borderline / " << s.fail << " fail\n";
}

std::string to_json(const Config& cfg, const std::vector<Record>& records) {
  std::ostringstream o;
  auto floor_json = [](const Floor& f) {
    return "{\"cos\": " + json_num(f.cos) + ", \"sqnr_db\": " + json_num(f.sqnr_db) + "}";
  };
  o << "{\n  \"tool\": \"mxflash-accuracy\",\n  \"reference\": \"fp64 attention on the unquantized inputs\",\n";
  o << "  \"config\": {\"dists\": [";
  const auto dists = selected_dists(cfg);
  for (size_t i = 0; i < dists.size(); ++i) o << (i ? ", " : "") << json_str(to_string(dists[i]));
  o << "], \"lengths\": [" << join_ints(cfg.lengths) << "], \"heads\": " << cfg.heads << ", \"lq\": " << cfg.lq
    << ", \"broadcast_q\": " << (cfg.broadcast_q ? "true" : "false")
    << ", \"causal\": " << json_str(causal_name(cfg.causal)) << ", \"seed\": " << cfg.seed
    << ", \"softmax_scale\": " << json_num(cfg.softmax_scale) << ", \"quick\": " << (cfg.quick ? "true" : "false")
    << ", \"long\": " << (cfg.long_ctx ? "true" : "false")
    << ", \"forward_only\": " << (cfg.forward_only ? "true" : "false") << ", \"methods\": [";
  for (size_t i = 0; i < cfg.methods.size(); ++i) o << (i ? ", " : "") << json_str(to_string(cfg.methods[i]));
  o << "]},\n";
  const Thresholds& th = cfg.thresholds;
  o << "  \"thresholds\": {\"out\": " << floor_json(th.out) << ", \"dq\": " << floor_json(th.dq)
    << ", \"dk\": " << floor_json(th.dk) << ", \"dv\": " << floor_json(th.dv)
    << ", \"lse_max_rel\": " << json_num(th.lse_max_rel) << ", \"borderline_db\": " << json_num(th.border_db)
    << ", \"borderline_cos\": " << json_num(th.border_cos) << "},\n";
  o << "  \"shapes\": {";
  for (size_t i = 0; i < dists.size(); ++i) {
    const Shape s = shape_for(dists[i], cfg);
    o << (i ? ", " : "") << json_str(to_string(dists[i])) << ": {\"q_lengths\": [" << join_ints(s.q_lengths)
      << "], \"k_lengths\": [" << join_ints(s.k_lengths) << "], \"broadcast_q\": " << (s.broadcast_q ? "true" : "false")
      << "}";
  }
  o << "},\n  \"results\": [\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    o << "    {\"dist\": " << json_str(to_string(r.dist)) << ", \"method\": " << json_str(to_string(r.method))
      << ", \"tensor\": " << json_str(to_string(r.tensor)) << ", \"available\": " << (r.available ? "true" : "false");
    if (!r.available) {
      o << ", \"status\": " << json_str(r.missing);
    } else {
      const ErrorStats& s = r.stats;
      o << ", \"sqnr_db\": " << json_num(s.sqnr_db) << ", \"cosine\": " << json_num(s.cosine)
        << ", \"max_rel_err\": " << json_num(s.max_rel_err) << ", \"exact\": "
        << (s.mismatched == 0 && std::isinf(s.sqnr_db) ? "true" : "false") << ", \"count\": " << s.count
        << ", \"mismatched\": " << s.mismatched;
    }
    o << ", \"verdict\": " << json_str(to_string(r.verdict)) << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  const Summary s = summarize(records);
  o << "  ],\n  \"summary\": {\"pass\": " << s.pass << ", \"borderline\": " << s.borderline << ", \"fail\": " << s.fail
    << "}\n}\n";
  return o.str();
}

int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err, GpuForward gpu_forward,
            GpuBackward gpu_backward) {
  Config cfg;
  cfg.gpu_forward = std::move(gpu_forward);
  cfg.gpu_backward = std::move(gpu_backward);
  bool help = false;
  Status st = parse_args(args, &cfg, &help);
  if (help) {
    out << usage();
    return 0;
  }
  if (!st.ok()) {
    err << "mxflash-accuracy: " << st.message() << " (--help for usage)\n";
    return 2;
  }
  std::vector<Record> records;
  st = run_suite(cfg, &records, &err);
  if (!st.ok()) {
    err << "mxflash-accuracy: " << st.message() << "\n";
    return 2;
  }
  print_table(out, cfg, records);
  if (!cfg.json_path.empty()) {
    std::ofstream f(cfg.json_path);
    f << to_json(cfg, records);
    if (!f) {
      err << "mxflash-accuracy: cannot write " << cfg.json_path << "\n";
      return 2;
    }
    out << "JSON written to " << cfg.json_path << "\n";
  }
  return summarize(records).fail > 0 ? 1 : 0;
}

}  // namespace mxflash::accuracy
