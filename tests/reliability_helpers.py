"""What the reliability suites share: the probe families to try, tiny models, a deterministic fit, read-back.

A family enters every reliability suite (non-perturbation, fault injection, resume) through one line of
``FAMILY_CONFIGURATIONS``: the monitor arguments that turn it on alone, and the functions a fault can be
injected into (patched to raise).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions, NTKOptions

VOCAB = 16
WIDTH = 16
HEADS = 2
TOKENS = 8


@dataclass(frozen=True)
class FamilyConfiguration:
    """One probe family as the reliability suites switch it on and break it.

    ``monitor_arguments``: what makes a ``SpectralMonitor`` measure this family alone. ``probe_entry_points``:
    ``"module:attribute"`` (or ``"module:Class.method"``) of functions the family's measurement goes through,
    each patched in turn to raise, from arming to computing; ``during_forward`` marks those called inside the
    training forward, where a failure must not reach the user's model.
    """

    family: str
    monitor_arguments: dict[str, Any]
    probe_entry_points: tuple[str, ...]
    during_forward: tuple[str, ...] = field(default=())


FAMILY_CONFIGURATIONS = (
    FamilyConfiguration(
        "attention",
        {"families": ["attention"], "metric_method": "krylov"},
        (
            "spectral_monitor.probes.attention:AttentionCapture.arm",
            "spectral_monitor.probes.attention:_captured_multi_head_attention",
            "spectral_monitor.core.session:attention_metrics",
        ),
        during_forward=("spectral_monitor.probes.attention:_captured_multi_head_attention",),
    ),
    FamilyConfiguration(
        "tokens",
        {"families": ["tokens"]},
        (
            "spectral_monitor.probes.residual:ResidualCapture.arm",
            "spectral_monitor.probes.residual:_batch_first",
            "spectral_monitor.core.session:token_metrics",
        ),
        during_forward=("spectral_monitor.probes.residual:_batch_first",),
    ),
    FamilyConfiguration(
        "weights",
        {"families": ["weights"]},
        (
            "spectral_monitor.probes.weights:WeightProbe.measure",
            "spectral_monitor.probes.weights:WeightProbe.distributions",
        ),
    ),
    FamilyConfiguration(
        "curvature",
        {"families": [], "curvature": CurvatureOptions(every_n_steps=1, max_products=8)},
        ("spectral_monitor.core.second_order:SecondOrderProbes._measure_curvature",),
    ),
    FamilyConfiguration(
        "jacobian",
        {"families": [], "jacobian": JacobianOptions(every_n_steps=1, max_iters=4)},
        ("spectral_monitor.core.second_order:SecondOrderProbes._measure_jacobian",),
    ),
    FamilyConfiguration(
        "ntk",
        {"families": [], "ntk": NTKOptions(every_n_steps=1, examples=4)},
        ("spectral_monitor.core.second_order:SecondOrderProbes._measure_ntk",),
    ),
)
"""Every family the monitor has; a new family is one more line here."""

ALL_FAMILIES = {
    "families": [
        family
        for configuration in FAMILY_CONFIGURATIONS
        for family in configuration.monitor_arguments["families"]
    ],
    "metric_method": "krylov",
    **{
        name: value
        for configuration in FAMILY_CONFIGURATIONS
        for name, value in configuration.monitor_arguments.items()
        if name not in ("families", "metric_method")
    },
}
"""Monitor arguments that turn every family on (attention on the Krylov path: it keeps warm state)."""

FAMILY_IDS = [configuration.family for configuration in FAMILY_CONFIGURATIONS]


class TinyEncoder(pl.LightningModule):
    """Embedding, two ``nn.TransformerEncoderLayer`` blocks (LayerNorm inside), optional BatchNorm, a head.

    ``norm="batch"`` adds a ``BatchNorm1d`` over the features after the embedding, so the running statistics
    are part of what must not change; ``optimizer`` is ``"adamw"`` or ``"sgd"`` (with momentum). Initialised
    from ``torch.manual_seed(seed)``, so two instances are the same model.
    """

    def __init__(
        self,
        dropout: float = 0.0,
        batch_norm: bool = False,
        optimizer: str = "adamw",
        width: int = WIDTH,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.optimizer_name = optimizer
        self.embedding = nn.Embedding(VOCAB, width)
        self.batch_norm = nn.BatchNorm1d(width) if batch_norm else None
        block = nn.TransformerEncoderLayer(
            width, HEADS, dim_feedforward=32, dropout=dropout, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(block, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states = self.embedding(tokens)
        if self.batch_norm is not None:
            states = self.batch_norm(states.transpose(1, 2)).transpose(1, 2)
        return self.head(self.encoder(states))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def previous_token_batches(batches: int = 8, batch_size: int = 4) -> DataLoader:
    tokens = torch.randint(VOCAB, (batches * batch_size, TOKENS), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens, tokens.roll(1, dims=1)), batch_size=batch_size)


def trainer_for(logger: Any, callbacks: list, max_steps: int, **trainer_arguments: Any) -> pl.Trainer:
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
    data: DataLoader | None = None,
    ckpt_path: str | None = None,
    **trainer_arguments: Any,
) -> pl.Trainer:
    trainer = trainer_for(logger, callbacks, max_steps, **trainer_arguments)
    trainer.fit(model, data if data is not None else previous_token_batches(), ckpt_path=ckpt_path)
    return trainer


def tensorboard_logger(root: Path, name: str = "run", version: int = 0) -> TensorBoardLogger:
    return TensorBoardLogger(save_dir=str(root), name=name, version=version)


def read_back(logdir: str | Path) -> event_accumulator.EventAccumulator:
    """Every event of ``logdir``; an event whose step goes back is kept, so a duplicate step shows."""
    everything = {kind: 0 for kind in event_accumulator.DEFAULT_SIZE_GUIDANCE}
    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance=everything, purge_orphaned_data=False
    )
    accumulator.Reload()
    return accumulator


def scalar_series(events: event_accumulator.EventAccumulator, prefix: str = "") -> dict[str, list]:
    """``tag -> [(step, value), ...]`` of every scalar whose tag starts with ``prefix``."""
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.startswith(prefix)
    }


def hook_count(model: nn.Module) -> int:
    """Forward hooks on ``model`` and globally, plus active torch-function modes."""
    module_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    module = nn.modules.module
    global_hooks = len(module._global_forward_hooks) + len(module._global_forward_pre_hooks)
    return module_hooks + global_hooks + torch._C._len_torch_function_stack()


@dataclass
class MonitorReports:
    """The monitor's warnings of one run, with how often each message came."""

    messages: list[str]

    def count(self, text: str) -> int:
        return sum(text in message for message in self.messages)

    def repeated(self) -> list[str]:
        return [message for message, times in Counter(self.messages).items() if times > 1]


@contextmanager
def monitor_reports() -> Iterator[MonitorReports]:
    """Collects every ``SpectralMonitor`` warning raised in the block, each occurrence (not deduplicated)."""
    reports = MonitorReports([])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield reports
    reports.messages += [str(w.message) for w in record if str(w.message).startswith("SpectralMonitor")]
