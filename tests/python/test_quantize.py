"""MX quantize / dequantize / layout converters against a numpy oracle written here.

The oracle implements REFERENCE.md §2-3 directly: block amax (NaN-propagating), scale byte from
the §2 formulas (test_codecs.py), elements x / 2^(clamped scale exponent) clipped to +-448 and
rounded by ml_dtypes, plain layouts by indexing, blocked128x4 by the §3 byte formulas. CUDA tests
compare the GPU results with the CPU results byte for byte; they skip, saying why, without torch,
a CUDA device or a CUDA build (MXFLASH_REQUIRE_CUDA=1 turns those skips into failures).
"""
import functools
import importlib.util

import ml_dtypes
import numpy as np
import pytest

import mxflash
from test_codecs import scale_bytes

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16
LENGTH_SET = [0, 1, 31, 32, 33, 127, 128, 129, 1000]
MODES = ["rceil", "floor"]
# (orientation, scale_layout, payload_layout): every valid combination
COMBOS = [(o, sl, pl) for o in ["hdim", "seq", "square32"] for sl in ["plain", "blocked128x4"]
          for pl in ["token_major", "token_contiguous"] if not (o == "hdim" and pl == "token_contiguous")]


# ---------------------------------------------------------------------------- oracle
def quantize_elements(v, byte):
    """x / 2^e with e = byte - 127 clamped to [-126, 127] (REFERENCE.md §2), clipped to +-448,
    round to nearest even (ml_dtypes). Returns e4m3 bytes."""
    e = np.clip(byte.astype(np.int64) - 127, -126, 127)
    scale = np.exp2(e.astype(np.float64)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.clip(v.astype(np.float32) / scale, -448.0, 448.0)
        return q.astype(E4M3).view(np.uint8)


def amax_of(v, axis):
    return np.max(np.abs(v), axis=axis)  # np.max propagates NaN


class Oracle:
    """Plain-layout MX tensors of x (T, H, 128) for one mode, plus the layout transforms."""

    def __init__(self, x, lengths, mode):
        xf = np.asarray(x).astype(np.float32)
        self.lengths = list(lengths)
        self.cu = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.sf = np.concatenate([[0], np.cumsum([-(-n // 128) * 128 for n in self.lengths])]).astype(np.int64)
        T, H, _ = xf.shape
        self.T, self.H, self.P = T, H, int(self.sf[-1])
        G = self.P // 32
        # hdim: blocks of 32 head-dim values
        blk = xf.reshape(T, H, 4, 32)
        self.hdim_scales = scale_bytes(amax_of(blk, -1), mode)
        self.hdim_payload = quantize_elements(blk, self.hdim_scales[..., None]).reshape(T, H, 128)
        # seq and square32: blocks of 32 tokens from each sequence start, tail zero-padded
        self.seq_scales = np.zeros((G, H, 128), np.uint8)
        self.sq_scales = np.zeros((G, H, 4), np.uint8)
        self.seq_payload = np.zeros((T, H, 128), np.uint8)
        self.sq_payload = np.zeros((T, H, 128), np.uint8)
        for b, n in enumerate(self.lengths):
            if n == 0:
                continue
            g = -(-n // 32)
            pad = np.zeros((g * 32, H, 128), np.float32)
            pad[:n] = xf[self.cu[b]:self.cu[b + 1]]
            g0 = self.sf[b] // 32
            sb = pad.reshape(g, 32, H, 128)
            s = scale_bytes(amax_of(sb, 1), mode)
            self.seq_scales[g0:g0 + g] = s
            self.seq_payload[self.cu[b]:self.cu[b + 1]] = quantize_elements(sb, s[:, None]).reshape(-1, H, 128)[:n]
            qb = pad.reshape(g, 32, H, 4, 32)
            s = scale_bytes(amax_of(qb, (1, 4)), mode)
            self.sq_scales[g0:g0 + g] = s
            self.sq_payload[self.cu[b]:self.cu[b + 1]] = (
                quantize_elements(qb, s[:, None, :, :, None]).reshape(-1, H, 128)[:n])

    def padded_index(self):
        """Padded token index of every real token."""
        return np.concatenate([self.sf[b] + np.arange(n) for b, n in enumerate(self.lengths)] +
                              [np.zeros(0, np.int64)]).astype(np.int64)

    def token_contiguous(self, payload):
        out = np.zeros((self.H, 128, self.P), np.uint8)
        out[:, :, self.padded_index()] = payload.transpose(1, 2, 0)
        return out

    def blocked_hdim(self, per_token):
        """(T, H, 4) per-token bytes -> (H*P/4, 16) blocked: R = h*P + t',
        addr = 512*(R//128) + 16*(R%32) + 4*((R%128)//32) + k."""
        tp = self.padded_index()[:, None, None]
        h = np.arange(self.H)[None, :, None]
        k = np.arange(4)[None, None, :]
        R = h * self.P + tp
        addr = 512 * (R // 128) + 16 * (R % 32) + 4 * ((R % 128) // 32) + k
        out = np.zeros(self.H * self.P * 4, np.uint8)
        out[addr.reshape(-1)] = per_token.reshape(-1)
        assert np.unique(addr).size == addr.size
        return out.reshape(self.H * self.P // 4, 16)

    def blocked_seq(self, plain):
        """(P/32, H, 128) -> (H*32, P/8): addr = 512*(h*P/128 + g//4) + 16*(d%32) + 4*(d//32) + g%4."""
        g = np.arange(self.P // 32)[:, None, None]
        h = np.arange(self.H)[None, :, None]
        d = np.arange(128)[None, None, :]
        addr = 512 * (h * (self.P // 128) + g // 4) + 16 * (d % 32) + 4 * (d // 32) + g % 4
        out = np.zeros(self.H * self.P * 4, np.uint8)
        out[addr.reshape(-1)] = plain.reshape(-1)
        assert np.unique(addr).size == addr.size
        return out.reshape(self.H * 32, self.P // 8)

    def expected(self, orientation, scale_layout, payload_layout):
        if orientation == "hdim":
            payload, plain = self.hdim_payload, self.hdim_scales
        elif orientation == "seq":
            payload, plain = self.seq_payload, self.seq_scales
        else:
            payload, plain = self.sq_payload, self.sq_scales
        if payload_layout == "token_contiguous":
            payload = self.token_contiguous(payload)
        if scale_layout == "plain":
            return payload, plain
        if orientation == "hdim":
            return payload, self.blocked_hdim(plain)
        if orientation == "seq":
            return payload, self.blocked_seq(plain)
        # square32 blocked: the hdim blocked tensor, each real token row carrying its block's scale
        per_token = plain[self.padded_index() // 32]
        return payload, self.blocked_hdim(per_token)


def decode(payload, scales_per_element):
    """e4m3 bytes * 2^(byte-127) in float32 via ml_dtypes (the product of two exact floats)."""
    q = payload.view(E4M3).astype(np.float32)
    s = scales_per_element.view(E8M0).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return q * s


# ---------------------------------------------------------------------------- data
def make_x(lengths, H, dtype, seed, hostile=False):
    """Normal data with magnitudes varying per (token, head, hdim block) and per column, some
    all-zero hdim blocks and all-zero columns; `hostile` adds NaN, +-inf, fp32 subnormals, -0,
    500 and 3e38 at random places."""
    rng = np.random.default_rng(seed)
    T = int(sum(lengths))
    x = rng.standard_normal((T, H, 128)).astype(np.float32)
    x *= np.exp2(rng.integers(-6, 7, (T, H, 4, 1))).repeat(32, axis=-1).reshape(T, H, 128).astype(np.float32)
    x *= np.exp2(rng.integers(-4, 5, (1, H, 128))).astype(np.float32)
    if T:
        x.reshape(T, H, 4, 32)[rng.random((T, H, 4)) < 0.02] = 0.0
        x[:, :, rng.integers(0, 128, 3)] = 0.0
    if hostile and T:
        specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e-40, -3e-42, -0.0, 500.0, 3e38], np.float32)
        mask = rng.random(x.shape) < 0.002
        x[mask] = rng.choice(specials, int(mask.sum()))
    return x.astype(dtype)


@functools.lru_cache(maxsize=None)
def case(H, dtype_name, mode, hostile, batch):
    """(lengths, meta, x, oracle) for one configuration; cached across the parametrized tests."""
    rng = np.random.default_rng(1000 * H + 7 * batch)
    if batch == 0:
        lengths = [int(n) for n in rng.permutation(LENGTH_SET)]
    else:
        lengths = [int(n) for n in rng.choice(LENGTH_SET, 6)]
    dtype = {"bfloat16": BF16, "float32": np.float32}[dtype_name]
    x = make_x(lengths, H, dtype, seed=H * 31 + batch + 3 * hostile, hostile=hostile)
    return lengths, mxflash.JaggedMeta.from_lengths(lengths), x, Oracle(x, lengths, mode)


def as_bytes(a):
    return np.asarray(a).view(np.uint8)


def assert_same_floats(got, want):
    """Bit-identical except that any NaN matches any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    gn, wn = np.isnan(got), np.isnan(want)
    assert np.array_equal(gn, wn), f"NaN positions differ: {np.flatnonzero(gn != wn)[:8]}"
    bad = np.flatnonzero(got.view(np.uint32)[~gn] != want.view(np.uint32)[~wn])
    assert bad.size == 0, f"{bad.size} values differ, e.g. {got[~gn][bad[:5]]} vs {want[~wn][bad[:5]]}"


# ---------------------------------------------------------------------------- CPU: quantize
@pytest.mark.parametrize("orientation,scale_layout,payload_layout", COMBOS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
@pytest.mark.parametrize("H,batch", [(1, 0), (3, 0), (3, 1)])
def test_quantize_matches_oracle(H, batch, dtype_name, mode, orientation, scale_layout, payload_layout):
    lengths, meta, x, oracle = case(H, dtype_name, mode, False, batch)
    payload, scales = mxflash.quantize(x, meta, orientation, mode, scale_layout, payload_layout)
    want_p, want_s = oracle.expected(orientation, scale_layout, payload_layout)
    assert payload.dtype == E4M3 and scales.dtype == np.uint8
    assert scales.shape == mxflash.scale_shape(meta, H, orientation, scale_layout) == want_s.shape
    assert payload.shape == mxflash.payload_shape(meta, H, payload_layout) == want_p.shape
    assert np.array_equal(scales, want_s)
    assert np.array_equal(as_bytes(payload), want_p)


@pytest.mark.parametrize("orientation,scale_layout,payload_layout", COMBOS)
@pytest.mark.parametrize("mode", MODES)
def test_quantize_hostile_values_match_oracle(mode, orientation, scale_layout, payload_layout):
    _, meta, x, oracle = case(3, "float32", mode, True, 1)
    assert np.isnan(x).any() and np.isinf(x).any()
    payload, scales = mxflash.quantize(x, meta, orientation, mode, scale_layout, payload_layout)
    want_p, want_s = oracle.expected(orientation, scale_layout, payload_layout)
    assert np.array_equal(scales, want_s)
    assert np.array_equal(as_bytes(payload), want_p)
    assert (scales == 0xFF).any()


@pytest.mark.parametrize("scale_layout", ["plain", "blocked128x4"])
@pytest.mark.parametrize("payload_layout", ["token_major", "token_contiguous"])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_hdim_seq_equals_separate_calls(mode, payload_layout, scale_layout):
    _, meta, x, _ = case(3, "bfloat16", mode, False, 1)
    ph, sh, ps, ss = mxflash.quantize_hdim_seq(x, meta, mode, scale_layout, payload_layout)
    wph, wsh = mxflash.quantize(x, meta, "hdim", mode, scale_layout)
    wps, wss = mxflash.quantize(x, meta, "seq", mode, scale_layout, payload_layout)
    for got, want in [(ph, wph), (sh, wsh), (ps, wps), (ss, wss)]:
        assert got.shape == want.shape and np.array_equal(as_bytes(got), as_bytes(want))


def test_reference_example_shapes_and_bytes():
    lengths, H = [17, 0, 129], 16
    meta = mxflash.JaggedMeta.from_lengths(lengths)
    assert list(meta.cu_seqlens) == [0, 17, 17, 146]
    assert list(meta.cu_seqlens_sf) == [0, 128, 128, 384]
    assert meta.max_seqlen == 129 and meta.padded_tokens == 384
    assert mxflash.scale_shape(meta, H, "hdim", "blocked128x4") == (1536, 16)
    assert mxflash.scale_shape(meta, H, "seq", "blocked128x4") == (512, 48)
    x = make_x(lengths, H, BF16, seed=5)
    oracle = Oracle(x, lengths, "rceil")
    for o in ["hdim", "seq"]:
        payload, scales = mxflash.quantize(x, meta, o, scale_layout="blocked128x4")
        want_p, want_s = oracle.expected(o, "blocked128x4", "token_major")
        assert scales.shape == {"hdim": (1536, 16), "seq": (512, 48)}[o]
        assert np.array_equal(scales, want_s) and np.array_equal(as_bytes(payload), want_p)


# ---------------------------------------------------------------------------- CPU: exact values
def one_block_input(values, orientation):
    """x (32, 1, 128) float32, zero except one block holding `values` (32 of them)."""
    x = np.zeros((32, 1, 128), np.float32)
    v = np.asarray(values, np.float32)
    if orientation == "hdim":
        x[0, 0, :32] = v
    elif orientation == "seq":
        x[:, 0, 5] = v
    else:
        x[:, 0, 32:64] = 0.0
        x[0, 0, 32:64] = v  # one token row of the square block 1
    return x


def block_of(payload, scales, orientation):
    p = as_bytes(payload)
    if orientation == "hdim":
        return p[0, 0, :32], scales[0, 0, 0]
    if orientation == "seq":
        return p[:, 0, 5], scales[0, 0, 5]
    return p[0, 0, 32:64], scales[0, 0, 1]


@pytest.mark.parametrize("orientation", ["hdim", "seq", "square32"])
def test_block_max_500(orientation):
    meta = mxflash.JaggedMeta.from_lengths([32])
    vals = np.zeros(32, np.float32)
    vals[:4] = [500.0, -1.0, 3.0, 250.0]
    x = one_block_input(vals, orientation)
    # FLOOR: floor(log2 500) = 8 -> scale 2^0 (byte 127); 500 clips to 448 (0x7E); 250 lies
    # between e4m3 240 and 256 (spacing 16 in [128, 256)) and is nearer 256
    p, s = block_of(*mxflash.quantize(x, meta, orientation, "floor"), orientation)
    assert s == 127 and p[0] == 0x7E
    assert list(p[:4].view(E4M3).astype(np.float32)) == [448.0, -1.0, 3.0, 256.0]
    # RCEIL: 500/448 = 1.116 -> scale 2^1 (byte 128); 500/2 = 250 rounds to 256 as above;
    # 250/2 = 125 rounds to 128 (spacing 8 in [64, 128): 120|128)
    p, s = block_of(*mxflash.quantize(x, meta, orientation, "rceil"), orientation)
    assert s == 128
    assert list(p[:4].view(E4M3).astype(np.float32)) == [256.0, -0.5, 1.5, 128.0]


@pytest.mark.parametrize("orientation", ["hdim", "seq", "square32"])
@pytest.mark.parametrize("mode", MODES)
def test_special_blocks(orientation, mode):
    meta = mxflash.JaggedMeta.from_lengths([32])
    # all-zero block: scale byte 0, zero payload
    p, s = block_of(*mxflash.quantize(one_block_input(np.zeros(32), orientation), meta, orientation, mode),
                    orientation)
    assert s == 0 and not p.any()
    # NaN in a block: scale 0xFF, NaN element -> e4m3 NaN; finite elements divided by 2^127 -> 0
    vals = np.ones(32, np.float32)
    vals[3] = np.nan
    p, s = block_of(*mxflash.quantize(one_block_input(vals, orientation), meta, orientation, mode), orientation)
    assert s == 0xFF and p[3] == 0x7F and not np.delete(p, 3).any()
    # inf: scale 0xFF; +-inf saturate to +-448
    vals = np.ones(32, np.float32)
    vals[0], vals[1] = np.inf, -np.inf
    p, s = block_of(*mxflash.quantize(one_block_input(vals, orientation), meta, orientation, mode), orientation)
    assert s == 0xFF and p[0] == 0x7E and p[1] == 0xFE and not p[2:].any()
    # fp32-subnormal block: RCEIL ratio is subnormal -> byte 1; FLOOR clamps to byte 0; both divide
    # by 2^-126, so 1e-40 becomes 1e-40 * 2^126 = 0.0085 -> e4m3 0.0087890625 (4.5 * 2^-9 -> 4 or 5 units)
    vals = np.zeros(32, np.float32)
    vals[0] = 1e-40
    p, s = block_of(*mxflash.quantize(one_block_input(vals, orientation), meta, orientation, mode), orientation)
    assert s == (1 if mode == "rceil" else 0)
    assert p[0] == mxflash.e4m3_encode(np.float32(1e-40) * np.float32(2.0**126))


def test_seq_partial_tail_block_is_zero_padded():
    # 33 tokens: the second seq block holds one real token; its scale comes from that token alone
    meta = mxflash.JaggedMeta.from_lengths([33])
    x = np.zeros((33, 1, 128), np.float32)
    x[:32, 0, 0] = 1000.0
    x[32, 0, 0] = 3.0
    _, s = mxflash.quantize(x, meta, "seq", "rceil")
    assert s.shape == (4, 1, 128)
    assert s[0, 0, 0] == scale_bytes(np.float32(1000.0), "rceil")
    assert s[1, 0, 0] == scale_bytes(np.float32(3.0), "rceil")
    assert not s[2:].any()  # padding groups hold 0


# ---------------------------------------------------------------------------- CPU: dequantize
@pytest.mark.parametrize("orientation,scale_layout,payload_layout", COMBOS)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_dequantize_matches_oracle(orientation, scale_layout, payload_layout, out_dtype):
    _, meta, x, oracle = case(3, "float32", "rceil", True, 1)
    payload, scales = mxflash.quantize(x, meta, orientation, "rceil", scale_layout, payload_layout)
    y = mxflash.dequantize(payload, scales, meta, orientation, scale_layout, payload_layout, out_dtype=out_dtype)
    assert y.shape == x.shape and y.dtype == {"float32": np.float32, "bfloat16": BF16}[out_dtype]
    tm, _ = oracle.expected(orientation, "plain", "token_major")
    if orientation == "hdim":
        per_elem = oracle.hdim_scales.repeat(32, axis=-1)
    elif orientation == "seq":
        per_elem = oracle.seq_scales[oracle.padded_index() // 32]
    else:
        per_elem = oracle.sq_scales[oracle.padded_index() // 32].repeat(32, axis=-1)
    want = decode(tm, per_elem)
    if out_dtype == "bfloat16":
        want = want.astype(BF16)
    assert_same_floats(np.asarray(y).astype(np.float32), np.asarray(want).astype(np.float32))


def sqnr_db(ref, out):
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    return 10 * np.log10(np.sum(ref**2) / np.sum((out - ref) ** 2))


@pytest.mark.parametrize("orientation", ["hdim", "seq", "square32"])
@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_sqnr(orientation, mode):
    lengths = [1000, 129, 33, 0, 1]
    meta = mxflash.JaggedMeta.from_lengths(lengths)
    x = np.random.default_rng(11).standard_normal((sum(lengths), 3, 128)).astype(np.float32)
    p, s = mxflash.quantize(x, meta, orientation, mode)
    y = mxflash.dequantize(p, s, meta, orientation)
    db = sqnr_db(x, y)
    # E4M3 keeps 3 mantissa bits: about 30 dB on normal data for every orientation
    assert db > 25, db
    assert db < 40, db  # sanity: the data did go through 8 bits


def representable_input(lengths, H, mode, seed, scale):
    """x = q * scale with q random finite e4m3 values. RCEIL then reproduces x exactly for any
    block; FLOOR maps a block max m*2^k to [256, 512), exact unless the mantissa is 1.875 (-> 480,
    clipped), so those codes are left out for FLOOR."""
    rng = np.random.default_rng(seed)
    codes = np.arange(256, dtype=np.uint8)
    ok = (codes & 0x7F) != 0x7F
    if mode == "floor":
        ok &= ~(((codes & 0x78) != 0) & ((codes & 0x07) == 0x07))
    q = rng.choice(codes[ok], (sum(lengths), H, 128)).view(E4M3).astype(np.float32)
    return q * np.float32(scale)


@pytest.mark.parametrize("orientation", ["hdim", "seq", "square32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**10])
def test_roundtrip_exact_for_representable_values(orientation, mode, scale):
    lengths = [129, 0, 32, 1, 31]
    meta = mxflash.JaggedMeta.from_lengths(lengths)
    x = representable_input(lengths, 2, mode, seed=3, scale=scale)
    for xin in (x, x.astype(BF16)):  # e4m3 * 2^k is exact in bf16 too
        p, s = mxflash.quantize(xin, meta, orientation, mode)
        assert_same_floats(mxflash.dequantize(p, s, meta, orientation), x)
        assert_same_floats(mxflash.dequantize(p, s, meta, orientation, out_dtype="bfloat16").astype(np.float32), x)


# ---------------------------------------------------------------------------- CPU: converters
@pytest.mark.parametrize("orientation", ["seq", "square32"])
def test_payload_converters(orientation):
    _, meta, x, _ = case(3, "bfloat16", "rceil", False, 0)
    tm, _ = mxflash.quantize(x, meta, orientation)
    tc, _ = mxflash.quantize(x, meta, orientation, payload_layout="token_contiguous")
    got = mxflash.to_token_contiguous(tm, meta)
    assert got.dtype == E4M3 and got.shape == tc.shape
    assert np.array_equal(as_bytes(got), as_bytes(tc))
    back = mxflash.to_token_major(tc, meta)
    assert back.shape == tm.shape and np.array_equal(as_bytes(back), as_bytes(tm))
    # uint8 in, uint8 out; padding tokens are zero even in a dirty output buffer
    dirty = np.full(tc.shape, 0xAB, np.uint8)
    got = mxflash.to_token_contiguous(as_bytes(tm), meta, out=dirty)
    assert got is dirty and np.array_equal(dirty, as_bytes(tc))


@pytest.mark.parametrize("orientation", ["hdim", "seq", "square32"])
def test_scale_converters(orientation):
    _, meta, x, _ = case(3, "bfloat16", "floor", False, 0)
    _, plain = mxflash.quantize(x, meta, orientation, "floor", "plain")
    _, blocked = mxflash.quantize(x, meta, orientation, "floor", "blocked128x4")
    got = mxflash.scales_to_blocked(plain, meta, orientation)
    assert got.shape == blocked.shape and np.array_equal(got, blocked)
    back = mxflash.scales_to_plain(blocked, meta, orientation)
    assert back.shape == plain.shape and np.array_equal(back, plain)
    dirty = np.full(blocked.shape, 0xAB, np.uint8)
    mxflash.scales_to_blocked(plain.view(E8M0), meta, orientation, heads=3, out=dirty.view(E8M0))
    assert np.array_equal(dirty, blocked)  # padding bytes rewritten to 0


def test_empty_batch():
    meta = mxflash.JaggedMeta.from_lengths([0, 0])
    x = np.zeros((0, 2, 128), BF16)
    for o in ["hdim", "seq", "square32"]:
        p, s = mxflash.quantize(x, meta, o, scale_layout="blocked128x4")
        assert p.shape == (0, 2, 128) and s.size == 0
        assert mxflash.dequantize(p, s, meta, o, scale_layout="blocked128x4").shape == (0, 2, 128)


def test_out_arguments_are_filled_and_returned():
    _, meta, x, oracle = case(1, "float32", "rceil", False, 1)
    want_p, want_s = oracle.expected("seq", "blocked128x4", "token_contiguous")
    p = np.full(want_p.shape, 0xAB, np.uint8)
    s = np.full(want_s.shape, 0xAB, np.uint8).view(E8M0)
    rp, rs = mxflash.quantize(x, meta, "seq", "rceil", "blocked128x4", "token_contiguous", out=(p, s))
    assert rp is p and rs is s
    assert np.array_equal(p, want_p) and np.array_equal(as_bytes(s), want_s)


# ---------------------------------------------------------------------------- CUDA


def to_torch(a, torch, device="cuda"):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    if a.dtype in (E4M3, E8M0):
        return torch.from_numpy(a.view(np.uint8)).to(device).view(
            torch.float8_e4m3fn if a.dtype == E4M3 else torch.uint8)
    return torch.from_numpy(a).to(device)


def to_numpy_bytes(t, torch):
    """The tensor's bytes as a numpy uint8 array (numpy has no torch fp8/bf16 interop)."""
    same_size_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.detach().view(same_size_int).cpu().numpy().view(np.uint8)


@pytest.mark.parametrize("orientation,scale_layout,payload_layout", COMBOS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype_name,hostile", [("bfloat16", False), ("float32", True)])
def test_cuda_quantize_equals_cpu(torch_cuda, dtype_name, hostile, mode, orientation, scale_layout, payload_layout):
    torch = torch_cuda
    _, meta, x, _ = case(3, dtype_name, mode, hostile, 0)
    cp, cs = mxflash.quantize(x, meta, orientation, mode, scale_layout, payload_layout)
    gp, gs = mxflash.quantize(to_torch(x, torch), meta, orientation, mode, scale_layout, payload_layout)
    assert isinstance(gp, torch.Tensor) and gp.is_cuda and gp.dtype == torch.float8_e4m3fn
    assert gs.dtype == torch.uint8 and tuple(gs.shape) == cs.shape and tuple(gp.shape) == cp.shape
    assert np.array_equal(to_numpy_bytes(gp, torch), as_bytes(cp))
    assert np.array_equal(to_numpy_bytes(gs, torch), cs)
    # dequantize on the GPU equals the CPU bit for bit, except that a NaN's payload bits are free
    for out_dtype in ["float32", "bfloat16"]:
        cy = mxflash.dequantize(cp, cs, meta, orientation, scale_layout, payload_layout, out_dtype=out_dtype)
        gy = mxflash.dequantize(gp, gs, meta, orientation, scale_layout, payload_layout, out_dtype=out_dtype)
        assert gy.is_cuda
        assert_same_floats(gy.float().cpu().numpy(), np.asarray(cy).astype(np.float32))


@pytest.mark.parametrize("scale_layout", ["plain", "blocked128x4"])
@pytest.mark.parametrize("payload_layout", ["token_major", "token_contiguous"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_quantize_hdim_seq_equals_cpu(torch_cuda, mode, payload_layout, scale_layout):
    torch = torch_cuda
    _, meta, x, _ = case(3, "bfloat16", mode, False, 1)
    cpu = mxflash.quantize_hdim_seq(x, meta, mode, scale_layout, payload_layout)
    gpu = mxflash.quantize_hdim_seq(to_torch(x, torch), meta, mode, scale_layout, payload_layout)
    for g, c in zip(gpu, cpu):
        assert g.is_cuda and np.array_equal(to_numpy_bytes(g, torch), as_bytes(c))


@pytest.mark.parametrize("orientation", ["hdim", "seq", "square32"])
def test_cuda_converters_equal_cpu(torch_cuda, orientation):
    torch = torch_cuda
    _, meta, x, _ = case(3, "bfloat16", "rceil", False, 0)
    tm, plain = mxflash.quantize(x, meta, orientation)
    _, blocked = mxflash.quantize(x, meta, orientation, scale_layout="blocked128x4")
    g_blocked = mxflash.scales_to_blocked(to_torch(plain, torch), meta, orientation)
    assert np.array_equal(to_numpy_bytes(g_blocked, torch), blocked)
    g_plain = mxflash.scales_to_plain(to_torch(blocked, torch), meta, orientation)
    assert np.array_equal(to_numpy_bytes(g_plain, torch), plain)
    if orientation != "hdim":
        tc = mxflash.to_token_contiguous(tm, meta)
        g_tc = mxflash.to_token_contiguous(to_torch(tm, torch), meta)
        assert g_tc.dtype == torch.float8_e4m3fn and np.array_equal(to_numpy_bytes(g_tc, torch), as_bytes(tc))
        g_tm = mxflash.to_token_major(to_torch(tc, torch), meta)
        assert np.array_equal(to_numpy_bytes(g_tm, torch), as_bytes(tm))


def test_cuda_runs_on_current_stream(torch_cuda):
    # The launch must be queued behind work already on the current (non-blocking) stream: while
    # that stream sleeps, another stream still reads the untouched output buffer.
    torch = torch_cuda
    _, meta, x, _ = case(3, "bfloat16", "rceil", False, 0)
    meta.upload()
    xg = to_torch(x, torch)
    p = torch.full(mxflash.payload_shape(meta, 3), 0xAB, dtype=torch.uint8, device="cuda")
    s = torch.full(mxflash.scale_shape(meta, 3, "hdim"), 0xAB, dtype=torch.uint8, device="cuda")
    # Load the kernels first: under CUDA's lazy loading a kernel's first load may synchronize the
    # context (test_attention.launch_behind_sleep).
    mxflash.quantize(xg, meta, out=(torch.empty_like(p), torch.empty_like(s)))
    torch.cuda.synchronize()
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        mxflash.quantize(xg, meta, out=(p, s))
    with torch.cuda.stream(other):
        early = p.cpu()
    stream.synchronize()
    assert bool((early == 0xAB).all()), (
        "output written before earlier work on torch's current stream finished: quantize did not "
        "enqueue asynchronously on that stream")
    cp, cs = mxflash.quantize(x, meta)
    assert np.array_equal(p.cpu().numpy(), as_bytes(cp)) and np.array_equal(s.cpu().numpy(), cs)


def test_cuda_second_device(torch_cuda):
    torch = torch_cuda
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    _, meta, x, _ = case(1, "bfloat16", "rceil", False, 1)
    cp, cs = mxflash.quantize(x, meta, "seq")
    with torch.cuda.device(0):
        gp, gs = mxflash.quantize(to_torch(x, torch, "cuda:1"), meta, "seq")
        assert torch.cuda.current_device() == 0
    assert gp.device.index == 1
    assert np.array_equal(to_numpy_bytes(gp, torch), as_bytes(cp)) and np.array_equal(to_numpy_bytes(gs, torch), cs)


def test_torch_cpu_tensors_use_the_reference():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch
    _, meta, x, oracle = case(1, "bfloat16", "rceil", False, 1)
    p, s = mxflash.quantize(to_torch(x, torch, "cpu"), meta, "seq", scale_layout="blocked128x4")
    assert isinstance(p, torch.Tensor) and p.device.type == "cpu" and p.dtype == torch.float8_e4m3fn
    want_p, want_s = oracle.expected("seq", "blocked128x4", "token_major")
    assert np.array_equal(to_numpy_bytes(p, torch), want_p) and np.array_equal(s.numpy(), want_s)
