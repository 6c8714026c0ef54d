"""A run directory the monitor cannot write (here a path under a file: ENOTDIR; a read-only file system
fails the same way) is reported once while training goes on, then listed in the end-of-run report: the
preflight's write and the steps' writes are one problem, not two."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.models import TinyEncoder

from spectral_monitor import Monitor

pytestmark = pytest.mark.usefixtures("one_thread")


def monitor_warnings(run: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in record if str(w.message).startswith("SpectralMonitor")]


def test_the_plain_loop_reports_an_unwritable_run_directory_once(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    model = TinyEncoder()
    monitor = Monitor(model, tmp_path / "a_file" / "run", every_n_steps=1, families=["weights"])

    def train() -> None:
        for step in range(3):
            with monitor.step(step):
                model(torch.zeros(2, 8, dtype=torch.long))
        monitor.close()

    failure, end_of_run = monitor_warnings(train)
    assert failure.startswith("SpectralMonitor: writing to TensorBoardSink failed with SinkError(")
    assert "Not a directory" in failure
    assert end_of_run.startswith(
        "SpectralMonitor: end of the run; lost to failures: writing to TensorBoardSink"
    )


@pytest.mark.slow
def test_the_hugging_face_callback_reports_an_unwritable_log_dir_once(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from helpers.huggingface_runs import BATCH, hf_train, trainer_gpt2, training_arguments

    from spectral_monitor.integrations.huggingface import SpectralMonitorCallback

    (tmp_path / "a_file").write_text("")
    monitor = SpectralMonitorCallback(log_dir=tmp_path / "a_file" / "run", every_n_steps=1)
    arguments = training_arguments(tmp_path / "hf", logging_steps=1)
    messages = monitor_warnings(lambda: hf_train(trainer_gpt2(), arguments, monitor, count=3 * BATCH))
    failures = [message for message in messages if "failed with" in message]
    assert len(failures) == 1 and "Not a directory" in failures[0]
    assert sum(message.startswith("SpectralMonitor: end of the run") for message in messages) == 1
