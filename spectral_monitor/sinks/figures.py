"""The figures the monitor draws: spectra, attention maps, layer × head summaries and weight ESDs.

Figures are built on ``matplotlib.figure.Figure`` directly, never through ``pyplot``: no figure is
registered globally, nothing has to be closed to be freed, and the user's backend is left alone
(rendering goes through the Agg canvas the sink creates). Sizes are fixed so each PNG stays small.

They are drawn on training steps, so they are laid out by hand (fixed margins, explicit colour-bar axes)
and use no mathtext: the constrained layout engine and TeX-like labels cost more than the drawing they
lay out (benchmarks/README.md).

A monitor draws the same figures every few hundred steps with new data. :class:`SpectrumImages`,
:class:`AttentionHeatmapImages`, :class:`LayerHeadHeatmapImages` and :class:`EsdImages` keep each figure and
redraw only what changes over its rendered axes, ticks and labels
(:class:`~spectral_monitor.sinks.redrawn.RedrawnFigure`): the text of ticks and labels is paid once. For that
the spectrum's and the ESD's legends sit beside their panels rather than over the curves, and the titles of
the spectrum and layer × head figures are part of what is kept (a new title makes a new figure): the step a
figure belongs to is shown by TensorBoard with each image, so it is not in the titles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

from spectral_monitor.sinks.redrawn import KeptFigure, RedrawnFigure

ENERGY_LEVEL = 0.99
"""The cumulative-energy level marked on spectrum figures: the threshold rank's definition."""
LOG_DECADES = 6
"""Decades of the spectrum figure's log axis below its largest value; smaller singular values (float32
rounding of a rank-deficient matrix) fall off its bottom."""

_DPI = 100
_LEGEND_ENTRIES = 12
_ANNOTATED_CELLS = 256
_HEATMAP_CELLS = 128


def spectrum_figure(singular_values: Mapping[str, np.ndarray], title: str) -> Figure:
    """Singular values (sorted, descending, log scale) and cumulative energy Σ_{i≤k} σᵢ² / Σ σᵢ², per series.

    ``singular_values`` maps a label (a layer, or a layer and head) to the singular values of one matrix,
    in any order. The energy panel marks the ``ENERGY_LEVEL`` line: where a curve crosses it is the
    threshold rank. Zero singular values are left out of the log panel; a series that is all zeros has
    no energy curve. The log axis spans ``LOG_DECADES`` decades below the largest value (rounded up to a half
    decade), so figures of successive steps compare.

    Args:
        singular_values: Each series' label → its singular values.
        title: The figure's title.

    Returns:
        The figure; release it with :func:`~spectral_monitor.sinks.release_figure` once written.

    Raises:
        ValueError: No series, or a series that is not a non-empty 1-D array of finite values >= 0.

    Examples:
        >>> import numpy as np
        >>> figure = spectrum_figure({"blocks.0.attn": np.array([1.0, 0.5, 0.1])}, "attention spectrum")
        >>> [axes.get_yscale() for axes in figure.axes]
        ['log', 'linear']
    """
    return _Spectrum(_checked_spectra(singular_values), title).figure


class SpectrumImages(KeptFigure):
    """:func:`spectrum_figure` of successive steps as RGBA images, redrawn while the series' labels, the
    longest spectrum and the log axis stay the same (then the figure is made anew).

    Examples:
        >>> import numpy as np
        >>> images = SpectrumImages()
        >>> images.image({"a": np.array([1.0, 0.5])}, "spectrum").shape
        (320, 900, 4)
    """

    def image(self, singular_values: Mapping[str, np.ndarray], title: str) -> np.ndarray:
        """The spectrum figure of one step.

        Args:
            singular_values: Each series' label → its singular values.
            title: The figure's title.

        Returns:
            The figure as an (height, width, 4) uint8 RGBA array.

        Raises:
            ValueError: As :func:`spectrum_figure`.
        """
        spectra = _checked_spectra(singular_values)
        return self._image((_Spectrum.static_key(spectra), title), lambda: _Spectrum(spectra, title), spectra)


class _Spectrum:
    def __init__(self, spectra: dict[str, np.ndarray], title: str) -> None:
        figure = Figure(figsize=(9.0, 3.2), dpi=_DPI)
        # The right margin holds the legend, clear of the curves, so it is drawn once with the axes.
        figure.subplots_adjust(left=0.07, right=0.8, bottom=0.15, top=0.86, wspace=0.28)
        values_axes, energy_axes = figure.subplots(1, 2)
        colors = matplotlib.colormaps["viridis"](np.linspace(0.0, 0.9, len(spectra)))
        labelled = _legend_labels(list(spectra))
        self.value_lines = []
        self.energy_lines = []
        for color, legend_label in zip(colors, labelled, strict=True):
            (line,) = values_axes.plot([], [], color=color, label=legend_label)
            self.value_lines.append(line)
            (line,) = energy_axes.plot([], [], color=color)
            self.energy_lines.append(line)

        longest, (low, high) = self.static_key(spectra)[1:]
        for axes in (values_axes, energy_axes):
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.set_xlim(*_index_limits(longest))
            axes.set_xlabel("index k")
        values_axes.set_yscale("log")
        values_axes.set_ylim(10.0 ** (low / 2), 10.0 ** (high / 2))
        # Decades labelled in plain text, no minor ticks: matplotlib's own log ticks are mathtext labels and
        # eight minor ticks a decade, which made up about half of a new spectrum figure's cost.
        values_axes.yaxis.set_major_locator(LogLocator(base=10.0))
        values_axes.yaxis.set_major_formatter(FuncFormatter(_power_of_ten))
        values_axes.yaxis.set_minor_locator(NullLocator())
        values_axes.set_ylabel("σₖ")
        values_axes.grid(True, which="major", alpha=0.3)
        figure.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(0.805, 0.5), frameon=False)

        self.energy_level = energy_axes.axhline(ENERGY_LEVEL, color="tab:red", linestyle="--", linewidth=1.0)
        self.energy_label = energy_axes.annotate(
            f"{ENERGY_LEVEL:.0%}",
            xy=(1.0, ENERGY_LEVEL),
            xycoords=("axes fraction", "data"),
            xytext=(-4, -10),
            textcoords="offset points",
            ha="right",
            color="tab:red",
            fontsize="small",
        )
        energy_axes.set_ylim(0.0, 1.02)
        energy_axes.set_ylabel("Σᵢ≤ₖ σᵢ² / Σᵢ σᵢ²")
        energy_axes.grid(True, alpha=0.3)
        figure.suptitle(title)
        self.figure = figure
        self.update(spectra)

    @staticmethod
    def static_key(spectra: dict[str, np.ndarray]) -> tuple[tuple[str, ...], int, tuple[int, int]]:
        """What a redrawn figure cannot change: labels, longest spectrum, the log axis (in half decades)."""
        largest = max(float(sigma.max()) for sigma in spectra.values())
        # The log axis shows LOG_DECADES below the largest value rounded up to a half decade, whatever the
        # smallest: the smallest singular values of attention wander over decades from step to step, and
        # the axis then stays put (each move draws the whole figure anew). σ₁ of attention is just above 1.
        high = math.ceil(2 * math.log10(largest)) if largest > 0 else 0
        return tuple(spectra), max(sigma.size for sigma in spectra.values()), (high - 2 * LOG_DECADES, high)

    def update(self, spectra: dict[str, np.ndarray]) -> None:
        for sigma, value_line, energy_line in zip(
            spectra.values(), self.value_lines, self.energy_lines, strict=True
        ):
            index = np.arange(1, sigma.size + 1)
            value_line.set_data(index, np.where(sigma > 0, sigma, np.nan))
            energy = np.cumsum(sigma**2)
            share = energy / energy[-1] if energy[-1] > 0 else np.full(sigma.size, np.nan)
            energy_line.set_data(index, share)

    def changing(self) -> list[Artist]:
        # In the order a fresh figure draws them (by z-order): the 99% line and the spines over the curves.
        spines = [spine for axes in self.figure.axes for spine in axes.spines.values()]
        lines = [*self.value_lines, *self.energy_lines, self.energy_level]
        return [*lines, *spines, self.energy_label]


_SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _power_of_ten(value: float, _position: int | None = None) -> str:
    """A decade tick's label, 10⁻³ for 0.001, in Unicode rather than mathtext."""
    return "10" + str(round(math.log10(value))).translate(_SUPERSCRIPTS)


def _index_limits(longest: int) -> tuple[float, float]:
    """x limits of index 1..longest with matplotlib's default 5% margins."""
    margin = 0.05 * max(longest - 1, 1)
    return 1 - margin, longest + margin


def attention_heatmap_figure(
    probs: np.ndarray, title: str, key_padding_mask: np.ndarray | None = None
) -> Figure:
    """One attention matrix as a heatmap: queries down, keys across, colour by weight from 0 to 1 on a
    square-root scale (``HEATMAP_GAMMA``).

    The scale is the same for every matrix, so heatmaps of different layers and steps compare (a map that
    brightens has sharpened), and the colour bar is drawn once with the axes; the square root keeps diffuse
    rows visible (1/64 is an eighth of the way up, where a linear scale leaves it black).

    ``key_padding_mask`` follows ``nn.MultiheadAttention``: shape (m,), ``True`` where a key is padding
    and ignored; those columns are drawn grey. A matrix with more than 128 queries or keys is shown as
    means over blocks of consecutive queries and keys (said in the title), which keeps the PNG small.

    Args:
        probs: The attention matrix, (n, m), rows summing to 1.
        title: The figure's title.
        key_padding_mask: (m,) booleans, True where a key is padding.

    Returns:
        The figure.

    Raises:
        ValueError: As :func:`attention_block_means`.

    Examples:
        >>> import numpy as np
        >>> attention_heatmap_figure(np.full((4, 4), 0.25), "layer 0, head 0").axes[0].get_title()
        'layer 0, head 0'
    """
    blocks = attention_block_means(probs, key_padding_mask)
    return _AttentionHeatmap(blocks.means, blocks.shape, _blocks_title(title, blocks)).figure


@dataclass(frozen=True)
class AttentionBlocks:
    """What an attention heatmap draws of a matrix.

    Attributes:
        means: At most 128 × 128 means over ``block``-shaped tiles of consecutive queries and keys, NaN
            where a tile is all padding.
        shape: (n, m) of the matrix.
        block: Queries × keys of a tile.

    Examples:
        >>> import numpy as np
        >>> blocks = attention_block_means(np.full((300, 300), 1 / 300))
        >>> blocks.means.shape, blocks.shape, blocks.block
        ((100, 100), (300, 300), (3, 3))
    """

    means: np.ndarray
    shape: tuple[int, int]
    block: tuple[int, int]


def attention_block_means(
    probs: np.ndarray, key_padding_mask: np.ndarray | None = None, query_rows: np.ndarray | None = None
) -> AttentionBlocks:
    """The heatmap's block means of an attention matrix, padding keys left out.

    Read a tile of rows at a time, summed in float64: the working memory is a few tiles' rows, not a
    float64 copy of the matrix (32 MiB at n = 2048), so it fits what the monitor's memory budget leaves.

    Args:
        probs: The attention matrix, (n, m), any float dtype.
        key_padding_mask: (m,) booleans, True where a key is padding.
        query_rows: The row indices of the queries drawn; None: all.

    Returns:
        The block means.

    Raises:
        ValueError: ``probs`` is not a non-empty 2-D float array of finite values >= 0, ``query_rows``
            selects nothing, or ``key_padding_mask`` is not one boolean per key.

    Examples:
        >>> import numpy as np
        >>> probs = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
        >>> attention_block_means(probs, key_padding_mask=np.array([False, False, True])).means
        array([[1. , 0. , nan],
               [0.5, 0.5, nan]])
    """
    probs = np.asarray(probs)
    if probs.ndim != 2 or probs.size == 0 or not np.issubdtype(probs.dtype, np.floating):
        raise ValueError(
            f"probs must be a non-empty (n_queries, n_keys) float array; got shape {probs.shape} and dtype "
            f"{probs.dtype}"
        )
    rows = np.arange(probs.shape[0]) if query_rows is None else np.asarray(query_rows)
    n_queries, n_keys = rows.size, probs.shape[1]
    if n_queries == 0:
        raise ValueError("query_rows must select at least one query")
    kept_keys = np.ones(n_keys, dtype=bool)
    if key_padding_mask is not None:
        key_padding_mask = np.asarray(key_padding_mask)
        if key_padding_mask.dtype != np.bool_ or key_padding_mask.shape != (n_keys,):
            raise ValueError(
                f"key_padding_mask must be a boolean array of shape ({n_keys},) (one entry per key, "
                f"True = padding); got dtype {key_padding_mask.dtype} and shape {key_padding_mask.shape}"
            )
        kept_keys = ~key_padding_mask
    block = (-(-n_queries // _HEATMAP_CELLS), -(-n_keys // _HEATMAP_CELLS))
    row_tiles, column_tiles = -(-n_queries // block[0]), -(-n_keys // block[1])
    column_tile = np.repeat(np.arange(column_tiles), block[1])[:n_keys]
    keys_per_tile = np.bincount(column_tile, weights=kept_keys, minlength=column_tiles)
    sums = np.zeros((row_tiles, column_tiles))
    counts = np.zeros((row_tiles, column_tiles))
    for tile, start in enumerate(range(0, n_queries, block[0])):
        tile_rows = probs[rows[start : start + block[0]]][:, kept_keys].astype(np.float64)
        if not np.all(np.isfinite(tile_rows)) or np.any(tile_rows < 0):
            raise ValueError("probs must hold finite, non-negative attention weights")
        sums[tile] = np.bincount(
            column_tile[kept_keys], weights=tile_rows.sum(axis=0), minlength=column_tiles
        )
        counts[tile] = tile_rows.shape[0] * keys_per_tile
    means = np.divide(sums, counts, out=np.full(sums.shape, np.nan), where=counts > 0)
    return AttentionBlocks(means, (n_queries, n_keys), block)


class AttentionHeatmapImages(KeptFigure):
    """:func:`attention_heatmap_figure` of successive steps as RGBA images, redrawn while the matrix's
    shape stays the same.

    Examples:
        >>> import numpy as np
        >>> images = AttentionHeatmapImages()
        >>> images.image(np.full((4, 4), 0.25), "layer 0").shape
        (400, 480, 4)
    """

    def image(self, probs: np.ndarray, title: str, key_padding_mask: np.ndarray | None = None) -> np.ndarray:
        """The heatmap of one step.

        Args:
            probs: The attention matrix, (n, m).
            title: The figure's title.
            key_padding_mask: (m,) booleans, True where a key is padding.

        Returns:
            The figure as an (height, width, 4) uint8 RGBA array.

        Raises:
            ValueError: As :func:`attention_block_means`.
        """
        return self.image_of_blocks(attention_block_means(probs, key_padding_mask), title)

    def image_of_blocks(self, blocks: AttentionBlocks, title: str) -> np.ndarray:
        """The heatmap of a matrix already reduced by :func:`attention_block_means`.

        Args:
            blocks: The block means.
            title: The figure's title; the block size is added where blocks are larger than one cell.

        Returns:
            The figure as an (height, width, 4) uint8 RGBA array.
        """
        title = _blocks_title(title, blocks)
        shape = blocks.shape
        return self._image(shape, lambda: _AttentionHeatmap(blocks.means, shape, title), blocks.means, title)


def _blocks_title(title: str, blocks: AttentionBlocks) -> str:
    if blocks.block == (1, 1):
        return title
    return f"{title} (means of {blocks.block[0]}×{blocks.block[1]} blocks)"


HEATMAP_GAMMA = 0.5
"""Exponent of the attention heatmap's colour scale: colour ∝ weight ** HEATMAP_GAMMA."""
_HEATMAP_TICKS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


class _AttentionHeatmap:
    def __init__(self, shown: np.ndarray, shape: tuple[int, int], title: str) -> None:
        n_queries, n_keys = shape
        figure = Figure(figsize=(4.8, 4.0), dpi=_DPI)
        axes, colorbar_axes = _axes_with_colorbar(figure, left=0.13)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
        self.image = axes.imshow(
            np.ma.masked_invalid(shown),
            cmap=cmap,
            norm=PowerNorm(HEATMAP_GAMMA, vmin=0.0, vmax=1.0),
            interpolation="nearest",
            aspect="auto",
            extent=(-0.5, n_keys - 0.5, n_queries - 0.5, -0.5),
        )
        axes.set_xlabel("key")
        axes.set_ylabel("query")
        self.title = axes.set_title(title, fontsize="medium")
        colorbar = figure.colorbar(self.image, cax=colorbar_axes, label="attention weight (√ scale)")
        colorbar.set_ticks(_HEATMAP_TICKS, labels=[f"{tick:g}" for tick in _HEATMAP_TICKS])
        self.axes, self.figure = axes, figure
        self.update(shown, title)

    def update(self, shown: np.ndarray, title: str) -> None:
        self.image.set_data(np.ma.masked_invalid(shown))
        self.title.set_text(title)

    def changing(self) -> list[Artist]:
        # A fresh figure draws the spines over the image. The title changes: layers of one shape share a
        # figure (the callback's heatmaps of the first and last layer).
        return [self.image, *self.axes.spines.values(), self.title]


def layer_head_heatmap_figure(
    values: np.ndarray,
    layer_names: Sequence[str],
    title: str,
    vmin: float | None = None,
    vmax: float | None = None,
) -> Figure:
    """A (layers, heads) grid of one metric, e.g. effective rank / n, annotated with each value.

    ``vmin``/``vmax`` fix the colour scale (pass the metric's natural range, e.g. 0 and 1, so figures
    from different steps compare); by default it spans the finite values. NaN cells are grey. Cells are
    annotated while the grid is small enough to read (at most 256 cells).

    Args:
        values: The (layers, heads) grid.
        layer_names: The name of each row.
        title: The figure's title.
        vmin: The bottom of the colour scale; by default the smallest finite value.
        vmax: The top of the colour scale; by default the largest finite value.

    Returns:
        The figure.

    Raises:
        ValueError: ``values`` is not a non-empty 2-D array, ``layer_names`` does not name each row, or
            ``vmin`` is not below ``vmax``.

    Examples:
        >>> import numpy as np
        >>> figure = layer_head_heatmap_figure(np.array([[0.2, 0.9]]), ["blocks.0.attn"], "entropy", 0, 1)
        >>> figure.axes[0].get_title()
        'entropy'
    """
    values = _checked_grid(values, layer_names, vmin, vmax)
    return _LayerHeadHeatmap(values, tuple(layer_names), title, vmin, vmax).figure


class LayerHeadHeatmapImages(KeptFigure):
    """:func:`layer_head_heatmap_figure` of successive steps as RGBA images, redrawn while the layers, the
    number of heads, the title and the colour range stay the same.

    Examples:
        >>> import numpy as np
        >>> images = LayerHeadHeatmapImages()
        >>> images.image(np.array([[0.2, 0.9]]), ["blocks.0.attn"], "entropy", 0.0, 1.0).dtype
        dtype('uint8')
    """

    def image(
        self,
        values: np.ndarray,
        layer_names: Sequence[str],
        title: str,
        vmin: float | None = None,
        vmax: float | None = None,
    ) -> np.ndarray:
        """The grid of one step.

        Args:
            values: The (layers, heads) grid.
            layer_names: The name of each row.
            title: The figure's title.
            vmin: The bottom of the colour scale; by default the smallest finite value.
            vmax: The top of the colour scale; by default the largest finite value.

        Returns:
            The figure as an (height, width, 4) uint8 RGBA array.

        Raises:
            ValueError: As :func:`layer_head_heatmap_figure`.
        """
        values = _checked_grid(values, layer_names, vmin, vmax)
        names = tuple(layer_names)
        return self._image(
            (names, values.shape[1], title, vmin, vmax),
            lambda: _LayerHeadHeatmap(values, names, title, vmin, vmax),
            values,
        )


def _checked_grid(
    values: np.ndarray, layer_names: Sequence[str], vmin: float | None, vmax: float | None
) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.size == 0:
        raise ValueError(f"values must be a non-empty (layers, heads) array; got shape {values.shape}")
    if len(layer_names) != values.shape[0]:
        raise ValueError(
            f"layer_names must name each of the {values.shape[0]} layers (rows of values); "
            f"got {len(layer_names)} names"
        )
    if vmin is not None and vmax is not None and not vmin < vmax:
        raise ValueError(f"vmin must be smaller than vmax; got vmin={vmin}, vmax={vmax}")
    return values


class _LayerHeadHeatmap:
    def __init__(
        self,
        values: np.ndarray,
        layer_names: tuple[str, ...],
        title: str,
        vmin: float | None,
        vmax: float | None,
    ) -> None:
        n_layers, n_heads = values.shape
        figure = Figure(figsize=(6.4, 4.0), dpi=_DPI)
        # Room for the longest layer name at the small tick font (about 0.07 in. a character).
        longest = max((len(name) for name in layer_names), default=1)
        axes, colorbar_axes = _axes_with_colorbar(figure, left=min(0.5, 0.04 + 0.07 * longest / 6.4))
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
        self.image = axes.imshow(
            np.ma.masked_invalid(values),
            cmap=cmap,
            vmin=vmin,
            vmax=vmax,
            interpolation="nearest",
            aspect="auto",
        )
        axes.set_xticks(range(n_heads), [str(head) for head in range(n_heads)])
        axes.set_yticks(range(n_layers), list(layer_names))
        axes.tick_params(labelsize="small")
        axes.set_xlabel("head")
        axes.set_title(title)
        figure.colorbar(self.image, cax=colorbar_axes)
        self.fixed_scale = vmin is not None and vmax is not None
        self.annotations: list[Text] = []
        if values.size <= _ANNOTATED_CELLS:
            fontsize = 8 if values.size <= 64 else 6
            self.annotations = [
                axes.text(column, row, "", ha="center", va="center", fontsize=fontsize)
                for row, column in np.ndindex(values.shape)
            ]
        self.axes, self.colorbar_axes, self.figure = axes, colorbar_axes, figure
        self.update(values)

    def update(self, values: np.ndarray) -> None:
        self.image.set_data(np.ma.masked_invalid(values))
        if not self.fixed_scale:
            finite = values[np.isfinite(values)]
            if finite.size:
                self.image.set_clim(finite.min(), finite.max())
        for annotation, value in zip(self.annotations, values.ravel(), strict=False):
            if np.isfinite(value):
                # Dark text on the bright end of viridis, light text on the dark end.
                annotation.set_color("black" if self.image.norm(value) > 0.6 else "white")
                annotation.set_text(f"{value:.2f}")
            else:
                annotation.set_color("black")
                annotation.set_text("–")

    def changing(self) -> list[Artist]:
        colour_bar = [] if self.fixed_scale else [self.colorbar_axes]
        return [self.image, *self.axes.spines.values(), *self.annotations, *colour_bar]


def _axes_with_colorbar(figure: Figure, *, left: float) -> tuple[Axes, Axes]:
    """Main axes from ``left`` (a fraction of the width) and a thin colour bar to their right."""
    bottom, height, bar_width, gap = 0.12, 0.78, 0.03, 0.02
    bar_left = 0.8
    axes = figure.add_axes((left, bottom, bar_left - gap - left, height))
    return axes, figure.add_axes((bar_left, bottom, bar_width, height))


def _checked_spectra(singular_values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    if not singular_values:
        raise ValueError("singular_values must map at least one label to an array; got an empty mapping")
    return {label: _checked_spectrum(label, values) for label, values in singular_values.items()}


def _checked_spectrum(label: str, values: np.ndarray) -> np.ndarray:
    sigma = np.asarray(values, dtype=np.float64)
    if sigma.ndim != 1 or sigma.size == 0:
        raise ValueError(f"singular_values[{label!r}] must be a non-empty 1-D array; got shape {sigma.shape}")
    if not np.all(np.isfinite(sigma)) or np.any(sigma < 0):
        raise ValueError(f"singular_values[{label!r}] must hold finite, non-negative singular values")
    return np.sort(sigma)[::-1]


def _legend_labels(labels: list[str]) -> list[str]:
    """All labels when the legend stays readable; otherwise only the first and last (colour shows order)."""
    if len(labels) <= _LEGEND_ENTRIES:
        return labels
    hidden = ["_" + label for label in labels[1:-1]]
    return [labels[0], *hidden, labels[-1]]


def spectral_density_figure(nodes: np.ndarray, weights: np.ndarray, title: str) -> Figure:
    """A spectral density from stochastic Lanczos quadrature: Gaussian-smoothed nodes, normalised to 1.

    ``nodes`` and ``weights`` are (probes, steps): each probe's Gauss rule. The density is the average of
    the probes' rules, each rescaled to unit mass, smoothed with a Gaussian of 1% of the spectrum's width
    (Ghorbani, Krishnan & Xiao 2019), on a symmetric-log y axis so the bulk and the outliers both show.

    Args:
        nodes: (probes, steps): the nodes of each probe's Gauss rule.
        weights: (probes, steps): their weights.
        title: The figure's title.

    Returns:
        The figure.

    Raises:
        ValueError: ``nodes`` and ``weights`` are not non-empty 2-D arrays of one shape.

    Examples:
        >>> import numpy as np
        >>> figure = spectral_density_figure(np.array([[-1.0, 2.0]]), np.array([[0.5, 0.5]]), "Hessian")
        >>> figure.axes[0].get_xlabel(), figure.axes[0].get_yscale()
        ('eigenvalue', 'symlog')
    """
    nodes = np.asarray(nodes, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if nodes.shape != weights.shape or nodes.ndim != 2 or nodes.size == 0:
        raise ValueError(f"nodes and weights must be (probes, steps) arrays of one shape; got {nodes.shape}")
    mass = weights.sum(axis=1, keepdims=True)
    weights = weights / np.where(mass > 0, mass, 1) / nodes.shape[0]
    low, high = float(nodes.min()), float(nodes.max())
    width = max(high - low, 1e-12)
    sigma = 0.01 * width
    grid = np.linspace(low - 0.05 * width, high + 0.05 * width, 512)
    density = (
        weights.ravel()[None, :]
        * np.exp(-0.5 * ((grid[:, None] - nodes.ravel()[None, :]) / sigma) ** 2)
        / (sigma * np.sqrt(2 * np.pi))
    ).sum(axis=1)
    figure = Figure(figsize=(6.4, 3.2), dpi=_DPI)
    figure.subplots_adjust(left=0.12, right=0.97, bottom=0.15, top=0.88)
    axes = figure.subplots()
    axes.plot(grid, density)
    axes.set_yscale("symlog", linthresh=1e-3 * max(float(density.max()), 1e-12))
    axes.axvline(0.0, color="grey", linewidth=0.5)
    axes.set_xlabel("eigenvalue")
    axes.set_ylabel("density")
    axes.set_title(title, fontsize="medium")
    return figure


@dataclass(frozen=True)
class EsdDrawing:
    """What an empirical-spectral-density figure draws of one weight: plain numbers, and the reference law
    as a function.

    Attributes:
        eigenvalues: λ = σ² of WᵀW, in any order, each >= 0.
        mp_edge: The Marchenko–Pastur bulk edge of σ; its square is marked.
        law: The Marchenko–Pastur density at given λ (a 1-D array in, one out), or None for no curve.
        alpha: The fitted power-law exponent.
        alpha_xmin: The power law's λ_min, marked; NaN for no fit.
        title: The axes' title.

    Examples:
        >>> import numpy as np
        >>> drawing = EsdDrawing(np.array([4.0, 1.0]), 1.5, None, float("nan"), float("nan"), "w")
        >>> esd_drawing_figure(drawing).axes[0].get_title()
        'w'
    """

    eigenvalues: np.ndarray
    mp_edge: float
    law: Callable[[np.ndarray], np.ndarray] | None
    alpha: float
    alpha_xmin: float
    title: str


def esd_drawing_figure(drawing: EsdDrawing) -> Figure:
    """A density histogram of the eigenvalues against the reference law, with the MP bulk edge and the
    power law's λ_min marked. The x axis is logarithmic, from decade to decade, when the positive eigenvalues
    span more than two decades (zero eigenvalues then left out), and the density is then per decade of λ
    (histogram and law alike), so equal areas hold equal shares of the eigenvalues: per unit λ, the narrow
    bins of the few smallest eigenvalues of a near-square weight would tower over its bulk. The y axis ends
    at a 1-2-5 number above the highest density, so figures of successive steps compare and
    :class:`EsdImages` can redraw one.

    Args:
        drawing: What to draw.

    Returns:
        The figure; release it with :func:`~spectral_monitor.sinks.release_figure` once written.

    Examples:
        >>> import numpy as np
        >>> figure = esd_drawing_figure(
        ...     EsdDrawing(np.geomspace(1e-4, 1.0, 50), 0.5, None, 2.0, 1e-2, "w (50×50), 1 spikes")
        ... )
        >>> axes = figure.axes[0]
        >>> axes.get_xscale(), [float(limit) for limit in axes.get_xlim()], axes.get_ylabel()
        ('log', [0.0001, 1.0], 'density per decade of λ')
        >>> float(axes.get_ylim()[1])  # 50 eigenvalues spread evenly over 4 decades: about 0.25 per decade
        0.5
    """
    return _Esd(drawing).figure


class EsdImages:
    """:func:`esd_drawing_figure` of many weights over successive steps as RGBA images. Weights whose axes
    agree (the x scale and decades, the top of the y axis, the curves listed) share one kept figure, redrawn
    for each (:class:`~spectral_monitor.sinks.redrawn.RedrawnFigure`); :meth:`next_step` lets go of the
    figures the last step did not draw, so what is held is one figure per kind of axes in use (9 for a
    freshly initialised GPT-2's 37 weights).

    Examples:
        >>> import numpy as np
        >>> images = EsdImages()
        >>> drawing = EsdDrawing(np.array([4.0, 1.0]), 1.5, None, float("nan"), float("nan"), "w")
        >>> images.image(drawing).shape, images.held
        ((320, 640, 4), 1)
        >>> images.next_step(); images.next_step(); images.held
        0
    """

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[_Esd, RedrawnFigure]] = {}
        self._drawn: set[Hashable] = set()

    @property
    def held(self) -> int:
        """How many figures are kept."""
        return len(self._kept)

    def image(self, drawing: EsdDrawing) -> np.ndarray:
        """The figure of one weight at this step.

        Args:
            drawing: What to draw.

        Returns:
            The figure as an (height, width, 4) uint8 RGBA array.
        """
        key = _Esd.static_key(drawing)
        kept = self._kept.get(key)
        if kept is None:
            parts = _Esd(drawing)
            kept = self._kept[key] = (parts, RedrawnFigure(parts.figure, parts.changing()))
        else:
            kept[0].update(drawing)
        self._drawn.add(key)
        return kept[1].render()

    def next_step(self) -> None:
        """Start another step: the figures the last one did not draw are let go."""
        self._kept = {key: kept for key, kept in self._kept.items() if key in self._drawn}
        self._drawn = set()


class _Esd:
    _BINS = 60

    def __init__(self, drawing: EsdDrawing) -> None:
        wide, x_limits, y_top, has_law, has_alpha = self.static_key(drawing)
        figure = Figure(figsize=(6.4, 3.2), dpi=_DPI)
        # The right margin holds the legend, clear of the histogram, so it is drawn once with the axes.
        figure.subplots_adjust(left=0.1, right=0.7, bottom=0.15, top=0.9)
        axes = figure.subplots()
        if wide:
            axes.set_xscale("log")
            axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axes.xaxis.set_minor_locator(NullLocator())
        axes.set_xlim(*x_limits)
        axes.set_ylim(0.0, y_top)
        self.histogram = axes.stairs(
            np.zeros(1), np.array([0.0, 1.0]), fill=True, alpha=0.6, label="ESD of WᵀW"
        )
        self.law = axes.plot([], [], color="tab:red", label="MP law (same ‖W‖_F)")[0] if has_law else None
        self.edge = axes.axvline(1.0, color="tab:red", linestyle="--", linewidth=1.0, label="MP edge")
        self.power_law = (
            axes.axvline(1.0, color="tab:green", linestyle=":", label="power-law λ_min")
            if has_alpha
            else None
        )
        axes.set_xlabel("eigenvalue λ = σ²")
        axes.set_ylabel("density per decade of λ" if wide else "density")
        # A large density gets a power-of-ten factor above the axis, not tick labels wider than the margin.
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        figure.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(0.705, 0.5), frameon=False)
        self.title = axes.set_title("", fontsize="medium")
        self.spines = list(axes.spines.values())
        self.wide = wide
        self.figure = figure
        self.update(drawing)

    @staticmethod
    def static_key(drawing: EsdDrawing) -> tuple[bool, tuple[float, float], float, bool, bool]:
        """What a redrawn figure cannot change: the x scale and limits (whole decades on a log axis), the top
        of the y axis (a 1-2-5 number) and which curves the legend lists."""
        eigenvalues = drawing.eigenvalues
        positive = eigenvalues[eigenvalues > 0]
        edge = drawing.mp_edge**2
        wide = bool(positive.size > 1 and positive.max() / positive.min() > 100)
        if wide:
            marks = [value for value in (edge, drawing.alpha_xmin) if np.isfinite(value) and value > 0]
            low = math.floor(math.log10(min(positive.min(), *marks)))
            high = math.ceil(math.log10(max(positive.max(), *marks)))
            x_limits = (10.0**low, 10.0 ** max(high, low + 1))
        else:
            x_limits = (0.0, _nice_ceiling(max(float(eigenvalues.max()), edge) * 1.05))
        bins, density, grid, law = _Esd.curves(drawing, wide)
        highest = max(float(density.max()), float(np.nanmax(law, initial=0.0)) if law is not None else 0.0)
        return (
            wide,
            x_limits,
            _nice_ceiling(highest),
            drawing.law is not None,
            bool(np.isfinite(drawing.alpha_xmin)),
        )

    @staticmethod
    def curves(
        drawing: EsdDrawing, wide: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The histogram's bin edges and densities, and the law's grid and values (None without a law): per
        decade of λ on a logarithmic axis, per unit λ on a linear one."""
        eigenvalues = drawing.eigenvalues
        if wide:
            positive = eigenvalues[eigenvalues > 0]
            bins = np.geomspace(positive.min(), positive.max(), _Esd._BINS)
            density, _ = np.histogram(np.log10(positive), bins=np.log10(bins), density=True)
            grid = np.geomspace(bins[0], bins[-1], 400)
            per_unit_of_axis = grid * math.log(10)  # dλ / d(log₁₀ λ)
        else:  # an all-zero weight (a zero-initialised projection) still gets bins of some width
            top = max(float(eigenvalues.max()), drawing.mp_edge**2) * 1.05 or 1.0
            bins = np.linspace(0.0, top, _Esd._BINS)
            density, _ = np.histogram(eigenvalues, bins=bins, density=True)
            grid = np.linspace(bins[0], bins[-1], 400)
            per_unit_of_axis = np.ones_like(grid)
        law = (
            None
            if drawing.law is None
            else np.where(np.isfinite(values := drawing.law(grid) * per_unit_of_axis), values, np.nan)
        )
        return bins, density, grid, law

    def changing(self) -> list[Artist]:
        lines = [line for line in (self.law, self.edge, self.power_law) if line is not None]
        # The spines are drawn after the curves, as a fresh figure draws them: the histogram and the marks
        # touch the axes' edges.
        return [self.histogram, *lines, *self.spines, self.title]

    def update(self, drawing: EsdDrawing) -> None:
        bins, density, grid, law = self.curves(drawing, self.wide)
        self.histogram.set_data(density, bins)
        if self.law is not None and law is not None:
            self.law.set_data(grid, law)
        edge = drawing.mp_edge**2
        self.edge.set_xdata([edge, edge])
        if self.power_law is not None:
            self.power_law.set_xdata([drawing.alpha_xmin, drawing.alpha_xmin])
        self.title.set_text(drawing.title)


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (1 for a value that is not
    positive)."""
    if not value > 0 or not math.isfinite(value):
        return 1.0
    decade = 10.0 ** math.floor(math.log10(value))
    return next(step * decade for step in (1.0, 2.0, 5.0, 10.0) if step * decade >= value * (1 - 1e-12))
