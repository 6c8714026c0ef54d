"""A run checkpointed and resumed logs exactly what the same run without interruption logs.

Two monitors with different settings share one Trainer: one measures every family every 2 steps (attention
on the Krylov path, whose warm vectors are part of the state), the other the head's weight every 3 steps.
The run stops at a ``ModelCheckpoint`` written at the end of its first epoch and resumes from it with new
monitor objects, into the same log directory. The resumed monitors start from exactly the state their
predecessors checkpointed (each under its own ``state_key``), and every series (every tag, read back
without TensorBoard's purging of repeated steps) holds each logging step once, with the very values of the
uninterrupted run, which the warm-started estimates give only if their vectors were restored. An alert
that opened before the checkpoint is still open after it, with its history, and does not fire again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from reliability_helpers import ALL_FAMILIES, TinyEncoder, fit, read_back, scalar_series, tensorboard_logger

from spectral_monitor.alerts import AlertConfig, AlertEvent, Condition, Rule
from spectral_monitor.callback import SpectralMonitor

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

EPOCH = 8  # batches of previous_token_batches()
STEPS = 2 * EPOCH
WIDTH = 48  # 48 x 48 attention projections: the weights' warm-started Krylov path (smaller ones are exact)


OPENS_AT = 3  # the first logging step of the every-family monitor from its start_step on
STAYS_OPEN = Rule(
    name="stays_open",
    conditions=[Condition("weights/spectral_norm", ">=", 0.0)],
    layers=["encoder.layers.0.linear1"],
    start_step=OPENS_AT,
)
"""Fires at step 3, before the checkpoint at step 8, and holds for the rest of the run (a norm is >= 0)."""


def monitors(seen: list[AlertEvent] | None = None) -> list[SpectralMonitor]:
    every_family = SpectralMonitor(
        every_n_steps=2,
        exclude=["head"],
        figures_every_n_logs=3,
        alerts=AlertConfig(rules=[STAYS_OPEN]),
        on_alert=None if seen is None else seen.append,
        **ALL_FAMILIES,
    )
    head_weight = SpectralMonitor(every_n_steps=3, families=["weights"], include=["head"])
    return [every_family, head_weight]


class StateAtStart(pl.Callback):
    """Keeps each monitor's state as training starts, after a checkpoint was restored."""

    def __init__(self, watched: list[SpectralMonitor]) -> None:
        self.watched = watched
        self.states: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.states = [monitor.state_dict() for monitor in self.watched]


def assert_same_state(actual: Any, expected: Any, where: str = "state") -> None:
    """Equal nested dicts/lists, tensors equal exactly (generator states included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


COLD_AFTER_RESUME = ("curvature/", "jacobian/")


def same_series(actual: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """The same steps and bit-identical values, NaN equal to NaN."""
    return [step for step, _ in actual] == [step for step, _ in expected] and np.array_equal(
        [value for _, value in actual], [value for _, value in expected], equal_nan=True
    )


def logging_steps(every: int, log_first_step: bool = True) -> list[int]:
    return [s for s in range(STEPS) if (s + 1) % every == 0 or (log_first_step and s == 0)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    logger = tensorboard_logger(tmp_path_factory.mktemp("uninterrupted"))
    fit(TinyEncoder(width=WIDTH), monitors(), logger, STEPS)
    return scalar_series(read_back(logger.log_dir))


def interrupted_run(
    root: Path, restore_monitors: bool = True, seen_after_resume: list[AlertEvent] | None = None
) -> tuple[dict[str, list], list, list, list]:
    """Stops at the checkpoint of step ``EPOCH``, resumes from it; returns what both halves logged and the
    monitors' state at the checkpoint, as checkpointed and as restored. The alerts the resumed half fires
    go to ``seen_after_resume``."""
    first = monitors()
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=EPOCH, save_top_k=-1)
    fit(
        TinyEncoder(width=WIDTH),
        [*first, checkpoints],
        tensorboard_logger(root),
        EPOCH,
        enable_checkpointing=True,
    )
    (checkpoint,) = (root / "checkpoints").glob("*.ckpt")
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]

    second = monitors(seen_after_resume)
    if not restore_monitors:
        for monitor in second:
            monitor.load_state_dict = lambda state_dict: None
    at_start = StateAtStart(second)
    logger = tensorboard_logger(root)
    fit(TinyEncoder(width=WIDTH), [*second, at_start], logger, STEPS, ckpt_path=str(checkpoint))
    return scalar_series(read_back(logger.log_dir)), first, second, [saved, at_start.states]


def test_a_resumed_run_logs_every_step_once_with_the_values_of_an_uninterrupted_run(
    uninterrupted: dict[str, list], tmp_path: Path
) -> None:
    seen_after_resume: list[AlertEvent] = []
    resumed, first, second, (saved, restored) = interrupted_run(tmp_path, seen_after_resume=seen_after_resume)

    assert len({monitor.state_key for monitor in first}) == 2
    for monitor, state in zip(first, restored, strict=True):
        assert_same_state(state, saved[monitor.state_key], monitor.state_key)
    every_family_state = saved[first[0].state_key]
    assert every_family_state["attention_krylov_vectors"].keys() == {
        f"encoder.layers.{i}.self_attn" for i in range(2)
    }
    assert every_family_state["weight_probe"]["right_vectors"]
    assert saved[first[1].state_key]["last_logged_step"] == 5  # its own cadence, not the other's 7

    # The alert opened at step 3 is still open after the resume, with its history, and fired only once.
    alerts = second[0]._alerting.engine
    ((rule, layer, step),) = [(e.rule, e.layer, e.step) for e in alerts.open_alerts if e.rule == "stays_open"]
    assert (rule, layer, step) == ("stays_open", "encoder.layers.0.linear1", OPENS_AT)
    assert [(e.kind, e.step) for e in alerts.history if e.rule == "stays_open"] == [("fired", OPENS_AT)]
    assert alerts.fired["stays_open"] == 1
    assert [event for event in seen_after_resume if event.rule == "stays_open"] == []
    open_series = resumed["alerts/open/stays_open"]  # on every step the rules run, the resume's included
    assert {step for step, _ in open_series} >= {*logging_steps(2), EPOCH + 1}
    assert open_series == [(step, float(step >= OPENS_AT)) for step, _ in open_series]
    assert resumed["alerts/fired/stays_open"] == open_series

    assert resumed.keys() == uninterrupted.keys()
    for tag, series in uninterrupted.items():  # the same steps, once each, with the same float32 values
        if tag.startswith(COLD_AFTER_RESUME):
            # Their parameter-sized warm vectors are not checkpointed: the first events after the resume
            # start cold, and with the few products this test allows (8) land elsewhere within the solver's
            # unconverged error. Their steps must still continue with no gap and no duplicate (but for the
            # overhead ratio, which needs a timed step before it in the same process).
            if "overhead" not in tag:
                assert [step for step, _ in resumed[tag]] == [step for step, _ in series], tag
            continue
        assert same_series(resumed[tag], series), tag
    assert [step for step, _ in resumed["attention/entropy/encoder.layers.1.self_attn"]] == logging_steps(2)
    assert [step for step, _ in resumed["weights/spectral_norm/head"]] == logging_steps(3)
    assert [step for step, _ in resumed["train/loss"]] == list(range(STEPS))
    assert figure_steps(tmp_path) == [0, 5, 11]  # every third of logging steps 0, 1, 3, 5, 7, 9, 11, 13, 15


def figure_steps(root: Path) -> list[int]:
    return [
        event.step for event in read_back(root / "run" / "version_0").Images("attention/figures/spectrum")
    ]


def test_without_the_restored_warm_state_the_values_would_differ(
    uninterrupted: dict[str, list], tmp_path: Path
) -> None:
    # The control that gives the comparison above its teeth: the same resume, monitor state dropped.
    seen_after_resume: list[AlertEvent] = []
    resumed, *_ = interrupted_run(tmp_path, restore_monitors=False, seen_after_resume=seen_after_resume)

    differing = sorted(
        tag
        for tag in uninterrupted
        if tag.startswith(("attention/", "weights/"))
        and not same_series(
            [(step, value) for step, value in resumed[tag] if step > EPOCH],
            [(step, value) for step, value in uninterrupted[tag] if step > EPOCH],
        )
    )
    # Warm-started weight estimates (2 iterations a step) differ; the attention Krylov path converges fully
    # on 8 tokens whatever its start, so its restored vectors are checked as state, in the test above.
    assert {
        f"weights/spectral_norm/encoder.layers.{i}.self_attn.{role}" for i in range(2) for role in "qkv"
    } <= set(differing)
    assert figure_steps(tmp_path) == [0, 5, 9, 15]  # the count of logging steps restarted at the resume
    # and the alert open since step 3 fires a second time, on the first logging step after the resume.
    assert [(e.kind, e.step) for e in seen_after_resume if e.rule == "stays_open"] == [("fired", EPOCH + 1)]
