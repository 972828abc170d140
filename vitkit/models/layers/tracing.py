"""Whether the model is being traced symbolically by torch.fx (feature extraction, graph rewriting).

Under fx tracing, tensors are proxies without values: input checks and the per-call choice of a faster
kernel (which read shapes, dtypes and devices) step aside, and every layer takes its plain path."""
from __future__ import annotations

import torch.fx._symbolic_trace as _fx

is_fx_tracing = getattr(_fx, "is_fx_symbolic_tracing", _fx.is_fx_tracing)
