"""SPEC 1 and 6: E2M1 / E4M3 / E8M0 codecs, nibble order, swizzled scale layout, Philox known answers."""
import math

import pytest
import torch

from trace_ext import formats as F
from trace_ext.philox import philox4x32_10, sr_random_words


def all_finite_bf16() -> torch.Tensor:
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return x[torch.isfinite(x)]


def e2m1_oracle(v: torch.Tensor) -> torch.Tensor:
    """Independent E2M1 RTN: nearest grid value in float64, ties to the even magnitude code, saturate at 6."""
    grid = torch.tensor(F.E2M1_MAGNITUDES, dtype=torch.float64)
    a = v.double().abs().clamp(max=6.0)
    dist = (a[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    even = candidates & (torch.arange(8) % 2 == 0)
    mag = torch.where(even.any(1), even.float().argmax(1), candidates.float().argmax(1))
    return (mag | (torch.signbit(v).long() << 3)).to(torch.uint8)


def test_e2m1_rn_matches_oracle_on_every_bf16_value():
    # protects: the threshold table of SPEC 1, incl. saturation and signed zero
    x = all_finite_bf16()
    assert torch.equal(F.e2m1_rn(x), e2m1_oracle(x))


@pytest.mark.parametrize("tie,even_code", [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)])
def test_e2m1_ties_go_to_even_code_and_neighbours_do_not(tie, even_code):
    # protects: ties-to-even at every midpoint, and the strictness of each bound
    t = torch.tensor([tie], dtype=torch.float32)
    below = torch.nextafter(t, torch.tensor([0.0]))
    above = torch.nextafter(t, torch.tensor([10.0]))
    assert int(F.e2m1_rn(t)) == even_code
    assert int(F.e2m1_rn(-t)) == even_code | 8
    # just below a tie rounds down to the lower neighbour, just above rounds up
    grid = F.E2M1_MAGNITUDES
    lo = max(i for i, g in enumerate(grid) if g < tie)
    hi = min(i for i, g in enumerate(grid) if g > tie)
    assert int(F.e2m1_rn(below)) == lo
    assert int(F.e2m1_rn(above)) == hi
    assert even_code in (lo, hi) and even_code % 2 == 0


def test_e2m1_sign_of_small_negative_is_kept():
    # protects: SPEC 1 "-0.1 gives code 0x8"
    assert int(F.e2m1_rn(torch.tensor([-0.1]))) == 0x8
    assert int(F.e2m1_rn(torch.tensor([-0.0]))) == 0x8
    assert int(F.e2m1_rn(torch.tensor([0.0]))) == 0x0


def test_e2m1_adjacent_grid_values_differ_in_the_mantissa_bit():
    # protects: the property guided rounding relies on (SPEC 1)
    for m in range(7):
        assert (m & 1) != ((m + 1) & 1)


def test_e4m3_matches_torch_cast_after_clamp_on_every_bf16_and_random_fp32():
    # protects: E4M3 RNE incl. subnormals down to 2^-9 and saturation to 448
    x = all_finite_bf16().abs()
    r = torch.rand(1 << 18) * torch.exp2(torch.randint(-14, 12, (1 << 18,)).float())
    x = torch.cat([x, r, torch.tensor([448.0, 464.0, 470.0, 1e30, 2.0**-10, 2.0**-10 * 1.0000001, 2.0**-9 * 1.5])])
    ours = F.e4m3_rn(x)
    theirs = x.clamp(max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)


def test_e4m3_saturates_instead_of_nan_and_decodes_nan():
    assert int(F.e4m3_rn(torch.tensor([1e6]))) == 0x7E
    assert int(F.e4m3_rn(torch.tensor([float("nan")]))) == 0x7F
    assert math.isnan(float(F.e4m3_to_float(torch.tensor([0x7F], dtype=torch.uint8))))
    assert float(F.e4m3_to_float(torch.tensor([0x01], dtype=torch.uint8))) == 2.0**-9


def test_e8m0_decoding():
    b = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8)
    v = F.e8m0_to_float(b)
    assert v[0].item() == 2.0**-127 and v[1].item() == 2.0**-126
    assert v[2].item() == 1.0 and v[3].item() == 2.0 and v[4].item() == 2.0**127
    assert math.isnan(v[5].item())


def test_nibble_order_with_asymmetric_pattern():
    # protects: element 2i in the LOW nibble (PTX cvt.e2m1x2, torch float4_e2m1fn_x2)
    codes = torch.tensor([[0x1, 0xE, 0x7, 0x8]], dtype=torch.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.tolist() == [[0xE1, 0x87]]
    assert torch.equal(F.unpack_nibbles(packed), codes)


def test_nibble_order_agrees_with_torch_float4_e2m1fn_x2():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2 dtype to compare with")
    codes = torch.randint(0, 16, (4, 32), dtype=torch.uint8)
    packed = F.pack_nibbles(codes).view(torch.float4_e2m1fn_x2)
    # torch documents element 2i in bits [3:0]: reinterpret and compare the raw bytes
    assert torch.equal(packed.view(torch.uint8) & 0xF, codes[:, 0::2])
    assert torch.equal(packed.view(torch.uint8) >> 4, codes[:, 1::2])


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 3), (128, 4), (130, 9), (300, 64)])
def test_swizzle_round_trip_and_padding(rows, cols):
    s = torch.randint(0, 255, (2, rows, cols), dtype=torch.uint8)
    sw = F.to_swizzled(s)
    assert sw.shape[-2:] == F.swizzled_shape(rows, cols)
    assert torch.equal(F.from_swizzled(sw, rows, cols), s)
    # padding bytes are zero: the swizzled buffer holds exactly the input's bytes plus zeros
    assert int(sw.long().sum()) == int(s.long().sum())


def test_swizzle_spot_offsets():
    # protects: the byte offset formula of SPEC 6 (CUTLASS Sm1xxBlkScaledConfig / cuBLASLt 128x4)
    rows, cols = 256, 8
    off = F.swizzle_offsets(rows, cols)
    assert off[0, 0] == 0 and off[0, 1] == 1 and off[0, 3] == 3
    assert off[1, 0] == 16 and off[31, 0] == 31 * 16
    assert off[32, 0] == 4 and off[64, 0] == 8 and off[96, 2] == 12 + 2
    assert off[0, 4] == 512
    assert off[128, 0] == (8 // 4) * 512
    assert off[129, 5] == 2 * 512 + 512 + 16 + 1
    assert torch.unique(off).numel() == rows * cols


def test_swizzle_rejects_wrong_padded_shape():
    with pytest.raises(ValueError, match="padded shape"):
        F.from_swizzled(torch.zeros(128, 8, dtype=torch.uint8), 100, 3)


KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    out = philox4x32_10(tuple(map(t, counter)), tuple(map(t, key)))
    assert tuple(int(o) for o in out) == expected


def test_philox_element_to_counter_mapping():
    # protects: SPEC 4's counter (n = i // 4, offset in words 2-3) and key (seed lo, hi) for element i
    seed, offset = (0xA4093822 | (0x299F31D0 << 32)), (0x13198A2E | (0x03707344 << 32))
    words = sr_random_words(12, seed, offset)
    n = 2
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    ref = philox4x32_10((t(n), t(0), t(0x13198A2E), t(0x03707344)), (t(0xA4093822), t(0x299F31D0)))
    assert [int(words[4 * n + j]) for j in range(4)] == [int(r) for r in ref]
