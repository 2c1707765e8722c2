// mxflash-accuracy: SQNR / cosine of every attention method against the FP64 reference on the
// ARCHITECTURE.md §3 distribution suite. All the work is in mxflash::accuracy::run_cli; on a CUDA
// build with a GPU this front end adds the gpu column: the sm_90a forward on the same inputs,
// quantized by the library's quantizer (RCEIL, Q and K along hdim, V along seq), and the sm_90a
// backward on the GPU forward's out and lse (Q and K in both orientations, V along hdim, dout in
// bf16). With --gpu-exec the gpu column takes its operands in the execution layouts instead
// (quantize_attention_forward / quantize_attention_backward on the GPU, then attention_forward /
// attention_backward on the operands: what mxflash.autograd.mx_attention runs).
// --causal [top_left|bottom_right] (parsed by the suite, src/reference/accuracy_suite.cpp) runs every
// method, the FP64 reference and the gpu column with that mask: the gpu hooks take it from the inputs.
#include <algorithm>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "reference/accuracy_suite.h"

#ifdef MXFLASH_WITH_CUDA
#include <cuda_runtime.h>

#include "mxflash/attention.h"
#include "mxflash/quantize.h"

namespace {
using namespace mxflash;

// One device allocation, freed on scope exit.
struct DeviceBytes {
  void* p = nullptr;
  ~DeviceBytes() { cudaFree(p); }
  Status alloc(size_t n) {
    return cudaMalloc(&p, n ? n : 1) == cudaSuccess ? Status::Ok() : Status::Cuda("cudaMalloc failed");
  }
};

Status check(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::Ok() : Status::Cuda(std::string(what) + ": " + cudaGetErrorString(e));
}

// Quantizes `x` (host fp32) on the host and uploads payload and scales into a CUDA MxTensor.
Status upload_mx(const std::vector<float>& x, const JaggedMeta& m, int64_t H, Orientation o, DeviceBytes* payload,
                 DeviceBytes* scales, MxTensor* t) {
  int64_t ps[3];
  payload_shape(m, H, PayloadLayout::kTokenMajor, ps);
  const ScaleShape ss = scale_shape(m, H, o, ScaleLayout::kPlain);
  std::vector<uint8_t> hp(size_t(ps[0] * ps[1] * ps[2])), hs(size_t(ss.numel()));
  MXFLASH_RETURN_IF_ERROR(quantize(make_view(const_cast<float*>(x.data()), DType::kFloat32, Device::kCPU,
                                             {m.total_tokens(), H, kHeadDim}),
                                   m, o, QuantizeOptions{}, make_view(hp.data(), DType::kE4M3, Device::kCPU, 3, ps),
                                   make_view(hs.data(), DType::kE8M0, Device::kCPU, ss.ndim, ss.dims)));
  MXFLASH_RETURN_IF_ERROR(payload->alloc(hp.size()));
  MXFLASH_RETURN_IF_ERROR(scales->alloc(hs.size()));
  MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(payload->p, hp.data(), hp.size(), cudaMemcpyHostToDevice), "upload"));
  MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(scales->p, hs.data(), hs.size(), cudaMemcpyHostToDevice), "upload"));
  t->payload = make_view(payload->p, DType::kE4M3, Device::kCUDA, 3, ps);
  t->scales = make_view(scales->p, DType::kE8M0, Device::kCUDA, ss.ndim, ss.dims);
  t->orientation = o;
  return Status::Ok();
}

// Runs `fwd(options, out, lse)` into device outputs and brings out and lse back to the host.
template <typename Fwd>
Status run_forward(const accuracy::Inputs& in, const JaggedMeta& qm, const JaggedMeta& km, Fwd fwd,
                   std::vector<double>* out, std::vector<double>* lse) {
  const int64_t H = in.heads;
  const int64_t To = in.broadcast_q ? km.batch() * qm.total_tokens() : qm.total_tokens();
  DeviceBytes o, l;
  MXFLASH_RETURN_IF_ERROR(o.alloc(size_t(To * H * kHeadDim * 2)));
  MXFLASH_RETURN_IF_ERROR(l.alloc(size_t(To * H * 4)));
  AttentionOptions opt;
  opt.broadcast_q = in.broadcast_q;
  opt.softmax_scale = float(in.softmax_scale);
  opt.causal = in.causal;
  MXFLASH_RETURN_IF_ERROR(fwd(opt, make_view(o.p, DType::kBFloat16, Device::kCUDA, {To, H, kHeadDim}),
                              make_view(l.p, DType::kFloat32, Device::kCUDA, {H, To})));
  MXFLASH_RETURN_IF_ERROR(check(cudaDeviceSynchronize(), "attention_forward"));
  std::vector<uint16_t> ho(size_t(To * H * kHeadDim));
  std::vector<float> hl(size_t(To * H));
  MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(ho.data(), o.p, ho.size() * 2, cudaMemcpyDeviceToHost), "download"));
  MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(hl.data(), l.p, hl.size() * 4, cudaMemcpyDeviceToHost), "download"));
  out->assign(ho.size(), 0.0);
  for (size_t i = 0; i < ho.size(); ++i) (*out)[i] = bf16_to_float(ho[i]);
  lse->assign(hl.begin(), hl.end());
  return Status::Ok();
}

Status gpu_forward(const accuracy::Inputs& in, std::vector<double>* out, std::vector<double>* lse) {
  JaggedMeta qm = in.q_meta, km = in.k_meta;
  MXFLASH_RETURN_IF_ERROR(qm.upload());
  MXFLASH_RETURN_IF_ERROR(km.upload());
  const int64_t H = in.heads;
  DeviceBytes qp, qs, kp, ks, vp, vs;
  MxTensor q, k, v;
  MXFLASH_RETURN_IF_ERROR(upload_mx(in.q, qm, H, Orientation::kHdim, &qp, &qs, &q));
  MXFLASH_RETURN_IF_ERROR(upload_mx(in.k, km, H, Orientation::kHdim, &kp, &ks, &k));
  MXFLASH_RETURN_IF_ERROR(upload_mx(in.v, km, H, Orientation::kSeq, &vp, &vs, &v));
  return run_forward(in, qm, km, [&](const AttentionOptions& opt, TensorView o, TensorView l) {
    return attention_forward(q, k, v, qm, km, opt, o, l);
  }, out, lse);
}

// The fp32 inputs q, k, v on the device, with views.
Status upload_inputs(const accuracy::Inputs& in, DeviceBytes (&x)[3], TensorView (&xv)[3]) {
  const int64_t H = in.heads, Tq = in.q_meta.total_tokens(), Tk = in.k_meta.total_tokens();
  const std::vector<float>* src[3] = {&in.q, &in.k, &in.v};
  for (int i = 0; i < 3; ++i) {
    MXFLASH_RETURN_IF_ERROR(x[i].alloc(src[i]->size() * 4));
    MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(x[i].p, src[i]->data(), src[i]->size() * 4, cudaMemcpyHostToDevice), "upload"));
    xv[i] = make_view(x[i].p, DType::kFloat32, Device::kCUDA, {i == 0 ? Tq : Tk, H, kHeadDim});
  }
  return Status::Ok();
}

// --gpu-exec: the gpu column from operands in the execution layout: the fp32 inputs uploaded, then
// quantize_attention_forward and attention_forward on the GPU (what mx_attention runs).
Status gpu_forward_exec(const accuracy::Inputs& in, std::vector<double>* out, std::vector<double>* lse) {
  JaggedMeta qm = in.q_meta, km = in.k_meta;
  MXFLASH_RETURN_IF_ERROR(qm.upload());
  MXFLASH_RETURN_IF_ERROR(km.upload());
  const int64_t H = in.heads;
  DeviceBytes x[3], part[kAttentionFwdOperandCount];
  TensorView xv[3];
  MXFLASH_RETURN_IF_ERROR(upload_inputs(in, x, xv));
  size_t bytes[kAttentionFwdOperandCount];
  void* ptr[kAttentionFwdOperandCount];
  attention_fwd_operand_bytes(qm, km, H, bytes);
  for (int i = 0; i < kAttentionFwdOperandCount; ++i) {
    MXFLASH_RETURN_IF_ERROR(part[i].alloc(bytes[i]));
    ptr[i] = part[i].p;
  }
  const AttentionFwdOperands ops = attention_fwd_operand_views(qm, km, H, ptr, Device::kCUDA);
  MXFLASH_RETURN_IF_ERROR(quantize_attention_forward(xv[0], xv[1], xv[2], qm, km, ops));
  return run_forward(in, qm, km, [&](const AttentionOptions& opt, TensorView o, TensorView l) {
    return attention_forward(ops, qm, km, opt, o, l);
  }, out, lse);
}

std::vector<uint16_t> to_bf16(const std::vector<double>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = float_to_bf16(float(x[i]));
  return b;
}

// The backward on the device: out, dout (bf16) and lse uploaded, `launch(opt, out, dout, lse, dq, dk,
// dv)` on device views, the gradients downloaded.
template <typename Launch>
Status run_backward(const accuracy::Inputs& in, const JaggedMeta& qm, const JaggedMeta& km,
                    const std::vector<double>& out, const std::vector<double>& lse, Launch launch,
                    std::vector<double>* dq, std::vector<double>* dk, std::vector<double>* dv) {
  const int64_t H = in.heads, Tq = qm.total_tokens(), Tk = km.total_tokens();
  const int64_t To = in.broadcast_q ? km.batch() * Tq : Tq;
  DeviceBytes o, g, l, gq, gk, gv;
  const std::vector<uint16_t> ho = to_bf16(out);
  const std::vector<uint16_t> hg = to_bf16(std::vector<double>(in.dout.begin(), in.dout.end()));
  const std::vector<float> hl(lse.begin(), lse.end());
  MXFLASH_RETURN_IF_ERROR(o.alloc(ho.size() * 2));
  MXFLASH_RETURN_IF_ERROR(g.alloc(hg.size() * 2));
  MXFLASH_RETURN_IF_ERROR(l.alloc(hl.size() * 4));
  MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(o.p, ho.data(), ho.size() * 2, cudaMemcpyHostToDevice), "upload"));
  MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(g.p, hg.data(), hg.size() * 2, cudaMemcpyHostToDevice), "upload"));
  MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(l.p, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice), "upload"));
  MXFLASH_RETURN_IF_ERROR(gq.alloc(size_t(Tq * H * kHeadDim * 2)));
  MXFLASH_RETURN_IF_ERROR(gk.alloc(size_t(Tk * H * kHeadDim * 2)));
  MXFLASH_RETURN_IF_ERROR(gv.alloc(size_t(Tk * H * kHeadDim * 2)));
  AttentionBackwardOptions opt;
  opt.broadcast_q = in.broadcast_q;
  opt.softmax_scale = float(in.softmax_scale);
  opt.causal = in.causal;  // the forward's
  auto bf16 = [&](void* p, int64_t T) { return make_view(p, DType::kBFloat16, Device::kCUDA, {T, H, kHeadDim}); };
  MXFLASH_RETURN_IF_ERROR(launch(opt, bf16(o.p, To), bf16(g.p, To), make_view(l.p, DType::kFloat32, Device::kCUDA, {H, To}),
                                 bf16(gq.p, Tq), bf16(gk.p, Tk), bf16(gv.p, Tk)));
  MXFLASH_RETURN_IF_ERROR(check(cudaDeviceSynchronize(), "attention_backward"));
  for (auto [buf, dst, T] : {std::tuple{&gq, dq, Tq}, std::tuple{&gk, dk, Tk}, std::tuple{&gv, dv, Tk}}) {
    std::vector<uint16_t> h(size_t(T * H * kHeadDim));
    MXFLASH_RETURN_IF_ERROR(check(cudaMemcpy(h.data(), buf->p, h.size() * 2, cudaMemcpyDeviceToHost), "download"));
    dst->assign(h.size(), 0.0);
    for (size_t i = 0; i < h.size(); ++i) (*dst)[i] = bf16_to_float(h[i]);
  }
  return Status::Ok();
}

Status gpu_backward(const accuracy::Inputs& in, const std::vector<double>& out, const std::vector<double>& lse,
                    std::vector<double>* dq, std::vector<double>* dk, std::vector<double>* dv) {
  JaggedMeta qm = in.q_meta, km = in.k_meta;
  MXFLASH_RETURN_IF_ERROR(qm.upload());
  MXFLASH_RETURN_IF_ERROR(km.upload());
  DeviceBytes pay[5], sc[5];
  MxTensor ops[5];
  const struct {
    const std::vector<float>* x;
    const JaggedMeta* m;
    Orientation o;
  } srcs[5] = {{&in.q, &qm, Orientation::kHdim},
               {&in.q, &qm, Orientation::kSeq},
               {&in.k, &km, Orientation::kHdim},
               {&in.k, &km, Orientation::kSeq},
               {&in.v, &km, Orientation::kHdim}};
  for (int i = 0; i < 5; ++i)
    MXFLASH_RETURN_IF_ERROR(upload_mx(*srcs[i].x, *srcs[i].m, in.heads, srcs[i].o, &pay[i], &sc[i], &ops[i]));
  return run_backward(in, qm, km, out, lse, [&](const AttentionBackwardOptions& opt, TensorView o, TensorView g,
                                                 TensorView l, TensorView gq, TensorView gk, TensorView gv) {
    return attention_backward(ops[0], ops[1], ops[2], ops[3], ops[4], o, g, l, qm, km, opt, gq, gk, gv);
  }, dq, dk, dv);
}

// --gpu-exec: the backward on operands in its execution layout (quantize_attention_backward on the
// GPU from the fp32 inputs, then attention_backward on them: what mx_attention runs).
Status gpu_backward_exec(const accuracy::Inputs& in, const std::vector<double>& out, const std::vector<double>& lse,
                         std::vector<double>* dq, std::vector<double>* dk, std::vector<double>* dv) {
  JaggedMeta qm = in.q_meta, km = in.k_meta;
  MXFLASH_RETURN_IF_ERROR(qm.upload());
  MXFLASH_RETURN_IF_ERROR(km.upload());
  DeviceBytes x[3], part[kAttentionBwdOperandCount];
  TensorView xv[3];
  MXFLASH_RETURN_IF_ERROR(upload_inputs(in, x, xv));
  size_t bytes[kAttentionBwdOperandCount];
  void* ptr[kAttentionBwdOperandCount];
  attention_bwd_operand_bytes(qm, km, in.heads, bytes);
  for (int i = 0; i < kAttentionBwdOperandCount; ++i) {
    MXFLASH_RETURN_IF_ERROR(part[i].alloc(bytes[i]));
    ptr[i] = part[i].p;
  }
  const AttentionBwdOperands ops = attention_bwd_operand_views(qm, km, in.heads, ptr, Device::kCUDA);
  MXFLASH_RETURN_IF_ERROR(quantize_attention_backward(xv[0], xv[1], xv[2], qm, km, ops));
  return run_backward(in, qm, km, out, lse, [&](const AttentionBackwardOptions& opt, TensorView o, TensorView g,
                                                 TensorView l, TensorView gq, TensorView gk, TensorView gv) {
    return attention_backward(ops, o, g, l, qm, km, opt, gq, gk, gv);
  }, dq, dk, dv);
}

bool hopper_present() {
  int n = 0;
  cudaDeviceProp p;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && cudaGetDeviceProperties(&p, 0) == cudaSuccess &&
                  p.major == 9;
  cudaGetLastError();
  return ok;
}
}  // namespace
#endif

int main(int argc, char** argv) {
  mxflash::accuracy::GpuForward gpu;
  mxflash::accuracy::GpuBackward gpu_bwd;
  std::vector<std::string> args(argv + 1, argv + argc);
  // --gpu-exec (this front end's flag): the gpu column runs on execution-layout operands.
  const auto exec_flag = std::find(args.begin(), args.end(), "--gpu-exec");
  const bool exec = exec_flag != args.end();
  if (exec) args.erase(exec_flag);
#ifdef MXFLASH_WITH_CUDA
  if (hopper_present()) {
    gpu = exec ? gpu_forward_exec : gpu_forward;
    gpu_bwd = exec ? gpu_backward_exec : gpu_backward;
  }
#endif
  return mxflash::accuracy::run_cli(args, std::cout, std::cerr, gpu, gpu_bwd);
}
