"""Alerts in real training runs of the shipped configs, shortened by arguments (steps, cadence), not by
other models: the long-context collapse is caught and stopped, its γ·log n twin and the healthy demo raise
nothing, a NaN injected into a weight is reported on that step; ``report`` reads the event files back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from helpers.models import EOS_LEARNING_RATE, FullBatchRegression, teacher_data
from matplotlib.image import imread
from pytorch_lightning.cli import LightningCLI
from tensorboard.backend.event_processing import event_accumulator

from spectral_monitor import SpectralMonitor
from spectral_monitor.alerts import AlertEvent, default_rules
from spectral_monitor.cli import main, shipped_configs
from spectral_monitor.core.options import grouped_keywords
from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.report import KEY_METRICS, ReportError, write_report

pytestmark = pytest.mark.usefixtures("one_thread")

RULE_NAMES = [rule.name for rule in default_rules()]
COLLAPSING_LAYERS = ("blocks.0.attention", "blocks.1.attention")


def fit_config(name: str, logdir: Path, max_steps: int, **monitor: object) -> pl.Trainer:
    """Train the shipped config ``name`` as LightningCLI would, with fewer steps and these monitor args."""
    options = grouped_keywords(monitor)
    callback = {"class_path": "spectral_monitor.SpectralMonitor", "init_args": {"options": options}}
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
    """The fired counter of each rule the run evaluated (only those have counters)."""
    written = events.Tags()["scalars"]
    return {
        rule: events.Scalars(f"alerts/fired/{rule}")[-1].value
        for rule in RULE_NAMES
        if f"alerts/fired/{rule}" in written
    }


@pytest.mark.slow
def test_long_context_collapse_fires_on_both_layers_and_stop_on_stops_training(tmp_path: Path) -> None:
    trainer = fit_config(
        "long_context_collapse", tmp_path, max_steps=20, every_n_steps=5, log_first_step=False,
        max_sequences=1, stop_on=["uniform_attention"], attention_cost_ratio=1e9,
    )  # fmt: skip
    events = events_of(tmp_path)
    counts = fired(events)
    # Evaluations at steps 4 and 9: patience 2 fires at step 9 on both layers, and training stops there.
    assert counts["uniform_attention"] == 2
    assert counts["rank_collapse"] == 2
    assert {rule for rule, count in counts.items() if count} == {"uniform_attention", "rank_collapse"}
    assert trainer.global_step == 10
    (status_step, status), (step, table) = [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("alerts/table/text_summary")
    ]
    assert (status_step, step) == (4, 9)
    assert status.startswith("No open alerts at step 4.")
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
    # One status entry, written on the first evaluation, and no other table: nothing fired or resolved.
    tables = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("alerts/table/text_summary")]
    assert len(tables) == 1 and tables[0].startswith("No open alerts at step 0.")
    # Counters of the rules that are evaluated only: curvature and Jacobians are off in the demo.
    counters = {tag for tag in events.Tags()["scalars"] if tag.startswith("alerts/fired/")}
    assert "alerts/fired/rank_collapse" in counters
    assert not counters & {"alerts/fired/edge_of_stability", "alerts/fired/jacobian_explosion"}


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
            printed_row = rf"^{re.escape(layer)} +{re.escape(metric)} +{values[-1]:.3f} +{min(values):.3f} "
            assert re.search(printed_row, printed, re.MULTILINE), printed_row
            checked += 1
    assert checked >= 10
    watched = [rule for rule in RULE_NAMES if f"alerts/fired/{rule}" in tags]
    assert len(watched) == len(RULE_NAMES) - 2  # curvature and Jacobians are off: their rules are not run
    assert f"alerts: none fired ({len(watched)} rules watched)" in printed
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


class LearningRateJump(FullBatchRegression):
    """The edge-of-stability regression of test_curvature_callback, its step size multiplied by ``factor``
    from step ``at`` on: a schedule that overshoots the edge mid-run."""

    def __init__(self, at: int, factor: float) -> None:
        super().__init__()
        self.at, self.factor = at, factor

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=EOS_LEARNING_RATE)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 if s < self.at else self.factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit_regression(logdir: Path, model: pl.LightningModule, max_steps: int, every: int) -> list[AlertEvent]:
    seen: list[AlertEvent] = []
    monitor = SpectralMonitor(
        families=[], curvature=CurvatureOptions(every_n_steps=every), on_alert=seen.append
    )
    trainer = pl.Trainer(
        max_steps=max_steps, max_epochs=-1, callbacks=[monitor], log_every_n_steps=1,
        logger=pl.loggers.TensorBoardLogger(str(logdir)), accelerator="cpu", enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, teacher_data())
    return seen


def scalars(events: event_accumulator.EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}


@pytest.mark.slow
def test_gradient_descent_at_the_edge_of_stability_raises_nothing(tmp_path: Path) -> None:
    seen = fit_regression(tmp_path, FullBatchRegression(), max_steps=400, every=20)
    events = events_of(tmp_path)
    ratio = scalars(events, "curvature/sharpness_ratio/model")
    assert 0.95 < max(ratio.values()) < 1.3  # it reaches the edge and stays there: the normal regime of GD
    assert seen == []
    assert events.Scalars("alerts/fired/edge_of_stability")[-1].value == 0


@pytest.mark.slow
def test_a_learning_rate_jump_past_the_edge_fires_before_the_loss_moves(tmp_path: Path) -> None:
    seen = fit_regression(tmp_path, LearningRateJump(at=100, factor=2.5), max_steps=130, every=4)
    events = events_of(tmp_path)
    ratio, loss = scalars(events, "curvature/sharpness_ratio/model"), scalars(events, "train/loss")
    assert ratio[99] < 1 and min(ratio[103], ratio[107], ratio[111]) > 2  # η × 2.5 at step 100
    (alert,) = seen
    assert (alert.rule, alert.kind, alert.step, alert.since) == ("edge_of_stability", "fired", 111, 103)
    assert alert.message().startswith(
        "SpectralMonitor warning edge_of_stability at model, step 111: curvature/sharpness_ratio "
        f"{ratio[111]:.3f} >= 1.500 since step 103. Try: lower the learning rate"
    )
    # The loss still falls when the ratio crosses, has barely moved when the alert fires (on an AMD EPYC
    # it still fell at step 111; on an AVX-512 Xeon it had risen 1.47x) ...
    assert loss[103] < loss[99] and loss[111] < 2 * loss[99]
    assert loss[120] > 1000 * loss[99]  # ... and has exploded 9 steps later


def fit_tiny_probed(logdir: Path, lr: float, max_steps: int, every: int) -> list[AlertEvent]:
    """The tiny demo model with AdamW at ``lr``, every family including curvature and Jacobians on."""
    seen: list[AlertEvent] = []
    monitor = SpectralMonitor(
        every_n_steps=every, figures_every_n_logs=0, on_alert=seen.append,
        curvature=CurvatureOptions(every_n_steps=every), jacobian=JacobianOptions(every_n_steps=every),
    )  # fmt: skip
    model = DemoTransformer(vocab_size=160, d_model=16, n_layers=2, n_heads=2, seq_len=16, seed=0, lr=lr)
    data = SyntheticDataModule(vocab_size=160, seq_len=16, batch_size=8, num_batches=64, seed=0)
    trainer = pl.Trainer(
        max_steps=max_steps, callbacks=[monitor], logger=pl.loggers.TensorBoardLogger(str(logdir)),
        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=every,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    return seen


@pytest.mark.slow
def test_adams_first_steps_above_their_edge_raise_nothing(tmp_path: Path) -> None:
    seen = fit_tiny_probed(tmp_path, lr=3e-3, max_steps=12, every=1)
    ratio = scalars(events_of(tmp_path), "curvature/sharpness_ratio/model")
    assert max(ratio[step] for step in (2, 3, 4)) > 1.5  # v̂ of a few gradients: preconditioned λ past 38/η
    assert max(ratio[step] for step in range(5, 12)) < 0.5
    assert seen == []


def half_a_unit_in_the_last_place(printed: str) -> float:
    """How far a number printed as ``printed`` ("1.04e+03", "0.123") may be from the value it rounds."""
    mantissa, _, exponent = printed.partition("e")
    return 0.5 * 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))


@pytest.mark.slow
def test_adamw_at_100x_the_demo_learning_rate_blows_up_the_jacobians_and_report_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = fit_tiny_probed(tmp_path / "logs", lr=0.3, max_steps=10, every=5)
    exploding = [event for event in seen if event.rule == "jacobian_explosion"]
    assert {(event.layer, event.step, event.kind) for event in exploding} == {
        ("blocks.0", 9, "fired"),
        ("model", 9, "fired"),
    }
    assert all(event.value >= 200 for event in exploding)
    events = events_of(tmp_path / "logs")
    assert scalars(events, "jacobian/jacobian_norm/blocks.1")[9] < 10  # the second block is not judged broken

    assert main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    for tag in ("jacobian/jacobian_norm/blocks.0", "jacobian/end_to_end_norm/model",
                "curvature/sharpness_ratio/model", "curvature/sharpness/model"):  # fmt: skip
        family, metric, layer = tag.split("/")
        (line,) = [line for line in printed.splitlines() if line.split()[:2] == [layer, f"{family}/{metric}"]]
        latest, printed_latest = list(scalars(events, tag).values())[-1], line.split()[2]
        assert abs(float(printed_latest) - latest) <= half_a_unit_in_the_last_place(printed_latest), line
    # Each alert with its step and layer, as the alert tables wrote them.
    for where in ("blocks.0", "model"):
        assert f"  jacobian_explosion at step 9 in {where}: " in printed
    (markdown,) = (tmp_path / "report").rglob("report.md")
    assert "| jacobian_explosion | 9 | blocks.0 | " in markdown.read_text()
    for plot in ("curvature__sharpness_ratio", "jacobian__jacobian_norm", "jacobian__end_to_end_norm"):
        assert imread(markdown.parent / "plots" / f"{plot}.png").shape[0] > 100


@pytest.mark.slow
def test_the_healthy_demo_with_curvature_and_jacobians_on_raises_nothing(tmp_path: Path) -> None:
    fit_config(
        "demo", tmp_path, max_steps=50, every_n_steps=25, figures_every_n_logs=0, max_sequences=1,
        curvature={"every_n_steps": 25}, jacobian={"every_n_steps": 25},
    )  # fmt: skip
    events = events_of(tmp_path)
    # Alerts never read unconverged values: the rules below judged certified readings, not skipped ones.
    assert set(scalars(events, "curvature/converged/model").values()) == {1.0}
    assert set(scalars(events, "jacobian/converged/blocks.0").values()) == {1.0}
    growth = scalars(events, "jacobian/jacobian_norm/blocks.0")
    # Block 0 reads the 0.02-scale embeddings through LayerNorm: its Jacobian grows > 10x in healthy training.
    assert growth[49] > 10 * growth[0]
    assert set(scalars(events, "curvature/sharpness_ratio/model")) == {24, 49}
    assert set(fired(events).values()) == {0.0}
