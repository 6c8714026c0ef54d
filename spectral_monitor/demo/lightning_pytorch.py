"""The demo model and data as ``lightning.pytorch`` classes, for ``import lightning.pytorch as pl``.

A ``lightning.pytorch`` Trainer or LightningCLI accepts only modules of its own namespace, and
``spectral_monitor.demo``'s classes are ``pytorch_lightning``'s (see
:mod:`spectral_monitor.lightning.namespaces`). These are the same model and data, built from the same code
with the same arguments, seeds and checkpoint keys, on ``lightning.pytorch``'s bases: in a LightningCLI
YAML, ``class_path: spectral_monitor.demo.lightning_pytorch.DemoTransformer``.
"""

from __future__ import annotations

import lightning.pytorch as pl

from spectral_monitor.demo.data import SyntheticDataMixin
from spectral_monitor.demo.model import DemoTransformerMixin

__all__ = ["DemoTransformer", "SyntheticDataModule"]


class DemoTransformer(DemoTransformerMixin, pl.LightningModule):
    """:class:`~spectral_monitor.demo.model.DemoTransformerMixin` as a ``lightning.pytorch`` module.

    Examples:
        >>> import lightning.pytorch as pl
        >>> isinstance(DemoTransformer(d_model=16, n_layers=1, n_heads=2), pl.LightningModule)
        True
    """


class SyntheticDataModule(SyntheticDataMixin, pl.LightningDataModule):
    """:class:`~spectral_monitor.demo.data.SyntheticDataMixin` as a ``lightning.pytorch`` data module.

    Examples:
        >>> import lightning.pytorch as pl
        >>> isinstance(SyntheticDataModule(num_batches=1), pl.LightningDataModule)
        True
    """
