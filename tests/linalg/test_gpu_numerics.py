"""The numerics on a CUDA device against float64 references computed on the CPU: attention metrics of
softmax(q kᵀ) attention, a Lightning run on CUDA against the same run on the CPU, and the Hessian's top
eigenvalues against ``eigvalsh`` of the explicit Hessian. Skipped without CUDA; run on a GPU machine with
``pytest -m gpu`` (``benchmarks/gpu_check.sh`` runs them with the benchmarks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from helpers.reference_metrics import attention_reference_batch, query_key_logits, row_softmax
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from spectral_monitor import SpectralMonitor
from spectral_monitor.demo import DemoTransformer
from spectral_monitor.metrics import attention_metrics
from spectral_monitor.probes.curvature import measure_curvature

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXACT_METRICS = (
    "entropy",
    "sigma1",
    "sigma2",
    "spectral_gap",
    "rank_one_residual",
    "stable_rank",
    "dobrushin",
)
MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32, "init_std": 0.3}


@pytest.mark.parametrize("causal", [False, True])
def test_float32_attention_metrics_on_cuda_match_the_float64_reference(causal: bool) -> None:
    rng = np.random.default_rng(0)
    attn = row_softmax(query_key_logits(rng, (4, 96, 96), d=16), causal=causal)
    expected = attention_reference_batch(attn, causal=causal)
    actual = attention_metrics(
        torch.from_numpy(attn).to("cuda", torch.float32), causal=causal, method="exact"
    )
    for name in EXACT_METRICS:
        np.testing.assert_allclose(
            actual[name].double().cpu().numpy(), expected[name], rtol=1e-5, atol=1e-5, err_msg=name
        )


def step_zero_scalars(tmp_path: Path, accelerator: str) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(MODEL["vocab_size"], (4, MODEL["seq_len"]), generator=generator)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=1,
        log_every_n_steps=1,
        logger=TensorBoardLogger(str(tmp_path), name=accelerator, version=0),
        callbacks=[SpectralMonitor(every_n_steps=1, figures_every_n_logs=0, histograms=False)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = DataLoader(TensorDataset(batch, batch.roll(1, dims=1)), batch_size=4)
    trainer.fit(DemoTransformer(**MODEL), data)
    events = event_accumulator.EventAccumulator(
        str(tmp_path / accelerator / "version_0"), size_guidance={"scalars": 0}
    )
    events.Reload()
    return {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}


def test_a_cuda_run_writes_what_a_cpu_run_writes(tmp_path: Path) -> None:
    cpu = step_zero_scalars(tmp_path, "cpu")
    cuda = step_zero_scalars(tmp_path, "cuda")
    attention = [tag for tag in cpu if tag.startswith(("attention/", "tokens/", "weights/"))]
    assert len(attention) > 20
    assert set(attention) <= set(cuda)
    for tag in attention:
        assert cuda[tag] == pytest.approx(cpu[tag], rel=1e-3, abs=1e-4), tag


def test_hessian_top_eigenvalues_on_cuda_match_the_explicit_float64_hessian() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randint(3, (32,))
    parameters = [p.detach().clone() for p in model.parameters()]
    shapes = [p.shape for p in parameters]

    def loss_of(flat: Tensor) -> Tensor:
        values, offset = [], 0
        for shape in shapes:
            values.append(flat[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        hidden = torch.tanh(x @ values[0].T + values[1])
        return nn.functional.cross_entropy(hidden @ values[2].T + values[3], y)

    flat = torch.cat([p.flatten() for p in parameters])
    exact = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss_of, flat))
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    estimate = measure_curvature(
        model, lambda: nn.functional.cross_entropy(model(x), y), top_k=3, tol=1e-8, max_products=flat.numel()
    )
    assert estimate.converged
    torch.testing.assert_close(estimate.eigenvalues.cpu(), exact[-3:].flip(0), rtol=1e-6, atol=0)
