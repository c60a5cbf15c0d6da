"""Small containers for quantized tensors and guidance records (SPEC sections 2, 3, 5 and 6).

They hold plain tensors and describe them; all arithmetic lives in ``reference`` and ``ops``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .formats import MXFP4_BLOCK, NVFP4_BLOCK


def _logical_shape(codes, shape, what: str) -> tuple:
    """The logical shape [..., K] of an FP4 container: given (a sequence of ints), or read off codes [..., K/2]."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{what}: codes must be a uint8 tensor [..., K/2], got {type(codes).__name__}")
    if not shape:
        if codes.dim() < 1:
            raise ValueError(f"{what}: codes must be [..., K/2] (at least 1-D), got a 0-d tensor")
        return (*codes.shape[:-1], codes.shape[-1] * 2)
    shape = tuple(shape)
    # integers (incl. torch.SymInt under torch.compile: anything with __index__), not bools, floats or strings
    if not all(hasattr(type(d), "__index__") and not isinstance(d, bool) and d >= 0 for d in shape):
        raise TypeError(f"{what}: shape must be a tuple of non-negative ints, got {shape!r}")
    return shape


@dataclass
class NVFP4Tensor:
    """NVFP4 data of a logical tensor ``shape`` = [..., K].

    codes:  uint8 [..., K/2], two E2M1 codes per byte (element 2i in the low nibble).
    scales: uint8 [..., K/16] E4M3 bytes (linear), or [..., rows_pad, Kb_pad] when ``swizzled``.
    g:      float32 decode scale per row, shape [...] (per-tensor scales are stored expanded per row).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    g: torch.Tensor
    shape: tuple = field(default=())
    swizzled: bool = False
    format: str = "nvfp4"

    def __post_init__(self):
        self.shape = _logical_shape(self.codes, self.shape, "NVFP4Tensor")

    @property
    def K(self) -> int:
        return self.shape[-1]

    @property
    def block(self) -> int:
        return NVFP4_BLOCK

    def to(self, device) -> "NVFP4Tensor":
        return replace(self, codes=self.codes.to(device), scales=self.scales.to(device), g=self.g.to(device))

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + 4 * self.g.numel()


@dataclass
class MXFP4Tensor:
    """MXFP4 data: codes uint8 [..., K/2], E8M0 scale bytes uint8 [..., K/32]."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple = field(default=())
    format: str = "mxfp4"

    def __post_init__(self):
        self.shape = _logical_shape(self.codes, self.shape, "MXFP4Tensor")

    @property
    def block(self) -> int:
        return MXFP4_BLOCK


@dataclass
class GuidanceRecord:
    """What the rollout recorded of one quantization site for a set of rows (SPEC 5 and 6).

    kind "compact": payload = mantissa bits uint8 [R, K/8] (element 8j+t is bit t, LSB first).
    kind "full":    payload = the rollout's packed codes uint8 [R, K/2].
    scales: the rollout's E4M3 block scale bytes uint8 [R, K/16]; g: its decode scale float32 [R].
    """

    kind: str
    payload: torch.Tensor
    scales: torch.Tensor
    g: torch.Tensor

    def __post_init__(self):
        if self.kind not in ("compact", "full"):
            raise ValueError(f"GuidanceRecord.kind must be 'compact' or 'full', got {self.kind!r}")

    @property
    def rows(self) -> int:
        return self.scales.shape[0]

    @property
    def K(self) -> int:
        return self.scales.shape[-1] * NVFP4_BLOCK

    def nbytes(self) -> int:
        return self.payload.numel() + self.scales.numel() + 4 * self.g.numel()

    def to(self, device, non_blocking: bool = False) -> "GuidanceRecord":
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, payload=mv(self.payload), scales=mv(self.scales), g=mv(self.g))

    def index_rows(self, idx: torch.Tensor) -> "GuidanceRecord":
        return replace(self, payload=self.payload[idx], scales=self.scales[idx], g=self.g[idx])
