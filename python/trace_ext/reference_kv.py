"""The FP4 KV cache of SPEC 8 in plain torch: the oracle of the CUDA append and decode-attention kernels.

- ``append``: quantize new K/V rows with ``reference.nvfp4_quantize`` (static per-layer g, one row = one
  (token, kv head) of head_dim elements) and scatter codes and scale bytes into their pages.
- ``gather_codes`` / ``gather``: read the cached rows of every sequence back in [B, H_kv, S_max, ...] order
  (zeros past each sequence's length), dequantized with ``reference.nvfp4_dequantize``.
- ``decode_attention``: one query per sequence over its whole cached length (causal: the query is the newest
  token), GQA by repeating K/V heads, computed in float64 from the dequantized cache; returns the output and
  the natural-log log-sum-exp of the scaled scores (-inf and a zero output for an empty sequence).

Argument checking (SPEC 10) lives in ``trace_ext.ops.kv``; these functions assume checked arguments.
"""
from __future__ import annotations

import torch

from . import reference as ref
from .tensor import NVFP4Tensor


def token_positions(cu_seqlens: torch.Tensor, start_pos: torch.Tensor, total: int):
    """(sequence id, cache position) of every token of a concatenated batch of new tokens, int64 [total]."""
    cu = cu_seqlens.long()
    counts = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=cu.device), counts, output_size=total)
    pos = start_pos.long()[seq] + torch.arange(total, device=cu.device) - cu[seq]
    return seq, pos


def quantize_rows(x: torch.Tensor, g: float) -> NVFP4Tensor:
    """NVFP4 RTN of x [..., D] with the static decode scale g (SPEC 2): what the cache stores."""
    return ref.nvfp4_quantize(x, torch.tensor(g, dtype=torch.float32, device=x.device))


def append(
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    g_k: float,
    g_v: float,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
) -> None:
    """Token j of sequence b (rows cu_seqlens[b] + j of k_new / v_new) goes to position start_pos[b] + j."""
    T = k_new.shape[0]
    if T == 0:
        return
    P = k_codes.shape[1]
    seq, pos = token_positions(cu_seqlens, start_pos, T)
    page = block_table.long()[seq, pos // P]
    slot = pos % P
    for x, g, codes, scales in ((k_new, g_k, k_codes, k_scales), (v_new, g_v, v_codes, v_scales)):
        q = quantize_rows(x, g)
        codes[page, slot] = q.codes
        scales[page, slot] = q.scales


def gather_codes(codes: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
    """Codes [B, H, S_max, D/2] and scale bytes [B, H, S_max, D/16] of the cached rows; zero past each length."""
    B = block_table.shape[0]
    P = codes.shape[1]
    S = int(seq_lens.max()) if B else 0
    t = torch.arange(S, device=codes.device)
    valid = t[None, :] < seq_lens.long()[:, None]  # [B, S]
    page_col = (t // P).clamp(max=max(block_table.shape[1] - 1, 0))
    page = block_table.long()[:, page_col] if S else block_table.new_zeros((B, 0)).long()
    page = torch.where(valid, page, torch.zeros_like(page))
    slot = (t % P)[None, :].expand(B, S)
    c = codes[page, slot]  # [B, S, H, D/2]
    s = scales[page, slot]
    c = torch.where(valid[:, :, None, None], c, torch.zeros_like(c))
    s = torch.where(valid[:, :, None, None], s, torch.zeros_like(s))
    return c.permute(0, 2, 1, 3).contiguous(), s.permute(0, 2, 1, 3).contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, g: float, dtype: torch.dtype) -> torch.Tensor:
    """x^ = fl(fl(q * s_b) * g) (SPEC 2) of codes [..., D/2] / scales [..., D/16], cast to dtype."""
    D = codes.shape[-1] * 2
    rows = codes.shape[:-1]
    gt = torch.tensor(g, dtype=torch.float32, device=codes.device).expand(rows)
    return ref.nvfp4_dequantize(NVFP4Tensor(codes, scales, gt, (*rows, D)), dtype)


def gather(k_codes, k_scales, v_codes, v_scales, g_k, g_v, block_table, seq_lens, dtype=torch.float32):
    """Dequantized (K, V) [B, H_kv, S_max, D] in ``dtype``; zeros past each sequence's length."""
    kc, ks = gather_codes(k_codes, k_scales, block_table, seq_lens)
    vc, vs = gather_codes(v_codes, v_scales, block_table, seq_lens)
    return dequantize(kc, ks, g_k, dtype), dequantize(vc, vs, g_v, dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float):
    """Decode attention in float64: q [B, Hq, D], k/v [B, H_kv, S, D] (rows past seq_lens[b] ignored).

    Returns (out float32 [B, Hq, D], lse float32 [B, Hq]); an empty sequence gives out 0 and lse -inf.
    """
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qd = q.double().reshape(B, Hkv, G, D)
    scores = torch.einsum("bhgd,bhsd->bhgs", qd, k.double()) * float(softmax_scale)
    valid = torch.arange(S, device=q.device)[None, :] < seq_lens.long()[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if S else torch.full((B, Hkv, G), float("-inf"), dtype=torch.float64, device=q.device)
    finite = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    p = torch.where(finite[..., None], p, torch.zeros_like(p))
    out = torch.einsum("bhgs,bhsd->bhgd", p, v.double())
    return out.reshape(B, Hq, D).float(), lse.reshape(B, Hq).float()


def decode_attention(
    q: torch.Tensor,
    k_codes,
    k_scales,
    v_codes,
    v_scales,
    g_k: float,
    g_v: float,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
):
    """Reference decode attention over the paged cache: (out float32 [B, Hq, D], lse float32 [B, Hq])."""
    k, v = gather(k_codes, k_scales, v_codes, v_scales, g_k, g_v, block_table, seq_lens, torch.float32)
    return attention_with_lse(q, k, v, seq_lens, softmax_scale)


def bottom_right_causal_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    """bool [s_q, s_k], True where query i (at position s_k - s_q + i) may attend key j."""
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    return torch.arange(s_k, device=device)[None, :] <= i

