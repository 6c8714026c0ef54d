"""torch.compile: a compiled model is measured by a probe forward, never inside its graphs.

Two setups: ``Monitor(torch.compile(model))`` (the model given compiled) and ``Monitor(model)`` with the loop
calling ``torch.compile(model)`` (found compiled at the first logging step). In both, on a nanoGPT-style
SDPA model and on the demo model:

- every attention and token metric is logged, equal to a float64 recomputation from the model's weights
  (the conformance harness's references and comparison);
- after the first logging step Dynamo compiles no new graph, and the monitor's code breaks no graph
  (``aot_eager``; once with the default ``inductor``);
- nothing is installed on the model during a training forward after the first logging step, and never
  between logging steps;
- training with the monitor is bit-identical to training without it, dropout on;
- Lightning's ``fit(torch.compile(model))`` logs the same metrics, equal to float64, compiling the graphs an
  unmonitored fit compiles.

Blocks compiled in place (``block.compile()``) are measured the same way.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.events import read_back
from helpers.models import hook_count
from pytorch_lightning.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from spectral_monitor import Monitor, SpectralMonitor
from spectral_monitor.demo import DemoTransformer, SyntheticDataModule
from spectral_monitor.demo.model import IGNORE_INDEX
from spectral_monitor.probes.wrappers import forward_on_batch, probe_forward
from spectral_monitor.toolbox.length_scaling import attention_logit_scale

sys.path.insert(0, str(Path(__file__).parents[1] / "conformance"))
from conformance_harness import (  # noqa: E402
    BlockReference,
    LayerReference,
    LogitInputs,
    as_float64,
    largest_error,
)
from conformance_models import nanogpt_family  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SETUPS = ("compiled model", "compiled forward")
# init_std 0.3: peaked attention, so the float64 comparison tells definitions apart.
DEMO = {"vocab_size": 40, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "init_std": 0.3}
DEMO_DATA = {
    "vocab_size": 40,
    "seq_len": 16,
    "batch_size": 3,
    "num_batches": 4,
    "num_keys": 4,
    "num_values": 4,
    "num_pairs": 3,
    "num_queries": 2,
}
MEASURED = {
    "families": ("attention", "tokens"),
    "per_head": True,
    "histograms": False,
    "figures_every_n_logs": 0,
    "head_diversity_every_n_logs": 0,
    "metric_method": "exact",
    "preflight": False,
    "strict": True,
}


def test_a_probe_forward_leaves_training_flags_random_streams_and_the_fast_path_as_they_were() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    model[2].eval()
    flags = [module.training for module in model.modules()]
    fastpath = torch.backends.mha.get_fastpath_enabled()
    x = torch.randn(3, 4)
    random_state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="inside"), probe_forward(model):
        assert not any(module.training for module in model.modules())
        assert not torch.is_grad_enabled()
        assert not torch.backends.mha.get_fastpath_enabled()
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)  # no dropout
        torch.rand(5)
        raise RuntimeError("an error inside the probe forward")
    assert [module.training for module in model.modules()] == flags
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    assert torch.equal(torch.get_rng_state(), random_state)


def test_the_probe_forward_calls_the_model_as_a_training_loop_feeds_it() -> None:
    def inputs(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    class Recorder(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return inputs(*args, **kwargs)

    tokens, targets = torch.ones(2, 3), torch.zeros(2, 3)
    model = Recorder()
    assert forward_on_batch(model, {"input_ids": tokens}) == inputs(input_ids=tokens)
    assert forward_on_batch(model, (tokens, targets))[0][0] is tokens
    assert forward_on_batch(model, [tokens, targets])[0][0] is tokens
    assert forward_on_batch(model, tokens)[0][0] is tokens
    for empty in (None, (), []):
        with pytest.raises(ValueError, match="batch is"):
            forward_on_batch(model, empty)


class NanoGPTByKeywords(nn.Module):
    """nanoGPT under the name ``model`` (the conformance reference's layer names), called with a batch's
    keywords as a Hugging Face model is: ``model(input_ids=..., attention_mask=...)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.model(input_ids)


def nanogpt_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).square().mean()


def demo_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def demo_reference(model: DemoTransformer, batch: tuple[Tensor, Tensor]):
    """Each layer's attention and each block's output of the demo model on ``batch``, recomputed in float64
    from the attention module's input and its fused q/k/v weights (no padding: every token real)."""
    tokens = batch[0]
    inputs: dict[int, Tensor] = {}
    outputs: dict[int, Tensor] = {}
    handles = []
    for index, block in enumerate(model.blocks):
        handles.append(
            block.attention.register_forward_pre_hook(
                lambda module, args, index=index: inputs.__setitem__(index, args[0])
            )
        )
        handles.append(
            block.register_forward_hook(
                lambda module, args, output, index=index: outputs.__setitem__(index, output)
            )
        )
    training = model.training
    model.eval()
    with torch.no_grad():
        model(tokens)
    model.train(training)
    for handle in handles:
        handle.remove()
    real = torch.ones(tokens.shape, dtype=torch.bool).numpy()
    layers, blocks = [], []
    with torch.no_grad():
        for index, block in enumerate(model.blocks):
            name = f"blocks.{index}.attention"
            layers.append(_demo_layer_reference(name, block.attention, inputs[index], real))
            blocks.append(BlockReference(f"blocks.{index}", as_float64(outputs[index]), real))
    return layers, blocks


def _demo_layer_reference(name: str, attention: nn.Module, x: Tensor, real: np.ndarray) -> LayerReference:
    """One causal layer of the demo model, q and k from its input ``x`` in float64."""
    x = x.double()
    batch_size, n, _ = x.shape
    qkv = F.linear(x, attention.qkv.weight.double(), attention.qkv.bias.double())
    q, k, _ = qkv.view(batch_size, n, 3, attention.n_heads, attention.head_dim).permute(2, 0, 3, 1, 4)
    scale = attention_logit_scale(
        attention.head_dim, n, attention.logit_scaling, attention.log_n_gamma, attention.train_seq_len
    )
    future = ~torch.ones(n, n, dtype=torch.bool).tril()
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(future, -math.inf)
    return LayerReference(
        name,
        logits.softmax(dim=-1).numpy(),
        real,
        real,
        causal=True,
        logit_inputs=LogitInputs(q.numpy(), k.numpy(), float(scale)),
    )


@dataclass
class Subject:
    """A model to train compiled: its batches (each twice, so that every other step, the logging one,
    measures a new batch), its loss, its float64 reference and the monitor's options for it."""

    model: nn.Module
    batches: list[Any]
    loss: Callable[[nn.Module, Any], Tensor]
    reference: Callable[[Any], tuple[list[LayerReference], list[BlockReference]]]
    options: dict[str, Any] = field(default_factory=dict)


def nanogpt_subject() -> Subject:
    family = nanogpt_family()
    cases = list(family.cases.values())
    return Subject(
        NanoGPTByKeywords(family.model),
        [batch for batch in cases for _ in range(2)],
        nanogpt_loss,
        family.reference,
        {"token_mask": family.token_mask, "max_sequences": 3},
    )


def demo_subject() -> Subject:
    torch.manual_seed(0)
    model = DemoTransformer(**DEMO)
    batches = list(SyntheticDataModule(**DEMO_DATA).train_dataloader())
    reference_model = copy.deepcopy(model)
    return Subject(
        model,
        [batch for batch in batches for _ in range(2)],
        demo_loss,
        lambda batch: demo_reference(reference_model, batch),
        {"max_sequences": 3},
    )


@dataclass
class CompiledRun:
    logged: dict[int, dict[str, float]]  # tag -> value, by logging step
    graphs_after_first_log: int  # Dynamo's graphs when the first logging step has ended
    graphs_at_end: int
    hooks_in_forward: dict[int, int]  # hooks and modes on the model during each step's training forward


def train_compiled(
    subject: Subject, setup: str, logdir: Path, backend: str = "aot_eager", backward: bool = True
) -> CompiledRun:
    """The loop of ``docs/plain-loop.md`` over the subject's batches with the forward compiled, the monitor
    measuring every other step (1, 3, ...) without an optimizer step (the weights stay the reference's);
    without ``backward``, forwards only, under ``no_grad``."""
    torch._dynamo.reset()
    counters.clear()
    model = subject.model
    if setup == "blocks compiled in place":
        for block in model.blocks:
            block.compile(backend=backend)
        compiled = given = model
    else:
        compiled = torch.compile(model, backend=backend)
        given = compiled if setup == "compiled model" else model
    hooks_in_forward = {}
    graphs_after_first_log = -1
    options = {**MEASURED, **subject.options}
    with Monitor(given, logdir, every_n_steps=2, log_first_step=False, **options) as monitor:
        for step, batch in enumerate(subject.batches):
            with monitor.step(step, batch=batch), torch.set_grad_enabled(backward):
                hooks_in_forward[step] = hook_count(model)
                loss = subject.loss(compiled, batch)
            if backward:
                loss.backward()
                model.zero_grad()
            if step == 1:
                graphs_after_first_log = counters["stats"]["unique_graphs"]
    events = read_back(logdir)
    logged: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            logged.setdefault(event.step, {})[tag] = event.value
    return CompiledRun(logged, graphs_after_first_log, counters["stats"]["unique_graphs"], hooks_in_forward)


def assert_equal_to_float64(subject: Subject, run: CompiledRun) -> None:
    """Every logging step logged every attention and token metric of every layer, equal to the float64
    reference of its batch (``max_logit_growth`` against the previous logging step's)."""
    logging_steps = list(range(1, len(subject.batches), 2))
    assert sorted(run.logged) == logging_steps
    previous: list[LayerReference] | tuple[()] = ()
    for step in logging_steps:
        layers, blocks = subject.reference(subject.batches[step])
        assert layers and blocks
        largest_error(run.logged[step], layers, blocks, previous)
        previous = layers


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("make_subject", [nanogpt_subject, demo_subject], ids=["nanogpt", "demo"])
def test_compiled_runs_log_every_metric_equal_to_float64_and_compile_nothing_after_the_first_logging_step(
    tmp_path: Path, setup: str, make_subject: Callable[[], Subject], caplog: pytest.LogCaptureFixture
) -> None:
    subject = make_subject()
    with caplog.at_level(logging.INFO, logger="spectral_monitor"):
        run = train_compiled(subject, setup, tmp_path)
    said = [record for record in caplog.records if "measured by a forward" in record.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert_equal_to_float64(subject, run)
    assert run.graphs_after_first_log >= 1
    assert run.graphs_at_end == run.graphs_after_first_log
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Given compiled, nothing is ever on the model; found compiled, only during the first logging forward.
    first_hooked = 2 if setup == "compiled forward" else 0
    assert all(hooks == 0 for step, hooks in run.hooks_in_forward.items() if step >= first_hooked)
    assert hook_count(subject.model) == 0


@pytest.mark.slow
def test_blocks_compiled_in_place_are_measured_equal_to_float64_without_new_graphs(tmp_path: Path) -> None:
    subject = demo_subject()
    run = train_compiled(subject, "blocks compiled in place", tmp_path)
    assert_equal_to_float64(subject, run)
    assert run.graphs_after_first_log >= 1
    assert run.graphs_at_end == run.graphs_after_first_log
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(hooks == 0 for hooks in run.hooks_in_forward.values())


@pytest.mark.slow
def test_inductor_compiled_forward_is_measured_without_graph_breaks_or_new_graphs(tmp_path: Path) -> None:
    subject = nanogpt_subject()
    subject.batches = subject.batches[:4]
    # Forwards only: inductor's backward compilation would take a minute on a small CPU, and the monitor
    # touches no backward.
    run = train_compiled(subject, "compiled forward", tmp_path, backend="inductor", backward=False)
    assert_equal_to_float64(subject, run)
    assert run.graphs_at_end == run.graphs_after_first_log
    assert not counters["graph_break"], dict(counters["graph_break"])


def demo_parameters_after_training(setup: str | None, logdir: Path) -> list[Tensor]:
    """The demo model's parameters after 6 AdamW steps with dropout, compiled; monitored every other step
    (the first included) unless ``setup`` is None."""
    torch.manual_seed(0)
    model = DemoTransformer(**{**DEMO, "dropout": 0.2})
    optimizer = model.configure_optimizers()
    compiled = torch.compile(model, backend="aot_eager")
    batches = list(SyntheticDataModule(**{**DEMO_DATA, "num_batches": 6}).train_dataloader())
    monitor = None
    if setup is not None:
        given = compiled if setup == "compiled model" else model
        monitor = Monitor(given, logdir, every_n_steps=2, optimizer=optimizer, **MEASURED)
    torch.manual_seed(1)
    for step, batch in enumerate(batches):
        if monitor is None:
            loss = demo_loss(compiled, batch)
        else:
            with monitor.step(step, batch=batch):
                loss = demo_loss(compiled, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if monitor is not None:
        monitor.close()
        assert "attention/entropy/blocks.0.attention" in read_back(logdir).Tags()["scalars"]
    return [parameter.detach().clone() for parameter in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUPS)
def test_training_compiled_with_the_monitor_is_bit_identical_to_training_without_it(
    tmp_path: Path, setup: str
) -> None:
    unmonitored = demo_parameters_after_training(None, tmp_path / "unmonitored")
    monitored = demo_parameters_after_training(setup, tmp_path / "monitored")
    for without, with_monitor in zip(unmonitored, monitored, strict=True):
        assert torch.equal(without, with_monitor)


class QuietTransformer(DemoTransformer):
    """The demo model without ``self.log`` in its training step: Lightning 2.6's ``self.log`` does not trace
    under torch 2.13's Dynamo (``inspect.getfullargspec`` on a method), with or without the monitor."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return demo_loss(self, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay the reference's


def fit_compiled(logdir: Path, monitored: bool) -> tuple[QuietTransformer, list[Any], int]:
    """``Trainer.fit(torch.compile(model))`` over 4 demo batches, measured at steps 1 and 3 when
    ``monitored``; returns the model, its batches and the graphs Dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = QuietTransformer(**DEMO)
    batches = list(SyntheticDataModule(**DEMO_DATA).train_dataloader())
    monitor = SpectralMonitor(every_n_steps=2, log_first_step=False, max_sequences=3, **MEASURED)
    callbacks = [monitor] if monitored else []
    trainer = pl.Trainer(
        max_epochs=1,
        logger=TensorBoardLogger(str(logdir), name="run", version=0),
        callbacks=callbacks,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(torch.compile(model, backend="aot_eager"), DataLoader(batches, batch_size=None))
    return model, batches, counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_lightning_fit_of_a_compiled_module_logs_every_metric_equal_to_float64(tmp_path: Path) -> None:
    model, batches, graphs = fit_compiled(tmp_path, monitored=True)
    _, _, unmonitored_graphs = fit_compiled(tmp_path / "unmonitored", monitored=False)
    assert graphs == unmonitored_graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert hook_count(model) == 0
    events = read_back(tmp_path / "run" / "version_0")
    logged: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            logged.setdefault(event.step, {})[tag] = event.value
    previous: list[LayerReference] | tuple[()] = ()
    for step in (1, 3):  # every_n_steps=2 measures the batches after 1 and 3 optimizer steps
        layers, blocks = demo_reference(model, batches[step])
        largest_error(logged[step], layers, blocks, previous)
        previous = layers
