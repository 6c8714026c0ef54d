"""The plain-loop API, :class:`spectral_monitor.Monitor`: a loop on the demo model writes the tags and values
the Lightning callback writes on the same model and batches; a failing step leaves nothing behind; a
``stop_on`` rule reaches the loop; the loop's own scalars and the monitor's are one TensorBoard run."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.events import read_back, scalar_series
from helpers.models import hook_count
from helpers.plain_loop_runs import DATA, MODEL, demo_batches, demo_loss, train_in_a_plain_loop
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from spectral_monitor import AlertConfig, CurvatureOptions, Monitor, ProbeDataOptions, Rule, SpectralMonitor
from spectral_monitor.alerts import Condition
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.demo.model import IGNORE_INDEX

pytestmark = pytest.mark.usefixtures("one_thread")

ENTROPY = "attention/entropy/blocks.0.attention"


def monitor_events(logdir: Path) -> event_accumulator.EventAccumulator:
    """The monitor's own event file of ``logdir`` (not the Lightning logger's), read back."""
    (events,) = logdir.glob("*.spectral_monitor")
    return read_back(events)


@pytest.mark.slow
def test_a_plain_loop_writes_the_tags_and_values_of_the_lightning_callback(tmp_path: Path) -> None:
    """Same model init, batches, optimizer and steps: every tag of every kind is the callback's, and every
    scalar and histogram equals the callback's. At the first step both measure the same weights and the
    same forward, so the values are identical as written (float32). Later steps follow two trajectories,
    each AdamW applied to the same gradients, one through Lightning's closure: they agree to the last bit
    on this CPU (max abs difference 0.0 at every step); the tolerance leaves room only for a platform whose
    kernels sum in a different order between the two calls."""
    trainer = pl.Trainer(
        max_steps=DATA["num_batches"],
        logger=TensorBoardLogger(tmp_path / "lightning", name="", version=""),
        callbacks=[SpectralMonitor(every_n_steps=2)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(DemoTransformer(**MODEL), datamodule=SyntheticDataModule(**DATA))
    train_in_a_plain_loop(tmp_path / "plain", every_n_steps=2)

    lightning, plain = monitor_events(tmp_path / "lightning"), monitor_events(tmp_path / "plain")
    for kind in ("scalars", "histograms", "images", "tensors"):
        assert sorted(plain.Tags()[kind]) == sorted(lightning.Tags()[kind]), kind
    assert len(plain.Tags()["scalars"]) > 100 and plain.Tags()["images"] and plain.Tags()["tensors"]
    assert [event.step for event in plain.Scalars(ENTROPY)] == [0, 1, 3, 5]
    for tag in lightning.Tags()["scalars"]:
        expected, got = lightning.Scalars(tag), plain.Scalars(tag)
        assert [event.step for event in got] == [event.step for event in expected], tag
        assert got[0].value == expected[0].value or (got[0].value != got[0].value), tag  # NaN is NaN
        for ours, theirs in zip(got[1:], expected[1:], strict=True):
            assert ours.value == pytest.approx(theirs.value, rel=1e-5, abs=1e-6, nan_ok=True), tag
    for tag in lightning.Tags()["histograms"]:
        expected, got = lightning.Histograms(tag), plain.Histograms(tag)
        assert [event.step for event in got] == [event.step for event in expected], tag
        assert got[0].histogram_value == expected[0].histogram_value, tag
    for tag in lightning.Tags()["tensors"]:  # the preflight's and the alerts' text
        assert [event.tensor_proto for event in plain.Tensors(tag)] == [
            event.tensor_proto for event in lightning.Tensors(tag)
        ], tag


def test_a_failing_step_leaves_nothing_armed_and_its_exception_untouched(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    batches = demo_batches()
    hooks_before = hook_count(model)
    error = RuntimeError("the loss went wrong")
    with Monitor(model, tmp_path, every_n_steps=1, families=["attention", "tokens"]) as monitor:
        with pytest.raises(RuntimeError) as raised, monitor.step(0, batch=batches[0]) as logging:
            assert logging
            demo_loss(model, batches[0])
            assert hook_count(model) > hooks_before  # armed during the forward's block
            raise error
        assert raised.value is error
        assert (
            raised.traceback[-1].name
            == test_a_failing_step_leaves_nothing_armed_and_its_exception_untouched.__name__
        )
        assert hook_count(model) == hooks_before
        with monitor.step(1, batch=batches[1]):
            loss = demo_loss(model, batches[1])
        assert hook_count(model) == hooks_before  # disarmed when the block exits, before the backward
        loss.backward()
    steps = [event.step for event in monitor_events(tmp_path).Scalars(ENTROPY)]
    assert steps == [1]  # the failed step wrote nothing


def test_a_step_retried_after_its_block_raised_is_measured(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    batches = demo_batches()
    with Monitor(model, tmp_path, every_n_steps=1, families=["attention"]) as monitor:
        with pytest.raises(MemoryError), monitor.step(0, batch=batches[0]) as logging:
            assert logging
            raise MemoryError  # as an out-of-memory forward would
        with monitor.step(0, batch=batches[0]) as logging:
            demo_loss(model, batches[0])
        assert logging
        with monitor.step(0, batch=batches[1]) as logging:  # a further micro-batch of the retried step
            demo_loss(model, batches[1])
        assert not logging
    assert [event.step for event in monitor_events(tmp_path).Scalars(ENTROPY)] == [0]


def test_a_step_called_without_with_warns_that_nothing_was_measured(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    batch = demo_batches()[0]
    monitor = Monitor(model, tmp_path / "run", every_n_steps=1)
    with pytest.warns(RuntimeWarning, match=r"Monitor.step\(0\) was called but its block was never entered"):
        monitor.step(0, batch=batch)
        demo_loss(model, batch)
    monitor.close()
    assert not (tmp_path / "run").exists()


def test_autocast_around_the_block_leaves_the_monitors_arithmetic_in_float32(tmp_path: Path) -> None:
    """A loop that wraps its whole step, block included, in bf16 autocast writes what one that wraps only
    the forward writes: the weights measured on entry and the metrics computed on leaving run with autocast
    off (under it the weights' float32 Gram products were made in bf16, 1e-3 off)."""
    batch = demo_batches()[0]
    written = {}
    for around in (False, True):
        torch.manual_seed(0)
        model = DemoTransformer(**MODEL)
        monitor = Monitor(model, tmp_path / str(around), every_n_steps=1, histograms=False)
        outer = torch.autocast("cpu", dtype=torch.bfloat16, enabled=around)
        with outer, monitor.step(0, batch=batch), torch.autocast("cpu", dtype=torch.bfloat16):
            demo_loss(model, batch)
        monitor.close()
        written[around] = scalar_series(monitor_events(tmp_path / str(around)))
    assert any(tag.startswith("weights/") for tag in written[False])
    assert written[True] == written[False]


class Residual(nn.Module):
    """A pre-LN block under a name the monitor does not take for one."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual(), Residual()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_block_patterns_name_blocks_the_monitor_does_not_find(tmp_path: Path) -> None:
    model = Stack()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    for patterns, logdir in ((None, tmp_path / "found"), (["blocks.*"], tmp_path / "named")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Monitor(model, logdir, every_n_steps=1, block_patterns=patterns) as monitor, monitor.step(0):
                model(x)
        tags = [tag for tag in monitor_events(logdir).Tags()["scalars"] if tag.startswith("tokens/cosine")]
        if patterns is None:
            assert tags == [] and any("block_patterns" in str(w.message) for w in caught)
        else:
            assert sorted(tags) == ["tokens/cosine_similarity/blocks.0", "tokens/cosine_similarity/blocks.1"]


def test_a_curvature_probe_that_fails_writes_no_overhead(tmp_path: Path) -> None:
    def failing_loss(model: DemoTransformer, batch: object) -> torch.Tensor:
        raise RuntimeError("no loss here")

    model = DemoTransformer(**MODEL)
    batches = demo_batches()
    curvature = CurvatureOptions(every_n_steps=1)
    monitor = Monitor(
        model, tmp_path, every_n_steps=1, families=["attention"], curvature=curvature, loss_fn=failing_loss
    )
    with pytest.warns(RuntimeWarning, match="measuring the curvature family failed"), monitor:
        for step, batch in enumerate(batches[:3]):
            with monitor.step(step, batch=batch):
                demo_loss(model, batch)
    tags = monitor_events(tmp_path).Tags()["scalars"]
    assert ENTROPY in tags
    assert not [tag for tag in tags if tag.startswith("curvature/")]


def test_a_causal_layer_gone_non_finite_writes_nan_but_no_eigen_gap(tmp_path: Path) -> None:
    """eigen_gap is defined for bidirectional attention only, finite or not."""
    model = DemoTransformer(**MODEL)
    batches = demo_batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-finite reports
        with Monitor(model, tmp_path, every_n_steps=1, families=["attention"]) as monitor:
            for step, batch in enumerate(batches[:2]):
                if step == 1:
                    with torch.no_grad():
                        next(model.parameters()).fill_(math.nan)
                with monitor.step(step, batch=batch):
                    demo_loss(model, batch)
    events = monitor_events(tmp_path)
    assert math.isnan(events.Scalars(ENTROPY)[-1].value)
    assert not [tag for tag in events.Tags()["scalars"] if "eigen_gap" in tag]


def test_should_stop_once_a_stop_on_rule_fires(tmp_path: Path) -> None:
    always = Rule("always", [Condition("attention/entropy", ">=", 0.0)])
    monitor = train_in_a_plain_loop(
        tmp_path,
        every_n_steps=3,
        log_first_step=False,
        families=["attention"],
        alerts=AlertConfig(defaults=False, rules=[always]),
        stop_on=["always"],
    )
    assert monitor.should_stop
    # Steps 0 and 1 are not logging steps; step 2 is, fires the rule, and the loop breaks after it.
    assert [event.step for event in monitor_events(tmp_path).Scalars(ENTROPY)] == [2]


def test_the_loops_summary_writer_and_the_monitor_make_one_run(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    optimizer = model.configure_optimizers()
    writer = SummaryWriter(tmp_path / "run")
    with Monitor(model, writer, every_n_steps=2, optimizer=optimizer, preset="light") as monitor:
        for step, batch in enumerate(demo_batches()):
            with monitor.step(step, batch=batch):
                loss = demo_loss(model, batch)
            writer.add_scalar("train/loss", loss.item(), global_step=step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    writer.close()

    assert monitor.logdir == str(tmp_path / "run")
    run = read_back(tmp_path / "run")  # the directory: TensorBoard's one run
    assert [event.step for event in run.Scalars("train/loss")] == [0, 1, 2, 3, 4, 5]
    assert [event.step for event in run.Scalars(ENTROPY)] == [0, 1, 3, 5]
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 2  # each writer its own file


def test_a_repeated_step_is_one_optimizer_step_measured_once(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    batches = demo_batches()
    with Monitor(model, tmp_path, every_n_steps=1, preset="light") as monitor:
        for step, micro_batches in enumerate((batches[0:2], batches[2:4])):
            for batch in micro_batches:
                with monitor.step(step, batch=batch) as logging:
                    demo_loss(model, batch).backward()
                assert logging == (batch is micro_batches[0])
    assert [event.step for event in monitor_events(tmp_path).Scalars(ENTROPY)] == [0, 1]


def test_a_process_that_does_not_write_creates_no_event_file(tmp_path: Path) -> None:
    assert Monitor(DemoTransformer(**MODEL), tmp_path).writes  # no process group: the one process writes
    model = DemoTransformer(**MODEL)
    with Monitor(model, tmp_path, every_n_steps=1, writes=False) as monitor:
        for step, batch in enumerate(demo_batches()[:2]):
            with monitor.step(step, batch=batch):
                demo_loss(model, batch)
    assert not list(tmp_path.iterdir())


def test_the_state_survives_a_weights_only_checkpoint_and_resumes_the_cadence(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    batches = demo_batches()
    with Monitor(model, tmp_path / "first", every_n_steps=2, preset="light") as monitor:
        for step, batch in enumerate(batches[:3]):
            with monitor.step(step, batch=batch):
                demo_loss(model, batch)
        torch.save({"monitor": monitor.state_dict()}, tmp_path / "checkpoint.pt")
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["monitor"]
    assert state["logging_steps_done"] == 2  # steps 0 and 1

    with Monitor(model, tmp_path / "resumed", every_n_steps=2, preset="light") as resumed:
        resumed.load_state_dict(state)
        for step, batch in enumerate(batches[3:], start=3):
            with resumed.step(step, batch=batch):
                demo_loss(model, batch)
        assert resumed.state_dict()["logging_steps_done"] == 4  # and steps 3 and 5
    assert [event.step for event in monitor_events(tmp_path / "resumed").Scalars(ENTROPY)] == [3, 5]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"model": "not a module"}, "model must be a torch.nn.Module"),
        ({"logdir": 3}, "logdir must be a run directory"),
        ({"logdir": ""}, "logdir must be a run directory"),
        ({"every_n_steps": 0}, "every_n_steps must be an int >= 1"),
        ({"optimizer": "adam"}, "optimizer must be None or a torch.optim.Optimizer"),
        ({"loss_fn": 1.0}, "loss_fn must be None or a function"),
        ({"writes": 1}, "writes must be a bool"),
        ({"every_n_step": 5}, "every_n_step is not an option of Monitor"),
        ({"preset": "heavy"}, "preset must be one of"),
        ({"stop_on": ["no_such_rule"]}, "no_such_rule"),
        ({"curvature": CurvatureOptions()}, r"curvature= turns on the curvature probe.*loss_fn="),
        ({"preset": "full"}, r"preset='full', which sets curvature=.*loss_fn="),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(tmp_path: Path, arguments: dict, named: str) -> None:
    given = {"model": DemoTransformer(**MODEL), "logdir": tmp_path, **arguments}
    with pytest.raises(ValueError, match=named):
        Monitor(**given)


def test_the_second_order_probes_take_their_loss_from_loss_fn_or_probe_data(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    Monitor(model, tmp_path, curvature=CurvatureOptions(), loss_fn=demo_loss)
    Monitor(model, tmp_path, curvature=CurvatureOptions(), probe_data=ProbeDataOptions(loss_fn=demo_loss))
    monitor = Monitor(model, tmp_path, curvature=CurvatureOptions(), loss_fn=demo_loss)
    with pytest.raises(ValueError, match="batch must be given to Monitor.step"), monitor.step(0):
        pass


def test_steps_that_go_back_nest_or_come_after_close_are_refused(tmp_path: Path) -> None:
    model = DemoTransformer(**MODEL)
    batch = demo_batches()[0]
    monitor = Monitor(model, tmp_path, preset="light")
    with monitor.step(4, batch=batch), pytest.raises(RuntimeError, match="cannot nest"), monitor.step(4):
        pass
    with pytest.raises(ValueError, match="must not go back: got 3 after 4"), monitor.step(3, batch=batch):
        pass
    with pytest.raises(ValueError, match=r"step must be an int in \[0, "), monitor.step(-1, batch=batch):
        pass
    monitor.close()
    monitor.close()
    with pytest.raises(RuntimeError, match="after Monitor.close"), monitor.step(5, batch=batch):
        pass


def test_a_ddp_wrapped_model_is_measured_through_its_module_and_rank_0_writes(tmp_path: Path) -> None:
    """A one-rank gloo group: ``writes=None`` writes on its rank 0, and the tags and values are those of the
    unwrapped model (no ``module.`` prefix)."""
    batches = demo_batches()[:2]
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(DemoTransformer(**MODEL))
        with Monitor(wrapped, tmp_path / "ddp", every_n_steps=1, preset="light") as monitor:
            assert monitor.writes
            for step, (tokens, targets) in enumerate(batches):
                with monitor.step(step, batch=(tokens, targets)):
                    logits = wrapped(tokens)
                F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).backward()
    finally:
        torch.distributed.destroy_process_group()
    model = DemoTransformer(**MODEL)
    with Monitor(model, tmp_path / "plain", every_n_steps=1, preset="light") as monitor:
        for step, batch in enumerate(batches):
            with monitor.step(step, batch=batch):
                demo_loss(model, batch).backward()

    ddp, plain = monitor_events(tmp_path / "ddp"), monitor_events(tmp_path / "plain")
    assert sorted(ddp.Tags()["scalars"]) == sorted(plain.Tags()["scalars"])
    assert ENTROPY in plain.Tags()["scalars"]
    for tag in plain.Tags()["scalars"]:
        assert [(e.step, e.value) for e in ddp.Scalars(tag)] == [
            (e.step, e.value) for e in plain.Scalars(tag)
        ]
