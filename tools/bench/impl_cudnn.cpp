// cuDNN SDPA peers (BF16 and per-tensor FP8, forward and backward) through the cudnn-frontend graph
// API. All cuDNN code lives in this one translation unit: cudnn_frontend.h is heavy to compile.
//
// Layouts (recorded in the JSON notes):
//  dense   uniform lengths: (B, H, S, D) tensors in BSHD memory order, no mask.
//  padded  jagged lengths: (B, H, S_max, D) BSHD tensors + padding mask from seq_len_q / seq_len_kv.
//  ragged  jagged lengths: packed THD tensors (int64 ragged offsets = cu_seqlens * H * D) + padding mask.
// auto: dense when every length is equal; otherwise ragged for BF16 and padded for FP8, because
// cudnn-frontend rejects FP8 backward with ragged (THD) tensors on Hopper ("sdpa fp8 backward with
// THD is not supported on Hopper architecture"), and forward and backward must share O and LSE.
//
// FP8 (per-tensor, what cuDNN's FP8 graph takes): Q, K, V, dO are E4M3 with descale = amax/448 of the
// generated data; S (softmax probabilities, <= 1) uses scale 448 / descale 1/448; scale_O, scale_dP
// and scale_dQ/dK/dV are 448/amax from calibration executions (the graphs' amax outputs, as delayed
// scaling would give), dP first since dQ/dK depend on it. On sm_90 FP8 SDPA writes O, dQ, dK, dV
// in FP8 (BF16 outputs need Blackwell), so those are E4M3 here.
//
// Broadcast Q: cuDNN has no broadcast, so Q is materialized B times (what a user would do); dQ comes
// out per copy and its sum over the batch (autograd's job for an expanded Q) is not timed.
//
// Causal (--causal): cudnn-frontend's diagonal band, right bound 0 (key j <= i + 0 relative to the
// diagonal), aligned TOP_LEFT (j <= i) or BOTTOM_RIGHT (j <= i + Lk - Lq, per sequence from
// seq_len_q / seq_len_kv under a padding mask), on every graph (forward and backward, BF16 and FP8).
// Where the frontend or the engine heuristics refuse the mask for a case (e.g. bottom_right with
// Lq > Lk on dense tensors, or the FP8 backward's bottom_right before Blackwell) the graph does not
// build and the impl is reported unsupported with cuDNN's message: a masked case never times an
// unmasked run.
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <unordered_map>

#include "bench_impl.h"

namespace mxflash::bench {
namespace fe = cudnn_frontend;
namespace {

constexpr float kE4m3Max = 448.f;
constexpr int64_t kRaggedSlackRows = 128;  // cuDNN's ragged kernels round the packed total up to 64

// Tensor uids shared by the forward and backward graphs.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV,
  kSeqQ, kSeqKV, kOffQ, kOffK, kOffStats,
  // FP8 scalars: one float each in a per-set block, slot = uid - kScalar0
  kScalar0 = 32,
  kDescaleQ = kScalar0, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO, kAmaxS, kAmaxO,
  kDescaleO, kDescaleDO, kDescaleDP, kScaleDQ, kScaleDK, kScaleDV, kScaleDP,
  kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP,
  kScalarEnd
};
constexpr int kNumScalars = int(kScalarEnd - kScalar0);
int slot(Uid u) { return int(u - kScalar0); }

enum class Layout { kDense, kPadded, kRagged };
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kDense: return "dense";
    case Layout::kPadded: return "padded";
    case Layout::kRagged: return "ragged";
  }
  return "?";
}

// The problem's causal mask on SDPA forward / backward attributes (see the header comment).
template <typename Attributes>
void set_causal(Attributes& opt, CausalMask m) {
  if (m == CausalMask::kNone) return;
  opt.set_diagonal_alignment(m == CausalMask::kTopLeft ? fe::DiagonalAlignment_t::TOP_LEFT
                                                       : fe::DiagonalAlignment_t::BOTTOM_RIGHT)
      .set_diagonal_band_right_bound(0);
}

Status fe_status(fe::error_t e, const std::string& what) {
  if (e.is_good()) return Status::Ok();
  return Status::Unsupported(what + ": " + e.get_message());
}

// One handle for the process (cuDNN handles are expensive to create).
Status handle(cudnnHandle_t* out) {
  static cudnnHandle_t h = nullptr;
  static cudnnStatus_t st = CUDNN_STATUS_SUCCESS;
  static bool tried = false;
  if (!tried) {
    tried = true;
    st = cudnnCreate(&h);
  }
  if (st != CUDNN_STATUS_SUCCESS) return Status::Cuda(std::string("cudnnCreate: ") + cudnnGetErrorString(st));
  *out = h;
  return Status::Ok();
}

std::vector<int64_t> prefix(const std::vector<int64_t>& v) {
  std::vector<int64_t> p(v.size() + 1, 0);
  for (size_t i = 0; i < v.size(); ++i) p[i + 1] = p[i] + v[i];
  return p;
}

float safe_scale(float amax) { return (std::isfinite(amax) && amax > 0.f) ? kE4m3Max / amax : 1.f; }

std::string fmt_float(float v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", double(v));
  return b;
}

using Pack = std::unordered_map<int64_t, void*>;

class CudnnAttention final : public AttnImpl {
 public:
  CudnnAttention(const AttnProblem& p, bool fp8, Layout layout) : p_(p), fp8_(fp8), layout_(layout) {
    B_ = p.batch, H_ = p.heads, D_ = p.head_dim;
    sq_ = p.max_lq(), skv_ = p.max_lk();
  }

  std::string name() const override { return fp8_ ? "cudnn-fp8" : "cudnn-bf16"; }

  int64_t input_set_bytes(Direction d) const override {
    const int64_t e = fp8_ ? 1 : 2, hd = H_ * D_;
    const int64_t q = p_.total_q() * hd * e, k = p_.total_k() * hd * e;
    if (d == Direction::kFwd) return q + 2 * k;
    return 3 * q + 2 * k + p_.total_q() * H_ * 4;  // Q, O, dO, K, V, LSE
  }

  Status prepare(int n_sets, cudaStream_t s) override;
  Status run(Direction d, int set, cudaStream_t s) override;
  Status output(Direction d, const std::string& which, OutputView* out) override;
  Notes notes(Direction d) const override;

 private:
  struct Set {
    DeviceBuffer q, k, v, o, stats, dO, scalars;
    float host[kNumScalars];
    Pack fwd, bwd;
  };

  int64_t elem() const { return fp8_ ? 1 : 2; }
  std::vector<int64_t> qdims() const { return {B_, H_, sq_, D_}; }
  std::vector<int64_t> kdims() const { return {B_, H_, skv_, D_}; }
  std::vector<int64_t> qstride() const { return {sq_ * H_ * D_, D_, H_ * D_, 1}; }
  std::vector<int64_t> kstride() const { return {skv_ * H_ * D_, D_, H_ * D_, 1}; }
  std::vector<int64_t> stats_stride() const {
    return layout_ == Layout::kRagged ? std::vector<int64_t>{sq_ * H_, 1, H_, 1}
                                      : std::vector<int64_t>{H_ * sq_, sq_, 1, 1};
  }
  int64_t stats_elems() const {
    return layout_ == Layout::kRagged ? (p_.total_q() + kRaggedSlackRows) * H_ : B_ * H_ * sq_;
  }

  using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;
  struct Offsets {
    TensorPtr q, k, stats;  // ragged offsets (element offsets of each sequence), one tensor per uid
  };
  Offsets offsets(fe::graph::Graph& g) const;
  TensorPtr data_tensor(fe::graph::Graph& g, const char* name, Uid uid, bool q_side, const Offsets& off) const;
  TensorPtr stats_tensor(fe::graph::Graph& g) const;
  TensorPtr scalar(fe::graph::Graph& g, const char* name, Uid uid) const;
  void add_masks(fe::graph::Graph& g, TensorPtr* seq_q, TensorPtr* seq_kv) const;
  void set_out(const TensorPtr& t, const char* name, Uid uid, bool q_side) const;
  Status build_fwd();
  Status build_bwd();
  Status finish_graph(fe::graph::Graph& g, std::string* plan, int64_t* ws);
  Pack pack_for(Set& st) const;
  Status upload_scalars(Set& st, cudaStream_t s);
  Status read_scalars(Set& st, cudaStream_t s);
  Status exec(const std::shared_ptr<fe::graph::Graph>& g, Pack& pack, cudaStream_t s);

  AttnProblem p_;
  bool fp8_;
  Layout layout_;
  int64_t B_, H_, D_, sq_, skv_;
  cudnnHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  SeqLayoutBuffer lay_q_, lay_k_;
  DeviceBuffer seq_q_, seq_kv_, off_q_, off_k_, off_stats_;
  std::shared_ptr<fe::graph::Graph> fwd_, bwd_;
  std::string fwd_plan_, bwd_plan_, fwd_err_, bwd_err_;
  DeviceBuffer ws_;
  std::vector<Set> sets_;
  DeviceBuffer dq_, dk_, dv_;
};

CudnnAttention::TensorPtr CudnnAttention::data_tensor(fe::graph::Graph& g, const char* name, Uid uid, bool q_side,
                                                      const Offsets& off) const {
  auto t = g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim(q_side ? qdims() : kdims())
                        .set_stride(q_side ? qstride() : kstride()));
  if (layout_ == Layout::kRagged) t->set_ragged_offset(q_side ? off.q : off.k);
  return t;
}

CudnnAttention::Offsets CudnnAttention::offsets(fe::graph::Graph& g) const {
  Offsets o;
  if (layout_ != Layout::kRagged) return o;
  auto mk = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({B_ + 1, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT64));
  };
  o.q = mk("off_q", kOffQ);
  o.k = mk("off_k", kOffK);
  o.stats = mk("off_stats", kOffStats);
  return o;
}

void CudnnAttention::set_out(const TensorPtr& t, const char* name, Uid uid, bool q_side) const {
  t->set_output(true).set_name(name).set_uid(uid).set_dim(q_side ? qdims() : kdims()).set_stride(
      q_side ? qstride() : kstride());
}

CudnnAttention::TensorPtr CudnnAttention::stats_tensor(fe::graph::Graph& g) const {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("stats")
                      .set_uid(kStats)
                      .set_dim({B_, H_, sq_, 1})
                      .set_stride(stats_stride())
                      .set_data_type(fe::DataType_t::FLOAT));
}

CudnnAttention::TensorPtr CudnnAttention::scalar(fe::graph::Graph& g, const char* name, Uid uid) const {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::FLOAT));
}

void CudnnAttention::add_masks(fe::graph::Graph& g, TensorPtr* seq_q, TensorPtr* seq_kv) const {
  auto mk = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({B_, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  };
  *seq_q = mk("seq_q", kSeqQ);
  *seq_kv = mk("seq_kv", kSeqKV);
}

Status CudnnAttention::finish_graph(fe::graph::Graph& g, std::string* plan, int64_t* ws) {
  // Heuristics mode A only, as the frameworks use it: no fallback to non-flash engines.
  MXFLASH_RETURN_IF_ERROR(fe_status(g.build(handle_, {fe::HeurMode_t::A}), "build"));
  MXFLASH_RETURN_IF_ERROR(fe_status(g.get_workspace_size(*ws), "get_workspace_size"));
  std::string name;
  if (g.get_plan_name(name).is_good()) *plan = name;
  return Status::Ok();
}

Status CudnnAttention::build_fwd() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fp8_ ? fe::DataType_t::FP8_E4M3 : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const Offsets off = offsets(*g);
  auto Q = data_tensor(*g, "Q", kQ, true, off);
  auto K = data_tensor(*g, "K", kK, false, off);
  auto V = data_tensor(*g, "V", kV, false, off);
  fe::graph::SDPA_attributes opt;
  opt.set_name("sdpa_fwd").set_generate_stats(true).set_attn_scale(p_.softmax_scale);
  set_causal(opt, p_.causal);
  if (layout_ != Layout::kDense) {
    TensorPtr sq, skv;
    add_masks(*g, &sq, &skv);
    opt.set_padding_mask(true).set_seq_len_q(sq).set_seq_len_kv(skv);
  }
  if (layout_ == Layout::kRagged)
    opt.set_max_total_seq_len_q((p_.total_q() + 63) / 64 * 64).set_max_total_seq_len_kv((p_.total_k() + 63) / 64 * 64);
  TensorPtr O, Stats;
  if (!fp8_) {
    auto r = g->sdpa(Q, K, V, opt);
    O = r[0], Stats = r[1];
  } else {
    auto r = g->sdpa_fp8(Q, K, V, scalar(*g, "descale_q", kDescaleQ), scalar(*g, "descale_k", kDescaleK),
                         scalar(*g, "descale_v", kDescaleV), scalar(*g, "descale_s", kDescaleS),
                         scalar(*g, "scale_s", kScaleS), scalar(*g, "scale_o", kScaleO), opt);
    O = r[0], Stats = r[1];
    r[2]->set_output(true).set_uid(kAmaxS).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(
        fe::DataType_t::FLOAT);
    r[3]->set_output(true).set_uid(kAmaxO).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(
        fe::DataType_t::FLOAT);
  }
  set_out(O, "O", kO, true);
  Stats->set_output(true).set_uid(kStats).set_dim({B_, H_, sq_, 1}).set_stride(stats_stride()).set_data_type(
      fe::DataType_t::FLOAT);
  if (layout_ == Layout::kRagged) {
    O->set_ragged_offset(off.q);
    Stats->set_ragged_offset(off.stats);
  }
  int64_t ws = 0;
  MXFLASH_RETURN_IF_ERROR(finish_graph(*g, &fwd_plan_, &ws));
  if (size_t(ws) > ws_.bytes()) MXFLASH_RETURN_IF_ERROR(ws_.alloc(size_t(ws)));
  fwd_ = g;
  return Status::Ok();
}

Status CudnnAttention::build_bwd() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fp8_ ? fe::DataType_t::FP8_E4M3 : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const Offsets off = offsets(*g);
  auto Q = data_tensor(*g, "Q", kQ, true, off);
  auto K = data_tensor(*g, "K", kK, false, off);
  auto V = data_tensor(*g, "V", kV, false, off);
  auto O = data_tensor(*g, "O", kO, true, off);
  auto dO = data_tensor(*g, "dO", kDO, true, off);
  auto Stats = stats_tensor(*g);
  if (layout_ == Layout::kRagged) Stats->set_ragged_offset(off.stats);
  TensorPtr sq, skv;
  if (layout_ != Layout::kDense) add_masks(*g, &sq, &skv);
  TensorPtr dQ, dK, dV;
  if (!fp8_) {
    fe::graph::SDPA_backward_attributes opt;
    opt.set_name("sdpa_bwd").set_attn_scale(p_.softmax_scale);
    set_causal(opt, p_.causal);
    if (layout_ != Layout::kDense) opt.set_padding_mask(true).set_seq_len_q(sq).set_seq_len_kv(skv);
    if (layout_ == Layout::kRagged)
      opt.set_max_total_seq_len_q((p_.total_q() + 63) / 64 * 64).set_max_total_seq_len_kv((p_.total_k() + 63) / 64 * 64);
    auto r = g->sdpa_backward(Q, K, V, O, dO, Stats, opt);
    dQ = r[0], dK = r[1], dV = r[2];
  } else {
    fe::graph::SDPA_fp8_backward_attributes opt;
    opt.set_name("sdpa_fp8_bwd").set_attn_scale(p_.softmax_scale);
    set_causal(opt, p_.causal);
    if (layout_ != Layout::kDense) opt.set_padding_mask(true).set_seq_len_q(sq).set_seq_len_kv(skv);
    if (layout_ == Layout::kRagged)
      opt.set_max_total_seq_len_q((p_.total_q() + 63) / 64 * 64).set_max_total_seq_len_kv((p_.total_k() + 63) / 64 * 64);
    auto r = g->sdpa_fp8_backward(
        Q, K, V, O, dO, Stats, scalar(*g, "descale_q", kDescaleQ), scalar(*g, "descale_k", kDescaleK),
        scalar(*g, "descale_v", kDescaleV), scalar(*g, "descale_o", kDescaleO), scalar(*g, "descale_do", kDescaleDO),
        scalar(*g, "descale_s", kDescaleS), scalar(*g, "descale_dp", kDescaleDP), scalar(*g, "scale_s", kScaleS),
        scalar(*g, "scale_dq", kScaleDQ), scalar(*g, "scale_dk", kScaleDK), scalar(*g, "scale_dv", kScaleDV),
        scalar(*g, "scale_dp", kScaleDP), opt);
    dQ = r[0], dK = r[1], dV = r[2];
    const Uid amax[4] = {kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP};
    for (int i = 0; i < 4; ++i)
      r[3 + i]->set_output(true).set_uid(amax[i]).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(
          fe::DataType_t::FLOAT);
  }
  set_out(dQ, "dQ", kDQ, true);
  set_out(dK, "dK", kDK, false);
  set_out(dV, "dV", kDV, false);
  if (layout_ == Layout::kRagged) {
    dQ->set_ragged_offset(off.q);
    dK->set_ragged_offset(off.k);
    dV->set_ragged_offset(off.k);
  }
  int64_t ws = 0;
  MXFLASH_RETURN_IF_ERROR(finish_graph(*g, &bwd_plan_, &ws));
  if (size_t(ws) > ws_.bytes()) MXFLASH_RETURN_IF_ERROR(ws_.alloc(size_t(ws)));
  bwd_ = g;
  return Status::Ok();
}

Pack CudnnAttention::pack_for(Set& st) const {
  Pack p = {{kQ, st.q.get()},          {kK, st.k.get()},        {kV, st.v.get()},
            {kO, st.o.get()},          {kStats, st.stats.get()}, {kDO, st.dO.get()},
            {kDQ, dq_.get()},          {kDK, dk_.get()},        {kDV, dv_.get()}};
  if (layout_ != Layout::kDense) {
    p[kSeqQ] = seq_q_.get();
    p[kSeqKV] = seq_kv_.get();
  }
  if (layout_ == Layout::kRagged) {
    p[kOffQ] = off_q_.get();
    p[kOffK] = off_k_.get();
    p[kOffStats] = off_stats_.get();
  }
  if (fp8_)
    for (int i = 0; i < kNumScalars; ++i) p[kScalar0 + i] = st.scalars.as<float>() + i;
  return p;
}

Status CudnnAttention::upload_scalars(Set& st, cudaStream_t s) {
  BENCH_CUDA(cudaMemcpyAsync(st.scalars.get(), st.host, sizeof st.host, cudaMemcpyHostToDevice, s));
  return cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

Status CudnnAttention::read_scalars(Set& st, cudaStream_t s) {
  BENCH_CUDA(cudaMemcpyAsync(st.host, st.scalars.get(), sizeof st.host, cudaMemcpyDeviceToHost, s));
  return cuda_status(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

Status CudnnAttention::exec(const std::shared_ptr<fe::graph::Graph>& g, Pack& pack, cudaStream_t s) {
  if (s != stream_) {
    const cudnnStatus_t cs = cudnnSetStream(handle_, s);
    if (cs != CUDNN_STATUS_SUCCESS) return Status::Cuda(std::string("cudnnSetStream: ") + cudnnGetErrorString(cs));
    stream_ = s;
  }
  auto e = g->execute(handle_, pack, ws_.get());
  if (!e.is_good()) return Status::Cuda("cuDNN execute: " + e.get_message());
  return Status::Ok();
}

Status CudnnAttention::prepare(int n_sets, cudaStream_t s) {
  MXFLASH_RETURN_IF_ERROR(handle(&handle_));
  const cudnnStatus_t cs = cudnnSetStream(handle_, s);
  if (cs != CUDNN_STATUS_SUCCESS) return Status::Cuda(std::string("cudnnSetStream: ") + cudnnGetErrorString(cs));
  stream_ = s;
  try {
    // Graphs first: an unsupported configuration fails fast, before any large allocation.
    Status st = build_fwd();
    if (!st.ok()) return Status::Unsupported("cuDNN forward graph: " + st.message());
    if (p_.need_bwd) {
      st = build_bwd();
      if (!st.ok()) bwd_err_ = "cuDNN backward graph: " + st.message();
    }
  } catch (const std::exception& e) {
    return Status::Unsupported(std::string("cudnn-frontend threw: ") + e.what());
  }

  // Storage layouts. Generator rows: Q's logical rows are shared by all copies with broadcast.
  const std::vector<int64_t> cu_q = prefix(p_.lq), cu_k = prefix(p_.lk);
  std::vector<int64_t> key_q(static_cast<size_t>(B_));
  const std::vector<int64_t> key_k(cu_k.begin(), cu_k.end() - 1), key_do(cu_q.begin(), cu_q.end() - 1);
  for (int64_t b = 0; b < B_; ++b) key_q[size_t(b)] = p_.broadcast_q ? 0 : cu_q[size_t(b)];
  const bool packed = layout_ == Layout::kRagged;
  SeqLayoutBuffer lay_dO;
  MXFLASH_RETURN_IF_ERROR(lay_q_.init(p_.lq, key_q, H_ * D_, packed ? 0 : sq_));
  MXFLASH_RETURN_IF_ERROR(lay_dO.init(p_.lq, key_do, H_ * D_, packed ? 0 : sq_));
  MXFLASH_RETURN_IF_ERROR(lay_k_.init(p_.lk, key_k, H_ * D_, packed ? 0 : skv_));
  const int64_t rows_q = lay_q_.rows() + (packed ? kRaggedSlackRows : 0);
  const int64_t rows_k = lay_k_.rows() + (packed ? kRaggedSlackRows : 0);
  const size_t qbytes = size_t(rows_q * H_ * D_ * elem()), kbytes = size_t(rows_k * H_ * D_ * elem());

  if (layout_ != Layout::kDense) {
    std::vector<int32_t> lq32(p_.lq.begin(), p_.lq.end()), lk32(p_.lk.begin(), p_.lk.end());
    MXFLASH_RETURN_IF_ERROR(seq_q_.upload(lq32));
    MXFLASH_RETURN_IF_ERROR(seq_kv_.upload(lk32));
  }
  if (packed) {
    std::vector<int64_t> oq(cu_q), ok(cu_k), os(cu_q);
    for (auto& x : oq) x *= H_ * D_;
    for (auto& x : ok) x *= H_ * D_;
    for (auto& x : os) x *= H_;
    MXFLASH_RETURN_IF_ERROR(off_q_.upload(oq));
    MXFLASH_RETURN_IF_ERROR(off_k_.upload(ok));
    MXFLASH_RETURN_IF_ERROR(off_stats_.upload(os));
  }
  if (p_.need_bwd && bwd_) {
    MXFLASH_RETURN_IF_ERROR(dq_.alloc(qbytes));
    MXFLASH_RETURN_IF_ERROR(dk_.alloc(kbytes));
    MXFLASH_RETURN_IF_ERROR(dv_.alloc(kbytes));
  }

  const Elem e = fp8_ ? Elem::kE4M3 : Elem::kBF16;
  DeviceBuffer amax;
  MXFLASH_RETURN_IF_ERROR(amax.alloc(sizeof(float)));
  sets_.clear();
  sets_.resize(static_cast<size_t>(n_sets));
  for (int i = 0; i < n_sets; ++i) {
    Set& st = sets_[size_t(i)];
    MXFLASH_RETURN_IF_ERROR(st.q.alloc(qbytes));
    MXFLASH_RETURN_IF_ERROR(st.k.alloc(kbytes));
    MXFLASH_RETURN_IF_ERROR(st.v.alloc(kbytes));
    MXFLASH_RETURN_IF_ERROR(st.o.alloc(qbytes));
    MXFLASH_RETURN_IF_ERROR(st.stats.alloc(size_t(stats_elems()) * 4));
    if (p_.need_bwd && bwd_) MXFLASH_RETURN_IF_ERROR(st.dO.alloc(qbytes));
    MXFLASH_RETURN_IF_ERROR(st.scalars.alloc(sizeof st.host));
    for (float& x : st.host) x = 1.f;
    // Zero the padding and slack once; fill writes the real rows (and zeros padded rows).
    BENCH_CUDA(cudaMemsetAsync(st.q.get(), 0, qbytes, s));
    BENCH_CUDA(cudaMemsetAsync(st.k.get(), 0, kbytes, s));
    BENCH_CUDA(cudaMemsetAsync(st.v.get(), 0, kbytes, s));
    BENCH_CUDA(cudaMemsetAsync(st.o.get(), 0, qbytes, s));
    struct Fill {
      void* dst;
      const SeqLayout* l;
      uint64_t tensor;
      Uid descale;
    };
    const uint64_t t0 = uint64_t(i) * 16;
    std::vector<Fill> fills = {{st.q.get(), &lay_q_.layout(), t0 + 1, kDescaleQ},
                               {st.k.get(), &lay_k_.layout(), t0 + 2, kDescaleK},
                               {st.v.get(), &lay_k_.layout(), t0 + 3, kDescaleV}};
    if (st.dO.get()) {
      BENCH_CUDA(cudaMemsetAsync(st.dO.get(), 0, qbytes, s));
      fills.push_back({st.dO.get(), &lay_dO.layout(), t0 + 4, kDescaleDO});
    }
    for (const Fill& f : fills) {
      float scale = 1.f;
      if (fp8_) {
        MXFLASH_RETURN_IF_ERROR(amax_normal(*f.l, p_.seed, f.tensor, amax.as<float>(), s));
        float a = 0;
        BENCH_CUDA(cudaMemcpyAsync(&a, amax.get(), sizeof a, cudaMemcpyDeviceToHost, s));
        BENCH_CUDA(cudaStreamSynchronize(s));
        scale = safe_scale(a);
        st.host[slot(f.descale)] = 1.f / scale;
      }
      MXFLASH_RETURN_IF_ERROR(fill_normal(f.dst, e, scale, *f.l, p_.seed, f.tensor, s));
    }
    st.host[slot(kDescaleS)] = 1.f / kE4m3Max;
    st.host[slot(kScaleS)] = kE4m3Max;
    MXFLASH_RETURN_IF_ERROR(upload_scalars(st, s));
    st.fwd = pack_for(st);
    st.bwd = st.fwd;
  }

  // Forward once per set: O and LSE for the backward; for FP8 also the O scale (calibration run with
  // scale_O = 1, then again with 448/amax_O so the stored O uses the E4M3 range).
  for (Set& st : sets_) {
    MXFLASH_RETURN_IF_ERROR(exec(fwd_, st.fwd, s));
    if (fp8_) {
      MXFLASH_RETURN_IF_ERROR(read_scalars(st, s));
      st.host[slot(kScaleO)] = safe_scale(st.host[slot(kAmaxO)]);
      st.host[slot(kDescaleO)] = 1.f / st.host[slot(kScaleO)];
      MXFLASH_RETURN_IF_ERROR(upload_scalars(st, s));
      MXFLASH_RETURN_IF_ERROR(exec(fwd_, st.fwd, s));
    }
  }
  if (fp8_ && bwd_) {
    // dP's scale first (dQ, dK are computed from the quantized dS), then dQ, dK, dV's.
    for (Set& st : sets_) {
      MXFLASH_RETURN_IF_ERROR(exec(bwd_, st.bwd, s));
      MXFLASH_RETURN_IF_ERROR(read_scalars(st, s));
      st.host[slot(kScaleDP)] = safe_scale(st.host[slot(kAmaxDP)]);
      st.host[slot(kDescaleDP)] = 1.f / st.host[slot(kScaleDP)];
      MXFLASH_RETURN_IF_ERROR(upload_scalars(st, s));
      MXFLASH_RETURN_IF_ERROR(exec(bwd_, st.bwd, s));
      MXFLASH_RETURN_IF_ERROR(read_scalars(st, s));
      st.host[slot(kScaleDQ)] = safe_scale(st.host[slot(kAmaxDQ)]);
      st.host[slot(kScaleDK)] = safe_scale(st.host[slot(kAmaxDK)]);
      st.host[slot(kScaleDV)] = safe_scale(st.host[slot(kAmaxDV)]);
      MXFLASH_RETURN_IF_ERROR(upload_scalars(st, s));
    }
  }
  return cuda_status(cudaStreamSynchronize(s), "prepare");
}

Status CudnnAttention::run(Direction d, int set, cudaStream_t s) {
  Set& st = sets_[size_t(set)];
  if (d == Direction::kFwd) return exec(fwd_, st.fwd, s);
  if (!bwd_) return Status::Unsupported(bwd_err_.empty() ? "backward not prepared" : bwd_err_);
  return exec(bwd_, st.bwd, s);
}

Status CudnnAttention::output(Direction d, const std::string& which, OutputView* out) {
  if (sets_.empty()) return Status::Internal("output: not prepared");
  const Set& st = sets_[0];
  out->elem = fp8_ ? Elem::kE4M3 : Elem::kBF16;
  if (d == Direction::kFwd && which == "O") {
    out->data = st.o.get();
    out->scale = fp8_ ? st.host[slot(kDescaleO)] : 1.f;
    out->layout = &lay_q_.layout();
  } else if (d == Direction::kBwd && (which == "dQ" || which == "dK" || which == "dV")) {
    if (!bwd_) return Status::Unsupported(bwd_err_);
    const bool q = which == "dQ";
    out->data = q ? dq_.get() : (which == "dK" ? dk_.get() : dv_.get());
    const Uid sc = q ? kScaleDQ : (which == "dK" ? kScaleDK : kScaleDV);
    out->scale = fp8_ ? 1.f / st.host[slot(sc)] : 1.f;
    out->layout = q ? &lay_q_.layout() : &lay_k_.layout();
  } else {
    return Status::Invalid("output: no " + which + " for " + to_string(d));
  }
  return Status::Ok();
}

Notes CudnnAttention::notes(Direction d) const {
  Notes n;
  std::string lay;
  switch (layout_) {
    case Layout::kDense: lay = "dense (B,H,S,D) tensors, BSHD memory order, no mask"; break;
    case Layout::kPadded:
      lay = "padded (B,H,S_max,D) BSHD tensors + padding mask from seq_len_q/seq_len_kv (S_max q=" +
            std::to_string(sq_) + ", kv=" + std::to_string(skv_) + ")";
      break;
    case Layout::kRagged:
      lay = "ragged THD: packed tensors, int64 ragged offsets (cu_seqlens*H*D) + padding mask from "
            "seq_len_q/seq_len_kv";
      break;
  }
  n.push_back({"layout", layout_name(layout_)});
  n.push_back({"layout_detail", lay});
  n.push_back({"io_dtype", fp8_ ? "float8_e4m3fn" : "bfloat16"});
  n.push_back({"softmax_scale", fmt_float(p_.softmax_scale)});
  switch (p_.causal) {
    case CausalMask::kNone: n.push_back({"causal", "false"}); break;
    case CausalMask::kTopLeft:
      n.push_back({"causal", "top_left: diagonal_alignment TOP_LEFT, diagonal_band_right_bound 0 (key j <= i)"});
      break;
    case CausalMask::kBottomRight:
      n.push_back({"causal", "bottom_right: diagonal_alignment BOTTOM_RIGHT, diagonal_band_right_bound 0 (key j <= "
                             "i + Lk - Lq, per sequence)"});
      break;
  }
  if (p_.broadcast_q)
    n.push_back({"broadcast_q", "materialized: the shared Q is repeated B times (cuDNN has no broadcast); dQ is per "
                                "copy, its batch sum is not timed"});
  if (d == Direction::kFwd) {
    n.push_back({"plan", fwd_plan_});
    n.push_back({"outputs", fp8_ ? "O float8_e4m3fn (BF16 output for FP8 SDPA needs Blackwell), LSE float32"
                                 : "O bfloat16, LSE float32"});
  } else {
    n.push_back({"plan", bwd_plan_});
    n.push_back({"outputs", fp8_ ? "dQ, dK, dV float8_e4m3fn (BF16 outputs for FP8 SDPA need Blackwell)"
                                 : "dQ, dK, dV bfloat16"});
    n.push_back({"includes", "the whole cuDNN backward graph execution (its dO.O preprocess and dQ postprocess)"});
  }
  if (fp8_ && !sets_.empty()) {
    const Set& st = sets_[0];
    n.push_back({"fp8_scaling",
                 "per-tensor: descale Q/K/V/dO = amax/448 of the data; S scale 448; O, dP, dQ, dK, dV scales "
                 "448/amax from calibration executions"});
    std::string v = "descale_q=" + fmt_float(st.host[slot(kDescaleQ)]) +
                    " descale_k=" + fmt_float(st.host[slot(kDescaleK)]) +
                    " descale_v=" + fmt_float(st.host[slot(kDescaleV)]) +
                    " scale_o=" + fmt_float(st.host[slot(kScaleO)]);
    if (d == Direction::kBwd)
      v += " descale_do=" + fmt_float(st.host[slot(kDescaleDO)]) + " scale_dp=" + fmt_float(st.host[slot(kScaleDP)]) +
           " scale_dq=" + fmt_float(st.host[slot(kScaleDQ)]) + " scale_dk=" + fmt_float(st.host[slot(kScaleDK)]) +
           " scale_dv=" + fmt_float(st.host[slot(kScaleDV)]);
    n.push_back({"fp8_scales_set0", v});
  }
  return n;
}

}  // namespace

std::unique_ptr<AttnImpl> make_cudnn_attention(const AttnProblem& p, bool fp8, std::string* why) {
  if (p.head_dim != 128) {
    *why = "head dim must be 128";
    return nullptr;
  }
  Layout l;
  if (p.cudnn_layout == "padded") {
    l = Layout::kPadded;
  } else if (p.cudnn_layout == "ragged") {
    l = Layout::kRagged;
  } else {
    l = p.uniform() ? Layout::kDense : (fp8 ? Layout::kPadded : Layout::kRagged);
  }
  return std::make_unique<CudnnAttention>(p, fp8, l);
}

int64_t cudnn_runtime_version() { return int64_t(cudnnGetVersion()); }
int64_t cudnn_compiled_version() { return int64_t(CUDNN_VERSION); }
std::string cudnn_frontend_version() {
  return std::to_string(CUDNN_FRONTEND_MAJOR_VERSION) + "." + std::to_string(CUDNN_FRONTEND_MINOR_VERSION) + "." +
         std::to_string(CUDNN_FRONTEND_PATCH_VERSION);
}

}  // namespace mxflash::bench
