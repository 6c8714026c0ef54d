"""The TensorBoard Custom Scalars layout: one chart per metric with one line per layer.

The Scalars tab shows one chart per tag; Custom Scalars puts every layer of a metric on one chart, which
is how collapse across depth is read. A layout is kept in the dict form that
``SummaryWriter.add_custom_scalars`` takes::

    {category: {chart_title: ("Multiline", (tag_regex, ...))
                             | ("Margin", (value_tag, lower_tag, upper_tag))}}

rather than as a ``layout_pb2.Layout``: it is the public input of the writer (torch and tensorboardX),
and plain data, so merging layouts and asking "did a chart appear?" are dict operations. Charts are
tuples (the writer only indexes them) so layouts can be shared and compared without defensive copies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from spectral_monitor.catalog import GROUPS, diagnosis_metrics, group_of

MULTILINE = "Multiline"
MARGIN = "Margin"

ChartSpec = tuple[str, tuple[str, ...]]
Layout = dict[str, dict[str, ChartSpec]]
"""A Custom Scalars layout: category title → chart title → (chart kind, tag regular expressions).

The kind is ``"Multiline"`` (one line per matching tag) or ``"Margin"`` (a value between two bounds)."""

_PER_HEAD_SUFFIX = re.compile(r"/head_\d+$")


def per_layer_layout(scalar_tags: Iterable[str]) -> Layout:
    """One category per family and one multiline chart per metric, drawing one line per layer.

    ``scalar_tags`` are ``Measurement.tag`` values, ``family/metric/layer[/head_h]``. Per-head tags are
    left out (they stay in the Scalars tab): a chart is made for a metric only when some layer reports
    it per layer. Each chart holds one regex, so a layer that appears later joins its chart without a
    new layout; only a new family or metric changes the layout.

    Args:
        scalar_tags: The tags written so far.

    Returns:
        The layout, families and metrics in name order.

    Raises:
        ValueError: A tag does not have three non-empty parts.

    Examples:
        >>> tags = ["attention/entropy/blocks.0.attn", "attention/entropy/blocks.1.attn",
        ...         "attention/entropy/blocks.0.attn/head_0"]
        >>> import re
        >>> kind, (regex,) = per_layer_layout(tags)["attention"]["entropy"]
        >>> kind, [tag for tag in tags if re.match(regex, tag)]
        ('Multiline', ['attention/entropy/blocks.0.attn', 'attention/entropy/blocks.1.attn'])
    """
    layout: Layout = {}
    for tag in scalar_tags:
        parts = tag.split("/", 2)
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"scalar_tags must look like 'family/metric/layer[/head_h]'; got {tag!r}")
        family, metric, _ = parts
        if metric in layout.get(family, ()) or _PER_HEAD_SUFFIX.search(tag):
            continue
        layout.setdefault(family, {})[metric] = (MULTILINE, (_per_layer_regex(family, metric),))
    return {family: dict(sorted(charts.items())) for family, charts in sorted(layout.items())}


SHARPNESS_MARGIN = ("Curvature", "sharpness vs its edge of stability", "curvature/sharpness/model",
                    "curvature/sharpness/model", "curvature/sharpness_threshold/model")  # fmt: skip
"""The margin chart of sharpness: the band from the sharpness up to the optimizer's edge is the margin left;
it closes when the sharpness reaches the edge."""


def diagnosis_layout(scalar_tags: Iterable[str]) -> Layout:
    """:func:`per_layer_layout` with its charts grouped by diagnosis, chart titles ``family/metric``, and
    the sharpness margin chart once sharpness and its threshold are both logged.

    A metric's category is its dashboard group in :mod:`spectral_monitor.catalog` (a static table of names:
    nothing here knows how a metric is computed), in the catalogue's order of groups; a metric the
    catalogue does not list (another probe's) gets a category named after its family, after those. Within a
    category the charts the diagnoses read come first, in diagnosis order, then the others by name.

    Args:
        scalar_tags: The tags written so far.

    Returns:
        The layout, categories in the order of :data:`~spectral_monitor.catalog.GROUPS`.

    Raises:
        ValueError: A tag does not have three non-empty parts.

    Examples:
        >>> layout = diagnosis_layout(["attention/entropy/blocks.0.attn", "weights/spectral_norm/head"])
        >>> {category: list(charts) for category, charts in layout.items()}
        {'Entropy': ['attention/entropy'], 'Weights': ['weights/spectral_norm']}
    """
    tags = list(scalar_tags)
    layout: Layout = {}
    for family, charts in per_layer_layout(tags).items():
        for metric, chart in charts.items():
            name = f"{family}/{metric}"
            layout.setdefault(group_of(name) or family, {})[name] = chart
    order = list(GROUPS)
    read_first = {name: index for index, name in enumerate(diagnosis_metrics())}
    layout = {
        category: dict(
            sorted(
                layout[category].items(), key=lambda item: (read_first.get(item[0], len(read_first)), item[0])
            )
        )
        for category in sorted(layout, key=lambda c: (order.index(c) if c in order else len(order), c))
    }
    category, title, value, lower, upper = SHARPNESS_MARGIN
    if value in tags and upper in tags:
        layout = with_margin_chart(layout, category, title, value, lower, upper)
    return layout


def with_margin_chart(
    layout: Layout, category: str, title: str, value_tag: str, lower_tag: str, upper_tag: str
) -> Layout:
    """A copy of ``layout`` with a chart of one series drawn inside a band.

    Args:
        layout: The layout to add to.
        category: The chart's category.
        title: The chart's title.
        value_tag: The exact tag of the series drawn.
        lower_tag: The exact tag of the band's lower edge.
        upper_tag: The exact tag of the band's upper edge.

    Returns:
        The new layout; ``layout`` is left as it was.

    Raises:
        ValueError: A tag is empty.

    Examples:
        >>> with_margin_chart({}, "Curvature", "sharpness", "curvature/sharpness/model",
        ...                   "curvature/sharpness/model", "curvature/sharpness_threshold/model")
        {'Curvature': {'sharpness': ('Margin', ('curvature/sharpness/model', 'curvature/sharpness/model',
        'curvature/sharpness_threshold/model'))}}
    """
    for name, tag in (("value_tag", value_tag), ("lower_tag", lower_tag), ("upper_tag", upper_tag)):
        if not tag:
            raise ValueError(f"{name} must be a non-empty scalar tag; got {tag!r}")
    return merged_layout(layout, {category: {title: (MARGIN, (value_tag, lower_tag, upper_tag))}})


def merged_layout(base: Layout, update: Layout) -> Layout:
    """Two layouts in one.

    Args:
        base: The layout added to; it is left as it was.
        update: The charts to add; one with the category and title of a chart of ``base`` replaces it.

    Returns:
        The merged layout.

    Examples:
        >>> merged_layout({"A": {"x": ("Multiline", ("a",))}}, {"A": {"y": ("Multiline", ("b",))}})
        {'A': {'x': ('Multiline', ('a',)), 'y': ('Multiline', ('b',))}}
    """
    merged = {category: dict(charts) for category, charts in base.items()}
    for category, charts in update.items():
        merged.setdefault(category, {}).update(charts)
    return merged


def check_layout(layout: Layout) -> None:
    """Check that a layout has the form described in this module's docstring.

    Args:
        layout: The layout.

    Raises:
        ValueError: It has not, naming the first chart that is wrong.

    Examples:
        >>> check_layout({"A": {"x": ("Multiline", ("^a/.+$",))}})
        >>> check_layout({"A": {"x": ("Multiline", ())}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: layout['A']['x'] must be ('Multiline', (tag_regex, ...)) or ... got ('Multiline', ())
    """
    if not isinstance(layout, dict):
        raise ValueError(f"layout must be a dict of categories; got {type(layout).__name__}")
    for category, charts in layout.items():
        if not isinstance(category, str) or not isinstance(charts, dict):
            raise ValueError(f"layout must map category names to dicts of charts; got {category!r}")
        for title, chart in charts.items():
            if not isinstance(title, str) or not _is_chart(chart):
                raise ValueError(
                    f"layout[{category!r}][{title!r}] must be ({MULTILINE!r}, (tag_regex, ...)) or "
                    f"({MARGIN!r}, (value_tag, lower_tag, upper_tag)); got {chart!r}"
                )


def _is_chart(chart: object) -> bool:
    if not isinstance(chart, (tuple, list)) or len(chart) != 2:
        return False
    kind, tags = chart
    if isinstance(tags, str) or not isinstance(tags, (tuple, list)):
        return False
    if not all(isinstance(tag, str) and tag for tag in tags):
        return False
    return (kind == MULTILINE and len(tags) >= 1) or (kind == MARGIN and len(tags) == 3)


def _per_layer_regex(family: str, metric: str) -> str:
    # Layer names may contain '/', so per-head tags are excluded by their suffix, not by counting parts.
    return rf"^{re.escape(family)}/{re.escape(metric)}/(?!.*/head_\d+$).+$"
