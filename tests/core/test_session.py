"""The session on its own: driven step by step on a tiny model, writing to a fake sink that records every
call, with no training framework. What the session promises its callers (cadence, what reaches which sink,
failures kept inside, checkpoint state, the probe-family protocol) is checked here directly."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from spectral_monitor import MonitorOptions, MonitorSession
from spectral_monitor.core.families import LoggingStep, ProbeFamily, Run
from spectral_monitor.demo import DemoTransformer
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import Capability, Sink

ALL_OUTPUTS = frozenset(Capability)


class RecordingSink(Sink):
    """Keeps every call, in order, as ``(kind, *arguments)``; ``failing`` makes scalar writes raise."""

    def __init__(self, capabilities: frozenset[Capability] = ALL_OUTPUTS, failing: bool = False) -> None:
        self.capabilities = capabilities
        self.failing = failing
        self.calls: list[tuple[Any, ...]] = []

    def write_measurements(self, records: Iterable[Measurement]) -> None:
        if self.failing:
            raise OSError("no space left on device")
        self.calls.append(("measurements", list(records)))

    def write_distributions(self, records: Iterable[Distribution]) -> None:
        self.calls.append(("distributions", list(records)))

    def write_figure(self, tag: str, figure: Figure, step: int) -> None:
        self.calls.append(("figure", tag, step))

    def write_image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.calls.append(("figure", tag, step))

    def write_text(self, tag: str, markdown: str, step: int) -> None:
        self.calls.append(("text", tag, step))

    def write_layout(self, layout: Any) -> bool:
        self.calls.append(("layout",))
        return True

    def close(self) -> None:
        self.calls.append(("close",))

    def kinds(self) -> list[str]:
        return [call[0] for call in self.calls]

    def records(self) -> list[Measurement]:
        return [record for call in self.calls if call[0] == "measurements" for record in call[1]]


def tiny_model() -> DemoTransformer:
    torch.manual_seed(0)
    return DemoTransformer(vocab_size=16, d_model=32, n_layers=2, n_heads=4, seq_len=16)


def tokens() -> torch.Tensor:
    return torch.randint(16, (2, 16), generator=torch.Generator().manual_seed(1))


def run_steps(session: MonitorSession, model: torch.nn.Module, steps: Iterable[int]) -> list[bool]:
    """Each step as a caller runs it; whether each was a logging step."""
    batch, logged = tokens(), []
    for step in steps:
        logged.append(session.begin_step(step, batch))
        model(batch)
        session.end_forward()
        session.end_step()
    return logged


def options(**overrides: Any) -> MonitorOptions:
    defaults: dict[str, Any] = {"families": ["attention", "weights"], "preflight": False}
    return MonitorOptions.from_keywords(**{**defaults, **overrides})


def test_only_logging_steps_are_measured_and_each_is_written_once() -> None:
    model, sink = tiny_model(), RecordingSink()
    session = MonitorSession(options(every_n_steps=5, log_first_step=True))
    session.start(model, [sink])
    logged = run_steps(session, model, range(11))
    session.close()
    assert [step for step, was in enumerate(logged) if was] == [0, 4, 9]
    steps_written = [call[1][0].step for call in sink.calls if call[0] == "measurements"]
    assert steps_written == [0, 4, 9]
    assert sink.kinds()[-1] == "close"


def test_a_repeated_step_is_measured_at_its_first_micro_batch_only() -> None:
    model, sink = tiny_model(), RecordingSink()
    session = MonitorSession(options(every_n_steps=1))
    session.start(model, [sink])
    assert run_steps(session, model, [0, 0, 0, 1]) == [True, False, False, True]


def test_the_weights_written_are_their_largest_singular_values() -> None:
    """Closed form: the spectral norm written for a plain linear weight is ``svdvals(W)[0]`` in float64."""
    model, sink = tiny_model(), RecordingSink()
    session = MonitorSession(options(families=["weights"], every_n_steps=1))
    session.start(model, [sink])
    run_steps(session, model, [0])
    written = {record.layer: record.value for record in sink.records() if record.metric == "spectral_norm"}
    linears = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    checked = sorted(set(written) & set(linears))
    assert checked, (sorted(written), sorted(linears))
    for layer in checked:
        exact = torch.linalg.svdvals(linears[layer].weight.detach().double())[0].item()
        assert written[layer] == pytest.approx(exact, rel=1e-4), layer


def test_a_step_due_both_spectrum_histograms_and_weight_spectra_decomposes_the_weights_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The histograms of every singular value and the weight-spectrum metrics read one decomposition, and both
    are the float64 singular values of the weights."""
    from spectral_monitor.probes import WeightProbe
    from spectral_monitor.toolbox import weight_spectra as toolbox

    decompositions: list[int] = []
    probe_singular_values = WeightProbe.singular_values
    toolbox_full_spectra = toolbox.full_spectra

    def counted_probe(self: WeightProbe) -> dict[str, np.ndarray]:
        decompositions.append(len(list(self.named_matrices())))
        return probe_singular_values(self)

    def counted_toolbox(targets: list[Any]) -> dict[str, np.ndarray]:
        if targets:
            decompositions.append(len(targets))
        return toolbox_full_spectra(targets)

    monkeypatch.setattr(WeightProbe, "singular_values", counted_probe)
    monkeypatch.setattr(toolbox, "full_spectra", counted_toolbox)
    model, sink = tiny_model(), RecordingSink()
    session = MonitorSession(
        options(
            families=["weights"],
            every_n_steps=1,
            histograms=True,
            figures_every_n_logs=2,
            weight_spectra_every_n_logs=1,
        )
    )
    session.start(model, [sink])
    run_steps(session, model, range(3))
    session.close()

    weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(decompositions) == 3 and len(set(decompositions)) == 1  # one per logging step
    histograms = [
        record
        for call in sink.calls
        if call[0] == "distributions"
        for record in call[1]
        if record.name == "singular_values"
    ]
    assert sorted({record.step for record in histograms}) == [0, 2]  # the figure steps
    ranks = {(r.layer, r.step): r.value for r in sink.records() if r.metric == "energy_rank_99"}
    assert {step for _, step in ranks} == {0, 1, 2}
    checked = [record for record in histograms if record.layer in weights]
    assert len(checked) >= 4
    for record in checked:
        exact = torch.linalg.svdvals(weights[record.layer].detach().double()).numpy()
        assert np.abs(record.values - exact).max() <= 1e-7 * exact[0], record.layer
        energy = np.cumsum(exact**2) / np.sum(exact**2)
        assert ranks[record.layer, record.step] == 1 + int(np.sum(energy < 0.99 - 1e-12)), record.layer


def test_each_output_reaches_only_the_sinks_that_keep_it_and_figures_are_drawn_only_for_them() -> None:
    model = tiny_model()
    everything, scalars_only = RecordingSink(), RecordingSink(frozenset({Capability.SCALARS}))
    session = MonitorSession(options(every_n_steps=1, histograms=True, figures_every_n_logs=1))
    session.start(model, [everything, scalars_only])
    run_steps(session, model, [0])
    session.close()
    assert set(scalars_only.kinds()) == {"measurements", "close"}
    kinds = set(everything.kinds())
    assert {"measurements", "distributions", "figure", "layout", "text"} <= kinds
    figures = [call[1] for call in everything.calls if call[0] == "figure"]
    assert "attention/figures/spectrum" in figures
    # The same scalars reach both.
    assert [r.tag for r in everything.records()] == [r.tag for r in scalars_only.records()]

    alone = RecordingSink(frozenset({Capability.SCALARS}))
    session = MonitorSession(options(every_n_steps=1, figures_every_n_logs=1))
    session.start(model, [alone])
    drawn: list[str] = []
    session._families.append(_FigureCounter(drawn))  # sees what the step asks to draw
    run_steps(session, model, [0])
    assert drawn == [False]


class _FigureCounter(ProbeFamily):
    def __init__(self, seen: list[Any]) -> None:
        super().__init__(options(), reports=None)  # type: ignore[arg-type]
        self.seen = seen

    def measure(self, progress: LoggingStep) -> None:
        self.seen.append(progress.draw_figures)


def test_a_failing_metric_loses_only_its_own_records_and_is_reported_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a kernel the metric needs failed")

    monkeypatch.setattr("spectral_monitor.core.attention_plan.attention_metrics", broken)
    model, sink = tiny_model(), RecordingSink()
    session = MonitorSession(options(every_n_steps=1))
    session.start(model, [sink])
    with pytest.warns(RuntimeWarning, match="computing the attention metrics"):
        run_steps(session, model, [0, 1])
        session.close()
    families = {record.family for record in sink.records()}
    assert "weights" in families and "attention" not in families

    strict = MonitorSession(options(every_n_steps=1, strict=True))
    strict.start(model, [RecordingSink()])
    with pytest.raises(RuntimeError, match="a kernel the metric needs failed"):
        run_steps(strict, model, [0])


def test_a_failing_sink_does_not_stop_the_others_and_is_named_at_the_end() -> None:
    model, healthy, full = tiny_model(), RecordingSink(), RecordingSink(failing=True)
    session = MonitorSession(options(every_n_steps=1))
    session.start(model, [full, healthy])
    with pytest.warns(RuntimeWarning, match="writing to RecordingSink"):
        run_steps(session, model, [0, 1])
        session.close()
    assert [call[1][0].step for call in healthy.calls if call[0] == "measurements"] == [0, 1]


def test_a_resumed_session_logs_the_steps_the_uninterrupted_one_would() -> None:
    model = tiny_model()
    uninterrupted = MonitorSession(options(every_n_steps=3))
    uninterrupted.start(model, [RecordingSink()])
    expected = run_steps(uninterrupted, model, range(10))

    first = MonitorSession(options(every_n_steps=3))
    first.start(model, [RecordingSink()])
    before = run_steps(first, model, range(5))
    state = first.state_dict()
    first.close()
    assert set(state) == {
        "last_logged_step",
        "logging_steps_done",
        "alerts",
        "weight_probe",
        "second_order",
        "attention_krylov_vectors",
        "previous_max_logit",
    }
    assert state["second_order"] is None  # no second-order family ran
    resumed = MonitorSession(options(every_n_steps=3))
    resumed.load_state_dict(state)  # before start: each family applies its part when it starts
    resumed.start(model, [RecordingSink()])
    assert before + run_steps(resumed, model, range(5, 10)) == expected
    assert (
        resumed.state_dict()["weight_probe"]["right_vectors"].keys()
        == state["weight_probe"]["right_vectors"].keys()
    )


def test_max_logit_growth_survives_a_checkpoint() -> None:
    model, sink = tiny_model(), RecordingSink()
    first = MonitorSession(options(every_n_steps=1))
    first.start(model, [RecordingSink()])
    run_steps(first, model, [0])
    resumed = MonitorSession(options(every_n_steps=1))
    resumed.load_state_dict(first.state_dict())
    resumed.start(model, [sink])
    run_steps(resumed, model, [1])
    growth = [record.value for record in sink.records() if record.metric == "max_logit_growth"]
    assert len(growth) == 2 and all(value == pytest.approx(1.0) for value in growth)  # same batch, same model
    assert all(math.isfinite(value) for value in growth)


class _ProtocolRecorder(ProbeFamily):
    """A family that records which hook the session calls, with the step where there is one."""

    def __init__(self, calls: list[tuple[str, int | None]]) -> None:
        super().__init__(options(), reports=None)  # type: ignore[arg-type]
        self.calls = calls

    def start(self, run: Run) -> None:
        self.calls.append(("start", None))

    def before_step(self, progress: LoggingStep, batch: Any, optimizer: Any) -> None:
        self.calls.append(("before_step", progress.step))

    def before_forward(self, progress: LoggingStep) -> None:
        self.calls.append(("before_forward", progress.step))

    def arm(self, token_mask: torch.Tensor | None, *, every_module: bool) -> None:
        self.calls.append(("arm", None))

    def disarm(self) -> None:
        self.calls.append(("disarm", None))

    def discard(self) -> None:
        self.calls.append(("discard", None))

    def measure(self, progress: LoggingStep) -> None:
        self.calls.append(("measure", progress.step))

    def close(self) -> None:
        self.calls.append(("close", None))

    def state_dict(self) -> dict[str, Any]:
        return {"recorder": len(self.calls)}


def test_the_session_drives_every_family_through_the_protocol_in_order() -> None:
    model, calls = tiny_model(), []
    session = MonitorSession(options(families=["weights"], every_n_steps=2, log_first_step=False))
    session._families = [_ProtocolRecorder(calls)]
    session.start(model, [RecordingSink()])
    run_steps(session, model, [0, 1])
    session.begin_step(2, tokens())
    session.abandon()  # a step whose forward failed
    session.close()
    logging_step = [
        ("before_step", 1),
        ("before_forward", 1),
        ("arm", None),
        ("disarm", None),
        ("disarm", None),  # end_step ends the forward again: a no-op for a disarmed family
        ("measure", 1),
    ]
    assert calls == [
        ("start", None),
        ("discard", None),
        ("before_step", 0),
        ("discard", None),
        *logging_step,
        ("discard", None),
        ("before_step", 2),
        ("discard", None),
        ("discard", None),
        ("close", None),
    ]
    assert session.state_dict()["recorder"] == len(calls)
