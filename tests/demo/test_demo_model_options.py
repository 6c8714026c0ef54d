"""The demo model's options for instability experiments. QK-norm: off by default (same parameters, same
outputs), and when on, the logits the monitor measures are those of the normalised q and k, checked against
a float64 recomputation. Learning-rate warm-up: linear to ``lr``, then constant; none by default."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.reference_metrics import max_logit_reference

from spectral_monitor.demo import DemoTransformer
from spectral_monitor.probes import AttentionCapture
from spectral_monitor.toolbox import LengthScaledAttention

SMALL = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=2, seq_len=12)


def test_qk_norm_is_off_by_default_and_adds_no_parameter() -> None:
    default = DemoTransformer(**SMALL)
    explicit = DemoTransformer(**SMALL, qk_norm="none")
    assert default.hparams.qk_norm == "none"
    assert [name for name, _ in default.named_parameters()] == [
        name for name, _ in explicit.named_parameters()
    ]
    assert not any("q_norm" in name or "k_norm" in name for name, _ in default.named_parameters())
    tokens = torch.randint(40, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(default(tokens), explicit(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("qk_norm", ["layer", "rms"])
def test_qk_norm_leaves_the_other_weights_as_without_it(qk_norm: str) -> None:
    plain = dict(DemoTransformer(**SMALL).named_parameters())
    normed = dict(DemoTransformer(**SMALL, qk_norm=qk_norm).named_parameters())
    added = sorted(set(normed) - set(plain))
    assert added == sorted(
        f"blocks.{layer}.attention.{which}_norm.{part}"
        for layer in range(2)
        for which in ("q", "k")
        for part in (("weight", "bias") if qk_norm == "layer" else ("weight",))
    )
    for name, parameter in plain.items():
        torch.testing.assert_close(normed[name], parameter, rtol=0, atol=0)
    for name in added:
        assert torch.all(normed[name] == (1.0 if name.endswith("weight") else 0.0)), name


def test_an_unknown_qk_norm_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        LengthScaledAttention(16, 2, qk_norm="batch")  # type: ignore[arg-type]


def _normalised_heads(x: np.ndarray, gain: np.ndarray, bias: np.ndarray | None, heads: int) -> np.ndarray:
    """(n, d) -> (heads, n, d/heads), each head's vectors normalised over its width in float64."""
    n, d = x.shape
    per_head = x.reshape(n, heads, d // heads).transpose(1, 0, 2)
    if bias is None:  # RMSNorm
        eps = torch.finfo(torch.float32).eps
        return gain * per_head / np.sqrt((per_head**2).mean(-1, keepdims=True) + eps)
    centred = per_head - per_head.mean(-1, keepdims=True)
    return gain * centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5) + bias


@pytest.mark.parametrize("qk_norm", ["layer", "rms"])
def test_the_captured_max_logit_is_that_of_the_normalised_q_and_k(qk_norm: str) -> None:
    model = DemoTransformer(**SMALL, qk_norm=qk_norm, init_std=0.5).eval()
    attention = model.blocks[1].attention
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # gains and biases away from (1, 0), as after training
        for parameter in (*attention.q_norm.parameters(), *attention.k_norm.parameters()):
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    tokens = torch.randint(40, (2, 12), generator=generator)
    inputs = {}
    attention.register_forward_pre_hook(lambda module, args: inputs.setdefault("x", args[0].detach()))
    with AttentionCapture(model, max_sequences=2).armed() as recording:
        model(tokens)
    (captured,) = [c for c in recording.captured if c.layer == "blocks.1.attention"]
    measured = captured.sample().max_logit
    assert measured is not None and measured.shape == (2, 2)

    head_dim = 16 // 2
    weight = attention.qkv.weight.detach().double().numpy()
    bias = attention.qkv.bias.detach().double().numpy()
    norms = {}
    for which in ("q", "k"):
        module = getattr(attention, f"{which}_norm")
        norms[which] = (
            module.weight.detach().double().numpy(),
            None if qk_norm == "rms" else module.bias.detach().double().numpy(),
        )
    for sequence in range(2):
        projected = inputs["x"][sequence].double().numpy() @ weight.T + bias
        q = _normalised_heads(projected[:, :16], *norms["q"], heads=2)
        k = _normalised_heads(projected[:, 16:32], *norms["k"], heads=2)
        raw_q = projected[:, :16].reshape(12, 2, head_dim).transpose(1, 0, 2)
        raw_k = projected[:, 16:32].reshape(12, 2, head_dim).transpose(1, 0, 2)
        for head in range(2):
            expected = max_logit_reference(q[head], k[head], scale=1 / math.sqrt(head_dim), causal=True)
            assert float(measured[sequence, head]) == pytest.approx(expected, rel=1e-5)
            unnormalised = max_logit_reference(
                raw_q[head], raw_k[head], scale=1 / math.sqrt(head_dim), causal=True
            )
            assert float(measured[sequence, head]) != pytest.approx(unnormalised, rel=1e-2)


def _learning_rates(model: DemoTransformer, steps: int) -> list[float]:
    configured = model.configure_optimizers()
    if isinstance(configured, torch.optim.Optimizer):
        return [group["lr"] for group in configured.param_groups[:1]] * steps
    optimizer, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_warmup_raises_the_learning_rate_linearly_then_holds_it() -> None:
    rates = _learning_rates(DemoTransformer(**SMALL, lr=0.1, warmup_steps=4), steps=6)
    assert rates == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    assert _learning_rates(DemoTransformer(**SMALL, lr=0.1), steps=3) == [0.1] * 3
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        DemoTransformer(**SMALL, warmup_steps=-1)
