"""Fault injection that acts like bad hardware on one rank, and the campaign that measures detection.

Importing this package is cheap; torch is imported by the submodules that need it, on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Fault": "replicheck.faults.injector",
    "FaultHandle": "replicheck.faults.injector",
    "Corruption": "replicheck.faults.injector",
    "BitFlip": "replicheck.faults.patterns",
    "ZeroChunk": "replicheck.faults.patterns",
    "Scale": "replicheck.faults.patterns",
    "NonFinite": "replicheck.faults.patterns",
    "SdcMix": "replicheck.faults.patterns",
    "Change": "replicheck.faults.patterns",
    "Persistent": "replicheck.faults.schedule",
    "Transient": "replicheck.faults.schedule",
    "Intermittent": "replicheck.faults.schedule",
    "Forward": "replicheck.faults.sites",
    "WeightGradient": "replicheck.faults.sites",
    "OptimizerUpdate": "replicheck.faults.sites",
    "WeightsAtRest": "replicheck.faults.sites",
    "ReducedGradient": "replicheck.faults.sites",
    "KernelNoise": "replicheck.faults.noise",
    "RankBias": "replicheck.faults.noise",
    "NoiseModel": "replicheck.faults.noise",
    "NoiseShape": "replicheck.faults.noise",
    "install_noise": "replicheck.faults.noise",
    "FaultError": "replicheck.faults.errors",
    "FaultConfigError": "replicheck.faults.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'replicheck.faults' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
