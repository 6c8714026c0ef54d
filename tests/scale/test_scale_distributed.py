"""The monitor under DDP and FSDP: two CPU processes on gloo, each run a script under a hard timeout.

Each run is a subprocess (tests/helpers/distributed_run.py) with a free port, collectives that time out
after 60 s and a wall-clock limit, so a deadlock fails the test instead of hanging CI. What they prove: under
Lightning ``ddp`` and ``ddp_spawn`` every family (curvature, Jacobian and NTK included) works with several
monitors of different families and cadences at once, some with ``stop_on`` (each rank joins whatever the
others do), rank 0 alone writes, and what it writes is rank 0's measurement; the curvature under DDP is
that of the global batch (float64, against a single process on the concatenated batch), and a ``stop_on``
rule that fires on one rank's data only stops both ranks after the same step; under FSDP the weights
gathered by ``full_parameters`` measure as the unsharded model's, attention and blocks are captured
through wrapped units under their plain names, the curvature probes refuse the sharded model naming DDP,
and the collectives of ``spectral_monitor.distributed`` reduce as documented (Lanczos runs whose ranks
were given different tolerances still stop together).
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
from spectral_monitor.distributed import (
    any_rank,
    full_parameters,
    is_distributed,
    mean_over_ranks_,
    on_every_rank,
    sharded_parameters,
)
from spectral_monitor.metrics import attention_metrics
from spectral_monitor.probes import AttentionCapture, ResidualCapture, WeightProbe
from spectral_monitor.probes.curvature import measure_curvature

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.multiprocess, pytest.mark.slow]

REPOSITORY = Path(__file__).resolve().parents[2]
SCRIPT = REPOSITORY / "tests" / "helpers" / "distributed_run.py"
RUN_TIMEOUT_S = 240  # a loaded 2-core machine needs ~50 s: three interpreters import torch and Lightning
FAMILY_PREFIXES = ("attention/", "tokens/", "weights/", "curvature/", "jacobian/", "ntk/", "alerts/")
OPT_IN = ("curvature", "jacobian", "ntk")

from helpers.distributed_run import (  # noqa: E402
    CURVATURE_TOLERANCES,
    MODEL,
    SGD_LEARNING_RATE,
    STEPS,
    rank_batches,
    shard_loss,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
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
    return finished


def logging_steps(every_n_steps: int, log_first_step: bool = True) -> list[int]:
    return [s for s in range(STEPS) if (s + 1) % every_n_steps == 0 or (log_first_step and s == 0)]


def probe_steps(every_n_steps: int = 100, schedule: str = "linear", **_: object) -> list[int]:
    """Steps of an opt-in family: 0, (s + 1) % every == 0, and with "log" s + 1 a power of two < every."""
    early = [s for s in range(STEPS) if schedule == "log" and s + 1 < every_n_steps and (s + 1) & s == 0]
    return sorted(set(logging_steps(every_n_steps)) | set(early))


def expected_steps(monitor: dict, family: str, tag: str) -> list[int]:
    if family not in OPT_IN:
        steps = logging_steps(monitor["every_n_steps"], monitor.get("log_first_step", True))
        return steps[1:] if "_growth/" in tag else steps  # a growth ratio starts on the second
    steps = probe_steps(**monitor.get(family, {}))
    # The share of a step's time needs the length of a step before it; AdamW's sharpness and edge need v̂.
    after_first = tag.startswith((f"{family}/overhead_percent/", "curvature/sharpness"))
    return [s for s in steps if s > 0] if after_first else steps


def monitor_tags(path: Path) -> set[str]:
    tags = set()
    for line in path.read_text().splitlines():
        tags.update(tag for tag in json.loads(line)["metrics"] if tag.startswith(FAMILY_PREFIXES))
    return tags


# Several monitors at once, of disjoint families (so disjoint tags) and different cadences: whatever one
# does on a step, every rank does with it.
MONITOR_SETS = {
    "ddp": [
        {
            "families": ["attention"],
            "every_n_steps": 1,
            "figures_every_n_logs": 1,
            "head_diversity_every_n_logs": 1,
        },
        {"families": ["tokens"], "every_n_steps": 2, "stop_on": ["token_collapse"]},
        {"families": ["weights"], "every_n_steps": 3, "figures_every_n_logs": 2},
        {
            "families": [],
            "every_n_steps": 4,
            "curvature": {"every_n_steps": 2, "top_k": 2, "min_eigenvalue": True, "trace_products": 6},
            "jacobian": {"every_n_steps": 3},
            "ntk": {"every_n_steps": 5, "examples": 2},
            "stop_on": ["edge_of_stability", "non_finite"],
        },
    ],
    "ddp_spawn": [
        {
            "families": ["weights", "attention"],
            "every_n_steps": 2,
            "figures_every_n_logs": 1,
            "head_diversity_every_n_logs": 1,
        },
        {"families": ["tokens"], "every_n_steps": 5, "log_first_step": False},
        {
            "families": [],
            "every_n_steps": 6,
            "curvature": {"every_n_steps": 3, "schedule": "log"},
            "stop_on": ["non_finite"],
        },
    ],
}


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_ddp_every_family_written_once_by_rank_zero(tmp_path: Path, strategy: str) -> None:
    monitors = MONITOR_SETS[strategy]
    run(tmp_path, strategy, json.dumps(monitors))

    # Rank 0 alone writes: rank 1's loggers got Lightning's own metrics but nothing of the monitor's.
    assert monitor_tags(tmp_path / "rank0.jsonl")
    assert monitor_tags(tmp_path / "rank1.jsonl") == set()
    # One run directory: Lightning's event file and the monitors' own, all written by rank 0's process.
    event_files = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    (run_directory,) = {path.parent for path in event_files}
    lightning_files = [path for path in event_files if not path.name.endswith(".spectral_monitor")]
    assert len(lightning_files) == 1, event_files
    assert len({path.name.split(".")[5] for path in event_files}) == 1, event_files  # one process id

    accumulator = event_accumulator.EventAccumulator(str(run_directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    scalar_tags = accumulator.Tags()["scalars"]
    for monitor in monitors:
        for family in [*monitor["families"], *(family for family in OPT_IN if family in monitor)]:
            tags = [tag for tag in scalar_tags if tag.startswith(f"{family}/")]
            assert tags, f"nothing of {family} was written"
            for tag in tags:  # each logging step once: no rank wrote a second copy
                steps = [event.step for event in accumulator.Scalars(tag)]
                assert steps == expected_steps(monitor, family, tag), tag
    assert "weights/spectral_norm/blocks.0.attention.q" in scalar_tags
    assert "curvature/hessian_eigenvalue_1/model" in scalar_tags
    assert [tag for tag in scalar_tags if tag.startswith("jacobian/")] or strategy == "ddp_spawn"
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert [saved["global_step"] for saved in ranks] == [STEPS, STEPS]  # no stop_on rule fired

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
        assert saved["any_rank"] == [True, False]
        assert saved["on_every_rank"] == [True, False, False]

        for message in saved["refusals"]["fsdp"]:  # measure_curvature, SecondOrderProbes
            assert message is not None and "FSDP" in message and "strategy='ddp'" in message
        assert saved["refusals"]["fsdp"][1].startswith("SpectralMonitor's curvature/jacobian probes")
        assert all(message and "DDP" in message for message in saved["refusals"]["fsdp2"])

    # Each rank gave only its own shard and a tolerance of its own (1e-2 on rank 0, 1e-9 on rank 1): both
    # ran the same products, agreed on when to stop, and measured the concatenated batch's curvature.
    curvature = [saved["curvature"] for saved in ranks]
    assert curvature[0]["products"] == curvature[1]["products"]
    assert curvature[0]["eigenvalues"] == pytest.approx(curvature[1]["eigenvalues"], rel=1e-12)
    model = DemoTransformer(**MODEL).double()
    whole = measure_curvature(  # the ranks' random start and trace probes: the generator they were given
        model,
        lambda: shard_loss(model, [0, 1, 2, 3]),
        top_k=2,
        trace_products=12,
        tol=1e-9,
        max_products=400,
        generator=torch.Generator().manual_seed(0),
    )
    for saved in curvature:
        assert saved["converged"]
        assert saved["eigenvalues"] == pytest.approx(whole.eigenvalues.tolist(), rel=1e-8)
        assert saved["unseeded_eigenvalues"] == pytest.approx(whole.eigenvalues.tolist(), rel=1e-8)
        assert saved["trace"] == pytest.approx(float(whole.trace.mean[0]), rel=1e-8)
    alone = measure_curvature(
        model, lambda: shard_loss(model, [0, 1, 2, 3]), top_k=2, tol=CURVATURE_TOLERANCES[0], max_products=400
    )
    assert alone.products < curvature[0]["products"]  # rank 0 alone would have stopped (and hung) earlier


# One run, two tests: float64 and SGD, curvature at step 0, weights every step; rank 1's own copy of a
# weight made NaN at step 3; stop_on the non_finite alert.
CURVATURE_MONITOR = {
    "families": ["weights"],
    "every_n_steps": 1,
    "figures_every_n_logs": 0,
    "curvature": {"every_n_steps": 100, "top_k": 2, "trace_products": 12, "tol": 1e-6, "max_products": 400},
    "stop_on": ["non_finite"],
}
NAN_STEP = 3


@pytest.fixture(scope="module")
def ddp_curvature_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    output = tmp_path_factory.mktemp("ddp_curvature")
    options = {"precision": "64-true", "optimizer": "sgd", "nan": [1, NAN_STEP]}
    finished = run(output, "ddp", json.dumps([CURVATURE_MONITOR]), json.dumps(options))
    return output, finished.stderr


def written_scalars(output: Path) -> event_accumulator.EventAccumulator:
    (run_directory,) = {path.parent for path in (output / "tb").rglob("events.out.tfevents.*")}
    accumulator = event_accumulator.EventAccumulator(str(run_directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator


def test_ddp_sharpness_is_the_single_process_sharpness_of_the_concatenated_batch(
    ddp_curvature_run: tuple[Path, str],
) -> None:
    output, _ = ddp_curvature_run
    written = {
        metric: written_scalars(output).Scalars(f"curvature/{metric}/model")
        for metric in ("sharpness", "hessian_eigenvalue_2", "hessian_trace", "sharpness_threshold")
    }
    assert all([event.step for event in events] == [0] for events in written.values())

    # Rank r's probe batch is its own first batch, rows r and r + 2; together, rows 0 to 3.
    options = CURVATURE_MONITOR["curvature"]
    model = DemoTransformer(**MODEL).double()
    whole = measure_curvature(
        model,
        lambda: shard_loss(model, [0, 1, 2, 3]),
        top_k=2,
        trace_products=12,
        tol=1e-9,
        max_products=options["max_products"],
        optimizer=torch.optim.SGD(model.parameters(), lr=SGD_LEARNING_RATE),
        generator=torch.Generator().manual_seed(0),  # the second-order probes' own, as they start
    )
    assert written["sharpness"][0].value == pytest.approx(whole.sharpness, rel=1e-4)
    assert written["hessian_eigenvalue_2"][0].value == pytest.approx(float(whole.eigenvalues[1]), rel=1e-4)
    assert written["hessian_trace"][0].value == pytest.approx(float(whole.trace.mean[0]), rel=1e-4)
    assert written["sharpness_threshold"][0].value == pytest.approx(2 / SGD_LEARNING_RATE)
    # ... and not the sharpness of rank 0's shard alone, which the check tells apart.
    shard = measure_curvature(model, lambda: shard_loss(model, [0, 2]), tol=1e-9, max_products=400)
    assert abs(shard.sharpness / whole.sharpness - 1) > 1e-2


def test_ddp_stop_on_a_rule_fired_on_one_rank_stops_every_rank_after_the_same_step(
    ddp_curvature_run: tuple[Path, str],
) -> None:
    output, stderr = ddp_curvature_run
    ranks = [torch.load(output / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    # Both stopped after step 3 (4 optimizer steps of 6): had rank 0 gone on alone, its next gradient
    # all-reduce would have waited for rank 1 until the 60 s timeout failed the run.
    assert [saved["global_step"] for saved in ranks] == [NAN_STEP + 1, NAN_STEP + 1]
    (rank_zero_alerts,), (rank_one_alerts,) = (saved["alerts"] for saved in ranks)
    assert rank_zero_alerts["history"] == []  # rank 0's own weights and batch stayed finite
    fired = [event for event in rank_one_alerts["history"] if event["kind"] == "fired"]
    assert {event["rule"] for event in rank_one_alerts["history"]} == {"non_finite"}
    assert {event["step"] for event in fired} == {NAN_STEP}
    assert "blocks.0.mlp.0" in {event["layer"] for event in fired}  # the weight made NaN, where it began
    subjects = [(event["layer"], event["head"]) for event in fired]
    assert len(subjects) == len(set(subjects)) == rank_one_alerts["fired"]["non_finite"]  # each fired once
    assert "stopping training after step 3: non_finite fired (non_finite on another rank's data)" in stderr
    steps = [event.step for event in written_scalars(output).Scalars("weights/spectral_norm/blocks.0.mlp.0")]
    assert steps == list(range(NAN_STEP + 1))


def test_collectives_are_identities_without_a_process_group() -> None:
    assert not is_distributed()
    tensors = [torch.tensor([3.0])]
    assert mean_over_ranks_(tensors)[0].item() == 3.0
    assert any_rank([True, False]) == [True, False]
    flags = torch.tensor([True, False])
    assert torch.equal(on_every_rank(flags), flags)
    model = DemoTransformer(**MODEL)
    assert sharded_parameters(model) == []
    before = [parameter.clone() for parameter in model.parameters()]
    with full_parameters(model):
        pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
