"""The plain loop refuses at its boundary what it could not honour later: a step an event file cannot store,
and a call from a second thread, which would interleave two steps' hooks on one model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from helpers.events import read_back
from helpers.models import TinyEncoder, hook_count

from spectral_monitor import Monitor

pytestmark = pytest.mark.usefixtures("one_thread")

LARGEST_STEP = 2**63 - 1  # Event.step is a protobuf int64


def tokens() -> torch.Tensor:
    return torch.randint(16, (2, 8), generator=torch.Generator().manual_seed(0))


def test_the_largest_int64_step_is_written_and_one_more_is_refused_naming_step(tmp_path: Path) -> None:
    model = TinyEncoder()
    with Monitor(model, tmp_path, every_n_steps=1, families=["weights"], preflight=False) as monitor:
        refused = r"^step must be an int in \[0, 9223372036854775807\], got 9223372036854775808$"
        with pytest.raises(ValueError, match=refused), monitor.step(2**63):
            model(tokens())
        with pytest.raises(ValueError, match="^step must be an int in"), monitor.step(-1):
            model(tokens())
        with monitor.step(LARGEST_STEP):
            model(tokens())
    steps = {event.step for event in read_back(tmp_path).Scalars("weights/spectral_norm/head")}
    assert steps == {LARGEST_STEP}


def test_a_step_from_a_second_thread_is_refused_and_leaves_nothing_on_the_model(tmp_path: Path) -> None:
    model = TinyEncoder()
    monitor = Monitor(model, tmp_path, every_n_steps=1, preflight=False)
    with monitor.step(0):
        model(tokens())
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            with monitor.step(1):
                model(tokens())
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    (error,) = errors
    assert "a thread other than the one that first called it" in str(error)
    assert hook_count(model) == 0
    with monitor.step(2):  # the first thread goes on
        model(tokens())
    monitor.close()
    assert hook_count(model) == 0
