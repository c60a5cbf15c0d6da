"""CPU emulation of the KV append warp-stream kernel's index walk (csrc/kv_append_fp4.cu, fp4kv_append_warp_kernel,
TRACE_EXT_KV_APPEND_IMPL=warp / warp2) and of its host-side sizing (FastDiv multipliers, items per token, the 32-item
step split into whole tokens + items, one wave of chunks of at least 32 items).

Protects: every (tensor, token, head, block) item is written exactly once, at the cache row the default kernel
computes (page = block_table[b, pos / P], pos = start_pos[b] + token - cu[b]), for the shapes of the GPU tests
(tests/gpu/test_kv_gpu.py: test_append_warp_kernel_page_sizes_and_head_counts, ..._is_bit_exact, the bench shape)
including P = 1 (a table load per token), H_kv = 1 (one item per token: a step of 32 whole tokens), small T (one
partial wave, chunks of 32 items, lanes idle in the last chunk), empty sequences and lanes that cross sequence and
page boundaries inside one step, on H200-like (132 SMs, 3 / 4 CTAs per SM) and small devices. The emulation follows
the kernel's integer arithmetic statement by statement (32-bit FastDiv umulhi >> shr, the binary search from b + 1 at
sequence entry, the page cache reset at sequence entry).
"""

import math
import random

import pytest

WARPS_PER_CTA = 8  # kAppendThreads / 32


def fastdiv_make(d):
    """FastDiv::make: (mul, shr) with n / d == umulhi(n, mul) >> shr for 0 <= n < 2^31; d == 1 has mul 0."""
    if d == 1:
        return 0, 0
    l = 0
    while (1 << l) < d:
        l += 1
    p = 31 + l
    return ((1 << p) + d - 1) // d, p - 32


def fast_div(n, fd):
    mul, shr = fd
    assert 0 <= n < 2**31
    return n if mul == 0 else ((n * mul) >> 32) >> shr


def sequence_of_token_from(cu, lo, batch, token):
    """Largest b in [lo, batch) with cu[b] <= token (the kernel's precondition: cu[lo] <= token)."""
    assert cu[lo] <= token
    hi = batch - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if cu[mid] <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


def warp_walk(counts, start, table, H, D, P, kper, sms, ctas_per_sm):
    """{(tensor, cache_row, first block): [(token, head, first block), ...]} as the warp kernel writes them."""
    B = len(counts)
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    T = cu[-1]
    max_pages = len(table[0])
    nb = D // 16
    ni = nb // kper
    items_per_token = H * ni
    fd_it, fd_ni, fd_p = fastdiv_make(items_per_token), fastdiv_make(ni), fastdiv_make(P)
    step_tokens, step_items = 32 // items_per_token, 32 % items_per_token
    per_tensor = T * items_per_token
    resident_warps = sms * max(ctas_per_sm, 1) * WARPS_PER_CTA
    want_per_tensor = max(1, resident_warps // 2)
    chunk = max(32, (per_tensor + want_per_tensor - 1) // want_per_tensor)
    warps_per_tensor = (per_tensor + chunk - 1) // chunk
    grid = (2 * warps_per_tensor + WARPS_PER_CTA - 1) // WARPS_PER_CTA
    flat_table = [x for row in table for x in row]
    written = {}
    for warp in range(grid * WARPS_PER_CTA):
        if warp >= 2 * warps_per_tensor:
            continue
        is_v = warp >= warps_per_tensor
        w = warp - warps_per_tensor if is_v else warp
        for lane in range(32):
            f = w * chunk + lane
            end = min(w * chunk + chunk, per_tensor)
            if f >= end:
                continue
            tok = fast_div(f, fd_it)
            c = f - tok * items_per_token
            b = sequence_of_token_from(cu, 0, B, tok)
            cu_next = cu[b + 1]
            seq_off = start[b] - cu[b]
            pcol, prow = -1, 0
            while f < end:
                head = fast_div(c, fd_ni)
                blk = (c - head * ni) * kper
                assert 0 <= tok < T and 0 <= head < H and 0 <= blk < nb  # the bf16 loads stay in the input
                if tok >= cu_next:
                    b = sequence_of_token_from(cu, b + 1, B, tok)
                    cu_next = cu[b + 1]
                    seq_off = start[b] - cu[b]
                    pcol = -1
                pos = tok + seq_off
                col = fast_div(pos, fd_p)
                if col != pcol:
                    pcol = col
                    assert 0 <= col < max_pages
                    prow = (flat_table[b * max_pages + col] - col) * P
                cache_row = (prow + pos) * H + head
                written.setdefault((int(is_v), cache_row, blk), []).append((tok, head, blk))
                c += step_items
                tok += step_tokens
                if c >= items_per_token:
                    c -= items_per_token
                    tok += 1
                f += 32
    return written


def expected_writes(counts, start, table, H, D, P, kper):
    """The default kernel's addressing (division, binary search over all of cu, one table load per item)."""
    out = {}
    t = 0
    for b, n in enumerate(counts):
        for j in range(n):
            pos = start[b] + j
            row = table[b][pos // P] * P + pos % P
            for tensor in (0, 1):
                for h in range(H):
                    for blk in range(0, D // 16, kper):
                        out[(tensor, row * H + h, blk)] = [(t, h, blk)]
            t += 1
    return out


def check(counts, start, H, D, P, kper, sms, ctas, seed):
    max_pages = math.ceil((max(s + c for s, c in zip(start, counts)) + 1) / P)
    pages = list(range(len(counts) * max_pages))
    random.Random(seed).shuffle(pages)
    table = [pages[i * max_pages : (i + 1) * max_pages] for i in range(len(counts))]
    got = warp_walk(counts, start, table, H, D, P, kper, sms, ctas)
    want = expected_writes(counts, start, table, H, D, P, kper)
    twice = [k for k, v in got.items() if len(v) > 1]
    assert not twice, f"items written twice, e.g. {twice[0]}: {got[twice[0]]}"
    assert got.keys() == want.keys(), (
        f"missing {sorted(want.keys() - got.keys())[:3]}, stray {sorted(got.keys() - want.keys())[:3]}"
    )
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"wrong source rows, e.g. {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"


# (SMs, CTAs per SM): the H200 at four blocks per item (80 registers: 3 CTAs) and two (4 CTAs), and a small device
DEVICES = [(132, 3), (132, 4), (2, 1)]


@pytest.mark.parametrize("sms,ctas", DEVICES)
@pytest.mark.parametrize("kper", [4, 2])
@pytest.mark.parametrize("P", [1, 7, 16])
@pytest.mark.parametrize("H", [1, 3, 8])
def test_walk_page_sizes_and_head_counts(H, P, kper, sms, ctas):
    """The GPU test test_append_warp_kernel_page_sizes_and_head_counts (D = 64; T = 420: one partial wave of 32-item
    chunks), [1-1-warp] included: prefill chunks of 97, 33, 0, 250 tokens at 3, 0, 11, 6, then 40 decode tokens."""
    rng = random.Random(10 * P + H)
    counts = [97, 33, 0, 250] + [1] * 40
    start = [3, 0, 11, 6] + [rng.randrange(300) for _ in range(40)]
    check(counts, start, H, 64, P, kper, sms, ctas, seed=P * 100 + H)


@pytest.mark.parametrize("sms,ctas", DEVICES)
@pytest.mark.parametrize("D,kper", [(128, 4), (64, 4), (128, 2), (96, 2)])
def test_walk_adversarial_shape(D, kper, sms, ctas):
    """test_append_warp_kernel_is_bit_exact's batch: an empty sequence, one-token sequences, a start at 4095."""
    counts = [300, 1, 0, 17, 64, 1, 1, 129]
    start = [5, 4095, 3, 0, 40, 7, 16, 1]
    check(counts, start, 4, D, 16, kper, sms, ctas, seed=D)


@pytest.mark.parametrize("sms,ctas", DEVICES)
def test_walk_tiny_and_trailing_empty_sequences(sms, ctas):
    """Fewer items than one lane step (T = 1, H = 1: one lane of one warp busy), empty sequences first and last."""
    check([0, 1, 0, 0], [0, 3, 0, 9], 1, 64, 1, 4, sms, ctas, seed=1)
    check([0, 0, 5, 0, 2, 0], [1, 2, 3, 4, 5, 6], 2, 128, 3, 4, sms, ctas, seed=2)


@pytest.mark.parametrize("H", [8, 3])
def test_walk_long_chunks(H):
    """Chunks of ~1000 items (a 4-SM device, one CTA each: 16 warps per tensor) over many steps: H_kv 8, D 128 gives
    steps of exactly 2 tokens (kPer 4: 16 items per token) or 1 token (kPer 2), H_kv 3 steps of 5 tokens + 2 items
    (kPer 4: 6 items per token) or 2 tokens + 8 items (kPer 2: 12), so lanes carry a partial token between steps."""
    counts = [700, 1, 1, 0, 333]
    start = [0, 50, 1023, 7, 16]
    for kper in (4, 2):
        check(counts, start, H, 128, 16, kper, 4, 1, seed=kper)
