// Rules of gemm_quantize (include/mxflash/fused.h) shared by the CPU reference and the CUDA kernels,
// so both compute the same bytes.
//
// The exact product (the MX definition, ARCHITECTURE.md §3): y[m, n] = sum over 32-blocks b, in
// order, of 2^(sa[m,b] + sw[n,b] - 254) * P_b, P_b = sum_k a[m,k] w[n,k] over the block. P_b is exact
// in fp64 (32 products of 4-bit significands, exponents 2^-18 .. 2^18), scaling by a power of two is
// exact, so only the running fp64 sum rounds; y is that sum rounded to fp32.
//
// The fast path re-expresses the operands against coarse scales (ARCHITECTURE.md §4): A against one
// scale per row, sa_row[m] = max_b sa[m,b], W against one per output channel, sw_ch[n] = max_b
// sw[n,b]. A block with d = row scale - block scale binades below has its elements divided by 2^d
// (e4m3_shift_down): exact while the result stays an e4m3 normal, rounded to nearest even on the
// e4m3 subnormal grid (2^-9) below that. The GEMM is then a plain FP8 GEMM, and
// y = (acc * 2^(sa_row - 127)) * 2^(sw_ch - 127) in fp32.
#pragma once
#include <cstdint>

#include "mxflash/mx.h"

namespace mxflash {

inline constexpr int64_t kGemmMaxDim = 65536;  // largest K and N gemm_quantize takes

// e4m3 byte b divided by 2^d (d >= 0), rounded to nearest even on the e4m3 grid; NaN stays NaN,
// the sign is kept (a value that rounds to zero keeps it too: -0).
MXFLASH_HD uint8_t e4m3_shift_down(uint8_t b, uint32_t d) {
  const uint32_t mag = b & 0x7Fu, sign = b & 0x80u;
  if (mag == kE4m3Nan || d == 0) return b;
  const uint32_t e = mag >> 3;
  if (e > d) return uint8_t(sign | (mag - (d << 3)));  // still normal: the exponent field drops by d
  // The result is subnormal (or 2^-6, encoded 0x08 like a subnormal's 8 units): value in units of
  // 2^-9 is u / 2^d, u = m for a subnormal input, (8 + m) 2^(e - 1) for a normal one.
  const uint32_t m = mag & 7u;
  const uint32_t u = e == 0 ? m : (8u + m) << (e - 1);  // < 2^18
  if (d >= 20) return uint8_t(sign);
  uint32_t q = u >> d;
  const uint32_t rest = u & ((1u << d) - 1u), half = 1u << (d - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return uint8_t(sign | q);  // q <= 8
}

// The common case of the shift of a 4-byte word (all four bytes of one block) by d, as two byte-wise
// additions on mags = w & 0x7F7F7F7F (no carry leaves a byte): every byte of mags + ge_add has bit 7
// set iff every byte stays an e4m3 normal (exponent field > d), and no byte of mags + nan_add has
// it iff none is NaN. Then the shifted word is w - (d << 3) * 0x01010101 (the exponent fields drop
// by d). d = 0 always passes (the word unchanged), d >= 15 never (bit 7 of mags is clear).
struct ShiftWordTest {
  uint32_t ge_add, nan_add;
};
MXFLASH_HD ShiftWordTest shift_word_test(uint32_t d) {
  const uint32_t ge = d == 0 ? 0x80u : (d < 15 ? 0x78u - 8u * d : 0u);  // d >= 1: 0x80 - 8 (d + 1)
  return {ge * 0x01010101u, d == 0 ? 0u : 0x01010101u};
}

// Four e4m3 bytes of one block divided by 2^d: e4m3_shift_down on each byte. The common case
// (shift_word_test: e.g. d <= 3 on most data) is one subtraction; other words go byte by byte.
MXFLASH_HD uint32_t e4m3x4_shift_down(uint32_t w, uint32_t d) {
  if (d == 0) return w;
  const uint32_t mags = w & 0x7F7F7F7Fu;
  const ShiftWordTest t = shift_word_test(d);
  if (((mags + t.ge_add) & 0x80808080u) == 0x80808080u && ((mags + t.nan_add) & 0x80808080u) == 0)
    return w - (d << 3) * 0x01010101u;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t(e4m3_shift_down(uint8_t(w >> (8 * i)), d)) << (8 * i);
  return r;
}

// The coarse exponent of a row (or channel) of block scale bytes: their maximum. 0xFF (a NaN scale)
// is the largest byte, so a row with a NaN block gets the NaN scale and its results are NaN.
MXFLASH_HD uint32_t coarse_exponent(const uint8_t* scales, int64_t blocks) {
  uint32_t e = 0;
  for (int64_t b = 0; b < blocks; ++b) e = scales[b] > e ? scales[b] : e;
  return e;
}

// Shift of a block against its row's coarse exponent (a NaN row: every block to zero; its results
// are NaN through the row scale).
MXFLASH_HD uint32_t block_shift(uint32_t coarse, uint32_t block) { return coarse - block; }

}  // namespace mxflash
