"""The Hugging Face Trainer callback and the plain-loop ``Monitor`` in real two-process runs: ``torchrun
--nproc_per_node 2`` on CPU (gloo), the Trainer's own DDP, a plain loop around ``DistributedDataParallel``
and one around FSDP2 (``fully_shard``). Every rank measures and takes part in the collectives (a rank that
skipped one would leave the other waiting until the 60 s timeout), rank 0 alone writes, once; and what it
writes equals a one-process run on the same micro-batch: the one process trains on both ranks' batches
concatenated (the ranks' averaged update) and measures the first sequences, which are rank 0's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.events import read_back, scalar_series

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.multiprocess, pytest.mark.slow]

REPOSITORY = Path(__file__).resolve().parents[2]
SCRIPT = REPOSITORY / "tests" / "helpers" / "distributed_loops.py"
RUN_TIMEOUT_S = 300  # two interpreters import torch and transformers on a loaded 2-core machine
FAMILY_PREFIXES = ("attention/", "tokens/", "weights/", "alerts/")

from helpers.distributed_loops import SAVE_STEP, STEPS, single_process_loop  # noqa: E402


def torchrun(tmp_path: Path, mode: str, processes: int = 2) -> None:
    """Runs the script's ``mode`` under torchrun with ``processes`` processes (1: plain ``python``)."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable]
    if processes > 1:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    try:
        finished = subprocess.run(
            [*command, str(SCRIPT), mode, str(tmp_path)],
            env=environment,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun {mode} did not finish in {RUN_TIMEOUT_S} s (deadlock?):\n{error.stderr}")
    assert finished.returncode == 0, finished.stderr[-4000:]


def monitor_scalars(directory: Path) -> dict[str, list]:
    series = scalar_series(read_back(directory))
    return {tag: values for tag, values in series.items() if tag.startswith(FAMILY_PREFIXES)}


def monitor_event_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("events.out.tfevents.*"))


def assert_written_once_by_rank_zero_as_one_process_would(
    tmp_path: Path, single: Path, first_step: int
) -> dict[str, list]:
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for saved in ranks:  # every rank measured every step
        assert saved["state"]["logging_steps_done"] == STEPS
    (written,) = monitor_event_files(tmp_path / "tb")  # one file: rank 0's
    got, expected = monitor_scalars(written.parent), monitor_scalars(single)
    assert any(tag.startswith("attention/entropy/") for tag in got)
    assert any(tag.startswith("tokens/") for tag in got)
    assert sorted(got) == sorted(expected)
    for tag, series in expected.items():
        assert [step for step, _ in got[tag]] == [step for step, _ in series], tag
        for (step, ours), (_, theirs) in zip(got[tag], series, strict=True):
            # The first step measures the same weights on the same sequences; later ones follow an update
            # whose gradient was summed in another order (across ranks), so the weights may differ in the
            # last bits, which a few steps of training amplify a little.
            tolerance = 1e-6 if step == first_step else 1e-5
            assert ours == pytest.approx(theirs, rel=tolerance, abs=tolerance), (tag, step)
    return got


def test_the_trainer_under_torchrun_writes_once_from_rank_zero_what_one_process_measures(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torchrun(tmp_path, "trainer")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert ranks[0]["run_directory"] == str(tmp_path / "tb") and ranks[1]["run_directory"] is None
    checkpoint = tmp_path / f"checkpoint-{SAVE_STEP}"
    assert [path.name for path in checkpoint.glob("spectral_monitor*")] == ["spectral_monitor.pt"]
    saved = torch.load(checkpoint / "spectral_monitor.pt", weights_only=True)
    assert saved["logging_steps_done"] == SAVE_STEP

    single = tmp_path / "single"
    single.mkdir()
    torchrun(single, "trainer_single", processes=1)
    assert_written_once_by_rank_zero_as_one_process_would(tmp_path, single / "tb", first_step=1)


@pytest.mark.parametrize("mode", ["loop_ddp", "loop_fsdp2"])
def test_the_plain_loop_under_two_processes_writes_once_from_rank_zero_what_one_process_measures(
    tmp_path: Path, mode: str
) -> None:
    torchrun(tmp_path, mode)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert [saved["writes"] for saved in ranks] == [True, False]
    single = tmp_path / "single"
    state = single_process_loop(single)
    assert state["logging_steps_done"] == STEPS
    got = assert_written_once_by_rank_zero_as_one_process_would(tmp_path, single, first_step=0)
    # The weights were measured whole, under their plain names, also when sharded.
    assert "weights/spectral_norm/blocks.0.attention.q" in got
