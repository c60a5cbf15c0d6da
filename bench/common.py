"""Shared benchmark plumbing: timing of record (triton do_bench, median, cold L2), the copy-bandwidth
anchor measured in the same run, environment stamp, and result files.

Every bench script prints a table and writes JSON + Markdown into an output directory (default
bench/results/, or $OUT on the device machine).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > 5x the H200's 50-60 MB L2


def require_kernels_usable() -> None:
    """Exits with the reason when the compiled kernels cannot run here (no extension, no GPU, wrong arch)."""
    import trace_ext

    b = trace_ext.backends()
    if not b["kernels_usable"]:
        raise SystemExit(f"compiled kernels unusable: {b['kernels_unusable_reason']}")


@contextlib.contextmanager
def env_switch(name: str, value: str | None):
    """Sets environment variable `name` to `value` (None: unset) inside the block and restores it after: the
    extension reads its kernel-variant switches per call, so one process can time several variants."""
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def impl_env(name: str, impl: str | None):
    """env_switch for a kernel-variant name of the A/B benches: `impl` is a value of the switch `name` ("default" or
    None: unset), optionally followed by @VAR=VALUE settings of further switches, e.g.
    kslab-grouped@TRACE_EXT_KSLAB_GRP_PLAN=v1 or default@TRACE_EXT_KSLAB_SEG=smem."""
    value, *extra = (impl or "default").split("@")
    with contextlib.ExitStack() as stack:
        stack.enter_context(env_switch(name, None if value == "default" else value))
        for setting in extra:
            var, val = setting.split("=", 1)
            stack.enter_context(env_switch(var, val))
        yield


def do_bench_cold(fn, rep_ms: int = 200, warmup_ms: int = 25) -> float:
    """Median milliseconds with a cold L2 (do_bench clears the cache before every timed call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written) / time, GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench_cold(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def env_stamp(command: str | None = None) -> dict:
    def git(*args):
        try:
            return subprocess.check_output(["git", *args], cwd=os.path.dirname(__file__), text=True).strip()
        except Exception:
            return os.environ.get("TRACE_EXT_COMMIT", "unknown")

    import trace_ext

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": os.environ.get("TRACE_EXT_COMMIT") or git("rev-parse", "--short", "HEAD"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command or " ".join([os.path.basename(sys.executable)] + sys.argv),
        "backends": {k: v for k, v in trace_ext.backends().items() if k in ("compiled_archs", "kernels_usable")},
    }


def out_dir() -> str:
    d = os.environ.get("BENCH_OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(d, exist_ok=True)
    return d


def write_results(name: str, rows: list[dict], stamp: dict, notes: str = "") -> str:
    """Write <name>.json and <name>.md (table of rows) into out_dir(); returns the Markdown path."""
    d = out_dir()
    with open(os.path.join(d, f"{name}.json"), "w") as f:
        json.dump({"env": stamp, "rows": rows, "notes": notes}, f, indent=1)
    cols = list(rows[0].keys()) if rows else []
    lines = [f"# {name}", "", "| " + " | ".join(f"{k}: {v}" for k, v in stamp.items() if k != "backends") + " |", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    path = os.path.join(d, f"{name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0].keys())
    width = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(width[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def nvfp4_f64(q, e: int | None = None) -> torch.Tensor:
    """float64 dequantization of an NVFP4 tensor from trace_ext.reference.nvfp4_quantize (codes, scales, g), the
    oracle the decode A/B benches check against; e: that expert of a grouped [E, N, K] weight. g comes one value per
    row from the reference ([N], [E, N] or [M] for activations, expanded from the tensor's / matrix's / row's value),
    so it scales rows."""
    from trace_ext import reference_gemm as R  # noqa: PLC0415

    codes, scales, g = (q.codes, q.scales, q.g) if e is None else (q.codes[e], q.scales[e], q.g[e])
    return R.dequantize_f64(codes, scales) * g.double().reshape(-1, 1)


def check_gemm_bound(ys: dict, a64: torch.Tensor, w64: torch.Tensor, where: str = "") -> None:
    """Raises unless every output in ys (name -> Y [M, N]) is within the float64 reference bound of the GPU tests
    (reference_gemm.gemm_tolerance: 1 bf16 ulp + the fp32 accumulation bound) of a64 @ w64^T; NaN counts as out."""
    from trace_ext import reference_gemm as R  # noqa: PLC0415

    ref_bf16 = R.round_to_bf16(a64 @ w64.T)
    tol = R.gemm_tolerance(a64, w64, ref_bf16)
    for tag, y in ys.items():
        bad = int((~((y.double() - ref_bf16.double()).abs() <= tol)).sum())
        if bad:
            raise AssertionError(f"{tag}{where}: {bad} outputs outside the reference bound")
