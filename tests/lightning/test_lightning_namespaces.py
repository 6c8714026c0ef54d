"""Both Lightning namespaces: ``SpectralMonitor`` is a callback of ``pytorch_lightning`` and of
``lightning.pytorch``, in their Trainers (a real fit writing event files) and in their ``LightningCLI`` YAML
(``trainer.callbacks`` with ``class_path: spectral_monitor.SpectralMonitor``); with only one of the two
packages importable, it is a callback of that one. The demo model and data exist for both
(``spectral_monitor.demo`` and ``spectral_monitor.demo.lightning_pytorch``), so the README's ten lines and
the configuration page's YAML work under either, as those pages say.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from helpers.events import read_back
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.demo import DemoTransformer

ROOT = Path(__file__).resolve().parents[2]

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
                    options:
                      every_n_steps: 3
                      families: [attention, weights]
                      outputs:
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
        from spectral_monitor.demo import DemoTransformer
        assert issubclass(DemoTransformer, lightning.LightningModule), DemoTransformer.__mro__
        cli = LightningCLI(Linear, args=["--config={config}"], run=False)
        assert any(isinstance(callback, SpectralMonitor) for callback in cli.trainer.callbacks)
        print("served", lightning.__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"served {kept}" in result.stdout


def demo_module(name: str) -> ModuleType:
    """Where a user of namespace ``name`` takes the demo model and data from (the README says so)."""
    namespace(name)
    return importlib.import_module(
        "spectral_monitor.demo" if name == "pytorch_lightning" else "spectral_monitor.demo.lightning_pytorch"
    )


def fenced_block(page: Path, language: str, containing: str) -> str:
    (block,) = [
        block
        for block in re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.S | re.M)
        if containing in block
    ]
    return block


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMESPACES)
def test_the_readme_ten_lines_train_under_each_namespace(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's lines with its first line as each namespace's import and the demo taken where the
    README's comment says, shortened to 3 steps."""
    lightning = namespace(name)
    example = fenced_block(ROOT / "README.md", "python", "trainer.fit")
    assert len(example.strip().splitlines()) <= 10, example
    first, *rest = example.splitlines()
    assert first.startswith("import pytorch_lightning as pl  # or: import lightning.pytorch as pl"), first
    code = "\n".join([f"import {name} as pl", *rest])
    code = code.replace("from spectral_monitor.demo import", f"from {demo_module(name).__name__} import")
    assert "max_steps=50" in code
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "__main__"}
    exec(compile(code.replace("max_steps=50", "max_steps=3"), "README.md", "exec"), scope)

    assert isinstance(scope["model"], lightning.LightningModule) and scope["trainer"].global_step == 3
    (run,) = {path.parent for path in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    assert [event.step for event in read_back(run).Scalars("attention/entropy/blocks.0.attention")] == [0]


def test_the_demo_is_the_same_model_and_data_under_both_namespaces(tmp_path: Path) -> None:
    models = {
        name: demo_module(name).DemoTransformer(d_model=16, n_layers=1, seq_len=16) for name in NAMESPACES
    }
    data = {name: demo_module(name).SyntheticDataModule(seq_len=16, batch_size=4) for name in NAMESPACES}
    for name in NAMESPACES:
        assert isinstance(models[name], namespace(name).LightningModule)
        assert isinstance(data[name], namespace(name).LightningDataModule)
    first, second = (models[name].state_dict() for name in NAMESPACES)
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)
    assert models["lightning.pytorch"].hparams == models["pytorch_lightning"].hparams
    first_batch, second_batch = (next(iter(data[name].train_dataloader())) for name in NAMESPACES)
    assert all(torch.equal(a, b) for a, b in zip(first_batch, second_batch, strict=True))


@pytest.mark.parametrize("name", NAMESPACES)
def test_the_configuration_pages_yaml_builds_under_each_namespaces_cli(name: str, tmp_path: Path) -> None:
    """As written under ``pytorch_lightning``'s CLI; under ``lightning.pytorch``'s with the logger's
    class_path in that namespace, as the page says."""
    yaml_block = fenced_block(ROOT / "docs" / "configuration.md", "yaml", "spectral_monitor.SpectralMonitor")
    assert "class_path: pytorch_lightning.loggers.TensorBoardLogger" in yaml_block
    config = tmp_path / "config.yaml"
    config.write_text(yaml_block.replace("pytorch_lightning.loggers", f"{name}.loggers"))
    demo = demo_module(name)
    cli = importlib.import_module(f"{name}.cli").LightningCLI(
        demo.DemoTransformer, demo.SyntheticDataModule, args=[f"--config={config}"], run=False
    )
    (monitor,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, SpectralMonitor)]
    assert monitor.every_n_steps == 25 and monitor.curvature.top_k == 3
    assert isinstance(cli.trainer.logger, importlib.import_module(f"{name}.loggers").TensorBoardLogger)
    assert isinstance(cli.model, DemoTransformer if name == "pytorch_lightning" else demo.DemoTransformer)
