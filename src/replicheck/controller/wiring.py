"""Building a controller from a config file plus command-line overrides (used by the CLI)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicheck.controller.backends.base import Backend
from replicheck.controller.config import (
    ControllerConfig,
    config_from_mapping,
    load_config_file,
)
from replicheck.controller.errors import ConfigError

BACKENDS = ("local", "slurm", "kubernetes", "hyperpod")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything ``replicheck controller run`` needs."""

    backend: str = "local"
    """Which backend: local, slurm, kubernetes or hyperpod."""
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    """The controller's policy."""
    slurm: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Raw ``[slurm]`` table, turned into a SlurmConfig when the slurm backend is built."""
    kubernetes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Raw ``[kubernetes]`` table (KubernetesConfig)."""
    hyperpod: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Raw ``[hyperpod]`` table (HyperPodConfig)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")


def load_settings(
    config_path: str | Path | None,
    *,
    backend: str | None = None,
    slurm_overrides: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Settings:
    """Settings from an optional TOML file, then non-None ``overrides`` (command-line flags)."""
    data = load_config_file(config_path) if config_path else {}
    section = dict(data.get("controller", {}))
    kind = backend or section.pop("backend", None) or "local"
    controller = config_from_mapping(section).with_overrides(**overrides)
    slurm = {**data.get("slurm", {}), **{k: v for k, v in (slurm_overrides or {}).items() if v is not None}}
    return Settings(
        backend=str(kind),
        controller=controller,
        slurm=slurm,
        kubernetes=dict(data.get("kubernetes", {})),
        hyperpod=dict(data.get("hyperpod", {})),
    )


def make_backend(settings: Settings, db_path: str | Path) -> Backend:
    """The backend named by ``settings``."""
    if settings.backend == "slurm":
        from replicheck.controller.backends.slurm import SlurmBackend, SlurmConfig

        return SlurmBackend(config_from_mapping(settings.slurm, SlurmConfig))
    if settings.backend == "kubernetes":
        from replicheck.controller.backends.kubernetes import KubernetesBackend, KubernetesConfig

        return KubernetesBackend(config_from_mapping(settings.kubernetes, KubernetesConfig))
    if settings.backend == "hyperpod":
        from replicheck.controller.backends.hyperpod import HyperPodBackend, HyperPodConfig

        hyperpod = config_from_mapping(settings.hyperpod, HyperPodConfig)
        orchestrator = None
        if hyperpod.orchestrator != "none":
            orchestrator = make_backend(dataclasses.replace(settings, backend=hyperpod.orchestrator), db_path)
        return HyperPodBackend(hyperpod, orchestrator=orchestrator)
    from replicheck.controller.backends.local import LocalBackend

    return LocalBackend(db_path)


def settings_to_json(settings: Settings) -> str:
    """Remembered in the database so ``replicheck nodes`` talks to the same backend."""
    return json.dumps(
        {
            "backend": settings.backend,
            "slurm": dict(settings.slurm),
            "kubernetes": dict(settings.kubernetes),
            "hyperpod": dict(settings.hyperpod),
        },
        sort_keys=True,
    )


def settings_from_json(text: str | None) -> Settings:
    if not text:
        return Settings()
    data = json.loads(text)
    return Settings(
        backend=data.get("backend", "local"),
        slurm=data.get("slurm", {}),
        kubernetes=data.get("kubernetes", {}),
        hyperpod=data.get("hyperpod", {}),
    )
