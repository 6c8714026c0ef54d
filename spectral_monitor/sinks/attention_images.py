"""The attention figures of a monitor, kept from one figure step to the next.

What a figure step draws of each attention layer (:class:`DrawnHead`) is plain arrays, so it outlives the
attention it was read from; :class:`AttentionImages` turns it into images only when a sink keeps figures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from spectral_monitor.sinks.figures import (
    AttentionBlocks,
    AttentionHeatmapImages,
    LayerHeadHeatmapImages,
    SpectrumImages,
)


@dataclass
class DrawnHead:
    """What the attention figures draw of one layer: plain arrays, kept after the attention is dropped.

    Attributes:
        layer: The attention layer's name.
        blocks: The drawn head of the first sequence, as its heatmap draws it.
        singular_values: Of that head's attention restricted to real queries and attendable keys.
        head_values: Each layer × head metric the layer has → its (heads,) values.

    Examples:
        >>> import numpy as np
        >>> from spectral_monitor.sinks.figures import attention_block_means
        >>> head = DrawnHead("blocks.0.attn", attention_block_means(np.eye(4)), np.ones(4),
        ...                  {"entropy": np.array([0.1, 0.7])})
        >>> head.blocks.shape
        (4, 4)
    """

    layer: str
    blocks: AttentionBlocks
    singular_values: np.ndarray
    head_values: dict[str, np.ndarray]


class AttentionImages:
    """The attention figures, kept from one figure step to the next and redrawn with each one's data
    (:class:`~spectral_monitor.sinks.redrawn.RedrawnFigure`), which costs a fraction of drawing afresh.

    Args:
        metrics: The per-head metrics drawn as a layer × head image, each ranging over [0, 1].
        titles: The image title of a metric, where it differs from the metric's name.
        figure_head: The head each layer's heatmap and spectrum show, named in their titles.

    Examples:
        >>> import numpy as np
        >>> from spectral_monitor.sinks.figures import attention_block_means
        >>> heads = [DrawnHead(f"blocks.{i}.attn", attention_block_means(np.eye(4)), np.ones(4),
        ...                    {"entropy": np.array([0.1, 0.7])}) for i in range(3)]
        >>> images = AttentionImages(["entropy"], {}, figure_head=0).drawn(heads)
        >>> [tag for tag, _ in images]  # doctest: +NORMALIZE_WHITESPACE
        ['attention/figures/spectrum', 'attention/figures/heatmap/blocks.0.attn',
         'attention/figures/heatmap/blocks.2.attn', 'attention/figures/entropy']
        >>> images[0][1]().shape
        (320, 900, 4)
    """

    def __init__(self, metrics: Sequence[str], titles: Mapping[str, str], figure_head: int) -> None:
        self.titles = titles
        self.figure_head = figure_head
        self.spectrum = SpectrumImages()
        # By the drawn matrix's shape, for the shapes of the last figure step: layers of one shape share a
        # figure (a redraw costs a fraction of a new figure), and padded batches whose shapes
        # change from step to step cannot pile figures up.
        self.heatmaps: dict[tuple[int, ...], AttentionHeatmapImages] = {}
        self.layer_head = {metric: LayerHeadHeatmapImages() for metric in metrics}

    def drawn(self, heads: list[DrawnHead]) -> list[tuple[str, Callable[[], np.ndarray]]]:
        """(tag, draw) of each attention image; drawing is deferred to the sinks that keep figures.

        Args:
            heads: What is drawn of each layer, in layer order.

        Returns:
            The tag and the deferred drawing of the spectrum image, of the first and last layer's heatmap
            and of each layer × head image whose metric some layer has.
        """
        images: list[tuple[str, Callable[[], np.ndarray]]] = [
            (
                "attention/figures/spectrum",
                lambda: self.spectrum.image(
                    {head.layer: head.singular_values for head in heads},
                    f"attention singular values, head {self.figure_head} of sequence 0",
                ),
            )
        ]
        drawn_heads = heads[:1] + heads[1:][-1:]  # the first and the last layer
        kept: dict[tuple[int, ...], AttentionHeatmapImages] = {}
        for head in drawn_heads:
            shape = head.blocks.shape
            kept[shape] = kept.get(shape) or self.heatmaps.get(shape) or AttentionHeatmapImages()
        self.heatmaps = kept
        for head in drawn_heads:
            heatmap = self.heatmaps[head.blocks.shape]
            images.append(
                (
                    f"attention/figures/heatmap/{head.layer}",
                    lambda head=head, heatmap=heatmap: heatmap.image_of_blocks(
                        head.blocks, f"{head.layer}, head {self.figure_head}"
                    ),
                )
            )
        for metric, kept_figure in self.layer_head.items():
            measured = [head for head in heads if metric in head.head_values]
            if not measured:
                continue
            grid = np.full((len(measured), max(head.head_values[metric].size for head in measured)), np.nan)
            for row, head in enumerate(measured):
                grid[row, : head.head_values[metric].size] = head.head_values[metric]
            images.append(
                (
                    f"attention/figures/{metric}",
                    lambda grid=grid, measured=measured, metric=metric, kept_figure=kept_figure: (
                        kept_figure.image(
                            grid,
                            [head.layer for head in measured],
                            self.titles.get(metric, metric),
                            vmin=0.0,
                            vmax=1.0,
                        )
                    ),
                )
            )
        return images
