"""Small helpers over ``torch.nn.Module`` shared by the training-side packages."""

from __future__ import annotations

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module inside a wrapper that exposes it as ``.module`` (DDP), else ``model``."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model
