"""What the reliability suites share: the probe families to try, a deterministic fit, warnings collected.

A family enters every reliability suite (non-perturbation, fault injection, resume) through one line of
``FAMILY_CONFIGURATIONS``: the monitor arguments that turn it on alone, and the functions a fault can be
injected into (patched to raise).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from helpers.lightning_runs import fit, tensorboard_logger, trainer_for  # noqa: F401 (the suites import them from here)
from spectral_monitor.core.second_order import CurvatureOptions, JacobianOptions, NTKOptions


@dataclass(frozen=True)
class FamilyConfiguration:
    """One probe family as the reliability suites switch it on and break it.

    ``monitor_arguments``: what makes a ``SpectralMonitor`` measure this family alone. ``probe_entry_points``:
    ``"module:attribute"`` (or ``"module:Class.method"``) of functions the family's measurement goes through,
    each patched in turn to raise, from arming to computing; ``during_forward`` marks those called inside the
    training forward, where a failure must not reach the user's model.
    """

    family: str
    monitor_arguments: dict[str, Any]
    probe_entry_points: tuple[str, ...]
    during_forward: tuple[str, ...] = field(default=())


FAMILY_CONFIGURATIONS = (
    FamilyConfiguration(
        "attention",
        {"families": ["attention"], "metric_method": "krylov"},
        (
            "spectral_monitor.probes.attention:AttentionCapture.arm",
            "spectral_monitor.probes.attention:_captured_multi_head_attention",
            "spectral_monitor.core.attention_plan:attention_metrics",
        ),
        during_forward=("spectral_monitor.probes.attention:_captured_multi_head_attention",),
    ),
    FamilyConfiguration(
        "tokens",
        {"families": ["tokens"]},
        (
            "spectral_monitor.probes.residual:ResidualCapture.arm",
            "spectral_monitor.probes.residual:_batch_first",
            "spectral_monitor.core.families:token_metrics",
        ),
        during_forward=("spectral_monitor.probes.residual:_batch_first",),
    ),
    FamilyConfiguration(
        "weights",
        {"families": ["weights"]},
        (
            "spectral_monitor.probes.weights:WeightProbe.measure",
            "spectral_monitor.probes.weights:WeightProbe.distributions",
        ),
    ),
    FamilyConfiguration(
        "curvature",
        {"families": [], "curvature": CurvatureOptions(every_n_steps=1, max_products=8)},
        ("spectral_monitor.core.second_order:SecondOrderProbes._measure_curvature",),
    ),
    FamilyConfiguration(
        "jacobian",
        {"families": [], "jacobian": JacobianOptions(every_n_steps=1, max_iters=4)},
        ("spectral_monitor.core.second_order:SecondOrderProbes._measure_jacobian",),
    ),
    FamilyConfiguration(
        "ntk",
        {"families": [], "ntk": NTKOptions(every_n_steps=1, examples=4)},
        ("spectral_monitor.core.second_order:SecondOrderProbes._measure_ntk",),
    ),
)
"""Every family the monitor has; a new family is one more line here."""

ALL_FAMILIES = {
    "families": [
        family
        for configuration in FAMILY_CONFIGURATIONS
        for family in configuration.monitor_arguments["families"]
    ],
    "metric_method": "krylov",
    **{
        name: value
        for configuration in FAMILY_CONFIGURATIONS
        for name, value in configuration.monitor_arguments.items()
        if name not in ("families", "metric_method")
    },
}
"""Monitor arguments that turn every family on (attention on the Krylov path: it keeps warm state)."""

FAMILY_IDS = [configuration.family for configuration in FAMILY_CONFIGURATIONS]


@dataclass
class MonitorReports:
    """The monitor's warnings of one run, with how often each message came."""

    messages: list[str]

    def count(self, text: str) -> int:
        return sum(text in message for message in self.messages)

    def repeated(self) -> list[str]:
        return [message for message, times in Counter(self.messages).items() if times > 1]


@contextmanager
def monitor_reports() -> Iterator[MonitorReports]:
    """Collects every ``SpectralMonitor`` warning raised in the block, each occurrence (not deduplicated)."""
    reports = MonitorReports([])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield reports
    reports.messages += [str(w.message) for w in record if str(w.message).startswith("SpectralMonitor")]
