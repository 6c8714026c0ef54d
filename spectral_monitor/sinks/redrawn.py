"""Figures kept from one figure step to the next and redrawn with new data, and how a figure is freed.

A monitor draws the same figures every few hundred steps. :class:`KeptFigure` keeps a figure's parts while
what a redraw cannot change stays the same, and :class:`RedrawnFigure` redraws only the artists that change
over the rendered axes, ticks and labels, which are drawn once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import numpy as np
from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text


class Redrawable(Protocol):
    """A figure's parts: the figure, the artists a redraw changes, and how new data changes them.

    Attributes:
        figure: The figure.

    Examples:
        >>> from matplotlib.figure import Figure
        >>> class Level:
        ...     def __init__(self, value):
        ...         self.figure = Figure(figsize=(2, 2))
        ...         axes = self.figure.add_subplot(ylim=(0, 1))
        ...         (self.line,) = axes.plot([0, 1], [value, value])
        ...     def changing(self):
        ...         return [self.line]
        ...     def update(self, value):
        ...         self.line.set_ydata([value, value])
        >>> parts: Redrawable = Level(0.5)
        >>> parts.changing() == [parts.line]
        True
    """

    figure: Figure

    def changing(self) -> list[Artist]:
        """The artists a redraw changes.

        Returns:
            Them, in the order they are drawn.
        """

    def update(self, *data: Any) -> None:
        """Set the changing artists to new data.

        Args:
            *data: The new data, as the figure takes it.
        """


class KeptFigure:
    """The figure an ``*Images`` class keeps between steps: made anew when ``key`` (what a redraw cannot
    change) differs from the kept figure's, else updated with the new data and redrawn.

    Examples:
        >>> from matplotlib.figure import Figure
        >>> class Level:
        ...     def __init__(self, value):
        ...         self.figure = Figure(figsize=(2, 2))
        ...         axes = self.figure.add_subplot(ylim=(0, 1))
        ...         (self.line,) = axes.plot([0, 1], [value, value])
        ...     def changing(self):
        ...         return [self.line]
        ...     def update(self, value):
        ...         self.line.set_ydata([value, value])
        >>> class LevelImages(KeptFigure):
        ...     def image(self, value):
        ...         return self._image("one axes", lambda: Level(value), value)
        >>> images = LevelImages()
        >>> first, second = images.image(0.2), images.image(0.8)
        >>> first.shape, bool((first != second).any())
        ((200, 200, 4), True)
    """

    def __init__(self) -> None:
        self._key: Hashable = None
        self._parts: Redrawable | None = None
        self._redrawn: RedrawnFigure | None = None

    def _image(self, key: Hashable, make: Callable[[], Redrawable], *data: Any) -> np.ndarray:
        if self._parts is None or self._redrawn is None or key != self._key:
            self._parts = make()
            self._key, self._redrawn = key, RedrawnFigure(self._parts.figure, self._parts.changing())
        else:
            self._parts.update(*data)
        return self._redrawn.render()


class RedrawnFigure:
    """A figure drawn again and again with new data, at a fraction of a fresh figure's cost.

    Its static artists (axes, ticks, labels) are rendered once into a background; each :meth:`render`
    restores it and draws only ``changing``, in that order, over it (matplotlib's blitting, as its
    animations use). The caller updates the changing artists between renders and makes a new
    ``RedrawnFigure`` when anything else must change. A redraw costs a fraction of drawing afresh
    (benchmarks/README.md).

    Args:
        figure: The figure, drawn in full once here.
        changing: The artists each render draws again, in this order.

    Attributes:
        figure: The figure.

    Examples:
        >>> from matplotlib.figure import Figure
        >>> figure = Figure(figsize=(2, 2))
        >>> (line,) = figure.add_subplot(ylim=(0, 1)).plot([0, 1], [0.2, 0.2])
        >>> redrawn = RedrawnFigure(figure, [line])
        >>> first = redrawn.render()
        >>> line.set_ydata([0.8, 0.8])
        >>> first.shape, bool((redrawn.render() != first).any())
        ((200, 200, 4), True)
    """

    def __init__(self, figure: Figure, changing: Sequence[Artist]) -> None:
        self.figure = figure
        self._changing = tuple(changing)
        self._canvas = FigureCanvasAgg(figure)
        # Drawing an axes moves its title out of the way when the title is hidden: put texts back after.
        positions = {artist: artist.get_position() for artist in self._changing if isinstance(artist, Text)}
        for artist in self._changing:
            artist.set_visible(False)
        self._canvas.draw()
        self._background = self._canvas.copy_from_bbox(figure.bbox)
        for artist in self._changing:
            artist.set_visible(True)
        for text, position in positions.items():
            text.set_position(position)

    def render(self) -> np.ndarray:
        """Draw the changing artists over the kept background.

        Returns:
            The figure as an (height, width, 4) uint8 RGBA array.
        """
        self._canvas.restore_region(self._background)
        renderer = self._canvas.get_renderer()
        for artist in self._changing:
            artist.draw(renderer)
        return np.array(self._canvas.buffer_rgba())


def release_figure(figure: Figure) -> None:
    """Free a figure once it has been written, whoever made it.

    Our figures hold no global state. A figure made with ``pyplot`` stays registered with it until
    ``pyplot.close``; pyplot is consulted only if the user already imported it, so drawing never
    imports it (which would pick a backend).

    Args:
        figure: The figure; it is not drawn again after this.

    Examples:
        >>> from matplotlib.figure import Figure
        >>> release_figure(Figure())
    """
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(figure)
