"""Faults injected into a monitored run: training goes on, each fault is reported once, strict mode raises.

Tried: an exception inside every probe entry point of every family; NaN/inf in the inputs, the activations,
the weights and the gradients; attention modules with unusual signatures; a block that disappears and a
weight that changes shape between logging steps; a log directory that is full or unwritable (the monitor's
own event file refuses writes with ``OSError``, while Lightning's file keeps working). For each: the run
reaches ``max_steps``, no monitor report is repeated, the report names the fault, what could still be
measured is written on every logging step, and with ``strict=True`` the same fault raises out of
``Trainer.fit``. The fault matrix crosses six fault kinds with every family and checks that Lightning's own
metrics are all written and that the end-of-run report lists exactly what the monitor lost.
"""

from __future__ import annotations

import errno
import importlib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.events import read_back, scalar_series
from helpers.models import HEADS, VOCAB, WIDTH, TinyEncoder, hook_count
from helpers.reliability import (
    ALL_FAMILIES,
    FAMILY_CONFIGURATIONS,
    FAMILY_IDS,
    fit,
    monitor_reports,
    tensorboard_logger,
)
from tensorboard.compat.proto.event_pb2 import Event
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import spectral_monitor.sinks.redrawn as redrawn_module
import spectral_monitor.sinks.tfrecord as tfrecord_module
from spectral_monitor import SpectralMonitor
from spectral_monitor.alerts import AlertEvent
from spectral_monitor.core.second_order import CurvatureOptions
from spectral_monitor.probes import AttentionInputs, register_attention_extractor
from spectral_monitor.records import Measurement
from spectral_monitor.sinks import SinkError, TensorBoardSink

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

STEPS = 4
EVERY_STEP = list(range(STEPS))


def quiet_monitor(**arguments: Any) -> SpectralMonitor:
    # Exact attention metrics: the Krylov path leaves threshold_rank out on steps where it is not resolved.
    # No head diversity (its own cadence, not every step) and no preflight (it may warn about the tiny model).
    defaults = {
        **ALL_FAMILIES,
        "metric_method": "exact",
        "every_n_steps": 1,
        "figures_every_n_logs": 0,
        "head_diversity_every_n_logs": 0,
        "preflight": False,
    }
    return SpectralMonitor(**{**defaults, **arguments})


def family_monitor(*families: str, **arguments: Any) -> SpectralMonitor:
    """``quiet_monitor`` measuring ``families`` only."""
    options = {"curvature": None, "jacobian": None, "ntk": None}
    return quiet_monitor(**{**options, "families": list(families), **arguments})


def written_steps(logdir: str, prefix: str) -> dict[str, list[int]]:
    return {
        tag: [step for step, _ in series] for tag, series in scalar_series(read_back(logdir), prefix).items()
    }


# -- an exception inside each probe --------------------------------------------------------------------------

PROBE_ENTRY_POINTS = [
    pytest.param(configuration, entry_point, id=entry_point.rpartition(":")[2])
    for configuration in FAMILY_CONFIGURATIONS
    for entry_point in configuration.probe_entry_points
]


class ProbeBroke(RuntimeError):
    pass


def break_entry_point(monkeypatch: pytest.MonkeyPatch, entry_point: str) -> None:
    module_name, _, attribute = entry_point.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ProbeBroke(f"injected failure in {attribute}")

    monkeypatch.setattr(owner, name, broken)


@pytest.fixture(scope="module")
def unbroken_series(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """The steps of every series of a run without faults."""
    logger = tensorboard_logger(tmp_path_factory.mktemp("unbroken"))
    fit(TinyEncoder(), [quiet_monitor()], logger, STEPS)
    return written_steps(logger.log_dir, "")


@pytest.mark.parametrize(("configuration", "entry_point"), PROBE_ENTRY_POINTS)
def test_a_probe_that_raises_is_reported_once_and_the_other_families_go_on(
    configuration,
    entry_point: str,
    unbroken_series: dict[str, list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    break_entry_point(monkeypatch, entry_point)
    model = TinyEncoder()
    logger = tensorboard_logger(tmp_path)
    with monitor_reports() as reports:
        trainer = fit(model, [quiet_monitor()], logger, STEPS)

    assert trainer.global_step == STEPS
    assert reports.count("injected failure") == 1, reports.messages
    assert not reports.repeated()
    assert hook_count(model) == 0
    for other in FAMILY_CONFIGURATIONS:
        if other.family != configuration.family:
            prefix = f"{other.family}/"
            expected = {tag: steps for tag, steps in unbroken_series.items() if tag.startswith(prefix)}
            assert expected and written_steps(logger.log_dir, prefix) == expected, other.family


@pytest.mark.parametrize(("configuration", "entry_point"), PROBE_ENTRY_POINTS)
def test_strict_mode_raises_what_a_probe_raised(
    configuration, entry_point: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_entry_point(monkeypatch, entry_point)
    model = TinyEncoder()
    with pytest.raises(ProbeBroke, match="injected failure"):
        fit(model, [quiet_monitor(strict=True)], tensorboard_logger(tmp_path), STEPS)
    assert hook_count(model) == 0


# -- non-finite values ---------------------------------------------------------------------------------------

FAULT_STEP = 1


class FeatureEncoder(TinyEncoder):
    """Takes float features (batch, tokens, WIDTH) instead of token ids, so its inputs can hold NaN."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(features))


def features_with_nan_at(batch_index: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(4 * STEPS, 8, WIDTH, generator=generator)
    features[4 * batch_index, 3, 0] = math.nan
    targets = torch.randint(VOCAB, (4 * STEPS, 8), generator=generator)
    return DataLoader(TensorDataset(features, targets), batch_size=4)


class FaultyEncoder(TinyEncoder):
    """Puts a non-finite value into its activations, weights or gradients at step ``FAULT_STEP``."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.encoder.layers[0].register_forward_hook(self._poison_output)

    def _at_fault_step(self) -> bool:
        return self.trainer.fit_loop.epoch_loop._batches_that_stepped == FAULT_STEP

    def _poison_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.fault == "activations" and self.training and self._at_fault_step():
            output = output.clone()
            output[0, 2, 0] = math.inf
            return output
        return None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.fault == "weights" and self._at_fault_step():
            with torch.no_grad():
                self.encoder.layers[1].linear1.weight[0, 0] = math.nan

    def on_after_backward(self) -> None:
        if self.fault == "gradients" and self._at_fault_step():
            self.head.weight.grad[0, 0] = math.nan


NON_FINITE_FAULTS = {
    # fault: (model, data, the reports it must cause)
    "inputs": (FeatureEncoder, features_with_nan_at, ("non-finite attention", "non-finite tokens")),
    "activations": (FaultyEncoder, None, ("non-finite attention", "non-finite tokens")),
    "weights": (FaultyEncoder, None, ("non-finite weights",)),
    "gradients": (FaultyEncoder, None, ("non-finite weights",)),
}


def non_finite_run(fault: str, logger: Any, monitor: SpectralMonitor) -> Any:
    model_type, data, _ = NON_FINITE_FAULTS[fault]
    model = model_type() if model_type is FeatureEncoder else model_type(fault)
    loader = data(FAULT_STEP) if data is not None else None
    return fit(model, [monitor], logger, STEPS, data=loader)


@pytest.mark.parametrize("fault", NON_FINITE_FAULTS)
def test_non_finite_values_are_written_and_each_kind_reported_once(fault: str, tmp_path: Path) -> None:
    logger = tensorboard_logger(tmp_path)
    with monitor_reports() as reports:
        trainer = non_finite_run(fault, logger, quiet_monitor())

    assert trainer.global_step == STEPS
    assert not reports.repeated(), reports.messages
    for kind in NON_FINITE_FAULTS[fault][2]:
        assert reports.count(kind) == 1, (kind, reports.messages)
    # Besides the non-finite reports, only the one-time note that this model's blocks have no end-to-end
    # Jacobian (its encoder's blocks do not chain into the output) is expected.
    unexpected = [message for message in reports.messages if "NaN or inf" not in message]
    assert all("do not form a chain" in message for message in unexpected), reports.messages
    for family in ("attention/", "tokens/", "weights/"):
        series = written_steps(logger.log_dir, family)
        # NaN is written at every step (a growth ratio from the second, while its previous value is finite).
        assert series, family
        for tag, steps in series.items():
            assert steps == EVERY_STEP or ("_growth/" in tag and set(steps) < set(EVERY_STEP)), (tag, steps)


@pytest.mark.parametrize("fault", NON_FINITE_FAULTS)
def test_strict_mode_raises_on_the_first_non_finite_measurement(fault: str, tmp_path: Path) -> None:
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        non_finite_run(fault, tensorboard_logger(tmp_path), quiet_monitor(strict=True))


# A NaN gradient reaches the weights in that step's update: the monitor sees it at the next step.
FIRST_NON_FINITE_STEP = {"inputs": FAULT_STEP, "activations": FAULT_STEP, "weights": FAULT_STEP}
FIRST_NON_FINITE_STEP["gradients"] = FAULT_STEP + 1


@pytest.mark.parametrize("fault", NON_FINITE_FAULTS)
def test_the_non_finite_alert_fires_once(fault: str, tmp_path: Path) -> None:
    logger = tensorboard_logger(tmp_path)
    seen: list[AlertEvent] = []
    non_finite_run(fault, logger, quiet_monitor(on_alert=seen.append))

    # From the step the fault is seen on: one critical alert per layer (or head) it reached, each once and
    # left open while the NaN stays (it spreads to every layer through the next updates), none resolved.
    assert seen and {(event.rule, event.kind, event.severity) for event in seen} == {
        ("non_finite", "fired", "critical")
    }
    assert min(event.step for event in seen) == FIRST_NON_FINITE_STEP[fault]
    subjects = [(event.layer, event.head) for event in seen]
    assert len(subjects) == len(set(subjects))
    events = read_back(logger.log_dir)
    fired = scalar_series(events, "alerts/fired/non_finite")["alerts/fired/non_finite"]
    opened = scalar_series(events, "alerts/open/non_finite")["alerts/open/non_finite"]
    assert [step for step, _ in fired] == EVERY_STEP
    assert fired == opened and fired[-1][1] == len(seen)


# -- attention modules with unusual signatures ---------------------------------------------------------------


class KeywordOnlyAttention(nn.Module):
    """Keyword-only arguments, a tuple output, SDPA on 3-D (batch·heads, tokens, d) tensors, additive mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.n_heads = HEADS

    def forward(self, *, hidden: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        batch, tokens, _ = hidden.shape
        q, k, v = (
            part.reshape(batch, tokens, HEADS, -1).transpose(1, 2).reshape(batch * HEADS, tokens, -1)
            for part in self.qkv(hidden).chunk(3, dim=-1)
        )
        mask = torch.zeros(tokens, tokens).masked_fill(torch.ones(tokens, tokens).triu(1).bool(), -math.inf)
        out = F.scaled_dot_product_attention(q, k, v, mask)
        return out.reshape(batch, HEADS, tokens, -1).transpose(1, 2).reshape(batch, tokens, -1), {
            "cache": None
        }


class HandWrittenAttention(nn.Module):
    """softmax(q kᵀ/√d) v written out: no attention kernel call for the monitor to see."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(WIDTH, WIDTH)
        self.key = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k = self.query(hidden), self.key(hidden)
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(WIDTH), dim=-1) @ hidden


class Block(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.attention, KeywordOnlyAttention):
            mixed, _ = self.attention(hidden=hidden)
        else:
            mixed = self.attention(hidden)
        return self.norm(hidden + mixed)


class UnusualModel(TinyEncoder):
    def __init__(self, attention: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(attention()), Block(attention())])
        del self.encoder

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def test_sdpa_with_keyword_only_arguments_and_3d_tensors_is_measured(tmp_path: Path) -> None:
    logger = tensorboard_logger(tmp_path)
    with monitor_reports() as reports:
        fit(UnusualModel(KeywordOnlyAttention), [quiet_monitor()], logger, STEPS)

    assert not reports.messages
    series = written_steps(logger.log_dir, "attention/entropy/")
    assert series.keys() >= {f"attention/entropy/blocks.{i}.attention" for i in range(2)}
    assert all(steps == EVERY_STEP for steps in series.values())


def failing_extractor(module: nn.Module, args: Any, kwargs: Any, output: Any) -> AttentionInputs:
    raise ProbeBroke("extractor broke")


def wrong_type_extractor(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    return module.query(args[0])


UNUSUAL_ATTENTION = {
    # extractor registered for HandWrittenAttention (None: none) -> the one report it must cause
    "no-extractor": (None, "no attention-kernel call"),
    "raising-extractor": (failing_extractor, "extractor broke"),
    "wrong-type-extractor": (wrong_type_extractor, "must return AttentionInputs"),
}


@pytest.mark.parametrize("case", UNUSUAL_ATTENTION)
def test_attention_the_monitor_cannot_read_is_reported_once(
    case: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    extractor, report = UNUSUAL_ATTENTION[case]
    if extractor is not None:
        request.addfinalizer(register_attention_extractor(HandWrittenAttention, extractor).remove)
    logger = tensorboard_logger(tmp_path)
    model = UnusualModel(HandWrittenAttention)
    with monitor_reports() as reports:
        trainer = fit(model, [quiet_monitor()], logger, STEPS)

    assert trainer.global_step == STEPS
    assert len(reports.messages) == 1 and report in reports.messages[0], reports.messages
    assert written_steps(logger.log_dir, "tokens/token_residual/") == {
        f"tokens/token_residual/blocks.{i}": EVERY_STEP for i in range(2)
    }
    assert hook_count(model) == 0


@pytest.mark.parametrize("case", [case for case, (extractor, _) in UNUSUAL_ATTENTION.items() if extractor])
def test_strict_mode_raises_when_an_extractor_fails(
    case: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    extractor, report = UNUSUAL_ATTENTION[case]
    request.addfinalizer(register_attention_extractor(HandWrittenAttention, extractor).remove)
    with pytest.raises(Exception, match=report):
        fit(UnusualModel(HandWrittenAttention), [quiet_monitor(strict=True)], tensorboard_logger(tmp_path), 2)


# -- a model that changes between logging steps --------------------------------------------------------------

CHANGE_STEP = 2


class ChangingEncoder(TinyEncoder):
    """From ``CHANGE_STEP`` on, either drops its second block or widens its first block's feed-forward."""

    def __init__(self, change: str) -> None:
        super().__init__(width=48)  # 48 x 48 projections take the warm-started Krylov path of the weights
        self.change = change

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != CHANGE_STEP - 1:
            return
        if self.change == "block-disappears":
            del self.encoder.layers[1]
        else:
            block = self.encoder.layers[0]
            block.linear1, block.linear2 = nn.Linear(48, 40), nn.Linear(40, 48)


@pytest.mark.parametrize("change", ["block-disappears", "weight-changes-shape"])
def test_a_model_that_changes_between_steps_is_measured_as_it_now_is(change: str, tmp_path: Path) -> None:
    logger = tensorboard_logger(tmp_path)
    model = ChangingEncoder(change)
    with monitor_reports() as reports:
        trainer = fit(model, [quiet_monitor()], logger, STEPS)

    assert trainer.global_step == STEPS
    assert hook_count(model) == 0
    series = written_steps(logger.log_dir, "")
    before, after = list(range(CHANGE_STEP)), list(range(CHANGE_STEP, STEPS))
    if change == "block-disappears":
        (report,) = reports.messages
        assert "encoder.layers.1" in report and "no longer in the model" in report
        for family_tag in (
            "attention/entropy/encoder.layers.{}.self_attn",
            "tokens/token_residual/encoder.layers.{}",
        ):
            assert series[family_tag.format(0)] == EVERY_STEP
            assert series[family_tag.format(1)] == before
        assert series["weights/spectral_norm/encoder.layers.1.linear1"] == before
    else:
        assert not reports.messages
        assert series["weights/spectral_norm/encoder.layers.0.linear1"] == EVERY_STEP
        widened = read_back(logger.log_dir).Scalars("weights/spectral_norm/encoder.layers.0.linear1")
        exact = float(torch.linalg.svdvals(model.encoder.layers[0].linear1.weight.detach().double())[0])
        assert widened[-1].value == pytest.approx(exact, rel=1e-3)  # measured cold: no stale warm vector
        assert all(
            series[tag] == (EVERY_STEP[1:] if "_growth/" in tag else EVERY_STEP)
            for tag in series
            if tag.startswith(("attention/", "tokens/"))
        )
    assert after  # the change happened inside the run


# -- a full or unwritable log directory ----------------------------------------------------------------------


class StepClock(pl.Callback):
    """The step a batch is at, for faults that depend on it (first in the callbacks: set before the monitor
    writes anything of that step)."""

    def __init__(self) -> None:
        self.step = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step = trainer.fit_loop.epoch_loop._batches_that_stepped


class RefusingFile:
    """The monitor's event file, whose writes raise ``OSError(code)`` while ``refusing()`` holds."""

    def __init__(self, file: Any, code: int, refusing: Callable[[], bool]) -> None:
        self._file, self._code, self._refusing = file, code, refusing

    def write(self, data: bytes) -> int:
        if self._refusing():
            raise OSError(self._code, os.strerror(self._code))
        return self._file.write(data)

    def close(self) -> None:
        self._file.close()


def refuse_monitor_writes(monkeypatch: pytest.MonkeyPatch, code: int, refusing: Callable[[], bool]) -> None:
    """The monitor's own event file refuses writes (``ENOSPC``: a full disk) or cannot be opened
    (``EACCES``: an unwritable directory) while ``refusing()`` holds; every other file works."""
    open_for_appending = tfrecord_module.open_for_appending

    def opened(path: str) -> RefusingFile:
        if code == errno.EACCES and refusing():
            raise PermissionError(code, os.strerror(code), path)
        return RefusingFile(open_for_appending(path), code, refusing)

    monkeypatch.setattr(tfrecord_module, "open_for_appending", opened)


MONITOR_PREFIXES = ("attention/", "tokens/", "weights/", "curvature/", "jacobian/", "ntk/", "alerts/")


def end_of_run_report(reports: Any) -> str | None:
    (report,) = [message for message in reports.messages if "end of the run" in message] or [None]
    return report


def lost_scalars(report: str) -> tuple[int, str]:
    """The count and steps of the scalars the end-of-run report says were not written."""
    match = re.search(r"could not write (\d+) scalars at steps ([0-9–, ]+?)[;(]", report)
    assert match, report
    return int(match.group(1)), match.group(2).strip()


def test_refused_monitor_records_leave_lightnings_logging_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The monitor's records, and only them, are refused at steps 1 and 2, whatever writer frames them.
    framed = tfrecord_module.tfrecord

    def refusing_monitor_records(data: bytes) -> bytes:
        event = Event.FromString(data)
        if event.step in (1, 2) and any(v.tag.startswith(MONITOR_PREFIXES) for v in event.summary.value):
            raise OSError(errno.ENOSPC, "No space left on device")
        return framed(data)

    monkeypatch.setattr(tfrecord_module, "tfrecord", refusing_monitor_records)
    logger = tensorboard_logger(tmp_path)
    with monitor_reports():
        trainer = fit(TinyEncoder(), [quiet_monitor(figures_every_n_logs=1)], logger, 8)
    assert trainer.global_step == 8
    written = written_steps(logger.log_dir, "")
    assert written["train/loss"] == list(range(8))
    assert written["weights/spectral_norm/head"] == [0, 4, 5, 6, 7]  # 1-2 refused, 3 waited out


def test_the_sink_backs_off_while_writes_keep_failing_and_counts_what_it_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = StepClock()
    refuse_monitor_writes(monkeypatch, errno.ENOSPC, lambda: clock.step < 12)
    sink = TensorBoardSink(tmp_path)
    attempts = []
    for step in range(20):
        clock.step = step
        try:
            sink.write_measurements([Measurement(step, "weights", "spectral_norm", "head", 1.0)])
        except SinkError:
            attempts.append(step)
    sink.close()
    assert attempts == [0, 1, 3, 7]  # then 15, which the disk took
    assert sink.losses.counts == {"scalars": dict.fromkeys(range(15), 1)}
    assert [event.step for event in read_back(tmp_path).Scalars("weights/spectral_norm/head")] == [
        15,
        16,
        17,
        18,
        19,
    ]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES], ids=["full-disk", "unwritable"])
def test_a_log_directory_that_refuses_writes_is_reported_once_and_writing_resumes(
    code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = StepClock()
    refuse_monitor_writes(monkeypatch, code, lambda: clock.step == 1)
    logger = tensorboard_logger(tmp_path)
    with monitor_reports() as reports:
        trainer = fit(TinyEncoder(), [clock, quiet_monitor(figures_every_n_logs=1)], logger, STEPS)

    assert trainer.global_step == STEPS
    (report,) = [message for message in reports.messages if "end of the run" not in message]
    assert errno.errorcode[code] in report and "writing to TensorBoardSink" in report
    events = read_back(logger.log_dir)
    written = written_steps(logger.log_dir, "")
    monitored = [tag for tag in written if tag.startswith(("attention/", "tokens/", "weights/"))]
    assert monitored
    for tag in monitored:
        # The refused step is lost, nothing else; a growth ratio has no value on the first step.
        assert written[tag] == ([2, 3] if "_growth/" in tag else [0, 2, 3]), tag
    assert [event.step for event in events.Images("attention/figures/spectrum")] == [0, 2, 3]
    assert written["train/loss"] == EVERY_STEP  # Lightning's own logging was never affected
    assert lost_scalars(end_of_run_report(reports))[1] == "1"


def test_strict_mode_raises_when_the_log_directory_refuses_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_monitor_writes(monkeypatch, errno.ENOSPC, lambda: True)
    with pytest.raises(Exception, match="ENOSPC|No space"):
        fit(TinyEncoder(), [quiet_monitor(strict=True)], tensorboard_logger(tmp_path), STEPS)


# -- partial failures stay partial ---------------------------------------------------------------------------


def test_a_curvature_block_matching_nothing_costs_that_block_only(tmp_path: Path) -> None:
    curvature = CurvatureOptions(every_n_steps=1, max_products=8, blocks={"missing": ["no_such_parameter*"]})
    logger = tensorboard_logger(tmp_path)
    with monitor_reports() as reports:
        trainer = fit(TinyEncoder(), [quiet_monitor(families=[], curvature=curvature)], logger, STEPS)

    assert trainer.global_step == STEPS
    (report,) = reports.messages
    assert "curvature block 'missing'" in report and "no_such_parameter*" in report
    written = written_steps(logger.log_dir, "curvature/")
    assert written["curvature/hessian_eigenvalue_1/model"] == EVERY_STEP  # (sharpness: from step 1, Adam)
    assert not [tag for tag in written if tag.endswith("/missing")]


def test_non_finite_attention_gives_non_finite_head_diversity_not_a_failure(tmp_path: Path) -> None:
    logger = tensorboard_logger(tmp_path)
    with monitor_reports() as reports:
        non_finite_run("inputs", logger, quiet_monitor(head_diversity_every_n_logs=1))

    assert not [message for message in reports.messages if "failed" in message], reports.messages
    diversity = scalar_series(read_back(logger.log_dir), "attention/head_diversity/")
    assert diversity and all([step for step, _ in series] == EVERY_STEP for series in diversity.values()), {
        tag: [step for step, _ in series] for tag, series in diversity.items()
    }
    assert any(math.isnan(value) for series in diversity.values() for _, value in series)


class PaddedEncoder(TinyEncoder):
    """Takes (tokens, key padding, targets) batches; padded positions are left out of the loss."""

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens), src_key_padding_mask=padding))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        tokens, padding, targets = batch
        loss = F.cross_entropy(self(tokens, padding)[~padding], targets[~padding])
        self.log("train/loss", loss)
        return loss


def test_strict_mode_draws_figures_of_padded_batches_whose_first_sequence_is_all_padding(
    tmp_path: Path,
) -> None:
    tokens = torch.randint(VOCAB, (4 * STEPS, 8), generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(4 * STEPS, 8, dtype=torch.bool)
    padding[:, 6:] = True
    padding[::4] = True  # the first sequence of every batch: nothing of it can be drawn
    padding[::4, 0] = False  # (one real token, so the loss of the batch stays defined)
    padding[0] = True
    loader = DataLoader(TensorDataset(tokens, padding, tokens.roll(1, dims=1)), batch_size=4)
    logger = tensorboard_logger(tmp_path)
    monitor = family_monitor("attention", "tokens", strict=True, figures_every_n_logs=1)
    trainer = fit(PaddedEncoder(), [monitor], logger, STEPS, data=loader)

    assert trainer.global_step == STEPS
    events = read_back(logger.log_dir)
    # Step 0's first sequence is all padding: no head to draw. Later ones have one real query.
    assert [event.step for event in events.Images("attention/figures/spectrum")] == [1, 2, 3]
    assert written_steps(logger.log_dir, "attention/entropy/")


# -- the fault matrix: every fault kind against every family -------------------------------------------------

FAULT_KINDS = (
    "disk-full-mid-run",
    "disk-full-from-start",
    "unwritable-directory",
    "non-finite-data",
    "raising-probe",
    "figure-failure",
)
FAILING_PART = {
    "attention": "arming the attention capture",
    "tokens": "arming the residual-stream capture",
    "weights": "measuring the weights",
    "curvature": "measuring the curvature family",
    "jacobian": "measuring the jacobian family",
    "ntk": "measuring the ntk family",
}
"""What the end-of-run report names when the family's first probe entry point raises."""
FAMILIES_WITH_FIGURES = {"attention"}
"""Families that draw figures in the matrix's configuration (curvature draws one only with density probes)."""


def matrix_monitor(configuration: Any) -> SpectralMonitor:
    arguments = {
        key: value for key, value in configuration.monitor_arguments.items() if key != "metric_method"
    }
    return family_monitor(*arguments.pop("families"), figures_every_n_logs=1, **arguments)


def monitor_scalars_per_step(logdir: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for tag, series in scalar_series(read_back(logdir)).items():
        if tag.startswith(MONITOR_PREFIXES):
            for step, _ in series:
                counts[step] = counts.get(step, 0) + 1
    return counts


@pytest.fixture(scope="module")
def unbroken_scalar_counts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Any], dict[int, int]]:
    """The monitor's scalars per step in a run of one family without a fault."""
    counts: dict[str, dict[int, int]] = {}

    def of(configuration: Any) -> dict[int, int]:
        if configuration.family not in counts:
            logger = tensorboard_logger(tmp_path_factory.mktemp(f"unbroken-{configuration.family}"))
            with monitor_reports():
                fit(TinyEncoder(), [matrix_monitor(configuration)], logger, STEPS)
            counts[configuration.family] = monitor_scalars_per_step(logger.log_dir)
        return counts[configuration.family]

    return of


def inject(
    fault: str, configuration: Any, monkeypatch: pytest.MonkeyPatch, clock: StepClock
) -> dict[str, Any]:
    """Sets the fault up; returns the ``fit`` arguments it needs (model, data)."""
    if fault == "disk-full-mid-run":
        refuse_monitor_writes(monkeypatch, errno.ENOSPC, lambda: clock.step == 1)
    elif fault == "disk-full-from-start":
        refuse_monitor_writes(monkeypatch, errno.ENOSPC, lambda: True)
    elif fault == "unwritable-directory":
        refuse_monitor_writes(monkeypatch, errno.EACCES, lambda: True)
    elif fault == "non-finite-data":
        return {"model": FeatureEncoder(), "data": features_with_nan_at(FAULT_STEP)}
    elif fault == "raising-probe":
        break_entry_point(monkeypatch, configuration.probe_entry_points[0])
    elif fault == "figure-failure":

        def broken_render(self: Any) -> Any:
            raise ProbeBroke("the figure could not be drawn")

        monkeypatch.setattr(redrawn_module.RedrawnFigure, "render", broken_render)
    return {"model": TinyEncoder(), "data": None}


@pytest.mark.parametrize("configuration", FAMILY_CONFIGURATIONS, ids=FAMILY_IDS)
@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_fault_matrix_fit_completes_lightning_logs_everything_and_the_report_lists_what_was_lost(
    fault: str,
    configuration: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    unbroken_scalar_counts: Callable[[Any], dict[int, int]],
) -> None:
    unbroken = unbroken_scalar_counts(configuration)
    clock = StepClock()
    run = inject(fault, configuration, monkeypatch, clock)
    logger = tensorboard_logger(tmp_path)
    with monitor_reports() as reports:
        trainer = fit(run["model"], [clock, matrix_monitor(configuration)], logger, STEPS, data=run["data"])

    assert trainer.global_step == STEPS
    assert written_steps(logger.log_dir, "train/loss") == {"train/loss": EVERY_STEP}  # Lightning's own
    assert not reports.repeated(), reports.messages
    report = end_of_run_report(reports)
    if fault in ("disk-full-mid-run", "disk-full-from-start", "unwritable-directory"):
        lost_steps = [1] if fault == "disk-full-mid-run" else EVERY_STEP
        count, steps = lost_scalars(report)
        assert count == sum(unbroken[step] for step in lost_steps), report
        assert steps == ("1" if fault == "disk-full-mid-run" else "0–3"), report
        assert sorted(monitor_scalars_per_step(logger.log_dir)) == sorted(set(unbroken) - set(lost_steps))
    elif fault == "non-finite-data":
        assert report is None, report  # NaN is written, as measured: nothing lost
        assert set(monitor_scalars_per_step(logger.log_dir)) == set(unbroken)
    elif fault == "raising-probe":
        expected = f"{FAILING_PART[configuration.family]} failed at steps 0–3"
        assert report == f"SpectralMonitor: end of the run; lost to failures: {expected}.", report
    elif configuration.family in FAMILIES_WITH_FIGURES:
        assert (
            report
            == "SpectralMonitor: end of the run; lost to failures: drawing figures failed at steps 0–3."
        )
        assert monitor_scalars_per_step(logger.log_dir) == unbroken
    else:
        assert report is None, report
        assert monitor_scalars_per_step(logger.log_dir) == unbroken
