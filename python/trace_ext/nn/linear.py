"""FP4Linear: an nn.Linear replacement for attention projections, shared experts, dense MLPs and
transformers 4.x ModuleList experts (SPEC 2, 5, 7). Keeps the original ``weight`` / ``bias`` parameters.

Modes as for the fused experts: none / "bf16" -> F.linear; "rollout" -> weight packed once (one g per matrix),
W4A4 rows quantized and recorded under ``site``, SPEC 7 GEMM, bf16 out; "qat" / "guided" -> fake-quant weight
(RTN) and input (RTN or guided) with STE, matmul in ``config.qat_compute_dtype``.
Rows are keyed by the session's (seq, pos) when the input holds every token of the forward call ([B, S, K] or
[B * S, K]); 4.x experts see routed subsets, which cannot be keyed (guidance for them raises).
"""
from __future__ import annotations

import torch
import torch.nn.functional as Fn

from .. import ops
from .._args import is_int
from ..autograd import fake_quant_grouped_matmul
from ..rl.config import SITE_GROUPS
from .gemm import fp4_linear
from .sites import rollout_quantize, train_fake_quantize


class FP4Linear(torch.nn.Module):
    """FP4 twin of an nn.Linear. ``site``: "<group>.<name>" (e.g. "attn_proj.q_proj"); ``layer``: decoder layer."""

    def __init__(self, linear: torch.nn.Linear, site: str, layer: int, group: str, block: int = 16):
        super().__init__()
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"FP4Linear wraps an nn.Linear, got {type(linear).__name__}")
        if not isinstance(site, str) or not isinstance(group, str):
            raise TypeError(f"FP4Linear: site and group must be strings, got {site!r} and {group!r}")
        if group not in SITE_GROUPS:
            raise ValueError(f"FP4Linear: group must be one of {SITE_GROUPS}, got {group!r}")
        if not is_int(layer):
            raise TypeError(f"{site}: layer must be an int (the decoder layer), got {type(layer).__name__} {layer!r}")
        if layer < 0:
            raise ValueError(f"{site}: layer must be >= 0, got {layer}")
        if block not in (16, 32):
            raise ValueError(f"{site}: block must be 16 (NVFP4) or 32 (MXFP4), got {block}")
        if linear.in_features % block:
            raise ValueError(f"{site}: in_features={linear.in_features} must be a multiple of the {block}-element FP4 block")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.site, self.layer, self.group = site, layer, group
        self._packed = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, site={self.site}, layer={self.layer}"

    def to_linear(self) -> torch.nn.Linear:
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = self.weight
        lin.bias = self.bias
        return lin

    def packed_weight(self, config):
        w = self.weight
        version = (w._version, w.data_ptr(), config.format)
        if self._packed is None or self._packed[0] != version:
            with torch.no_grad():
                if config.format == "nvfp4":
                    q = ops.nvfp4_quantize(w.detach().contiguous(), scope="tensor", backend=config.backend)
                else:
                    q = ops.mxfp4_quantize(w.detach().contiguous(), backend=config.backend)
            self._packed = (version, q)
        return self._packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..rl.session import current_session

        sess = current_session()
        if sess is None or sess.mode == "bf16" or not sess.config.quantizes(self.group):
            return Fn.linear(x, self.weight, self.bias)
        cfg = sess.config
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        R = x2.shape[0]

        def keys():
            seq, pos = sess.row_keys()
            return (seq, pos) if seq.numel() == R else None

        w4a4 = cfg.activation == "w4a4"
        if sess.mode == "rollout":
            a = rollout_quantize(sess, self.site, self.layer, x2, keys) if w4a4 else x2
            y = fp4_linear(a, self.packed_weight(cfg), out_dtype=x.dtype, backend=cfg.backend)
        else:
            cdt = cfg.qat_compute_dtype
            a = train_fake_quantize(sess, self.site, self.layer, x2, keys, cdt) if w4a4 else x2.to(cdt)
            # one matrix = one g (SPEC 2 weights): the grouped form with E = 1
            y = fake_quant_grouped_matmul(a, self.weight.unsqueeze(0), [0, R], cfg.format, cfg.backend).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)
