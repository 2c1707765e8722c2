#include "bench_quantize.h"

#include <cstdio>
#include <string>

#include "bench_cuda.h"
#include "bench_env.h"
#include "mxflash/attention.h"
#include "mxflash/jagged.h"
#include "mxflash/quantize.h"

namespace mxflash::bench {
namespace {

struct Output {
  DeviceBuffer buf;
  TensorView view;
};

Status make_output(int ndim, const int64_t* shape, DType t, Output* o) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  MXFLASH_RETURN_IF_ERROR(o->buf.alloc(size_t(n) * size_t(dtype_size(t))));
  int dev = 0;
  cudaGetDevice(&dev);
  o->view = make_view(o->buf.get(), t, Device::kCUDA, ndim, shape, dev);
  return Status::Ok();
}

Status payload(const JaggedMeta& m, int64_t H, PayloadLayout l, Output* o) {
  int64_t s[3];
  payload_shape(m, H, l, s);
  return make_output(3, s, DType::kE4M3, o);
}

Status scales(const JaggedMeta& m, int64_t H, Orientation orient, ScaleLayout l, Output* o) {
  const ScaleShape s = scale_shape(m, H, orient, l);
  return make_output(s.ndim, s.dims, DType::kE8M0, o);
}

}  // namespace

Status run_quantize_case(const Options& opt, const Protocol& proto, int64_t l2_bytes, cudaStream_t stream,
                         CaseReport* out) {
  std::vector<int64_t> lengths;
  std::string err;
  if (!quantize_lengths(opt, &lengths, &err)) return Status::Invalid(err);
  const int64_t H = opt.quant_heads;
  JaggedMeta meta;
  MXFLASH_RETURN_IF_ERROR(JaggedMeta::FromLengths(lengths, &meta));
  MXFLASH_RETURN_IF_ERROR(meta.upload());
  const int64_t T = meta.total_tokens();

  out->name = "quantize";
  out->workload = "quantize";
  out->batch = int64_t(lengths.size());
  out->heads = H;
  out->head_dim = kHeadDim;
  out->lk_spec = opt.quant_lengths.to_string();
  out->seed = opt.quant_seed;
  out->lk = lengths;
  const bool blocked = opt.quant_scale_layout == "blocked";
  const bool contiguous = opt.quant_payload_layout == "token-contiguous";
  out->notes.push_back({"input", "x (T, H, 128) bfloat16, normal(0,1), T=" + std::to_string(T) +
                                     ", H=" + std::to_string(H) + ", " + std::to_string(T * H * kHeadDim * 2) +
                                     " bytes"});
  out->notes.push_back({"scale_layout", blocked ? "blocked128x4" : "plain"});
  out->notes.push_back({"seq_payload_layout", contiguous ? "token_contiguous (H,128,P)" : "token_major (T,H,128)"});
  out->notes.push_back({"mode", "rceil"});
  out->notes.push_back({"bytes_counted", "input bf16 read + every payload and scale tensor written (scale tensors "
                                         "at their full padded size)"});

  // Input: one set (1 GiB is far above 4x L2; input_sets_for() decides in general).
  const int64_t x_bytes = T * H * kHeadDim * 2;
  const int n_sets = input_sets_for(x_bytes, l2_bytes);
  std::vector<DeviceBuffer> xs(static_cast<size_t>(n_sets));
  std::vector<TensorView> xv(static_cast<size_t>(n_sets));
  int dev = 0;
  cudaGetDevice(&dev);
  {
    std::vector<int64_t> key(lengths.size());
    int64_t row = 0;
    for (size_t b = 0; b < lengths.size(); ++b) key[b] = row, row += lengths[b];
    SeqLayoutBuffer lay;
    MXFLASH_RETURN_IF_ERROR(lay.init(lengths, key, H * kHeadDim, 0));
    for (int i = 0; i < n_sets; ++i) {
      MXFLASH_RETURN_IF_ERROR(xs[size_t(i)].alloc(size_t(x_bytes)));
      MXFLASH_RETURN_IF_ERROR(
          fill_normal(xs[size_t(i)].get(), Elem::kBF16, 1.f, lay.layout(), opt.quant_seed, uint64_t(100 + i), stream));
      xv[size_t(i)] = make_view(xs[size_t(i)].get(), DType::kBFloat16, Device::kCUDA, {T, H, kHeadDim}, dev);
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
  }

  QuantizeOptions qo;
  qo.mode = ScalingMode::kRceil;
  qo.scale_layout = blocked ? ScaleLayout::kBlocked128x4 : ScaleLayout::kPlain;
  const PayloadLayout tok_layout = contiguous ? PayloadLayout::kTokenContiguous : PayloadLayout::kTokenMajor;

  for (const std::string& o : opt.quant_orients) {
    ImplResult r;
    r.impl = "mxfp8";
    r.direction = o;
    r.unit = "GB/s";
    r.n_sets = n_sets;
    r.set_bytes = x_bytes;
    Output p1, s1, p2, s2;
    Status st;
    LaunchFn launch;
    AttentionFwdOperands ops;
    DeviceBuffer fo[kAttentionFwdOperandCount];
    AttentionBwdOperands bops;
    DeviceBuffer bo[kAttentionBwdOperandCount];
    if (o == "bwd-operands") {
      // quantize_attention_backward with x as Q, K and V: five reads of x (Q and K twice), the ten
      // operand tensors written.
      size_t bytes[kAttentionBwdOperandCount];
      void* ptr[kAttentionBwdOperandCount];
      attention_bwd_operand_bytes(meta, meta, H, bytes);
      r.work = double(5 * x_bytes);
      for (int i = 0; i < kAttentionBwdOperandCount && st.ok(); ++i) {
        st = bo[i].alloc(bytes[i]);
        ptr[i] = bo[i].get();
        r.work += double(bytes[i]);
      }
      bops = attention_bwd_operand_views(meta, meta, H, ptr, Device::kCUDA, dev);
      launch = [&](int set) {
        return quantize_attention_backward(xv[size_t(set)], xv[size_t(set)], xv[size_t(set)], meta, meta, bops, stream);
      };
    } else if (o == "training-operands") {
      // quantize_attention_training with x as Q, K and V: three reads of x, the forward's six operand
      // tensors and the backward's other six (V rows, Qᵀ', Kᵀ' and their scales) written.
      size_t fb[kAttentionFwdOperandCount], bb[kAttentionBwdOperandCount];
      void *fp[kAttentionFwdOperandCount], *bp[kAttentionBwdOperandCount];
      attention_fwd_operand_bytes(meta, meta, H, fb);
      attention_bwd_operand_bytes(meta, meta, H, bb);
      r.work = double(3 * x_bytes);
      for (int i = 0; i < kAttentionFwdOperandCount && st.ok(); ++i) {
        st = fo[i].alloc(fb[i]);
        fp[i] = fo[i].get();
        r.work += double(fb[i]);
      }
      for (int i = 0; i < kAttentionBwdOperandCount && st.ok(); ++i) {
        const bool shared = i == 0 || i == 1 || i == 5 || i == 6;  // q, k, q_scale, k_scale: the forward's
        if (!shared) st = bo[i].alloc(bb[i]), r.work += double(bb[i]);
        bp[i] = shared ? nullptr : bo[i].get();
      }
      ops = attention_fwd_operand_views(meta, meta, H, fp, Device::kCUDA, dev);
      bops = attention_bwd_operand_views(meta, meta, H, bp, Device::kCUDA, dev);
      bops.q = ops.q, bops.q_scale = ops.q_scale, bops.k = ops.k, bops.k_scale = ops.k_scale;
      launch = [&](int set) {
        const TensorView& x = xv[size_t(set)];
        return quantize_attention_training(x, x, x, meta, meta, ops, bops, stream);
      };
    } else if (o == "fwd-operands") {
      // quantize_attention_forward with x as Q, K and V: three reads of x, the six operand tensors
      // written (Q, K, V payloads; Q row, K tile, V (tile, channel) scales in fp32).
      size_t bytes[kAttentionFwdOperandCount];
      void* ptr[kAttentionFwdOperandCount];
      attention_fwd_operand_bytes(meta, meta, H, bytes);
      r.work = double(3 * x_bytes);
      for (int i = 0; i < kAttentionFwdOperandCount && st.ok(); ++i) {
        st = fo[i].alloc(bytes[i]);
        ptr[i] = fo[i].get();
        r.work += double(bytes[i]);
      }
      ops = attention_fwd_operand_views(meta, meta, H, ptr, Device::kCUDA, dev);
      launch = [&](int set) {
        return quantize_attention_forward(xv[size_t(set)], xv[size_t(set)], xv[size_t(set)], meta, meta, ops, stream);
      };
    } else if (o == "hdim+seq") {
      st = payload(meta, H, PayloadLayout::kTokenMajor, &p1);
      if (st.ok()) st = scales(meta, H, Orientation::kHdim, qo.scale_layout, &s1);
      if (st.ok()) st = payload(meta, H, tok_layout, &p2);
      if (st.ok()) st = scales(meta, H, Orientation::kSeq, qo.scale_layout, &s2);
      QuantizeOptions q2 = qo;
      q2.payload_layout = tok_layout;
      launch = [&, q2](int set) {
        return quantize_hdim_seq(xv[size_t(set)], meta, q2, p1.view, s1.view, p2.view, s2.view, stream);
      };
      r.work = double(x_bytes + p1.view.nbytes() + s1.view.nbytes() + p2.view.nbytes() + s2.view.nbytes());
    } else {
      const Orientation orient =
          o == "hdim" ? Orientation::kHdim : (o == "seq" ? Orientation::kSeq : Orientation::kSquare32);
      QuantizeOptions q1 = qo;
      q1.payload_layout = orient == Orientation::kHdim ? PayloadLayout::kTokenMajor : tok_layout;
      st = payload(meta, H, q1.payload_layout, &p1);
      if (st.ok()) st = scales(meta, H, orient, qo.scale_layout, &s1);
      launch = [&, q1, orient](int set) {
        return quantize(xv[size_t(set)], meta, orient, q1, p1.view, s1.view, stream);
      };
      r.work = double(x_bytes + p1.view.nbytes() + s1.view.nbytes());
    }
    r.notes.push_back({"bytes_per_launch", std::to_string(int64_t(r.work))});
    if (st.ok()) st = launch(0);  // validates the call once before timing
    if (st.ok()) st = cuda_status(cudaStreamSynchronize(stream), "quantize");
    if (st.ok()) {
      std::fprintf(stderr, "[mxflash-bench] quantize %s mxfp8: warm-up %.1f s + window %.1f s\n", o.c_str(),
                   proto.warmup_s, proto.window_s);
      st = measure(launch, n_sets, proto, stream, "quantize " + o, &r);
    }
    if (!st.ok()) {
      r.status = st.code() == StatusCode::kUnsupported ? "unsupported" : "error";
      r.message = st.message();
      cudaGetLastError();
      std::fprintf(stderr, "[mxflash-bench] quantize %s mxfp8: %s: %s\n", o.c_str(), r.status.c_str(),
                   r.message.c_str());
    } else {
      r.notes.push_back({"sm_clock_mhz_end", std::to_string(nvml_sm_clock_mhz())});
      std::fprintf(stderr, "[mxflash-bench] quantize %s mxfp8: median %.4f ms, %.1f GB/s\n", o.c_str(),
                   r.stats.median, r.throughput());
    }
    out->results.push_back(r);
  }

  // Device-to-device copy of the same input size, same protocol: the bandwidth yardstick.
  ImplResult c;
  c.impl = "copy";
  c.direction = "copy";
  c.unit = "GB/s";
  c.n_sets = n_sets;
  c.set_bytes = x_bytes;
  c.work = 2.0 * double(x_bytes);
  c.notes.push_back({"what", "cudaMemcpyAsync device-to-device of the bf16 input; bytes = read + write"});
  DeviceBuffer dst;
  Status st = dst.alloc(size_t(x_bytes));
  LaunchFn copy = [&](int set) {
    return cuda_status(
        cudaMemcpyAsync(dst.get(), xs[size_t(set)].get(), size_t(x_bytes), cudaMemcpyDeviceToDevice, stream),
        "cudaMemcpyAsync");
  };
  if (st.ok()) {
    std::fprintf(stderr, "[mxflash-bench] quantize copy: warm-up %.1f s + window %.1f s\n", proto.warmup_s,
                 proto.window_s);
    st = measure(copy, n_sets, proto, stream, "copy", &c);
  }
  if (!st.ok()) {
    c.status = "error";
    c.message = st.message();
  } else {
    c.notes.push_back({"sm_clock_mhz_end", std::to_string(nvml_sm_clock_mhz())});
    std::fprintf(stderr, "[mxflash-bench] quantize copy: median %.4f ms, %.1f GB/s\n", c.stats.median, c.throughput());
  }
  out->results.push_back(c);
  return Status::Ok();
}

}  // namespace mxflash::bench
