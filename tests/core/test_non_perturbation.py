"""Training with the monitor follows exactly the trajectory of training without it.

For each probe family alone and all of them together, with the monitor on every step (figures included),
a deterministic CPU run ends with bit-identical parameters, buffers (BatchNorm running statistics),
optimizer state and global RNG state, and logs bit-identical losses, to the same run without the monitor:
for models with dropout, with LayerNorm and with BatchNorm, under SGD with momentum and AdamW, with and
without gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.events import read_back, scalar_series
from helpers.models import TinyEncoder
from helpers.reliability import (
    ALL_FAMILIES,
    FAMILY_CONFIGURATIONS,
    FAMILY_IDS,
    fit,
    tensorboard_logger,
)

from spectral_monitor import SpectralMonitor

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

STEPS = 6


@dataclass(frozen=True)
class Setting:
    """A model and training setup; ``id`` names it in the test report."""

    id: str
    dropout: float
    batch_norm: bool
    optimizer: str
    accumulate: int


RICHEST = Setting("dropout-batchnorm-adamw-accumulate2", 0.1, True, "adamw", 2)
SETTINGS = (
    Setting("dropout-layernorm-adamw", 0.1, False, "adamw", 1),
    Setting("batchnorm-sgd", 0.0, True, "sgd", 1),
    Setting("dropout-layernorm-sgd-accumulate3", 0.1, False, "sgd", 3),
    RICHEST,
)


@dataclass
class Outcome:
    parameters: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer_state: dict
    rng_state: torch.Tensor
    losses: list[tuple[int, float]]


_unwatched: dict[str, Outcome] = {}


def train(setting: Setting, callbacks: list, logdir: Path) -> Outcome:
    torch.manual_seed(0)
    model = TinyEncoder(dropout=setting.dropout, batch_norm=setting.batch_norm, optimizer=setting.optimizer)
    logger = tensorboard_logger(logdir)
    trainer = fit(model, callbacks, logger, STEPS, accumulate_grad_batches=setting.accumulate)
    return Outcome(
        parameters={name: p.detach().clone() for name, p in model.named_parameters()},
        buffers={name: b.clone() for name, b in model.named_buffers()},
        optimizer_state=trainer.optimizers[0].state_dict()["state"],
        rng_state=torch.random.get_rng_state(),
        losses=scalar_series(read_back(logger.log_dir))["train/loss"],
    )


def unwatched(setting: Setting, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    if setting.id not in _unwatched:
        _unwatched[setting.id] = train(setting, [], tmp_path_factory.mktemp(f"unwatched-{setting.id}"))
    return _unwatched[setting.id]


def assert_same_trajectory(watched: Outcome, reference: Outcome) -> None:
    assert watched.losses == reference.losses  # steps and float32 values, exactly
    assert len(watched.losses) == STEPS
    for name, parameter in reference.parameters.items():
        assert torch.equal(watched.parameters[name], parameter), name
    assert watched.buffers.keys() == reference.buffers.keys()
    for name, buffer in reference.buffers.items():
        assert torch.equal(watched.buffers[name], buffer), name
    assert watched.optimizer_state.keys() == reference.optimizer_state.keys()
    for index, state in reference.optimizer_state.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(watched.optimizer_state[index][key]), torch.as_tensor(value))
    assert torch.equal(watched.rng_state, reference.rng_state)  # the monitor drew no random numbers


def every_step_monitor(**arguments) -> SpectralMonitor:
    # Figures on the first logging step only: drawing them is most of a step's cost (about 2 s here).
    return SpectralMonitor(every_n_steps=1, figures_every_n_logs=STEPS, **arguments)


@pytest.mark.parametrize("configuration", FAMILY_CONFIGURATIONS, ids=FAMILY_IDS)
def test_each_family_alone_leaves_the_trajectory_bit_identical(
    configuration, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    monitor = every_step_monitor(**configuration.monitor_arguments)
    watched = train(RICHEST, [monitor], tmp_path)

    assert_same_trajectory(watched, unwatched(RICHEST, tmp_path_factory))
    monitored = scalar_series(read_back(tmp_path / "run" / "version_0"), f"{configuration.family}/")
    assert monitored, "the family wrote nothing: the comparison would prove nothing"
    # Every step measured, none twice; a series may start late (Adam's edge of stability needs one step).
    assert max(len(series) for series in monitored.values()) == STEPS
    assert all(len(series) <= STEPS for series in monitored.values())


@pytest.mark.parametrize("setting", SETTINGS, ids=[setting.id for setting in SETTINGS])
def test_every_family_together_leaves_the_trajectory_bit_identical(
    setting: Setting, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    watched = train(setting, [every_step_monitor(**ALL_FAMILIES)], tmp_path)

    assert_same_trajectory(watched, unwatched(setting, tmp_path_factory))
    written = scalar_series(read_back(tmp_path / "run" / "version_0"))
    for configuration in FAMILY_CONFIGURATIONS:
        assert any(tag.startswith(f"{configuration.family}/") for tag in written), configuration.family
