"""Runs SpectralMonitor on a model written outside this project and checks what it logs against float64.

A family (``conformance_models``) gives a monitored model, the batches of its padding cases (one per
training step), and for a batch the attention probabilities and block outputs of an independent source
(the eager twin's ``output_attentions``, or the kernel's inputs recomputed in float64) with the real tokens
of the batch. The monitor runs in a real ``Trainer.fit`` with learning rate 0 (the weights stay those of the
twin), measuring every step, and every attention and token value it logs for a layer must equal the
reference over real queries × attendable keys (real tokens) within ``TOLERANCE``, relative to the value's
size where it exceeds 1. Metrics the reference leaves undefined for a layer (``eigen_gap`` of causal
attention, every metric of a layer with nothing to measure) must not be logged at all. Where a family's
reference also gives the kernel's q and k, ``max_logit`` (per head the largest over the sequences) and its
growth from the previous case's step are checked too; elsewhere those tags are left out of the comparison.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from helpers.reference_metrics import attention_reference, max_logit_reference, token_reference
from pytorch_lightning.loggers import Logger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from spectral_monitor import SpectralMonitor
from spectral_monitor.alerts import AlertEvent
from spectral_monitor.catalog import metric_info
from spectral_monitor.metrics import ATTENTION_METRICS
from spectral_monitor.probes import AttentionExtractor, register_attention_extractor

TOLERANCE = 1e-5
TOKEN_METRICS = ("cosine_similarity", "token_residual", "stable_rank", "effective_rank")
LOGIT_METRICS = ("max_logit", "max_logit_max", "max_logit_growth")


@dataclass
class LogitInputs:
    """The attention kernel's inputs of one layer in float64: ``q`` (B, H, n, d), ``k`` (B, H, m, d), and the
    ``scale`` of q·k (the masks are the layer reference's)."""

    q: np.ndarray
    k: np.ndarray
    scale: float


@dataclass
class LayerReference:
    """One attention layer of one batch from an independent source.

    ``probs`` (B, H, n, m); ``real_queries`` (B, n) and ``real_keys`` (B, m) bool; ``causal``: query i may
    attend keys j <= i only (on top of ``real_keys``); ``logit_inputs``: q and k, where the source gives them;
    ``window``: a sliding window, query i attends keys j > i - window only.
    """

    layer: str
    probs: np.ndarray
    real_queries: np.ndarray
    real_keys: np.ndarray
    causal: bool
    logit_inputs: LogitInputs | None = None
    window: int | None = None

    def attendable(self) -> np.ndarray:
        """(B, n, m) bool: the keys each query may attend."""
        sequences, _, n, m = self.probs.shape
        attendable = np.broadcast_to(self.real_keys[:, None, :], (sequences, n, m)).copy()
        if self.causal:
            attendable &= np.tri(n, m, dtype=bool)
        if self.window is not None:
            attendable &= ~np.tri(n, m, -self.window, dtype=bool)
        return attendable


@dataclass
class BlockReference:
    """One block's output (B, n, d) and its real tokens (B, n)."""

    block: str
    states: np.ndarray
    real_tokens: np.ndarray


@dataclass
class Family:
    """A model family under test: its monitored model, loss, cases and independent reference."""

    name: str
    model: nn.Module
    loss: Callable[[nn.Module, dict[str, Tensor]], Tensor]
    cases: dict[str, dict[str, Tensor]]
    reference: Callable[[dict[str, Tensor]], tuple[list[LayerReference], list[BlockReference]]]
    token_mask: Callable[[Any], Tensor | None] | None = None
    extractors: dict[type[nn.Module], AttentionExtractor] = field(default_factory=dict)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call by step."""

    def __init__(self) -> None:
        super().__init__()
        self.by_step: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.by_step.setdefault(int(step or 0), {}).update(metrics)


class _Trained(pl.LightningModule):
    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, dict[str, Tensor]], Tensor]) -> None:
        super().__init__()
        self.model = model
        self._loss = loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@dataclass
class MonitoredRun:
    """What the monitor logged per case, the alerts it raised, and how many steps ran."""

    logged: dict[str, dict[str, float]]
    alerts: list[AlertEvent] = field(default_factory=list)
    steps: int = 0


def run_monitored(family: Family) -> MonitoredRun:
    """One ``Trainer.fit`` over the family's cases, one step each, the monitor measuring every step and
    stopping on a ``non_finite`` alert."""
    logger = RecordingLogger()
    alerts: list[AlertEvent] = []
    monitor = SpectralMonitor(
        every_n_steps=1,
        families=("attention", "tokens"),
        per_head=True,
        max_sequences=max(batch_size(batch) for batch in family.cases.values()),
        histograms=False,
        figures_every_n_logs=0,
        head_diversity_every_n_logs=0,
        metric_method="exact",
        preflight=False,
        strict=True,
        on_alert=alerts.append,
        stop_on=["non_finite"],
        **({} if family.token_mask is None else {"token_mask": family.token_mask}),
    )
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[monitor],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    family.model.train()
    batches = list(family.cases.values())
    handles = [
        register_attention_extractor(target, extractor) for target, extractor in family.extractors.items()
    ]
    try:
        trainer.fit(_Trained(family.model, family.loss), DataLoader(batches, batch_size=None))
    finally:
        for handle in handles:
            handle.remove()
    logged = {name: logger.by_step.get(step, {}) for step, name in enumerate(family.cases)}
    return MonitoredRun(logged, alerts, trainer.global_step)


def assert_conforms(family: Family, run: MonitoredRun, case: str) -> float:
    """Asserts that what the monitor logged for ``case`` equals the reference; returns the largest error."""
    layers, blocks = family.reference(family.cases[case])
    names = list(family.cases)
    previous = names.index(case) - 1
    previous_layers = [] if previous < 0 else family.reference(family.cases[names[previous]])[0]
    return largest_error(run.logged[case], layers, blocks, previous_layers)


def assert_no_false_alarm(family: Family, run: MonitoredRun) -> None:
    """Every case ran (``stop_on=["non_finite"]`` did not stop the run) and no alert was about NaN."""
    assert run.steps == len(family.cases)
    assert not [event for event in run.alerts if event.rule == "non_finite"]


def assert_far_from_uniform(family: Family) -> None:
    """The reference attention of every layer is sharp enough that normalisations can be told apart."""
    layers, _ = family.reference(next(iter(family.cases.values())))
    for reference in layers:
        entropy = _attention_per_head(reference)["entropy"]
        assert float(np.mean(entropy)) < 0.9, f"{reference.layer}: entropy {np.mean(entropy):.3f}"


def batch_size(batch: dict[str, Tensor]) -> int:
    return next(iter(batch.values())).shape[0]


def expected_values(
    layers: list[LayerReference],
    blocks: list[BlockReference],
    previous_layers: list[LayerReference] | tuple[()] = (),
) -> tuple[dict[str, float], set[str]]:
    """The tags the monitor must log with their reference values, and the layers and blocks they cover;
    ``previous_layers``: the reference of the step before, for the logit growth."""
    expected: dict[str, float] = {}
    previous_maxima = {
        reference.layer: float(np.max(maxima))
        for reference in previous_layers
        if (maxima := _max_logit_per_head(reference)) is not None and not np.isnan(maxima).all()
    }
    for reference in layers:
        per_head = _attention_per_head(reference)
        maxima = _max_logit_per_head(reference)
        if maxima is not None:
            per_head["max_logit"] = maxima
        for metric, values in per_head.items():
            if np.isnan(values).all():
                continue  # undefined for this layer: must not be logged
            where = f"attention/{metric}/{reference.layer}"
            expected[where] = float(np.mean(values))
            for aggregate in metric_info("attention", metric).head_aggregates:
                value = np.min(values) if aggregate == "min" else np.max(values)
                expected[f"attention/{metric}_{aggregate}/{reference.layer}"] = float(value)
            for head, value in enumerate(values):
                expected[f"{where}/head_{head}"] = float(value)
        # The default (standard) preset's cost budget measures every head of these short sequences.
        expected[f"attention/heads_measured/{reference.layer}"] = float(len(per_head["entropy"]))
        previous = previous_maxima.get(reference.layer)
        if maxima is not None and not np.isnan(maxima).all() and previous is not None and previous > 0:
            expected[f"attention/max_logit_growth/{reference.layer}"] = float(np.max(maxima)) / previous
    for reference in blocks:
        per_sequence = [
            token_reference(states, token_mask=real)
            for states, real in zip(reference.states, reference.real_tokens, strict=True)
            if real.any()
        ]
        for metric in TOKEN_METRICS:
            values = [value[metric] for value in per_sequence if not math.isnan(value[metric])]
            if values:
                expected[f"tokens/{metric}/{reference.block}"] = float(np.mean(values))
    covered = {reference.layer for reference in layers} | {reference.block for reference in blocks}
    return expected, covered


def _attention_per_head(reference: LayerReference) -> dict[str, np.ndarray]:
    """Each metric per head: the mean over the sequences that have a value (NaN where none has)."""
    probs = reference.probs
    sequences, heads = probs.shape[:2]
    attendable = reference.attendable()
    queries, keys = _measured_queries_and_keys(reference)
    values = {metric: np.full((sequences, heads), np.nan) for metric in ATTENTION_METRICS}
    for sequence in range(sequences):
        if not queries[sequence].any():
            continue  # nothing to measure
        for head in range(heads):
            metrics = attention_reference(
                probs[sequence, head],
                key_mask=keys[sequence],
                query_mask=queries[sequence],
                causal=reference.causal,
                attendable=attendable[sequence],
            )
            for metric in ATTENTION_METRICS:
                values[metric][sequence, head] = metrics[metric]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a head no sequence measures: NaN, as wanted
        return {metric: np.nanmean(value, axis=0) for metric, value in values.items()}


def _max_logit_per_head(reference: LayerReference) -> np.ndarray | None:
    """Each head's largest logit over the sequences' real queries × attendable keys (NaN where no sequence
    has one); None where the reference has no q and k."""
    inputs = reference.logit_inputs
    if inputs is None:
        return None
    sequences, heads = inputs.q.shape[:2]
    queries, keys = _measured_queries_and_keys(reference)
    values = np.full((sequences, heads), np.nan)
    for sequence in range(sequences):
        for head in range(heads):
            values[sequence, head] = max_logit_reference(
                inputs.q[sequence, head], inputs.k[sequence, head], scale=inputs.scale,
                key_mask=keys[sequence], query_mask=queries[sequence], causal=reference.causal,
            )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a head no sequence measures: NaN, as wanted
        return np.nanmax(values, axis=0)


def _measured_queries_and_keys(reference: LayerReference) -> tuple[np.ndarray, np.ndarray]:
    """(B, n) real queries with an attendable key and (B, m) keys some such query may attend."""
    attendable = reference.attendable()
    queries = reference.real_queries & attendable.any(axis=2)
    return queries, (attendable & queries[:, :, None]).any(axis=1)


def largest_error(
    logged: dict[str, float],
    layers: list[LayerReference],
    blocks: list[BlockReference],
    previous_layers: list[LayerReference] | tuple[()] = (),
) -> float:
    """The largest relative difference between what was logged and the reference; asserts that every
    expected tag was logged and nothing else for the layers and blocks covered (the logit metrics of a
    layer whose reference has no q and k are not compared)."""
    expected, covered = expected_values(layers, blocks, previous_layers)
    without_logits = {reference.layer for reference in layers if reference.logit_inputs is None}
    ours = {
        tag: value
        for tag, value in logged.items()
        if tag.split("/")[0] in ("attention", "tokens")
        and _layer_of(tag) in covered
        and not (tag.split("/")[1] in LOGIT_METRICS and _layer_of(tag) in without_logits)
    }
    assert set(ours) == set(expected), (
        f"logged but not expected: {sorted(set(ours) - set(expected))[:8]}; "
        f"expected but not logged: {sorted(set(expected) - set(ours))[:8]}"
    )
    errors = {tag: abs(ours[tag] - value) / max(1.0, abs(value)) for tag, value in expected.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"{worst}: logged {ours[worst]}, reference {expected[worst]}"
    assert all(math.isfinite(value) for value in ours.values())
    return errors[worst]


def _layer_of(tag: str) -> str:
    where = tag.split("/", 2)[2]
    head = where.rsplit("/", 1)
    return head[0] if len(head) == 2 and head[1].startswith("head_") else where


def sharpen_attention(model: nn.Module, names: tuple[str, ...], factor: float) -> None:
    """Scales the weights of the query and key projections named (suffixes) by ``factor``, so attention is
    far from uniform and the definitions the check compares cannot agree by accident."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(names):
                parameter.mul_(factor)


def as_float64(tensor: Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64).cpu().numpy()
