"""The curvature probe's budgets: its memory estimated before the first event (and the probe refused with
the estimate and the options named when it is too large), and a cadence stretched to a share of training."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers.resident_set import needs_resident_set_counters, run_probe
from torch import nn

from spectral_monitor.core.curvature_budget import (
    ALWAYS_ALLOWED_BYTES,
    estimate_curvature_memory,
    lanczos_vectors,
    saved_activation_bytes,
)
from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.core.second_order import (
    CurvatureOptions,
    JacobianOptions,
    NTKOptions,
    ProbeDataOptions,
    SecondOrderProbes,
)
from spectral_monitor.linalg.lanczos import GrowingRows

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_activations_counted_are_what_the_forward_saves_without_the_parameters() -> None:
    layer = nn.Linear(16, 32)
    x = torch.randn(8, 16)
    counted = saved_activation_bytes(lambda: torch.tanh(layer(x)).sum(), layer.parameters())
    # addmm keeps its input (8 × 16) and the weight (a parameter: not counted); tanh its output (8 × 32).
    assert counted == (8 * 16 + 8 * 32) * 4


def test_the_basis_bound_is_the_most_rows_a_growing_basis_holds_at_once() -> None:
    for products in (1, 8, 12, 13, 40, 128):
        rows = GrowingRows(torch.zeros(1, 1, 1000), min(products, 12))
        most = rows.capacity
        for _ in range(products - 1):
            before = rows.capacity
            rows.append(torch.zeros(1, 1, 1000))
            if rows.capacity != before:
                most = max(most, before + rows.capacity)
        assert lanczos_vectors(products) == most


ESTIMATE_PROBE = """
    from spectral_monitor.core.curvature_budget import estimate_curvature_memory, saved_activation_bytes
    from spectral_monitor.core.second_order import CurvatureOptions
    from spectral_monitor.demo import DemoTransformer
    from spectral_monitor.probes.curvature import ParameterSpace, measure_curvature

    map_large_buffers_alone()
    model = DemoTransformer(vocab_size=64, d_model=128, n_layers=2, n_heads=4, seq_len=32, causal=True)
    tokens = torch.randint(64, (4, 32), generator=torch.Generator().manual_seed(0))
    loss = lambda: torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss().backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    options = CurvatureOptions(max_products=int(sys.argv[1]), tol=1e-9)  # runs to its budget
    baseline = reset_peak()
    loss().backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    step = status("VmHWM") - baseline
    activations = saved_activation_bytes(loss, model.parameters())
    sizes = [ParameterSpace.of(model).size]
    memory = estimate_curvature_memory(model, sizes, options, optimizer, activations)
    baseline = reset_peak()
    result = measure_curvature(model, loss, optimizer=optimizer, max_products=options.max_products, tol=1e-9)
    probe = status("VmHWM") - baseline
    resident = sum(p.numel() * 4 for p in model.parameters()) * 3  # parameters and AdamW's two moments
    print(json.dumps({"step": step, "probe": probe, "estimated_step": memory.step_bytes - resident,
                      "estimated_probe": memory.probe_bytes - resident, "products": result.products}))
"""


@pytest.mark.slow
@needs_resident_set_counters
def test_the_memory_estimate_bounds_the_measured_peaks_within_a_factor_of_two() -> None:
    """What a training step and a curvature event add to the resident set, measured in a fresh process,
    against the estimate's parts beyond the resident parameters and optimizer state."""
    measured = run_probe(ESTIMATE_PROBE, 16)
    print({key: round(value / 2**20, 1) for key, value in measured.items() if key != "products"})
    assert 16 < measured["products"] <= 2 * 16  # the top run and the preconditioned one, within the budget
    assert measured["probe"] <= measured["estimated_probe"] <= 2 * measured["probe"]
    assert measured["estimated_step"] <= 2 * measured["step"]


class Failures:
    """Collects what a probe family raised, as the session's failure reports do outside strict mode."""

    def __init__(self) -> None:
        self.raised: list[tuple[str, Exception]] = []

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:  # noqa: BLE001 - what the session's reports catch
            self.raised.append((what, error))


def probes_of(
    model: nn.Module,
    curvature: CurvatureOptions,
    failures: Callable[[str], Any],
    warn: Callable[[str], None] = warnings.warn,
    strict: bool = False,
) -> SecondOrderProbes:
    return SecondOrderProbes(
        model,
        ["curvature"],
        curvature,
        JacobianOptions(),
        NTKOptions(),
        ProbeDataOptions(loss_fn=lambda module, batch: module(batch).square().mean()),
        failures,
        warn=warn,
        strict=strict,
    )


def test_a_probe_estimated_over_its_memory_ratio_is_refused_before_its_graph_with_what_to_change() -> None:
    wide = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024))  # 2.1 M parameters
    optimizer = torch.optim.AdamW(wide.parameters())
    failures, warned = Failures(), []
    options = CurvatureOptions(max_memory_ratio=2.0, max_overhead_percent=10.0)
    probes = probes_of(wide, options, failures, warn=warned.append)
    for step in range(3):
        # Nothing of the family is written: no overhead of an event, no stretched cadence.
        assert probes.measure_due(wide, torch.randn(4, 1024), step, optimizer).measurements == []
    assert failures.raised == []  # a refusal is the option's decision: no failure for the end-of-run report
    (message,) = warned  # once: the family is off for the rest of the run
    assert message.startswith("SpectralMonitor: the curvature probe is off for this run: ")
    # 246 vectors of 2,099,200 float32 numbers (the basis at 128 products, the top-1 Ritz vector and the
    # working vectors), 1.92 GiB, with the parameters and AdamW's two moments (0.02 GiB in all): far over
    # twice a training step's 32 MiB.
    assert "estimated at 1.95 GiB" in message and "246 parameter-sized vectors of 2,099,200" in message
    for option in ("max_products=128", "blocks=[...], whole_model=False", "ProbeDataOptions(loss_fn=...)",
                   "max_memory_ratio=None"):  # fmt: skip
        assert option in message
    assert probes.families == []
    strict = probes_of(wide, options, lambda what: contextlib.nullcontext(), strict=True)
    with pytest.raises(ValueError, match="^the curvature probe is off for this run: "):
        strict.measure_due(wide, torch.randn(4, 1024), 0, optimizer)


def test_a_small_model_is_measured_whatever_its_ratio_and_a_large_one_when_allowed() -> None:
    small = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    failures = Failures()
    event = probes_of(small, CurvatureOptions(max_memory_ratio=2.0), failures).measure_due(
        small, torch.randn(4, 8), 0, None
    )
    assert not failures.raised and any(m.metric == "sharpness" for m in event.measurements)
    memory = estimate_curvature_memory(small, [8 * 16 + 16 + 16 + 1], CurvatureOptions(), None, 4 * 16 * 4)
    assert memory.probe_bytes > 2 * memory.step_bytes  # over the ratio, under the floor
    assert memory.probe_bytes < ALWAYS_ALLOWED_BYTES and not memory.refused(2.0)
    assert not memory.refused(None)


def test_the_full_preset_keeps_the_curvature_probe_under_its_overhead_and_memory_shares() -> None:
    curvature = MonitorOptions(preset="full").curvature
    assert (curvature.max_overhead_percent, curvature.max_memory_ratio) == (10.0, 2.0)
    assert MonitorOptions(preset="full").curvature is not curvature  # made anew for each monitor


class StretchedRun:
    """Curvature probes with a 10 % share, on a clock that moves only as told: 0.125 s per training step,
    5 s per curvature event (its loss)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clock = 0.0
        monkeypatch.setattr("spectral_monitor.core.second_order.time.perf_counter", lambda: self.clock)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.failures = Failures()
        self.events: list[int] = []
        self.intervals: dict[int, float] = {}

    def probes(self) -> SecondOrderProbes:
        def loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
            self.clock += 5.0
            return module(batch).square().mean()

        options = CurvatureOptions(every_n_steps=10, max_overhead_percent=10.0)
        data = ProbeDataOptions(loss_fn=loss)
        return SecondOrderProbes(self.model, ["curvature"], options, JacobianOptions(), NTKOptions(), data,
                                 self.failures)  # fmt: skip

    def train(self, probes: SecondOrderProbes, steps: range) -> None:
        for step in steps:
            for record in probes.measure_due(self.model, torch.randn(2, 4), step, None).measurements:
                if record.metric == "overhead_ms":
                    self.events.append(step)
                if record.metric == "every_n_steps":
                    self.intervals[step] = record.value
            self.clock += 0.125


def test_the_cadence_stretches_so_each_event_costs_at_most_its_share_of_training_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 10 %, an event may come once per 100 · 5 / (10 · 0.125) = 400 steps: the first step of the
    every-10 cadence at least 400 steps on, 409 after step 0, then 809. Each interval is written at the
    step after its event, the first training step timed since."""
    run = StretchedRun(monkeypatch)
    run.train(run.probes(), range(900))
    assert not run.failures.raised
    assert run.events == [0, 409, 809]
    assert run.intervals == {1: 400, 410: 400, 810: 400}
    # Amortised over the steps between them, the events took 10 % of the training time or less.
    pairs = zip(run.events[:-1], run.events[1:], strict=True)
    assert all(5.0 / ((later - event) * 0.125) <= 0.1 for event, later in pairs)


def test_a_resumed_run_keeps_the_stretched_cadence(monkeypatch: pytest.MonkeyPatch) -> None:
    run = StretchedRun(monkeypatch)
    first = run.probes()
    run.train(first, range(600))
    resumed = run.probes()
    assert resumed.load_state_dict(first.state_dict()) == []
    run.train(resumed, range(600, 900))
    assert run.events == [0, 409, 809]
