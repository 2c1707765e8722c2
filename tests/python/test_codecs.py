"""The C++ scalar codecs (include/mxflash/mx.h) against independent oracles.

E4M3 encode/decode and E8M0 decode are checked bit for bit against ml_dtypes. E8M0 scale bytes are
checked against the REFERENCE.md §2 formulas written here with np.frexp (a different computation
from the library's exponent-field arithmetic), and cross-checked against the defining inequalities.
The scale-byte oracles are imported by test_quantize.py.
"""
import ml_dtypes
import numpy as np
import pytest

import mxflash

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
F32_MIN_NORMAL = np.float32(2.0**-126)


# ---------------------------------------------------------------------------- oracles
def rceil_bytes(amax):
    """RCEIL: ratio = amax/448 in float32; byte = biased exponent of ratio, +1 if it has mantissa
    bits. For a normal ratio that is 127 + ceil(log2 ratio), read off frexp (ratio = m * 2^e with
    m in [0.5, 1): log2 is an integer exactly when m == 0.5). A subnormal ratio has exponent field
    0 and mantissa bits, hence byte 1 (scale 2^-126); a zero ratio gives byte 0."""
    a = np.abs(np.asarray(amax, dtype=np.float32))
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = a / np.float32(448.0)
    m, e = np.frexp(ratio)
    normal_byte = np.where(m == 0.5, e - 1, e).astype(np.int64) + 127
    byte = np.where(ratio >= F32_MIN_NORMAL, normal_byte, np.where(ratio > 0, 1, 0))
    byte = np.where(np.isfinite(a), np.minimum(byte, 254), 255)
    byte = np.where(a == 0, 0, byte)
    return byte.astype(np.uint8)


def floor_bytes(amax):
    """FLOOR: scale = 2^(floor(log2 amax) - 8), byte clamped to [0, 254]; frexp gives
    floor(log2 amax) = e - 1 for amax = m * 2^e, subnormal amax included."""
    a = np.abs(np.asarray(amax, dtype=np.float32))
    _, e = np.frexp(a)
    byte = np.clip(e.astype(np.int64) - 1 - 8 + 127, 0, 254)
    byte = np.where(np.isfinite(a), byte, 255)
    byte = np.where(a == 0, 0, byte)
    return byte.astype(np.uint8)


def scale_bytes(amax, mode):
    return rceil_bytes(amax) if mode == "rceil" else floor_bytes(amax)


def e8m0_value(byte):
    """2^(byte-127) via ml_dtypes (float64 so 2^-127 and 2^127 are exact)."""
    return np.asarray(byte, dtype=np.uint8).view(E8M0).astype(np.float64)


# ---------------------------------------------------------------------------- inputs
def bf16_patterns():
    return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


def e4m3_ties_and_neighbours():
    """Every midpoint between adjacent e4m3 magnitudes (and 448|480, 480|512), the floats just
    around each, with both signs: the round-to-nearest-even and overflow boundaries."""
    mags = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float64)  # 0 .. 448, ascending
    grid = np.concatenate([mags, [480.0, 512.0]])
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)  # exact in float32
    pts = np.concatenate([mids, grid.astype(np.float32)])
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(-np.inf))])
    return np.concatenate([near, -near]).astype(np.float32)


def random_f32(n, seed):
    """n float32 values: arbitrary bit patterns (every exponent, NaN payloads, inf), fp32
    subnormals, and values with random mantissas around the e4m3 range (2^-12 .. 2^10)."""
    rng = np.random.default_rng(seed)
    n_any, n_sub = n // 4, n // 10
    n_mid = n - n_any - n_sub
    any_bits = rng.integers(0, 2**32, n_any, dtype=np.uint64).astype(np.uint32)
    sub_bits = rng.integers(0, 2**23, n_sub, dtype=np.uint32) | (rng.integers(0, 2, n_sub, dtype=np.uint32) << 31)
    exp = rng.integers(127 - 12, 127 + 11, n_mid, dtype=np.uint32)
    mid_bits = (exp << 23) | rng.integers(0, 2**23, n_mid, dtype=np.uint32)
    mid_bits |= rng.integers(0, 2, n_mid, dtype=np.uint32) << 31
    return np.concatenate([any_bits, sub_bits, mid_bits]).view(np.float32)


@pytest.fixture(scope="module")
def many_f32():
    return np.concatenate([random_f32(2_000_000, seed=1), e4m3_ties_and_neighbours()])


def ml_e4m3(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(E4M3).view(np.uint8)


def assert_bytes_equal(got, want, x):
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = bad[:8]
        raise AssertionError(
            f"{bad.size} mismatches; x bits {[hex(v) for v in x.view(np.uint32)[i]]} "
            f"got {[hex(v) for v in got[i]]} want {[hex(v) for v in want[i]]}")


# ---------------------------------------------------------------------------- E4M3
def test_ml_dtypes_nan_sign_convention():
    # Our encoder keeps the NaN sign (0x7F / 0xFF); the oracle must do the same for the
    # bit-for-bit comparisons below to be meaningful.
    nans = np.array([np.nan, -np.nan], np.float32)
    assert list(ml_e4m3(nans)) == [0x7F, 0xFF]
    assert list(mxflash.e4m3_encode(nans, saturate=False)) == [0x7F, 0xFF]
    assert list(mxflash.e4m3_encode(nans, saturate=True)) == [0x7F, 0xFF]


def test_e4m3_encode_all_bf16_patterns():
    x = bf16_patterns()
    assert_bytes_equal(mxflash.e4m3_encode(x, saturate=False), ml_e4m3(x), x)


def test_e4m3_encode_random_and_ties(many_f32):
    x = many_f32
    assert np.count_nonzero((x != 0) & (np.abs(x) < F32_MIN_NORMAL)) > 100_000  # subnormals present
    assert_bytes_equal(mxflash.e4m3_encode(x, saturate=False), ml_e4m3(x), x)


@pytest.mark.parametrize("which", ["bf16", "random"])
def test_e4m3_encode_saturating(which, many_f32):
    x = bf16_patterns() if which == "bf16" else many_f32
    want = ml_e4m3(np.clip(x, -448.0, 448.0))  # clip keeps NaN (and its sign), sends inf to +-448
    assert_bytes_equal(mxflash.e4m3_encode(x, saturate=True), want, x)


def test_e4m3_saturation_boundaries():
    x = np.array([448, 464, np.nextafter(np.float32(464), np.float32(1e9)), 480, 1e30, np.inf], np.float32)
    # plain conversion: 464 is the tie 448|480 and rounds to even (448); anything above is NaN
    assert list(mxflash.e4m3_encode(x, saturate=False)) == [0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F]
    assert list(mxflash.e4m3_encode(-x, saturate=True)) == [0xFE] * 6


def test_e4m3_decode_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    got = mxflash.e4m3_decode(b)
    want = b.view(E4M3).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # NaNs included, by bits
    assert np.array_equal(mxflash.e4m3_decode(b.view(E4M3)).view(np.uint32), got.view(np.uint32))


def test_e4m3_roundtrip_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    assert np.array_equal(mxflash.e4m3_encode(mxflash.e4m3_decode(b), saturate=False), b)


def test_e4m3_encode_keeps_shape_and_converts_dtype():
    x = np.linspace(-500, 500, 24, dtype=np.float64).reshape(2, 3, 4)
    got = mxflash.e4m3_encode(x)
    assert got.shape == (2, 3, 4) and got.dtype == np.uint8
    assert np.array_equal(got, ml_e4m3(np.clip(x.astype(np.float32), -448, 448)))


# ---------------------------------------------------------------------------- E8M0
def test_e8m0_decode_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    got = mxflash.e8m0_decode(b)
    want = b.view(E8M0).astype(np.float32)
    assert np.isnan(got[255]) and np.isnan(want[255])
    assert np.array_equal(got[:255].view(np.uint32), want[:255].view(np.uint32))
    assert got[0] == np.float32(2.0**-127) and got[127] == 1.0 and got[254] == np.float32(2.0**127)


@np.errstate(over="ignore")
def amax_edges():
    k = np.arange(-149, 128)
    p448 = (448.0 * np.exp2(k.astype(np.float64)))
    p448 = p448[(p448 > 0) & (p448 < 3.4e38)].astype(np.float32)
    pow2 = np.exp2(np.arange(-149, 128, dtype=np.float64)).astype(np.float32)
    pts = np.concatenate([
        p448, pow2, [0.0, 500.0, 448.0, 256.0, 512.0, 1.0, np.finfo(np.float32).max,
                     np.float32(2.0**-149), np.float32(2.0**-126), np.nextafter(np.float32(2.0**-126), np.float32(0))],
    ]).astype(np.float32)
    up = np.nextafter(pts, np.float32(np.inf))  # float32 max -> inf, kept
    down = np.nextafter(pts, np.float32(0))
    return np.concatenate([pts, up, down, [np.inf, np.nan]]).astype(np.float32)


@pytest.fixture(scope="module")
def amax_values():
    rng = np.random.default_rng(7)
    rand = (rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32) & 0x7FFFFFFF).view(np.float32)
    return np.concatenate([amax_edges(), rand])


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_e8m0_scale_vs_formula(mode, amax_values):
    a = amax_values
    got = mxflash.e8m0_scale(a, mode)
    want = scale_bytes(a, mode)
    assert_bytes_equal(got, want, a)


def test_e8m0_rceil_defining_inequality(amax_values):
    # decode(byte) >= amax/448 > decode(byte - 1): the smallest power of two not below the ratio.
    a = amax_values[np.isfinite(amax_values)]
    ratio = (a / np.float32(448)).astype(np.float64)
    a, ratio = a[ratio >= 2.0**-126], ratio[ratio >= 2.0**-126]
    b = mxflash.e8m0_scale(a, "rceil")
    assert np.all(e8m0_value(b) >= ratio)
    assert np.all(e8m0_value(b - 1) < ratio)


def test_e8m0_floor_defining_inequality(amax_values):
    # block max lands in [256, 512) * scale (unless the byte is clamped to 0 or 254)
    a = amax_values[np.isfinite(amax_values) & (amax_values > 0)].astype(np.float64)
    b = mxflash.e8m0_scale(a, "floor")
    s = e8m0_value(b)
    inside = (b > 0) & (b < 254)
    assert np.all(a[inside] >= 256 * s[inside]) and np.all(a[inside] < 512 * s[inside])
    assert np.all(a[b == 0] < 256 * 2.0**-126)


def test_e8m0_special_amax():
    a = np.array([0.0, np.inf, np.nan, 500.0, 2.0**-149, 448 * 2.0**-130], np.float32)
    # 2^-149 / 448 rounds to zero in float32 (byte 0); 448 * 2^-130 / 448 is subnormal (byte 1)
    assert list(mxflash.e8m0_scale(a, "rceil")) == [0, 255, 255, 128, 0, 1]
    assert list(mxflash.e8m0_scale(a, "floor")) == [0, 255, 255, 127, 0, 0]
    assert list(mxflash.e8m0_scale([0.0], "rceil", zero_byte=127)) == [127]
    with pytest.raises(ValueError, match="^mode: must be rceil or floor$"):
        mxflash.e8m0_scale(a, "ceil")
