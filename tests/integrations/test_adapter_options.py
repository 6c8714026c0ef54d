"""The three adapters take the same options, flat or whole, and refuse the same bad ones with the same
ValueError naming the option and what is allowed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from spectral_monitor import (
    CaptureOptions,
    JacobianOptions,
    Monitor,
    MonitorOptions,
    OutputOptions,
    SpectralMonitor,
)
from spectral_monitor.integrations.huggingface import SpectralMonitorCallback

ADAPTERS: dict[str, Callable[..., Any]] = {
    "SpectralMonitor": SpectralMonitor,
    "SpectralMonitorCallback": SpectralMonitorCallback,
    # The run directory is only written on the first step, which these tests never take.
    "Monitor": lambda **given: Monitor(nn.Linear(2, 2), Path("never-written"), **given),
}

BAD = {
    "unknown name": ({"every_n_step": 3}, r"every_n_step is not an option of {owner} \(did you mean "
                     r"every_n_steps\?\); the options are options .* every_n_steps, families, capture"),
    "bad top-level value": ({"every_n_steps": 0}, r"every_n_steps must be an int >= 1, got 0"),
    "bad grouped value": ({"max_sequences": 0}, r"max_sequences must be an int >= 1, got 0"),
    "bad choice": ({"metric_method": "fast"}, r"metric_method must be one of \('auto', 'exact', 'krylov'\)"),
    "group whole and by field": (
        {"outputs": OutputOptions(), "per_head": True},
        r"outputs is given whole and per_head of it as keywords: give one or the other",
    ),
    "options and keywords": (
        {"options": MonitorOptions(), "every_n_steps": 5},
        r"options is given whole and every_n_steps as keywords: give one or the other",
    ),
    "options not options": ({"options": {"every_n_steps": 5}}, r"options must be a MonitorOptions or None"),
}  # fmt: skip


@pytest.mark.parametrize("adapter", list(ADAPTERS))
@pytest.mark.parametrize("case", list(BAD))
def test_every_adapter_refuses_the_same_bad_option_with_the_same_value_error(adapter: str, case: str) -> None:
    given, message = BAD[case]
    with pytest.raises(ValueError, match=message.format(owner=adapter)):
        ADAPTERS[adapter](**given)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_flat_keywords_and_whole_options_are_the_same_options_in_every_adapter(adapter: str) -> None:
    flat = ADAPTERS[adapter](every_n_steps=10, families=["attention"], per_head=True, max_sequences=1)
    whole = MonitorOptions(
        every_n_steps=10,
        families=["attention"],
        capture=CaptureOptions(max_sequences=1),
        outputs=OutputOptions(per_head=True),
    )
    assert flat.options == whole
    assert ADAPTERS[adapter](options=whole).options is whole
    assert flat.options.outputs.histograms is True  # the preset fills what was left at None


@pytest.mark.parametrize("preset", ["standard", "full"])
def test_a_copy_of_the_options_measures_the_same_families(preset: str) -> None:
    """``dataclasses.replace`` (or ``MonitorOptions(**vars(options))``) makes the same options again: an
    opt-in probe that was off stays off, one that was on stays on with its options."""
    options = MonitorOptions(preset=preset)
    copy = dataclasses.replace(options, every_n_steps=10)
    assert copy.families == options.families
    assert (copy.curvature, copy.jacobian, copy.ntk) == (options.curvature, options.jacobian, options.ntk)
    assert options.jacobian is None and options.ntk is None
    assert (options.curvature is None) == (preset == "standard")
    with_jacobian = MonitorOptions(jacobian=JacobianOptions(every_n_steps=7))
    assert dataclasses.replace(with_jacobian).families == ("attention", "tokens", "weights", "jacobian")
    assert dataclasses.replace(with_jacobian).jacobian == JacobianOptions(every_n_steps=7)
    with pytest.raises(ValueError, match="families names the opt-in family 'jacobian'"):
        MonitorOptions(families=["attention", "jacobian"])
