"""Per-CTA timelines of the lean3 quantizer (bench_quant's 2^26 / 2^28 RTN rows) and the heads8 KV decode (bench_kv's
decode cases) under the benches' conditions (L2 cleared by a 256 MB zero_ before the call, as triton's do_bench does):
when CTAs start and end (launch gap and ramp, waves, tail), how long their steps take, and when the combine pass of the
KV splits runs. The kernels are the extension's templates with the timeline marks compiled in (tools/probes/timeline.cu);
each case is also timed with bench.common.do_bench_cold, with and without the marks' stores, next to the extension's op.
  tools/probes/build_timeline.sh /tmp/timeline.so
  python tools/probes/timeline.py /tmp/timeline.so [quant] [kv] [quant28]
"""
from __future__ import annotations

import ctypes
import datetime
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from common import do_bench_cold  # noqa: E402

SLOTS = 16
RUNS = 5  # recorded calls per case (the table shows the one with the median span)
ITERS_CAP = 4  # the lean grids' default cap (kLeanItersMax), rounded up to whole waves as the extension's default


def stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def ptr(t):
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


class Recorder:
    """Record buffers for the main kernel and its dependent, a 256 MB L2-clearing buffer and the marker word."""

    def __init__(self, lib, ctas0, ctas1=1):
        self.lib = lib
        self.rec = [torch.zeros(max(ctas0, 1) * SLOTS, dtype=torch.int64, device="cuda"),
                    torch.zeros(max(ctas1, 1) * SLOTS, dtype=torch.int64, device="cuda")]
        self.cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
        self.marker = torch.zeros(1, dtype=torch.int64, device="cuda")

    def enable(self, on=True):
        a, b = (ptr(self.rec[0]), ptr(self.rec[1])) if on else (ctypes.c_void_p(0), ctypes.c_void_p(0))
        assert self.lib.timeline_set_records(a, b) == 0

    def record(self, launch):
        """One call after clearing L2, right behind a marker kernel: (marker ns, records0 [n, SLOTS], records1)."""
        for r in self.rec:
            r.zero_()
        self.cache.zero_()
        assert self.lib.timeline_marker(ptr(self.marker), stream()) == 0
        launch()
        torch.cuda.synchronize()
        return int(self.marker.item()), [r.view(-1, SLOTS).cpu() for r in self.rec]


def cta_table(recs):
    """Per CTA: (start, [marks...], end, sm) from the records of the CTAs that ran (slot count > 0)."""
    out = []
    for row in recs.tolist():
        n = row[SLOTS - 1] >> 32
        if n == 0:
            continue
        ts = row[:n]
        out.append((ts[0], ts[1:-1], ts[-1], row[SLOTS - 1] & 0xFFFFFFFF))
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def active_profile(ctas, t0, bin_ns=1000):
    """Resident CTAs per bin_ns bin from t0 to the last end."""
    end = max(c[2] for c in ctas)
    nb = int(math.ceil((end - t0) / bin_ns)) + 1
    prof = [0.0] * nb
    for s, _, e, _ in ctas:
        for b in range(int((s - t0) // bin_ns), int((e - t0) // bin_ns) + 1):
            lo, hi = t0 + b * bin_ns, t0 + (b + 1) * bin_ns
            prof[b] += max(0, min(e, hi) - max(s, lo)) / bin_ns
    return prof


def summarize(name, marker, ctas, slots_full, dep=None):
    """One line of facts about a recorded call, and the resident-CTA profile in 1 us bins."""
    t0 = min(c[0] for c in ctas)
    t_end = max(c[2] for c in ctas)
    starts = sorted(c[0] for c in ctas)
    first_wave = starts[: min(slots_full, len(starts))]
    prof = active_profile(ctas, t0)
    peak = max(prof)
    below = next((i for i in range(len(prof) - 1, -1, -1) if prof[i] >= 0.9 * peak), 0)
    life = [c[2] - c[0] for c in ctas]
    fw = set(id(c) for c in sorted(ctas, key=lambda c: c[0])[:slots_full])
    life_first = [c[2] - c[0] for c in ctas if id(c) in fw]
    life_rest = [c[2] - c[0] for c in ctas if id(c) not in fw]
    line = {
        "case": name,
        "ctas": len(ctas),
        "launch gap us": (t0 - marker) / 1e3,
        "first-wave start spread us": (first_wave[-1] - first_wave[0]) / 1e3,
        "span us": (t_end - t0) / 1e3,
        "tail us (< 90% of peak resident)": (t_end - t0) / 1e3 - (below + 1),
        "CTA life us (first wave / rest)": f"{med(life_first) / 1e3:.2f} / {med(life_rest) / 1e3:.2f}",
        "CTA life us min / max": f"{min(life) / 1e3:.2f} / {max(life) / 1e3:.2f}",
    }
    nm = max(len(c[1]) for c in ctas)
    if nm:  # gaps between consecutive marks (start, marks..., end), medians over CTAs
        gaps = []
        for k in range(nm + 1):
            g = []
            for s, ms, e, _ in ctas:
                pts = [s, *ms, e]
                if k + 1 < len(pts):
                    g.append(pts[k + 1] - pts[k])
            gaps.append(f"{med(g) / 1e3:.2f}")
        line["mark gaps us (median)"] = " ".join(gaps)
    if dep:
        d0 = min(c[0] for c in dep)
        waits = [c[1][0] for c in dep if c[1]]
        line["combine: first start / first past wait / last end, us after decode end"] = (
            f"{(d0 - t_end) / 1e3:.2f} / {(min(waits) - t_end) / 1e3:.2f} / {(max(c[2] for c in dep) - t_end) / 1e3:.2f}"
        )
        line["combine CTA life us (median, past wait)"] = f"{med([c[2] - c[1][0] for c in dep if c[1]]) / 1e3:.2f}"
    return line, prof


def report(title, rec, launch, slots_full, dep=False):
    runs = []
    for _ in range(RUNS):
        marker, (r0, r1) = rec.record(launch)
        ctas = cta_table(r0)
        dctas = cta_table(r1) if dep else None
        runs.append(summarize(title, marker, ctas, slots_full, dctas))
    runs.sort(key=lambda x: x[0]["span us"])
    line, prof = runs[len(runs) // 2]
    print(f"\n### {title}\n")
    for k, v in line.items():
        print(f"- {k}: {v:.2f}" if isinstance(v, float) else f"- {k}: {v}")
    print(f"- spans of the {RUNS} recorded calls, us: " + ", ".join(f"{r[0]['span us']:.2f}" for r in runs))
    print("- resident CTAs per 1 us bin: " + " ".join(f"{p:.0f}" for p in prof))


def bench_pair(rec, launch, op=None):
    """do_bench_cold of the probe launch with the marks' stores on and off, and of the extension's op (us)."""
    rec.enable(True)
    on = do_bench_cold(launch) * 1e3
    rec.enable(False)
    off = do_bench_cold(launch) * 1e3
    rec.enable(True)
    ext = do_bench_cold(op) * 1e3 if op is not None else float("nan")
    return f"do_bench us: probe with marks {on:.2f}, probe without stores {off:.2f}, extension op {ext:.2f}"


def quant_launcher(lib, sms, x, g, codes, scales, g_out):
    """A call of the probe's lean3 quantize launch (g None: per-row g) that returns the grid size."""
    rows, K = x.shape

    def launch():
        grid = lib.launch_quant_lean3(ptr(x), ptr(g), ptr(codes), ptr(scales), ptr(g_out), ctypes.c_int64(rows),
                                      ctypes.c_int64(K), ITERS_CAP, 1, sms, stream())
        assert grid > 0
        return grid

    return launch


def quant_cases(lib, sms, ext):
    for lg in (26, 28):
        rows, K = (1 << lg) // 4096, 4096
        x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
        g_row = (x.float().abs().amax(dim=1) / 2688.0).contiguous()
        codes = torch.empty(rows, K // 2, dtype=torch.uint8, device="cuda")
        scales = torch.empty(rows, K // 16, dtype=torch.uint8, device="cuda")
        g_out = torch.empty(rows, dtype=torch.float32, device="cuda")
        for given in (True, False):
            g = g_row if given else None
            launch = quant_launcher(lib, sms, x, g, codes, scales, g_out)
            grid = launch()
            torch.cuda.synchronize()
            rec = Recorder(lib, grid)
            rec.enable(True)
            name = f"nvfp4 rtn {'g given' if given else 'per-row g'} 2^{lg} ({rows}x{K}), grid {grid}"
            op = None
            if ext is not None:
                op = (lambda g=g: ext.nvfp4_quantize(x, g, 0, 0, 0, None, None, None, False, False))
                ref = ext.nvfp4_quantize(x, g, 0, 0, 0, None, None, None, False, False)
                launch()
                torch.cuda.synchronize()
                assert torch.equal(ref[0], codes) and torch.equal(ref[1], scales), "probe kernel != extension op"
            report(name, rec, launch, sms * 4)
            print("- " + bench_pair(rec, launch, op))
        del x, codes, scales


def quant28_case(lib, sms, ext):
    """The g-given 2^28 row alone (round 98: 255 us here against bench_quant's 170 us): the same call on the same x with
    g computed two ways, before and after a per-row-g call, and on a copy of x at another address; the slowest CTAs
    of one recorded call (id, SM, step gaps) and that call's raw records under $OUT (timeline_quant28_records.pt)."""
    from trace_ext import reference as ref  # noqa: PLC0415 (the pure-torch reference; no extension needed)

    rows, K = (1 << 28) // 4096, 4096
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    g_amax = (x.float().abs().amax(dim=1) / 2688.0).contiguous()
    g_ref = ref.nvfp4_global_scale(x, "row").contiguous()
    print(f"\n### g given 2^28: g_ref == g_amax: {torch.equal(g_ref, g_amax)}, g_ref shape {tuple(g_ref.shape)}")
    codes = torch.empty(rows, K // 2, dtype=torch.uint8, device="cuda")
    scales = torch.empty(rows, K // 16, dtype=torch.uint8, device="cuda")
    g_out = torch.empty(rows, dtype=torch.float32, device="cuda")

    def launcher(xx, g):
        return quant_launcher(lib, sms, xx, g, codes, scales, g_out)

    grid = launcher(x, g_ref)()
    torch.cuda.synchronize()
    rec = Recorder(lib, grid)
    rec.enable(True)
    x2 = x.clone()
    for label, xx, g in (("g_ref", x, g_ref), ("g_amax", x, g_amax), ("per-row g", x, None), ("g_ref again", x, g_ref),
                         ("g_ref, x copy", x2, g_ref), ("per-row g, x copy", x2, None)):
        ms = do_bench_cold(launcher(xx, g)) * 1e3
        print(f"- {label}: do_bench {ms:.2f} us; x at 0x{xx.data_ptr():x}, g at 0x{(g.data_ptr() if g is not None else 0):x}")
    marker, (r0, _) = rec.record(launcher(x, g_ref))
    out = os.environ.get("OUT")
    if out:
        torch.save({"marker": marker, "records": r0, "grid": grid}, os.path.join(out, "timeline_quant28_records.pt"))
    ctas = [(i, *c) for i, c in enumerate(cta_table(r0))]
    t0 = min(c[1] for c in ctas)
    ctas.sort(key=lambda c: c[3] - c[1], reverse=True)
    print(f"- recorded call: span {(max(c[3] for c in ctas) - t0) / 1e3:.2f} us; slowest CTAs (id, SM, start us, life "
          "us, step gaps us):")
    for i, s, ms, e, sm in ctas[:12]:
        gaps = [(b - a) / 1e3 for a, b in zip([s, *ms], [*ms, e])]
        print(f"  - {i} SM {sm} start {(s - t0) / 1e3:.2f} life {(e - s) / 1e3:.2f} gaps " +
              " ".join(f"{g:.2f}" for g in gaps))
    slow = [c for c in ctas if c[3] - c[1] > 20000]
    print(f"- CTAs living > 20 us: {len(slow)}; their SMs: {sorted(set(c[4] for c in slow))[:40]}")


def kv_cases(lib, sms, ext):
    D, page = 128, 16
    cases = [("decode B32 Hq32 Hkv4 S8K", 32, 32, 4, 8192, [8]), ("decode B64 Hq32 Hkv4 S4K", 64, 32, 4, 4096, [4]),
             ("decode B8 Hq32 Hkv8 S32K", 8, 32, 8, 32768, [16]), ("decode B1 Hq32 Hkv8 S128K", 1, 32, 8, 131072, [126]),
             ("decode B32 Hq32 Hkv4 S8K, 1 split", 32, 32, 4, 8192, [1])]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, B, Hq, Hkv, S, split_list in cases:
        pages = S // page
        num_pages = B * pages
        kc = torch.randint(0, 256, (num_pages, page, Hkv, D // 2), dtype=torch.uint8, device="cuda", generator=gen)
        vc = torch.randint(0, 256, (num_pages, page, Hkv, D // 2), dtype=torch.uint8, device="cuda", generator=gen)
        ks = torch.randint(0x30, 0x48, (num_pages, page, Hkv, D // 16), dtype=torch.uint8, device="cuda", generator=gen)
        vs = torch.randint(0x30, 0x48, (num_pages, page, Hkv, D // 16), dtype=torch.uint8, device="cuda", generator=gen)
        table = torch.randperm(num_pages, device="cuda", generator=gen).reshape(B, pages).to(torch.int32)
        seq_lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        q = torch.randn(B, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
        out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(B, Hq, dtype=torch.float32, device="cuda")
        scale, g_k, g_v = 1.0 / math.sqrt(D), 0.01, 0.02
        score_scale = scale * g_k * 16384.0 * 1.4426950408889634
        for splits in split_list:
            o_part = torch.empty(B, Hq, splits, D, dtype=torch.float32, device="cuda")
            lse_part = torch.empty(B, Hq, splits, dtype=torch.float32, device="cuda")
            wide = int(splits * 4 * (Hq // Hkv) * D > (1 << 16))

            def launch(splits=splits, o_part=o_part, lse_part=lse_part, wide=wide):
                n = lib.launch_kv_heads8(ptr(q), ptr(kc), ptr(ks), ptr(vc), ptr(vs), ptr(table), ptr(seq_lens),
                                         ptr(out), ptr(lse), ptr(o_part), ptr(lse_part), B, Hq, Hkv, page, pages,
                                         splits, wide, ctypes.c_float(score_scale), ctypes.c_float(16384.0 * g_v),
                                         stream())
                assert n > 0

            rec = Recorder(lib, splits * (Hkv // 4) * B, B * Hq)
            rec.enable(True)
            op = None
            if ext is not None:
                op = (lambda splits=splits: ext.fp4kv_decode_attention(q, kc, ks, vc, vs, table, seq_lens, scale, g_k,
                                                                       g_v, splits))
                ref_out, ref_lse = op()
                launch()
                torch.cuda.synchronize()
                assert torch.equal(ref_out, out) and torch.equal(ref_lse, lse), "probe kernels != extension op"
            report(f"{name}, {splits} splits ({'wide ' if wide else ''}combine)" if splits > 1 else name, rec, launch,
                   sms * 2, dep=splits > 1)
            print("- " + bench_pair(rec, launch, op))
        del kc, vc, ks, vs


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    what = sys.argv[2:] or ["quant", "kv"]  # quant28: the g-given 2^28 row's diagnosis (quant28_case)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        import trace_ext  # noqa: F401,PLC0415

        ext = torch.ops.trace_ext
    except Exception as e:  # the probe runs without the extension too
        print(f"(extension not importable: {e})")
        ext = None
    commit = os.environ.get("TRACE_EXT_COMMIT", "?")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"# timeline: per-CTA timelines of the lean3 quantizer and the heads8 KV decode\n\n| gpu: "
          f"{torch.cuda.get_device_name()} | SMs: {sms} | torch: {torch.__version__} | cuda: {torch.version.cuda} | "
          f"commit: {commit} | date: {date} | command: python tools/probes/timeline.py {' '.join(what)} |\n")
    print("Times from %globaltimer (ns resolution as the GPU updates it); each case: the recorded call with the median "
          "span of 5, L2 cleared before each. 'tail': from the last 1 us bin with >= 90% of the peak resident CTAs to "
          "the last CTA's end.")
    if "quant" in what:
        quant_cases(lib, sms, ext)
    if "kv" in what:
        kv_cases(lib, sms, ext)
    if "quant28" in what:
        quant28_case(lib, sms, ext)


if __name__ == "__main__":
    main()
