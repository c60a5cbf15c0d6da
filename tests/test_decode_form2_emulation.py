"""The second decode packed form (reference_gemm.to_decode_layout2, read by the opt-in TRACE_EXT_DECODE_IMPL=pair3 /
stream2 / auto2 kernels of gemm_w4_decode_sm90.cu through decode_word2) expands to the same bf16 values as the
default form. Exhaustive by structure: the extraction (shifts, rotates, ANDs with constants, ORs) copies bits, so
it is fixed by its images of the 32 one-bit words; those are checked to be a bijection onto the 32 bits of the
4 pair masks, and the encoder to place every element bit where that wiring reads it. Then all 2^8 values of every
pair (the extraction of pair j reads only its own 8 bits) and random whole words confirm the composition.
"""
import torch

from trace_ext import reference_gemm as R

P = R.DECODE2_MASK


def _one_bit_images():
    w = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    return R.decode_word_pairs2(w)


def test_form2_extraction_is_a_bit_bijection_onto_the_pair_masks():
    """Protects decode_word2: every word bit lands in exactly one output bit, inside the bf16 mask, and no two word
    bits land on the same (pair, bit): the extraction loses nothing and invents nothing."""
    out = _one_bit_images()
    seen = set()
    for i in range(32):
        hits = [(j, b) for j in range(4) for b in range(32) if (int(out[j][i]) >> b) & 1]
        assert len(hits) == 1, (i, hits)
        j, b = hits[0]
        assert (P >> b) & 1, (i, j, b)
        seen.add(hits[0])
    assert len(seen) == 32
    zero = R.decode_word_pairs2(torch.zeros(1, dtype=torch.int64))
    assert all(int(z[0]) == 0 for z in zero)


def test_form2_extraction_is_or_linear_on_random_words():
    """Protects the structural argument: the emulated extraction of any word is the OR of its one-bit images."""
    g = torch.Generator().manual_seed(7)
    w = torch.randint(0, 2**32, (1 << 16,), dtype=torch.int64, generator=g)
    img = _one_bit_images()
    got = R.decode_word_pairs2(w)
    for j in range(4):
        want = torch.zeros_like(w)
        for i in range(32):
            want |= torch.where(((w >> i) & 1) == 1, img[j][i], torch.zeros_like(w))
        assert torch.equal(got[j], want), j


def test_form2_matches_form1_for_every_pair_value():
    """Protects to_decode_layout2 + decode_word2: for every byte value of every pair position (the other 3 bytes
    cycling through all values in lockstep, plus random ones), form 2 expands to the bf16x2 words of form 1."""
    v = torch.arange(256, dtype=torch.int64)
    for j in range(4):
        for shift in (0, 1, 97):
            b = torch.stack([(v + shift * (k != j) * (k + 1)) % 256 for k in range(4)], dim=-1)
            p1 = R.decode_word_pairs(R.encode_decode_word(b))
            p2 = R.decode_word_pairs2(R.encode_decode_word2(b))
            for q in range(4):
                assert torch.equal(p1[q], p2[q]), (j, shift, q)
    g = torch.Generator().manual_seed(3)
    b = torch.randint(0, 256, (1 << 16, 4), dtype=torch.int64, generator=g)
    p1 = R.decode_word_pairs(R.encode_decode_word(b))
    p2 = R.decode_word_pairs2(R.encode_decode_word2(b))
    assert all(torch.equal(x, y) for x, y in zip(p1, p2))


def test_form2_layout_keeps_scales_and_word_positions():
    """Protects prepare_fp4_weight(decode_form2=True): same size, scale bytes identical, every code word the form-2
    re-encoding of the form-1 word at the same position."""
    g = torch.Generator().manual_seed(11)
    E, N, K = 2, 32, 512
    codes = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (E, N, K // 16), dtype=torch.uint8, generator=g)
    p1 = R.to_decode_layout(codes, scales).reshape(E, -1, 2304)
    p2 = R.to_decode_layout2(codes, scales).reshape(E, -1, 2304)
    assert p1.shape == p2.shape
    assert torch.equal(p1[..., 2048:], p2[..., 2048:])
    sh = torch.arange(0, 32, 8, dtype=torch.int64)
    w1 = (p1[..., :2048].reshape(E, -1, 512, 4).long() << sh).sum(-1)
    w2 = (p2[..., :2048].reshape(E, -1, 512, 4).long() << sh).sum(-1)
    a = R.decode_word_pairs(w1)
    b = R.decode_word_pairs2(w2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_prepare_builds_form2_only_when_asked():
    """Protects the memory of default users: packed2 only with decode_form2=True (or a form-2 TRACE_EXT_DECODE_IMPL)."""
    from trace_ext.ops import gemm as G

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (32, 128), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 127, (32, 16), dtype=torch.uint8, generator=g)
    gw = torch.ones(1)
    assert G.prepare_fp4_weight((codes, scales, gw), decode_form2=False).packed2 is None
    pw = G.prepare_fp4_weight((codes, scales, gw), decode_form2=True)
    assert torch.equal(pw.packed2, R.to_decode_layout2(codes, scales))
