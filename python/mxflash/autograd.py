"""MXFP8 attention as a torch autograd function, for training loops.

    from mxflash.autograd import mx_attention
    out = mx_attention(q, k, v, q_meta, k_meta)          # q (Tq, H, 128), k and v (Tk, H, 128)
    out.float().sum().backward()                          # q.grad, k.grad, v.grad
    out = mx_attention(q, k, v, q_meta, k_meta, causal=True)   # causal, as torch's is_causal=True

q, k, v are packed jagged torch tensors (bfloat16, float16, float32 or float64, CPU or CUDA)
described by mxflash.JaggedMeta objects; they are quantized to MXFP8 inside, so callers hand over
the same tensors they would give any attention. The forward quantizes Q, K, V in one pass straight
into the kernel's execution layout (mxflash.quantize_attention_forward: the MX values, RCEIL, of Q
and K along the head dim and V along tokens) and runs mxflash.attention_forward_operands on them
(no prepare pass). When q, k or v requires grad (and grad mode is on), the same pass also writes the
backward kernels' operands (mxflash.quantize_attention_training: Q and K along tokens and V along
the head dim, RCEIL; Q' and K' are the forward's): each input is read once per training step, and
the autograd graph keeps those FP8 operands (about 5 bytes per element of Q and K/V), out and the
LSE, not q, k, v, all through save_for_backward (so activation checkpointing drops and recomputes
them like any layer's activations). The backward then runs mxflash.attention_backward_operands on
them (no prepare passes). Those calls' bytes, with fewer host steps: the operands travel in two
uint8 buffers (the kept one saved for the backward) and each direction is one binding call
(mxflash._attention_step_forward / _backward). causal= (False, True / "top_left", "bottom_right": see mx_attention) is
the forward's mask, and the backward runs with the same one.
The forward and the backward run the sm_90a kernels on CUDA tensors (the backward is deterministic:
no atomics) and the exact-MX CPU references on CPU tensors. Gradients come back in the inputs'
dtype. Under torch.compile, mx_attention is a graph break (it runs eagerly between the compiled
layers around it; fullgraph=True is not supported with it), and so is flash_attn_varlen_func;
scaled_dot_product_attention and flash_attn_func trace into the graph as the custom ops
mxflash::dense_step_fwd / _bwd (the same calls: fullgraph=True and CUDA graphs work).

Drop-ins for code written against other attention calls, all running mx_attention:
scaled_dot_product_attention (torch.nn.functional's, dense (B, H, L, 128)), flash_attn_func and
flash_attn_varlen_func (FlashAttention 2's, dense (B, L, H, 128) and packed variable-length; their
causal=True is FlashAttention's bottom-right mask).
"""
import atexit

import mxflash


def _torch():
    import torch

    return torch


def _quantizable(x, detach=True):
    """x as the quantizer takes it: bfloat16 and float32 as they are; float16 (exactly) and float64
    through float32. detach=False keeps the conversions in the autograd graph (the custom ops' path)."""
    torch = _torch()
    if detach:
        x = x.detach()
    if x.dtype in (torch.float16, torch.float64):
        x = x.float()
    return x.contiguous()


def _quantizable_all(q, k, v, detach=True):
    """q, k, v as the attention quantizers take them (one dtype for all three): bfloat16 when all
    are bfloat16, else float32 (exact for bfloat16 and float16, so the bytes are the same)."""
    xs = [_quantizable(x, detach) for x in (q, k, v)]
    if any(x.dtype != xs[0].dtype for x in xs):
        xs = [x.float() for x in xs]
    return xs


def _make_function():
    torch = _torch()

    class MxAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, q_meta, k_meta, softmax_scale, broadcast_q, causal, training):
            xs = _quantizable_all(q, k, v)
            # One read of q, k, v for both passes (training): the backward's operands are written now
            # into one uint8 buffer (`saved`: Q', K', V rows, Qᵀ', Kᵀ' and their scales, about five
            # bytes per element of Q and K/V) and kept instead of q, k, v; the forward's V' and
            # workspace live in a second one, dropped after the call.
            out, lse, saved = mxflash._attention_step_forward(*xs, q_meta, k_meta, softmax_scale, broadcast_q, causal,
                                                              training)
            del xs
            # Everything the backward reads goes through save_for_backward (intermediates included:
            # no double backward), so that saved-tensor hooks see it: activation checkpointing
            # (torch.utils.checkpoint) then drops the FP8 operands and lse after the forward and
            # recomputes them, as it does for any layer's activations.
            ctx.save_for_backward(out, lse, saved)
            ctx.heads = (int(q.shape[1]), int(k.shape[1]))
            ctx.q_meta, ctx.k_meta = q_meta, k_meta
            ctx.softmax_scale, ctx.broadcast_q, ctx.causal = softmax_scale, broadcast_q, causal
            ctx.dtypes = (q.dtype, k.dtype, v.dtype)
            if q.dtype == k.dtype == v.dtype == torch.float16:
                # bf16 -> fp16 keeps every bit for |out| in [2^-14, 65504] (|out| <= max |v|): fp16
                # models get fp16 activations
                return out.to(torch.float16)
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable  # (no double backward: a clear error, not zeros)
        def backward(ctx, dout):
            out, lse, saved = ctx.saved_tensors  # (a graph exists only when the forward kept the operands)
            dq, dk, dv = mxflash._attention_step_backward(saved, out, dout.to(torch.bfloat16).contiguous(), lse,
                                                          ctx.q_meta, ctx.k_meta, *ctx.heads, ctx.softmax_scale,
                                                          ctx.broadcast_q, ctx.causal)
            del saved
            dt = ctx.dtypes
            return dq.to(dt[0]), dk.to(dt[1]), dv.to(dt[2]), None, None, None, None, None, None

    return MxAttentionFunction


_function = None


def mx_attention(q, k, v, q_meta, k_meta, softmax_scale=None, broadcast_q=False, causal=False):
    """out = MXFP8 attention of q, k, v (see the module docstring); differentiable in q, k and v.

    Returns out (To, H, 128) bfloat16, or float16 when q, k and v are all float16 (To = Tq, or
    B * Lq with broadcast_q). softmax_scale: None for
    1/sqrt(128). broadcast_q: q_meta holds one Q sequence shared by the B K/V sequences; q.grad is the
    sum over the batch.
    causal: False (default: non-causal, every key), True or "top_left" (row i of each Q sequence
    attends keys j <= i of its K/V sequence: torch.nn.functional.scaled_dot_product_attention's
    is_causal=True) or "bottom_right" (keys j <= i + Lk - Lq: FlashAttention's causal; rows
    i < Lq - Lk attend no key and give out 0 and zero gradients); anything else raises ValueError.
    The backward uses the forward's mask.
    Grouped-query attention: k and v may have Hkv heads where Hkv divides q's H; q head h then attends
    k/v head h // (H / Hkv) (torch's enable_gqa=True, FlashAttention's). K and V are quantized and
    kept at their Hkv heads (the forward kernel reads K/V head h // (H / Hkv)); the backward repeats
    their FP8 operands per Q head for the call only and sums each group's dk, dv (fp32 sums of the
    per-head bf16 gradients): the same result as repeating k and v before the call.
    """
    _check_inputs(q, k, v, q_meta, k_meta)
    causal = mxflash._causal_code(causal)  # rejects a bad value by name before any work; the code from here on
    global _function
    if _function is None:
        _function = _make_function()
    torch = _torch()
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return _function.apply(q, k, v, q_meta, k_meta, softmax_scale, bool(broadcast_q), causal, training)


def _opaque_to_torch_compile(fn):
    """fn as torch.compile's tracer (dynamo) sees it: a call it does not trace, so that a compiled
    model breaks its graph around the attention and runs it eagerly, the layers around it compiled.
    Traced, its launchers' stream lookups fail (dynamo hands them a generic torch.Stream). Without
    torch (or a torch before torch.compiler) fn as it is. fullgraph=True compiles are not supported."""
    try:
        import torch
    except ImportError:
        return fn
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


mx_attention = _opaque_to_torch_compile(mx_attention)


def _check_inputs(q, k, v, q_meta, k_meta):
    """Rejects what the quantizers would reject, naming q, k, v (not the quantizer's x), before any work."""
    torch = _torch()
    mxflash._check_meta(q_meta, "q_meta")
    mxflash._check_meta(k_meta, "k_meta")
    floats = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    for name, x, meta, meta_name in (("q", q, q_meta, "q_meta"), ("k", k, k_meta, "k_meta"), ("v", v, k_meta, "k_meta")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
        if x.dtype not in floats:
            raise ValueError(f"{name}: dtype must be bfloat16, float16, float32 or float64, got {x.dtype}")
        if x.dim() != 3 or x.shape[2] != 128:
            raise ValueError(f"{name}: must be (tokens, heads, 128), got shape {tuple(x.shape)}")
        if x.shape[0] != meta.total_tokens:
            raise ValueError(f"{name}: has {x.shape[0]} tokens but {meta_name} holds {meta.total_tokens}")
        if name == "v" and x.shape[1] != k.shape[1]:
            raise ValueError(f"v: has {x.shape[1]} heads, k has {k.shape[1]}")
        if x.shape[1] < 1 or q.shape[1] % x.shape[1] != 0:
            raise ValueError(f"{name}: has {x.shape[1]} heads, which must divide q's {q.shape[1]} "
                             "(the same count, or a grouped-query share of it)")
        if x.device != q.device:
            raise ValueError(f"{name}: is on {x.device}, q on {q.device}")


# ---------------------------------------------------------------------------- dense drop-in
_METAS_KEPT = 64  # metadata the drop-ins keep per kind (the oldest dropped first)
_UNIFORM_METAS = {}  # (batch, length) -> JaggedMeta of equal lengths (device copies kept inside)


def _kept_meta(cache, key, make):
    """cache[key], made by make() on a miss and kept (the last _METAS_KEPT of the cache)."""
    meta = cache.get(key)
    if meta is None:
        meta = make()
        if len(cache) >= _METAS_KEPT:
            cache.pop(next(iter(cache)))  # the oldest
        cache[key] = meta
    return meta


def _uniform_meta(batch, length):
    """The JaggedMeta of `batch` sequences of `length` tokens, made once: its device copy is uploaded
    on first CUDA use (a blocking copy) and then reused by every call of that shape."""
    return _kept_meta(_UNIFORM_METAS, (batch, length), lambda: mxflash.JaggedMeta.from_lengths([length] * batch))


def _check_no_dropout(dropout_p):
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: must be 0 (attention dropout is not supported), got {dropout_p}")


_DENSE_LAYOUTS = {"bhsd": "(batch, heads, tokens, 128)", "bshd": "(batch, tokens, heads, 128)"}


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, layout="bhsd"):
    """torch.nn.functional.scaled_dot_product_attention's call on dense batches, run as MXFP8
    attention (mx_attention): a drop-in for training loops that hold q, k, v as (B, H, L, 128).

    query (B, H, L, 128), key and value (B, Hkv, S, 128), one dtype (bfloat16, float16, float32 or
    float64), CPU or CUDA; layout="bshd" takes (B, L, H, 128) and (B, S, Hkv, 128) instead
    (FlashAttention's flash_attn_func layout). Returns out in the inputs' layout and dtype,
    differentiable in query, key and value. Supported as torch's: is_causal (the top-left mask:
    row i attends keys j <= i), scale (None: 1/sqrt(128)), enable_gqa (Hkv divides H; query head h
    attends key/value head h // (H / Hkv); without it the head counts must be equal). Not supported
    (ValueError naming the argument): attn_mask (use is_causal, or mx_attention with jagged
    metadata for sequences of different lengths), dropout_p != 0, head dims other than 128.
    Rows facing no key (S = 0) give 0, as in mx_attention.

    Memory: (B, H, L, 128) tensors that are transposes of (B, L, H, 128) ones (the usual
    x.view(B, L, H, 128).transpose(1, 2)) are read in place; others are copied to that order once
    (the quantizer reads tokens with their heads side by side). out is returned as such a transpose
    (out.transpose(1, 2) is contiguous), as FlashAttention does. The equal-length metadata of each
    (B, L) is made once and kept (its first CUDA use uploads it: do a warm-up call before capturing
    a CUDA graph).
    """
    if attn_mask is not None:
        raise ValueError("attn_mask: not supported (use is_causal=True for the causal mask, or "
                         "mxflash.autograd.mx_attention with jagged metadata for sequences of different lengths)")
    _check_no_dropout(dropout_p)
    if layout not in _DENSE_LAYOUTS:
        raise ValueError(f"layout: must be 'bhsd' or 'bshd', got {layout!r}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal: must be a bool, got {is_causal!r}")
    return _dense_attention(query, key, value, scale, is_causal, layout, enable_gqa)


def _dense_attention(query, key, value, scale, causal, layout, enable_gqa=True):
    """The dense drop-ins' run (scaled_dot_product_attention, flash_attn_func): checks the (B, H, L,
    128) or (B, L, H, 128) tensors (different head counts only with enable_gqa), packs them as B
    equal-length sequences and runs mx_attention with `causal` (mx_attention's values); out in the
    inputs' layout and dtype."""
    torch = _torch()
    heads_axis, tokens_axis = (1, 2) if layout == "bhsd" else (2, 1)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[3] != 128:
            raise ValueError(f"{name}: must be {_DENSE_LAYOUTS[layout]} (layout={layout!r}), got shape {tuple(x.shape)}")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise ValueError(f"{name}: dtype {x.dtype} differs from query's {query.dtype} (one dtype for all three)")
    if value.shape != key.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} must equal key's {tuple(key.shape)}")
    batch, heads, lq = query.shape[0], query.shape[heads_axis], query.shape[tokens_axis]
    kv_heads, lk = key.shape[heads_axis], key.shape[tokens_axis]
    if key.shape[0] != batch:
        raise ValueError(f"key: batch {key.shape[0]} differs from query's {batch}")
    if kv_heads != heads and not enable_gqa:
        raise ValueError(f"key: has {kv_heads} heads, query {heads}: different head counts need enable_gqa=True")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"key: has {kv_heads} heads, which must divide query's {heads} (enable_gqa)")

    def packed(x):  # (B * tokens, heads, 128): a view where the memory allows
        x = x.transpose(1, 2) if layout == "bhsd" else x
        return x.reshape(x.shape[0] * x.shape[1], x.shape[2], 128)

    if batch == 0 or lq == 0 or lk == 0 or heads == 0:
        # Nothing to attend (JaggedMeta needs a sequence, the kernels a token): zeros, tied to the
        # inputs so that their gradients come back (zero).
        shape = (batch, lq, heads, 128)
        out = query.new_zeros(shape) + 0 * (query.sum() + key.sum() + value.sum())
    elif _compiling():
        # Traced by torch.compile: the same calls as torch.library custom ops (_dense_ops), so that
        # the graph need not break here (fullgraph=True works; CUDA graphs of the step too).
        code = mxflash._causal_code(causal)  # rejects a bad value by name before any work
        xs = _quantizable_all(packed(query), packed(key), packed(value), detach=False)
        out = _dense_step(*xs, int(batch), int(lq), int(lk), scale, code)
        out = out.view(batch, lq, heads, 128)
    else:
        out = mx_attention(packed(query), packed(key), packed(value), _uniform_meta(batch, lq),
                           _uniform_meta(batch, lk), softmax_scale=scale, causal=causal)
        out = out.view(batch, lq, heads, 128)
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return out if out.dtype == query.dtype else out.to(query.dtype)


# ------------------------------------------------------------------ the dense drop-ins under torch.compile
# torch.compile traces scaled_dot_product_attention and flash_attn_func into its graph: their step
# runs as two torch.library custom ops (mxflash::dense_step_fwd / _bwd, the autograd Function's
# calls: mxflash._attention_step_forward / _backward on the equal-length metadata of (batch, length),
# the same bytes), with fake implementations that give the outputs' shapes (the saved buffer's size
# from the bindings' layout) and the backward registered through torch.library. Eager calls keep the
# autograd Function (fewer host steps than a custom op's dispatch).
_DENSE_OPS = None


def _compiling():
    torch = _torch()
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


def _dense_ops():
    """(forward op, backward op), registered on first use."""
    global _DENSE_OPS
    if _DENSE_OPS is not None:
        return _DENSE_OPS
    import math

    torch = _torch()
    from torch.library import custom_op

    def metas(batch, lq, lk):
        # int(): a symbolic size (torch.compile's dynamic shapes) is specialized here, with a guard:
        # the metadata, and the saved buffer's size with them, are per (batch, length)
        return _uniform_meta(int(batch), int(lq)), _uniform_meta(int(batch), int(lk))

    def scale_of(softmax_scale):
        return None if math.isnan(softmax_scale) else softmax_scale

    @custom_op("mxflash::dense_step_fwd", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, lq: int, lk: int, softmax_scale: float,
            causal: int, training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qm, km = metas(batch, lq, lk)
        out, lse, saved = mxflash._attention_step_forward(q, k, v, qm, km, scale_of(softmax_scale), False, causal,
                                                          training)
        return out, lse, saved if saved is not None else q.new_empty((0,), dtype=torch.uint8)

    @fwd.register_fake
    def _(q, k, v, batch, lq, lk, softmax_scale, causal, training):
        heads, kv_heads = int(q.shape[1]), int(k.shape[1])
        saved = 0
        if training:
            qm, km = metas(batch, lq, lk)
            saved = max(mxflash._C.attention_step_layout(qm._host, km._host, heads, kv_heads, True, False, causal,
                                                         bool(q.is_cuda))[0], 1)
        tokens = int(batch) * int(lq)
        return (q.new_empty((tokens, heads, 128), dtype=torch.bfloat16),
                q.new_empty((heads, tokens), dtype=torch.float32), q.new_empty((saved,), dtype=torch.uint8))

    @custom_op("mxflash::dense_step_bwd", mutates_args=())
    def bwd(saved: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, batch: int, lq: int,
            lk: int, heads: int, kv_heads: int, softmax_scale: float,
            causal: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qm, km = metas(batch, lq, lk)
        return mxflash._attention_step_backward(saved, out, dout, lse, qm, km, heads, kv_heads,
                                                scale_of(softmax_scale), False, causal)

    @bwd.register_fake
    def _(saved, out, dout, lse, batch, lq, lk, heads, kv_heads, softmax_scale, causal):
        tq, tk, heads, kv_heads = int(batch) * int(lq), int(batch) * int(lk), int(heads), int(kv_heads)
        return (out.new_empty((tq, heads, 128)), out.new_empty((tk, kv_heads, 128)), out.new_empty((tk, kv_heads, 128)))

    def setup_context(ctx, inputs, output):
        q, k, v, batch, lq, lk, softmax_scale, causal, _training = inputs
        out, lse, saved = output
        ctx.mark_non_differentiable(lse, saved)
        ctx.save_for_backward(out, lse, saved)
        ctx.args = (batch, lq, lk, int(q.shape[1]), int(k.shape[1]), softmax_scale, causal)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)

    def backward(ctx, dout, _dlse, _dsaved):
        out, lse, saved = ctx.saved_tensors
        dq, dk, dv = bwd(saved, out, dout.to(torch.bfloat16).contiguous(), lse, *ctx.args)
        dt = ctx.dtypes
        return dq.to(dt[0]), dk.to(dt[1]), dv.to(dt[2]), None, None, None, None, None, None

    fwd.register_autograd(backward, setup_context=setup_context)
    _DENSE_OPS = (fwd, bwd)
    return _DENSE_OPS


def _dense_step(q, k, v, batch, lq, lk, softmax_scale, causal):
    """mx_attention's step on (batch x lq, H, 128) q and (batch x lk, Hkv, 128) k, v of equal-length
    sequences through the custom ops (under torch.compile; causal: the mask's code); out bfloat16, or
    float16 for float16 inputs is done by the caller."""
    torch = _torch()
    training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    scale = float("nan") if softmax_scale is None else float(softmax_scale)
    out, _, _ = _dense_ops()[0](q, k, v, batch, lq, lk, scale, causal, training)
    return out


def _drop_kept_metas():
    """At exit: the kept metadata go before the extension module does (torch.compile's caches keep
    this module's globals alive until after it, and nanobind would report the metas as leaked)."""
    _UNIFORM_METAS.clear()
    _VARLEN_METAS.clear()


def _register_dense_ops():
    """The custom ops at import where torch is installed (not inside a traced call: torch.compile
    cannot trace their registration); a second import of this module finds them registered."""
    global _DENSE_OPS
    try:
        import torch
    except ImportError:
        return
    try:
        _dense_ops()
    except RuntimeError:  # (already registered by an earlier import of this module)
        _DENSE_OPS = (torch.ops.mxflash.dense_step_fwd, torch.ops.mxflash.dense_step_bwd)


_register_dense_ops()
atexit.register(_drop_kept_metas)


# ---------------------------------------------------------------------------- FlashAttention's calls
# FlashAttention 2's keyword options: the values mxflash runs (its backward is deterministic whatever
# `deterministic` says); anything else is refused by name.
_FA_OPTIONS = {"window_size": (-1, -1), "softcap": 0.0, "alibi_slopes": None, "deterministic": None,
               "return_attn_probs": False}


def _check_fa_options(fn, dropout_p, options):
    _check_no_dropout(dropout_p)
    if not isinstance(options.get("causal", False), bool):
        raise ValueError(f"causal: must be a bool, got {options['causal']!r}")
    for name, value in options.items():
        if name == "causal":
            continue
        if name not in _FA_OPTIONS:
            raise TypeError(f"{fn}() got an unexpected keyword argument '{name}'")
        want = _FA_OPTIONS[name]
        if name == "deterministic":
            ok = isinstance(value, bool)
        elif name == "window_size":
            ok = tuple(value) == want
        else:
            ok = value is None if want is None else value == want
        if not ok:
            raise ValueError(f"{name}: not supported (mxflash runs {name}={want!r}), got {value!r}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **options):
    """FlashAttention's flash_attn_func on dense (B, L, H, 128) batches, run as MXFP8 attention: a
    drop-in for training loops written against flash_attn.

    q (B, Lq, H, 128), k and v (B, Lk, Hkv, 128) with Hkv dividing H (MQA / GQA as FlashAttention:
    query head h attends key/value head h // (H / Hkv)), one dtype (bfloat16, float16, float32 or
    float64), CPU or CUDA. Returns out (B, Lq, H, 128) in the inputs' dtype, differentiable in q, k,
    v. causal=True is FlashAttention's mask, aligned to the bottom-right corner: row i attends keys
    j <= i + Lk - Lq (rows i < Lq - Lk attend no key and give 0), which is torch's is_causal when
    Lq = Lk. softmax_scale: None for 1/sqrt(128). Refused by name (ValueError): dropout_p != 0,
    window_size other than (-1, -1), softcap != 0, alibi_slopes, return_attn_probs=True; any
    deterministic= is accepted (the backward is deterministic). Memory as
    scaled_dot_product_attention(layout="bshd"): the tensors are read in place.
    """
    _check_fa_options("flash_attn_func", dropout_p, dict(options, causal=causal))
    return _dense_attention(q, k, v, softmax_scale, "bottom_right" if causal else False, "bshd")


_VARLEN_METAS = {}  # cu_seqlens as a tuple -> JaggedMeta (device copies kept inside)


def _varlen_meta(cu_seqlens, name):
    """The JaggedMeta of a cu_seqlens argument (a torch tensor, CPU or CUDA, or a sequence of ints),
    made once per distinct value and kept (the last _METAS_KEPT)."""
    torch = _torch()
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: must be a 1-D int32 or int64 tensor, got {tuple(cu_seqlens.shape)} "
                             f"{cu_seqlens.dtype}")
        key = tuple(cu_seqlens.tolist())  # (a CUDA tensor: one device -> host copy, which waits for the GPU)
    else:
        try:
            key = tuple(int(x) for x in cu_seqlens)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: must be a tensor or a sequence of ints, got {type(cu_seqlens).__name__}")

    def make():
        try:
            return mxflash.JaggedMeta.from_cu_seqlens(list(key))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    return _kept_meta(_VARLEN_METAS, key, make)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, **options):
    """FlashAttention's flash_attn_varlen_func on packed variable-length batches, run as MXFP8
    attention (mx_attention): a drop-in for training loops written against flash_attn.

    q (total_q, H, 128), k and v (total_k, Hkv, 128) (Hkv dividing H: MQA / GQA), one dtype; sequence b
    is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q against rows cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] of k and v. cu_seqlens_*: int32/int64 torch tensors (B + 1 entries from 0,
    non-decreasing) or sequences of ints. The metadata is host-side: CPU tensors or lists cost nothing
    more, a CUDA tensor is read back to the host (a device -> host copy that waits for the GPU's
    queued work). The metadata of each distinct cu_seqlens is made once and kept (the last 64; its
    first CUDA use uploads it: do a warm-up call before capturing a CUDA graph). max_seqlen_q and
    max_seqlen_k must be at least the longest sequence (as FlashAttention needs; they are only
    checked). causal=True: FlashAttention's bottom-right alignment per sequence (row i attends keys
    j <= i + Lk - Lq). Returns out (total_q, H, 128) in q's dtype. Other options as flash_attn_func.
    """
    _check_fa_options("flash_attn_varlen_func", dropout_p, dict(options, causal=causal))
    q_meta, k_meta = _varlen_meta(cu_seqlens_q, "cu_seqlens_q"), _varlen_meta(cu_seqlens_k, "cu_seqlens_k")
    if k_meta.batch != q_meta.batch:
        raise ValueError(f"cu_seqlens_k: holds {k_meta.batch} sequences, cu_seqlens_q {q_meta.batch}")
    for name, given, meta in (("max_seqlen_q", max_seqlen_q, q_meta), ("max_seqlen_k", max_seqlen_k, k_meta)):
        if int(given) < meta.max_seqlen:
            raise ValueError(f"{name}: {given} is less than the longest sequence ({meta.max_seqlen})")
    out = mx_attention(q, k, v, q_meta, k_meta, softmax_scale=softmax_scale,
                       causal="bottom_right" if causal else False)
    return out if out.dtype == q.dtype else out.to(q.dtype)


flash_attn_varlen_func = _opaque_to_torch_compile(flash_attn_varlen_func)
