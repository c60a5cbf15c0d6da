"""The alignment demo's model and task: a small Qwen3-MoE built from a config (no hub download), trained
briefly on a synthetic sequence-reversal task so that its next-token distributions are peaked, and cached.

Every dimension that an FP4 site touches is a multiple of 32 (NVFP4 blocks of 16, MXFP4 blocks of 32):
hidden, moe_intermediate and head_dim. The trained weights are stored under ``cache_dir/<key>/`` where the
key hashes the model config, the task and the training recipe, so a changed recipe retrains by itself.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

CACHE_FORMAT_VERSION = 1  # bump when the meaning of a cached checkpoint changes


@dataclass(frozen=True)
class TaskSpec:
    """Reverse a random string: ``BOS x_1 .. x_n SEP`` -> ``x_n .. x_1 EOS`` (symbols 0..num_symbols-1)."""

    num_symbols: int = 16
    length: int = 8

    @property
    def bos(self) -> int:
        return self.num_symbols

    @property
    def sep(self) -> int:
        return self.num_symbols + 1

    @property
    def eos(self) -> int:
        return self.num_symbols + 2

    @property
    def prompt_len(self) -> int:
        return self.length + 2

    @property
    def response_len(self) -> int:
        return self.length + 1

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """int64 [n, prompt_len]: BOS, n random symbols, SEP."""
        x = torch.randint(0, self.num_symbols, (n, self.length), generator=generator)
        bos = torch.full((n, 1), self.bos, dtype=torch.long)
        sep = torch.full((n, 1), self.sep, dtype=torch.long)
        return torch.cat([bos, x, sep], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """The correct response [n, response_len] of each prompt."""
        x = prompts[:, 1 : 1 + self.length]
        return torch.cat([x.flip(1), torch.full((x.shape[0], 1), self.eos, dtype=torch.long)], dim=1)


@dataclass(frozen=True)
class ModelSpec:
    """Qwen3-MoE dimensions (all FP4-touched dims multiples of 32)."""

    vocab_size: int = 32
    hidden_size: int = 256
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 16
    num_experts_per_tok: int = 4
    max_position_embeddings: int = 64

    def __post_init__(self):
        for name in ("hidden_size", "moe_intermediate_size", "head_dim"):
            v = getattr(self, name)
            if v % 32:
                raise ValueError(f"ModelSpec.{name} must be a multiple of 32 (FP4 blocks), got {v}")


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 200
    batch_size: int = 48
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    label_noise: float = 0.15  # fraction of response symbols replaced by a random one: peaked, not one-hot
    seed: int = 0


@dataclass(frozen=True)
class DemoModelSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    task: TaskSpec = field(default_factory=TaskSpec)
    train: TrainSpec = field(default_factory=TrainSpec)

    def to_dict(self) -> dict:
        return {"model": asdict(self.model), "task": asdict(self.task), "train": asdict(self.train)}

    def cache_key(self) -> str:
        blob = json.dumps({"v": CACHE_FORMAT_VERSION, **self.to_dict()}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


FULL_SPEC = DemoModelSpec()
# --quick (tests): a smaller MoE with the same structure (4 layers, 8 experts top-2, head_dim 32)
QUICK_SPEC = DemoModelSpec(
    model=ModelSpec(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    task=TaskSpec(num_symbols=16, length=6),
    train=TrainSpec(steps=200, batch_size=48, lr=3e-3),
)


def hf_config(spec: ModelSpec):
    """The transformers Qwen3MoeConfig of ``spec`` (sdpa attention, grouped_mm experts for training speed)."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        output_router_logits=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(spec: ModelSpec, seed: int = 0):
    """A freshly initialized Qwen3MoeForCausalLM (float32)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(spec)
    try:
        cfg._experts_implementation = "grouped_mm"
        model = Qwen3MoeForCausalLM(cfg)
    except (ValueError, KeyError, ImportError):  # a transformers without grouped_mm experts
        cfg._experts_implementation = "eager"
        model = Qwen3MoeForCausalLM(cfg)
    return model


def set_experts_implementation(model, impl: str) -> None:
    """Switch the experts backend ("eager" for the FP4 swap and decoding, "grouped_mm" for training)."""
    cfg = model.config
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = impl


def _training_batch(task: TaskSpec, n: int, gen: torch.Generator, noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = task.prompts(n, gen)
    ans = task.answers(prompts)
    if noise > 0:
        flip = torch.rand(ans.shape, generator=gen) < noise
        flip[:, -1] = False  # EOS stays
        ans = torch.where(flip, torch.randint(0, task.num_symbols, ans.shape, generator=gen), ans)
    seq = torch.cat([prompts, ans], dim=1)
    labels = seq.clone()
    labels[:, : task.prompt_len] = -100  # loss on the response only
    return seq, labels


@torch.no_grad()
def greedy_accuracy(model, task: TaskSpec, n: int = 256, seed: int = 12345) -> float:
    """Fraction of response tokens right under teacher forcing with argmax, on clean data (a health check)."""
    gen = torch.Generator().manual_seed(seed)
    seq, labels = _training_batch(task, n, gen)
    dev = next(model.parameters()).device
    logits = model(seq.to(dev)).logits[:, task.prompt_len - 1 : -1]
    return float((logits.argmax(-1).cpu() == seq[:, task.prompt_len :]).float().mean())


def train(model, spec: DemoModelSpec, device="cpu", progress: bool = True) -> dict:
    """Brief AdamW training on the reversal task (float32). Returns a small log."""
    from tqdm.auto import tqdm

    tr = spec.train
    if torch.device(device).type != "cpu":
        set_experts_implementation(model, "eager")  # grouped_mm kernels on GPUs take bf16 only; training is fp32
    model.to(device).train()
    gen = torch.Generator().manual_seed(tr.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=tr.weight_decay, betas=(0.9, 0.98))

    def lr_at(step):
        if step < tr.warmup:
            return (step + 1) / tr.warmup
        p = (step - tr.warmup) / max(1, tr.steps - tr.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    t0 = time.time()
    losses = []
    bar = tqdm(range(tr.steps), desc="train demo MoE", disable=not progress, leave=False)
    for _ in bar:
        seq, labels = _training_batch(spec.task, tr.batch_size, gen, tr.label_noise)
        out = model(seq.to(device), labels=labels.to(device))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return {"final_loss": sum(losses[-10:]) / min(10, len(losses)), "train_seconds": time.time() - t0}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "trace_ext" / "demo"


def load_or_train(spec: DemoModelSpec, cache_dir=None, device="cpu", retrain: bool = False, progress: bool = True):
    """The trained demo model (float32, eval mode) and its info dict; trains and caches it when missing."""
    from safetensors.torch import load_file, save_file

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / spec.cache_key()
    weights, meta_path = path / "model.safetensors", path / "meta.json"
    model = build_model(spec.model, seed=spec.train.seed)
    if weights.exists() and meta_path.exists() and not retrain:
        model.load_state_dict(load_file(str(weights)))
        model.eval()
        info = json.loads(meta_path.read_text())
        info["cached"] = True
        return model, info
    log = train(model, spec, device=device, progress=progress)
    model.to("cpu")
    acc = greedy_accuracy(model, spec.task)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    tmp.replace(weights)
    info = {"spec": spec.to_dict(), "key": spec.cache_key(), "greedy_token_accuracy": acc, **log}
    meta_path.write_text(json.dumps(info, indent=1))
    info["cached"] = False
    return model, info
