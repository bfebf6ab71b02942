"""The guard inside the training frameworks people already use, each behind its own extra.

* :mod:`replicheck.integrations.transformers`: ``GuardedTrainer``, a drop-in
  ``transformers.Trainer`` (``pip install 'replicheck[transformers]'``).
* :mod:`replicheck.integrations.lightning`: a Lightning strategy that runs automatic optimisation
  under the guard (``pip install 'replicheck[lightning]'``).
* :mod:`replicheck.integrations.accelerate`: the Accelerate loop's helpers
  (``pip install 'replicheck[accelerate]'``).

Each is built on the public API (:class:`~replicheck.guard.Guard`, :class:`~replicheck.guard.GuardConfig`,
:mod:`replicheck.elastic`) and imports its framework only when imported itself; a missing
framework is an :class:`ImportError` naming the extra to install.
"""

from __future__ import annotations

import importlib


def require(module: str, extra: str) -> None:
    """Import ``module`` or raise an ImportError that says which extra installs it."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"replicheck.integrations.{extra} needs {module!r}: pip install 'replicheck[{extra}]'"
        ) from exc
