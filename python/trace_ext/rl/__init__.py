"""trace_ext.rl: the TRACE alignment layer (SPEC 5, 6, 9): modes, guidance capture / replay, routing replay, metrics.

```
cfg = FP4Config()                                   # NVFP4 W4A4 routed experts + FP4 KV, guidance on the deeper half
model = trace_ext.integrations.hf_moe.convert(model, cfg)
with trace_ext.rl.rollout(model) as rec:            # engine path; records guidance + routes
    out = model.generate(...)
with trace_ext.rl.train(model, mode="guided", guidance=rec.cache):
    logits = model(out[:, :-1]).logits
```
"""
from . import metrics, routing
from .config import FP4Config
from .guidance import GuidanceCache, GuidanceError, GuidanceRecorder, guided_layers
from .session import Session, current_session, model_signature, rollout, train

__all__ = [
    "FP4Config",
    "GuidanceCache",
    "GuidanceError",
    "GuidanceRecorder",
    "Session",
    "current_session",
    "guided_layers",
    "metrics",
    "routing",
    "model_signature",
    "rollout",
    "train",
]
