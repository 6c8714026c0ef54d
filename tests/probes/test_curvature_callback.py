"""The curvature, Jacobian and NTK families in real ``Trainer.fit`` runs, read back from the event files.

The edge of stability (Cohen et al. 2021), scaled down: full-batch gradient descent on a small tanh network
sharpens until λ_max(H) reaches 2/η and then hovers there. And the non-perturbation guarantee with every
opt-in probe on: the trained parameters are bit-identical to a run without the monitor (dropout active).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.events import scalar_steps
from helpers.lightning_runs import fit
from helpers.lightning_runs import read_viewed as read_back
from helpers.models import EOS_LEARNING_RATE, FullBatchRegression, TinyEncoder, teacher_data
from pytorch_lightning.loggers import TensorBoardLogger

from spectral_monitor import SpectralMonitor
from spectral_monitor.alerts import AlertConfig, AlertEvent, Condition, Rule
from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions, NTKOptions

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_gradient_descent_sharpens_to_the_edge_of_stability_and_stays_there(tmp_path: Path) -> None:
    monitor = SpectralMonitor(families=[], curvature=CurvatureOptions(every_n_steps=20))
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="eos", version=0)
    fit(FullBatchRegression(), [monitor], logger, max_steps=400, data=teacher_data(), max_epochs=-1)

    events = read_back(logger.log_dir)
    ratio = [event.value for event in events.Scalars("curvature/sharpness_ratio/model")]
    threshold = [event.value for event in events.Scalars("curvature/sharpness_threshold/model")]
    sharpness = [event.value for event in events.Scalars("curvature/sharpness/model")]
    assert threshold == pytest.approx([2 / EOS_LEARNING_RATE] * len(ratio))
    assert len(ratio) == 21 and ratio[0] < 0.75  # well below the edge at initialisation
    assert max(ratio) > 0.95  # progressive sharpening reaches it
    late = ratio[len(ratio) // 2 :]
    assert all(0.8 <= value <= 1.3 for value in late), late  # and it hovers there
    assert sharpness[-1] * EOS_LEARNING_RATE / 2 == pytest.approx(ratio[-1], rel=1e-5)
    assert scalar_steps(events, "curvature/overhead_ms/model")[:3] == [0, 19, 39]


def test_a_rule_on_curvature_fires_and_stops_training_on_a_step_only_curvature_measures(
    tmp_path: Path,
) -> None:
    seen: list[AlertEvent] = []
    sharp = Rule(
        name="sharp", conditions=[Condition("curvature/hessian_eigenvalue_1", ">=", 0.0)], start_step=1
    )
    monitor = SpectralMonitor(
        families=[],
        every_n_steps=4,  # logging steps 0, 3, ...; curvature at 0, 1, 3, ...
        curvature=CurvatureOptions(every_n_steps=2),
        alerts=AlertConfig(defaults=False, rules=[sharp]),
        on_alert=seen.append,
        stop_on=["sharp"],
    )
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="sharp", version=0)
    trainer = fit(FullBatchRegression(), [monitor], logger, max_steps=6, data=teacher_data(), max_epochs=-1)

    assert [(event.rule, event.kind, event.step, event.layer) for event in seen] == [
        ("sharp", "fired", 1, "model")
    ]
    assert trainer.global_step == 2  # stopped after step 1
    events = read_back(logger.log_dir)
    assert scalar_steps(events, "curvature/hessian_eigenvalue_1/model") == [0, 1]
    assert [(e.step, e.value) for e in events.Scalars("alerts/fired/sharp")] == [(0, 0.0), (1, 1.0)]


@pytest.mark.slow
def test_training_with_every_curvature_probe_on_follows_the_same_trajectory(tmp_path: Path) -> None:
    def train(callbacks: list, run: str) -> TinyEncoder:
        torch.manual_seed(0)
        model = TinyEncoder(dropout=0.1)
        logger = TensorBoardLogger(save_dir=str(tmp_path), name=run, version=0)
        fit(model, callbacks, logger, max_steps=12, log_every_n_steps=1)
        return model

    monitor = SpectralMonitor(
        every_n_steps=4,
        figures_every_n_logs=2,
        curvature=CurvatureOptions(
            every_n_steps=4,
            top_k=2,
            min_eigenvalue=True,
            trace_products=6,
            density_probes=2,
            density_steps=4,
            blocks=["query", "mlp"],
            max_products=12,
        ),
        jacobian=JacobianOptions(every_n_steps=4, max_iters=3),
        ntk=NTKOptions(every_n_steps=4, examples=3),
        strict=True,
    )
    watched = train([monitor], "watched")
    unwatched = train([], "unwatched")

    for (name, parameter), (_, reference) in zip(
        watched.named_parameters(), unwatched.named_parameters(), strict=True
    ):
        assert torch.equal(parameter, reference), name
    events = read_back(str(tmp_path / "watched" / "version_0"))
    for tag in (
        "curvature/sharpness/model",  # AdamW: from the first step on, once v̂ exists
        "curvature/sharpness_ratio/query",
        "curvature/hessian_eigenvalue_2/mlp",
        "curvature/hessian_min_eigenvalue/model",
        "curvature/hessian_trace_se/model",
        "jacobian/jacobian_norm/encoder.layers.1",
        "jacobian/residual_branch_norm/encoder.layers.0",
        "jacobian/end_to_end_norm/model",
        "ntk/ntk_effective_rank/model",
    ):
        assert scalar_steps(events, tag)[-2:] == [7, 11], tag
    assert scalar_steps(events, "curvature/hessian_eigenvalue_1/model") == [0, 3, 7, 11]
    assert [event.step for event in events.Images("curvature/figures/density/model")] == [0, 3, 7, 11]


def test_in_a_real_run_the_stretched_cadence_spaces_events_by_the_interval_it_writes(tmp_path: Path) -> None:
    """Measured times, not a fake clock: every gap between curvature events is at least the interval written
    at the step after the first event of the gap, and those intervals are what keeps each event's time at
    most 20 % of the training steps between."""
    monitor = SpectralMonitor(
        families=[], curvature=CurvatureOptions(every_n_steps=1, max_overhead_percent=20.0)
    )
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="stretched", version=0)
    fit(FullBatchRegression(), [monitor], logger, max_steps=80, data=teacher_data(), max_epochs=-1)

    events = read_back(logger.log_dir)
    measured = scalar_steps(events, "curvature/overhead_ms/model")
    intervals = {event.step: event.value for event in events.Scalars("curvature/every_n_steps/model")}
    assert len(measured) >= 2 and measured[0] == 0
    for event, later in zip(measured[:-1], measured[1:], strict=True):
        interval = intervals[event + 1]
        assert interval >= 1 and later - event >= interval
