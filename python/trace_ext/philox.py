"""Philox4x32-10 (Random123) in torch integer arithmetic, SPEC section 4.

Key = (seed & 0xffffffff, seed >> 32); element i of a tensor uses counter (n lo, n hi, offset lo,
offset hi) with n = i // 4 and output word i % 4. Same bits on every device: all products are split
into 16-bit halves so they fit int64.
"""
from __future__ import annotations

import torch

PHILOX_M0 = 0xD2511F53  # round multipliers
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # key schedule (golden ratio, sqrt(3) - 1)
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, m: int):
    """(hi, lo) 32-bit halves of the 64-bit product a * m, a holding uint32 values in int64."""
    p_lo = (a & 0xFFFF) * m  # < 2^48
    p_hi = (a >> 16) * m  # < 2^48
    lo = ((p_hi & 0xFFFF) << 16) + p_lo
    hi = (p_hi + (p_lo >> 16)) >> 16
    return hi & _MASK32, lo & _MASK32


def philox4x32_10(counter, key):
    """Philox4x32-10 on int64 tensors holding uint32 words; returns the four output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def sr_random_words(numel: int, seed: int, offset: int, device=None) -> torch.Tensor:
    """The uint32 random word (in int64) of each of ``numel`` elements, flat row-major order."""
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"seed and offset must be in [0, 2^64), got seed={seed} offset={offset}")
    n_calls = (numel + 3) // 4
    n = torch.arange(n_calls, dtype=torch.int64, device=device)
    full = lambda v: torch.full_like(n, v)  # noqa: E731
    counter = (n & _MASK32, n >> 32, full(offset & _MASK32), full(offset >> 32))
    key = (full(seed & _MASK32), full(seed >> 32))
    words = torch.stack(philox4x32_10(counter, key), dim=-1).reshape(-1)
    return words[:numel]
