"""The probe protocol's defaults: a family overrides only what it needs and is otherwise inert."""

from __future__ import annotations

from torch import nn

from spectral_monitor.probes.protocol import Probe
from spectral_monitor.records import Measurement


class _EveryOtherStep(Probe):
    name = "every_other_step"

    def __init__(self) -> None:
        self.armed = False

    def due(self, step: int) -> bool:
        return step % 2 == 0

    def arm(self, model: nn.Module) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False


def test_default_probe_is_due_every_step_and_measures_nothing() -> None:
    probe = Probe()
    assert all(probe.due(step) for step in range(5))
    assert probe.measure(0, nn.Linear(2, 2)) == []
    assert probe.state_dict() == {}
    probe.load_state_dict({"unknown": 1})


def test_family_keeps_its_own_cadence() -> None:
    probe = _EveryOtherStep()
    assert [step for step in range(6) if probe.due(step)] == [0, 2, 4]


def test_close_disarms_an_armed_family() -> None:
    probe = _EveryOtherStep()
    probe.arm(nn.Linear(2, 2))
    assert probe.armed
    probe.close()
    assert not probe.armed


def test_measure_returns_records() -> None:
    class _Constant(Probe):
        def measure(self, step: int, model: nn.Module) -> list[Measurement]:
            return [Measurement(step=step, family="constant", metric="one", layer="model", value=1.0)]

    assert [m.tag for m in _Constant().measure(3, nn.Linear(1, 1))] == ["constant/one/model"]
