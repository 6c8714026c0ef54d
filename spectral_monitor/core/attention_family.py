"""The attention family: q and k captured during the training forward, measured at the step's end.

What is measured, and within which memory, is :class:`~spectral_monitor.core.attention_plan.AttentionPlan`'s;
this family turns its per-matrix metrics into records: a mean (or a largest) over the sampled sequences per
head, the layer's mean over heads with the aggregates the catalogue asks for, per-head records and
histograms, the growth of the largest logit between logging steps, head diversity on its own cadence and the
figures on figure steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from spectral_monitor.alerts.engine import HEADS_METRIC, KEYS_METRIC
from spectral_monitor.catalog import CATALOG, histogram_metrics
from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.core.attention_budget import LayerBudget
from spectral_monitor.core.attention_plan import AttentionPlan, attention_images, drawn_head
from spectral_monitor.core.family_protocol import (
    CaptureFamily,
    LoggingStep,
    Run,
    counted_sequences,
    layer_selected,
    mean_over_sequences,
    report_skipped,
)
from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.core.reports import Reports
from spectral_monitor.core.schedule import Cadence
from spectral_monitor.metrics import ATTENTION_LOGIT_METRICS, ATTENTION_METRICS, SEQUENCE_MAXIMA, KrylovState
from spectral_monitor.probes import AttentionCapture, AttentionRecording, CapturedAttention
from spectral_monitor.probes.huggingface import attention_not_seen_advice
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.sinks import Capability
from spectral_monitor.toolbox.head_diversity import redundant_pairs_markdown, spectra_diversity_records

__all__ = ["HISTOGRAM_METRICS", "AttentionFamily"]

HISTOGRAM_METRICS = histogram_metrics("attention")
"""The attention metrics whose per-head values are also written as a histogram (``<metric>_per_head``), as
the catalogue says: the diagnostic ones."""

_HEAD_AGGREGATES = {info.name: info.head_aggregates for info in CATALOG if info.family == "attention"}
"""Per attention metric, the aggregates over heads written per layer (``<metric>_min``/``_max``) besides
the mean: only where the catalogue says the spread over heads diagnoses something."""

_NO_ATTENTION_SEEN = (
    "the attention family is on, but the training forward made no attention-kernel call the monitor could "
    "see (F.scaled_dot_product_attention, F.multi_head_attention_forward, Hugging Face eager attention)"
)


class AttentionFamily(CaptureFamily):
    """Attention: its q and k captured during the forward, measured at the step's end within the memory
    budget (:class:`~spectral_monitor.core.attention_plan.AttentionPlan`), summed up over sequences and heads,
    with head diversity on its own cadence and the figures on figure steps.

    Per layer and metric: the mean over heads of each head's value (the mean over the sampled sequences, or
    their largest for a maximum such as ``max_logit``), the ``_min``/``_max`` aggregates the catalogue asks
    for, each head's value (written with ``per_head``, else judged by the alerts only), ``<metric>_per_head``
    histograms, and ``max_logit_growth``, the layer's largest logit over the previous logging step's where
    that one was positive. Under a cost budget also ``heads_measured``, and where fewer heads than all were
    measured each mean's standard error ``<metric>_head_se``. A non-finite attention matrix is a problem
    (raised when strict) and its metrics are NaN.

    Args:
        options: the run's options; the family captures only when ``"attention"`` is among its families.
        reports: where the family's failures and problems go.

    Attributes:
        plan: what is measured and within which memory, with the Krylov warm starts per layer.

    Examples:
        Before a run nothing is captured and nothing is kept:

        >>> family = AttentionFamily(MonitorOptions(), Reports(strict=False))
        >>> family.captures, family.state_dict()
        (False, {'attention_krylov_vectors': {}, 'previous_max_logit': {}})

        The session drives it; by hand, one logging step reads:

        ```python
        family = AttentionFamily(MonitorOptions(families=["attention"]), Reports(strict=False))
        family.start(Run(model=model, training_root=model, kept=lambda capability: False))
        family.arm(token_mask=None, every_module=False)
        loss = model(batch).loss  # the training forward: q and k captured
        family.disarm()
        progress = LoggingStep(step=10)
        with torch.no_grad():
            family.measure(progress)  # progress.measurements holds the attention records
        family.close()
        ```
    """

    capture_name = "attention"
    metrics_name = "attention metrics"

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        super().__init__(options, reports)
        self.plan = AttentionPlan(options, reports)
        self._head_diversity_cadence = Cadence.of_logs(options.outputs.head_diversity_every_n_logs)
        self._previous_max_logit: dict[str, float] = {}
        self._images = attention_images()
        self._kept: Callable[[Capability], bool] = _nothing_kept  # picklable: ddp_spawn pickles the monitor

    def start(self, run: Run) -> None:
        """Begin a run on ``run.model``: make the capture, when the attention family is on.

        Args:
            run: the run; its ``kept`` says whether a sink keeps histograms.
        """
        self._kept = run.kept
        if "attention" in self.options.families:
            self._capture = AttentionCapture(
                run.model,
                max_sequences=self.options.capture.max_sequences,
                max_bytes=int(self.options.budget.memory_budget_mb * 2**20),
                attention_families=self.options.capture.attention_families,
                strict=self.options.strict,
            )

    def close(self) -> None:
        super().close()
        self._images = attention_images()  # kept figures hold canvases: not past a run

    def _recorded(self, recording: AttentionRecording) -> None:
        report_skipped(self.reports, "attention", recording.skipped)
        if not recording.captured and not recording.skipped:
            advice = attention_not_seen_advice(self._capture.model, self._capture.attention_families)
            self.reports.once("no attention", f"{_NO_ATTENTION_SEEN}; {advice}")

    def state_dict(self) -> dict[str, Any]:
        """The family's entries of the session's checkpoint state.

        Returns:
            ``"attention_krylov_vectors"``: layer → a copy of its Krylov warm-start vectors, for the layers
            that have them; ``"previous_max_logit"``: layer → its largest logit at the last logging step.
        """
        return {
            "attention_krylov_vectors": {
                layer: state.vectors.detach().clone()
                for layer, state in self.plan.krylov_states.items()
                if state.vectors is not None
            },
            "previous_max_logit": dict(self._previous_max_logit),
        }

    def load_state_dict(self, entries: StateEntries) -> None:
        """Read back what :meth:`state_dict` gave; an unusable entry is dropped into ``entries.dropped``.

        Args:
            entries: the session's checkpoint state; warm-start vectors must be finite 3-D tensors with unit
                columns, logits finite numbers.
        """
        self.plan.krylov_states = {
            layer: KrylovState(vectors)
            for layer, vectors in entries.unit_vectors("attention_krylov_vectors", ndim=3).items()
        }
        self._previous_max_logit = entries.numbers("previous_max_logit")

    def _measure(self, progress: LoggingStep, recording: AttentionRecording) -> None:
        write_histograms = self.options.outputs.histograms and self._kept(Capability.HISTOGRAMS)
        diversity_due = self._head_diversity_cadence.due(progress.logs_done)
        # What the capture holds stays alive throughout; the rest of the budget is the working memory.
        room = int(self.options.budget.memory_budget_mb * 2**20) - sum(
            captured.held_nbytes() for captured in recording.captured
        )
        layers = [captured for captured in recording.captured if layer_selected(self.options, captured.layer)]
        measured = self.plan.measure(
            layers, room, diversity=diversity_due, draw=progress.draw_figures, logs_done=progress.logs_done
        )
        budgeted = not math.isinf(self.options.budget.attention_cost_ratio)
        drawn_heads = []
        for captured, layer in zip(layers, measured, strict=True):
            per_head, defined = self._head_means(progress.step, captured, layer.metrics)
            layer_records, head_records = _layer_measurements(
                progress.step, captured.layer, per_head, defined, layer.budget, budgeted
            )
            progress.measurements += layer_records + self._max_logit_growth(
                progress.step, captured.layer, per_head
            )
            # The layer's shape, for the alerts' text: the n of their advice, the heads a budget left out.
            progress.read_only += [
                Measurement(progress.step, "attention", KEYS_METRIC, captured.layer, captured.k.shape[-2]),
                Measurement(progress.step, "attention", HEADS_METRIC, captured.layer, layer.budget.num_heads),
            ]
            if self.options.outputs.per_head:
                progress.measurements += head_records
            else:
                progress.read_only += head_records
            if write_histograms:
                # "_per_head": a histogram tag equal to a scalar tag hides the scalar in TensorBoard's
                # default (fast) loader, which keeps one data class per tag.
                progress.distributions += [
                    Distribution(
                        progress.step, "attention", f"{metric}_per_head", captured.layer, head_values.numpy()
                    )
                    for metric, head_values in per_head.items()
                    if metric in HISTOGRAM_METRICS
                ]
            drawn = drawn_head(captured.layer, layer, per_head)
            if drawn is not None:
                drawn_heads.append(drawn)
        if drawn_heads:
            progress.figures += self._images.drawn(drawn_heads)
        if diversity_due:
            with self.reports.failures_of("measuring head diversity"):
                spectra = {
                    captured.layer: layer.spectra
                    for captured, layer in zip(layers, measured, strict=True)
                    if layer.spectra is not None
                }
                records, pairs = spectra_diversity_records(progress.step, spectra)
                # The spectra of a layer measured on some heads are numbered by position among them.
                heads = {
                    captured.layer: layer.budget.heads
                    for captured, layer in zip(layers, measured, strict=True)
                }
                pairs = {
                    name: [(heads[name][h], heads[name][g], distance) for h, g, distance in layer_pairs]
                    for name, layer_pairs in pairs.items()
                }
                progress.measurements += records
                if pairs:
                    progress.texts.append(
                        ("attention/redundant_heads", redundant_pairs_markdown(progress.step, pairs))
                    )

    def _head_means(
        self, step: int, captured: CapturedAttention, metrics: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Each metric per head over the sampled sequences: their mean, or their largest for a maximum; and
        per metric the heads (bool) where some sequence has a value, non-finite included (the threshold rank
        of a head the quadrature did not resolve in any sequence has none)."""
        nonfinite = metrics["nonfinite"]
        if nonfinite.any():
            self.reports.problem(
                "non-finite attention",
                f"non-finite attention in {captured.layer} at step {step}: its probabilities hold NaN or inf "
                "(or its q and k do), so its metrics are written as NaN",
            )
        # eigen_gap has no value for a causal or rectangular matrix, non-finite or not: never written there.
        square = captured.q.shape[-2] == captured.k.shape[-2]
        undefined = () if square and not captured.causal else ("eigen_gap",)
        per_head, defined = {}, {}
        for metric in (*ATTENTION_METRICS, *ATTENTION_LOGIT_METRICS):
            if metric not in metrics or metric in undefined:
                continue
            over_sequences = _max_over_sequences if metric in SEQUENCE_MAXIMA else mean_over_sequences
            summary = over_sequences(metrics[metric], nonfinite)
            if summary is not None:
                per_head[metric] = summary.to("cpu", torch.float64)
                defined[metric] = counted_sequences(metrics[metric], nonfinite).any(dim=0).cpu()
        return per_head, defined

    def _max_logit_growth(self, step: int, layer: str, per_head: dict[str, Tensor]) -> list[Measurement]:
        """``max_logit_growth``: the layer's largest logit over the previous logging step's, written where
        both are measured and the previous one is positive (a ratio of logits of either sign says nothing)."""
        if "max_logit" not in per_head:
            return []
        current = float(per_head["max_logit"].amax())
        previous = self._previous_max_logit.get(layer)
        self._previous_max_logit[layer] = current
        if previous is None or not previous > 0 or not math.isfinite(previous):
            return []
        return [Measurement(step, "attention", "max_logit_growth", layer, current / previous)]


def _layer_measurements(
    step: int,
    layer: str,
    per_head: dict[str, Tensor],
    defined: dict[str, Tensor],
    budget: LayerBudget,
    budgeted: bool,
) -> tuple[list[Measurement], list[Measurement]]:
    """A layer's attention records: the head mean of each metric with the aggregates of ``_HEAD_AGGREGATES``;
    and each head's value; over the heads where it is ``defined``. Under a cost budget (``budgeted``) also
    the number of heads measured, and where those are fewer than all (``budget``), each mean's standard
    error as an estimate of the mean over all."""
    layer_records, head_records = [], []
    if budgeted:
        layer_records.append(Measurement(step, "attention", "heads_measured", layer, len(budget.heads)))
    for metric, every_head in per_head.items():
        values = every_head[defined[metric]]
        heads = [head for head, has in zip(budget.heads, defined[metric].tolist(), strict=True) if has]
        layer_records.append(Measurement(step, "attention", metric, layer, float(values.mean())))
        for aggregate in _HEAD_AGGREGATES.get(metric, ()):
            value = values.amin() if aggregate == "min" else values.amax()
            layer_records.append(Measurement(step, "attention", f"{metric}_{aggregate}", layer, float(value)))
        if budget.sampled and values.numel() > 1:
            error = head_sample_standard_error(values, budget.num_heads)
            layer_records.append(Measurement(step, "attention", f"{metric}_head_se", layer, error))
        head_records += [
            Measurement(step, "attention", metric, layer, value, head=head)
            for head, value in zip(heads, values.tolist(), strict=True)
        ]
    return layer_records, head_records


def head_sample_standard_error(values: Tensor, num_heads: int) -> float:
    """The standard error of the mean of ``values`` (k,), measured on k of ``num_heads`` heads drawn without
    replacement, as an estimate of the mean over all heads: s/√k · √((H − k)/(H − 1)), s the standard
    deviation of the k (at least two) values."""
    count = values.numel()
    spread = float(values.double().std(correction=1))
    return spread / math.sqrt(count) * math.sqrt((num_heads - count) / (num_heads - 1))


def _max_over_sequences(values: Tensor, nonfinite: Tensor) -> Tensor | None:
    """The largest over the sequences (dim 0) of ``values`` defined for them, NaN where one was non-finite;
    None where no sequence has a value
    (as :func:`~spectral_monitor.core.family_protocol.mean_over_sequences`)."""
    counted = counted_sequences(values, nonfinite)
    if not bool(counted.any()):
        return None
    # A non-finite sequence's value is NaN, which amax propagates.
    largest = torch.where(counted, values, torch.full_like(values, -math.inf)).amax(dim=0)
    return largest.masked_fill(~counted.any(dim=0), math.nan)


def _nothing_kept(capability: Capability) -> bool:
    return False
