"""Full weight spectra of a model: singular values per layer, Marchenko–Pastur edge and spikes, power-law α,
compressible rank, and the empirical spectral density drawn against the MP law.

Meant for a slow cadence (every singular value of every weight). Weights and names are those of
:class:`~spectral_monitor.probes.WeightProbe` (q, k, v split out of packed projections). Every number comes
from :mod:`spectral_monitor.metrics`: the MP edge of :func:`~spectral_monitor.metrics.marchenko_pastur_edge`
(σ̂(√N + √M), σ̂² = ‖W‖_F²/(NM)), α of :func:`~spectral_monitor.metrics.spectra.power_law_alpha`
(WeightWatcher's convention), the energy ranks of :func:`~spectral_monitor.metrics.spectra.energy_rank`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

from spectral_monitor.metrics import marchenko_pastur_edge
from spectral_monitor.metrics.spectra import energy_rank, marchenko_pastur_density, power_law_alpha
from spectral_monitor.probes import WEIGHT_FAMILY, AttentionFamilies, WeightProbe
from spectral_monitor.probes.weight_norms import NormTarget, full_spectra
from spectral_monitor.records import Measurement
from spectral_monitor.sinks.figures import EsdDrawing, esd_drawing_figure

__all__ = [
    "SPECTRUM_METRICS",
    "WeightSpectrum",
    "esd_drawing",
    "esd_figure",
    "weight_spectra",
    "weight_spectrum_measurements",
]

ENERGY_LEVELS = (0.9, 0.99)
SPECTRUM_METRICS = ("mp_edge", "mp_spikes", "alpha", "alpha_ks_distance", "energy_rank_90", "energy_rank_99")
"""Family "weights" metrics written from a full spectrum (``energy_rank_<p>``: rank keeping p% of ‖W‖_F²)."""


@dataclass(frozen=True)
class WeightSpectrum:
    """The exact spectrum of one weight W (N×M as ``nn.Linear`` stores it) and what is read from it.

    Built by :func:`weight_spectra`; frozen. The Marchenko–Pastur (MP) edge is where the singular values of
    an N×M matrix of iid entries with W's mean square end: a singular value above it is a spike, structure
    the training put there.

    Attributes:
        layer: The weight's name, as :class:`~spectral_monitor.probes.WeightProbe` names it (the module's
            qualified name; q, k and v of a packed projection named apart).
        rows: N, the output features.
        cols: M, the input features.
        singular_values: float64 σ₁ ≥ σ₂ ≥ … ≥ 0, min(N, M) of them.
        mp_edge: σ̂(√N + √M) with σ̂² = ‖W‖_F²/(NM).
        mp_spikes: How many σᵢ exceed ``mp_edge``.
        stable_rank: ‖W‖_F²/σ₁², in [1, min(N, M)]; NaN for W = 0.
        alpha: The power-law exponent α fitted to the tail of the eigenvalues λᵢ = σᵢ²
            (:func:`~spectral_monitor.metrics.spectra.power_law_alpha`); NaN with too few non-zero λ.
        alpha_xmin: The λ_min where the fitted tail starts; NaN where ``alpha`` is.
        alpha_ks_distance: The Kolmogorov–Smirnov distance of the fit over the tail; NaN where ``alpha`` is.
        energy_rank_90: The smallest k with Σ_{i≤k} σᵢ² ≥ 0.9‖W‖_F².
        energy_rank_99: The smallest k with Σ_{i≤k} σᵢ² ≥ 0.99‖W‖_F².

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0])))
        >>> spectrum = weight_spectra(model)[0]
        >>> spectrum.eigenvalues.tolist(), round(spectrum.mp_edge**2, 6), spectrum.stable_rank
        ([16.0, 9.0, 4.0, 1.0], 30.0, 1.875)
        >>> spectrum.mp_spikes, spectrum.energy_rank_90, spectrum.energy_rank_99
        (0, 3, 4)
    """

    layer: str
    rows: int
    cols: int
    singular_values: np.ndarray
    mp_edge: float
    mp_spikes: int
    stable_rank: float
    alpha: float
    alpha_xmin: float
    alpha_ks_distance: float
    energy_rank_90: int
    energy_rank_99: int

    @property
    def eigenvalues(self) -> np.ndarray:
        """λᵢ = σᵢ², the eigenvalues of WᵀW (the ESD WeightWatcher fits), descending."""
        return self.singular_values**2


@torch.no_grad()
def weight_spectra(
    model: nn.Module,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    attention_families: AttentionFamilies | None = None,
    singular_values: Mapping[str, np.ndarray] | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[WeightSpectrum]:
    """The :class:`WeightSpectrum` of every weight ``WeightProbe(model, include=..., exclude=...)`` measures.

    The singular values are :meth:`~spectral_monitor.probes.WeightProbe.singular_values`': the eigenvalues
    of each weight's smaller Gram matrix formed in float64, so each eigenvalue λᵢ = σᵢ² is within ~1e-16·σ₁²
    and each σᵢ within ~1e-8·σ₁ of the exact one (float64 weights: ``svdvals``).

    Args:
        model: The model whose weights are read.
        include: ``fnmatch`` patterns over qualified module names; only matching weights are read.
        exclude: Patterns of weights left out.
        attention_families: Which attention modules' q, k and v are split out of packed weights (None:
            ``AttentionFamilies()``).
        singular_values: Spectra of these weights already decomposed at this step (a ``WeightProbe``'s
            :meth:`~spectral_monitor.probes.WeightProbe.singular_values` with the same patterns), by layer:
            used instead of decomposing the weights again.
        warn: What to do with the weight probe's warnings (a fused q/k/v projection it cannot split);
            None: a ``RuntimeWarning``.

    Returns:
        One spectrum per weight, in the model's order.

    Raises:
        ValueError: ``include`` or ``exclude`` is not a sequence of patterns, or ``attention_families`` not
            an ``AttentionFamilies``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0])))
        >>> [(spectrum.layer, spectrum.singular_values.tolist()) for spectrum in weight_spectra(model)]
        [('0', [4.0, 3.0, 2.0, 1.0])]
    """
    probe = WeightProbe(
        model,
        include=include,
        exclude=exclude,
        per_head=False,
        attention_families=attention_families,
        warn=warn,
    )
    named = list(probe.named_matrices())
    known = {} if singular_values is None else singular_values
    missing = [NormTarget(layer, None, matrix) for layer, matrix in named if layer not in known]
    spectra = {**known, **full_spectra(missing)}
    return [_spectrum(layer, *matrix.shape, torch.from_numpy(spectra[layer])) for layer, matrix in named]


def weight_spectrum_measurements(spectra: Sequence[WeightSpectrum], step: int) -> list[Measurement]:
    """The ``SPECTRUM_METRICS`` records of each spectrum, for a sink or the alerts.

    Args:
        spectra: Spectra of :func:`weight_spectra`.
        step: The step the records are filed under.

    Returns:
        Family "weights" records, layer = the weight's name: per spectrum, one per metric of
        ``SPECTRUM_METRICS`` in that order, counts as floats and NaN kept.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0])))
        >>> records = weight_spectrum_measurements(weight_spectra(model), step=5)
        >>> [(record.tag, round(record.value, 4)) for record in records if record.metric != "alpha"]
        [('weights/mp_edge/0', 5.4772), ('weights/mp_spikes/0', 0.0), ('weights/alpha_ks_distance/0', 0.3321),
         ('weights/energy_rank_90/0', 3.0), ('weights/energy_rank_99/0', 4.0)]
    """
    records = []
    for spectrum in spectra:
        for metric in SPECTRUM_METRICS:
            value = float(getattr(spectrum, metric))
            records.append(Measurement(step, WEIGHT_FAMILY, metric, spectrum.layer, value))
    return records


def esd_figure(spectrum: WeightSpectrum, title: str | None = None) -> Figure:
    """The empirical spectral density of one weight, drawn against the Marchenko–Pastur law.

    A density histogram of the eigenvalues λ = σ² of WᵀW against the MP density of an iid matrix of the same
    ‖W‖_F, with the MP bulk edge (``mp_edge``²) and the fitted power-law λ_min marked
    (:func:`~spectral_monitor.sinks.figures.esd_drawing_figure`). The x axis is logarithmic (zero
    eigenvalues left out) when the positive eigenvalues span more than two decades.

    Args:
        spectrum: What to draw.
        title: The axes' title; None: the weight's name, shape, spike count and α (:func:`esd_drawing`).

    Returns:
        A new matplotlib ``Figure`` (not attached to pyplot, so nothing to close).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0])))
        >>> figure = esd_figure(weight_spectra(model)[0])
        >>> figure.axes[0].get_title(), figure.axes[0].get_xscale()
        ('0 (4×4), 0 spikes, α = 1.63', 'linear')
    """
    return esd_drawing_figure(esd_drawing(spectrum, title))


def esd_drawing(spectrum: WeightSpectrum, title: str | None = None) -> EsdDrawing:
    """What :func:`esd_figure` draws of ``spectrum``, as :class:`~spectral_monitor.sinks.figures.EsdImages`
    takes it to redraw a kept figure.

    Args:
        spectrum: What to draw.
        title: The axes' title; None: the weight's name, shape and spike count, and α where a power law was
            fitted.

    Returns:
        The eigenvalues, the MP edge and density (of an iid matrix of the same ‖W‖_F), the power-law fit and
        the title.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(3, 2, bias=False)
        >>> _ = nn.init.zeros_(layer.weight).requires_grad_(False).fill_diagonal_(2.0)
        >>> drawing = esd_drawing(weight_spectra(nn.Sequential(layer))[0], title="layer 0")
        >>> sorted(drawing.eigenvalues.round(6).tolist()), drawing.title
        ([4.0, 4.0], 'layer 0')
    """
    eigenvalues = spectrum.eigenvalues
    rows, cols = spectrum.rows, spectrum.cols
    variance = float(np.sum(eigenvalues) / (rows * cols))
    law = None
    if variance > 0:

        def law(points: np.ndarray) -> np.ndarray:
            return marchenko_pastur_density(torch.from_numpy(points), rows, cols, variance).numpy()

    if title is None:
        title = f"{spectrum.layer} ({rows}×{cols}), {spectrum.mp_spikes} spikes"
        if np.isfinite(spectrum.alpha_xmin):
            title += f", α = {spectrum.alpha:.2f}"
    return EsdDrawing(eigenvalues, spectrum.mp_edge, law, spectrum.alpha, spectrum.alpha_xmin, title)


def _spectrum(layer: str, rows: int, cols: int, singular_values: torch.Tensor) -> WeightSpectrum:
    frobenius_squared = singular_values.square().sum()
    edge = marchenko_pastur_edge(frobenius_squared, rows, cols)
    sigma1 = singular_values[0]
    fit = power_law_alpha(singular_values.square())
    ranks = {level: int(energy_rank(singular_values, level)) for level in ENERGY_LEVELS}
    return WeightSpectrum(
        layer=layer,
        rows=rows,
        cols=cols,
        singular_values=singular_values.cpu().numpy(),
        mp_edge=float(edge),
        mp_spikes=int((singular_values > edge).sum()),
        stable_rank=float(frobenius_squared / sigma1.square()) if sigma1 > 0 else float("nan"),
        alpha=float(fit["alpha"]),
        alpha_xmin=float(fit["xmin"]),
        alpha_ks_distance=float(fit["ks_distance"]),
        energy_rank_90=ranks[0.9],
        energy_rank_99=ranks[0.99],
    )
