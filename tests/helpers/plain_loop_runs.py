"""The plain-loop API's reference run: the demo model trained on the demo task's batches by the loop of
``docs/plain-loop.md``, with the model and data settings the plain-loop tests and the dashboard's share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor import Monitor
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.demo.model import IGNORE_INDEX

MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
DATA = {
    "vocab_size": 40,
    "seq_len": 16,
    "batch_size": 4,
    "num_batches": 6,
    "num_keys": 4,
    "num_values": 4,
    "num_pairs": 3,
    "num_queries": 2,
}


def demo_loss(model: DemoTransformer, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss ``DemoTransformer.training_step`` returns, without Lightning's logging."""
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def demo_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(SyntheticDataModule(**DATA).train_dataloader())


def train_in_a_plain_loop(logdir: Path | SummaryWriter, **options: Any) -> Monitor:
    """The demo model trained on the demo batches by the loop of ``docs/plain-loop.md``; returns the closed
    monitor."""
    model = DemoTransformer(**MODEL)
    optimizer = model.configure_optimizers()
    with Monitor(model, logdir, optimizer=optimizer, **options) as monitor:
        for step, batch in enumerate(demo_batches()):
            with monitor.step(step, batch=batch):
                loss = demo_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if monitor.should_stop:
                break
    return monitor
