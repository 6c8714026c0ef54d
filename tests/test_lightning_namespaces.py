"""Both Lightning namespaces: ``SpectralMonitor`` is a callback of ``pytorch_lightning`` and of
``lightning.pytorch``, in their Trainers (a real fit writing event files) and in their ``LightningCLI`` YAML
(``trainer.callbacks`` with ``class_path: spectral_monitor.SpectralMonitor``); with only one of the two
packages importable, it is a callback of that one.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from events import read_back
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor

pytestmark = pytest.mark.usefixtures("one_thread")

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
WIDTH, HEADS, TOKENS = 16, 2, 6


def namespace(name: str) -> ModuleType:
    return pytest.importorskip(name)


def tiny_attention_module(lightning: ModuleType) -> type:
    """A one-layer attention model as a LightningModule of the given namespace."""

    class TinyAttention(lightning.LightningModule):
        def __init__(self, width: int = WIDTH) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(width, HEADS, batch_first=True)
            self.head = nn.Linear(width, 1)

        def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (inputs,) = batch
            mixed, _ = self.attention(inputs, inputs, inputs, need_weights=False)
            return F.mse_loss(self.head(mixed).squeeze(-1), inputs.sum(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(8, TOKENS, WIDTH, generator=generator)), batch_size=4)

    return TinyAttention


@pytest.mark.parametrize("name", NAMESPACES)
def test_the_monitor_is_a_callback_of_each_installed_namespace(name: str) -> None:
    assert isinstance(SpectralMonitor(), namespace(name).Callback)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMESPACES)
def test_a_fit_under_each_namespace_writes_attention_and_weight_metrics(name: str, tmp_path: Path) -> None:
    lightning = namespace(name)
    loggers = importlib.import_module(f"{name}.loggers")
    torch.manual_seed(0)
    trainer = lightning.Trainer(
        max_steps=2,
        callbacks=[
            SpectralMonitor(every_n_steps=1, figures_every_n_logs=0, families=["attention", "weights"])
        ],
        logger=loggers.TensorBoardLogger(tmp_path, name="run", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    trainer.fit(tiny_attention_module(lightning)())

    events = read_back(tmp_path / "run" / "version_0")
    tags = set(events.Tags()["scalars"])
    for tag in (
        "attention/entropy/attention",
        "weights/spectral_norm/head",
        "weights/qk_spectral_norm_max/attention",
    ):
        assert tag in tags
        assert [event.step for event in events.Scalars(tag)] == [0, 1]


def write_config(tmp_path: Path, logger_class: str) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            trainer:
              max_steps: 1
              logger:
                class_path: {logger_class}
                init_args:
                  save_dir: {tmp_path}
              callbacks:
                - class_path: spectral_monitor.SpectralMonitor
                  init_args:
                    every_n_steps: 3
                    families: [attention, weights]
                    per_head: false
            """
        )
    )
    return config


@pytest.mark.parametrize("name", NAMESPACES)
def test_each_namespaces_lightning_cli_builds_the_monitor_from_yaml(name: str, tmp_path: Path) -> None:
    namespace(name)
    cli_module = importlib.import_module(f"{name}.cli")
    config = write_config(tmp_path, f"{name}.loggers.TensorBoardLogger")
    cli = cli_module.LightningCLI(
        tiny_attention_module(namespace(name)), args=[f"--config={config}"], run=False
    )
    (monitor,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, SpectralMonitor)]
    assert monitor.every_n_steps == 3 and monitor.families == ("attention", "weights")
    assert monitor.per_head is False


@pytest.mark.slow
@pytest.mark.parametrize(("kept", "hidden"), [NAMESPACES, NAMESPACES[::-1]])
def test_with_one_namespace_importable_the_monitor_serves_that_one(
    kept: str, hidden: str, tmp_path: Path
) -> None:
    namespace(kept)
    config = write_config(tmp_path, f"{kept}.loggers.TensorBoardLogger")
    script = textwrap.dedent(
        f"""\
        import sys
        sys.modules[{hidden.split(".")[0]!r}] = None  # an import of it now raises ImportError
        import torch
        import {kept} as lightning
        from {kept}.cli import LightningCLI
        from spectral_monitor import SpectralMonitor

        class Linear(lightning.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(2, 2)

        assert SpectralMonitor.__bases__ == (lightning.Callback,), SpectralMonitor.__bases__
        cli = LightningCLI(Linear, args=["--config={config}"], run=False)
        assert any(isinstance(callback, SpectralMonitor) for callback in cli.trainer.callbacks)
        print("served", lightning.__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"served {kept}" in result.stdout
