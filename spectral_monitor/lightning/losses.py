"""The loss the curvature, Jacobian and NTK probes take from a LightningModule: its own ``training_step``.

``self.log`` and ``self.log_dict`` are turned into no-ops for the call, so the probe's loss never reaches
the logged metrics. ``ProbeDataOptions(loss_fn=...)`` replaces it (and is needed with manual optimisation).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from spectral_monitor.lightning.namespaces import pl

__all__ = ["lightning_module_loss", "logging_suppressed", "training_step_loss"]


@contextmanager
def logging_suppressed(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing while the probe runs ``training_step``.

    Args:
        module: The LightningModule.

    Yields:
        Nothing: ``training_step`` runs inside the context.

    Examples:
        >>> from spectral_monitor.demo import DemoTransformer
        >>> model = DemoTransformer(d_model=16, n_layers=1, n_heads=2, seq_len=8)
        >>> with logging_suppressed(model):
        ...     model.log("train/loss", 1.0)  # nothing logged, no warning
        >>> "log" in vars(model)
        False
    """
    module.log = _ignore  # instance attributes shadow the methods
    module.log_dict = _ignore
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def training_step_loss(module: pl.LightningModule, batch: Any, batch_idx: int = 0) -> Tensor:
    """The loss of a LightningModule's own training step, with Lightning logging suppressed.

    Args:
        module: The LightningModule.
        batch: The batch ``training_step`` takes.
        batch_idx: The index it is given.

    Returns:
        The scalar loss ``training_step`` returns (or its ``"loss"`` entry).

    Raises:
        ValueError: ``training_step`` returned no scalar loss.

    Examples:
        >>> import torch
        >>> from spectral_monitor.demo import DemoTransformer
        >>> from spectral_monitor.demo.model import IGNORE_INDEX
        >>> model = DemoTransformer(d_model=16, n_layers=1, n_heads=2, seq_len=8)
        >>> batch = (torch.zeros(2, 8, dtype=torch.long), torch.full((2, 8), IGNORE_INDEX).index_fill(1,
        ...          torch.tensor([7]), 3))
        >>> training_step_loss(model, batch).shape
        torch.Size([])
    """
    with logging_suppressed(module):
        output = module.training_step(batch, batch_idx)
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        raise ValueError(
            "training_step returned no scalar loss for the curvature probe; "
            "pass ProbeDataOptions(loss_fn=...)"
        )
    return loss


def lightning_module_loss(module: pl.LightningModule, batch: Any) -> Tensor:
    """The probes' default loss: :func:`training_step_loss`, which manual optimisation cannot give.

    Args:
        module: The LightningModule.
        batch: The batch ``training_step`` takes.

    Returns:
        The scalar loss.

    Raises:
        ValueError: ``module`` uses manual optimisation, or ``training_step`` returned no scalar loss.

    Examples:
        >>> import torch
        >>> from spectral_monitor.demo import DemoTransformer
        >>> from spectral_monitor.demo.model import IGNORE_INDEX
        >>> model = DemoTransformer(d_model=16, n_layers=1, n_heads=2, seq_len=8)
        >>> batch = (torch.zeros(2, 8, dtype=torch.long), torch.full((2, 8), IGNORE_INDEX).index_fill(1,
        ...          torch.tensor([7]), 3))
        >>> bool(lightning_module_loss(model, batch) > 0)
        True
    """
    if not module.automatic_optimization:
        raise ValueError("with manual optimisation the curvature probes need ProbeDataOptions(loss_fn=...)")
    return training_step_loss(module, batch)
