"""FP4 routed experts for transformers 5.x fused expert modules (SPEC 2, 5, 7).

The module keeps its own parameters (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; gpt-oss:
transposed [E, H, 2I] / [E, I, H], interleaved gate/up, biases, clamped activation); ``convert`` only binds
``fp4_experts_forward`` as the instance's forward and attaches an ``ExpertsSpec``. Per session mode:

- none / "bf16": the class's own forward (the untouched model).
- "rollout": weights packed once per weight version (NVFP4 per expert matrix, or MXFP4), token rows quantized
  (W4A4) and recorded, grouped SPEC 7 GEMMs (bf16 out), activation, down input quantized and recorded per
  (token, top-k slot), grouped GEMM, weighted sum in float32.
- "qat" / "guided": the same dataflow with fake-quantized weights (RTN) and activations (RTN, or the rollout's
  guidance), straight-through gradients, GEMMs in ``config.qat_compute_dtype`` with bf16 outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..autograd import fake_quant_grouped_matmul
from ..rl.guidance import GuidanceError
from .gemm import fp4_grouped_linear
from .sites import rollout_quantize, train_fake_quantize


@dataclass
class ExpertsSpec:
    """How one fused experts module is laid out, and where it sits."""

    layer: int
    transposed: bool  # gpt-oss: gate_up_proj [E, H, 2I], down_proj [E, I, H]
    has_bias: bool
    num_experts: int
    hidden_size: int
    intermediate_size: int


def expert_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """K-major GEMM weights (gate_up [E, 2I, H], down [E, H, I]) of a fused experts module (views)."""
    gu, dn = module.gate_up_proj, module.down_proj
    if module._trace_fp4.transposed:
        return gu.transpose(1, 2), dn.transpose(1, 2)
    return gu, dn


def _apply_gate(module, gate_up: torch.Tensor) -> torch.Tensor:
    if hasattr(module, "_apply_gate"):
        return module._apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def pack_expert_weights(module, config, force: bool = False):
    """Quantize the expert weights once per weight version (in-place updates and weight syncs bump it)."""
    gu, dn = module.gate_up_proj, module.down_proj
    version = (gu._version, dn._version, gu.data_ptr(), dn.data_ptr(), config.format)
    cached = getattr(module, "_trace_fp4_packed", None)
    if cached is not None and cached[0] == version and not force:
        return cached[1], cached[2]
    w_gu, w_dn = expert_weights(module)
    with torch.no_grad():
        if config.format == "nvfp4":
            q_gu = ops.nvfp4_quantize(w_gu.detach().contiguous(), scope="matrix", backend=config.backend)
            q_dn = ops.nvfp4_quantize(w_dn.detach().contiguous(), scope="matrix", backend=config.backend)
            q_gu, q_dn = _prepare(q_gu), _prepare(q_dn)
        else:
            q_gu = ops.mxfp4_quantize(w_gu.detach().contiguous(), backend=config.backend)
            q_dn = ops.mxfp4_quantize(w_dn.detach().contiguous(), backend=config.backend)
    module._trace_fp4_packed = (version, q_gu, q_dn)
    return q_gu, q_dn


def _prepare(q):
    """The GEMM op's load-time weight layout (trace_ext.ops.prepare_fp4_weight) when the op module exists."""
    try:
        from ..ops.gemm import prepare_fp4_weight
    except ImportError:
        return q
    return prepare_fp4_weight(q)


def _rows(q, idx):
    """Rows ``idx`` of an FP4 tensor [R, K]."""
    from dataclasses import replace

    if hasattr(q, "g"):
        return replace(q, codes=q.codes[idx], scales=q.scales[idx], g=q.g[idx], shape=(idx.numel(), q.shape[-1]))
    return replace(q, codes=q.codes[idx], scales=q.scales[idx], shape=(idx.numel(), q.shape[-1]))


def _original_forward(module):
    """The class's forward; its eager body when the model's experts backend is trace_fp4 itself (no recursion)."""
    f = type(module).forward
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl == "trace_fp4":
        f = getattr(f, "__wrapped__", f)
    return f


def _check_top_k(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, T: int, E: int) -> None:
    """The router's output (SPEC 10): integer ids [T, k] with weights of one shape. Ids outside [0, E) are a ValueError
    on CPU; on a GPU the check would cost a host sync per layer in the decode loop, so there the router's top-k over E
    logits (or the replay hook's checked ids) is trusted, as the model's own experts forward trusts it."""
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_index and top_k_weights must be [T={T}, k], got {tuple(top_k_index.shape)} and "
                         f"{tuple(top_k_weights.shape)}")
    if not top_k_index.is_cuda and top_k_index.numel():
        lo, hi = int(top_k_index.min()), int(top_k_index.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"top_k_index: expert ids must be in [0, {E}), got values in [{lo}, {hi}]")


def fp4_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Forward of a converted fused experts module: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""
    from ..rl.session import current_session

    sess = current_session()
    spec: ExpertsSpec = self._trace_fp4
    if sess is None or sess.mode == "bf16" or not sess.config.quantizes("experts"):
        return _original_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    cfg = sess.config
    layer = spec.layer
    T, H = hidden_states.shape
    k = top_k_index.shape[-1]
    E = spec.num_experts
    _check_top_k(top_k_index, top_k_weights, T, E)
    out_dtype = hidden_states.dtype
    flat_e = top_k_index.reshape(-1)
    order = torch.sort(flat_e, stable=True).indices
    tok, slot = order // k, order % k
    row_expert = flat_e[order]
    # scatter_add, not bincount: a fixed-size result needs no device->host sync in the decode loop
    counts = torch.zeros(E, dtype=torch.int64, device=flat_e.device).scatter_add_(0, flat_e, torch.ones_like(flat_e))
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=hidden_states.device)
    offsets[1:] = torch.cumsum(counts, 0)

    def keys_tok():
        seq, pos = sess.row_keys()
        if seq.numel() != T:
            raise GuidanceError(f"experts of layer {layer}: {T} token rows, but the forward call has {seq.numel()} tokens")
        return seq, pos

    def keys_down():
        seq, pos = keys_tok()
        return seq[tok], pos[tok], slot

    w4a4 = cfg.activation == "w4a4"
    if sess.mode == "rollout":
        q_gu, q_dn = pack_expert_weights(self, cfg)
        if w4a4:
            a = _rows(rollout_quantize(sess, "expert_in", layer, hidden_states, keys_tok), tok)
        else:
            a = hidden_states[tok]
        h1 = fp4_grouped_linear(a, q_gu, offsets, out_dtype=out_dtype, backend=cfg.backend)
        if spec.has_bias:
            h1 = h1 + self.gate_up_proj_bias[row_expert]
        h = _apply_gate(self, h1).to(out_dtype)
        a2 = rollout_quantize(sess, "expert_down_in", layer, h, keys_down) if w4a4 else h
        h2 = fp4_grouped_linear(a2, q_dn, offsets, out_dtype=out_dtype, backend=cfg.backend)
    else:
        cdt = cfg.qat_compute_dtype
        bounds = offsets.tolist()
        w_gu, w_dn = expert_weights(self)
        if w4a4:
            x = train_fake_quantize(sess, "expert_in", layer, hidden_states, keys_tok, cdt)[tok]
        else:
            x = hidden_states[tok].to(cdt)
        h1 = fake_quant_grouped_matmul(x, w_gu, bounds, cfg.format, cfg.backend).to(out_dtype)
        if spec.has_bias:
            h1 = h1 + self.gate_up_proj_bias[row_expert]
        h = _apply_gate(self, h1).to(out_dtype)
        a2 = train_fake_quantize(sess, "expert_down_in", layer, h, keys_down, cdt) if w4a4 else h.to(cdt)
        h2 = fake_quant_grouped_matmul(a2, w_dn, bounds, cfg.format, cfg.backend).to(out_dtype)
    if spec.has_bias:
        h2 = h2 + self.down_proj_bias[row_expert]
    y = h2.float() * top_k_weights[tok, slot].float()[:, None]
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden_states.device).index_add(0, tok, y)
    return out.to(out_dtype)
