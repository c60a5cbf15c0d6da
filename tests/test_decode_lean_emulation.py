"""The scale conversion of the lean decode loops (gemm_w4_decode_sm90.cu, scale2_bf16x2_folded, TRACE_EXT_DECODE_IMPL=
stream-lean / pair2-lean / auto-lean) gives the bf16 bits of the default conversion (scale_bf16x2_folded in
gemm_w4_common.cuh) for every E4M3 byte, in both halves of every byte pair. Exhaustive: all 65536 (low, high) byte pairs.

Default, per byte: E4M3 -> f16 (exact) -> f32 -> fl32(f * 2^119) -> bf16 RN, broadcast to both halves.
Lean, per byte PAIR: cvt.rn.f16x2.e4m3x2 (low byte -> low half) -> f16 -> f32 of each half -> cvt.rn.bf16x2.f32 (RN)
-> fma.rn.bf16x2(b, 2^119, -0) (RN), each half then broadcast by an operand swizzle. Emulated here op by op with
round-to-nearest-even at every bf16 rounding, and every step is also asserted exact (no rounding happens at all), so
the result does not depend on the rounding emulation: both give s * 2^119 exactly for finite s (|s| <= 448, at most 4
significant bits, 448 * 2^119 < 2^128), +-0 with its sign, and NaN for the two NaN bytes 0x7F / 0xFF (a NaN scale then
makes the whole block NaN in both kernels: every product is NaN, and the GPU's NaN results are canonical).
"""
import numpy as np
import torch

from trace_ext import formats as F

FOLD = 2.0**119


def _e4m3_values() -> np.ndarray:
    """float64 value of every byte 0..255 (NaN for 0x7F / 0xFF), from the project's codec."""
    v = F.e4m3_to_float(torch.arange(256, dtype=torch.uint8)).double().numpy()
    return v


def _bf16_rn_bits(x32: np.ndarray) -> np.ndarray:
    """bf16 bits of float32 values, round to nearest even; NaN -> 0x7FFF (canonical)."""
    u = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(np.isnan(x32), 0x7FFF, r).astype(np.uint32)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _default_bits(v: np.ndarray) -> np.ndarray:
    f = v.astype(np.float16).astype(np.float32)  # E4M3 -> f16 -> f32 (exact)
    p = (f * np.float32(FOLD)).astype(np.float32)  # fl32(f * 2^119)
    return _bf16_rn_bits(p)


def _lean_bits(lo: np.ndarray, hi: np.ndarray, v: np.ndarray):
    """The lean ops on byte pairs (lo, hi): returns (low half bits, high half bits) and checks every step exact."""
    h = np.stack([v[lo], v[hi]]).astype(np.float16)  # cvt.rn.f16x2.e4m3x2: low byte -> low half
    fin = ~np.isnan(h)
    assert np.array_equal(h[fin].astype(np.float64), np.stack([v[lo], v[hi]])[fin]), "E4M3 -> f16 not exact"
    f = h.astype(np.float32)  # HADD2.F32 of each half (exact)
    b = _bf16_rn_bits(f)  # cvt.rn.bf16x2.f32 (F2FP.BF16.F32.PACK_AB)
    assert np.array_equal(_bf16_value(b)[fin], f[fin].astype(np.float64)), "f32 -> bf16 not exact"
    prod = _bf16_value(b) * FOLD + (-0.0)  # fma.rn.bf16x2(b, 2^119, -0): exact in float64
    out = _bf16_rn_bits(prod.astype(np.float32))
    assert np.array_equal(_bf16_value(out)[fin], prod[fin]), "* 2^119 not exact in bf16"
    assert np.all(np.abs(prod[fin]) < 2.0**128), "overflow"
    return out[0], out[1]


def test_lean_scale_conversion_equals_default_for_every_byte_pair():
    """Protects scale2_bf16x2_folded: for all 65536 (low, high) byte pairs both halves are the default conversion's
    bf16 bits of their own byte (finite, +-0 with its sign), NaN exactly for 0x7F / 0xFF, and never swapped."""
    v = _e4m3_values()
    ref_bits = _default_bits(v)
    pairs = np.arange(1 << 16, dtype=np.uint32)
    lo, hi = pairs & 0xFF, pairs >> 8
    got_lo, got_hi = _lean_bits(lo, hi, v)
    for got, byte in ((got_lo, lo), (got_hi, hi)):
        nan_byte = (byte & 0x7F) == 0x7F
        got_nan = ((got & 0x7F80) == 0x7F80) & ((got & 0x7F) != 0)
        assert np.array_equal(got_nan, nan_byte), "NaN bytes must give NaN, others not"
        assert np.array_equal(got[~nan_byte], ref_bits[byte[~nan_byte]]), "lean scale bits differ from the default"


def test_default_conversion_is_the_exact_folded_scale():
    """Protects the oracle of the test above: the emulated default gives s * 2^119 exactly for every finite byte,
    keeps the sign of zero (0x80 -> -0) and covers subnormal scales (0x01 = 2^-9)."""
    v = _e4m3_values()
    bits = _default_bits(v)
    fin = ~np.isnan(v)
    assert np.array_equal(_bf16_value(bits)[fin], v[fin] * FOLD)
    assert bits[0x00] == 0x0000 and bits[0x80] == 0x8000
    assert _bf16_value(bits[[0x01]])[0] == 2.0**-9 * FOLD
    assert _bf16_value(bits[[0x7E]])[0] == 448.0 * FOLD
    assert np.isnan(v[0x7F]) and np.isnan(v[0xFF]) and int(np.isnan(v).sum()) == 2


def _decode_word_lean(w: torch.Tensor) -> list[torch.Tensor]:
    """decode_word_lean of gemm_w4_decode_sm90.cu (int64 emulation; __umulhi = high word of the 64-bit product)."""
    M = 0x81C081C0
    hi = ((w & 0x4C004C00) * 0x14000000) >> 32
    return [w & M, (w << 3) & M, (w << 6) & M, (hi & 0x01C001C0) | ((w << 2) & 0x80008000)]


def test_lean_decode_word_equals_decode_word_in_both_halves_exhaustively():
    """Protects decode_word_lean (pair 3 as the high word of one product): the same 4 bf16x2 words as decode_word
    (reference_gemm.decode_word_pairs) for all 65536 values of each 16-bit half, the other half random. The halves
    cannot interact (no carries: the partial products are disjoint), which the random other halves also exercise."""
    from trace_ext import reference_gemm as R

    g = torch.Generator().manual_seed(5)
    half = torch.arange(1 << 16, dtype=torch.int64)
    for _ in range(4):
        other = torch.randint(0, 1 << 16, (1 << 16,), dtype=torch.int64, generator=g)
        for w in (half | (other << 16), other | (half << 16)):
            want = R.decode_word_pairs(w)
            got = _decode_word_lean(w)
            for j in range(4):
                assert torch.equal(got[j] & 0xFFFFFFFF, want[j] & 0xFFFFFFFF), j
