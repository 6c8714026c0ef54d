"""A shortened soak (benchmarks/soak.py): memory, live tensors and file handles stay flat; nothing is left.

The full 2,000-step soak is the script itself (its numbers are in docs/RELIABILITY.md); this runs the same
function for 300 steps so every CI run checks it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

SOAK_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_300_steps_with_every_family_every_10_steps_leave_resources_flat(tmp_path: Path) -> None:
    result = load_soak().run_soak(steps=300, every_n_steps=10, sample_every=30, logdir=tmp_path)

    assert not result.failures, result.failures
    assert result.tensor_growth <= 0 and result.descriptor_growth <= 0
    assert result.left_on_model == 0 and result.reused_model_matches_fresh_copy
    assert [sample.step for sample in result.samples][-1] == 300
    assert list(tmp_path.rglob("events.out.tfevents*"))  # it did write
