"""Alerts in real training runs of the shipped configs, shortened by arguments (steps, cadence), not by
other models: the long-context collapse is caught and stopped, its γ·log n twin and the healthy demo raise
nothing, a NaN injected into a weight is reported on that step; ``report`` reads the event files back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from matplotlib.image import imread
from pytorch_lightning.cli import LightningCLI
from tensorboard.backend.event_processing import event_accumulator

from spectral_monitor.alerts import AlertEvent, default_rules
from spectral_monitor.callback import SpectralMonitor
from spectral_monitor.cli import main, shipped_configs
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.report import KEY_METRICS, ReportError, write_report

pytestmark = pytest.mark.usefixtures("one_thread")

RULE_NAMES = [rule.name for rule in default_rules()]
COLLAPSING_LAYERS = ("blocks.0.attention", "blocks.1.attention")


def fit_config(name: str, logdir: Path, max_steps: int, **monitor: object) -> pl.Trainer:
    """Train the shipped config ``name`` as LightningCLI would, with fewer steps and these monitor args."""
    callback = {"class_path": "spectral_monitor.SpectralMonitor", "init_args": monitor}
    logger = {
        "class_path": "pytorch_lightning.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(logdir)},
    }
    cli = LightningCLI(
        DemoTransformer,
        SyntheticDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=[
            f"--config={shipped_configs()[name]}",
            f"--trainer.max_steps={max_steps}",
            f"--trainer.callbacks=[{json.dumps(callback)}]",
            f"--trainer.logger={json.dumps(logger)}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli.trainer


def events_of(logdir: Path) -> event_accumulator.EventAccumulator:
    (run,) = {path.parent for path in logdir.rglob("events.out.tfevents*")}
    accumulator = event_accumulator.EventAccumulator(
        str(run), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    return accumulator


def fired(events: event_accumulator.EventAccumulator) -> dict[str, float]:
    return {rule: events.Scalars(f"alerts/fired/{rule}")[-1].value for rule in RULE_NAMES}


@pytest.mark.slow
def test_long_context_collapse_fires_on_both_layers_and_stop_on_stops_training(tmp_path: Path) -> None:
    trainer = fit_config(
        "long_context_collapse", tmp_path, max_steps=20, every_n_steps=5, log_first_step=False,
        max_sequences=1, stop_on=["uniform_attention"],
    )  # fmt: skip
    events = events_of(tmp_path)
    counts = fired(events)
    # Evaluations at steps 4 and 9: patience 2 fires at step 9 on both layers, and training stops there.
    assert counts["uniform_attention"] == 2
    assert counts["rank_collapse"] == 2
    assert {rule for rule, count in counts.items() if count} == {"uniform_attention", "rank_collapse"}
    assert trainer.global_step == 10
    ((step, table),) = [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("alerts/table/text_summary")
    ]
    assert step == 9
    for layer in COLLAPSING_LAYERS:
        assert f"| uniform_attention | warning | {layer} (4/4 heads) | 4 | 9 |" in table
    assert "n=512" in table


@pytest.mark.slow
def test_the_gamma_log_n_twin_raises_nothing(tmp_path: Path) -> None:
    trainer = fit_config(
        "long_context_logn", tmp_path, max_steps=10, every_n_steps=5, log_first_step=False, max_sequences=1,
        stop_on=["uniform_attention", "rank_collapse"],
    )  # fmt: skip
    events = events_of(tmp_path)
    assert [event.step for event in events.Scalars("alerts/fired/rank_collapse")] == [4, 9]
    assert set(fired(events).values()) == {0.0}
    assert trainer.global_step == 10


@pytest.mark.slow
def test_the_healthy_demo_raises_nothing_while_its_causal_heads_start_uniform(tmp_path: Path) -> None:
    fit_config("demo", tmp_path, max_steps=150, every_n_steps=10, figures_every_n_logs=0)
    events = events_of(tmp_path)
    assert len(events.Scalars("alerts/open/uniform_attention")) == 16  # steps 0, 9, ..., 149
    # Every head of every layer stays near uniform for the first ~100 steps: the causal case must not fire.
    assert min(e.value for e in events.Scalars("attention/entropy_min/blocks.1.attention")[:10]) > 0.98
    assert set(fired(events).values()) == {0.0}
    assert "alerts/table/text_summary" not in events.Tags()["tensors"]


class InjectNaN(pl.Callback):
    """Writes a NaN into the first MLP weight at the start of batch ``step`` (before the monitor looks)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.blocks[0].mlp[0].weight[0, 0] = float("nan")


def fit_tiny(logdir: Path, callbacks: list[pl.Callback], max_steps: int) -> pl.Trainer:
    model = DemoTransformer(vocab_size=160, d_model=16, n_layers=2, n_heads=2, seq_len=16, seed=0)
    data = SyntheticDataModule(vocab_size=160, seq_len=16, batch_size=4, num_batches=32, seed=0)
    trainer = pl.Trainer(
        max_steps=max_steps, callbacks=callbacks, logger=pl.loggers.TensorBoardLogger(str(logdir)),
        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("stop", [False, True], ids=["goes_on", "stop_on"])
def test_non_finite_fires_on_the_step_a_nan_is_injected(tmp_path: Path, stop: bool) -> None:
    seen: list[AlertEvent] = []
    monitor = SpectralMonitor(
        every_n_steps=1, figures_every_n_logs=0, on_alert=seen.append, stop_on=["non_finite"] if stop else []
    )
    with pytest.warns(RuntimeWarning, match="non-finite"):
        trainer = fit_tiny(tmp_path, [InjectNaN(step=3), monitor], max_steps=6)
    at_injection = [event for event in seen if event.step == 3]
    assert [event for event in seen if event.step < 3] == []
    assert {(event.rule, event.kind, event.severity) for event in at_injection} == {
        ("non_finite", "fired", "critical")
    }
    # The NaN weight itself, and what it reaches in the same forward: block 0's output, block 1's attention.
    assert {event.layer for event in at_injection} == {
        "blocks.0.mlp.0",
        "blocks.0",
        "blocks.1",
        "blocks.1.attention",
    }
    assert trainer.global_step == (4 if stop else 6)
    assert trainer.callbacks[1].state_dict()["alerts"]["history"][0]["step"] == 3


@pytest.mark.slow
def test_report_tables_the_scalars_of_the_event_files_and_draws_non_empty_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit_tiny(tmp_path / "logs", [SpectralMonitor(every_n_steps=2, figures_every_n_logs=0)], max_steps=6)
    assert main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out

    events = events_of(tmp_path / "logs")
    (markdown,) = (tmp_path / "report").rglob("report.md")
    text = markdown.read_text()
    tags = events.Tags()["scalars"]
    checked = 0
    for metric in KEY_METRICS:
        for tag in (t for t in tags if t.startswith(metric + "/") and "/head_" not in t):
            layer = tag[len(metric) + 1 :]
            values = [event.value for event in events.Scalars(tag)]
            row = f"| {layer} | {metric} | {values[-1]:.3f} | {min(values):.3f} |"
            assert row in text, row
            assert f"{layer:<28} {metric:<32} {values[-1]:>10.3f} {min(values):>10.3f}" in printed
            checked += 1
    assert checked >= 10
    assert "alerts: none fired (8 rules watched)" in printed
    plots = sorted(markdown.parent.glob("plots/*.png"))
    assert (markdown.parent / "plots" / "heatmap_effective_rank.png") in plots
    assert len(plots) > 10
    for plot in plots:
        image = imread(plot)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert np.ptp(image[..., :3]) > 0  # not a blank canvas
        assert f"]({plot.relative_to(markdown.parent).as_posix()})" in text


def test_report_on_a_missing_or_empty_logdir_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ReportError, match="does not exist"):
        write_report(tmp_path / "nope")
    assert main(["report", str(tmp_path)]) == 2
    assert "no TensorBoard event files (events.out.tfevents*) under" in capsys.readouterr().err
