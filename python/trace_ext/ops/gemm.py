"""Public NVFP4 GEMM ops (SPEC 7): dense ``fp4_linear``, grouped MoE ``fp4_grouped_linear``, the offline weight
re-layout ``prepare_fp4_weight``, and the routing helpers ``moe_permute`` / ``moe_unpermute``.

W is NVFP4 (codes uint8 [(E,) N, K/2], E4M3 scale bytes [(E,) N, K/16], g_w per matrix, or per output row).
A is bf16 (W4A16) or NVFP4 with per-row g_a (W4A4: pass an NVFP4Tensor, or ``act_quant="nvfp4"`` to quantize a
bf16 A with trace_ext.ops.nvfp4_quantize, RTN, per-row scale). Output bf16, fp32 accumulation; the kernels multiply
the exact bf16 products q * s and apply g_a[m] * g_w once in the epilogue. Every op takes
``backend="auto" | "cuda" | "reference"``; the CUDA kernels are sm_90a (see csrc/gemm_w4_sm90.cu).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .. import formats as F
from .. import reference_gemm as R
from .._loader import extension_loaded
from .._args import check_bool, is_int
from ..tensor import NVFP4Tensor
from ._backend import have_op, resolve_backend, torch_op

ACT_QUANT = (None, "nvfp4")


@dataclass
class PreparedFP4Weight:
    """An NVFP4 weight ready for the GEMM kernels (from ``prepare_fp4_weight``).

    codes [(E,) N, K/2], scales [(E,) N, K/16] (linear layout, kept for every path), g float32 ([1] / [N] dense,
    [E] / [E, N] grouped), packed: the decode kernel's layout (reference_gemm.to_decode_layout) or None when the
    shape does not allow it; prepare_ms: time the re-layout took; packed2: the second decode layout
    (reference_gemm.to_decode_layout2, same size as packed) when asked for (decode_form2), else None.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    g: torch.Tensor
    packed: torch.Tensor | None
    grouped: bool
    prepare_ms: float = 0.0
    packed2: torch.Tensor | None = None

    @property
    def N(self) -> int:
        return self.codes.shape[-2]

    @property
    def K(self) -> int:
        return self.codes.shape[-1] * 2

    @property
    def E(self) -> int:
        return self.codes.shape[0] if self.grouped else 1


def _weight_parts(w, grouped: bool):
    """(codes, scales, g float32 flat) of an NVFP4Tensor / PreparedFP4Weight / (codes, scales, g) tuple."""
    if isinstance(w, PreparedFP4Weight):
        if w.grouped != grouped:
            raise ValueError(f"this weight was prepared with grouped={w.grouped}; the op needs grouped={grouped}")
        return w.codes, w.scales, w.g, w.packed
    if isinstance(w, NVFP4Tensor):
        if w.swizzled:
            raise ValueError("the sm_90 GEMM takes linear scales; convert with formats.from_swizzled first")
        codes, scales, g = w.codes, w.scales, w.g
    elif isinstance(w, (tuple, list)) and len(w) == 3:
        codes, scales, g = w
    else:
        raise TypeError(f"w must be an NVFP4Tensor, a PreparedFP4Weight or (codes, scales, g), got {type(w).__name__}")
    if not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError("w codes and scales must be tensors")
    if codes.dtype != torch.uint8:
        raise TypeError(f"w codes must be uint8, got {codes.dtype}")
    if scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"w scales must be uint8 (E4M3 bytes), got {scales.dtype}")
    scales = scales.view(torch.uint8)
    want_dim = 3 if grouped else 2
    if codes.dim() != want_dim:
        raise ValueError(f"w codes must be {'[E, N, K/2]' if grouped else '[N, K/2]'}, got shape {tuple(codes.shape)}")
    K = codes.shape[-1] * 2
    if K % F.NVFP4_BLOCK:
        raise ValueError(f"K = {K} must be a multiple of {F.NVFP4_BLOCK}")
    if tuple(scales.shape) != (*codes.shape[:-1], K // F.NVFP4_BLOCK):
        raise ValueError(f"w scales must have shape {(*codes.shape[:-1], K // F.NVFP4_BLOCK)}, got {tuple(scales.shape)}")
    if not isinstance(g, torch.Tensor):
        g = torch.tensor([float(g)], dtype=torch.float32, device=codes.device)
    if g.dtype != torch.float32:
        raise TypeError(f"g_w must be float32, got {g.dtype}")
    N = codes.shape[-2]
    E = codes.shape[0] if grouped else 1
    # one value, one per matrix [E], or one per row [E, N] / [N]: the shape must say which (trailing 1s aside), so that
    # a transposed [N, E] is not read as [E, N]
    shape = tuple(g.shape)
    while shape and shape[-1] == 1:
        shape = shape[:-1]
    allowed = {(E,), (E, N)} if grouped else {(), (N,)}
    if shape not in allowed and not (g.numel() == 1 and E == 1):
        want = f"[E={E}] or [E, N]=[{E}, {N}]" if grouped else f"one value or [N={N}]"
        raise ValueError(f"g_w must be {want} (trailing 1s allowed), got shape {tuple(g.shape)}")
    return codes, scales, g.reshape(-1).contiguous(), None


# TRACE_EXT_DECODE_IMPL values whose dense decode kernels read the second packed form (read per call, like the C++
# side in gemm_w4_decode_sm90.cu decode_pair_selected): the op is then given packed2 instead of packed.
DECODE_FORM2_IMPLS = ("pair3", "stream2", "auto2", "quad3", "kslab2")


def decode_form2_selected() -> bool:
    import os

    return os.environ.get("TRACE_EXT_DECODE_IMPL", "") in DECODE_FORM2_IMPLS


def prepare_fp4_weight(w, *, grouped: bool | None = None, decode_form2: bool | None = None) -> PreparedFP4Weight:
    """Offline re-layout at load / weight sync: keeps the linear codes and scales, adds the decode kernel's packed
    layout (when N % 16 == 0 and K % 256 == 0). ``grouped`` defaults to (codes.dim() == 3). ``decode_form2``
    (default: TRACE_EXT_DECODE_IMPL is one of DECODE_FORM2_IMPLS now) also builds the second packed form of the
    opt-in dense decode kernels (to_decode_layout2: N * K * 9 / 16 more bytes per expert, as much as packed)."""
    for name, flag in (("grouped", grouped), ("decode_form2", decode_form2)):
        if flag is not None:
            check_bool(**{name: flag})
    codes = w.codes if isinstance(w, (NVFP4Tensor, PreparedFP4Weight)) else w[0] if isinstance(w, (tuple, list)) else None
    if grouped is None:
        grouped = isinstance(codes, torch.Tensor) and codes.dim() == 3  # (_weight_parts reports what else is wrong)
    codes, scales, g, _ = _weight_parts(w, grouped)
    if codes.is_cuda:
        torch.cuda.synchronize(codes.device)
    t0 = time.perf_counter()
    packed = None
    if R.decode_layout_supported(codes.shape[-2], codes.shape[-1] * 2):
        packed = R.to_decode_layout(codes.contiguous(), scales.contiguous())
    if decode_form2 is None:
        decode_form2 = decode_form2_selected()
    packed2 = None
    if packed is not None and decode_form2 and not grouped:
        packed2 = R.to_decode_layout2(codes.contiguous(), scales.contiguous())
    if codes.is_cuda:
        torch.cuda.synchronize(codes.device)
    ms = (time.perf_counter() - t0) * 1e3
    return PreparedFP4Weight(codes.contiguous(), scales.contiguous(), g, packed, grouped, ms, packed2)


def _activation(a, act_quant, K: int, backend: str):
    """(a tensor for the op, a_scales | None, g_a | None, lead shape) from a bf16 tensor or an NVFP4Tensor."""
    if act_quant not in ACT_QUANT:
        raise ValueError(f"act_quant must be one of {ACT_QUANT}, got {act_quant!r}")
    if isinstance(a, torch.Tensor) and act_quant == "nvfp4":
        if a.dtype != torch.bfloat16:
            raise TypeError(f"a must be bfloat16, got {a.dtype}")
        if a.dim() < 1 or a.shape[-1] != K:
            raise ValueError(f"a must be [..., K={K}], got shape {tuple(a.shape)}")
        from .quant import nvfp4_quantize

        a = nvfp4_quantize(a, backend=backend)
    if isinstance(a, NVFP4Tensor):
        if a.swizzled:
            raise ValueError("a: the sm_90 GEMM takes linear scales; quantize with swizzle=False")
        if a.shape[-1] != K:
            raise ValueError(f"a must have K = {K} (the weight's), got shape {tuple(a.shape)}")
        from .quant import _check_fp4_parts

        _check_fp4_parts(a, F.NVFP4_BLOCK)  # codes, scales and g (per row or one) agree with a.shape
        lead = tuple(a.shape[:-1])
        M = math.prod(lead)
        g = a.g.reshape(-1)
        return (
            a.codes.reshape(M, K // 2).contiguous(),
            a.scales.reshape(M, K // F.NVFP4_BLOCK).contiguous(),
            g.expand(M).contiguous(),
            lead,
        )
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"a must be a bf16 tensor or an NVFP4Tensor, got {type(a).__name__}")
    if a.dtype != torch.bfloat16:
        raise TypeError(f"a must be bfloat16 (W4A16) or an NVFP4Tensor (W4A4), got {a.dtype}")
    if a.dim() < 1 or a.shape[-1] != K:
        raise ValueError(f"a must be [..., K={K}] (K of the weight), got shape {tuple(a.shape)}")
    lead = tuple(a.shape[:-1])
    return a.reshape(math.prod(lead), K).contiguous(), None, None, lead  # rows from lead: reshape(-1, 0) fails at K = 0


_USABLE: dict = {}  # (device, op) -> backend that "auto" resolves to; the decode GEMMs are ~10 us, so per-call
# Python work matters: device capability and build checks run once per device and op.


def _pick(backend: str, op: str, *tensors) -> str:
    """Backend for these tensors (SPEC 10 errors: one device; backend='cuda' must be usable)."""
    dev = None
    for t in tensors:
        if t is None:
            continue
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise RuntimeError(f"all tensors must be on one device, got {dev} and {t.device}")
    if backend == "reference":
        return "reference"
    key = (dev, op)
    which = _USABLE.get(key)
    if which is None or backend not in ("auto", "cuda"):
        which = resolve_backend(backend if backend != "cuda" else "auto", *[t for t in tensors if t is not None])
        if which == "cuda" and not have_op(op):
            which = "reference"
        if backend in ("auto", "cuda"):
            _USABLE[key] = which
    if backend == "cuda" and which != "cuda":
        resolve_backend("cuda", *[t for t in tensors if t is not None])  # raises with the reason
        raise RuntimeError(f"backend='cuda': this build of trace_ext._C has no {op} kernel; rebuild with `pip install .`")
    return which


def _check_device(*tensors):
    devs = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devs) > 1:
        raise RuntimeError(f"all tensors must be on one device, got {sorted(map(str, devs))}")


def fp4_linear(a, w, *, act_quant: str | None = None, backend: str = "auto") -> torch.Tensor:
    """Y[..., N] = A[..., K] @ W[N, K]^T in bf16 (SPEC 7).

    a: bf16 [..., K] (W4A16), or an NVFP4Tensor / ``act_quant="nvfp4"`` (W4A4).
    w: NVFP4Tensor [N, K], PreparedFP4Weight (prepare_fp4_weight) or (codes, scales, g_w).
    """
    codes, scales, g_w, packed = _weight_parts(w, grouped=False)
    N, K = codes.shape[0], codes.shape[1] * 2
    a2, a_s, g_a, lead = _activation(a, act_quant, K, backend)
    which = _pick(backend, "fp4_linear", a2, a_s, g_a, codes, scales, g_w, packed)
    if which == "reference":
        y = R.fp4_linear(a2, codes, scales, g_w, a_s, g_a)
    else:
        if packed is not None and decode_form2_selected():
            # the opt-in form-2 kernels read the second packed form (built here when the weight lacks it: correct,
            # but a re-layout per call; prepare with decode_form2=True to time them)
            p2 = w.packed2 if isinstance(w, PreparedFP4Weight) else None
            packed = p2 if p2 is not None else R.to_decode_layout2(codes, scales)
        y = torch_op("fp4_linear")(a2, a_s, g_a, codes, scales, g_w, packed)
    return y.reshape(*lead, N)


def fp4_grouped_linear(
    a, w, offsets: torch.Tensor, *, act_quant: str | None = None, validate: bool = False, backend: str = "auto"
) -> torch.Tensor:
    """MoE form: rows offsets[e] .. offsets[e+1] of A (sorted by expert) times expert e's W. One kernel launch
    covers all experts; experts with no rows are legal.

    a: bf16 [M, K] or NVFP4Tensor [M, K]; w: [E, N, K] NVFP4 (g_w [E] or [E, N]); offsets: int32 [E + 1].
    validate: check the offsets' values (0 .. M, non-decreasing) on CUDA tensors too (costs a device sync;
    CPU offsets are always checked). Unchecked offsets that break this give an undefined result (rows no expert
    covers are left unwritten) but never an access out of bounds: the kernels clamp the ranges to [0, M] and cap
    their work units at the bound their buffers were sized for.
    """
    codes, scales, g_w, packed = _weight_parts(w, grouped=True)
    E, N, K = codes.shape[0], codes.shape[1], codes.shape[2] * 2
    a2, a_s, g_a, lead = _activation(a, act_quant, K, backend)
    if len(lead) != 1:
        raise ValueError(f"a must be 2-D [M, K] for the grouped op, got lead shape {lead}")
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be an int32 tensor, got {type(offsets).__name__}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets must be int32, got {offsets.dtype}")
    if tuple(offsets.shape) != (E + 1,):
        raise ValueError(f"offsets must have shape ({E + 1},) (E + 1), got {tuple(offsets.shape)}")
    M = a2.shape[0]
    check_bool(validate=validate)
    if validate or not offsets.is_cuda:
        R.check_offsets_values([int(v) for v in offsets.tolist()], E, M)
    which = _pick(backend, "fp4_grouped_linear", a2, a_s, g_a, codes, scales, g_w, offsets, packed)
    if which == "reference":
        return R.fp4_grouped_linear(a2, codes, scales, g_w, offsets, a_s, g_a)
    return torch_op("fp4_grouped_linear")(a2, a_s, g_a, codes, scales, g_w, offsets.contiguous(), packed)


@dataclass
class MoePermutation:
    """Result of moe_permute: x_sorted [T*k, H], src_row [T*k] (token of each sorted row), dest_of [T*k] (sorted row
    of pair t*k + j, -1 when dropped), offsets [E + 1] int32 (for fp4_grouped_linear)."""

    x_sorted: torch.Tensor
    src_row: torch.Tensor
    dest_of: torch.Tensor
    offsets: torch.Tensor


def moe_permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, validate: bool = False,
                backend: str = "auto") -> MoePermutation:
    """Sort the T*k (token, slot) pairs by expert (stable: ties keep t*k + j order) and gather the rows of x.

    Ids outside [0, num_experts) raise ValueError when checked (always on CPU, with validate=True on CUDA), and
    are otherwise dropped (dest_of = -1).
    """
    if not isinstance(x, torch.Tensor) or not isinstance(topk_ids, torch.Tensor):
        raise TypeError("x and topk_ids must be tensors")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, H] and topk_ids [T, k], got {tuple(x.shape)} and {tuple(topk_ids.shape)}")
    if not is_int(num_experts):
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__} {num_experts!r}")
    if not (1 <= int(num_experts) <= 1024):
        raise ValueError(f"num_experts must be in [1, 1024], got {num_experts}")
    _check_device(x, topk_ids)
    check_bool(validate=validate)
    if (validate or not topk_ids.is_cuda) and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must be in [0, {num_experts}), got values in [{lo}, {hi}]")
    which = _pick(backend, "moe_permute", x, topk_ids)
    if which == "reference":
        return MoePermutation(*R.moe_permute(x, topk_ids, int(num_experts)))
    return MoePermutation(*torch_op("moe_permute")(x.contiguous(), topk_ids.contiguous(), int(num_experts)))


def moe_unpermute(y_sorted: torch.Tensor, perm, topk_weights: torch.Tensor, *, validate: bool = False,
                  backend: str = "auto") -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * y_sorted[dest_of[t*k + j]] (fp32, slot order), in y_sorted's dtype.

    perm: the MoePermutation of moe_permute (or its dest_of tensor). dest_of values outside [-1, T*k) raise
    ValueError when checked (always on CPU, with validate=True on CUDA: one device sync) and are otherwise dropped
    like -1 (the kernel never reads outside y_sorted).
    """
    dest_of = perm.dest_of if isinstance(perm, MoePermutation) else perm
    if not all(isinstance(t, torch.Tensor) for t in (y_sorted, dest_of, topk_weights)):
        raise TypeError("y_sorted, dest_of and topk_weights must be tensors")
    if y_sorted.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"y_sorted must be bfloat16, float16 or float32, got {y_sorted.dtype}")
    if topk_weights.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"topk_weights must be float32 or bfloat16, got {topk_weights.dtype}")
    if dest_of.dtype != torch.int32:
        raise TypeError(f"dest_of must be int32, got {dest_of.dtype}")
    if topk_weights.dim() != 2 or y_sorted.dim() != 2 or y_sorted.shape[0] != topk_weights.numel():
        raise ValueError(
            f"y_sorted must be [T*k, H] and topk_weights [T, k], got {tuple(y_sorted.shape)} and {tuple(topk_weights.shape)}"
        )
    if tuple(dest_of.shape) != (topk_weights.numel(),):
        raise ValueError(f"dest_of must have shape ({topk_weights.numel()},), got {tuple(dest_of.shape)}")
    _check_device(y_sorted, dest_of, topk_weights)
    check_bool(validate=validate)
    if (validate or not dest_of.is_cuda) and dest_of.numel():
        lo, hi = int(dest_of.min()), int(dest_of.max())
        if lo < -1 or hi >= dest_of.numel():
            raise ValueError(f"dest_of must be in [-1, {dest_of.numel()}) (-1: dropped), got values in [{lo}, {hi}]")
    which = _pick(backend, "moe_unpermute", y_sorted, dest_of, topk_weights)
    if which == "reference":
        return R.moe_unpermute(y_sorted, dest_of, topk_weights)
    return torch_op("moe_unpermute")(y_sorted.contiguous(), dest_of.contiguous(), topk_weights.contiguous())


# ---- fake and CPU implementations of the compiled ops --------------------------------------------------------


def _cpu_fp4_linear(a, a_scales, g_a, w_codes, w_scales, g_w, w_packed):
    return R.fp4_linear(a, w_codes, w_scales, g_w, a_scales, g_a)


def _cpu_fp4_grouped_linear(a, a_scales, g_a, w_codes, w_scales, g_w, offsets, w_packed):
    return R.fp4_grouped_linear(a, w_codes, w_scales, g_w, offsets, a_scales, g_a)


def _register_compiled_op_impls() -> None:
    lib = "trace_ext::"

    @torch.library.register_fake(lib + "fp4_linear")
    def _(a, a_scales, g_a, w_codes, w_scales, g_w, w_packed):
        return a.new_empty((a.shape[0], w_codes.shape[0]), dtype=torch.bfloat16)

    @torch.library.register_fake(lib + "fp4_grouped_linear")
    def _(a, a_scales, g_a, w_codes, w_scales, g_w, offsets, w_packed):
        return a.new_empty((a.shape[0], w_codes.shape[1]), dtype=torch.bfloat16)

    @torch.library.register_fake(lib + "moe_permute")
    def _(x, topk_ids, num_experts):
        n = topk_ids.shape[0] * topk_ids.shape[1]
        i = torch.int32
        return (
            x.new_empty((n, x.shape[1])),
            x.new_empty((n,), dtype=i),
            x.new_empty((n,), dtype=i),
            x.new_empty((num_experts + 1,), dtype=i),
        )

    @torch.library.register_fake(lib + "moe_unpermute")
    def _(y_sorted, dest_of, topk_weights):
        return y_sorted.new_empty((topk_weights.shape[0], y_sorted.shape[1]))

    torch.library.register_kernel(lib + "fp4_linear", "cpu", _cpu_fp4_linear)
    torch.library.register_kernel(lib + "fp4_grouped_linear", "cpu", _cpu_fp4_grouped_linear)
    torch.library.register_kernel(lib + "moe_permute", "cpu", lambda x, ids, E: R.moe_permute(x, ids, E))
    torch.library.register_kernel(lib + "moe_unpermute", "cpu", R.moe_unpermute)


if extension_loaded() and have_op("fp4_linear") and have_op("moe_permute"):
    _register_compiled_op_impls()
