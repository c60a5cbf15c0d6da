"""Does the NVFP4 RTN quantizer's time depend on where x lies? Round 99 (tools/probes/timeline.py quant28) timed the
g-given lean3 kernel at 2^28 on the same values at two addresses: 172 us and 224 us (per-row g: 182 / 185 us). Here the
extension's op at 2^26 and 2^28 on copies of one x at several addresses, g given through the default (lean3 walk) and
through the flat kernels (TRACE_EXT_QUANT_GIVEN_LEAN3=0), and per-row g, each with do_bench_cold (median, L2 cleared).
Codes of every copy and variant are checked equal.
  python tools/probes/quant_address.py        (the extension installed)
"""
from __future__ import annotations

import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from common import copy_bandwidth_gbs, do_bench_cold, env_switch  # noqa: E402

import trace_ext  # noqa: E402, F401
from trace_ext import reference as ref  # noqa: E402

COPIES = 4


def main() -> None:
    op = torch.ops.trace_ext
    copy_gbs = copy_bandwidth_gbs()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"# quant_address: NVFP4 RTN time against x's address\n\n| gpu: {torch.cuda.get_device_name()} | torch: "
          f"{torch.__version__} | cuda: {torch.version.cuda} | commit: {os.environ.get('TRACE_EXT_COMMIT', '?')} | "
          f"date: {date} | command: python tools/probes/quant_address.py |\n\ncopy bandwidth {copy_gbs:.1f} GB/s; "
          f"K 4096; {COPIES} copies of one x (x.clone()), the same g; % copy with quantize bytes (2.5625 B per element)\n")
    print("| elements | copy | x address | g given (default, lean3) us | g given (flat kernels) us | per-row g us |")
    print("|---|---|---|---|---|---|")
    for lg in (26, 28):
        rows, K = (1 << lg) // 4096, 4096
        base = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        g = ref.nvfp4_global_scale(base, "row").contiguous()
        xs = [base] + [base.clone() for _ in range(COPIES - 1)]
        want = op.nvfp4_quantize(base, g, 0, 0, 0, None, None, None, False, False)
        nbytes = rows * K * 2.5625
        for i, x in enumerate(xs):
            times = []
            for var, val, gg in (("TRACE_EXT_QUANT_GIVEN_LEAN3", None, g), ("TRACE_EXT_QUANT_GIVEN_LEAN3", "0", g),
                                 ("TRACE_EXT_QUANT_GIVEN_LEAN3", None, None)):
                with env_switch(var, val):
                    got = op.nvfp4_quantize(x, gg, 0, 0, 0, None, None, None, False, False)
                    if gg is not None:
                        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "codes differ"
                    us = do_bench_cold(lambda x=x, gg=gg: op.nvfp4_quantize(x, gg, 0, 0, 0, None, None, None, False,
                                                                            False)) * 1e3
                times.append(f"{us:.1f} ({100 * nbytes / (us * 1e-6) / 1e9 / copy_gbs:.1f}%)")
            print(f"| 2^{lg} | {i} | 0x{x.data_ptr():x} | " + " | ".join(times) + " |")
        del xs, base


if __name__ == "__main__":
    main()
