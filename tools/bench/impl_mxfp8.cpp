// "Ours" in mxflash-bench: the MXFP8 attention forward and backward through the public API. Inputs
// are filled with the same generator rows as the cuDNN peers (tensor ids set*16 + 1..4), quantized
// with the library's quantizer outside timing (forward: Q, K along hdim, V along seq; backward: Q, K
// in both orientations, V along hdim). A timed forward is one mxflash::attention_forward call, its
// prepare pass included, on a preallocated workspace; a timed backward is one
// mxflash::attention_backward call on the forward's O and LSE on a preallocated workspace, its
// preprocess (operand scale re-expression, dO quantization, D = rowsum(O∘dO)) included.
// "mxfp8-exec": the same, but both directions take their operands in the execution layout, written
// from the bf16 inputs by quantize_attention_forward and quantize_attention_backward outside timing
// (as the MX quantization is): no prepare passes; the backward's preprocess of dO is timed.
#include <numeric>

#include "bench_impl.h"
#include "mxflash/attention.h"
#include "mxflash/quantize.h"

namespace mxflash::bench {
namespace {

std::vector<int64_t> prefix_rows(const std::vector<int64_t>& len) {
  std::vector<int64_t> p(len.size() + 1, 0);
  std::partial_sum(len.begin(), len.end(), p.begin() + 1);
  return p;
}

class Mxfp8Attention final : public AttnImpl {
 public:
  Mxfp8Attention(const AttnProblem& p, bool exec) : p_(p), exec_(exec) {}
  std::string name() const override { return exec_ ? "mxfp8-exec" : "mxfp8"; }

  int64_t input_set_bytes(Direction d) const override {
    // e4m3 payloads + scales of Q, K, V (the bytes one launch reads); the backward reads Q and K
    // twice (both orientations) and O, dO in bf16
    const int64_t mx = (q_meta_.total_tokens() + 2 * k_meta_.total_tokens()) * p_.heads * (kHeadDim + 4);
    if (d == Direction::kFwd) return mx;
    return 2 * mx - k_meta_.total_tokens() * p_.heads * (kHeadDim + 4) + 2 * out_tokens() * p_.heads * kHeadDim * 2;
  }

  Status init() {
    std::vector<int64_t> lq = p_.broadcast_q ? std::vector<int64_t>{p_.lq.front()} : p_.lq;
    MXFLASH_RETURN_IF_ERROR(JaggedMeta::FromLengths(lq, &q_meta_));
    MXFLASH_RETURN_IF_ERROR(JaggedMeta::FromLengths(p_.lk, &k_meta_));
    MXFLASH_RETURN_IF_ERROR(q_meta_.upload());
    MXFLASH_RETURN_IF_ERROR(k_meta_.upload());
    opt_.broadcast_q = p_.broadcast_q;
    opt_.softmax_scale = p_.softmax_scale;
    opt_.causal = p_.causal;
    return Status::Ok();
  }

  Status prepare(int n_sets, cudaStream_t s) override {
    const int64_t H = p_.heads, Tq = q_meta_.total_tokens(), Tk = k_meta_.total_tokens();
    const int64_t To = p_.broadcast_q ? int64_t(p_.batch) * Tq : Tq;
    const std::vector<int64_t> cu_q = prefix_rows(lengths(q_meta_));
    const std::vector<int64_t> cu_k = prefix_rows(p_.lk);
    MXFLASH_RETURN_IF_ERROR(lay_q_.init(lengths(q_meta_), std::vector<int64_t>(cu_q.begin(), cu_q.end() - 1),
                                        H * kHeadDim, 0));
    MXFLASH_RETURN_IF_ERROR(lay_k_.init(p_.lk, std::vector<int64_t>(cu_k.begin(), cu_k.end() - 1), H * kHeadDim, 0));
    const std::vector<int64_t> cu_o = prefix_rows(p_.lq);
    MXFLASH_RETURN_IF_ERROR(lay_o_.init(p_.lq, std::vector<int64_t>(cu_o.begin(), cu_o.end() - 1), H * kHeadDim, 0));
    MXFLASH_RETURN_IF_ERROR(ws_.alloc(exec_ ? attention_forward_operands_workspace_size(q_meta_, k_meta_, H, opt_)
                                            : attention_forward_workspace_size(q_meta_, k_meta_, H, opt_)));
    DeviceBuffer xq, xk;
    MXFLASH_RETURN_IF_ERROR(xq.alloc(size_t(Tq * H * kHeadDim * 2)));
    MXFLASH_RETURN_IF_ERROR(xk.alloc(size_t(Tk * H * kHeadDim * 2)));
    sets_.clear();
    sets_.resize(size_t(n_sets));
    for (int i = 0; i < n_sets; ++i) {
      Set& st = sets_[size_t(i)];
      const uint64_t t0 = uint64_t(i) * 16;
      // Each input drawn once (generator tensor ids 1..3, as the peers), quantized in the forward's
      // orientation and, for the backward, in the other one.
      const bool bwd = p_.need_bwd && !exec_;  // MX tensors in the backward's orientations
      const struct {
        DeviceBuffer* x;
        const SeqLayout* l;
        const JaggedMeta* m;
        Orientation fwd_o, bwd_o;
        Mx *fwd, *bwd;
      } inputs[] = {{&xq, &lay_q_.layout(), &q_meta_, Orientation::kHdim, Orientation::kSeq, &st.q, &st.q_seq},
                    {&xk, &lay_k_.layout(), &k_meta_, Orientation::kHdim, Orientation::kSeq, &st.k, &st.k_seq},
                    {&xk, &lay_k_.layout(), &k_meta_, Orientation::kSeq, Orientation::kHdim, &st.v, &st.v_hdim}};
      DeviceBuffer xv;
      if (exec_) MXFLASH_RETURN_IF_ERROR(xv.alloc(size_t(Tk * H * kHeadDim * 2)));
      for (size_t n = 0; n < 3; ++n) {
        const auto& in = inputs[n];
        MXFLASH_RETURN_IF_ERROR(fill_normal(in.x->get(), Elem::kBF16, 1.f, *in.l, p_.seed, t0 + 1 + n, s));
        MXFLASH_RETURN_IF_ERROR(quantize_into(*in.x, *in.m, in.fwd_o, in.fwd, s));
        if (bwd) MXFLASH_RETURN_IF_ERROR(quantize_into(*in.x, *in.m, in.bwd_o, in.bwd, s));
        if (exec_ && n == 1)  // K's input is reused for V: keep it
          MXFLASH_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(xv.get(), xk.get(), xv.bytes(), cudaMemcpyDeviceToDevice, s),
                                              "copy K input"));
      }
      if (exec_) MXFLASH_RETURN_IF_ERROR(operands_into(xq, xv, xk, &st.ops, s));
      if (exec_ && p_.need_bwd) MXFLASH_RETURN_IF_ERROR(bwd_operands_into(xq, xv, xk, &st.bops, s));
      MXFLASH_RETURN_IF_ERROR(st.out.alloc(size_t(To * H * kHeadDim * 2)));
      MXFLASH_RETURN_IF_ERROR(st.lse.alloc(size_t(To * H * 4)));
      if (!p_.need_bwd) continue;
      // dO from the peers' generator rows (tensor 4); O and LSE from our forward.
      MXFLASH_RETURN_IF_ERROR(st.dout.alloc(size_t(To * H * kHeadDim * 2)));
      MXFLASH_RETURN_IF_ERROR(fill_normal(st.dout.get(), Elem::kBF16, 1.f, lay_o_.layout(), p_.seed, t0 + 4, s));
      MXFLASH_RETURN_IF_ERROR(run(Direction::kFwd, i, s));
    }
    if (p_.need_bwd) {
      AttentionBackwardOptions bo;
      bo.broadcast_q = p_.broadcast_q;
      bo.causal = p_.causal;
      MXFLASH_RETURN_IF_ERROR(ws_bwd_.alloc(exec_ ? attention_backward_operands_workspace_size(q_meta_, k_meta_, H, bo)
                                                  : attention_backward_workspace_size(q_meta_, k_meta_, H, bo)));
      MXFLASH_RETURN_IF_ERROR(dq_.alloc(size_t(Tq * H * kHeadDim * 2)));
      MXFLASH_RETURN_IF_ERROR(dk_.alloc(size_t(Tk * H * kHeadDim * 2)));
      MXFLASH_RETURN_IF_ERROR(dv_.alloc(size_t(Tk * H * kHeadDim * 2)));
    }
    return cuda_status(cudaStreamSynchronize(s), "quantize inputs");
  }

  int64_t out_tokens() const {
    return p_.broadcast_q ? int64_t(p_.batch) * q_meta_.total_tokens() : q_meta_.total_tokens();
  }

  Status run(Direction d, int set, cudaStream_t s) override {
    Set& st = sets_[size_t(set)];
    const int64_t H = p_.heads, To = out_tokens(), Tq = q_meta_.total_tokens(), Tk = k_meta_.total_tokens();
    auto bf16 = [&](const DeviceBuffer& b, int64_t T) {
      return make_view(b.get(), DType::kBFloat16, Device::kCUDA, {T, H, kHeadDim});
    };
    const TensorView lse = make_view(st.lse.get(), DType::kFloat32, Device::kCUDA, {H, To});
    if (d == Direction::kFwd && exec_)
      return attention_forward(st.ops.view, q_meta_, k_meta_, opt_, bf16(st.out, To), lse, ws_.get(), ws_.bytes(), s);
    if (d == Direction::kFwd)
      return attention_forward(st.q.view, st.k.view, st.v.view, q_meta_, k_meta_, opt_, bf16(st.out, To), lse,
                               ws_.get(), ws_.bytes(), s);
    AttentionBackwardOptions bo;
    bo.broadcast_q = p_.broadcast_q;
    bo.softmax_scale = p_.softmax_scale;
    bo.causal = p_.causal;  // the forward's mask
    if (exec_)
      return attention_backward(st.bops.view, bf16(st.out, To), bf16(st.dout, To), lse, q_meta_, k_meta_, bo,
                                bf16(dq_, Tq), bf16(dk_, Tk), bf16(dv_, Tk), {}, {}, ws_bwd_.get(), ws_bwd_.bytes(), s);
    return attention_backward(st.q.view, st.q_seq.view, st.k.view, st.k_seq.view, st.v_hdim.view, bf16(st.out, To),
                              bf16(st.dout, To), lse, q_meta_, k_meta_, bo, bf16(dq_, Tq), bf16(dk_, Tk), bf16(dv_, Tk),
                              {}, {}, ws_bwd_.get(), ws_bwd_.bytes(), s);
  }

  Status output(Direction d, const std::string& which, OutputView* out) override {
    out->elem = Elem::kBF16;
    out->scale = 1.f;
    if (d == Direction::kFwd && which == "O") {
      out->data = sets_.at(0).out.get();
      out->layout = &lay_o_.layout();
      return Status::Ok();
    }
    if (d == Direction::kBwd && which == "dQ" && p_.broadcast_q)
      return Status::Unsupported("mxfp8: dQ of the shared Q is summed over the batch (the peers keep one per copy)");
    if (d == Direction::kBwd && (which == "dQ" || which == "dK" || which == "dV")) {
      out->data = which == "dQ" ? dq_.get() : which == "dK" ? dk_.get() : dv_.get();
      out->layout = which == "dQ" ? &lay_q_.layout() : &lay_k_.layout();
      return Status::Ok();
    }
    return Status::Invalid("output: no " + which + " for " + to_string(d));
  }

  Notes notes(Direction d) const override {
    Notes n;
    n.push_back({"layout", "packed jagged (T, H, 128), no padding"});
    n.push_back({"operands", "Q, K MX along hdim, V MX along seq (RCEIL, plain scales), quantized outside timing"});
    if (exec_) {
      if (d == Direction::kFwd)
        n.push_back({"forward operands", "execution layout from quantize_attention_forward (Q per row, K and V per "
                                         "128-key tile), written outside timing"});
      else
        n.push_back({"backward operands", "execution layout from quantize_attention_backward (Q per row, K, V per "
                                          "128-key tile, Q and K along tokens per 128-token tile), written outside "
                                          "timing"});
      n.push_back({"kernel", "sm90 FP8 wgmma, no prepare pass"});
    } else {
      n.push_back({"kernel", "sm90 FP8 wgmma, prepare pass (scale re-expression) included in the timing"});
    }
    if (d == Direction::kBwd)
      n.push_back({"backward", exec_ ? "dK/dV kernel + dQ kernel (S, dP recomputed in each), no atomics; preprocess "
                                       "of dO included in the timing"
                                     : "dK/dV kernel + dQ kernel (S, dP recomputed in each), no atomics; preprocess "
                                       "of dO and the operands included in the timing"});
    if (p_.broadcast_q) n.push_back({"broadcast_q", "one shared Q sequence read in place (no copies)"});
    n.push_back({"causal", p_.causal == CausalMask::kNone
                               ? std::string("false")
                               : std::string(p_.causal == CausalMask::kTopLeft ? "top_left" : "bottom_right") +
                                     " (AttentionOptions::causal / AttentionBackwardOptions::causal)"});
    return n;
  }

 private:
  struct Mx {
    DeviceBuffer payload, scales;
    MxTensor view;
  };
  struct Ops {
    DeviceBuffer parts[kAttentionFwdOperandCount];
    AttentionFwdOperands view;
  };
  struct BwdOps {
    DeviceBuffer parts[kAttentionBwdOperandCount];
    AttentionBwdOperands view;
  };
  struct Set {
    Mx q, k, v;
    Ops ops;      // mxfp8-exec's forward operands
    BwdOps bops;  // mxfp8-exec's backward operands
    Mx q_seq, k_seq, v_hdim;  // backward operands
    DeviceBuffer out, lse, dout;
  };

  static std::vector<int64_t> lengths(const JaggedMeta& m) {
    std::vector<int64_t> l(size_t(m.batch()));
    for (int b = 0; b < m.batch(); ++b) l[size_t(b)] = m.length(b);
    return l;
  }

  Status quantize_into(const DeviceBuffer& x, const JaggedMeta& m, Orientation o, Mx* dst, cudaStream_t s) {
    const int64_t H = p_.heads;
    int64_t ps[3];
    payload_shape(m, H, PayloadLayout::kTokenMajor, ps);
    const ScaleShape ss = scale_shape(m, H, o, ScaleLayout::kPlain);
    MXFLASH_RETURN_IF_ERROR(dst->payload.alloc(size_t(ps[0] * ps[1] * ps[2])));
    MXFLASH_RETURN_IF_ERROR(dst->scales.alloc(size_t(ss.numel())));
    dst->view.payload = make_view(dst->payload.get(), DType::kE4M3, Device::kCUDA, 3, ps);
    dst->view.scales = make_view(dst->scales.get(), DType::kE8M0, Device::kCUDA, ss.ndim, ss.dims);
    dst->view.orientation = o;
    return quantize(make_view(x.get(), DType::kBFloat16, Device::kCUDA, {m.total_tokens(), H, kHeadDim}), m, o,
                    QuantizeOptions{}, dst->view.payload, dst->view.scales, s);
  }

  // The forward operands of bf16 inputs xq (Q) and xk, xv (K, V) in the execution layout.
  Status operands_into(const DeviceBuffer& xq, const DeviceBuffer& xk, const DeviceBuffer& xv, Ops* o, cudaStream_t s) {
    const int64_t H = p_.heads;
    size_t bytes[kAttentionFwdOperandCount];
    void* ptr[kAttentionFwdOperandCount];
    attention_fwd_operand_bytes(q_meta_, k_meta_, H, bytes);
    for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
      MXFLASH_RETURN_IF_ERROR(o->parts[i].alloc(std::max<size_t>(bytes[i], 16)));
      ptr[i] = o->parts[i].get();
    }
    o->view = attention_fwd_operand_views(q_meta_, k_meta_, H, ptr, Device::kCUDA);
    auto x = [&](const DeviceBuffer& b, const JaggedMeta& m) {
      return make_view(b.get(), DType::kBFloat16, Device::kCUDA, {m.total_tokens(), H, kHeadDim});
    };
    return quantize_attention_forward(x(xq, q_meta_), x(xk, k_meta_), x(xv, k_meta_), q_meta_, k_meta_, o->view, s);
  }

  // The backward operands of the same inputs.
  Status bwd_operands_into(const DeviceBuffer& xq, const DeviceBuffer& xk, const DeviceBuffer& xv, BwdOps* o,
                           cudaStream_t s) {
    const int64_t H = p_.heads;
    size_t bytes[kAttentionBwdOperandCount];
    void* ptr[kAttentionBwdOperandCount];
    attention_bwd_operand_bytes(q_meta_, k_meta_, H, bytes);
    for (int i = 0; i < kAttentionBwdOperandCount; ++i) {
      MXFLASH_RETURN_IF_ERROR(o->parts[i].alloc(std::max<size_t>(bytes[i], 16)));
      ptr[i] = o->parts[i].get();
    }
    o->view = attention_bwd_operand_views(q_meta_, k_meta_, H, ptr, Device::kCUDA);
    auto x = [&](const DeviceBuffer& b, const JaggedMeta& m) {
      return make_view(b.get(), DType::kBFloat16, Device::kCUDA, {m.total_tokens(), H, kHeadDim});
    };
    return quantize_attention_backward(x(xq, q_meta_), x(xk, k_meta_), x(xv, k_meta_), q_meta_, k_meta_, o->view, s);
  }

  AttnProblem p_;
  bool exec_ = false;
  JaggedMeta q_meta_, k_meta_;
  AttentionOptions opt_;
  SeqLayoutBuffer lay_q_, lay_k_, lay_o_;
  DeviceBuffer ws_;
  DeviceBuffer ws_bwd_, dq_, dk_, dv_;  // backward workspace and outputs (shared by the sets)
  std::vector<Set> sets_;
};

}  // namespace

std::unique_ptr<AttnImpl> make_mxfp8_attention(const AttnProblem& p, bool exec, std::string* why) {
  if (p.head_dim != kHeadDim) {
    *why = "mxfp8 supports head dim 128 only";
    return nullptr;
  }
  auto impl = std::make_unique<Mxfp8Attention>(p, exec);
  const Status st = impl->init();
  if (!st.ok()) {
    *why = st.message();
    return nullptr;
  }
  return impl;
}

}  // namespace mxflash::bench
