"""mxflash.quantize_attention_backward and mxflash.attention_backward_operands: the backward's operands
in the kernels' execution layout. CPU (numpy): shapes and dtypes, every byte written, Q' and K' equal
to the forward's operands, the backward on them against the MX-operand backward on the same inputs
(vs float64), bad arguments (ValueError naming the argument, outputs untouched). CUDA: the GPU
operands byte for byte against the CPU ones and the GPU backward on them against the CPU backward on
the same operands. CUDA tests skip, saying why, as in test_attention_operands.py."""
import numpy as np
import pytest

import mxflash
from test_attention import torch_of
from test_attention_operands import BF16, E4M3, inputs, metas, raw, sentinel, sqnr_db, untouched
from test_attention_operands import NAMES as FWD_NAMES
from test_attention_operands import sentinel_operands as fwd_sentinel_operands

H = 2
NAMES = ("q", "q_scale", "k", "k_scale", "v", "v_scale", "qt", "qt_scale", "kt", "kt_scale")
Q_LENGTHS, K_LENGTHS = [40, 17, 70], [33, 1, 129]


def forward_and_dout(x, qm, km, broadcast_q=False, seed=3):
    fops = mxflash.quantize_attention_forward(*x, qm, km)
    out, lse = mxflash.attention_forward_operands(fops, qm, km, broadcast_q=broadcast_q)
    dout = np.random.default_rng(seed).standard_normal(out.shape).astype(BF16)
    return fops, out, lse, dout


def mx_backward(x, out, dout, lse, qm, km, **kw):
    xq, xk, xv = x
    ops = (mxflash.quantize_mx(xq, qm, "hdim"), mxflash.quantize_mx(xq, qm, "seq"), mxflash.quantize_mx(xk, km, "hdim"),
           mxflash.quantize_mx(xk, km, "seq"), mxflash.quantize_mx(xv, km, "hdim"))
    return mxflash.attention_backward(*ops, out, dout, lse, qm, km, **kw)


def sentinel_operands(qm, km, heads=H):
    shapes = mxflash.attention_bwd_operand_shapes(qm, km, heads)
    return mxflash.AttentionBwdOperands(*(sentinel(shapes[n], np.float32 if n.endswith("scale") else E4M3)
                                          for n in NAMES))


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_operands_and_backward_on_them(broadcast_q):
    q_lengths, k_lengths = ([70], [33, 1, 0, 200]) if broadcast_q else (Q_LENGTHS, K_LENGTHS)
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, seed=4)
    ops = mxflash.quantize_attention_backward(*x, qm, km, out=sentinel_operands(qm, km))
    shapes = mxflash.attention_bwd_operand_shapes(qm, km, H)
    for n in NAMES:
        a = getattr(ops, n)
        assert a.shape == shapes[n], n
        assert not untouched(a), f"{n}: not written"
    fops, out, lse, dout = forward_and_dout(x, qm, km, broadcast_q)
    for n in ("q", "q_scale", "k", "k_scale"):
        assert np.array_equal(raw(getattr(ops, n)), raw(getattr(fops, n))), f"{n} differs from the forward's"
    got = mxflash.attention_backward_operands(ops, out, dout, lse, qm, km, broadcast_q=broadcast_q)
    want = mx_backward(x, out, dout, lse, qm, km, broadcast_q=broadcast_q)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == BF16 and g.shape == w.shape, name
        # the two differ only in Q, K along tokens (per tile here, per channel there)
        assert sqnr_db(w.astype(np.float32), g.astype(np.float32)) > 40, name


def test_forward_operands_are_reused():
    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    x = inputs(Q_LENGTHS, K_LENGTHS, seed=8)
    full = mxflash.quantize_attention_backward(*x, qm, km)
    fops = mxflash.quantize_attention_forward(*x, qm, km)
    ops = mxflash.quantize_attention_backward(*x, qm, km, forward=fops)
    for n in NAMES:
        if n in ("q", "q_scale", "k", "k_scale"):
            assert getattr(ops, n) is getattr(fops, n), f"{n}: not the forward's array"
        assert np.array_equal(raw(getattr(ops, n)), raw(getattr(full, n))), n
    with pytest.raises(TypeError, match="^forward: expected mxflash.AttentionFwdOperands"):
        mxflash.quantize_attention_backward(*x, qm, km, forward=tuple(fops))
    with pytest.raises(ValueError, match="^forward: give either out= or forward="):
        mxflash.quantize_attention_backward(*x, qm, km, out=full, forward=fops)


def test_bad_arguments_write_nothing():
    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    x = inputs(Q_LENGTHS, K_LENGTHS, seed=5)
    ops = mxflash.quantize_attention_backward(*x, qm, km)
    _, out, lse, dout = forward_and_dout(x, qm, km)
    grads = tuple(sentinel((t, H, 128), BF16) for t in (qm.total_tokens, km.total_tokens, km.total_tokens))
    bad = mxflash.AttentionBwdOperands(*(getattr(ops, n) if n != "qt" else ops.qt.reshape(H, -1, 128)
                                         for n in NAMES))
    with pytest.raises(ValueError, match="^ops.qt: "):
        mxflash.attention_backward_operands(bad, out, dout, lse, qm, km, grads=grads)
    assert untouched(*grads)
    with pytest.raises(TypeError, match="^ops: expected mxflash.AttentionBwdOperands"):
        mxflash.attention_backward_operands(tuple(ops), out, dout, lse, qm, km, grads=grads)
    fresh = sentinel_operands(qm, km, heads=3)
    with pytest.raises(ValueError, match="^ops.q: has 3 heads, q has 2$"):
        mxflash.quantize_attention_backward(*x, qm, km, out=fresh)
    assert untouched(*fresh)


SHARED = ("q", "q_scale", "k", "k_scale")


def training_sentinels(qm, km, heads=H):
    """Sentinel (fwd, bwd) for quantize_attention_training's out=, bwd's Q', K' being fwd's arrays."""
    fwd = fwd_sentinel_operands(qm, km, heads)
    bwd = sentinel_operands(qm, km, heads)
    return fwd, mxflash.AttentionBwdOperands(*(getattr(fwd if n in SHARED else bwd, n) for n in NAMES))


def check_training_sets(fwd, bwd, want_fwd, want_bwd):
    for n in FWD_NAMES:
        assert np.array_equal(raw(getattr(fwd, n)), raw(getattr(want_fwd, n))), f"fwd.{n} differs"
    for n in NAMES:
        if n in SHARED:
            assert getattr(bwd, n) is getattr(fwd, n), f"bwd.{n}: not fwd's array"
        assert np.array_equal(raw(getattr(bwd, n)), raw(getattr(want_bwd, n))), f"bwd.{n} differs"


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_training_quantizer_writes_both_sets(broadcast_q):
    """quantize_attention_training: the bytes of quantize_attention_forward and of
    quantize_attention_backward on the same inputs, bwd's Q' and K' being fwd's arrays; out= written
    whole; a bwd whose Q' is not fwd's refused, naming it, with nothing written."""
    q_lengths, k_lengths = ([70], [33, 1, 0, 200]) if broadcast_q else (Q_LENGTHS + [129], K_LENGTHS + [0])
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, seed=9)
    want_fwd = mxflash.quantize_attention_forward(*x, qm, km)
    want_bwd = mxflash.quantize_attention_backward(*x, qm, km)
    check_training_sets(*mxflash.quantize_attention_training(*x, qm, km), want_fwd, want_bwd)
    fwd, bwd = training_sentinels(qm, km)
    got = mxflash.quantize_attention_training(*x, qm, km, out=(fwd, bwd))
    assert got[0] is fwd and got[1] is bwd
    check_training_sets(fwd, bwd, want_fwd, want_bwd)

    fwd, bwd = training_sentinels(qm, km)
    loose = mxflash.AttentionBwdOperands(*(getattr(bwd, n) if n != "q" else getattr(bwd, n).copy() for n in NAMES))
    with pytest.raises(ValueError, match="^bwd.q: must view fwd.q"):
        mxflash.quantize_attention_training(*x, qm, km, out=(fwd, loose))
    assert untouched(*fwd, *loose)
    with pytest.raises(TypeError, match="^out: expected a \\(fwd, bwd\\) pair"):
        mxflash.quantize_attention_training(*x, qm, km, out=fwd)
    with pytest.raises(TypeError, match="^bwd: expected mxflash.AttentionBwdOperands"):
        mxflash.quantize_attention_training(*x, qm, km, out=(fwd, fwd))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("broadcast_q", [False, True])
def test_cuda_training_quantizer_equals_cpu(torch_cuda, dtype, broadcast_q):
    """On CUDA (bfloat16: the fused kernels, float32: the two passes per input) the CPU bytes, outputs
    poisoned first."""
    torch = torch_cuda
    q_lengths, k_lengths = ([150], [300, 0, 129, 1]) if broadcast_q else ([200, 0, 130, 1], [300, 5, 0, 129])
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, seed=10, dtype=BF16 if dtype == "bfloat16" else np.float32)
    want_fwd = mxflash.quantize_attention_forward(*x, qm, km)
    want_bwd = mxflash.quantize_attention_backward(*x, qm, km)
    fwd, bwd = (type(o)(*(torch_of(a, torch) for a in o)) for o in training_sentinels(qm, km))
    bwd = mxflash.AttentionBwdOperands(*(getattr(fwd if n in SHARED else bwd, n) for n in NAMES))
    mxflash.quantize_attention_training(*(torch_of(a, torch) for a in x), qm, km, out=(fwd, bwd))
    assert fwd.q.is_cuda and bwd.qt.is_cuda
    check_training_sets(fwd, bwd, want_fwd, want_bwd)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("broadcast_q", [False, True])
def test_cuda_operands_and_backward_equal_cpu(torch_cuda, dtype, broadcast_q):
    torch = torch_cuda
    q_lengths, k_lengths = ([150], [300, 0, 129, 1]) if broadcast_q else ([200, 0, 130, 1], [300, 5, 0, 129])
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, seed=6, dtype=BF16 if dtype == "bfloat16" else np.float32)
    cpu = mxflash.quantize_attention_backward(*x, qm, km)
    gpu = mxflash.quantize_attention_backward(*(torch_of(a, torch) for a in x), qm, km)
    for n in NAMES:
        g = getattr(gpu, n)
        assert g.is_cuda and tuple(g.shape) == getattr(cpu, n).shape, n
        assert np.array_equal(raw(g), raw(getattr(cpu, n))), f"{dtype}: {n} differs from the CPU bytes"
    _, out, lse, dout = forward_and_dout(tuple(np.asarray(a, np.float32) for a in x), qm, km, broadcast_q)
    want = mxflash.attention_backward_operands(cpu, out, dout, lse, qm, km, broadcast_q=broadcast_q)
    got = mxflash.attention_backward_operands(gpu, torch_of(out, torch), torch_of(dout, torch),
                                              torch_of(lse, torch), qm, km, broadcast_q=broadcast_q)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.is_cuda and g.dtype == torch.bfloat16, name
        # the fast kernels quantize dO and dS with coarser scales than the reference
        assert sqnr_db(w.astype(np.float32), g.float().cpu().numpy()) > 20, name


def mx_kv(x, km, spread=30, seed=12):
    """K and V as MX tensors (hdim, plain) from values whose 32-blocks span +-spread binades (scales
    from 2^-30 to 2^30: bf16 widening exact), and their bf16 values (the definition's inputs)."""
    rng = np.random.default_rng(seed)
    out = []
    for a in x[1:]:
        binades = np.exp2(rng.integers(-spread, spread + 1, a.shape[:2] + (4,))).repeat(32, axis=-1)
        a = (a.astype(np.float32) * binades).astype(np.float32)
        t = mxflash.quantize_mx(a, km, "hdim")
        out.append((t, t.dequantize(km, "bfloat16")))
    return out


def mx_kv_case(q_dtype, broadcast_q):
    """Inputs, MX K and V, and the bytes the definition gives (the call on their bf16 values)."""
    q_lengths, k_lengths = ([150], [300, 0, 129, 1]) if broadcast_q else ([200, 0, 130, 1], [300, 5, 0, 129])
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, seed=13, dtype=BF16 if q_dtype == "bfloat16" else np.float32)
    (kt, kb), (vt, vb) = mx_kv(x, km)
    cast = (lambda a: a) if q_dtype == "bfloat16" else (lambda a: a.astype(np.float32))  # noqa: E731
    return qm, km, x[0], kt, vt, mxflash.quantize_attention_training(x[0], cast(kb), cast(vb), qm, km)


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("broadcast_q", [False, True])
def test_training_quantizer_with_mx_kv(q_dtype, broadcast_q):
    """quantize_attention_training on MX K, V: the bytes of the same call on their bf16 values."""
    qm, km, xq, kt, vt, want = mx_kv_case(q_dtype, broadcast_q)
    check_training_sets(*mxflash.quantize_attention_training(xq, kt, vt, qm, km), *want)


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("broadcast_q", [False, True])
def test_cuda_training_quantizer_with_mx_kv(torch_cuda, q_dtype, broadcast_q):
    """On CUDA (the fused kernels reading the MX tensors once) the definition's bytes, outputs
    poisoned first."""
    torch = torch_cuda
    from test_attention import mx_to

    qm, km, xq, kt, vt, want = mx_kv_case(q_dtype, broadcast_q)
    fwd, bwd = (type(o)(*(torch_of(a, torch) for a in o)) for o in training_sentinels(qm, km))
    bwd = mxflash.AttentionBwdOperands(*(getattr(fwd if n in SHARED else bwd, n) for n in NAMES))
    mxflash.quantize_attention_training(torch_of(xq, torch), mx_to(kt, torch), mx_to(vt, torch), qm, km,
                                        out=(fwd, bwd))
    assert fwd.q.is_cuda and bwd.kt.is_cuda
    check_training_sets(fwd, bwd, *want)


def test_training_quantizer_with_mx_kv_bad_arguments():
    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    x = inputs(Q_LENGTHS, K_LENGTHS, seed=14, dtype=BF16)
    (kt, _), (vt, _) = mx_kv(x, km)
    fwd, bwd = training_sentinels(qm, km)
    seq = mxflash.quantize_mx(x[2].astype(np.float32), km, "seq")
    with pytest.raises(ValueError, match="^v.orientation: must be hdim"):
        mxflash.quantize_attention_training(x[0], kt, seq, qm, km, out=(fwd, bwd))
    blocked = mxflash.quantize_mx(x[1].astype(np.float32), km, "hdim", scale_layout="blocked128x4")
    with pytest.raises(ValueError, match="^k.scale_layout: must be plain"):
        mxflash.quantize_attention_training(x[0], blocked, vt, qm, km, out=(fwd, bwd))
    with pytest.raises(TypeError, match="^v: expected mxflash.MxTensor"):
        mxflash.quantize_attention_training(x[0], kt, x[2], qm, km, out=(fwd, bwd))
    assert untouched(*fwd, *bwd)
