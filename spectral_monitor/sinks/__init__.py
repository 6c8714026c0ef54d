"""Where measurements go: TensorBoard, any Lightning-style logger, Python logging; and the figures drawn.

Sinks take the records of ``spectral_monitor.records`` and finished figures; they know nothing of how
a number was computed. See ``Sink`` for the contract and ``Capability`` for what each sink keeps.
"""

from spectral_monitor.sinks.figures import (
    attention_heatmap_figure,
    layer_head_heatmap_figure,
    spectral_density_figure,
    spectrum_figure,
)
from spectral_monitor.sinks.layout import (
    Layout,
    diagnosis_layout,
    merged_layout,
    per_layer_layout,
    with_margin_chart,
)
from spectral_monitor.sinks.logger import (
    Capability,
    LoggerSink,
    LoggingSink,
    MetricsLogger,
    Sink,
    SinkError,
)
from spectral_monitor.sinks.redrawn import release_figure
from spectral_monitor.sinks.tensorboard import SummaryWriterLike, TensorBoardSink, WriteLosses, steps_phrase

__all__ = [
    "Capability",
    "Layout",
    "LoggerSink",
    "LoggingSink",
    "MetricsLogger",
    "Sink",
    "SinkError",
    "SummaryWriterLike",
    "TensorBoardSink",
    "WriteLosses",
    "attention_heatmap_figure",
    "diagnosis_layout",
    "layer_head_heatmap_figure",
    "merged_layout",
    "per_layer_layout",
    "release_figure",
    "spectral_density_figure",
    "spectrum_figure",
    "steps_phrase",
    "with_margin_chart",
]
