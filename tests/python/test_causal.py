"""The causal mask, causal= False | True | "top_left" | "bottom_right", through every attention entry
point of the package: attention_forward, attention_forward_operands, attention_backward,
attention_backward_operands and mxflash.autograd.mx_attention.

Row i of a Q sequence of Lq rows attends keys j < n(i) of its K/V sequence of Lk keys
(include/mxflash/attention.h, causal_keys): top_left n = min(i + 1, Lk) (torch's
scaled_dot_product_attention(is_causal=True)), bottom_right n = clamp(i + 1 + Lk - Lq, 0, Lk)
(FlashAttention's causal); rows with n = 0 give out 0, lse -inf and dq 0, keys no row attends dk =
dv = 0. CPU (numpy, torch CPU tensors): the exact-MX references against a float64 masked attention
written here (itself checked against torch's SDPA in float64 with is_causal / an explicit mask) and
against torch float64 autograd, on jagged lengths with 0, 1 and Lq != Lk, broadcast_q, both
alignments; the spellings of the option and bad values (ValueError naming causal, nothing written).
CUDA: the fast and exact GPU paths against the CPU references on the same inputs (skipped without a
Hopper GPU, as in test_attention.py; MXFLASH_REQUIRE_CUDA=1 turns the skips into failures)."""
import importlib.util
import math

import ml_dtypes
import numpy as np
import pytest

import mxflash
from test_attention import compare_gpu_cpu, cu, mx_operands, mx_to, sentinel, torch_of, untouched
from test_attention_operands import sqnr_db  # (inf for identical arrays)

BF16 = ml_dtypes.bfloat16
H = 2
SCALE = 1.0 / math.sqrt(128)
MASKS = ("top_left", "bottom_right")
# Lq > Lk (bottom_right: leading rows without keys), Lq = 0 (keys nobody attends), Lk = 0 (rows without
# keys), 1 x 1, Lq < Lk (top_left: trailing keys nobody attends), Lq = Lk, and a mask across a
# 128-row / 128-key tile boundary.
Q_LENGTHS = [40, 0, 70, 1, 5, 33, 130]
K_LENGTHS = [33, 5, 0, 1, 9, 33, 129]
BQ_LQ, BQ_K_LENGTHS = 37, [33, 5, 0, 50, 1]  # broadcast_q: one shared Q sequence of 37 rows

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


# ---------------------------------------------------------------------------- the rule and references
def n_keys(mask, i, lq, lk):
    """Keys row i of a Q sequence of lq rows attends (causal_keys of include/mxflash/attention.h)."""
    if mask is None:
        return lk
    n = i + 1 + (lk - lq if mask == "bottom_right" else 0)
    return min(max(n, 0), lk)


def mask_name(causal):
    """The alignment a causal= value selects (None: no mask)."""
    return "top_left" if causal is True else (None if causal is False else causal)


def sequences(q_lengths, k_lengths, broadcast_q=False):
    """(q0, lq, o0, k0, lk) of every (Q, K/V) sequence pair: Q rows, output rows and K/V rows."""
    qc, kc = cu(q_lengths), cu(k_lengths)
    for b, lk in enumerate(k_lengths):
        lq = q_lengths[0] if broadcast_q else q_lengths[b]
        q0 = 0 if broadcast_q else int(qc[b])
        o0 = b * lq if broadcast_q else q0
        yield q0, lq, o0, int(kc[b]), lk


def row_keys(mask, q_lengths, k_lengths, broadcast_q=False):
    """n(i) of every output row, in output order."""
    return np.concatenate([[n_keys(mask, i, lq, lk) for i in range(lq)]
                           for _, lq, _, _, lk in sequences(q_lengths, k_lengths, broadcast_q)]).astype(np.int64)


def attended_keys(mask, q_lengths, k_lengths, broadcast_q=False):
    """Boolean per K/V token: some row attends it."""
    seen = np.zeros(sum(k_lengths), bool)
    for _, lq, _, k0, lk in sequences(q_lengths, k_lengths, broadcast_q):
        if lq:
            seen[k0:k0 + max(n_keys(mask, i, lq, lk) for i in range(lq))] = True
    return seen


def allowed(mask, lq, lk):
    """(lq, lk) boolean: row i may attend key j."""
    return np.arange(lk)[None, :] < np.array([n_keys(mask, i, lq, lk) for i in range(lq)])[:, None]


def attention_fp64(q, k, v, q_lengths, k_lengths, mask, scale=SCALE, broadcast_q=False):
    """Masked attention in float64 on packed (T, H, 128) arrays: (out (To, H, 128), lse (H, To)),
    rows without keys out 0 and lse -inf."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    To = int(sum(lq for _, lq, _, _, _ in sequences(q_lengths, k_lengths, broadcast_q)))
    out, lse = np.zeros((To, q.shape[1], 128)), np.full((q.shape[1], To), -np.inf)
    for q0, lq, o0, k0, lk in sequences(q_lengths, k_lengths, broadcast_q):
        a = allowed(mask, lq, lk)
        rows = a.any(1)
        if not rows.any():
            continue
        s = np.einsum("ihd,jhd->hij", q[q0:q0 + lq][rows], k[k0:k0 + lk]) * scale
        s = np.where(a[rows][None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(-1)
        idx = o0 + np.flatnonzero(rows)
        out[idx] = np.einsum("hij,jhd->ihd", p, v[k0:k0 + lk]) / l.T[:, :, None]
        lse[:, idx] = m[..., 0] + np.log(l)
    return out, lse


def backward_fp64(q, k, v, dout, q_lengths, k_lengths, mask, scale=SCALE, broadcast_q=False):
    """Exact (dq, dk, dv) of the masked attention in float64; dq summed over the batch with
    broadcast_q."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for q0, lq, o0, k0, lk in sequences(q_lengths, k_lengths, broadcast_q):
        a = allowed(mask, lq, lk)
        if not a.any():
            continue
        qs, ks, vs, do = q[q0:q0 + lq], k[k0:k0 + lk], v[k0:k0 + lk], dout[o0:o0 + lq]
        s = np.where(a[None], np.einsum("ihd,jhd->hij", qs, ks) * scale, -np.inf)
        m = s.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)  # rows without keys: p = 0
        dp = np.einsum("ihd,jhd->hij", do, vs)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq[q0:q0 + lq] += np.einsum("hij,jhd->ihd", ds, ks) * scale
        dk[k0:k0 + lk] += np.einsum("hij,ihd->jhd", ds, qs) * scale
        dv[k0:k0 + lk] += np.einsum("hij,ihd->jhd", p, do)
    return dq, dk, dv


def torch_reference(q, k, v, q_lengths, k_lengths, causal, broadcast_q=False):
    """torch's scaled_dot_product_attention per sequence pair, in q's dtype (float64 here), with
    is_causal=True for top_left and an explicit boolean mask for bottom_right; differentiable. Rows
    without keys are left out of the call (SDPA gives NaN for them) and are 0 in the result."""
    import torch
    import torch.nn.functional as F

    mask = mask_name(causal)
    To = int(sum(lq for _, lq, _, _, _ in sequences(q_lengths, k_lengths, broadcast_q)))
    pieces = []
    for q0, lq, o0, k0, lk in sequences(q_lengths, k_lengths, broadcast_q):
        first = next((i for i in range(lq) if n_keys(mask, i, lq, lk) > 0), lq)
        if first > 0:
            pieces.append(torch.zeros(first, q.shape[1], 128, dtype=q.dtype))
        if first == lq:
            continue
        qs = q[q0 + first:q0 + lq].transpose(0, 1)  # (H, rows, 128)
        ks, vs = k[k0:k0 + lk].transpose(0, 1), v[k0:k0 + lk].transpose(0, 1)
        if mask == "top_left":
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=torch.from_numpy(allowed(mask, lq, lk)[first:]))
        pieces.append(o.transpose(0, 1))
    out = torch.cat(pieces) if pieces else torch.zeros(0, q.shape[1], 128, dtype=q.dtype)
    assert out.shape[0] == To
    return out


def inputs(q_lengths, k_lengths, seed=0, heads=H):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((t, heads, 128)).astype(np.float32)
                 for t in (sum(q_lengths), sum(k_lengths), sum(k_lengths)))


def metas(q_lengths, k_lengths):
    return mxflash.JaggedMeta.from_lengths(q_lengths), mxflash.JaggedMeta.from_lengths(k_lengths)


def f64(a):
    return np.asarray(a.astype(np.float32) if isinstance(a, np.ndarray) else a.float().cpu().numpy(), np.float64)


def u16(a):
    return np.asarray(a).view(np.uint16)


def check_forward(out, lse, ref_out, ref_lse, keys, tag, min_db=20.0):
    """out vs the float64 reference on rows with keys (SQNR), lse within 1.5 * scale (the quantized
    S), rows without keys out 0 and lse -inf."""
    rows = keys > 0
    assert np.all(f64(out)[~rows] == 0), f"{tag}: out of rows without keys must be 0"
    assert np.all(np.isneginf(lse[:, ~rows])), f"{tag}: lse of rows without keys must be -inf"
    db = sqnr_db(ref_out[rows], f64(out)[rows])
    assert db > min_db, f"{tag}: out SQNR {db:.1f} dB vs the float64 masked attention"
    err = np.abs(lse[:, rows] - ref_lse[:, rows])
    assert np.all(np.isfinite(lse[:, rows])) and err.max() < 1.5 * SCALE, f"{tag}: lse error {err.max():.3f}"


def check_lse_exact(lse, ops, q_meta, k_meta, q_lengths, k_lengths, mask, broadcast_q=False):
    """The LSE is computed from the unquantized S: on the dequantized MX inputs it is the masked
    float64 LSE to fp32 precision (a mask off by one key shows here)."""
    dq_, dk_, dv_ = (t.dequantize(m) for t, m in zip(ops, (q_meta, k_meta, k_meta)))
    _, want = attention_fp64(dq_, dk_, dv_, q_lengths, k_lengths, mask, broadcast_q=broadcast_q)
    rows = np.isfinite(want[0])
    assert np.array_equal(np.isfinite(lse[0]), rows), "rows with keys differ from the mask's"
    err = np.abs(lse[:, rows] - want[:, rows]) / np.maximum(1.0, np.abs(want[:, rows]))
    assert err.max() < 1e-5, f"{mask}: lse vs the masked float64 LSE of the MX inputs: {err.max():.1e}"


# ---------------------------------------------------------------------------- the tests' own rule
def test_reference_rule_is_the_headers():
    # top_left: j <= i; bottom_right: j <= i + Lk - Lq; no mask: every key
    assert [n_keys("top_left", i, 4, 2) for i in range(4)] == [1, 2, 2, 2]
    assert [n_keys("bottom_right", i, 4, 2) for i in range(4)] == [0, 0, 1, 2]
    assert [n_keys("bottom_right", i, 2, 5) for i in range(2)] == [4, 5]
    assert [n_keys("top_left", i, 2, 5) for i in range(2)] == [1, 2]
    assert [n_keys(None, i, 3, 5) for i in range(3)] == [5, 5, 5]
    assert all(n_keys(m, i, 6, 6) == i + 1 for m in MASKS for i in range(6))


@needs_torch
@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged", "broadcast_q"])
@pytest.mark.parametrize("mask", MASKS)
def test_float64_reference_is_torch_sdpa(mask, broadcast_q):
    """The masked float64 attention above is torch's SDPA (is_causal=True / an explicit mask) and
    torch.nn.attention.bias's causal_upper_left / causal_lower_right where they apply."""
    import torch

    ql, kl = ([BQ_LQ], BQ_K_LENGTHS) if broadcast_q else (Q_LENGTHS, K_LENGTHS)
    xq, xk, xv = inputs(ql, kl, seed=1)
    ref, _ = attention_fp64(xq, xk, xv, ql, kl, mask, broadcast_q=broadcast_q)
    got = torch_reference(*(torch.from_numpy(a).double() for a in (xq, xk, xv)), ql, kl, mask, broadcast_q)
    assert np.abs(got.numpy() - ref).max() < 1e-12
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    bias = causal_upper_left if mask == "top_left" else causal_lower_right
    q, k, v = (torch.from_numpy(a).double() for a in (xq, xk, xv))
    for q0, lq, o0, k0, lk in sequences(ql, kl, broadcast_q):
        if lq == 0 or lk == 0 or (mask == "bottom_right" and lq > lk):  # (NaN rows there)
            continue
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q0 + lq].transpose(0, 1), k[k0:k0 + lk].transpose(0, 1), v[k0:k0 + lk].transpose(0, 1),
            attn_mask=bias(lq, lk))
        assert np.abs(o.transpose(0, 1).numpy() - ref[o0:o0 + lq]).max() < 1e-12


# ---------------------------------------------------------------------------- CPU forward
@pytest.fixture(scope="module")
def case():
    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    x = inputs(Q_LENGTHS, K_LENGTHS)
    return qm, km, x, mx_operands(*x, qm, km)


@pytest.mark.parametrize("mask", MASKS)
def test_forward_matches_fp64_masked_attention(case, mask):
    qm, km, x, ops = case
    keys = row_keys(mask, Q_LENGTHS, K_LENGTHS)
    assert (keys == 0).any() and (keys > 0).any()
    out, lse = mxflash.attention_forward(*ops, qm, km, causal=mask)
    assert out.dtype == BF16 and out.shape == (sum(Q_LENGTHS), H, 128) and lse.shape == (H, sum(Q_LENGTHS))
    check_forward(out, lse, *attention_fp64(*x, Q_LENGTHS, K_LENGTHS, mask), keys, mask)
    check_lse_exact(lse, ops, qm, km, Q_LENGTHS, K_LENGTHS, mask)
    # and the mask does change the result (rows seeing fewer keys than the sequence has)
    full, _ = mxflash.attention_forward(*ops, qm, km)
    fewer = (keys > 0) & (keys < row_keys(None, Q_LENGTHS, K_LENGTHS))
    assert sqnr_db(f64(full)[fewer], f64(out)[fewer]) < 10


@needs_torch
@pytest.mark.parametrize("causal", [True, "top_left", "bottom_right"])
def test_forward_matches_torch_sdpa(case, causal):
    """The CPU forward of torch CPU tensors against torch's float64 SDPA with is_causal=True (True,
    "top_left") or the lower-right mask ("bottom_right")."""
    import torch

    qm, km, x, ops = case
    tops = [mxflash.MxTensor(torch_of(t.payload, torch, "cpu"), torch_of(t.scales, torch, "cpu"), t.orientation)
            for t in ops]
    out, lse = mxflash.attention_forward(*tops, qm, km, causal=causal)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref = torch_reference(*(torch.from_numpy(a).double() for a in x), Q_LENGTHS, K_LENGTHS, causal).numpy()
    keys = row_keys(mask_name(causal), Q_LENGTHS, K_LENGTHS)
    rows = keys > 0
    db = sqnr_db(ref[rows], out.float().numpy()[rows])
    assert db > 20, f"causal={causal!r}: out SQNR {db:.1f} dB vs torch SDPA in float64"
    assert (out.float().numpy()[~rows] == 0).all() and torch.isneginf(lse[:, ~rows]).all()


def test_spellings_of_the_option(case):
    qm, km, _, ops = case
    default = mxflash.attention_forward(*ops, qm, km)
    for off in (False, np.bool_(False)):
        o, l = mxflash.attention_forward(*ops, qm, km, causal=off)
        assert np.array_equal(u16(o), u16(default[0])) and np.array_equal(l, default[1], equal_nan=True)
    top = mxflash.attention_forward(*ops, qm, km, causal="top_left")
    for on in (True, np.bool_(True)):
        o, l = mxflash.attention_forward(*ops, qm, km, causal=on)
        assert np.array_equal(u16(o), u16(top[0])) and np.array_equal(l, top[1])


def test_square_sequences_give_one_mask():
    """Lq == Lk in every sequence: top_left and bottom_right are one mask, bit for bit."""
    lengths = [1, 33, 130, 0]
    qm, km = metas(lengths, lengths)
    x = inputs(lengths, lengths, seed=2)
    ops = mx_operands(*x, qm, km)
    a = mxflash.attention_forward(*ops, qm, km, causal="top_left")
    b = mxflash.attention_forward(*ops, qm, km, causal="bottom_right")
    assert np.array_equal(u16(a[0]), u16(b[0])) and np.array_equal(a[1], b[1])
    check_forward(*a, *attention_fp64(*x, lengths, lengths, "top_left"), row_keys("top_left", lengths, lengths),
                  "square")


@pytest.mark.parametrize("mask", MASKS)
def test_broadcast_q_equals_per_sequence_calls(mask):
    """One shared Q sequence against each K/V sequence: the mask counts the shared rows from 0
    against each K/V sequence's length, as B separate calls do."""
    lq, kl = BQ_LQ, BQ_K_LENGTHS
    x = inputs([lq], kl, seed=3)
    qm, km = metas([lq], kl)
    q, k, v = mx_operands(*x, qm, km)
    out, lse = mxflash.attention_forward(q, k, v, qm, km, broadcast_q=True, causal=mask)
    assert out.shape == (len(kl) * lq, H, 128)
    kc = cu(kl)
    for b, n in enumerate(kl):
        kmb = mxflash.JaggedMeta.from_lengths([n])
        kb = mxflash.quantize_mx(x[1][kc[b]:kc[b + 1]], kmb, "hdim")
        vb = mxflash.quantize_mx(x[2][kc[b]:kc[b + 1]], kmb, "seq")
        ob, lb = mxflash.attention_forward(q, kb, vb, qm, kmb, causal=mask)
        assert np.array_equal(u16(out[b * lq:(b + 1) * lq]), u16(ob)), f"sequence {b}"
        assert np.array_equal(lse[:, b * lq:(b + 1) * lq], lb), f"sequence {b}"
    keys = row_keys(mask, [lq], kl, broadcast_q=True)
    check_forward(out, lse, *attention_fp64(*x, [lq], kl, mask, broadcast_q=True), keys, f"broadcast {mask}")
    check_lse_exact(lse, (q, k, v), qm, km, [lq], kl, mask, broadcast_q=True)


@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged", "broadcast_q"])
@pytest.mark.parametrize("mask", MASKS)
def test_forward_on_operands_matches_mx_forward(mask, broadcast_q):
    ql, kl = ([BQ_LQ], BQ_K_LENGTHS) if broadcast_q else (Q_LENGTHS, K_LENGTHS)
    qm, km = metas(ql, kl)
    x = inputs(ql, kl, seed=4)
    ops = mxflash.quantize_attention_forward(*x, qm, km)
    out, lse = mxflash.attention_forward_operands(ops, qm, km, broadcast_q=broadcast_q, causal=mask)
    keys = row_keys(mask, ql, kl, broadcast_q)
    want = mxflash.attention_forward(*mx_operands(*x, qm, km), qm, km, broadcast_q=broadcast_q, causal=mask)
    rows = keys > 0
    assert sqnr_db(f64(want[0])[rows], f64(out)[rows]) > 40  # the operands' coarser scales only
    check_forward(out, lse, *attention_fp64(*x, ql, kl, mask, broadcast_q=broadcast_q), keys, f"operands {mask}")


def test_out_argument_with_a_mask(case):
    qm, km, _, ops = case
    To = sum(Q_LENGTHS)
    o, l = sentinel((To, H, 128), BF16), sentinel((H, To), np.float32)
    ro, rl = mxflash.attention_forward(*ops, qm, km, out=(o, l), causal="bottom_right")
    want = mxflash.attention_forward(*ops, qm, km, causal="bottom_right")
    assert ro is o and rl is l
    assert np.array_equal(u16(o), u16(want[0])) and np.array_equal(l, want[1])


# ---------------------------------------------------------------------------- CPU backward
def run_backward(q_lengths, k_lengths, mask, broadcast_q=False, seed=5):
    qm, km = metas(q_lengths, k_lengths)
    x = inputs(q_lengths, k_lengths, seed=seed)
    ops = dict(q=mxflash.quantize_mx(x[0], qm, "hdim"), q_seq=mxflash.quantize_mx(x[0], qm, "seq"),
               k=mxflash.quantize_mx(x[1], km, "hdim"), k_seq=mxflash.quantize_mx(x[1], km, "seq"),
               v=mxflash.quantize_mx(x[2], km, "hdim"))
    out, lse = mxflash.attention_forward(ops["q"], ops["k"], mxflash.quantize_mx(x[2], km, "seq"), qm, km,
                                         broadcast_q=broadcast_q, causal=mask)
    dout = np.random.default_rng(seed + 1).standard_normal(out.shape).astype(BF16)
    grads = mxflash.attention_backward(ops["q"], ops["q_seq"], ops["k"], ops["k_seq"], ops["v"], out, dout, lse,
                                       qm, km, broadcast_q=broadcast_q, causal=mask)
    want = backward_fp64(*x, dout.astype(np.float32), q_lengths, k_lengths, mask, broadcast_q=broadcast_q)
    return dict(qm=qm, km=km, x=x, ops=ops, out=out, lse=lse, dout=dout, grads=grads, want=want)


def check_grads(grads, want, q_lengths, k_lengths, mask, broadcast_q=False, min_db=15.0, tag=""):
    """Gradients vs float64 (SQNR), with the mask's exact zeros: dq of Q rows that attend no key in
    any sequence, dk and dv of keys no row attends."""
    names = ("dq", "dk", "dv")
    for name, g, w in zip(names, grads, want):
        assert g.shape == w.shape, name
        db = sqnr_db(w, f64(g))
        assert db > min_db, f"{tag} {mask}: {name} SQNR {db:.1f} dB vs float64"
    dq, dk, dv = (f64(g) for g in grads)
    seen = attended_keys(mask, q_lengths, k_lengths, broadcast_q)
    assert (dk[~seen] == 0).all() and (dv[~seen] == 0).all(), f"{tag} {mask}: keys nobody attends"
    keys = row_keys(mask, q_lengths, k_lengths, broadcast_q)
    if broadcast_q:
        keys = keys.reshape(len(k_lengths), q_lengths[0]).max(0)  # a shared row attends a key in some sequence
    assert (dq[keys == 0] == 0).all(), f"{tag} {mask}: rows without keys"


@pytest.mark.parametrize("mask", MASKS)
def test_backward_matches_fp64_masked_backward(mask):
    r = run_backward(Q_LENGTHS, K_LENGTHS, mask)
    for g in r["grads"]:
        assert g.dtype == BF16
    check_grads(r["grads"], r["want"], Q_LENGTHS, K_LENGTHS, mask)
    assert (row_keys(mask, Q_LENGTHS, K_LENGTHS) == 0).any()


@pytest.mark.parametrize("mask", MASKS)
def test_backward_broadcast_q(mask):
    r = run_backward([BQ_LQ], BQ_K_LENGTHS, mask, broadcast_q=True, seed=7)
    check_grads(r["grads"], r["want"], [BQ_LQ], BQ_K_LENGTHS, mask, broadcast_q=True)


def test_backward_mask_must_be_the_forwards():
    """The backward recomputes P under its own mask: the forward's gives the masked gradients, no
    mask gives others (so a saved backward must carry the forward's mask)."""
    r = run_backward(Q_LENGTHS, K_LENGTHS, "top_left", seed=9)
    o = r["ops"]
    plain = mxflash.attention_backward(o["q"], o["q_seq"], o["k"], o["k_seq"], o["v"], r["out"], r["dout"], r["lse"],
                                       r["qm"], r["km"])
    assert sqnr_db(r["want"][1], f64(plain[1])) < sqnr_db(r["want"][1], f64(r["grads"][1])) - 10


@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged", "broadcast_q"])
@pytest.mark.parametrize("mask", MASKS)
def test_backward_on_operands_matches_mx_backward(mask, broadcast_q):
    ql, kl = ([BQ_LQ], BQ_K_LENGTHS) if broadcast_q else (Q_LENGTHS, K_LENGTHS)
    r = run_backward(ql, kl, mask, broadcast_q=broadcast_q, seed=11)
    bops = mxflash.quantize_attention_backward(*r["x"], r["qm"], r["km"])
    got = mxflash.attention_backward_operands(bops, r["out"], r["dout"], r["lse"], r["qm"], r["km"],
                                              broadcast_q=broadcast_q, causal=mask)
    for name, g, w in zip(("dq", "dk", "dv"), got, r["grads"]):
        assert g.dtype == BF16, name
        # the two differ only in Q, K along tokens (per tile here, per channel there)
        assert sqnr_db(f64(w), f64(g)) > 40, f"{mask}: {name}"
    check_grads(got, r["want"], ql, kl, mask, broadcast_q, tag="operands")


# ---------------------------------------------------------------------------- autograd
def autograd_case(device, dtype, causal, q_lengths=Q_LENGTHS, k_lengths=K_LENGTHS, broadcast_q=False, seed=13):
    """mx_attention forward and backward; returns (leaves, out, dout)."""
    import torch
    from mxflash.autograd import mx_attention

    qm, km = metas(q_lengths, k_lengths)
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(t, H, 128, generator=g).to(device=device, dtype=dtype).requires_grad_()
              for t in (sum(q_lengths), sum(k_lengths), sum(k_lengths))]
    out = mx_attention(*leaves, qm, km, broadcast_q=broadcast_q, causal=causal)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    (out.float() * dout).sum().backward()
    return leaves, out, dout


@needs_torch
@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged", "broadcast_q"])
@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_mx_attention_gradients_against_float64_torch(causal, broadcast_q):
    """mx_attention(causal=...) on CPU tensors against torch float64 autograd through SDPA with the
    same mask; the backward runs with the forward's mask (rows without keys: out and dq 0; keys
    nobody attends: dk, dv 0)."""
    import torch

    ql, kl = ([BQ_LQ], BQ_K_LENGTHS) if broadcast_q else (Q_LENGTHS, K_LENGTHS)
    (q, k, v), out, dout = autograd_case("cpu", torch.float32, causal, ql, kl, broadcast_q)
    assert out.dtype == torch.bfloat16
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch_reference(rq, rk, rv, ql, kl, causal, broadcast_q)
    (ref * dout.double()).sum().backward()
    mask = mask_name(causal)
    keys = row_keys(mask, ql, kl, broadcast_q)
    rows = keys > 0
    assert sqnr_db(ref.detach().numpy()[rows], out.detach().float().numpy()[rows]) > 20
    assert (out.detach().float().numpy()[~rows] == 0).all()
    grads = [t.grad for t in (q, k, v)]
    for gr in grads:
        assert gr.dtype == torch.float32
    check_grads([gr.numpy() for gr in grads], [t.grad.numpy() for t in (rq, rk, rv)], ql, kl, mask, broadcast_q,
                tag="mx_attention")


@needs_torch
@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_mx_attention_backward_is_the_forwards_mask(causal):
    """The gradients mx_attention's saved backward gives are attention_backward_operands' with the
    forward's mask, bit for bit."""
    import torch

    (q, k, v), out, dout = autograd_case("cpu", torch.float32, causal, seed=17)
    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    xs = [t.detach().contiguous() for t in (q, k, v)]
    fwd, bwd = mxflash.quantize_attention_training(*xs, qm, km)
    o, lse = mxflash.attention_forward_operands(fwd, qm, km, causal=causal)
    assert torch.equal(o.view(torch.int16), out.detach().view(torch.int16))
    want = mxflash.attention_backward_operands(bwd, o, dout.to(torch.bfloat16), lse, qm, km, causal=causal)
    for name, got, w in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert torch.equal(got, w.float()), name


@needs_torch
def test_mx_attention_default_is_non_causal():
    import torch

    a = autograd_case("cpu", torch.float32, False, seed=19)
    from mxflash.autograd import mx_attention

    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    leaves = [t.detach().clone().requires_grad_() for t in a[0]]
    out = mx_attention(*leaves, qm, km)
    (out.float() * a[2]).sum().backward()
    assert torch.equal(out.view(torch.int16), a[1].view(torch.int16))
    for x, y in zip(leaves, a[0]):
        assert torch.equal(x.grad, y.grad)


# ---------------------------------------------------------------------------- bad values
BAD = ["causal", "TOP_LEFT", "top-left", "none", "lower_right", "", 1, 0, 2, 1.0, None, [True]]


@pytest.mark.parametrize("bad", BAD, ids=[repr(b) for b in BAD])
def test_bad_causal_values_raise_naming_causal_and_write_nothing(case, bad):
    qm, km, x, ops = case
    To = sum(Q_LENGTHS)
    o, l = sentinel((To, H, 128), BF16), sentinel((H, To), np.float32)
    with pytest.raises(ValueError, match="^causal: "):
        mxflash.attention_forward(*ops, qm, km, out=(o, l), causal=bad)
    fops = mxflash.quantize_attention_forward(*x, qm, km)
    with pytest.raises(ValueError, match="^causal: "):
        mxflash.attention_forward_operands(fops, qm, km, out=(o, l), causal=bad)
    assert untouched(o, l)
    out, lse = mxflash.attention_forward(*ops, qm, km)
    dout = np.ones(out.shape, BF16)
    g = [sentinel((sum(Q_LENGTHS), H, 128), BF16), sentinel((sum(K_LENGTHS), H, 128), BF16),
         sentinel((sum(K_LENGTHS), H, 128), BF16)]
    mx = dict(q=ops[0], q_seq=mxflash.quantize_mx(x[0], qm, "seq"), k=ops[1], k_seq=mxflash.quantize_mx(x[1], km, "seq"),
              v=mxflash.quantize_mx(x[2], km, "hdim"))
    with pytest.raises(ValueError, match="^causal: "):
        mxflash.attention_backward(**mx, out=out, dout=dout, lse=lse, q_meta=qm, k_meta=km, grads=g, causal=bad)
    bops = mxflash.quantize_attention_backward(*x, qm, km)
    with pytest.raises(ValueError, match="^causal: "):
        mxflash.attention_backward_operands(bops, out, dout, lse, qm, km, grads=g, causal=bad)
    assert untouched(*g)


@needs_torch
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_mx_attention_bad_causal_raises(bad):
    import torch
    from mxflash.autograd import mx_attention

    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    q = torch.zeros(sum(Q_LENGTHS), H, 128, requires_grad=True)
    k = torch.zeros(sum(K_LENGTHS), H, 128)
    with pytest.raises(ValueError, match="^causal: must be False, True, \"top_left\" or \"bottom_right\""):
        mx_attention(q, k, k, qm, km, causal=bad)


def test_the_code_reaches_the_library(case, monkeypatch):
    """Each entry point hands its mask code to the C++ launcher: an out-of-range code (as a bad
    Python value would give, were it not refused first) comes back as the library's own error."""
    qm, km, x, ops = case
    monkeypatch.setattr(mxflash, "_causal_code", lambda causal: 7)
    message = "^causal: must be none, top_left or bottom_right"
    with pytest.raises(ValueError, match=message):
        mxflash.attention_forward(*ops, qm, km)
    fops = mxflash.quantize_attention_forward(*x, qm, km)
    with pytest.raises(ValueError, match=message):
        mxflash.attention_forward_operands(fops, qm, km)
    monkeypatch.undo()
    out, lse = mxflash.attention_forward(*ops, qm, km)
    dout = np.ones(out.shape, BF16)
    monkeypatch.setattr(mxflash, "_causal_code", lambda causal: 7)
    with pytest.raises(ValueError, match=message):
        mxflash.attention_backward(ops[0], mxflash.quantize_mx(x[0], qm, "seq"), ops[1],
                                   mxflash.quantize_mx(x[1], km, "seq"), mxflash.quantize_mx(x[2], km, "hdim"),
                                   out, dout, lse, qm, km)
    with pytest.raises(ValueError, match=message):
        mxflash.attention_backward_operands(mxflash.quantize_attention_backward(*x, qm, km), out, dout, lse, qm, km)


def test_bindings_take_the_mask_code():
    """The extension's CausalMask codes, and its workspace sizes accepting one (trailing, default 0)."""
    from mxflash import _mxflash

    assert _mxflash.CAUSAL_MASKS == {"none": 0, "top_left": 1, "bottom_right": 2}
    qm, km = metas(Q_LENGTHS, K_LENGTHS)
    for code in (0, 1, 2):
        for size in (_mxflash.attention_forward_workspace_size, _mxflash.attention_forward_operands_workspace_size):
            assert size(qm._host, km._host, H, False, code) >= 0
        for size in (_mxflash.attention_backward_workspace_size, _mxflash.attention_backward_operands_workspace_size):
            assert size(qm._host, km._host, H, False, False, code) >= 0


# ---------------------------------------------------------------------------- CUDA
GPU_Q_LENGTHS = [200, 0, 130, 1, 77, 128, 1000, 40, 512]
GPU_K_LENGTHS = [300, 5, 0, 129, 128, 1, 1000, 700, 130]
GPU_BQ_LQ, GPU_BQ_K_LENGTHS = 300, [1000, 0, 129, 1, 300, 77]


def gpu_case(broadcast_q):
    return ([GPU_BQ_LQ], GPU_BQ_K_LENGTHS) if broadcast_q else (GPU_Q_LENGTHS, GPU_K_LENGTHS)


@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged", "broadcast_q"])
@pytest.mark.parametrize("mask", MASKS)
def test_cuda_forward_equals_cpu(torch_cuda, mask, broadcast_q):
    torch = torch_cuda
    ql, kl = gpu_case(broadcast_q)
    qm, km = metas(ql, kl)
    x = inputs(ql, kl, seed=21)
    ops = mx_operands(*x, qm, km)
    keys = row_keys(mask, ql, kl, broadcast_q)
    cpu = mxflash.attention_forward(*ops, qm, km, softmax_scale=0.1, broadcast_q=broadcast_q, causal=mask)
    assert np.array_equal(np.isneginf(cpu[1][0]), keys == 0), "the CPU path's rows without keys"
    gpu = mxflash.attention_forward(*(mx_to(t, torch) for t in ops), qm, km, softmax_scale=0.1,
                                    broadcast_q=broadcast_q, causal=mask)
    compare_gpu_cpu(gpu, cpu, f"MX forward {mask}, broadcast_q={broadcast_q}")
    fops = mxflash.quantize_attention_forward(*(torch_of(a, torch) for a in x), qm, km)
    gpu_ops = mxflash.attention_forward_operands(fops, qm, km, softmax_scale=0.1, broadcast_q=broadcast_q,
                                                 causal=mask)
    compare_gpu_cpu(gpu_ops, cpu, f"operands forward {mask}, broadcast_q={broadcast_q}")
    # the masked result is not the unmasked one
    full = mxflash.attention_forward(*(mx_to(t, torch) for t in ops), qm, km, softmax_scale=0.1,
                                     broadcast_q=broadcast_q)
    fewer = (keys > 0) & (keys < row_keys(None, ql, kl, broadcast_q))
    assert sqnr_db(full[0].float().cpu().numpy()[fewer], gpu[0].float().cpu().numpy()[fewer]) < 10


@pytest.mark.parametrize("broadcast_q", [False, True], ids=["jagged", "broadcast_q"])
@pytest.mark.parametrize("mask", MASKS)
def test_cuda_backward_fast_and_exact_equal_cpu(torch_cuda, mask, broadcast_q):
    torch = torch_cuda
    ql, kl = gpu_case(broadcast_q)
    r = run_backward(ql, kl, mask, broadcast_q=broadcast_q, seed=23)
    dev = {n: mx_to(t, torch) for n, t in r["ops"].items()}
    args = (dev["q"], dev["q_seq"], dev["k"], dev["k_seq"], dev["v"], torch_of(r["out"], torch),
            torch_of(r["dout"], torch), torch_of(r["lse"], torch), r["qm"], r["km"])
    fast = mxflash.attention_backward(*args, broadcast_q=broadcast_q, causal=mask)
    again = mxflash.attention_backward(*args, broadcast_q=broadcast_q, causal=mask)
    exact = mxflash.attention_backward(*args, broadcast_q=broadcast_q, causal=mask, exact_mx=True)
    torch.cuda.synchronize()
    for name, g, g2, e, want in zip(("dq", "dk", "dv"), fast, again, exact, r["grads"]):
        assert torch.equal(g.view(torch.int16), g2.view(torch.int16)), f"{mask} {name}: not deterministic"
        assert sqnr_db(f64(want), f64(g)) > 20, f"{mask} {name}: fast kernel vs the CPU path"
        assert sqnr_db(f64(want), f64(e)) > 60, f"{mask} {name}: exact GPU path vs the CPU path"
    check_grads([g.float().cpu().numpy() for g in fast], r["want"], ql, kl, mask, broadcast_q, tag="GPU fast")
    bops = mxflash.quantize_attention_backward(*(torch_of(a, torch) for a in r["x"]), r["qm"], r["km"])
    got = mxflash.attention_backward_operands(bops, *args[5:8], r["qm"], r["km"], broadcast_q=broadcast_q,
                                              causal=mask)
    for name, g, want in zip(("dq", "dk", "dv"), got, r["grads"]):
        assert sqnr_db(f64(want), f64(g)) > 20, f"{mask} {name}: GPU backward on operands vs the CPU path"


@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_cuda_mx_attention_matches_cpu(torch_cuda, causal):
    torch = torch_cuda
    ql, kl = gpu_case(False)
    (qc, kc, vc), outc, _ = autograd_case("cpu", torch.bfloat16, causal, ql, kl, seed=25)
    (qg, kg, vg), outg, _ = autograd_case("cuda", torch.bfloat16, causal, ql, kl, seed=25)
    assert sqnr_db(outc.float().detach(), outg.float().cpu().detach()) > 35
    for name, a, b in (("dq", qc.grad, qg.grad), ("dk", kc.grad, kg.grad), ("dv", vc.grad, vg.grad)):
        assert sqnr_db(a.float(), b.float().cpu()) > 20, name
    mask = mask_name(causal)
    seen = attended_keys(mask, ql, kl)
    assert (kg.grad.float().cpu().numpy()[~seen] == 0).all() and (vg.grad.float().cpu().numpy()[~seen] == 0).all()
    assert (qg.grad.float().cpu().numpy()[row_keys(mask, ql, kl) == 0] == 0).all()
