"""The two Lightning namespaces the callback serves: ``pytorch_lightning`` and ``lightning.pytorch``.

Both packages ship the same Trainer under different names, with distinct classes: a callback derived from
``pytorch_lightning.Callback`` is not a ``lightning.pytorch.Callback``, and ``LightningCLI`` checks a YAML
``class_path`` against its own namespace's ``Callback``. So :data:`CALLBACK_BASES` holds the ``Callback`` of
every installed namespace and :class:`~spectral_monitor.SpectralMonitor` derives from all of them: it is a
callback of both Trainers and both CLIs. Either package alone is enough.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "CALLBACK_BASES",
    "NAMESPACES",
    "MisconfigurationException",
    "TensorBoardLogger",
    "pl",
    "rank_zero_warn",
]


def _installed(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


NAMESPACES: tuple[ModuleType, ...] = tuple(
    namespace
    for namespace in (_installed("pytorch_lightning"), _installed("lightning.pytorch"))
    if namespace is not None
)
"""The installed Lightning namespaces, ``pytorch_lightning`` first."""

if not NAMESPACES:
    raise ImportError(
        "spectral_monitor needs PyTorch Lightning under either of its names: "
        "pip install pytorch-lightning (or pip install lightning)"
    )

pl: ModuleType = NAMESPACES[0]
"""One installed namespace, for what both share: type hints, exceptions, rank-zero utilities."""

CALLBACK_BASES: tuple[type, ...] = tuple(namespace.Callback for namespace in NAMESPACES)
"""``Callback`` of every installed namespace."""

MisconfigurationException: type[Exception] = pl.utilities.exceptions.MisconfigurationException
TensorBoardLogger: type = pl.loggers.TensorBoardLogger
rank_zero_warn = pl.utilities.rank_zero.rank_zero_warn
