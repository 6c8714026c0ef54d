"""Rank-collapse sweep: attention and token metrics of a model (or an attention module) against length n.

For each sequence length n the model runs one forward on inputs of that length (random ones by default) with
:class:`~spectral_monitor.probes.AttentionCapture` and :class:`~spectral_monitor.probes.ResidualCapture`
armed; the captured attention goes through :func:`~spectral_monitor.metrics.attention_metrics` and the block
outputs through :func:`~spectral_monitor.metrics.token_metrics`, so every number means what it means in
training. The result is a table (n, family, layer, metric, value) and a figure against n on log axes with the
random-attention baselines of :mod:`spectral_monitor.metrics.baselines`, evaluated at each layer's measured
logit standard deviation and d_k.

The model is left as found: its train/eval mode is restored, parameters and buffers are not written, and the
random inputs come from a private generator (the global RNG is forked around the forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from spectral_monitor.metrics import ATTENTION_METRICS, attention_metrics, token_metrics
from spectral_monitor.metrics.baselines import iid_logit_spectral_gap, random_attention_sigma2
from spectral_monitor.probes import AttentionCapture, CapturedAttention, ResidualCapture

__all__ = ["SweepResult", "default_inputs", "rank_collapse_sweep", "sweep_figure"]

InputFactory = Callable[[int, torch.Generator], Any]
"""``make_inputs(n, generator)`` -> the forward's input for sequence length n: a tensor, a tuple of positional
arguments, or a dict of keyword arguments."""

DEFAULT_FIGURE_METRICS = (
    ("attention", "spectral_gap"),
    ("attention", "sigma2"),
    ("attention", "entropy"),
    ("attention", "rank_one_residual"),
    ("tokens", "cosine_similarity"),
)
LOGIT_STD = "logit_std"
"""An extra attention row of the table: the measured standard deviation of the scaled logits (valid entries),
the s of the baselines."""


@dataclass
class SweepResult:
    """The table of a sweep: one row per (n, family, layer, metric), values averaged over sequences and heads.

    Attributes:
        lengths: The sequence lengths swept.
        rows: ``{"n", "family", "layer", "metric", "value"}`` dicts.
        head_dims: d_k of each attention layer.
        masked: Whether each attention layer is causal or masked (the baselines are for unmasked attention
            and are not drawn for masked layers).

    Examples:
        >>> result = SweepResult([8], [{"n": 8, "family": "attention", "layer": "a", "metric": "entropy",
        ...                              "value": 0.5}])
        >>> result.value(8, "a", "entropy"), result.layers()
        (0.5, ['a'])
    """

    lengths: list[int]
    rows: list[dict[str, Any]] = field(default_factory=list)
    head_dims: dict[str, int] = field(default_factory=dict)
    masked: dict[str, bool] = field(default_factory=dict)

    def value(self, n: int, layer: str, metric: str, family: str = "attention") -> float:
        """The value of one cell.

        Args:
            n: The sequence length.
            layer: The layer name.
            metric: The metric name.
            family: The metric family.

        Returns:
            The measured value.

        Raises:
            KeyError: The sweep has no such row.
        """
        for row in self.rows:
            if (row["n"], row["family"], row["layer"], row["metric"]) == (n, family, layer, metric):
                return row["value"]
        raise KeyError(f"no row for n={n}, family={family!r}, layer={layer!r}, metric={metric!r}")

    def series(self, layer: str, metric: str, family: str = "attention") -> np.ndarray:
        """The values of one (layer, metric) at each of ``lengths``.

        Args:
            layer: The layer name.
            metric: The metric name.
            family: The metric family.

        Returns:
            One value per length, NaN where the sweep has no row.
        """
        lookup = {
            row["n"]: row["value"]
            for row in self.rows
            if (row["family"], row["layer"], row["metric"]) == (family, layer, metric)
        }
        return np.array([lookup.get(n, math.nan) for n in self.lengths], dtype=float)

    def layers(self, family: str = "attention") -> list[str]:
        """The layers measured in one family.

        Args:
            family: The metric family.

        Returns:
            The layer names, in the order of the rows.
        """
        return list(dict.fromkeys(row["layer"] for row in self.rows if row["family"] == family))

    def to_markdown(self, metrics: Sequence[tuple[str, str]] = DEFAULT_FIGURE_METRICS) -> str:
        """The sweep as a Markdown table, one line per (family, metric, layer) and one column per n.

        Args:
            metrics: The (family, metric) pairs to show.

        Returns:
            The table's Markdown.
        """
        header = "| family | metric | layer | " + " | ".join(f"n={n}" for n in self.lengths) + " |"
        lines = [header, "|---|---|---|" + "---:|" * len(self.lengths)]
        for family, metric in metrics:
            for layer in self.layers(family):
                values = " | ".join(f"{v:.4g}" for v in self.series(layer, metric, family))
                lines.append(f"| {family} | {metric} | {layer} | {values} |")
        return "\n".join(lines)


def rank_collapse_sweep(
    model: nn.Module,
    lengths: Sequence[int],
    *,
    make_inputs: InputFactory | None = None,
    inputs: Tensor | None = None,
    num_sequences: int = 2,
    method: str = "auto",
    include_rank_sums: bool = False,
    seed: int = 0,
) -> SweepResult:
    """Measure ``model``'s attention and token metrics at each sequence length of ``lengths``.

    Token metrics are measured when the model has transformer blocks. The model is left as found.

    Args:
        model: A transformer, or a single attention module.
        lengths: The sequence lengths n, each at least 2.
        make_inputs: ``make_inputs(n, generator)`` returns the batch of length n; by default
            :func:`default_inputs` (random token ids for a model with an embedding, Gaussian vectors for an
            attention module or a model that starts with a linear layer).
        inputs: A batch of the user's own, (batch, ≥ max(lengths), ...), whose first n positions are used at
            each n; it takes precedence over ``make_inputs``.
        num_sequences: Sequences measured per length.
        method: That of :func:`~spectral_monitor.metrics.attention_metrics`.
        include_rank_sums: Also the effective and threshold ranks, which cost a full spectrum.
        seed: Seed of the random inputs' private generator.

    Returns:
        The table, one row per (n, family, layer, metric), values averaged over sequences and heads.

    Raises:
        ValueError: ``model`` is not a module, a length is below 2, ``num_sequences`` is not a positive int,
            or ``inputs`` has fewer than max(lengths) positions.

    Examples:
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        >>> result = rank_collapse_sweep(nn.TransformerEncoder(layer, num_layers=2), [8, 32])
        >>> result.lengths, result.layers()
        ([8, 32], ['layers.0.self_attn', 'layers.1.self_attn'])
        >>> bool(0 <= result.value(32, "layers.0.self_attn", "entropy") <= 1)
        True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    lengths = _checked_lengths(lengths)
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 1:
        raise ValueError(f"num_sequences must be a positive int, got {num_sequences!r}")
    if inputs is not None and (
        not isinstance(inputs, Tensor) or inputs.ndim < 2 or inputs.shape[1] < max(lengths)
    ):
        raise ValueError(
            "inputs must be a tensor (batch, positions, ...) with at least max(lengths) = "
            f"{max(lengths)} positions, got {_describe(inputs)}"
        )
    factory = make_inputs if make_inputs is not None else default_inputs(model, num_sequences)
    attention_capture = AttentionCapture(model, max_sequences=num_sequences, strict=True)
    try:
        residual_capture: ResidualCapture | None = ResidualCapture(model, max_sequences=num_sequences)
    except ValueError:  # no transformer blocks (e.g. a single attention module): attention only
        residual_capture = None

    result = SweepResult(lengths)
    generator = torch.Generator().manual_seed(seed)
    modes = {module: module.training for module in model.modules()}
    try:
        model.eval()
        for n in lengths:
            batch = inputs[:num_sequences, :n] if inputs is not None else factory(n, generator)
            recording, residual = _forward(model, batch, attention_capture, residual_capture)
            for captured in recording.captured:
                _add_attention_rows(result, n, captured, method, include_rank_sums)
            for sample in residual.states if residual is not None else ():
                metrics = token_metrics(sample.states, token_mask=sample.token_mask)
                metrics.pop("nonfinite")
                for metric, values in metrics.items():
                    result.rows.append(_row(n, "tokens", sample.layer, metric, values.mean()))
            if not recording.captured:
                reasons = "; ".join(f"{s.layer}: {s.reason}" for s in recording.skipped) or "none called"
                raise ValueError(f"no attention was captured at n={n} ({reasons})")
    finally:
        for module, training in modes.items():
            module.train(training)
    return result


def default_inputs(model: nn.Module, num_sequences: int = 2) -> InputFactory:
    """Random inputs for ``model``.

    Args:
        model: A model with an ``nn.Embedding``, an ``nn.MultiheadAttention``, or a model whose first linear
            layer takes the features (an attention module such as
            :class:`~spectral_monitor.toolbox.LengthScaledAttention`).
        num_sequences: The batch size.

    Returns:
        ``make_inputs(n, generator)``: uniform token ids of the first embedding's vocabulary, q = k = v
        standard-normal vectors for an ``nn.MultiheadAttention``, or standard-normal (batch, n, features)
        vectors.

    Raises:
        ValueError: The model is none of these.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> make_inputs = default_inputs(nn.Sequential(nn.Embedding(10, 4)), num_sequences=3)
        >>> make_inputs(5, torch.Generator().manual_seed(0)).shape
        torch.Size([3, 5])
    """
    if isinstance(model, nn.MultiheadAttention):

        def multi_head(n: int, generator: torch.Generator) -> dict[str, Tensor]:
            shape = (
                (num_sequences, n, model.embed_dim)
                if model.batch_first
                else (n, num_sequences, model.embed_dim)
            )
            x = _gaussian(shape, model, generator)
            return {"query": x, "key": x, "value": x, "need_weights": False}

        return multi_head
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:

        def tokens(n: int, generator: torch.Generator) -> Tensor:
            ids = torch.randint(0, embedding.num_embeddings, (num_sequences, n), generator=generator)
            return ids.to(embedding.weight.device)

        return tokens
    linear = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if linear is not None:

        def vectors(n: int, generator: torch.Generator) -> Tensor:
            return _gaussian((num_sequences, n, linear.in_features), model, generator)

        return vectors
    raise ValueError(
        f"cannot make random inputs for {type(model).__name__} (no nn.Embedding, nn.Linear or "
        "nn.MultiheadAttention found); pass make_inputs(n, generator) or inputs"
    )


def sweep_figure(
    result: SweepResult, metrics: Sequence[tuple[str, str]] = DEFAULT_FIGURE_METRICS, title: str = ""
) -> Figure:
    """One panel per (family, metric) against n (log axis), one line per layer, with the baselines.

    ``attention/spectral_gap`` gets the iid-logit gap 1 − 2√(e^{s²} − 1)/√n and ``attention/sigma2`` (log
    axis) the real-logit law (s/√d_k)(1 + √(d_k/n))², both dashed, at each non-causal layer's measured logit
    standard deviation s (rows ``logit_std``).

    Args:
        result: What :func:`rank_collapse_sweep` returned.
        metrics: The (family, metric) panels.
        title: The figure's title.

    Returns:
        A matplotlib ``Figure``, not registered with ``pyplot``.

    Raises:
        ValueError: The sweep has no rows for any of ``metrics``.

    Examples:
        >>> result = SweepResult([8, 16], [{"n": n, "family": "attention", "layer": "a", "metric": "entropy",
        ...                                 "value": 0.5} for n in (8, 16)])
        >>> len(sweep_figure(result, [("attention", "entropy")]).axes)
        1
    """
    panels = [(family, metric) for family, metric in metrics if result.layers(family)]
    if not panels:
        raise ValueError("the sweep has no rows for any of the requested metrics")
    figure = Figure(figsize=(3.6 * len(panels), 3.4), dpi=100, layout="constrained")
    axes_list = np.atleast_1d(figure.subplots(1, len(panels)))
    n = np.array(result.lengths, dtype=float)
    for axes, (family, metric) in zip(axes_list, panels, strict=True):
        for index, layer in enumerate(result.layers(family)):
            color = f"C{index % 10}"
            axes.plot(n, result.series(layer, metric, family), marker="o", color=color, label=layer)
            if family != "attention" or result.masked.get(layer, False):
                continue
            baseline = _baseline(result, layer, metric)
            if baseline is not None:
                label = "baseline" if index == 0 else None
                axes.plot(n, baseline, linestyle="--", color=color, alpha=0.7, label=label)
        axes.set_xscale("log", base=2)
        if metric == "sigma2":
            axes.set_yscale("log")
        axes.set_xlabel("sequence length n")
        axes.set_title(f"{family}/{metric}", fontsize="medium")
        axes.grid(True, which="both", alpha=0.3)
    axes_list[0].legend(fontsize="x-small")
    if title:
        figure.suptitle(title)
    return figure


def _baseline(result: SweepResult, layer: str, metric: str) -> np.ndarray | None:
    stds = result.series(layer, LOGIT_STD)
    if metric == "spectral_gap":
        return np.array([iid_logit_spectral_gap(n, s) for n, s in zip(result.lengths, stds, strict=True)])
    if metric == "sigma2":
        d_k = result.head_dims[layer]
        return np.array(
            [random_attention_sigma2(n, d_k, s) for n, s in zip(result.lengths, stds, strict=True)]
        )
    return None


def _forward(
    model: nn.Module, batch: Any, attention: AttentionCapture, residual: ResidualCapture | None
) -> tuple[Any, Any]:
    # Grad stays on when a module would otherwise take torch's fused inference path, which a capture must
    # not disable silently (the capture then refuses); nothing here calls backward, the graph is dropped.
    needs_grad = any(
        isinstance(m, (nn.MultiheadAttention, nn.TransformerEncoderLayer)) for m in model.modules()
    )
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(needs_grad):
        recording = attention.arm()
        residual_recording = residual.arm() if residual is not None else None
        try:
            if isinstance(batch, Mapping):
                model(**batch)
            elif isinstance(batch, tuple):
                model(*batch)
            else:
                model(batch)
        finally:
            recording = attention.disarm()
            if residual is not None:
                residual_recording = residual.disarm()
    return recording, residual_recording


@torch.no_grad()
def _add_attention_rows(
    result: SweepResult, n: int, captured: CapturedAttention, method: str, include_rank_sums: bool
) -> None:
    sample = captured.sample()
    heads = sample.probs.shape[1]
    expand = lambda mask: None if mask is None else mask[:, None, :].expand(-1, heads, -1)  # noqa: E731
    metrics = attention_metrics(
        sample.probs,
        key_mask=expand(sample.key_mask),
        query_mask=expand(sample.query_mask),
        causal=sample.causal,
        method=method,
        include_rank_sums=include_rank_sums,
    )
    for metric in ATTENTION_METRICS:
        values = metrics[metric]
        if bool(values.isnan().all()):  # undefined here (eigen_gap of causal attention, skipped rank sums)
            continue
        result.rows.append(_row(n, "attention", sample.layer, metric, values.nanmean()))
    logits = captured.logits()
    valid = torch.isfinite(logits)
    result.rows.append(_row(n, "attention", sample.layer, LOGIT_STD, logits[valid].double().std()))
    result.head_dims[sample.layer] = captured.q.shape[-1]
    result.masked[sample.layer] = sample.causal or captured.mask is not None


def _row(n: int, family: str, layer: str, metric: str, value: Tensor) -> dict[str, Any]:
    return {"n": n, "family": family, "layer": layer, "metric": metric, "value": float(value)}


def _gaussian(shape: tuple[int, ...], model: nn.Module, generator: torch.Generator) -> Tensor:
    reference = next(model.parameters(), None)
    x = torch.randn(shape, generator=generator)
    return x if reference is None else x.to(device=reference.device, dtype=reference.dtype)


def _checked_lengths(lengths: Sequence[int]) -> list[int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise ValueError(f"lengths must be a non-empty list of sequence lengths >= 2, got {lengths!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 2 for n in lengths):
        raise ValueError(f"lengths must be ints >= 2, got {list(lengths)!r}")
    return sorted(set(lengths))


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
