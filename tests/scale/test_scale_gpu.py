"""What needs a CUDA device: Lightning's FSDP strategy and fp16 mixed precision (Lightning turns "16-mixed"
into bf16 on a CPU). Skipped without CUDA; run on a GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import FSDPStrategy
from tensorboard.backend.event_processing import event_accumulator
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.demo import DemoTransformer
from spectral_monitor.demo.model import Block
from spectral_monitor.probes import WeightProbe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32, "init_std": 0.3}
NORMALISED = ("entropy", "spectral_gap", "rank_one_residual", "effective_rank_ratio", "dobrushin")
FP16_TOLERANCE = 1e-3  # as on the CPU (tests/scale/test_scale_single_process.py)


def fit_step_zero(tmp_path: Path, **trainer_args) -> event_accumulator.EventAccumulator:
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(MODEL["vocab_size"], (4, MODEL["seq_len"]), generator=generator)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=1,
        log_every_n_steps=1,
        logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
        callbacks=[SpectralMonitor(every_n_steps=1, figures_every_n_logs=0, histograms=False)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **trainer_args,
    )
    data = DataLoader(TensorDataset(batch, batch.roll(1, dims=1)), batch_size=4)
    trainer.fit(DemoTransformer(**MODEL), data)
    logdir = str(tmp_path / "run" / "version_0")
    events = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0})
    events.Reload()
    return events


def step_zero(events: event_accumulator.EventAccumulator, tag: str) -> float:
    (event,) = events.Scalars(tag)
    return event.value


def test_lightning_fsdp_weights_equal_the_unsharded_model_under_plain_names(tmp_path: Path) -> None:
    events = fit_step_zero(tmp_path, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    tags = events.Tags()["scalars"]
    assert not [tag for tag in tags if "_fsdp_wrapped_module" in tag or "_forward_module" in tag]
    assert "attention/entropy/blocks.0.attention" in tags
    assert "tokens/cosine_similarity/blocks.1" in tags
    for record in WeightProbe(DemoTransformer(**MODEL)).measure(0):
        if record.metric == "spectral_norm" and record.tag in tags:
            assert step_zero(events, record.tag) == pytest.approx(record.value, rel=1e-4), record.tag


def test_lightning_fp16_mixed_writes_what_a_float32_run_writes(tmp_path: Path) -> None:
    float32 = fit_step_zero(tmp_path / "32")
    fp16 = fit_step_zero(tmp_path / "16", precision="16-mixed")
    scalars = float32.Tags()["scalars"]
    tags = [tag for tag in scalars if tag.count("/") >= 2 and tag.split("/")[1] in NORMALISED]
    assert tags
    for tag in tags:
        assert step_zero(fp16, tag) == pytest.approx(step_zero(float32, tag), abs=FP16_TOLERANCE), tag
