"""How a logging step's captured attention is measured within the memory budget.

The attention of a step is the costliest thing the monitor measures: its matrices are formed from the
captured q and k (``spectral_monitor.probes.attention_records``), measured by
``spectral_monitor.metrics.attention_metrics``, and released before the next are formed.
:class:`AttentionPlan` decides, layer by layer, how: whole layers of one kind in one call, one layer in
chunks of its matrices, or blockwise from q and k where not even one matrix fits; and whether the spectra
that head diversity and the figures read fit what is left. The layers' Krylov warm-start vectors live here,
from one logging step to the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from spectral_monitor.catalog import layer_head_heatmap_metrics
from spectral_monitor.core.attention_budget import LayerBudget, layer_budget, spectra_fit
from spectral_monitor.core.options import MonitorOptions
from spectral_monitor.core.reports import Reports
from spectral_monitor.metrics import KrylovState, attention_metrics
from spectral_monitor.metrics.attention import uses_exact_path
from spectral_monitor.probes import AttentionSample, CapturedAttention
from spectral_monitor.probes.attention_records import DENSE_CALL_NBYTES
from spectral_monitor.sinks.attention_images import AttentionImages, DrawnHead
from spectral_monitor.sinks.figures import AttentionBlocks, attention_block_means
from spectral_monitor.toolbox.head_diversity import (
    SPECTRUM_DTYPES,
    attention_spectra,
    spectrum_working_nbytes,
)

__all__ = ["HEATMAP_METRICS", "AttentionPlan", "LayerAttention", "attention_images", "drawn_head"]

HEATMAP_METRICS = layer_head_heatmap_metrics()
"""The attention metrics drawn as a layer × head image (``attention/figures/<metric>``) on figure steps."""

_HEATMAP_TITLES = {
    "entropy": "entropy / log n",
    "rank_one_residual": "rank-one residual",
    "effective_rank_ratio": "effective rank / n",
}
"""Titles of the layer × head images, by metric (``HEATMAP_METRICS``; every one ranges over [0, 1])."""

_FIGURE_HEAD = 0
"""The head drawn in figures, in the first sampled sequence: always the same one, so the images of
successive steps show that head change."""


class AttentionPlan:
    """Measures the captured attention of a step's layers within the memory budget of ``options``.

    Args:
        options: the run's options (``metric_method``, ``attention_rank_sums``, ``memory_budget_mb``).
        reports: where a layer measured otherwise than asked (over budget) is reported, once.

    Attributes:
        krylov_states: each layer's warm-start vectors for the Krylov path, kept across logging steps and in
            the session's checkpoint.

    Examples:
        Uniform attention (q = 0) over 4 keys, both heads of one sequence:

        >>> import torch
        >>> q = torch.zeros(1, 2, 4, 8)
        >>> captured = CapturedAttention("blocks.0.attn", q, q, None, causal=False, scale=8**-0.5,
        ...                              key_mask=None, query_mask=None)
        >>> plan = AttentionPlan(MonitorOptions(), Reports(strict=True))
        >>> (layer,) = plan.measure([captured], room=2**28, diversity=True, draw=False)
        >>> layer.metrics["entropy"].tolist(), layer.metrics["rank_one_residual"].tolist()
        ([[1.0, 1.0]], [[0.0, 0.0]])
        >>> tuple(layer.spectra.shape), layer.budget.sampled
        ((1, 2, 4), False)
    """

    def __init__(self, options: MonitorOptions, reports: Reports) -> None:
        self.options = options
        self._reports = reports
        self.krylov_states: dict[str, KrylovState] = {}

    def measure(
        self,
        layers: list[CapturedAttention],
        room: int,
        *,
        diversity: bool,
        draw: bool,
        logs_done: int = 0,
    ) -> list[LayerAttention]:
        """Each layer's metrics (S, H), with its spectra and the drawn head's heatmap where wanted, within
        ``room`` bytes of working memory and the cost budget (``attention_cost_ratio``) of the logging step
        after ``logs_done`` others.

        Where the cost budget measures fewer than every head and sequence of a layer (:func:`layer_budget`),
        the layer is cut to them first, and its metrics are (S', k) for the heads its ``budget`` names; it is
        then measured from a cold start (its warm-start vectors are those of every head) and not drawn.

        A layer is measured densely a chunk of matrices at a time (:meth:`CapturedAttention.chunks`), as many
        as fit ``room`` with their working memory
        (:func:`~spectral_monitor.probes.attention_records.dense_working_nbytes`); where not even one fits, or
        from ``BLOCKWISE_MIN_TOKENS`` tokens, blockwise from q and k within ``room``, and it is left out of
        the figures and head diversity. Every chunk's tensors are released before the next is formed.
        Whole layers on the exact path with one shape, causality and masking are measured in one call when
        they fit together: there the elements are independent, and one call costs less than one a layer.

        Args:
            layers: the captured attention of the layers to measure.
            room: the bytes of working memory the measurement may use (the budget less what the capture
                holds).
            diversity: whether head diversity is due, so the spectra are wanted.
            draw: whether the figures are drawn this step.
            logs_done: the logging steps before this one, which rotate the heads a cost budget measures.

        Returns:
            One :class:`LayerAttention` per layer, in order, its ``budget`` set.
        """
        budgets = [self._layer_budget(captured, logs_done) for captured in layers]
        ratio = self.options.budget.attention_cost_ratio
        spectra_affordable = [
            spectra_fit(captured, budget, ratio) for captured, budget in zip(layers, budgets, strict=True)
        ]
        layers = [
            captured.selected(budget.sequences, budget.heads) if budget.sampled else captured
            for captured, budget in zip(layers, budgets, strict=True)
        ]
        room -= sum(
            captured.held_nbytes() for captured, budget in zip(layers, budgets, strict=True) if budget.sampled
        )
        results: list[LayerAttention | None] = [None] * len(layers)
        together: dict[tuple[Any, ...], list[int]] = {}
        for index, (captured, budget) in enumerate(zip(layers, budgets, strict=True)):
            n, m = captured.q.shape[2], captured.k.shape[2]
            exact = uses_exact_path(n, m, self.options.budget.metric_method, captured.causal)
            # Room is kept for the spectra (in float32 at least) when they are wanted, unless that leaves
            # not one matrix: the metrics come first.
            spectra_room = spectrum_working_nbytes(n, m, torch.float32) if diversity or draw else 0
            per_chunk = 0
            if not captured.measured_blockwise():
                per_chunk = captured.matrices_per_chunk(room - spectra_room, exact) or (
                    captured.matrices_per_chunk(room, exact)
                )
            matrices = captured.num_sequences * captured.num_heads
            if per_chunk == 0:
                results[index] = self._blockwise_attention(captured, room, exact, budget)
            elif exact and per_chunk == matrices and not budget.sampled:
                kind = (captured.q.shape[1:3], captured.k.shape[2], captured.q.device, captured.causal)
                masks = tuple(
                    tensor is None for tensor in (captured.mask, captured.key_mask, captured.query_mask)
                )
                together.setdefault((*kind, *masks), []).append(index)
            else:
                state = None if exact or budget.sampled else self._krylov_state(captured)
                results[index] = self._dense_attention(
                    [captured],
                    captured.chunks(per_chunk),
                    room,
                    state,
                    diversity and (exact or self._spectra_affordable(captured, spectra_affordable[index])),
                    draw and not budget.sampled,
                    budget.rank_sums,
                )[0]
        for indices in together.values():
            per_matrix = layers[indices[0]].dense_matrix_nbytes(exact=True)
            n, m = layers[indices[0]].q.shape[2], layers[indices[0]].k.shape[2]
            spectra_room = spectrum_working_nbytes(n, m, torch.float32) if diversity or draw else 0
            fitting = max(1, (room - spectra_room - DENSE_CALL_NBYTES) // per_matrix)
            group: list[int] = []
            for index in [*indices, None]:
                if (
                    index is not None
                    and sum(layers[i].num_sequences * layers[i].num_heads for i in [*group, index]) <= fitting
                ):
                    group.append(index)
                    continue
                members = [layers[i] for i in group]
                rank_sums = self.options.budget.attention_rank_sums
                measured = self._dense_attention(
                    members, iter(members), room, None, diversity, draw, rank_sums
                )
                for i, result in zip(group, measured, strict=True):
                    results[i] = result
                group = [] if index is None else [index]
        for result, budget in zip(results, budgets, strict=True):
            if result is not None:
                result.budget = budget
        return [result for result in results if result is not None]

    def _spectra_affordable(self, captured: CapturedAttention, affordable: bool) -> bool:
        """``affordable``, reported once where it is not: off the exact path, head diversity's spectra would
        factorise every measured matrix, which the cost budget does not allow."""
        if not affordable:
            n, m = captured.q.shape[2], captured.k.shape[2]
            self._reports.once(
                "spectra over the cost budget",
                f"factorising {captured.layer}'s {n}×{m} attention for head diversity would exceed "
                f"attention_cost_ratio={self.options.budget.attention_cost_ratio:g}; it is left out of head "
                "diversity (attention_cost_ratio=math.inf measures it)",
            )
        return affordable

    def _layer_budget(self, captured: CapturedAttention, logs_done: int) -> LayerBudget:
        options = self.options.budget
        return layer_budget(
            captured,
            options.attention_cost_ratio,
            logs_done,
            method=options.metric_method,
            rank_sums=options.attention_rank_sums,
        )

    def _dense_attention(
        self,
        layers: list[CapturedAttention],
        chunks: Iterator[CapturedAttention],
        room: int,
        state: KrylovState | None,
        diversity: bool,
        draw: bool,
        rank_sums: bool,
    ) -> list[LayerAttention]:
        """The attention of ``layers`` measured densely: several whole layers of one kind in one call (the
        chunks are the layers), or one layer in ``chunks`` of its matrices, one call each, in order;
        ``rank_sums``: with the effective and threshold ranks."""
        if len(layers) > 1:
            call = self._dense_call(list(chunks), room, None, diversity, draw, rank_sums)
            sizes = [layer.num_sequences for layer in layers]
            metrics = {name: values.split(sizes) for name, values in call.metrics.items()}
            spectra = None if call.spectra is None else call.spectra.split(sizes)
            return [
                LayerAttention(
                    {name: split[position] for name, split in metrics.items()},
                    None if spectra is None else spectra[position],
                    call.drawn[position],
                )
                for position in range(len(layers))
            ]
        (layer,) = layers
        warm = None if state is None else state.vectors
        warm_fits = warm is not None and warm.shape[0] == layer.num_sequences * layer.num_heads
        calls, next_vectors, first = [], [], 0
        for chunk in chunks:
            count = chunk.num_sequences * chunk.num_heads
            chunk_state = None
            if state is not None:
                chunk_state = KrylovState(warm[first : first + count] if warm_fits else None)
            calls.append(
                self._dense_call([chunk], room, chunk_state, diversity, draw and first == 0, rank_sums)
            )
            if chunk_state is not None:
                next_vectors.append(chunk_state.vectors)
            first += count
        if state is not None and all(vectors is not None for vectors in next_vectors):
            state.vectors = torch.cat(next_vectors)
        shape = (layer.num_sequences, layer.num_heads)
        metrics = {
            name: torch.cat([call.metrics[name].reshape(-1) for call in calls]).reshape(shape)
            for name in calls[0].metrics
        }
        spectra = None
        if all(call.spectra is not None for call in calls):
            spectra = torch.cat([call.spectra.flatten(0, 1) for call in calls]).unflatten(0, shape)
        return [LayerAttention(metrics, spectra, calls[0].drawn[0])]

    def _dense_call(
        self,
        parts: list[CapturedAttention],
        room: int,
        state: KrylovState | None,
        diversity: bool,
        draw: bool,
        rank_sums: bool,
    ) -> _DenseCall:
        """One ``attention_metrics`` call on ``parts`` (one kind), their probabilities formed into one
        buffer; then, within what the buffer leaves of ``room``, their spectra and each part's first
        matrix's heatmap. The call's tensors are released when it returns."""
        first = parts[0]
        heads, n, m = first.num_heads, first.q.shape[2], first.k.shape[2]
        sequences = [part.num_sequences for part in parts]
        probs = torch.empty((sum(sequences), heads, n, m), dtype=torch.float32, device=first.q.device)
        samples = [part.sample(out=block) for part, block in zip(parts, probs.split(sequences), strict=True)]
        key_mask = _concatenated([sample.key_mask for sample in samples])
        query_mask = _concatenated([sample.query_mask for sample in samples])
        metrics = attention_metrics(
            probs,
            key_mask=_per_head(key_mask, heads),
            query_mask=_per_head(query_mask, heads),
            causal=first.causal,
            attendable=_concatenated_patterns([sample.attendable for sample in samples], heads),
            method=self.options.budget.metric_method,
            include_rank_sums=rank_sums,
            state=state,
            return_spectra=diversity or draw,
        )
        # Singular values already computed serve head diversity and the figures: nothing is factorised twice.
        computed_spectra = metrics.pop("singular_values", None)
        if all(sample.max_logit is not None for sample in samples):
            metrics["max_logit"] = torch.cat([sample.max_logit for sample in samples])
        call = _DenseCall(metrics, None, [None] * len(parts))
        if not (diversity or draw):
            return call
        dtype = torch.float64
        if computed_spectra is not None:
            call.spectra = computed_spectra.double().cpu()  # where attention_spectra puts them
        else:
            left = room - probs.numel() * probs.element_size() - DENSE_CALL_NBYTES
            dtype = next(
                (dtype for dtype in SPECTRUM_DTYPES if spectrum_working_nbytes(n, m, dtype) <= left), None
            )
            if dtype is None:
                self._reports.once(
                    "spectra over budget",
                    f"the memory budget ({self.options.budget.memory_budget_mb:g} MB) leaves no room for the "
                    f"singular values of {first.layer}'s {n}×{m} attention; it is left out of head diversity "
                    "and the figures",
                )
                return call
        if diversity and call.spectra is None:
            call.spectra = attention_spectra(probs, query_mask, key_mask, dtype)
        if draw:
            firsts = torch.tensor([0, *sequences[:-1]]).cumsum(0).tolist()
            call.drawn = [
                _drawn_attention(
                    sample,
                    attention_spectra(
                        sample.probs[:1, _FIGURE_HEAD : _FIGURE_HEAD + 1],
                        None if sample.query_mask is None else sample.query_mask[:1],
                        None if sample.key_mask is None else sample.key_mask[:1],
                        dtype,
                    )[0, 0]
                    if call.spectra is None
                    else call.spectra[position, _FIGURE_HEAD],
                )
                for sample, position in zip(samples, firsts, strict=True)
            ]
        return call

    def _blockwise_attention(
        self, captured: CapturedAttention, room: int, exact: bool, budget: LayerBudget
    ) -> LayerAttention:
        """One layer's metrics from q and k in blocks within ``room``; on the Krylov path where the exact
        one would form whole matrices beyond it."""
        method = self.options.budget.metric_method
        if exact and not captured.measured_blockwise():
            method = "krylov"
            self._reports.once(
                "exact over budget",
                f"the memory budget ({self.options.budget.memory_budget_mb:g} MB) is too small for the exact "
                f"measurement of one of {captured.layer}'s attention matrices "
                f"({captured.dense_matrix_nbytes(True) / 2**20:.0f} MiB); it is measured on the Krylov path "
                "from q and k",
            )
        return LayerAttention(
            captured.blockwise_metrics(
                method=method,
                max_bytes=max(room, 2**20),
                include_rank_sums=budget.rank_sums,
                state=None if budget.sampled else self._krylov_state(captured),
            )
        )

    def _krylov_state(self, captured: CapturedAttention) -> KrylovState:
        """The layer's warm-start vectors, on the capture's device."""
        state = self.krylov_states.setdefault(captured.layer, KrylovState())
        if state.vectors is not None and state.vectors.device != captured.q.device:  # from a checkpoint
            state.vectors = state.vectors.to(captured.q.device)
        return state


@dataclass
class _DrawnAttention:
    """What the figures draw of one layer's head ``_FIGURE_HEAD`` in its first sequence."""

    blocks: AttentionBlocks  # the heatmap's block means over real queries × keys, padding keys left out
    singular_values: np.ndarray  # of the attention restricted to real queries and attendable keys


@dataclass
class _DenseCall:
    """One dense ``attention_metrics`` call's results: metrics (S, H), spectra (S, H, k) where measured, and
    each part's drawn attention where drawn and drawable."""

    metrics: dict[str, Tensor]
    spectra: Tensor | None
    drawn: list[_DrawnAttention | None]


@dataclass
class LayerAttention:
    """A layer's attention as measured.

    Attributes:
        metrics: each metric's (S, H) values, by name (with ``nonfinite``, a bool (S, H)).
        spectra: (S, H, k) float64 singular values for head diversity and the figures; None where the layer
            was measured blockwise, the spectra were not wanted or did not fit the memory budget.
        drawn: what the figures draw of the layer's head, where drawn and drawable.
        budget: the heads and sequences measured; where fewer than all, the metrics' H and S are those it
            names.

    Examples:
        >>> import torch
        >>> layer = LayerAttention({"entropy": torch.ones(2, 4)})
        >>> layer.spectra is None, layer.drawn is None
        (True, True)
    """

    metrics: dict[str, Tensor]
    spectra: Tensor | None = None
    drawn: _DrawnAttention | None = None
    budget: LayerBudget | None = None


def _drawn_attention(sample: AttentionSample, singular_values: Tensor) -> _DrawnAttention | None:
    """Head ``_FIGURE_HEAD`` of the first sequence of ``sample``, with its ``singular_values``, reduced to
    what its figures draw; None when it cannot be drawn: no real query or no attendable key (all padding), or
    attention holding NaN or inf (its spectrum is NaN; written as such by the metrics)."""
    real_queries = sample.probs.shape[2] if sample.query_mask is None else int(sample.query_mask[0].sum())
    attendable_keys = sample.probs.shape[3] if sample.key_mask is None else int(sample.key_mask[0].sum())
    if min(real_queries, attendable_keys) == 0 or not bool(singular_values.isfinite().all()):
        return None
    # The block means read the float32 matrix in place, a few rows at a time (no float64 copy of it).
    attention = sample.probs[0, _FIGURE_HEAD].cpu().numpy()
    return _DrawnAttention(
        blocks=attention_block_means(
            attention,
            None if sample.key_mask is None else (~sample.key_mask[0]).cpu().numpy(),
            None if sample.query_mask is None else sample.query_mask[0].nonzero().flatten().cpu().numpy(),
        ),
        singular_values=singular_values[: min(real_queries, attendable_keys)].numpy(),
    )


def drawn_head(layer: str, attention: LayerAttention, per_head: dict[str, Tensor]) -> DrawnHead | None:
    """What the figures draw of a layer; None where it was not drawn.

    A layer is not drawn when the figures were not due, it was measured blockwise or under a head sample,
    or its drawn head has no real query, no attendable key or a non-finite spectrum.

    Args:
        layer: the layer's qualified name.
        attention: the layer as measured.
        per_head: each metric's per-head (H,) values; those of :data:`HEATMAP_METRICS` go into the layer ×
            head images.

    Returns:
        The drawn head's block means and singular values with the layer's per-head heatmap values, or None.

    Examples:
        >>> import torch
        >>> drawn_head("blocks.0.attn", LayerAttention({"entropy": torch.ones(2, 4)}), {}) is None
        True
    """
    if attention.drawn is None:
        return None
    return DrawnHead(
        layer=layer,
        blocks=attention.drawn.blocks,
        singular_values=attention.drawn.singular_values,
        head_values={metric: per_head[metric].numpy() for metric in HEATMAP_METRICS if metric in per_head},
    )


def attention_images() -> AttentionImages:
    """The run's attention figure cache, drawing the :data:`HEATMAP_METRICS` images and head 0 of the first
    sampled sequence.

    Returns:
        A new, empty cache.

    Examples:
        >>> type(attention_images()).__name__
        'AttentionImages'
    """
    return AttentionImages(HEATMAP_METRICS, _HEATMAP_TITLES, _FIGURE_HEAD)


def _concatenated(masks: list[Tensor | None]) -> Tensor | None:
    """The layers' masks as one, for measuring the layers in one call (all given or all None)."""
    return None if masks[0] is None else torch.cat(masks)


def _per_head(mask: Tensor | None, heads: int) -> Tensor | None:
    """A per-sequence (S, L) mask broadcast to (S, heads, L), the batch shape of the metrics' input."""
    return None if mask is None else mask[:, None, :].expand(-1, heads, -1)


def _concatenated_patterns(patterns: list[Tensor | None], heads: int) -> Tensor | None:
    """The samples' attendable patterns (S, H or 1, n, m) joined along the sequences, one per head."""
    if patterns[0] is None:
        return None
    return torch.cat([pattern.expand(-1, heads, -1, -1) for pattern in patterns])
