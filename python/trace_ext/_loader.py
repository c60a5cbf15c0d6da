"""Loads the compiled extension ``trace_ext._C`` if it is there; never fails the import.

``backends()`` reports what is usable on this machine: whether the extension was built and loaded (and
why not), the CUDA archs it was compiled for, and the capability of the visible GPU.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("trace_ext")

_STATE = {"loaded": False, "reason": "not tried yet"}


def _load() -> None:
    try:
        from . import _C  # noqa: F401  (registers the torch.ops.trace_ext kernels)
    except ImportError as e:
        _STATE.update(loaded=False, reason=f"trace_ext._C could not be imported: {e}")
        log.info("trace_ext: running on the reference path only (%s)", _STATE["reason"])
        return
    _STATE.update(loaded=True, reason=None)


_load()


def build_config() -> dict:
    """What setup.py recorded at build time (archs, CUTLASS), or {} for a pure-Python install."""
    try:
        from . import _build_config
    except ImportError:
        return {}
    return dict(_build_config.CONFIG)


def extension_loaded() -> bool:
    return _STATE["loaded"]


def compiled_archs() -> list[str]:
    return list(build_config().get("cuda_archs", [])) if extension_loaded() else []


def _arch_of_capability(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}a"


def kernels_usable_on(device: torch.device) -> tuple[bool, str | None]:
    """Can the compiled kernels run on this CUDA device? (ok, reason-if-not)."""
    if not extension_loaded():
        return False, (
            f"the CUDA extension is not available ({_STATE['reason']}); build it with `pip install .` on a machine "
            "with nvcc and a CUDA build of torch"
        )
    if device.type != "cuda":
        return False, f"tensors are on {device}, the kernels need a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    arch = _arch_of_capability(cap)
    if arch not in compiled_archs():
        return False, (
            f"trace_ext was built for {';'.join(compiled_archs()) or 'no CUDA arch'} but this GPU is sm_{cap[0]}{cap[1]}; "
            f"rebuild with TRACE_EXT_CUDA_ARCHS='{arch}'"
        )
    return True, None


def backends() -> dict:
    """What is usable here, and what backend='auto' picks for CUDA tensors."""
    cuda = torch.cuda.is_available()
    cap = torch.cuda.get_device_capability() if cuda else None
    usable, why = kernels_usable_on(torch.device("cuda")) if cuda else (False, "no CUDA device visible")
    cfg = build_config()
    return {
        "extension": extension_loaded(),
        "extension_error": _STATE["reason"],
        "compiled_archs": compiled_archs(),
        "cutlass": cfg.get("cutlass"),
        "cuda_available": cuda,
        "gpu_capability": cap,
        "kernels_usable": usable,
        "kernels_unusable_reason": why,
        "auto_on_cuda_tensors": "cuda" if usable else "reference",
        "auto_on_cpu_tensors": "reference",
    }
