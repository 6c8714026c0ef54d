"""The two Lightning namespaces the callback serves: ``pytorch_lightning`` and ``lightning.pytorch``.

Both packages ship the same Trainer under different names, with distinct classes: a callback derived from
``pytorch_lightning.Callback`` is not a ``lightning.pytorch.Callback``, and ``LightningCLI`` checks a YAML
``class_path`` against its own namespace's ``Callback``. So :data:`CALLBACK_BASES` holds the ``Callback`` of
every installed namespace and :class:`~spectral_monitor.SpectralMonitor` derives from all of them: it is a
callback of both Trainers and both CLIs. Either package alone is enough; importing this module without
either raises ``ImportError`` naming what to install.

What both namespaces share is taken from one of them, :data:`pl`: ``MisconfigurationException``,
``TensorBoardLogger`` and ``rank_zero_warn`` are Lightning's own objects under that namespace, importable
from here for the callback and documented by Lightning, so they are not part of this module's ``__all__``.

Examples:
    >>> pl.__name__ in {"pytorch_lightning", "lightning.pytorch"}
    True
    >>> CALLBACK_BASES[0] is pl.Callback, len(CALLBACK_BASES) == len(NAMESPACES)
    (True, True)
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["CALLBACK_BASES", "NAMESPACES", "pl"]


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
"""Lightning's error for a Trainer set up in a way a callback cannot work with (of :data:`pl`)."""
TensorBoardLogger: type = pl.loggers.TensorBoardLogger
"""Lightning's TensorBoard logger of :data:`pl` (the other namespace's is matched by class name)."""
rank_zero_warn = pl.utilities.rank_zero.rank_zero_warn
"""Lightning's ``warnings.warn`` on global rank 0 only (of :data:`pl`)."""
