"""Traffic floors under the benches' own timing (bench.common.do_bench_cold) and copy anchor (copy_bandwidth_gbs):
the quantizer-shaped stream of tools/probes/l2_prefetch.cu (2 B read + 0.5625 B written per element, ~9 instructions
per element at W = 0, W rounds of 16 FMAs per block add W per element) at 2^26 and 2^28 elements, and a bare read at
the decode GEMM / KV decode byte counts. The probes' cudaEvent timing around one launch reads lower times than
do_bench, so this is the floor to hold the benches' rows against. Needs torch + triton, not the extension.
  nvcc -O3 -std=c++17 -arch=sm_90a -shared -Xcompiler -fPIC tools/probes/stream_dobench.cu -o /tmp/stream_dobench.so
  python tools/probes/stream_dobench.py /tmp/stream_dobench.so
"""
from __future__ import annotations

import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from common import copy_bandwidth_gbs, do_bench_cold  # noqa: E402


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbs = copy_bandwidth_gbs()
    commit = os.environ.get("TRACE_EXT_COMMIT", "?")
    print(f"# stream_dobench: traffic floors under bench.common.do_bench_cold\n\n| gpu: {torch.cuda.get_device_name()} | "
          f"torch: {torch.__version__} | cuda: {torch.version.cuda} | commit: {commit} | command: "
          f"python tools/probes/stream_dobench.py |\n\ncopy bandwidth (bench.common.copy_bandwidth_gbs, 2 GiB): "
          f"{copy_gbs:.1f} GB/s\n")
    print("| traffic | size | load | W | us | GB/s | % copy |\n|---|---|---|---|---|---|---|")
    names = {0: "ld.global.nc", 3: "ld.global.nc.L1::no_allocate.L2::256B"}
    for lg in (26, 28):
        n = 1 << lg
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        codes = torch.empty(n // 2, device="cuda", dtype=torch.uint8)
        scales = torch.empty(n // 16, device="cuda", dtype=torch.uint8)
        for W in (0, 4, 8):
            for ld in (0, 3):
                def fn():
                    assert lib.launch_quant(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(codes.data_ptr()),
                                            ctypes.c_void_p(scales.data_ptr()), ctypes.c_uint32(n // 16), W, ld,
                                            stream()) == 0
                ms = do_bench_cold(fn)
                gbs = n * 2.5625 / (ms * 1e-3) / 1e9
                print(f"| quantize shape | 2^{lg} elements | {names[ld]} | {W} | {ms * 1e3:.2f} | {gbs:.0f} | "
                      f"{100 * gbs / copy_gbs:.1f} |")
        del x, codes, scales
    out = torch.empty(sms * 8 * 256, device="cuda", dtype=torch.uint32)
    for mb in (7, 14, 33, 75, 151):
        nbytes = mb * 1000 * 1000 // 16 * 16
        x = torch.empty(nbytes, device="cuda", dtype=torch.uint8).random_()
        for ld in (0, 3):
            def fn():
                assert lib.launch_read(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                       ctypes.c_uint32(nbytes // 16), sms, ld, stream()) == 0
            ms = do_bench_cold(fn)
            gbs = nbytes / (ms * 1e-3) / 1e9
            print(f"| bare read | {mb} MB | {names[ld]} | - | {ms * 1e3:.2f} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f} |")
        del x


if __name__ == "__main__":
    main()
