#include "reference/attention_ref.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <thread>

#include "mxflash/mx.h"
#include "mxflash/quantize.h"
#include "mxflash/tensor.h"

namespace mxflash::ref {
namespace {

constexpr int kD = kHeadDim;
constexpr double kLog2e = 1.4426950408889634074;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
using Vec = std::vector<double>;

// ---------------------------------------------------------------- element rounding
double to_f32(double x) { return double(float(x)); }
// Via fp32, as a kernel converts its fp32 accumulator.
double to_bf16(double x) { return double(bf16_to_float(float_to_bf16(float(x)))); }
// Round to IEEE fp16 (binary16), nearest even, subnormals kept, overflow to +-inf; x any double.
double to_fp16(double x) {
  if (std::isnan(x) || std::isinf(x)) return x;
  const double a = std::fabs(x);
  if (a >= 65520.0) return std::copysign(INFINITY, x);  // 65504 + half an ulp rounds up to 2^16
  if (a == 0.0) return x;
  const int e = std::max(std::ilogb(a), -14);           // fp16's binade (subnormals below 2^-14)
  const double step = std::ldexp(1.0, e - 10);
  return std::nearbyint(x / step) * step;               // x / step is exact: a power-of-two scale
}
// e4m3 with a (not necessarily power-of-two) scale: e4m3(x * inv) * descale, saturating RNE.
double e4m3_scaled(double x, float inv, double descale) {
  return double(e4m3_to_float(float_to_e4m3(float(x) * inv, /*saturate=*/true))) * descale;
}

// How P is rounded before the P.V (forward) and P^T.dO (backward) products.
enum class PRound { kNone, kBf16, kE4m3Fp8, kE4m3Mx };
double round_p(double p, PRound r) {
  switch (r) {
    case PRound::kNone: return p;
    case PRound::kBf16: return to_bf16(p);
    case PRound::kE4m3Fp8: return e4m3_scaled(p, kFp8PScale, 1.0 / double(kFp8PScale));
    case PRound::kE4m3Mx: return e4m3_scaled(p, float(1 << kMxPScaleLog2), 1.0 / double(1 << kMxPScaleLog2));
  }
  return p;
}
PRound p_round_of(AttnMethod m) {
  switch (m) {
    case AttnMethod::kFp64: return PRound::kNone;
    case AttnMethod::kBf16: return PRound::kBf16;
    case AttnMethod::kFp8PerTensor: return PRound::kE4m3Fp8;
    case AttnMethod::kMx: return PRound::kE4m3Mx;
  }
  return PRound::kNone;
}

// In-kernel MX quantization of one block of fp32 values (rows x cols, row stride `ld`), in place:
// RCEIL, zero block byte 127 (REFERENCE.md §2), values replaced by their dequantized e4m3.
// Returns the block's amax (its scale byte is e8m0_scale_byte of it).
float mx_block_inplace(double* x, int rows, int cols, int64_t ld) {
  float amax = 0.f;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) amax = amax_nan(amax, float(x[r * ld + c]));
  const uint8_t s = e8m0_scale_byte(amax, ScalingMode::kRceil, /*zero_byte=*/kE8m0One);
  const float inv = e8m0_inv_scale(s);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) x[r * ld + c] = double(dequantize_element(quantize_element(float(x[r * ld + c]), inv), s));
  return amax;
}

// 128-long dot product with four independent partial sums (lets the compiler pipeline the FMAs).
inline double dot128(const double* a, const double* b) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int d = 0; d < kD; d += 4) {
    s0 += a[d] * b[d];
    s1 += a[d + 1] * b[d + 1];
    s2 += a[d + 2] * b[d + 2];
    s3 += a[d + 3] * b[d + 3];
  }
  return (s0 + s1) + (s2 + s3);
}
inline void axpy128(double a, const double* x, double* y) {
  for (int d = 0; d < kD; ++d) y[d] += a * x[d];
}

constexpr int64_t kDqTile = 128;  // keys per K/V tile: the unit of the fp16 dQ accumulation

// ---------------------------------------------------------------- geometry
struct Geometry {
  int B = 0;
  int64_t H = 0, Tq = 0, Tk = 0, To = 0;
  std::vector<int64_t> q0, lq, k0, lk, o0;  // per batch: first token and length
  int64_t idx(int64_t t, int64_t h) const { return (t * H + h) * kD; }
};

Geometry geometry_of(const AttnProblem& p) {
  Geometry g;
  g.B = p.k_meta->batch();
  g.H = p.heads;
  g.Tq = p.q_meta->total_tokens();
  g.Tk = p.k_meta->total_tokens();
  g.To = out_tokens(p);
  for (int b = 0; b < g.B; ++b) {
    const int64_t lq = p.broadcast_q ? p.q_meta->length(0) : p.q_meta->length(b);
    g.q0.push_back(p.broadcast_q ? 0 : p.q_meta->cu_seqlens()[b]);
    g.lq.push_back(lq);
    g.k0.push_back(p.k_meta->cu_seqlens()[b]);
    g.lk.push_back(p.k_meta->length(b));
    g.o0.push_back(p.broadcast_q ? b * lq : p.q_meta->cu_seqlens()[b]);
  }
  return g;
}

// Metadata of the output tokens (what dO is quantized against).
JaggedMeta out_meta_of(const AttnProblem& p, const Geometry& g) {
  if (!p.broadcast_q) return *p.q_meta;
  JaggedMeta m;
  Status s = JaggedMeta::FromLengths(std::vector<int64_t>(size_t(g.B), g.lq.empty() ? 0 : g.lq[0]), &m);
  (void)s;  // lengths are those of a validated metadata, so always valid
  return m;
}

// Runs f(b, h, i0, i1) over every (sequence, head, block of at most `rows` query rows [i0, i1)) on
// `threads` workers, largest items first. Each item writes disjoint outputs (callers that
// accumulate over query rows pass rows = 0: whole sequences), so results do not depend on the
// schedule. Row blocks let one long sequence use every core (the forward at 16384 keys).
template <typename F>
void for_each_row_block(const Geometry& g, int threads, int64_t rows, F&& f) {
  struct Item {
    int b;
    int64_t h, i0, i1;
  };
  std::vector<Item> items;
  for (int b = 0; b < g.B; ++b) {
    const int64_t step = rows > 0 ? rows : std::max<int64_t>(g.lq[b], 1);
    for (int64_t h = 0; h < g.H; ++h)
      for (int64_t i0 = 0; i0 < std::max<int64_t>(g.lq[b], 1); i0 += step)
        items.push_back({b, h, i0, std::min(g.lq[b], i0 + step)});
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    return (x.i1 - x.i0) * (g.lk[x.b] + 1) > (y.i1 - y.i0) * (g.lk[y.b] + 1);
  });
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < items.size();) f(items[i].b, items[i].h, items[i].i0, items[i].i1);
  };
  const int n = std::max(1, std::min<int>(threads, int(items.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

// f(b, h) over every (sequence, head) item: for_each_row_block with whole sequences.
template <typename F>
void for_each_item(const Geometry& g, int threads, F&& f) {
  for_each_row_block(g, threads, 0, [&](int b, int64_t h, int64_t, int64_t) { f(b, h); });
}

// Query rows per forward work item: rows are independent in the forward.
constexpr int64_t kForwardRowBlock = 64;

// ---------------------------------------------------------------- operand preparation
// Every operand is held as the values the method's GEMMs consume (dequantized), in double.
Vec raw_of(const float* x, int64_t n) { return Vec(x, x + n); }

Vec bf16_of(const float* x, int64_t n) {
  Vec out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(x[i]);
  return out;
}

// Per-tensor FP8: descale = amax / 448 per head (fp32), elements e4m3(x * 448 / amax).
Vec fp8_tensor_of(const float* x, int64_t T, int64_t H) {
  Vec out(size_t(T * H * kD), 0.0);
  for (int64_t h = 0; h < H; ++h) {
    float amax = 0.f;
    for (int64_t t = 0; t < T; ++t)
      for (int d = 0; d < kD; ++d) amax = amax_nan(amax, x[(t * H + h) * kD + d]);
    if (amax == 0.f) continue;
    const float inv = kE4m3Max / amax;
    const double descale = double(amax / kE4m3Max);
    for (int64_t t = 0; t < T; ++t)
      for (int d = 0; d < kD; ++d) {
        const int64_t i = (t * H + h) * kD + d;
        out[i] = e4m3_scaled(x[i], inv, descale);
      }
  }
  return out;
}

// MX through the library's CPU quantizer (RCEIL, host rules), dequantized back to fp32.
Status mx_of(const float* x, const JaggedMeta& meta, int64_t H, Orientation o, Vec* out) {
  const int64_t T = meta.total_tokens();
  out->assign(size_t(T * H * kD), 0.0);
  if (T == 0) return Status::Ok();
  std::vector<uint8_t> payload(size_t(T * H * kD));
  const ScaleShape ss = scale_shape(meta, H, o, ScaleLayout::kPlain);
  std::vector<uint8_t> scales(size_t(ss.numel()));
  std::vector<float> deq(size_t(T * H * kD));
  const TensorView xv = make_view(const_cast<float*>(x), DType::kFloat32, Device::kCPU, {T, H, kD});
  const TensorView pv = make_view(payload.data(), DType::kE4M3, Device::kCPU, {T, H, kD});
  const TensorView sv = make_view(scales.data(), DType::kE8M0, Device::kCPU, ss.ndim, ss.dims);
  const TensorView dv = make_view(deq.data(), DType::kFloat32, Device::kCPU, {T, H, kD});
  QuantizeOptions opt;  // RCEIL, plain scales, token-major payload
  MXFLASH_RETURN_IF_ERROR(quantize(xv, meta, o, opt, pv, sv));
  MXFLASH_RETURN_IF_ERROR(dequantize(pv, sv, meta, o, ScaleLayout::kPlain, PayloadLayout::kTokenMajor, dv));
  for (size_t i = 0; i < deq.size(); ++i) (*out)[i] = deq[i];
  return Status::Ok();
}

// Operands of one method; unused entries stay empty, shared ones point at one copy.
struct Operands {
  std::vector<Vec> store;
  const double *q_s = nullptr, *k_s = nullptr;    // S = Q K^T
  const double *v_o = nullptr;                    // O = P V
  const double *v_dp = nullptr, *do_g = nullptr;  // dP = dO V^T, dV = P^T dO
  const double* do_dv = nullptr;                  // dO for dV when it differs from do_g (hopper_exec)
  const double *q_dk = nullptr, *k_dq = nullptr;  // dK = dS^T Q, dQ = dS K
  const double* add(Vec v) {
    store.push_back(std::move(v));
    return store.back().data();
  }
};

// Re-quantize groups of an operand (values already on their MX grids) with one RCEIL scale per
// group: what the kernels' re-expression to coarser power-of-two scales does (exact unless a value
// falls under e4m3's subnormal floor of the coarser scale).
template <typename GroupOf>
Vec regroup(const double* x, int64_t n, GroupOf group_of, int64_t groups) {
  std::vector<float> amax(size_t(groups), 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t gi = group_of(i);
    if (gi >= 0) amax[size_t(gi)] = amax_nan(amax[size_t(gi)], float(x[i]));
  }
  Vec out(x, x + n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t gi = group_of(i);
    if (gi < 0) continue;
    const uint8_t sb = e8m0_scale_byte(amax[size_t(gi)], ScalingMode::kRceil, 0);
    out[size_t(i)] = double(dequantize_element(quantize_element(float(x[i]), e8m0_inv_scale(sb)), sb));
  }
  return out;
}

// Groups of the Hopper execution form: element index -> group (-1: a padding element of no
// sequence): per (token, head) row, per (head, sequence, 128-key tile), per (head, sequence, 128-key
// tile, channel), and per (sequence, head, channel) of Q, K or output tokens.
struct ExecGroups {
  const Geometry& g;
  std::vector<int64_t> q_seq, k_seq, k_first, o_seq;  // token -> sequence (-1: none), K: its first token
  int64_t max_tiles = 1;                               // 128-key tiles of the longest K/V sequence
  ExecGroups(const Geometry& geo, bool broadcast_q)
      : g(geo), q_seq(size_t(geo.Tq), -1), k_seq(size_t(geo.Tk), -1), k_first(size_t(geo.Tk), 0), o_seq(size_t(geo.To), -1) {
    for (int b = 0; b < g.B; ++b) {
      if (!broadcast_q || b == 0)
        for (int64_t t = g.q0[b]; t < g.q0[b] + g.lq[b]; ++t) q_seq[size_t(t)] = b;
      for (int64_t t = g.k0[b]; t < g.k0[b] + g.lk[b]; ++t) k_seq[size_t(t)] = b, k_first[size_t(t)] = g.k0[b];
      for (int64_t t = g.o0[b]; t < g.o0[b] + g.lq[b]; ++t) o_seq[size_t(t)] = b;
    }
    for (int64_t lk : g.lk) max_tiles = std::max(max_tiles, (lk + 127) / 128);
  }
  static int64_t row(int64_t i) { return i / kD; }
  int64_t k_tile(int64_t i) const {
    const int64_t t = i / (g.H * kD), h = (i / kD) % g.H;
    if (k_seq[size_t(t)] < 0) return -1;
    return (h * g.B + k_seq[size_t(t)]) * max_tiles + (t - k_first[size_t(t)]) / 128;
  }
  int64_t k_tiles() const { return g.H * g.B * max_tiles; }
  int64_t k_tile_channel(int64_t i) const {
    const int64_t tile = k_tile(i);
    return tile < 0 ? -1 : tile * kD + i % kD;
  }
  static int64_t channel(const std::vector<int64_t>& seq, int64_t H, int64_t i) {
    const int64_t t = i / (H * kD), hd = i % (H * kD);
    return seq[size_t(t)] < 0 ? int64_t(-1) : seq[size_t(t)] * H * kD + hd;
  }
  int64_t channels() const { return int64_t(g.B) * g.H * kD; }
};

// The Hopper execution form of the MX backward operands (AttnOptions::hopper_exec): Q and dO (for
// dP) per (token, head) row, K and V per (128-key tile, head), and the token-contracted operands
// (Q for dK, K for dQ, dO for dV) per (sequence, head, channel).
void hopper_exec_operands(const Geometry& g, bool broadcast_q, Operands* ops) {
  const int64_t H = g.H;
  const int64_t nq = g.Tq * H * kD, nk = g.Tk * H * kD, no = g.To * H * kD;
  const ExecGroups e(g, broadcast_q);
  auto k_tile = [&](int64_t i) { return e.k_tile(i); };
  auto channel = [&](const std::vector<int64_t>& seq) {
    return [&seq, H](int64_t i) { return ExecGroups::channel(seq, H, i); };
  };
  ops->q_s = ops->add(regroup(ops->q_s, nq, ExecGroups::row, g.Tq * H));
  ops->k_s = ops->add(regroup(ops->k_s, nk, k_tile, e.k_tiles()));
  ops->v_dp = ops->add(regroup(ops->v_dp, nk, k_tile, e.k_tiles()));
  ops->q_dk = ops->add(regroup(ops->q_dk, nq, channel(e.q_seq), e.channels()));
  ops->k_dq = ops->add(regroup(ops->k_dq, nk, channel(e.k_seq), e.channels()));
  const double* do_mx = ops->do_g;
  ops->do_g = ops->add(regroup(do_mx, no, ExecGroups::row, g.To * H));
  ops->do_dv = ops->add(regroup(do_mx, no, channel(e.o_seq), e.channels()));
}

// The Hopper execution form of the MX forward operands (AttnOptions::hopper_fwd): Q per (token,
// head) row, K per (128-key tile, head) and V per (sequence, head, channel) as the forward kernel's
// prepare pass does, or V per (128-key tile, head, channel) or per (128-key tile, head) (forms a
// quantizer writes without a pass over the whole sequence).
void hopper_forward_operands(const Geometry& g, bool broadcast_q, HopperFwd form, Operands* ops) {
  const int64_t H = g.H, nq = g.Tq * H * kD, nk = g.Tk * H * kD;
  const ExecGroups e(g, broadcast_q);
  ops->q_s = ops->add(regroup(ops->q_s, nq, ExecGroups::row, g.Tq * H));
  ops->k_s = ops->add(regroup(ops->k_s, nk, [&](int64_t i) { return e.k_tile(i); }, e.k_tiles()));
  if (form == HopperFwd::kVPerTile)
    ops->v_o = ops->add(regroup(ops->v_o, nk, [&](int64_t i) { return e.k_tile(i); }, e.k_tiles()));
  else if (form == HopperFwd::kVPerTileChannel)
    ops->v_o = ops->add(regroup(ops->v_o, nk, [&](int64_t i) { return e.k_tile_channel(i); }, e.k_tiles() * kD));
  else
    ops->v_o = ops->add(regroup(ops->v_o, nk, [&](int64_t i) { return ExecGroups::channel(e.k_seq, H, i); }, e.channels()));
}

// backward=false prepares q_s, k_s, v_o; backward=true prepares everything but v_o.
Status prepare(const AttnProblem& p, const Geometry& g, AttnMethod m, const float* dout, const JaggedMeta& out_meta,
               bool backward, Operands* ops) {
  const int64_t nq = g.Tq * g.H * kD, nk = g.Tk * g.H * kD, no = g.To * g.H * kD;
  ops->store.reserve(8);  // pointers into `store` must stay valid
  switch (m) {
    case AttnMethod::kFp64:
    case AttnMethod::kBf16: {
      auto conv = [&](const float* x, int64_t n) { return m == AttnMethod::kFp64 ? raw_of(x, n) : bf16_of(x, n); };
      ops->q_s = ops->q_dk = ops->add(conv(p.q, nq));
      ops->k_s = ops->k_dq = ops->add(conv(p.k, nk));
      ops->v_o = ops->v_dp = ops->add(conv(p.v, nk));
      if (backward) ops->do_g = ops->add(conv(dout, no));
      return Status::Ok();
    }
    case AttnMethod::kFp8PerTensor:
      ops->q_s = ops->q_dk = ops->add(fp8_tensor_of(p.q, g.Tq, g.H));
      ops->k_s = ops->k_dq = ops->add(fp8_tensor_of(p.k, g.Tk, g.H));
      ops->v_o = ops->v_dp = ops->add(fp8_tensor_of(p.v, g.Tk, g.H));
      if (backward) ops->do_g = ops->add(fp8_tensor_of(dout, g.To, g.H));
      return Status::Ok();
    case AttnMethod::kMx: {
      Vec t;
      MXFLASH_RETURN_IF_ERROR(mx_of(p.q, *p.q_meta, g.H, Orientation::kHdim, &t));
      ops->q_s = ops->add(std::move(t));
      MXFLASH_RETURN_IF_ERROR(mx_of(p.k, *p.k_meta, g.H, Orientation::kHdim, &t));
      ops->k_s = ops->add(std::move(t));
      if (!backward) {
        MXFLASH_RETURN_IF_ERROR(mx_of(p.v, *p.k_meta, g.H, Orientation::kSeq, &t));
        ops->v_o = ops->add(std::move(t));
        return Status::Ok();
      }
      MXFLASH_RETURN_IF_ERROR(mx_of(p.v, *p.k_meta, g.H, Orientation::kHdim, &t));
      ops->v_dp = ops->add(std::move(t));
      MXFLASH_RETURN_IF_ERROR(mx_of(dout, out_meta, g.H, Orientation::kSquare32, &t));
      ops->do_g = ops->add(std::move(t));
      MXFLASH_RETURN_IF_ERROR(mx_of(p.q, *p.q_meta, g.H, Orientation::kSeq, &t));
      ops->q_dk = ops->add(std::move(t));
      MXFLASH_RETURN_IF_ERROR(mx_of(p.k, *p.k_meta, g.H, Orientation::kSeq, &t));
      ops->k_dq = ops->add(std::move(t));
      return Status::Ok();
    }
  }
  return Status::Invalid("method: unknown attention method");
}

bool valid_method(AttnMethod m) { return int(m) >= 0 && int(m) <= 3; }

}  // namespace

// ---------------------------------------------------------------- public
const char* to_string(AttnMethod m) {
  switch (m) {
    case AttnMethod::kFp64: return "fp64";
    case AttnMethod::kBf16: return "bf16";
    case AttnMethod::kFp8PerTensor: return "fp8";
    case AttnMethod::kMx: return "mx";
  }
  return "?";
}

bool parse_attn_method(const std::string& name, AttnMethod* m) {
  for (AttnMethod x : {AttnMethod::kFp64, AttnMethod::kBf16, AttnMethod::kFp8PerTensor, AttnMethod::kMx})
    if (name == to_string(x)) {
      *m = x;
      return true;
    }
  return false;
}

int64_t out_tokens(const AttnProblem& p) {
  if (!p.broadcast_q) return p.q_meta->total_tokens();
  return int64_t(p.k_meta->batch()) * p.q_meta->length(0);
}

Status check_causal(CausalMask causal) {
  if (causal == CausalMask::kNone || causal == CausalMask::kTopLeft || causal == CausalMask::kBottomRight)
    return Status::Ok();
  return Status::Invalid("causal: must be none, top_left or bottom_right, got an unknown value " +
                         std::to_string(int(causal)));
}

namespace {
// Metadata, heads, scale and mask (check_problem without the data pointers).
Status check_problem_meta(const AttnProblem& p) {
  if (!p.q_meta || p.q_meta->batch() < 1) return Status::Invalid("q_meta: missing or empty metadata");
  if (!p.k_meta || p.k_meta->batch() < 1) return Status::Invalid("k_meta: missing or empty metadata");
  if (p.broadcast_q) {
    if (p.q_meta->batch() != 1)
      return Status::Invalid("q_meta: broadcast_q needs exactly one Q sequence, got " + std::to_string(p.q_meta->batch()));
  } else if (p.q_meta->batch() != p.k_meta->batch()) {
    return Status::Invalid("q_meta: batch " + std::to_string(p.q_meta->batch()) + " differs from k_meta batch " +
                           std::to_string(p.k_meta->batch()) + " (set broadcast_q for one shared Q sequence)");
  }
  if (p.heads < 1) return Status::Invalid("heads: must be >= 1");
  if (!(p.softmax_scale > 0.0) || !std::isfinite(p.softmax_scale))
    return Status::Invalid("softmax_scale: must be finite and > 0");
  return check_causal(p.causal);
}
}  // namespace

Status check_problem(const AttnProblem& p) {
  MXFLASH_RETURN_IF_ERROR(check_problem_meta(p));
  if (p.q_meta->total_tokens() > 0 && !p.q) return Status::Invalid("q: data pointer is null");
  if (p.k_meta->total_tokens() > 0 && (!p.k || !p.v)) return Status::Invalid("k, v: data pointer is null");
  return Status::Ok();
}

Status attention_operands(const AttnProblem& p, AttnMethod m, const float* dout, AttnOperands* ops) {
  MXFLASH_RETURN_IF_ERROR(check_problem(p));
  if (!valid_method(m)) return Status::Invalid("method: unknown attention method");
  if (!ops) return Status::Invalid("ops: null");
  const Geometry g = geometry_of(p);
  if (g.To > 0 && !dout) return Status::Invalid("dout: data pointer is null");
  Operands f, b;
  MXFLASH_RETURN_IF_ERROR(prepare(p, g, m, nullptr, *p.q_meta, /*backward=*/false, &f));
  MXFLASH_RETURN_IF_ERROR(prepare(p, g, m, dout, out_meta_of(p, g), /*backward=*/true, &b));
  const size_t nq = size_t(g.Tq * g.H * kD), nk = size_t(g.Tk * g.H * kD), no = size_t(g.To * g.H * kD);
  auto copy = [](const double* x, size_t n) { return Vec(x, x + n); };
  ops->q_s = copy(f.q_s, nq);
  ops->k_s = copy(f.k_s, nk);
  ops->v_o = copy(f.v_o, nk);
  ops->v_dp = copy(b.v_dp, nk);
  ops->do_g = copy(b.do_g, no);
  ops->q_dk = copy(b.q_dk, nq);
  ops->k_dq = copy(b.k_dq, nk);
  return Status::Ok();
}

Status attention_forward(const AttnProblem& p, AttnMethod m, AttnForwardResult* result, const AttnOptions& opt) {
  MXFLASH_RETURN_IF_ERROR(check_problem(p));
  if (!valid_method(m)) return Status::Invalid("method: unknown attention method");
  if (!result) return Status::Invalid("result: null");
  const Geometry g = geometry_of(p);
  Operands ops;
  MXFLASH_RETURN_IF_ERROR(prepare(p, g, m, nullptr, *p.q_meta, /*backward=*/false, &ops));
  if (m == AttnMethod::kMx && opt.hopper_fwd != HopperFwd::kNone) hopper_forward_operands(g, p.broadcast_q, opt.hopper_fwd, &ops);
  const bool exact = m == AttnMethod::kFp64;
  const bool round = !exact && opt.round_outputs;
  const PRound pr = p_round_of(m);
  result->out.assign(size_t(g.To * g.H * kD), 0.0);
  result->lse.assign(size_t(g.H * g.To), kNegInf);

  for_each_row_block(g, opt.threads, kForwardRowBlock, [&](int b, int64_t h, int64_t i_begin, int64_t i_end) {
    const int64_t lk = g.lk[b];
    if (lk == 0) return;  // O = 0, LSE = -inf
    Vec s(static_cast<size_t>(lk));
    double acc[kD];
    for (int64_t i = i_begin; i < i_end; ++i) {
      // The row's keys 0 .. nk - 1 (the causal mask; all lk without one): the others take no part.
      const int64_t nk = causal_keys(p.causal, i, g.lq[b], lk);
      if (nk == 0) continue;  // a row facing no key: O = 0, LSE = -inf
      const double* q = ops.q_s + g.idx(g.q0[b] + i, h);
      double m_row = kNegInf;
      for (int64_t j = 0; j < nk; ++j) {
        const double dot = dot128(q, ops.k_s + g.idx(g.k0[b] + j, h));
        s[j] = (exact ? dot : to_f32(dot)) * p.softmax_scale;
        m_row = std::max(m_row, s[j]);
      }
      double l = 0.0;
      std::fill(acc, acc + kD, 0.0);
      for (int64_t j = 0; j < nk; ++j) {
        double pj = std::exp(s[j] - m_row);
        if (!exact) pj = to_f32(pj);
        l += pj;  // the row sum uses the unquantized P, as FA kernels do
        const double pq = round_p(pj, pr);
        if (pq != 0.0) axpy128(pq, ops.v_o + g.idx(g.k0[b] + j, h), acc);
      }
      if (!exact) l = to_f32(l);
      const int64_t t = g.o0[b] + i;
      double* o = result->out.data() + g.idx(t, h);
      for (int d = 0; d < kD; ++d) {
        const double v = acc[d] / l;
        o[d] = round ? to_bf16(v) : (exact ? v : to_f32(v));
      }
      const double lse = m_row + std::log(l);
      result->lse[size_t(h * g.To + t)] = exact ? lse : to_f32(lse);
    }
  });
  return Status::Ok();
}

namespace {
// Checks shared by both backward entries; g is the problem's geometry.
Status check_backward_args(const Geometry& g, const AttnForwardResult& fwd, const float* dout,
                           const AttnBackwardResult* grads) {
  if (!grads) return Status::Invalid("grads: null");
  if (fwd.out.size() != size_t(g.To * g.H * kD) || fwd.lse.size() != size_t(g.H * g.To))
    return Status::Invalid("fwd: out / lse sizes do not match the problem (" + std::to_string(g.To) + " output tokens)");
  if (g.To > 0 && !dout) return Status::Invalid("dout: data pointer is null");
  return Status::Ok();
}

Status backward_core(const AttnProblem& p, const Geometry& g, AttnMethod m, const Operands& ops,
                     const AttnForwardResult& fwd, const float* dout, AttnBackwardResult* grads,
                     const AttnOptions& opt);
}  // namespace

Status attention_backward(const AttnProblem& p, AttnMethod m, const AttnForwardResult& fwd, const float* dout,
                          AttnBackwardResult* grads, const AttnOptions& opt) {
  MXFLASH_RETURN_IF_ERROR(check_problem(p));
  if (!valid_method(m)) return Status::Invalid("method: unknown attention method");
  const Geometry g = geometry_of(p);
  MXFLASH_RETURN_IF_ERROR(check_backward_args(g, fwd, dout, grads));
  Operands ops;
  MXFLASH_RETURN_IF_ERROR(prepare(p, g, m, dout, out_meta_of(p, g), /*backward=*/true, &ops));
  if (m == AttnMethod::kMx && opt.hopper_exec) hopper_exec_operands(g, p.broadcast_q, &ops);
  return backward_core(p, g, m, ops, fwd, dout, grads, opt);
}

Status attention_backward_mx_operands(const AttnProblem& p, const AttnOperands& given, const AttnForwardResult& fwd,
                                      const float* dout, AttnBackwardResult* grads, const AttnOptions& opt) {
  MXFLASH_RETURN_IF_ERROR(check_problem_meta(p));
  const Geometry g = geometry_of(p);
  MXFLASH_RETURN_IF_ERROR(check_backward_args(g, fwd, dout, grads));
  const size_t nq = size_t(g.Tq * g.H * kD), nk = size_t(g.Tk * g.H * kD);
  const struct {
    const Vec& v;
    size_t n;
    const char* name;
  } parts[] = {{given.q_s, nq, "ops.q_s"}, {given.k_s, nk, "ops.k_s"}, {given.v_dp, nk, "ops.v_dp"},
               {given.q_dk, nq, "ops.q_dk"}, {given.k_dq, nk, "ops.k_dq"}};
  for (const auto& part : parts)
    if (part.v.size() != part.n)
      return Status::Invalid(std::string(part.name) + ": has " + std::to_string(part.v.size()) + " values, the problem needs " +
                             std::to_string(part.n));
  Operands ops;
  ops.q_s = given.q_s.data();
  ops.k_s = given.k_s.data();
  ops.v_dp = given.v_dp.data();
  ops.q_dk = given.q_dk.data();
  ops.k_dq = given.k_dq.data();
  Vec t;
  MXFLASH_RETURN_IF_ERROR(mx_of(dout, out_meta_of(p, g), g.H, Orientation::kSquare32, &t));
  ops.do_g = ops.add(std::move(t));
  if (opt.hopper_exec) hopper_exec_operands(g, p.broadcast_q, &ops);
  return backward_core(p, g, AttnMethod::kMx, ops, fwd, dout, grads, opt);
}

namespace {
Status backward_core(const AttnProblem& p, const Geometry& g, AttnMethod m, const Operands& ops,
                     const AttnForwardResult& fwd, const float* dout, AttnBackwardResult* grads,
                     const AttnOptions& opt) {
  const bool exact = m == AttnMethod::kFp64;
  const bool round = !exact && opt.round_outputs;
  const PRound pr = p_round_of(m);
  const int64_t no = g.To * g.H * kD;
  // D = rowsum(O . dO): the forward's O and the dO the method received (bf16 for BF16, fp32 else).
  const Vec do_d = m == AttnMethod::kBf16 ? bf16_of(dout, no) : raw_of(dout, no);
  // dQ accumulated in fp16 with a static power-of-two scale (the MX method's option), else in fp32.
  const bool fp16_dq = m == AttnMethod::kMx && opt.dq_fp16_scale_log2 >= 0;
  const bool dynamic_p = m == AttnMethod::kMx && opt.dynamic_p;
  const double dq16_scale = fp16_dq ? std::ldexp(1.0, opt.dq_fp16_scale_log2) : 1.0;

  Vec dq_part(size_t(no), 0.0);  // per output token; summed over the batch for broadcast_q
  grads->dk.assign(size_t(g.Tk * g.H * kD), 0.0);
  grads->dv.assign(size_t(g.Tk * g.H * kD), 0.0);
  // Per-tensor FP8 quantizes dS with its exact per-head amax: a first pass finds it.
  std::vector<double> item_amax(size_t(g.B * g.H), 0.0);
  std::vector<double> ds_descale(size_t(g.H), 0.0);
  std::vector<float> ds_inv(size_t(g.H), 0.f);

  // Hopper execution form: dS for dK in blocks of a 64-row Q tile per key, for dQ per row (or per
  // opt.hopper_dq_rows rows) over 128-key tiles (the operands re-expressed by the caller:
  // hopper_exec_operands).
  const bool hopper = m == AttnMethod::kMx && opt.hopper_exec;
  const bool dk_from_dq = hopper && opt.hopper_dk_from_dq;
  // dQ's dS block height (hopper_dk_from_dq: 64, and dK takes the same operand).
  const int dq_rows = dk_from_dq ? 64 : opt.hopper_dq_rows;
  const int kRowsBlk = dk_from_dq ? 128 : hopper ? 64 : kBlockSize;
  const double* do_dv = ops.do_dv ? ops.do_dv : ops.do_g;

  // One (sequence, head) item in tiles of 32 (hopper: 64) query rows aligned to the sequence start
  // (the MX dS blocks along Q tokens). amax_only: per-tensor FP8's first pass.
  auto run_item = [&](int b, int64_t h, bool amax_only) {
    const int64_t lk = g.lk[b], lq = g.lq[b];
    if (lk == 0 || lq == 0) return;
    Vec ps(size_t(kRowsBlk * lk)), dsk(size_t(kRowsBlk * lk)), dsq;
    double amax = 0.0;
    for (int64_t i0 = 0; i0 < lq; i0 += kRowsBlk) {
      const int n = int(std::min<int64_t>(kRowsBlk, lq - i0));
      for (int r = 0; r < n; ++r) {
        const int64_t tq = g.q0[b] + i0 + r, to = g.o0[b] + i0 + r;
        const double lse = fwd.lse[size_t(h * g.To + to)];
        const double* q = ops.q_s + g.idx(tq, h);
        const double* dov = ops.do_g + g.idx(to, h);
        double dsum = dot128(fwd.out.data() + g.idx(to, h), do_d.data() + g.idx(to, h));
        if (!exact) dsum = to_f32(dsum);
        // The row's keys 0 .. nk - 1 (the causal mask; all lk without one): P = dS = 0 exactly
        // beyond, so masked keys add nothing to any product and no block's amax.
        const int64_t nk = causal_keys(p.causal, i0 + r, lq, lk);
        for (int64_t j = nk; j < lk; ++j) ps[r * lk + j] = dsk[r * lk + j] = 0.0;
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t tk = g.k0[b] + j;
          const double sdot = dot128(q, ops.k_s + g.idx(tk, h));
          double pij, dp = dot128(dov, ops.v_dp + g.idx(tk, h));
          if (exact) {
            pij = lse == kNegInf ? 0.0 : std::exp(sdot * p.softmax_scale - lse);
          } else {
            const double x = to_f32(sdot) * p.softmax_scale * kLog2e - lse * kLog2e;
            pij = lse == kNegInf ? 0.0 : to_f32(std::exp2(std::min(x, kPExp2Clamp)));
            dp = to_f32(dp);
          }
          const double p_ds = !hopper || opt.hopper_ds_p == 0 ? pij
                              : opt.hopper_ds_p == 1           ? round_p(pij, pr)
                                                               : to_bf16(pij);
          double ds = p_ds * (dp - dsum);
          if (!exact) ds = to_f32(ds);
          if (m == AttnMethod::kMx && nk == 1) ds = 0.0;  // softmax over one key: dS = 0 exactly
          ps[r * lk + j] = pij;
          dsk[r * lk + j] = ds;
          amax = std::max(amax, std::fabs(ds));
        }
      }
      if (amax_only) continue;

      // Round P and dS the way the method feeds them to the dV, dK and dQ products.
      if (dynamic_p) {
        // P for dV = Pᵀ dO in 1x32 blocks along Q tokens with their own scales (in-kernel rule).
        for (int64_t j = 0; j < lk; ++j) mx_block_inplace(ps.data() + j, n, 1, lk);
      } else {
        for (int64_t e = 0; e < n * lk; ++e) ps[e] = round_p(ps[e], pr);
      }
      switch (m) {
        case AttnMethod::kFp64: dsq = dsk; break;
        case AttnMethod::kBf16:
          for (int64_t e = 0; e < n * lk; ++e) dsk[e] = to_bf16(dsk[e]);
          dsq = dsk;
          break;
        case AttnMethod::kFp8PerTensor: {
          if (ds_descale[h] > 0)
            for (int64_t e = 0; e < n * lk; ++e) dsk[e] = e4m3_scaled(dsk[e], ds_inv[h], ds_descale[h]);
          dsq = dsk;
          break;
        }
        case AttnMethod::kMx:
          dsq = dsk;
          if (hopper && dq_rows == 0) {
            // dK's operand re-expressed: each key's block (its scale byte kept; keys whose dS are all
            // zero take no part in the tile's largest), then each value over its tile's largest.
            std::vector<int> key_scale(size_t(lk), -1);
            for (int64_t j = 0; j < lk; ++j) {
              const float amax = mx_block_inplace(dsk.data() + j, n, 1, lk);
              if (amax > 0.f) key_scale[size_t(j)] = e8m0_scale_byte(amax, ScalingMode::kRceil, kE8m0One);
            }
            for (int64_t j0 = 0; j0 < lk; j0 += 128) {
              const int64_t j1 = std::min<int64_t>(lk, j0 + 128);
              const int top = *std::max_element(key_scale.begin() + j0, key_scale.begin() + j1);
              if (top < 0) continue;  // all dS zero
              const uint8_t s = uint8_t(top);
              const float inv = e8m0_inv_scale(s);
              for (int r = 0; r < n; ++r)
                for (int64_t j = j0; j < j1; ++j)
                  dsq[r * lk + j] = double(dequantize_element(quantize_element(float(dsk[r * lk + j]), inv), s));
            }
            break;
          }
          if (!dk_from_dq)
            for (int64_t j = 0; j < lk; ++j) mx_block_inplace(dsk.data() + j, n, 1, lk);  // 1x32 along Q
          if (hopper) {  // per dq_rows rows (1: per row) over 128-key tiles
            const int rows = std::max(1, dq_rows);
            for (int r0 = 0; r0 < n; r0 += rows)
              for (int64_t j0 = 0; j0 < lk; j0 += 128)
                mx_block_inplace(dsq.data() + r0 * lk + j0, std::min(rows, n - r0), int(std::min<int64_t>(128, lk - j0)),
                                 lk);
          } else {  // 32x32
            for (int64_t j0 = 0; j0 < lk; j0 += kBlockSize)
              mx_block_inplace(dsq.data() + j0, n, int(std::min<int64_t>(kBlockSize, lk - j0)), lk);
          }
          if (dk_from_dq) dsk = dsq;  // one operand for dQ and dK
          break;
      }

      for (int64_t j = 0; j < lk; ++j) {
        const int64_t tk = g.k0[b] + j;
        double* dv = grads->dv.data() + g.idx(tk, h);
        double* dk = grads->dk.data() + g.idx(tk, h);
        for (int r = 0; r < n; ++r) {
          const double pq = ps[r * lk + j], ds = dsk[r * lk + j];
          if (pq != 0.0) axpy128(pq, do_dv + g.idx(g.o0[b] + i0 + r, h), dv);
          if (ds != 0.0) axpy128(ds, ops.q_dk + g.idx(g.q0[b] + i0 + r, h), dk);
        }
      }
      for (int r = 0; r < n; ++r) {
        double* dq = dq_part.data() + g.idx(g.o0[b] + i0 + r, h);
        const int64_t nk = causal_keys(p.causal, i0 + r, lq, lk);  // the row's keys (its dS are 0 beyond)
        if (!fp16_dq) {
          for (int64_t j = 0; j < nk; ++j) {
            const double ds = dsq[r * lk + j];
            if (ds != 0.0) axpy128(ds, ops.k_dq + g.idx(g.k0[b] + j, h), dq);
          }
          continue;
        }
        // FP16 accumulation: each K/V tile's fp32 contribution, scaled, rounded to fp16 and added
        // into the fp16 accumulator (rounded again), tile after tile (the tiles holding a key the
        // row sees: a fully masked tile adds nothing).
        for (int64_t t0 = 0; t0 < nk; t0 += kDqTile) {
          double c[kD] = {};
          for (int64_t j = t0; j < std::min(nk, t0 + kDqTile); ++j) {
            const double ds = dsq[r * lk + j];
            if (ds != 0.0) axpy128(ds, ops.k_dq + g.idx(g.k0[b] + j, h), c);
          }
          for (int d = 0; d < kD; ++d) dq[d] = to_fp16(dq[d] + to_fp16(to_f32(c[d]) * dq16_scale));
        }
      }
    }
    if (amax_only) item_amax[size_t(b * g.H + h)] = amax;
  };

  if (m == AttnMethod::kFp8PerTensor) {
    for_each_item(g, opt.threads, [&](int b, int64_t h) { run_item(b, h, /*amax_only=*/true); });
    for (int64_t h = 0; h < g.H; ++h) {
      double amax = 0.0;
      for (int b = 0; b < g.B; ++b) amax = std::max(amax, item_amax[size_t(b * g.H + h)]);
      if (amax == 0.0) continue;  // dS = 0: nothing to scale
      ds_inv[h] = kE4m3Max / float(amax);
      ds_descale[h] = double(float(amax) / kE4m3Max);
    }
  }
  for_each_item(g, opt.threads, [&](int b, int64_t h) { run_item(b, h, /*amax_only=*/false); });

  // dQ: sum over the batch (broadcast_q) in batch order (in fp16 for the fp16 accumulator), then
  // the softmax scale (and the fp16 accumulator's scale removed); dK likewise.
  grads->dq.assign(size_t(g.Tq * g.H * kD), 0.0);
  if (p.broadcast_q) {
    const int64_t n = g.lq.empty() ? 0 : g.lq[0] * g.H * kD;
    for (int b = 0; b < g.B; ++b)
      for (int64_t e = 0; e < n; ++e) {
        double& x = grads->dq[e];
        x = fp16_dq ? to_fp16(x + dq_part[size_t(b * n + e)]) : x + dq_part[size_t(b * n + e)];
      }
  } else {
    grads->dq = dq_part;
  }
  if (fp16_dq)
    for (double& e : grads->dq) e /= dq16_scale;
  auto finish = [&](Vec& x, double scale) {
    for (double& e : x) {
      e *= scale;
      e = round ? to_bf16(e) : (exact ? e : to_f32(e));
    }
  };
  finish(grads->dq, p.softmax_scale);
  finish(grads->dk, p.softmax_scale);
  finish(grads->dv, 1.0);
  return Status::Ok();
}
}  // namespace

}  // namespace mxflash::ref
