"""Architecture preflight: static checks of a transformer before it trains, each finding with its reason.

Checks (the correct versions of the survey's; its thresholds are not used):

- ``heads``: the model width divides into the heads (modules with a head count and a width attribute, by
  the names of the :class:`~spectral_monitor.probes.AttentionFamilies` given).
- ``head_dim``: d_k of each attention module. Each head's logit matrix scale·QKᵀ has rank ≤ d_k, so a head
  can express logit patterns of rank d_k at most (Bhojanapalli et al. 2020, "Low-rank bottleneck in
  multi-head attention"); reported as information, a warning below ``SMALL_HEAD_DIM``.
- ``depth``: transformer blocks against normalisation layers. Without normalisation the residual stream's
  scale is unconstrained and attention-only paths lose rank doubly exponentially with depth (Dong et al.
  2021);
  post-LN ``nn.TransformerEncoderLayer`` stacks have large gradients near the output at initialisation and
  need learning-rate warm-up (Xiong et al. 2020), pre-LN (``norm_first=True``) does not.
- ``init_scale``: each weight's σ₁ against the Marchenko–Pastur edge σ̂(√N + √M) of an iid matrix with the
  same ‖W‖_F. At an iid initialisation σ₁ sits at the edge (ratio ≈ 1, finite-size fluctuations of a few
  percent) with no spikes; a ratio well above 1 means the weight is not iid (loaded, low-rank or structured).
- ``logit_scale``: the standard deviation s of each head's initial logits for inputs with iid unit-variance
  coordinates (what a LayerNorm feeds it): s = scale·‖W_Q^hᵀ W_K^h‖_F exactly. At context length n a key
  needs a logit margin of log(n − 1) over the rest to get half the mass; logits of std s ≪ 1 give nearly
  uniform rows (normalised entropy ≈ 1 − s²/(2 log n)) and, without a causal mask, nearly rank-one attention
  (σ₂ ≈ (s/√d_k)(1 + √(d_k/n))², :func:`~spectral_monitor.metrics.baselines.random_attention_sigma2`).
  A warning when that σ₂ is below ``RANK_ONE_SIGMA2`` for attention not known to be causal.
- ``qkv_layout``: an attention module type whose q, k and v are fused in one projection in a layout none of
  the :class:`~spectral_monitor.probes.AttentionFamilies` splits, so its weights are measured whole, without
  per-head metrics; reported as information, with the layout to give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from spectral_monitor.metrics import marchenko_pastur_edge
from spectral_monitor.metrics.baselines import random_attention_sigma2
from spectral_monitor.probes import WeightProbe, find_transformer_blocks
from spectral_monitor.probes.attention_families import AttentionFamilies
from spectral_monitor.probes.weight_norms import NormTarget, full_spectra
from spectral_monitor.toolbox.length_scaling import LengthScaledAttention, attention_logit_scale

__all__ = ["Finding", "architecture_preflight", "preflight_markdown"]

Severity = Literal["info", "warning"]
SMALL_HEAD_DIM = 8
RANK_ONE_SIGMA2 = 0.05
"""σ₂ below this (gap 1 − σ₂ above 0.95, the collapse level the demo configs measure) counts as rank one."""
NOT_IID_RATIO = 1.5
"""σ₁ above this multiple of the MP edge: the weight is not an iid draw."""
EXACT_MAX_SIDE = 2048


@dataclass(frozen=True)
class Finding:
    """One result of the preflight.

    Attributes:
        check: Which check: ``heads``, ``head_dim``, ``depth``, ``logit_scale``, ...
        severity: ``"info"`` or ``"warning"``.
        where: The module's qualified name (``"model"`` for the whole model).
        message: Why, in a sentence.

    Examples:
        >>> finding = Finding("head_dim", "warning", "blocks.0.attn", "d_k = 4: logits of rank <= 4")
        >>> finding.where, finding.severity
        ('blocks.0.attn', 'warning')
    """

    check: str
    severity: Severity
    where: str
    message: str


@torch.no_grad()
def architecture_preflight(
    model: nn.Module,
    *,
    context_length: int | None = None,
    attention_families: AttentionFamilies | None = None,
) -> list[Finding]:
    """Run the checks of the module docstring on ``model``.

    Reads weights only (detached float64 copies); no forward is run and nothing is modified.

    Args:
        model: The transformer to check.
        context_length: The longest context it will see; enables the ``logit_scale`` check.
        attention_families: How its attention modules are recognised, counted and read (None:
            ``AttentionFamilies()``).

    Returns:
        The findings, each with its check, severity, module and reason.

    Raises:
        ValueError: ``model`` is not a module, ``context_length`` is not an int of at least 2, or
            ``attention_families`` is not an ``AttentionFamilies``.

    Examples:
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        >>> findings = architecture_preflight(nn.TransformerEncoder(layer, num_layers=2))
        >>> [(finding.check, finding.severity) for finding in findings]
        [('head_dim', 'info'), ('head_dim', 'info'), ('depth', 'info')]
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if context_length is not None and (
        isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 2
    ):
        raise ValueError(f"context_length must be an int >= 2 or None, got {context_length!r}")
    unsplit: list[str] = []  # what the weight probe would warn of: filed as findings instead
    probe = WeightProbe(model, per_head=False, attention_families=attention_families, warn=unsplit.append)
    findings = _head_counts(model, probe.attention_families)
    attention = probe.attention_weights()
    for name, weights in attention:
        findings += _head_dim(name, weights)
        if context_length is not None:
            findings += _logit_scale(model, name, weights, context_length)
    findings += _depth(model)
    findings += _init_scale(probe)
    findings += [
        Finding("qkv_layout", "info", "model", message.removeprefix("SpectralMonitor: ").rstrip("."))
        for message in unsplit
    ]
    return findings


def preflight_markdown(findings: list[Finding]) -> str:
    """The findings as a markdown table, warnings first.

    Args:
        findings: What :func:`architecture_preflight` returned.

    Returns:
        The table, one row per finding.

    Examples:
        >>> print(preflight_markdown([Finding("depth", "info", "model", "2 blocks, 4 norms")]))
        | severity | check | where | finding |
        |---|---|---|---|
        | info | depth | model | 2 blocks, 4 norms |
    """
    lines = ["| severity | check | where | finding |", "|---|---|---|---|"]
    for finding in sorted(findings, key=lambda f: f.severity != "warning"):
        lines.append(f"| {finding.severity} | {finding.check} | {finding.where} | {finding.message} |")
    return "\n".join(lines)


def _head_counts(model: nn.Module, families: AttentionFamilies) -> list[Finding]:
    findings = []
    for name, module in model.named_modules():
        heads, width = families.declared_head_count(module), families.declared_model_width(module)
        if heads and width and width % heads:
            findings.append(
                Finding(
                    "heads",
                    "warning",
                    name or "model",
                    f"width {width} is not divisible by {heads} heads: heads cannot split the width evenly",
                )
            )
    return findings


def _head_dim(name: str, weights) -> list[Finding]:
    d_k = weights.query.shape[0] // weights.num_heads
    severity: Severity = "warning" if d_k < SMALL_HEAD_DIM else "info"
    return [
        Finding(
            "head_dim",
            severity,
            name or "model",
            f"d_k = {d_k} ({weights.num_heads} heads): each head's logits q·k have rank ≤ {d_k}, the most "
            "structure a head's attention pattern can have in its logits (low-rank bottleneck)",
        )
    ]


def _logit_scale(model: nn.Module, name: str, weights, context_length: int) -> list[Finding]:
    module = model.get_submodule(name)
    d_k = weights.query.shape[0] // weights.num_heads
    if isinstance(module, LengthScaledAttention):
        scale = attention_logit_scale(
            d_k, context_length, module.logit_scaling, module.log_n_gamma, module.train_seq_len
        )
    else:
        scale = 1 / math.sqrt(d_k)
    group = weights.num_heads // weights.key_value_heads
    query = weights.query.double().reshape(weights.num_heads, d_k, -1)
    key = weights.key.double().reshape(weights.key_value_heads, d_k, -1).repeat_interleave(group, dim=0)
    stds = scale * torch.linalg.matrix_norm(query.transpose(1, 2) @ key)
    s = float(stds.median())
    sigma2 = random_attention_sigma2(context_length, d_k, s)
    entropy = 1 - s**2 / (2 * math.log(context_length))
    causal = bool(getattr(module, "causal", False) or getattr(module, "is_causal", False))
    collapsed = sigma2 < RANK_ONE_SIGMA2
    message = (
        f"initial logit std s = {s:.3g} (median over heads, scale {scale:.3g}) at n = {context_length}: "
        f"a key needs a margin of log(n − 1) = {math.log(context_length - 1):.2f} to get half the mass; "
        f"predicted normalised entropy ≈ {entropy:.3f}, σ₂ ≈ {sigma2:.3g} without a mask"
    )
    if collapsed and causal:
        message += " (causal: the mask keeps uniform attention away from rank one)"
    elif collapsed:
        message += (
            ": initial attention is nearly uniform and nearly rank one; training must grow ‖W_Qᵀ W_K‖ by "
            "about log n / s, or scale logits with γ·log n (LengthScaledAttention)"
        )
    severity: Severity = "warning" if collapsed and not causal else "info"
    return [Finding("logit_scale", severity, name or "model", message)]


def _depth(model: nn.Module) -> list[Finding]:
    blocks = find_transformer_blocks(model)
    if not blocks:
        return []
    norms = [name for name, module in model.named_modules() if "Norm" in type(module).__name__]
    depth = len(blocks)
    if not norms and depth >= 2:
        return [
            Finding(
                "depth",
                "warning",
                "model",
                f"{depth} blocks and no normalisation layer: the residual stream's scale is unconstrained "
                "and attention-only paths lose rank doubly exponentially with depth",
            )
        ]
    post_ln = [
        name
        for name in blocks
        if isinstance(
            module := model.get_submodule(name), (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
        )
        and not module.norm_first
    ]
    if post_ln and depth >= 6:
        return [
            Finding(
                "depth",
                "warning",
                "model",
                f"{depth} post-LN blocks (norm_first=False): gradients near the output are large at "
                "initialisation, so this depth needs learning-rate warm-up; norm_first=True (pre-LN) "
                "does not",
            )
        ]
    return [Finding("depth", "info", "model", f"{depth} blocks, {len(norms)} normalisation layers")]


def _init_scale(probe: WeightProbe) -> list[Finding]:
    findings = []
    weights = {
        layer: weight for layer, weight in probe.named_matrices() if 2 <= min(weight.shape) <= EXACT_MAX_SIDE
    }
    spectra = full_spectra([NormTarget(layer, None, weight) for layer, weight in weights.items()])
    for layer, weight in weights.items():
        rows, cols = weight.shape
        sigma = torch.from_numpy(spectra[layer]).double()
        frobenius_squared = sigma.square().sum()
        if frobenius_squared == 0:
            findings.append(Finding("init_scale", "info", layer, "all zeros (a zero-initialised projection)"))
            continue
        edge = float(marchenko_pastur_edge(frobenius_squared, rows, cols))
        ratio = float(sigma[0]) / edge
        spikes = int((sigma > edge).sum())
        if ratio > NOT_IID_RATIO:
            findings.append(
                Finding(
                    "init_scale",
                    "info",
                    layer,
                    f"σ₁ = {ratio:.2f}× the Marchenko–Pastur edge with {spikes} spikes: not an iid draw "
                    "(loaded, low-rank or structured weights); at an iid initialisation σ₁ sits at the edge",
                )
            )
    return findings
