"""SPEC 7 in plain torch: the float64 reference of the NVFP4 GEMM (dense and grouped MoE form), the MoE routing
helpers (stable permute by expert, weighted un-permute) and the decode weight layout of ``prepare_fp4_weight``.

The GEMM reference dequantizes both operands in float64 (every NVFP4 value q * s * g is exact there), multiplies in
float64 and rounds once to bfloat16. A kernel accumulates in float32, so tests compare with
``gemm_tolerance``: one bf16 ulp of the reference plus the probabilistic float32 accumulation bound.
"""
from __future__ import annotations

import torch

from . import formats as F

# ---- operands ----------------------------------------------------------------------------------------------------


def dequantize_f64(codes: torch.Tensor, scales: torch.Tensor, g: torch.Tensor | float | None = None) -> torch.Tensor:
    """NVFP4 codes [..., K/2] + scales [..., K/16] (+ g broadcast over the rows) -> float64 [..., K].

    Without g: the products q * s (what the MMA sees). NaN scale bytes give NaN blocks (SPEC 2).
    """
    K = codes.shape[-1] * 2
    q = F.e2m1_to_float(F.unpack_nibbles(codes)).double()
    s = F.e4m3_to_float(scales).double().repeat_interleave(F.NVFP4_BLOCK, dim=-1)
    v = q * s
    if g is None:
        return v.reshape(*codes.shape[:-1], K)
    g = torch.as_tensor(g, dtype=torch.float64, device=codes.device)
    return v * g.double().reshape(*g.shape, 1) if g.dim() else v * g


def round_to_bf16(y: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16 with ONE round-to-nearest-even (torch's cast goes through float32: double rounding).

    The float32 intermediate is made round-to-odd (truncate, set the sticky LSB when inexact), which makes the
    second rounding to bf16 (16 fewer bits) correct.
    """
    y = y.double()
    y32 = y.float()
    finite = torch.isfinite(y) & torch.isfinite(y32)
    inexact = finite & (y32.double() != y)
    bits = y32.view(torch.int32)
    over = y32.double().abs() > y.abs()
    bits = torch.where(inexact & over, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32).to(torch.bfloat16)


def bf16_ulp(r: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each value of r (float64; 2^-133, the smallest bf16 subnormal, at zero)."""
    a = r.double().abs()
    _, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    ulp = torch.ldexp(torch.ones_like(a), (e - 8).clamp(min=-133))
    return torch.where(a > 0, ulp, torch.full_like(a, 2.0**-133))


# ---- GEMM ----------------------------------------------------------------------------------------------------------


def _a_f64(a, a_scales, g_a):
    if a_scales is None:
        return a.double()
    return dequantize_f64(a, a_scales, g_a)


def _g_w_rows(g_w, E: int, N: int, grouped: bool) -> torch.Tensor:
    """g_w as float64 [E, N] from [] / [1] / [N] (dense) or [E] / [E, N] (grouped)."""
    g = torch.as_tensor(g_w).double().reshape(-1)
    if grouped and g.numel() == E:
        return g.reshape(E, 1).expand(E, N)
    if grouped and g.numel() == E * N:
        return g.reshape(E, N)
    if not grouped and g.numel() in (1, N):
        return g.reshape(1, -1).expand(1, N)
    want = f"E={E} or E*N={E * N}" if grouped else f"1 or N={N}"
    raise ValueError(f"g_w must have {want} elements, got shape {tuple(g.shape)}")


def fp4_linear(a, w_codes, w_scales, g_w, a_scales=None, g_a=None, *, exact: bool = False) -> torch.Tensor:
    """Y = A @ W^T (SPEC 7): W NVFP4 [N, K]; A bf16 [M, K] or NVFP4 (codes [M, K/2], a_scales, g_a [M]).

    Returns bf16 [M, N] (or the float64 product when ``exact``).
    """
    N = w_codes.shape[0]
    w = dequantize_f64(w_codes, w_scales) * _g_w_rows(g_w, 1, N, False).reshape(N, 1)
    y = _a_f64(a, a_scales, g_a) @ w.T
    return y if exact else round_to_bf16(y)


def fp4_grouped_linear(a, w_codes, w_scales, g_w, offsets, a_scales=None, g_a=None, *, exact: bool = False):
    """Grouped form: rows offsets[e] .. offsets[e+1] of A use expert e's W (w_codes [E, N, K/2])."""
    E, N = w_codes.shape[0], w_codes.shape[1]
    M = a.shape[0]
    off = [int(v) for v in offsets.tolist()]
    check_offsets_values(off, E, M)
    gw = _g_w_rows(g_w, E, N, True)
    a64 = _a_f64(a, a_scales, g_a)
    y = torch.zeros(M, N, dtype=torch.float64, device=a.device)
    for e in range(E):
        lo, hi = off[e], off[e + 1]
        if hi > lo:
            w = dequantize_f64(w_codes[e], w_scales[e]) * gw[e].reshape(N, 1)
            y[lo:hi] = a64[lo:hi] @ w.T
    return y if exact else round_to_bf16(y)


def check_offsets_values(off: list[int], E: int, M: int) -> None:
    """offsets must be [E+1], start at 0, end at M and never decrease (SPEC 10: ValueError)."""
    if len(off) != E + 1:
        raise ValueError(f"offsets must have E + 1 = {E + 1} entries, got {len(off)}")
    if off[0] != 0 or off[-1] != M or any(off[i + 1] < off[i] for i in range(E)):
        raise ValueError(f"offsets must be non-decreasing from 0 to M = {M}, got {off}")


def gemm_tolerance(a64: torch.Tensor, w64: torch.Tensor, ref_bf16: torch.Tensor) -> torch.Tensor:
    """Allowed |y - ref| per output: one bf16 ulp of the reference plus sqrt(K) * 2^-24 * sum_k |a_k w_k|
    (the probabilistic bound of a float32 sum of K exact products, Higham & Mary 2019). a64 [M, K], w64 [N, K]
    already include all scales."""
    K = a64.shape[1]
    acc = (K**0.5) * 2.0**-24 * (a64.abs() @ w64.abs().T)
    return bf16_ulp(ref_bf16.double()) + acc


# ---- MoE routing -----------------------------------------------------------------------------------------------------


def moe_permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """Stable sort of the T*k (token, slot) pairs by expert.

    Returns x_sorted [T*k, H] (x_sorted[r] = x[src_row[r]]), src_row [T*k] int32, dest_of [T*k] int32 (the
    sorted position of pair t*k + j), offsets [E+1] int32. Ids outside [0, E) are dropped (dest_of = -1, their rows
    come after offsets[E] and are zero).
    """
    T, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, torch.full_like(ids, num_experts))
    order = torch.sort(key, stable=True).indices
    n_valid = int(valid.sum())
    counts = torch.bincount(ids[valid], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    src_row = torch.zeros(T * k, dtype=torch.int32, device=x.device)
    src_row[:n_valid] = (order[:n_valid] // k).to(torch.int32)
    dest_of = torch.full((T * k,), -1, dtype=torch.int32, device=x.device)
    dest_of[order[:n_valid]] = torch.arange(n_valid, dtype=torch.int32, device=x.device)
    x_sorted = torch.zeros(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    x_sorted[:n_valid] = x[src_row[:n_valid].long()]
    return x_sorted, src_row, dest_of, offsets


def moe_unpermute(y_sorted: torch.Tensor, dest_of: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y_sorted[dest_of[t*k + j]], float32, slot order, one rounding per op; dropped
    pairs (dest_of < 0, and values past y_sorted's rows, as the kernel does) contribute nothing. Output dtype =
    y_sorted's."""
    T, k = topk_weights.shape
    n, H = y_sorted.shape
    acc = torch.zeros(T, H, dtype=torch.float32, device=y_sorted.device)
    d = dest_of.reshape(T, k).long()
    w = topk_weights.float()
    for j in range(k):
        ok = (d[:, j] >= 0) & (d[:, j] < n)
        rows = y_sorted[d[:, j].clamp(0, max(n - 1, 0))].float()
        term = w[:, j : j + 1] * rows
        acc = torch.where(ok[:, None], acc + term, acc)
    return acc.to(y_sorted.dtype)


# ---- decode weight layout (prepare_fp4_weight) -------------------------------------------------------------------

DECODE_ROWS = 16  # weight rows per MMA tile (the m16 side of the swapped-operand decode MMA)
DECODE_K = 256  # K per super-tile: 4 k64 steps, 16 scale blocks


def decode_layout_supported(N: int, K: int) -> bool:
    return N % DECODE_ROWS == 0 and K % DECODE_K == 0 and K > 0 and N > 0


# Bit positions (within a 16-bit half) of the 4 bits (sign, e1, e0, m) of pair j of a decode-layout word: the
# kernel extracts pairs 0-2 with one shift and one AND each (mask 0x81C0 per half), pair 3 with three shifts.
DECODE_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (13, 14, 11, 10))


def encode_decode_word(b: torch.Tensor) -> torch.Tensor:
    """4 linear code bytes [..., 4] (elements 0..7) -> the decode kernel's 32-bit word (int64 [...]): pair j =
    (element 2j, element 2j+1) goes to the low / high 16-bit half at DECODE_BITS[j]."""
    b = b.to(torch.int64)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 8)  # element i = nib[..., i]
    w = torch.zeros(b.shape[:-1], dtype=torch.int64, device=b.device)
    for j, pos in enumerate(DECODE_BITS):
        for half in (0, 1):
            n = nib[..., 2 * j + half]
            for bit, p in zip((3, 2, 1, 0), pos):
                w |= ((n >> bit) & 1) << (p + 16 * half)
    return w


def decode_word_pairs(w: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's extraction (int64 emulation): 4 bf16x2 words holding q * 2^-126 of pairs 0..3."""
    M = 0x81C081C0
    return [
        w & M,
        (w << 3) & M,
        (w << 6) & M,
        ((w << 2) & 0x80008000) | ((w >> 4) & 0x00C000C0) | ((w >> 6) & 0x01000100),
    ]


def to_decode_layout(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Linear NVFP4 weight (codes [..., N, K/2], scales [..., N, K/16]) -> the decode kernel's packed bytes.

    Per expert, per 16-row block nb, per 256-K super-tile kb: 2304 bytes =
      codes [kt=0..3][lane=0..31][16]: lane = 4*g + t holds the 16 elements kt*64 + 16t .. +16 (one NVFP4 block)
        of row g as two words (encode_decode_word of its 8 linear bytes, 4 at a time), then row g+8's two words;
      scales [lane][8]: byte 2*kt = scale of (row g, block kt*4 + t), byte 2*kt + 1 = (row g + 8, same block).
    Each lane streams 16 + 2 bytes per 64 K. Returns uint8 [..., N * K / 2 + N * K / 16] (flat per expert).
    """
    *lead, N, Kh = codes.shape
    K = Kh * 2
    if not decode_layout_supported(N, K):
        raise ValueError(f"the decode layout needs N % {DECODE_ROWS} == 0 and K % {DECODE_K} == 0, got N={N}, K={K}")
    L = 1
    for d in lead:
        L *= d
    c = codes.reshape(L, N // 16, 2, 8, K // 256, 4, 4, 8)  # [L, nb, half(g/g+8), g, kb, kt, t, byte]
    c = c.permute(0, 1, 4, 5, 3, 6, 2, 7).contiguous()  # [L, nb, kb, kt, g, t, half, byte]
    words = encode_decode_word(c.reshape(*c.shape[:-1], 2, 4))  # [..., half, 2 words]
    shifts = torch.arange(0, 32, 8, device=codes.device, dtype=torch.int64)
    c = ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)  # little-endian bytes
    c = c.reshape(L, N // 16, K // 256, 4 * 32 * 16)
    s = scales.reshape(L, N // 16, 2, 8, K // 256, 4, 4)  # [L, nb, half, g, kb, kt, t]
    s = s.permute(0, 1, 4, 3, 6, 5, 2)  # [L, nb, kb, g, t, kt, half]
    s = s.reshape(L, N // 16, K // 256, 32 * 8)
    out = torch.cat([c, s], dim=-1).contiguous()
    return out.reshape(*lead, N * K // 2 + N * K // 16)


# ---- second decode layout (form 2, TRACE_EXT_DECODE_IMPL=pair3 / stream2 / auto2) ---------------------------------
# Same bytes per lane as to_decode_layout, another bit order inside each 32-bit word: pair 3 splits into two
# shift classes, so the kernel expands 8 elements with 9 integer ops instead of 11 (decode_word_pairs2):
#   pair 0: w & P;  pair 1: (w << 6) & P;  pair 2: rotl(w, 12) & P;
#   pair 3: ((w << 2) & 0x00400040) | (rotl(w, 10) & 0x81808180),       P = 0x81C081C0 (bf16 bits 15, 8, 7, 6).
# Found by a search over the translates of {6, 7, 8, 15} mod 16 (the bit set of one bf16 half): no 4 of them tile
# Z_16 (one shift class per pair, the form-1 note), but 3 translates plus one split into 2 classes do.
DECODE2_MASK = 0x81C081C0


def _rotl32(w: torch.Tensor, s: int) -> torch.Tensor:
    w = w & 0xFFFFFFFF
    return ((w << s) | (w >> (32 - s))) & 0xFFFFFFFF


def decode_word_pairs2(w: torch.Tensor) -> list[torch.Tensor]:
    """The form-2 kernel's extraction (int64 emulation of gemm_w4_decode_sm90.cu decode_word2): 4 bf16x2 words
    holding q * 2^-126 of pairs 0..3."""
    P = DECODE2_MASK
    w = w & 0xFFFFFFFF
    return [
        w & P,
        (w << 6) & P,
        _rotl32(w, 12) & P,
        ((w << 2) & 0x00400040) | (_rotl32(w, 10) & 0x81808180),
    ]


def _decode2_sources() -> list[list[int]]:
    """src[j][b]: the word bit that pair j's output bit b (of the bf16x2) is read from, derived by running
    decode_word_pairs2 on the 32 one-bit words (the extraction copies bits, so this wiring defines it)."""
    src = [[-1] * 32 for _ in range(4)]
    for i in range(32):
        out = decode_word_pairs2(torch.tensor([1 << i], dtype=torch.int64))
        for j in range(4):
            v = int(out[j][0])
            for b in range(32):
                if (v >> b) & 1:
                    src[j][b] = i
    return src


_DECODE2_SRC = None


def encode_decode_word2(b: torch.Tensor) -> torch.Tensor:
    """4 linear code bytes [..., 4] (elements 0..7) -> the form-2 word (int64 [...]): element 2j + h's bits
    (sign, e1, e0, m) land where decode_word_pairs2 reads bf16 bits (15, 8, 7, 6) + 16 h of pair j."""
    global _DECODE2_SRC
    if _DECODE2_SRC is None:
        _DECODE2_SRC = _decode2_sources()
    b = b.to(torch.int64)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 8)
    w = torch.zeros(b.shape[:-1], dtype=torch.int64, device=b.device)
    for j in range(4):
        for half in (0, 1):
            n = nib[..., 2 * j + half]
            for bit, pos in zip((3, 2, 1, 0), (15, 8, 7, 6)):
                w |= ((n >> bit) & 1) << _DECODE2_SRC[j][pos + 16 * half]
    return w


def to_decode_layout2(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """to_decode_layout with every code word re-encoded by encode_decode_word2 (same size, same byte positions of
    words and scales)."""
    out = to_decode_layout(codes, scales)
    *lead, N, Kh = codes.shape
    K = Kh * 2
    L = 1
    for d in lead:
        L *= d
    t = out.reshape(L, N // 16, K // 256, 2304)
    c = t[..., :2048].reshape(L, N // 16, K // 256, 512, 4).to(torch.int64)
    shifts = torch.arange(0, 32, 8, device=codes.device, dtype=torch.int64)
    words = (c << shifts).sum(-1)  # form-1 words
    # form-1 word -> its 4 linear bytes -> form-2 word (both encoders are bit permutations)
    lin = _decode1_to_linear(words)
    w2 = encode_decode_word2(lin)
    c2 = ((w2.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(L, N // 16, K // 256, 2048)
    res = torch.cat([c2, t[..., 2048:]], dim=-1).contiguous()
    return res.reshape(*lead, N * K // 2 + N * K // 16)


def _decode1_to_linear(w: torch.Tensor) -> torch.Tensor:
    """Inverse of encode_decode_word: form-1 word (int64 [...]) -> 4 linear code bytes (int64 [..., 4])."""
    nib = []
    for j, pos in enumerate(DECODE_BITS):
        for half in (0, 1):
            n = torch.zeros_like(w)
            for bit, p in zip((3, 2, 1, 0), pos):
                n |= ((w >> (p + 16 * half)) & 1) << bit
            nib.append(n)
    return torch.stack([nib[2 * i] | (nib[2 * i + 1] << 4) for i in range(4)], dim=-1)
