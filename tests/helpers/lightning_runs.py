"""Real ``Trainer.fit`` runs on the CPU as the tests make them, and their event files read back as
TensorBoard's viewer reads them."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from helpers.events import read_back
from helpers.models import previous_token_batches

read_viewed = partial(read_back, purge_orphaned_data=True)
"""Events as TensorBoard's viewer shows a run: what a restarted writer wrote over is dropped."""


def trainer_for(logger: Any, callbacks: list, max_steps: int, **trainer_arguments: Any) -> pl.Trainer:
    """A quiet one-device CPU trainer that logs every step and saves no checkpoint unless asked."""
    arguments: dict[str, Any] = {
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
        **trainer_arguments,
    }
    return pl.Trainer(
        max_steps=max_steps, logger=logger, callbacks=callbacks, accelerator="cpu", devices=1, **arguments
    )


def fit(
    model: pl.LightningModule,
    callbacks: list,
    logger: Any,
    max_steps: int,
    data: DataLoader | pl.LightningDataModule | None = None,
    ckpt_path: str | None = None,
    **trainer_arguments: Any,
) -> pl.Trainer:
    """``max_steps`` of training on ``data`` (previous-token batches by default); returns the trainer."""
    trainer = trainer_for(logger, callbacks, max_steps, **trainer_arguments)
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    else:
        trainer.fit(model, data if data is not None else previous_token_batches(), ckpt_path=ckpt_path)
    return trainer


def tensorboard_logger(root: Path, name: str = "run", version: int = 0) -> TensorBoardLogger:
    return TensorBoardLogger(save_dir=str(root), name=name, version=version)
