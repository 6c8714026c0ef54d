"""The curvature probe's ``converged`` flag through the callback: at the edge of stability, where the top
Hessian eigenvalues cluster, every logged sharpness agrees with the exact float64 Hessian; a value that did
not converge is counted by the report.

The edge-of-stability run is ``benchmarks/eos_accuracy.py`` (its ``run``), shortened: full-batch gradient
descent on a tanh MLP, curvature every 20 steps, each event's parameters copied and the
explicit float64 Hessian's λ₁ computed by a dense symmetric eigensolver.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor.report import write_report

pytestmark = pytest.mark.usefixtures("one_thread")

EOS_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "eos_accuracy.py"


def eos_accuracy():
    spec = importlib.util.spec_from_file_location("eos_accuracy", EOS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("learning_rate", [0.8, 1.2])
def test_every_sharpness_logged_at_the_edge_of_stability_is_the_exact_top_eigenvalue(
    learning_rate: float,
) -> None:
    script = eos_accuracy()
    events = script.run(learning_rate, steps=500, every=20, hidden=32)
    assert len(events) == 26
    errors = {event.step: round(event.error, 6) for event in events}
    assert max(errors.values()) <= 1e-3, errors
    # In float32 a start with much weight along the crowded top cannot be certified gap-free within 1e-3
    # (docs/curvature.md); the probe then starts over once. None of 202 events on this machine failed from
    # both starts; a few could on a CPU that rounds otherwise, flagged, not passed.
    not_converged = [event.step for event in events if not event.converged]
    assert len(not_converged) <= 2, not_converged
    # The run is at the edge for its second half: the exact ratio λ₁η/2 hovers around 1 there.
    late = [event.exact * learning_rate / 2 for event in events if event.step >= 250]
    assert min(late) >= 0.9 and max(late) <= 1.2, late


def test_the_report_counts_the_events_that_did_not_converge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = SummaryWriter(str(tmp_path / "run"))
    for step, flag in enumerate([1.0, 0.0, 1.0]):
        writer.add_scalar("curvature/converged/model", flag, step)
        writer.add_scalar("curvature/sharpness/model", 2.0, step)
    for step, flag in enumerate([0.0, 1.0]):
        writer.add_scalar("jacobian/converged/blocks.0", flag, step)
    writer.close()
    write_report(tmp_path)
    assert "not converged: curvature 1 of 3, jacobian 1 of 2" in capsys.readouterr().out
