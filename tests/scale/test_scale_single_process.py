"""The monitor under mixed precision, torch.compile and activation checkpointing (one process, CPU).

- Mixed precision: under bf16 and fp16 autocast the captures hold the forward's half-precision q and k, and
  the monitor computes in float32 from them (equal to a float64 recomputation from the same tensors to
  float32 rounding); against a float32 run the metrics differ only by the forward's own rounding, within
  the tolerances stated in the README (measured here on a model with peaked attention).
- torch.compile: every way of compiling a model or its parts is found; compiling only modules without
  attention keeps every capture armed on the training forward, with the same numbers and no recompilation
  on armed steps (a compiled model is measured by a probe forward: ``tests/core/test_compile.py``).
- Activation checkpointing: recomputed forwards (reentrant or not) neither duplicate nor change captures,
  armed through the backward or disarmed before it as the callback does; ``checkpoint_wrapper`` leaves
  every name as the plain model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.demo import DemoTransformer
from spectral_monitor.metrics import attention_metrics, token_metrics
from spectral_monitor.probes import AttentionCapture, ResidualCapture, WeightProbe, unwrapped_named_modules
from spectral_monitor.probes.wrappers import compiled_module_names

pytestmark = pytest.mark.usefixtures("one_thread")

# init_std 0.3: attention logits of standard deviation ~3, so the attention is peaked and rounding of q and
# k shows in the metrics (at GPT-2's 0.02 the attention is uniform and every precision agrees to 1e-5).
MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32, "init_std": 0.3}
LAYERS = ["blocks.0.attention", "blocks.1.attention"]
BLOCKS = ["blocks.0", "blocks.1"]

# Metrics in [0, 1] whose healthy range does not depend on n: absolute tolerance against float32.
NORMALISED = (
    "entropy",
    "spectral_gap",
    "rank_one_residual",
    "effective_rank_ratio",
    "dobrushin",
    "self_attention",
)
# Against a float32 run: a few unit roundoffs of the forward's dtype (bf16 2^-8, fp16 2^-11). Measured on
# MODEL: at most 1.3e-3 (bf16) and 1.5e-4 (fp16) on the normalised metrics, 0.7% and 0.13% relative on σ₁.
TOLERANCE = {torch.bfloat16: 5e-3, torch.float16: 1e-3}
RELATIVE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def tokens(rows: int = 2) -> torch.Tensor:
    return torch.randint(
        MODEL["vocab_size"], (rows, MODEL["seq_len"]), generator=torch.Generator().manual_seed(0)
    )


def captured(model: torch.nn.Module, batch: torch.Tensor, dtype: torch.dtype | None = None):
    attention, residual = AttentionCapture(model), ResidualCapture(model)
    autocast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    with attention.armed() as attention_recording, residual.armed() as residual_recording, autocast:
        model(batch)
    return attention_recording, residual_recording


# -- mixed precision ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_metrics_are_float32_from_the_captured_tensors_and_match_float32(dtype: torch.dtype) -> None:
    model = DemoTransformer(**MODEL)
    reference, reference_tokens = captured(model, tokens())
    half, half_tokens = captured(model, tokens(), dtype)

    for full, low in zip(reference.captured, half.captured, strict=True):
        assert low.q.dtype == dtype and low.k.dtype == dtype  # the forward's own tensors, as captured
        probs = low.probs()
        assert probs.dtype == torch.float32
        # Computed in float32 from the captured tensors: a float64 recomputation differs by float32 rounding.
        logits = (low.q.double() @ low.k.double().transpose(-1, -2)) * low.scale
        logits = logits.masked_fill(~torch.ones_like(logits, dtype=torch.bool).tril(), -torch.inf)  # causal
        torch.testing.assert_close(probs.double(), torch.softmax(logits, -1), rtol=0, atol=1e-6)

        expected, measured = attention_metrics(full.probs()), attention_metrics(probs)
        for metric in NORMALISED:
            torch.testing.assert_close(measured[metric], expected[metric], rtol=0, atol=TOLERANCE[dtype])
        for metric in ("sigma1", "stable_rank", "effective_rank"):
            torch.testing.assert_close(
                measured[metric], expected[metric], rtol=RELATIVE_TOLERANCE[dtype], atol=0
            )

    for full, low in zip(reference_tokens.states, half_tokens.states, strict=True):
        assert low.states.dtype == torch.float32
        expected, measured = token_metrics(full.states), token_metrics(low.states)
        for metric in ("cosine_similarity", "token_residual"):
            torch.testing.assert_close(measured[metric], expected[metric], rtol=0, atol=TOLERANCE[dtype])


def fit_step_zero(
    tmp_path: Path, model: pl.LightningModule, **trainer_args
) -> event_accumulator.EventAccumulator:
    batch = tokens(4)
    trainer = pl.Trainer(
        max_steps=1,
        log_every_n_steps=1,
        logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
        callbacks=[SpectralMonitor(every_n_steps=1, figures_every_n_logs=0, histograms=False)],
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **trainer_args,
    )
    trainer.fit(model, DataLoader(TensorDataset(batch, batch.roll(1, dims=1)), batch_size=4))
    events = event_accumulator.EventAccumulator(
        str(tmp_path / "run" / "version_0"), size_guidance={"scalars": 0}
    )
    events.Reload()
    return events


@pytest.mark.slow
def test_lightning_bf16_mixed_writes_what_a_float32_run_writes(tmp_path: Path) -> None:
    float32 = fit_step_zero(tmp_path / "32", DemoTransformer(**MODEL))
    bf16 = fit_step_zero(tmp_path / "bf16", DemoTransformer(**MODEL), precision="bf16-mixed")

    tags = [tag for tag in float32.Tags()["scalars"] if tag.startswith(("attention/", "tokens/", "weights/"))]
    assert sorted(tags) == sorted(
        t for t in bf16.Tags()["scalars"] if t.startswith(("attention/", "tokens/", "weights/"))
    )
    checked = 0
    for tag in tags:
        family, metric = tag.split("/")[:2]
        (expected,), (measured,) = (
            [e.value for e in float32.Scalars(tag)],
            [e.value for e in bf16.Scalars(tag)],
        )
        if family == "weights":  # float32 parameters, measured before the forward: identical
            assert measured == expected, tag
        elif metric in NORMALISED or metric in ("cosine_similarity", "token_residual"):
            assert measured == pytest.approx(expected, abs=TOLERANCE[torch.bfloat16]), tag
            checked += 1
    assert checked >= 2 * len(NORMALISED)


# -- torch.compile -----------------------------------------------------------------------------------------


def test_compiled_regions_are_found_through_every_way_of_compiling() -> None:
    whole = torch.compile(DemoTransformer(**MODEL), backend="eager")
    assert compiled_module_names(whole) == [""]

    per_block = DemoTransformer(**MODEL)
    for block in per_block.blocks:
        block.compile(backend="eager")
    assert compiled_module_names(per_block) == BLOCKS

    mlps_only = DemoTransformer(**MODEL)
    for block in mlps_only.blocks:
        block.mlp = torch.compile(block.mlp, backend="eager")
    assert compiled_module_names(mlps_only) == ["blocks.0.mlp", "blocks.1.mlp"]  # no "_orig_mod"


def test_compiling_modules_without_attention_keeps_every_capture_without_recompiling() -> None:
    eager = DemoTransformer(**MODEL)
    expected_attention, expected_tokens = captured(eager, tokens())
    model = DemoTransformer(**MODEL)
    for block in model.blocks:
        block.mlp = torch.compile(block.mlp, backend="eager")
    model(tokens())
    captured(model, tokens())  # the first armed forward compiles once more (the capture's mode is active)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):  # armed forwards, as on two more logging steps: no new graph
        attention, residual = captured(model, tokens())
        model(tokens())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs

    assert [capture.layer for capture in attention.captured] == LAYERS
    for got, want in zip(attention.captured, expected_attention.captured, strict=True):
        torch.testing.assert_close(got.probs(), want.probs(), rtol=1e-6, atol=1e-7)
    assert [sample.layer for sample in residual.states] == BLOCKS
    for got, want in zip(residual.states, expected_tokens.states, strict=True):
        torch.testing.assert_close(got.states, want.states, rtol=1e-5, atol=1e-6)


# -- activation checkpointing ------------------------------------------------------------------------------


class CheckpointedTransformer(DemoTransformer):
    """The demo model with every block under ``torch.utils.checkpoint``: recomputed during the backward."""

    def __init__(self, use_reentrant: bool, **arguments) -> None:
        super().__init__(**arguments)
        self.use_reentrant = use_reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(self.final_norm(x))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_recomputation_in_the_backward_neither_duplicates_nor_changes_captures(use_reentrant: bool) -> None:
    expected_attention, expected_tokens = captured(DemoTransformer(**MODEL), tokens())
    model = CheckpointedTransformer(use_reentrant, **MODEL)
    attention, residual = AttentionCapture(model), ResidualCapture(model)
    with attention.armed() as attention_recording, residual.armed() as residual_recording:
        model(tokens()).square().mean().backward()  # armed through the recomputing backward
    assert all(parameter.grad is not None for parameter in model.blocks.parameters())

    assert [capture.layer for capture in attention_recording.captured] == LAYERS
    for got, want in zip(attention_recording.captured, expected_attention.captured, strict=True):
        torch.testing.assert_close(got.probs(), want.probs(), rtol=0, atol=0)
    assert [sample.layer for sample in residual_recording.states] == BLOCKS
    for got, want in zip(residual_recording.states, expected_tokens.states, strict=True):
        torch.testing.assert_close(got.states, want.states, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_callback_on_a_checkpointed_model_writes_what_the_plain_model_gives(
    tmp_path: Path, use_reentrant: bool
) -> None:
    plain = fit_step_zero(tmp_path / "plain", DemoTransformer(**MODEL))
    checkpointed = fit_step_zero(tmp_path / "checkpointed", CheckpointedTransformer(use_reentrant, **MODEL))
    # Sorted: the order of Tags() is that of the run's files by name, Lightning's among the monitor's.
    tags = sorted(plain.Tags()["scalars"])
    assert tags == sorted(checkpointed.Tags()["scalars"])
    monitored = [tag for tag in tags if tag.startswith(("attention/", "tokens/"))]
    assert {tag.split("/")[2] for tag in monitored if tag.startswith("attention/")} == set(LAYERS)
    for tag in monitored:
        assert [e.value for e in checkpointed.Scalars(tag)] == [e.value for e in plain.Scalars(tag)], tag


# -- names through wrappers --------------------------------------------------------------------------------


def test_names_are_the_plain_models_through_checkpoint_wrapper_and_a_users_own_module_named_module() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = DemoTransformer(**MODEL)
    wrapped = DemoTransformer(**MODEL)
    for index, block in enumerate(wrapped.blocks):
        wrapped.blocks[index] = checkpoint_wrapper(block)
    assert [name for name, _ in unwrapped_named_modules(wrapped)] == [
        name for name, _ in plain.named_modules()
    ]
    assert ResidualCapture(wrapped).blocks == tuple(BLOCKS)
    assert [r.tag for r in WeightProbe(wrapped).measure(0)] == [r.tag for r in WeightProbe(plain).measure(0)]
    attention, residual = captured(wrapped, tokens())
    assert [capture.layer for capture in attention.captured] == LAYERS
    assert [sample.layer for sample in residual.states] == BLOCKS

    holder = torch.nn.Module()
    holder.module = torch.nn.Linear(2, 2)  # not a wrapper's: keeps its name
    assert [name for name, _ in unwrapped_named_modules(holder)] == ["", "module"]
    ddp_like = torch.nn.DataParallel(holder)
    assert [name for name, _ in unwrapped_named_modules(ddp_like)] == ["", "module"]
