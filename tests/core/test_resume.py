"""A run checkpointed and resumed logs exactly what the same run without interruption logs.

Two monitors with different settings share one Trainer: one measures every family every 2 steps (attention
on the Krylov path, whose warm vectors are part of the state; the curvature, Jacobian and NTK probes on
their own cadence of every step), the other the head's weight every 3 steps. The run stops at a
``ModelCheckpoint`` written at the end of its first epoch and resumes from it with new monitor objects, into
the same log directory. The resumed monitors start from exactly the state their predecessors checkpointed
(each under its own ``state_key``), and every series (every tag, read back without TensorBoard's purging of
repeated steps) holds each logging step once, with the very values of the uninterrupted run, which the
warm-started estimates give only if their vectors were restored. An alert that opened before the checkpoint
is still open after it, with its history, and does not fire again.

The second-order probes' own state: a checkpoint of an earlier version (no ``"second_order"`` entry, or one
with parameter-sized curvature vectors) still resumes; no parameter-sized vector is checkpointed; a probe
batch that ``torch.load(weights_only=True)`` could not read back is left out instead of breaking the
resume; under DDP a rank other than 0 does not take rank 0's probe batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.events import read_back, scalar_series
from helpers.models import TinyEncoder, previous_token_batches
from helpers.reliability import (
    ALL_FAMILIES,
    FAMILY_CONFIGURATIONS,
    fit,
    monitor_reports,
    tensorboard_logger,
)
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import spectral_monitor.core.second_order as curvature_monitor
from spectral_monitor import SpectralMonitor
from spectral_monitor.alerts import AlertConfig, AlertEvent, Condition, Rule
from spectral_monitor.core.second_order import OPT_IN_FAMILIES, CurvatureOptions

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


WALL_CLOCK_METRICS = ("overhead_ms", "overhead_percent")
"""``<family>/overhead_ms/model`` and ``overhead_percent``: the probes' own wall time, which no two runs
share; their steps must still match."""


def is_wall_clock(tag: str) -> bool:
    metric = tag.partition("/")[2].partition("/")[0]  # family/metric/layer
    return metric in WALL_CLOCK_METRICS


def same_series(actual: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """The same steps and bit-identical values, NaN equal to NaN. Each monitor writes its own event file, so
    a tag both monitors write (``alerts/…``) is read back file by file: the points are compared in step
    order."""
    actual, expected = (
        sorted(series, key=lambda point: (point[0], repr(point[1]))) for series in (actual, expected)
    )
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
    second_order = every_family_state["second_order"]
    (probe_batch,) = second_order["probe_batches"]  # the batch of step 0, kept for the whole run
    assert same_batch(probe_batch, first_batch())
    assert second_order["jacobian_warm"].keys() == {
        "encoder.layers.0",
        "encoder.layers.0/residual",
        "encoder.layers.1",
        "encoder.layers.1/residual",
        "model",
    }
    assert second_order["last_step"] == EPOCH - 1
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
    assert {tag.split("/")[0] for tag in resumed} >= {*OPT_IN_FAMILIES, "attention", "tokens", "weights"}
    for tag, series in uninterrupted.items():  # the same steps, once each, with the same float32 values
        if is_wall_clock(tag):
            assert [step for step, _ in resumed[tag]] == [step for step, _ in series], tag
            continue
        assert same_series(resumed[tag], series), tag
    assert [step for step, _ in resumed["attention/entropy/encoder.layers.1.self_attn"]] == logging_steps(2)
    assert [step for step, _ in resumed["weights/spectral_norm/head"]] == logging_steps(3)
    assert [step for step, _ in resumed["train/loss"]] == list(range(STEPS))
    assert [step for step, _ in resumed["curvature/hessian_eigenvalue_1/model"]] == list(range(STEPS))
    assert figure_steps(tmp_path) == [0, 5, 11]  # every third of logging steps 0, 1, 3, 5, 7, 9, 11, 13, 15
    # Each monitor of each fit files the preflight's text under the fit's first step: the resumed under EPOCH.
    texts = read_back(tmp_path / "run" / "version_0").Tensors("preflight/text_summary")
    assert sorted(event.step for event in texts) == [0, 0, EPOCH, EPOCH]


def first_batch() -> list[torch.Tensor]:
    return next(iter(previous_token_batches()))


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
        if not is_wall_clock(tag)
        and not same_series(
            [(step, value) for step, value in resumed[tag] if step >= EPOCH],
            [(step, value) for step, value in uninterrupted[tag] if step >= EPOCH],
        )
    )
    # Warm-started weight estimates (2 iterations a step) differ; the attention Krylov path converges fully
    # on 8 tokens whatever its start, so its restored vectors are checked as state, in the test above.
    assert {
        f"weights/spectral_norm/encoder.layers.{i}.self_attn.{role}" for i in range(2) for role in "qkv"
    } <= set(differing)
    # So do the curvature (8 products an event, from another random start) and Jacobian (4 iterations)
    # estimates started cold. The NTK
    # has no warm state, and its probe batch, taken afresh at step 8, the first of the second epoch, is the
    # very batch of step 0: the restored probe batch is checked as state, in the test above.
    assert {
        "curvature/sharpness/model",
        "curvature/hessian_eigenvalue_1/model",
        "jacobian/end_to_end_norm/model",
        *(
            f"jacobian/{metric}/encoder.layers.{i}"
            for metric in ("jacobian_norm", "residual_branch_norm")
            for i in range(2)
        ),
    } <= set(differing)
    assert not [tag for tag in differing if tag.startswith("ntk/")]
    assert figure_steps(tmp_path) == [0, 5, 9, 15]  # the count of logging steps restarted at the resume
    # and the alert open since step 3 fires a second time, on the first logging step after the resume.
    assert [(e.kind, e.step) for e in seen_after_resume if e.rule == "stays_open"] == [("fired", EPOCH + 1)]


# -- the second-order probes' own state ----------------------------------------------------------------------

SECOND_ORDER_CONFIGURATIONS = [c for c in FAMILY_CONFIGURATIONS if c.family in OPT_IN_FAMILIES]


def second_order_monitor(**arguments: Any) -> SpectralMonitor:
    """The curvature, Jacobian and NTK probes on every step, as the reliability suites configure them."""
    options = {
        name: value
        for configuration in SECOND_ORDER_CONFIGURATIONS
        for name, value in configuration.monitor_arguments.items()
        if name != "families"
    }
    return SpectralMonitor(**{"families": [], "preflight": False, **options, **arguments})


def checkpointed_run(root: Path, monitor: SpectralMonitor, model: pl.LightningModule, **data: Any) -> Path:
    """Two steps with a checkpoint after them; the checkpoint's path."""
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2)
    fit(model, [monitor, checkpoints], tensorboard_logger(root), 2, enable_checkpointing=True, **data)
    (checkpoint,) = (root / "checkpoints").glob("*.ckpt")
    return checkpoint


class FirstBatchSeen(pl.Callback):
    def __init__(self) -> None:
        self.batch: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.batch is None:
            self.batch = batch


def resume(
    root: Path, monitor: SpectralMonitor, model: pl.LightningModule, checkpoint: Path, **data: Any
) -> tuple[dict[str, list], Any]:
    """Two more steps from ``checkpoint``, on ``data`` (default: other batches than the checkpointed run's);
    what was logged, and the first batch the resumed run trained on."""
    seen = FirstBatchSeen()
    logger = tensorboard_logger(root)
    fit(model, [monitor, seen], logger, 4, ckpt_path=str(checkpoint), **{"data": shifted_batches(), **data})
    return scalar_series(read_back(logger.log_dir)), seen.batch


def shifted_batches() -> DataLoader:
    """The batches of ``previous_token_batches`` from the second on: none is the first batch."""
    pairs = previous_token_batches().dataset
    return DataLoader(torch.utils.data.Subset(pairs, range(4, len(pairs))), batch_size=4)


def same_batch(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(actual, expected, strict=True))


def test_a_checkpoint_from_before_the_second_order_state_resumes_with_a_new_probe_batch(
    tmp_path: Path,
) -> None:
    checkpoint = checkpointed_run(tmp_path, second_order_monitor(), TinyEncoder())
    contents = torch.load(checkpoint, weights_only=False)
    (monitor_state,) = [state for key, state in contents["callbacks"].items() if "SpectralMonitor" in key]
    del monitor_state["second_order"]  # what the previous version wrote
    torch.save(contents, checkpoint)

    resumed = second_order_monitor()
    with monitor_reports() as reports:
        written, first_resumed_batch = resume(tmp_path, resumed, TinyEncoder(), checkpoint)

    assert not reports.messages
    for tag in (
        "curvature/hessian_eigenvalue_1/model",
        "jacobian/end_to_end_norm/model",
        "ntk/ntk_trace/model",
    ):
        assert [step for step, _ in written[tag]] == [0, 1, 2, 3], tag
    (probe_batch,) = resumed.state_dict()["second_order"]["probe_batches"]
    assert same_batch(probe_batch, first_resumed_batch)


def test_the_checkpoint_keeps_the_probe_batch_and_no_parameter_sized_vector(tmp_path: Path) -> None:
    monitor = second_order_monitor(curvature=CurvatureOptions(every_n_steps=1, max_products=8))
    checkpoint = checkpointed_run(tmp_path, monitor, TinyEncoder())

    state = next(s for k, s in torch.load(checkpoint)["callbacks"].items() if "SpectralMonitor" in k)
    state = state["second_order"]
    (probe_batch,) = state["probe_batches"]
    assert same_batch(probe_batch, first_batch())
    assert state["jacobian_warm"]  # one sequence's size
    parameters = sum(p.numel() for p in TinyEncoder().parameters())
    vectors = [leaf for leaf in torch.utils._pytree.tree_leaves(state) if isinstance(leaf, torch.Tensor)]
    assert max(vector.numel() for vector in vectors if vector.is_floating_point()) < parameters


def test_a_checkpoint_with_the_curvature_vectors_of_an_earlier_version_resumes_without_a_warning(
    tmp_path: Path,
) -> None:
    checkpoint = checkpointed_run(tmp_path, second_order_monitor(), TinyEncoder())
    contents = torch.load(checkpoint, weights_only=False)
    (monitor_state,) = [state for key, state in contents["callbacks"].items() if "SpectralMonitor" in key]
    parameters = sum(p.numel() for p in TinyEncoder().parameters())
    monitor_state["second_order"]["curvature_warm"] = {  # what earlier versions wrote
        "model": {"layout": [("embedding.weight", (8, 8))], "top": torch.ones(parameters, 1)}
    }
    torch.save(contents, checkpoint)

    with monitor_reports() as reports:
        written, _ = resume(tmp_path, second_order_monitor(), TinyEncoder(), checkpoint)

    assert not reports.messages
    assert [step for step, _ in written["curvature/hessian_eigenvalue_1/model"]] == [0, 1, 2, 3]


class TokenBatch(NamedTuple):
    tokens: torch.Tensor
    targets: torch.Tensor


class NamedBatchEncoder(TinyEncoder):
    def training_step(self, batch: TokenBatch, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch.tokens).flatten(0, 1), batch.targets.flatten())
        self.log("train/loss", loss)
        return loss


def named_batches() -> DataLoader:
    def collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> TokenBatch:
        tokens, targets = (torch.stack(column) for column in zip(*rows, strict=True))
        return TokenBatch(tokens, targets)

    return DataLoader(previous_token_batches().dataset, batch_size=4, collate_fn=collate)


def test_a_probe_batch_torch_load_would_refuse_is_left_out_and_the_run_resumes(tmp_path: Path) -> None:
    # torch.load(weights_only=True), Lightning's way to read a checkpoint, refuses a namedtuple: in the
    # checkpoint it would make the resume itself fail.
    with monitor_reports() as reports:
        checkpoint = checkpointed_run(
            tmp_path, second_order_monitor(), NamedBatchEncoder(), data=named_batches()
        )
    report, end_of_run = reports.messages
    assert "checkpointing the probe batch" in report and "test_resume.TokenBatch" in report
    assert "end of the run" in end_of_run and "checkpointing the probe batch failed at steps" in end_of_run
    assert torch.load(checkpoint)  # weights_only=True, as Lightning reads it

    resumed = second_order_monitor()
    written, _ = resume(tmp_path, resumed, NamedBatchEncoder(), checkpoint, data=named_batches())
    assert [step for step, _ in written["ntk/ntk_trace/model"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("rank", [0, 1])
def test_under_ddp_only_the_rank_that_checkpointed_keeps_its_probe_batch(
    rank: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkpoint holds global rank 0's callback state; every rank reads it on resume. The other ranks'
    # probe batches were their own shards, so they take a new one rather than rank 0's.
    checkpoint = checkpointed_run(tmp_path, second_order_monitor(), TinyEncoder())
    monkeypatch.setattr(curvature_monitor, "global_rank", lambda: rank)
    resumed = second_order_monitor()
    _, first_resumed_batch = resume(tmp_path, resumed, TinyEncoder(), checkpoint)

    (probe_batch,) = resumed.state_dict()["second_order"]["probe_batches"]
    assert same_batch(probe_batch, first_batch() if rank == 0 else first_resumed_batch)
