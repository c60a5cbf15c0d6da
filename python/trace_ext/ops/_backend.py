"""Backend choice shared by every op: backend = "auto" | "cuda" | "reference" (SPEC 10 errors)."""
from __future__ import annotations

import torch

from .._loader import extension_loaded, kernels_usable_on

BACKENDS = ("auto", "cuda", "reference")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """'cuda' when the compiled kernels can run on these tensors' device, else 'reference' (auto only)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    devices = {t.device for t in present}
    if len(devices) > 1:
        raise RuntimeError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if backend == "reference":
        return "reference"
    device = devices.pop() if devices else torch.device("cpu")
    ok, why = kernels_usable_on(device)
    if backend == "cuda" and not ok:
        raise RuntimeError(f"backend='cuda' is unavailable: {why}")
    return "cuda" if ok else "reference"


def torch_op(name: str):
    """torch.ops.trace_ext.<name> (only exists when the extension is loaded)."""
    return getattr(torch.ops.trace_ext, name)


def have_op(name: str) -> bool:
    return extension_loaded() and hasattr(torch.ops.trace_ext, name)
