"""The jagged cross-attention module in MXFP8, and its BF16 twin, for torch training loops.

    from mxflash.module import JaggedCrossAttention
    layer = JaggedCrossAttention(model_dim=384, heads=3, num_queries=512).cuda()
    meta = mxflash.JaggedMeta.from_lengths(lengths)       # B user histories, packed
    y = layer(x, meta)                                     # x (T, 384) -> y (B, 512, 384)

What it computes (ARCHITECTURE.md section 6): the B jagged sequences of x (user-history tokens,
packed (T, model_dim)) are attended by one shared set of learned seed queries:

    xn = rmsnorm(x) * norm_weight                       (T, C)
    k, v = xn @ wk.T, xn @ wv.T                          (T, H, 128) each
    q = seeds @ wq.T                                     (num_queries, H, 128), once for the batch
    o_b = softmax(q k_b^T / sqrt(128)) v_b               for every sequence b: (B * num_queries, H, 128)
    y = o @ wo.T                                         (B, num_queries, C)

The attention is non-causal: every seed query attends every token of its sequence (the seeds are
not positions in the history, so no causal mask applies; the layer takes no causal option, while
the lower-level mxflash.attention_* functions and mxflash.autograd.mx_attention do).
Sequences of length 0 give o = 0 (and y = 0). Parameters: seeds (num_queries, C), norm_weight (C),
wq, wk, wv (H * 128, C), wo (C, H * 128); float32 (master weights) or bfloat16.

The MXFP8 path (JaggedCrossAttention) on CUDA tensors:
- rmsnorm + quantize in one pass (mxflash.rmsnorm_quantize: xn never exists in BF16);
- the K and V projections by mxflash.gemm_quantize (FP8 wgmma on the MX operands; wk and wv are
  quantized along C each step by mxflash.quantize, with no host synchronization), written as MX
  along the head dim;
- q is projected once (a 512-row BF16 GEMM) and broadcast to every sequence without a gather; the
  attention forward and backward are the MXFP8 kernels on execution-layout operands, which the
  training step writes from the GEMMs' MX K and V directly (mxflash.quantize_attention_training on
  MX tensors: K and V never exist in BF16; inference widens them to bf16 for the forward-only
  quantizer); the graph keeps those FP8 operands (as mxflash.autograd.mx_attention does), not k, v;
- the output projection and the backward's projection GEMMs in BF16 (torch);
- the RMSNorm backward as one fused kernel (mxflash.rmsnorm_backward).
Gradients pass the quantizers unchanged (straight-through): dW of a projection is taken against the
quantized activation the forward multiplied, dx through the quantized weights.

JaggedCrossAttentionBf16 is the twin the speed-ups are measured against: the same parameters (load
one's state_dict into the other), eager torch in BF16 (F.rms_norm, F.linear, and
scaled_dot_product_attention on a padded (B, H, L, 128) batch, the seeds expanded, not copied).
reference_forward runs the module's math in any dtype (float64 for the accuracy reports), one
sequence at a time.
"""
import math

import mxflash
from mxflash.autograd import _opaque_to_torch_compile

E4M3_MAX = 448.0


def _torch():
    import torch

    return torch


def quantize_rows(w, name="w"):
    """MX quantization of a 2-D torch tensor along its rows' last dim, in blocks of 32, RCEIL (the
    rule of mxflash.quantize, REFERENCE.md section 2), in torch: (payload float8_e4m3fn, scales
    uint8 (rows, K // 32)). A readable statement of the rule for finite tensors (it raises on inf or
    NaN, a host synchronization); the module quantizes its weights with mxflash.quantize."""
    torch = _torch()
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(f"{name}: must be 2-D with a multiple of 32 columns, got shape {tuple(w.shape)}")
    w = w.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: holds inf or NaN")
    rows, cols = w.shape
    blk = w.reshape(rows, cols // 32, 32)
    ratio = blk.abs().amax(-1) / E4M3_MAX  # fp32, as the rule says
    bits = ratio.view(torch.int32)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = torch.ldexp(torch.ones_like(ratio), (byte - 127).clamp_min(-126))  # clamped for the division
    payload = (blk / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return payload.reshape(rows, cols), byte.to(torch.uint8)


_weight_metas = {}


def _quantize_weight(w):
    """A weight (R, C) MX-quantized along C, RCEIL: the library's quantizer (one kernel on CUDA, and
    no host synchronization: a weight holding inf or NaN gets NaN blocks, so the outputs turn NaN,
    as torch's own layers would), C padded with zeros to a multiple of 128 where it is not one (the
    32-blocks of the real columns are unchanged). Returns (payload (R, C), scales (R, C // 32))."""
    torch = _torch()
    rows, cols = w.shape
    x = w.detach()
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    wide = -(-cols // 128) * 128
    x = torch.nn.functional.pad(x, (0, wide - cols)) if wide != cols else x.contiguous()
    meta = _weight_metas.get(rows)
    if meta is None:
        meta = _weight_metas[rows] = mxflash.JaggedMeta.from_lengths([rows])
    p, s = mxflash.quantize(x.view(rows, wide // 128, 128), meta, "hdim")
    p, s = p.view(rows, wide), s.view(rows, wide // 32)
    if wide != cols:
        p, s = p[:, :cols].contiguous(), s[:, :cols // 32].contiguous()
    return p, s


def dequantize_rows(payload, scales, dtype):
    """payload (R, C) e4m3 x 2^(scales (R, C // 32) - 127), in dtype (exact in bfloat16 and float32)."""
    torch = _torch()
    rows, cols = payload.shape
    p = payload.view(torch.float8_e4m3fn).float().reshape(rows, cols // 32, 32)
    return torch.ldexp(p, scales.to(torch.int32)[..., None] - 127).reshape(rows, cols).to(dtype)


def _widen(payload, scales, meta, heads):
    """An MX GEMM output (T, H * 128) with scales (T, H * 4) as bf16 (T, H, 128): one kernel."""
    t = payload.shape[0]
    return mxflash.dequantize(payload.view(t, heads, 128), scales.view(t, heads, 4), meta, "hdim",
                              out_dtype="bfloat16")


def _activation_bf16(payload, scales, meta):
    """The quantized activation (T, C) as bf16 (exact)."""
    t, c = payload.shape
    if c % 128 == 0:
        return _widen(payload, scales, meta, c // 128).view(t, c)
    return dequantize_rows(payload, scales, _torch().bfloat16)


def _norm_kv_grads(needs, saved, dtypes, meta, dk, dv):
    """The backward of x -> (k, v) (RMSNorm+Quantize, then the two projections): BF16 GEMMs against
    the quantized activation and weights (straight-through), then the fused RMSNorm backward.
    needs: which of (x, norm_weight, wk, wv) need a gradient. Returns (dx, dg, dwk, dwv)."""
    torch = _torch()
    xq, g, rstd, xn_p, xn_s, wk_p, wk_s, wv_p, wv_s = saved
    t = xq.shape[0]
    bf16 = torch.bfloat16
    dk = dk.reshape(t, wk_p.shape[0]).to(bf16)
    dv = dv.reshape(t, wv_p.shape[0]).to(bf16)
    dx = dg = dwk = dwv = None
    if needs[2] or needs[3]:
        xn = _activation_bf16(xn_p, xn_s, meta)
        dwk = (dk.t() @ xn).to(dtypes[2]) if needs[2] else None
        dwv = (dv.t() @ xn).to(dtypes[3]) if needs[3] else None
        del xn
    if needs[0] or needs[1]:
        dxn = dk @ dequantize_rows(wk_p, wk_s, bf16)
        dxn.addmm_(dv, dequantize_rows(wv_p, wv_s, bf16))
        dx, dg = mxflash.rmsnorm_backward(xq, g, rstd, dxn.to(xq.dtype))
        dx = dx.to(dtypes[0]) if needs[0] else None
        dg = dg.to(dtypes[1]) if needs[1] else None
    return dx, dg, dwk, dwv


def _make_functions():
    torch = _torch()

    class NormKV(torch.autograd.Function):
        """x -> MX k, v: RMSNorm+Quantize, then the K and V GEMM+Quantize projections. The MX tensors
        are not differentiable; the gradient reaches this function through `link`, a (2, T, H * 128)
        bf16 zero that takes no memory (an expanded scalar), whose gradient is (dk, dv): the
        attention function's backward returns it, so that autograd frees the attention's saved
        operands before this backward runs (one function holding both kept ~4 GB more at the peak)."""

        @staticmethod
        def forward(ctx, x, norm_weight, wk, wv, meta, eps, heads):
            xq = x.detach()
            if xq.dtype not in (torch.bfloat16, torch.float32):
                xq = xq.float()
            xq = xq.contiguous()
            g = norm_weight.detach().float().contiguous()
            xn_p, xn_s, rstd = mxflash.rmsnorm_quantize(xq, g, eps=eps)
            wk_p, wk_s = _quantize_weight(wk)
            wv_p, wv_s = _quantize_weight(wv)
            k_p, k_s = mxflash.gemm_quantize(xn_p, xn_s, wk_p, wk_s)
            v_p, v_s = mxflash.gemm_quantize(xn_p, xn_s, wv_p, wv_s)
            ctx.save_for_backward(xq, g, rstd, xn_p, xn_s, wk_p, wk_s, wv_p, wv_s)
            ctx.meta, ctx.dtypes = meta, (x.dtype, norm_weight.dtype, wk.dtype, wv.dtype)
            link = torch.zeros((), dtype=torch.bfloat16, device=xq.device).expand(2, xq.shape[0], wk.shape[0])
            ctx.mark_non_differentiable(k_p, k_s, v_p, v_s)
            return link, k_p, k_s, v_p, v_s

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dlink, *_):
            return (*_norm_kv_grads(ctx.needs_input_grad[:4], ctx.saved_tensors, ctx.dtypes, ctx.meta, dlink[0],
                                    dlink[1]), None, None, None)

    class Attention(torch.autograd.Function):
        """(q, link; MX k, v) -> o: the MXFP8 attention of the one Q sequence over every K/V sequence.
        In training, K and V go from the GEMMs' MX outputs straight into the attention's operands
        (quantize_attention_training on MX tensors: no bf16 K or V), and the graph keeps those FP8
        operands, out and the LSE."""

        @staticmethod
        def forward(ctx, q, link, k_p, k_s, v_p, v_s, meta, q_meta, heads, training):
            t = k_p.shape[0]
            qb = q.detach().to(torch.bfloat16).contiguous()
            if training:
                kmx = mxflash.MxTensor(k_p.view(t, heads, 128), k_s.view(t, heads, 4), "hdim")
                vmx = mxflash.MxTensor(v_p.view(t, heads, 128), v_s.view(t, heads, 4), "hdim")
                ops, bwd_ops = mxflash.quantize_attention_training(qb, kmx, vmx, q_meta, meta)
            else:
                kb, vb = _widen(k_p, k_s, meta, heads), _widen(v_p, v_s, meta, heads)
                ops, bwd_ops = mxflash.quantize_attention_forward(qb, kb, vb, q_meta, meta), None
            out, lse = mxflash.attention_forward_operands(ops, q_meta, meta, broadcast_q=True, causal=False)
            del ops
            if training:
                ctx.save_for_backward(out, lse, *bwd_ops)
            ctx.meta, ctx.q_meta, ctx.heads, ctx.q_dtype = meta, q_meta, heads, q.dtype
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dout):
            out, lse, *arrays = ctx.saved_tensors
            ops = mxflash.AttentionBwdOperands(*arrays)
            del arrays
            t = ctx.meta.total_tokens
            dkv = torch.empty((2, t, ctx.heads, 128), dtype=torch.bfloat16, device=dout.device)
            dq = torch.empty((ctx.q_meta.total_tokens, ctx.heads, 128), dtype=torch.bfloat16, device=dout.device)
            mxflash.attention_backward_operands(ops, out, dout.to(torch.bfloat16).contiguous(), lse, ctx.q_meta,
                                                ctx.meta, broadcast_q=True, causal=False, grads=(dq, dkv[0], dkv[1]))
            return (dq.to(ctx.q_dtype), dkv.view(2, t, ctx.heads * 128), None, None, None, None, None, None, None,
                    None)

    return NormKV, Attention


_functions = None


def _mx_core(x, norm_weight, wk, wv, q, meta, q_meta, eps, heads):
    """x -> o through the two autograd functions; opaque to torch.compile's tracer (a compiled model
    breaks its graph here and runs this eagerly, the layers around it compiled), as mx_attention."""
    global _functions
    torch = _torch()
    if _functions is None:
        _functions = _make_functions()
    norm_kv, attention = _functions
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, norm_weight, wk, wv, q))
    link, *kv = norm_kv.apply(x, norm_weight, wk, wv, meta, eps, heads)
    return attention.apply(q, link, *kv, meta, q_meta, heads, training)


_mx_core = _opaque_to_torch_compile(_mx_core)


def _check_x(x, meta, model_dim):
    torch = _torch()
    mxflash._check_meta(meta, "meta")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"x: dtype must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != model_dim:
        raise ValueError(f"x: must be (tokens, {model_dim}), got shape {tuple(x.shape)}")
    if x.shape[0] != meta.total_tokens:
        raise ValueError(f"x: has {x.shape[0]} tokens but meta holds {meta.total_tokens}")


def _parameters(module, model_dim, heads, num_queries, device, dtype):
    """The module's parameters, initialized as torch's nn.Linear initializes its weights
    (uniform in +-1/sqrt(fan_in)); seeds standard normal, norm_weight ones."""
    torch = _torch()
    inner = heads * 128
    kw = dict(device=device, dtype=dtype)

    def linear(out_f, in_f):
        bound = 1.0 / math.sqrt(in_f)
        return torch.nn.Parameter(torch.empty(out_f, in_f, **kw).uniform_(-bound, bound))

    module.seeds = torch.nn.Parameter(torch.randn(num_queries, model_dim, **kw))
    module.norm_weight = torch.nn.Parameter(torch.ones(model_dim, **kw))
    module.wq, module.wk, module.wv = linear(inner, model_dim), linear(inner, model_dim), linear(inner, model_dim)
    module.wo = linear(model_dim, inner)


def _module_base():
    torch = _torch()

    class Base(torch.nn.Module):
        def __init__(self, model_dim=384, heads=3, num_queries=512, eps=1e-6, device=None, dtype=None):
            super().__init__()
            if model_dim <= 0 or model_dim % 32:
                raise ValueError(f"model_dim: must be a positive multiple of 32, got {model_dim}")
            if heads <= 0:
                raise ValueError(f"heads: must be positive, got {heads}")
            if num_queries <= 0:
                raise ValueError(f"num_queries: must be positive, got {num_queries}")
            self.model_dim, self.heads, self.num_queries, self.eps = model_dim, heads, num_queries, float(eps)
            _parameters(self, model_dim, heads, num_queries, device, dtype or torch.float32)

        def extra_repr(self):
            return (f"model_dim={self.model_dim}, heads={self.heads}, num_queries={self.num_queries}, "
                    f"eps={self.eps}")

        def _queries(self):
            bf16 = torch.bfloat16
            q = torch.nn.functional.linear(self.seeds.to(bf16), self.wq.to(bf16))
            return q.view(self.num_queries, self.heads, 128)

        def _project_out(self, o, batch):
            bf16 = torch.bfloat16
            y = torch.nn.functional.linear(o.reshape(-1, self.heads * 128).to(bf16), self.wo.to(bf16))
            return y.view(batch, self.num_queries, self.model_dim)

    return Base


_classes = {}


def _classes_made():
    if _classes:
        return _classes
    torch = _torch()
    Base = _module_base()

    class JaggedCrossAttention(Base):
        """The MXFP8 module (see mxflash.module). forward(x (T, model_dim), meta: JaggedMeta of the
        B sequences) -> y (B, num_queries, model_dim) bfloat16. CUDA tensors run the sm_90a kernels,
        CPU tensors the exact-MX references (slow; for tests)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._q_meta = mxflash.JaggedMeta.from_lengths([self.num_queries])

        def forward(self, x, meta):
            _check_x(x, meta, self.model_dim)
            o = _mx_core(x, self.norm_weight, self.wk, self.wv, self._queries(), meta, self._q_meta, self.eps,
                         self.heads)
            return self._project_out(o, meta.batch)

    class JaggedCrossAttentionBf16(Base):
        """The BF16 twin: eager torch, scaled_dot_product_attention on the batch padded to its
        longest sequence (keys past a sequence's end masked; none masked when the lengths are
        uniform). Same parameters and output as JaggedCrossAttention."""

        def forward(self, x, meta):
            _check_x(x, meta, self.model_dim)
            bf16, F = torch.bfloat16, torch.nn.functional
            xn = F.rms_norm(x.to(bf16), (self.model_dim,), self.norm_weight.to(bf16), self.eps)
            k, v = F.linear(xn, self.wk.to(bf16)), F.linear(xn, self.wv.to(bf16))
            q = self._queries().transpose(0, 1).unsqueeze(0)  # (1, H, Lq, 128)
            lengths = [int(n) for n in meta.lengths]
            batch, longest = len(lengths), max(lengths)
            if longest == 0:
                o = torch.zeros(batch, self.num_queries, self.heads, 128, dtype=bf16, device=x.device)
                return self._project_out(o, batch)
            if all(n == longest for n in lengths):
                kb = k.view(batch, longest, self.heads, 128).transpose(1, 2)
                vb = v.view(batch, longest, self.heads, 128).transpose(1, 2)
                mask = None
            else:
                idx, valid = _padded_index(meta, longest, x.device)
                kb = k[idx].view(batch, longest, self.heads, 128).transpose(1, 2)
                vb = v[idx].view(batch, longest, self.heads, 128).transpose(1, 2)
                mask = valid.view(batch, 1, 1, longest)
            o = F.scaled_dot_product_attention(q.expand(batch, -1, -1, -1), kb, vb, attn_mask=mask)
            if mask is not None:  # sequences with no keys: 0, as the MX module gives
                o = o.masked_fill(~valid.any(1).view(batch, 1, 1, 1), 0)
            return self._project_out(o.transpose(1, 2), batch)

    _classes.update(JaggedCrossAttention=JaggedCrossAttention, JaggedCrossAttentionBf16=JaggedCrossAttentionBf16)
    return _classes


def _padded_index(meta, longest, device):
    torch = _torch()
    cu = torch.as_tensor(meta.cu_seqlens, dtype=torch.int64, device=device)
    lengths = cu[1:] - cu[:-1]
    pos = torch.arange(longest, device=device)
    valid = pos[None, :] < lengths[:, None]
    idx = torch.where(valid, cu[:-1, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    return idx.reshape(-1), valid


def reference_forward(module, x, meta, dtype):
    """The module's math in `dtype` (float64 for accuracy reports) on unquantized values, one
    sequence at a time; differentiable in x and the module's parameters (autograd through the
    .to(dtype) casts reaches the parameters in their own dtype)."""
    torch = _torch()
    p = {n: getattr(module, n).to(dtype) for n in ("seeds", "norm_weight", "wq", "wk", "wv", "wo")}
    x = x.to(dtype)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * p["norm_weight"]
    h = module.heads
    k = (xn @ p["wk"].t()).view(-1, h, 128)
    v = (xn @ p["wv"].t()).view(-1, h, 128)
    q = (p["seeds"] @ p["wq"].t()).view(-1, h, 128)
    outs, cu = [], [int(c) for c in meta.cu_seqlens]
    for b in range(meta.batch):
        kb, vb = k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]]
        if kb.shape[0] == 0:
            outs.append(torch.zeros_like(q))
            continue
        s = torch.einsum("ihd,jhd->hij", q, kb) / math.sqrt(128)
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vb))
    o = torch.stack(outs)  # (B, Lq, H, 128)
    return (o.reshape(meta.batch, module.num_queries, h * 128) @ p["wo"].t())


def __getattr__(name):
    if name in ("JaggedCrossAttention", "JaggedCrossAttentionBf16"):
        return _classes_made()[name]
    raise AttributeError(f"module 'mxflash.module' has no attribute {name!r}")
