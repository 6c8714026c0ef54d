"""σ₁ and σ₂ at long context on attention written outside this project, against float64.

Above 384 tokens bidirectional attention goes through the Krylov path, where a σ₂ far below σ₁ (the
near-uniform attention of a freshly initialised model, or a head with a sink after training) is beyond what
float32 Gram products resolve. Each ``nn.MultiheadAttention`` of an ``nn.TransformerEncoder`` is called
again on its own inputs with ``need_weights=True`` in float64, and every head's written σ₁, σ₂ must be
within 1e-4 of the singular values of those probabilities.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from helpers.events import read_back
from torch import nn

from spectral_monitor import Monitor

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TOKENS, WIDTH, HEADS = 512, 64, 4


def encoder() -> nn.TransformerEncoder:
    """Two post-LN layers whose q, k projections have GPT-2's scale (near-uniform attention)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    for block in model.layers:
        nn.init.normal_(block.self_attn.in_proj_weight, std=0.02)  # GPT-2's scale: near-uniform attention
    return model


def inputs(sink: float) -> torch.Tensor:
    """Two sequences; with ``sink`` > 0 the first token is that many times larger than the rest, so its key
    draws every query of the first layer (a trained sink head's pattern)."""
    x = torch.randn(2, TOKENS, WIDTH, generator=torch.Generator().manual_seed(1))
    x[:, 0] *= 1.0 + sink
    return x


@pytest.mark.parametrize("sink", [0.0, 60.0], ids=["near_uniform", "sink"])
def test_sigma1_and_sigma2_of_every_head_equal_float64(sink: float, tmp_path: Path) -> None:
    model, x = encoder(), inputs(sink)
    seen: list[tuple[nn.MultiheadAttention, torch.Tensor]] = []
    handles = [
        block.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, block=block: seen.append((module, args[0].detach().clone())),
            with_kwargs=True,
        )
        for block in model.layers
    ]
    monitor = Monitor(model, tmp_path, every_n_steps=1, families=["attention"], per_head=True,
                      attention_cost_ratio=math.inf, histograms=False, figures_every_n_logs=0)  # fmt: skip
    with monitor.step(0):
        model(x)  # with gradients, as a training forward: under no_grad the fused fast path runs
    monitor.close()
    for handle in handles:
        handle.remove()
    events = read_back(tmp_path)
    assert len(seen) == 2
    smallest_ratio = math.inf
    for index, (module, query) in enumerate(seen):
        exact = copy.deepcopy(module).double().requires_grad_(False)
        _, probabilities = exact(*(query.double(),) * 3, need_weights=True, average_attn_weights=False)
        singular = torch.linalg.svdvals(probabilities)  # (sequences, heads, n)
        expected = singular[..., :2].mean(dim=0)  # the layer's value: the mean over the sampled sequences
        smallest_ratio = min(smallest_ratio, float((singular[..., 1] / singular[..., 0]).min()))
        for head in range(HEADS):
            for position, metric in enumerate(("sigma1", "sigma2")):
                (written,) = events.Scalars(f"attention/{metric}/layers.{index}.self_attn/head_{head}")
                assert written.value == pytest.approx(float(expected[head, position]), rel=1e-4), (
                    index, head, metric,
                )  # fmt: skip
    assert smallest_ratio < 0.03  # σ₂² under 1e-3 of σ₁²: the regime the Gram operator cannot resolve
