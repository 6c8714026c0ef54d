"""The monitor under DDP and FSDP: two CPU processes on gloo, each run a script under a hard timeout.

Each run is a subprocess (tests/distributed_run.py) with a free port, collectives that time out after 60 s
and a wall-clock limit, so a deadlock fails the test instead of hanging CI. What they prove: under
Lightning ``ddp`` and ``ddp_spawn`` every family works with several monitors of different families and
cadences at once (each rank joins whatever the others do), rank 0 alone writes, and what it writes is rank
0's measurement; under FSDP the weights gathered by ``full_parameters`` measure as the unsharded model's,
attention and blocks are captured through wrapped units under their plain names, and the collectives of
``spectral_monitor.distributed`` reduce as documented.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

from spectral_monitor.demo import DemoTransformer
from spectral_monitor.distributed import any_rank, full_parameters, is_distributed, mean_over_ranks_
from spectral_monitor.metrics import attention_metrics
from spectral_monitor.probes import AttentionCapture, ResidualCapture, WeightProbe

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("distributed_run.py")
REPOSITORY = SCRIPT.parent.parent
RUN_TIMEOUT_S = 240  # a loaded 2-core machine needs ~50 s: three interpreters import torch and Lightning
FAMILY_PREFIXES = ("attention/", "tokens/", "weights/")

sys.path.insert(0, str(SCRIPT.parent))
from distributed_run import MODEL, STEPS, rank_batches  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(tmp_path: Path, *arguments: str) -> None:
    environment = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    try:
        finished = subprocess.run(
            [sys.executable, str(SCRIPT), arguments[0], str(tmp_path), *arguments[1:]],
            env=environment,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{arguments[0]} run did not finish in {RUN_TIMEOUT_S} s (deadlock?):\n{error.stderr}")
    assert finished.returncode == 0, finished.stderr[-4000:]


def logging_steps(every_n_steps: int, log_first_step: bool = True) -> list[int]:
    return [s for s in range(STEPS) if (s + 1) % every_n_steps == 0 or (log_first_step and s == 0)]


def monitor_tags(path: Path) -> set[str]:
    tags = set()
    for line in path.read_text().splitlines():
        tags.update(tag for tag in json.loads(line)["metrics"] if tag.startswith(FAMILY_PREFIXES))
    return tags


# Several monitors at once, of disjoint families (so disjoint tags) and different cadences: whatever one
# does on a step, every rank does with it.
MONITOR_SETS = {
    "ddp": [
        {"families": ["attention"], "every_n_steps": 1, "figures_every_n_logs": 1},
        {"families": ["tokens"], "every_n_steps": 2},
        {"families": ["weights"], "every_n_steps": 3, "figures_every_n_logs": 2},
    ],
    "ddp_spawn": [
        {"families": ["weights", "attention"], "every_n_steps": 2, "figures_every_n_logs": 1},
        {"families": ["tokens"], "every_n_steps": 5, "log_first_step": False},
    ],
}


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_ddp_every_family_written_once_by_rank_zero(tmp_path: Path, strategy: str) -> None:
    monitors = MONITOR_SETS[strategy]
    run(tmp_path, strategy, json.dumps(monitors))

    # Rank 0 alone writes: rank 1's loggers got Lightning's own metrics but nothing of the monitor's.
    assert monitor_tags(tmp_path / "rank0.jsonl")
    assert monitor_tags(tmp_path / "rank1.jsonl") == set()
    event_files = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files

    accumulator = event_accumulator.EventAccumulator(str(event_files[0]), size_guidance={"scalars": 0})
    accumulator.Reload()
    scalar_tags = accumulator.Tags()["scalars"]
    for monitor in monitors:
        expected_steps = logging_steps(monitor["every_n_steps"], monitor.get("log_first_step", True))
        for family in monitor["families"]:
            tags = [tag for tag in scalar_tags if tag.startswith(f"{family}/")]
            assert tags, f"nothing of {family} was written"
            for tag in tags:  # each logging step once: no rank wrote a second copy
                steps = [event.step for event in accumulator.Scalars(tag)]
                if "head_diversity" in tag:  # its own cadence: every few logging steps
                    assert len(set(steps)) == len(steps) and set(steps) <= set(expected_steps), tag
                    continue
                assert steps == expected_steps, tag
    assert "weights/spectral_norm/blocks.0.attention.q" in scalar_tags

    # What rank 0 wrote is rank 0's measurement: its first batch holds rows 0 and 2.
    if any("attention" in monitor["families"] for monitor in monitors):
        model = DemoTransformer(**MODEL)
        with AttentionCapture(model).armed() as recording:
            model(rank_batches()[[0, 2]])
        probs = recording.captured[0].probs()
        expected = attention_metrics(probs)["entropy"].mean().item()
        written = accumulator.Scalars("attention/entropy/blocks.0.attention")[0]
        assert written.step == 0
        assert written.value == pytest.approx(expected, rel=1e-5)
        with AttentionCapture(model).armed() as recording:
            model(rank_batches()[[1, 3]])
        rank_one = attention_metrics(recording.captured[0].probs())["entropy"].mean().item()
        assert written.value != pytest.approx(rank_one, rel=1e-5)  # the check can tell the ranks apart


def test_fsdp_and_fsdp2_probes_see_the_unsharded_model_under_plain_names(tmp_path: Path) -> None:
    run(tmp_path, "fsdp")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]

    model = DemoTransformer(**MODEL)
    expected_weights = {record.tag: record.value for record in WeightProbe(model).measure(0)}
    for rank, saved in enumerate(ranks):
        assert saved["weights"].keys() == expected_weights.keys()  # no "_fsdp_wrapped_module." anywhere
        for weights in (saved["weights"], saved["weights_fsdp2"]):
            assert weights.keys() == expected_weights.keys()
            for tag, value in expected_weights.items():
                assert weights[tag] == pytest.approx(value, rel=1e-5, abs=1e-7), tag
        # Outside full_parameters the shards are no matrices: skipped, not measured wrong.
        assert not [tag for tag in saved["weights_outside_full_parameters"] if ".attention." in tag]

        attention, residual = AttentionCapture(model), ResidualCapture(model)
        with attention.armed() as attention_recording, residual.armed() as residual_recording:
            model(rank_batches()[rank : rank + 3 : 2])
        assert list(saved["attention"]) == ["blocks.0.attention", "blocks.1.attention"]
        for capture in attention_recording.captured:
            saved_probs = saved["attention"][capture.layer]
            torch.testing.assert_close(saved_probs, capture.probs(), rtol=1e-5, atol=1e-6)
        assert list(saved["tokens"]) == ["blocks.0", "blocks.1"]
        for sample in residual_recording.states:
            torch.testing.assert_close(saved["tokens"][sample.layer], sample.states, rtol=1e-5, atol=1e-6)

        mean, filled = saved["mean"]
        assert mean.item() == 1.5  # ranks held 1 and 2
        torch.testing.assert_close(filled, torch.full((2, 2), 5.0))
        assert saved["any_rank"] == (True, False)


def test_collectives_are_identities_without_a_process_group() -> None:
    assert not is_distributed()
    tensors = [torch.tensor([3.0])]
    assert mean_over_ranks_(tensors)[0].item() == 3.0
    assert any_rank(True) and not any_rank(False)
    model = DemoTransformer(**MODEL)
    before = [parameter.clone() for parameter in model.parameters()]
    with full_parameters(model):
        pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
