"""Spectral norms, Frobenius norms and stable ranks of a model's weights, warm-started between logging steps.

What is measured: every ``nn.Linear`` and Hugging Face ``Conv1D`` (read transposed: it stores its weight
(in, out)), and the query, key and value projections of every attention module whose layout
:mod:`spectral_monitor.probes.attention_families` knows (``nn.MultiheadAttention``, GPT-2, packed ``c_attn``
or ``qkv``, GPT-NeoX, Phi-3, separate ``q_proj``/``query``/``q``/``q_lin`` projections, and the fused
layouts of the probe's :class:`~spectral_monitor.probes.AttentionFamilies`), split out of packed weights, or
that a probe's ``attention_readers`` read. A module with a fused projection that no layout splits gets one
warning naming it and how to add its layout; its fused weight is measured whole.

Names and records (family ``"weights"``). A weight is named by its module (``blocks.0.mlp.0``); a projection
split out of an attention module ``blocks.0.attn`` is named ``blocks.0.attn.q``, ``.k``, ``.v`` whatever the
packing, so every model family reads the same (named as the module's children: when the measured model is
itself the attention module they are ``q``, ``k``, ``v``, and its own values are on ``"model"``).

- every weight: ``spectral_norm`` σ₁, ``frobenius_norm``, ``stable_rank`` ‖W‖_F²/σ₁² (NaN for a zero weight)
  and ``spectral_norm_residual``, the relative Ritz residual of the estimate (below);
- with ``per_head``, the same four for each head's rows W^h of q, k and v (``Measurement.head`` = h, tag
  ``weights/spectral_norm/blocks.0.attn.q/head_0``), and ``qk_spectral_norm`` = ‖W_Q^hᵀ W_K^h‖₂ for each
  query head h on the attention module's own name (grouped keys: query head h reads key head h // (H / H_k));
- ``qk_spectral_norm_max``, the largest over heads, per attention module, also without ``per_head``.

‖W_Q^hᵀ W_K^h‖₂ is the norm of the bilinear form of the head's attention logits, before the 1/√d_k scale and
the biases; its growth precedes attention-entropy collapse (Zhai et al. 2023). With rotary embeddings it is
the form at relative position 0. Histograms (:meth:`WeightProbe.distributions`) are named
``<metric>_per_head``, so they never share a tag with a scalar.

How. :mod:`spectral_monitor.probes.weight_norms` computes the norms: σ₁ by batched block Lanczos, each
weight (and head) warm-started between calls from its last top singular vector, so a logging step costs
``iterations_per_step`` block iterations (one Lanczos run for all weights whose smaller sides agree); a weight
seen for the first time starts cold and is solved to ``tol``, certified; a side of at most 32 gets the exact
σ₁. A warm estimate is not certified: it never exceeds σ₁ and lies within its residual of some singular
value. ‖W_Q^hᵀ W_K^h‖₂ is exact (:func:`query_key_spectral_norms`).

Sharded models: under FSDP a weight is whole only inside ``spectral_monitor.distributed.full_parameters``
(every rank enters it; the callback does); outside, a flat shard's freed views are skipped as unusable.
Names are those of :func:`~spectral_monitor.probes.wrappers.unwrapped_named_modules`, without wrapper
segments.

Observing only: everything runs under ``torch.no_grad`` on detached float32 (float64 stays float64) copies,
with a private random generator; parameters, ``.grad`` and optimizer state are never touched. Weights are
read as stored (a parametrized one as its ``original``: :mod:`spectral_monitor.probes.attention_families`).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.linalg.operators import default_generator
from spectral_monitor.probes.attention_families import (
    AttentionFamilies,
    QKVLayout,
    register_qkv_layout,
)
from spectral_monitor.probes.attention_records import ROOT_LAYER_NAME
from spectral_monitor.probes.attention_weights import (
    PACKED_PROJECTION_NAMES,
    AttentionWeights,
    AttentionWeightsReader,
    first_int,
    fused_projection_name,
    plain_weight,
)
from spectral_monitor.probes.weight_norms import (
    NormTarget,
    attention_query_key_norms,
    estimate_spectral_norms,
    full_spectra,
    query_key_spectral_norms,
)
from spectral_monitor.probes.wrappers import unwrapped_named_modules
from spectral_monitor.records import Distribution, Measurement
from spectral_monitor.validation import check_instance

__all__ = [
    "WEIGHT_FAMILY",
    "AttentionWeights",
    "AttentionWeightsReader",
    "QKVLayout",
    "WeightProbe",
    "query_key_spectral_norms",
    "register_qkv_layout",
]

WEIGHT_FAMILY = "weights"
"""The family of the weight probe's measurements: the first part of their tags."""

_PER_HEAD_METRICS = ("spectral_norm", "frobenius_norm", "stable_rank")


@dataclass
class _AttentionSite:
    module_name: str  # "" for the root module
    weights: AttentionWeights

    @property
    def layer(self) -> str:
        return _layer_name(self.module_name)

    def projections(self) -> Iterator[tuple[str, Tensor, int]]:
        """``(layer, weight, heads)`` of q, k and v, named like children of the attention module."""
        for role, weight, heads in self.weights.projections():
            yield _qualified(self.module_name, role), weight, heads


@dataclass
class _Selection:
    """What one call measures, in module order: plain weights as (layer, matrix) and attention sites."""

    items: list[tuple[str, Tensor] | _AttentionSite]
    candidate_names: list[str]


class WeightProbe:
    """Per-weight spectral norms, Frobenius norms and stable ranks of ``model``, warm-started between calls.

    :meth:`measure` returns :class:`~spectral_monitor.records.Measurement` records, :meth:`distributions`
    histograms; :meth:`state_dict` / :meth:`load_state_dict` carry the warm vectors through a checkpoint. The
    modules are read afresh at every call, so weights added, removed or reshaped are followed.

    Args:
        model: The model whose weights are measured; only read.
        include: ``fnmatch`` patterns over qualified module names: a weight is measured when its module (for
            a split projection: the attention module or the packed submodule) matches one of them. None: all.
        exclude: Patterns of modules left out, even when ``include`` matches them. :attr:`unmatched_patterns`
            lists the patterns of either that select nothing.
        iterations_per_step: Block Lanczos iterations per call for a warm weight.
        tol: Relative Ritz residual at which an estimate stops early, in (0, 1).
        per_head: Also measure each attention head's rows of q, k and v, and ‖W_Q^hᵀ W_K^h‖₂ per head.
        attention_readers: Module types or module-name patterns mapped to a function returning the module's
            :class:`AttentionWeights` (or None: not attention), tried before ``attention_families``.
        attention_families: The :class:`~spectral_monitor.probes.AttentionFamilies` registry that reads
            every other module. None: ``AttentionFamilies()``, the layouts registered when the probe is made.
        warn: Receives the one warning about a fused projection no layout splits (None: a
            ``RuntimeWarning``).

    Raises:
        ValueError: If ``model`` is not an ``nn.Module``, ``iterations_per_step`` is not a positive int,
            ``tol`` is not in (0, 1), ``per_head`` is not a bool, a pattern list is empty or not of strings,
            ``attention_readers`` maps something other than module types or strings to callables, or
            ``attention_families`` is not an ``AttentionFamilies``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(3, 2, bias=False)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]]))
        >>> probe = WeightProbe(nn.Sequential(layer))
        >>> {record.metric: round(record.value, 4) for record in probe.measure(step=0)}
        {'spectral_norm': 4.0, 'frobenius_norm': 5.0, 'stable_rank': 1.5625, 'spectral_norm_residual': 0.0}
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        iterations_per_step: int = 2,
        tol: float = 1e-3,
        per_head: bool = True,
        attention_readers: Mapping[type[nn.Module] | str, AttentionWeightsReader] | None = None,
        attention_families: AttentionFamilies | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if (
            isinstance(iterations_per_step, bool)
            or not isinstance(iterations_per_step, int)
            or iterations_per_step < 1
        ):
            raise ValueError(f"iterations_per_step must be a positive int, got {iterations_per_step!r}")
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
            raise ValueError(f"tol must be a float in (0, 1), got {tol!r}")
        if not isinstance(per_head, bool):
            raise ValueError(f"per_head must be a bool, got {per_head!r}")
        for target, reader in (attention_readers or {}).items():
            is_module_type = isinstance(target, type) and issubclass(target, nn.Module)
            if not (is_module_type or isinstance(target, str)) or not callable(reader):
                raise ValueError(
                    "attention_readers must map nn.Module subclasses or module-name patterns (str) to "
                    f"callables, got {target!r}: {reader!r}"
                )
        self.model = model
        self.include = _patterns("include", include)
        self.exclude = _patterns("exclude", exclude) or ()
        self.iterations_per_step = iterations_per_step
        self.tol = float(tol)
        self.per_head = per_head
        self.attention_readers = dict(attention_readers or {})
        self.attention_families = check_instance("attention_families", attention_families, AttentionFamilies)
        self._warn = warn or _runtime_warning
        self._fused_layouts_checked = False  # once, at the first measurement: the model's modules stay
        self._generator = default_generator(torch.device("cpu"))
        # Each weight's top singular vector on its smaller side (the checkpoint's "right_vectors").
        self._warm_vectors: dict[str, Tensor] = {}
        self._latest_histograms: tuple[int, list[Distribution]] | None = None

    @property
    def unmatched_patterns(self) -> list[str]:
        """The ``include`` and ``exclude`` patterns that match no module the probe could measure."""
        names = self._select(filtered=False).candidate_names
        patterns = [*(self.include or ()), *self.exclude]
        return [pattern for pattern in patterns if not any(fnmatch.fnmatchcase(n, pattern) for n in names)]

    def named_matrices(self) -> Iterator[tuple[str, Tensor]]:
        """The measured weights, as :meth:`measure` names and reads them.

        q, k and v come split out of packed weights and ``Conv1D`` weights transposed: the matrices and names
        :meth:`measure` uses, for metrics it does not compute (e.g. an exact spectrum).

        Yields:
            ``(layer, W)`` for every selected weight in module order, W a detached (out, in) view sharing
            storage with the parameter: copy before modifying.
        """
        for item in self._select().items:
            if isinstance(item, _AttentionSite):
                for layer, weight, _ in item.projections():
                    yield layer, weight
            else:
                yield item

    def attention_weights(self) -> list[tuple[str, AttentionWeights]]:
        """The projections of each selected attention module.

        Returns:
            ``(qualified module name, projections)`` per attention module, in module order; ``""`` names the
            root.
        """
        items = self._select().items
        return [(item.module_name, item.weights) for item in items if isinstance(item, _AttentionSite)]

    @torch.no_grad()
    def measure(self, step: int) -> list[Measurement]:
        """Advance every estimate by ``iterations_per_step`` (cold ones to ``tol``).

        Args:
            step: The step the records carry; the histograms of this step are kept for :meth:`distributions`.

        Returns:
            The records of family ``"weights"`` (the module docstring lists them), in module order.
        """
        measurements, histograms = self._run(step)
        self._latest_histograms = (step, histograms)
        return measurements

    @torch.no_grad()
    def singular_values(self) -> dict[str, np.ndarray]:
        """Every singular value of each weight :meth:`named_matrices` yields: a full eigendecomposition of
        its smaller Gram matrix, formed in float64 (each σᵢ within ~1e-8·σ₁; a float64 weight by ``svdvals``),
        meant for occasional steps.

        Returns:
            Each weight's singular values, descending, as a float64 array, by layer; all NaN for a weight
            holding NaN or inf.
        """
        return full_spectra([NormTarget(layer, None, matrix) for layer, matrix in self.named_matrices()])

    @torch.no_grad()
    def distributions(
        self, step: int, *, singular_values: Mapping[str, np.ndarray] | None = None
    ) -> list[Distribution]:
        """Per-head histograms of ``step``: ``<metric>_per_head`` of q, k, v, ``qk_spectral_norm_per_head``.

        Reuses the estimates of :meth:`measure` at the same step, or runs it.

        Args:
            step: The step of the histograms.
            singular_values: Also a histogram of each weight's whole spectrum (``singular_values``), from
                :meth:`singular_values` at this step, so that a caller needing the spectra for more than the
                histograms decomposes the weights once.

        Returns:
            The histograms, per attention module (per projection for the norms) and, with
            ``singular_values``, per weight.
        """
        if self._latest_histograms is None or self._latest_histograms[0] != step:
            self.measure(step)
        assert self._latest_histograms is not None
        records = list(self._latest_histograms[1])
        if singular_values is not None:
            records.extend(
                Distribution(step, WEIGHT_FAMILY, "singular_values", layer, spectrum)
                for layer, spectrum in singular_values.items()
            )
        return records

    def state_dict(self) -> dict[str, Any]:
        """What a resumed probe needs to go on as this one would.

        Returns:
            ``{"right_vectors": ..., "generator": ...}``: each weight's top singular vector on its smaller
            side (the left one of a wide weight), a copy keyed by layer (``layer/head_h`` per head), and the
            private generator's state. A vector whose length does not fit its weight starts it cold.
        """
        return {
            "right_vectors": {key: vector.detach().clone() for key, vector in self._warm_vectors.items()},
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any] | StateEntries) -> list[str]:
        """Restore :meth:`state_dict`'s output, entry by entry (:meth:`usable_state`).

        Weights without an entry start cold; entries for absent weights, and vectors whose length no longer
        fits their weight, are dropped at the next :meth:`measure`.

        Args:
            state_dict: What :meth:`state_dict` returned, or its entries already read from a checkpoint.

        Returns:
            The entries dropped, each named with why (the session warns of them).
        """
        entries = state_dict if isinstance(state_dict, StateEntries) else StateEntries(state_dict)
        state = self.usable_state(entries)
        self._warm_vectors = state["right_vectors"]
        if "generator" in state:
            self._generator.set_state(state["generator"])
        self._latest_histograms = None
        return entries.dropped

    @staticmethod
    def usable_state(entries: StateEntries) -> dict[str, Any]:
        """The entries of a checkpoint's state that :meth:`load_state_dict` can use.

        Args:
            entries: The checkpoint's entries; those it cannot use are dropped, named in ``entries.dropped``.

        Returns:
            ``right_vectors``: the warm vectors that are 2-D tensors of finite floats with unit columns, and
            ``generator`` where the state is one a CPU generator takes.
        """
        state: dict[str, Any] = {"right_vectors": entries.unit_vectors("right_vectors", ndim=2)}
        generator = entries.generator_state("generator")
        if generator is not None:
            state["generator"] = generator
        return state

    # ----------------------------------------------------------------------------------------------------
    # Finding the weights
    # ----------------------------------------------------------------------------------------------------

    def _select(self, filtered: bool = True) -> _Selection:
        modules = dict(unwrapped_named_modules(self.model))
        sites: dict[str, AttentionWeights] = {}
        for name, module in modules.items():
            weights = self._read_attention(name, module)
            if weights is not None:
                sites[name] = weights
        if filtered and not self._fused_layouts_checked:
            self._fused_layouts_checked = True
            self._warn_about_unsplit_projections(modules, sites)
        replaced = {_qualified(name, child) for name, weights in sites.items() for child in weights.replaces}

        items: list[tuple[str, Tensor] | _AttentionSite] = []
        candidate_names: list[str] = []
        seen_storage: set[tuple[int, tuple[int, ...]]] = set()
        for name, module in modules.items():
            if name in sites:
                names = [_layer_name(name), *(_qualified(name, child) for child in sites[name].replaces)]
                candidate_names.extend(names)
                if not filtered or self._selected(names):
                    items.append(_AttentionSite(name, sites[name]))
                continue
            if name in replaced:
                continue
            matrix = plain_weight(module)
            if matrix is None:
                continue
            layer = _layer_name(name)
            candidate_names.append(layer)
            storage = (matrix.data_ptr(), tuple(matrix.shape))
            if (filtered and not self._selected([layer])) or storage in seen_storage:
                continue
            seen_storage.add(storage)  # a weight tied to one already listed is measured once
            items.append((layer, matrix))
        return _Selection(items, candidate_names)

    def _selected(self, names: list[str]) -> bool:
        def matches(patterns: Sequence[str]) -> bool:
            return any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in patterns)

        return (self.include is None or matches(self.include)) and not matches(self.exclude)

    def _read_attention(self, name: str, module: nn.Module) -> AttentionWeights | None:
        for target, reader in self.attention_readers.items():
            matched = (
                fnmatch.fnmatchcase(_layer_name(name), target)
                if isinstance(target, str)
                else isinstance(module, target)
            )
            if matched:
                weights = reader(module)
                if weights is None:
                    return None
                if not isinstance(weights, AttentionWeights):
                    raise ValueError(
                        f"attention_readers: the reader for {target!r} must return AttentionWeights or None, "
                        f"got {type(weights).__name__} for module {_layer_name(name)!r}"
                    )
                value = None if weights.value is None else weights.value.detach()
                return replace(weights, query=weights.query.detach(), key=weights.key.detach(), value=value)
        return self.attention_families.read_attention_weights(_layer_name(name), module)

    def _warn_about_unsplit_projections(
        self, modules: Mapping[str, nn.Module], sites: Mapping[str, Any]
    ) -> None:
        """One warning per module type whose fused q/k/v projection no layout splits, naming the fix."""
        warned: set[str] = set()
        for name, module in modules.items():
            kind = type(module).__name__
            if name in sites or kind in warned:
                continue
            fused = fused_projection_name(module)
            if fused is None:
                continue
            warned.add(kind)
            heads = self.attention_families.head_count_attributes
            counted = first_int([module, getattr(module, "config", None)], heads) is not None
            count = (
                f"its head count, which it holds under none of {', '.join(heads)}: name the attribute, "
                'attention_families=AttentionFamilies().with_attribute_names(head_count=["..."])'
            )
            where = f'SpectralMonitor: {kind} ({_layer_name(name)}) fuses q, k and v in "{fused}"'
            whole = f'no per-head weight metrics (qk_spectral_norm) for it, and "{fused}" is measured whole'
            if fused in PACKED_PROJECTION_NAMES and not counted:  # the rows' layout is known, not the heads
                self._warn(f"{where}: {whole}. The monitor needs {count}.")
                continue
            layout = f'{kind}, QKVLayout("{fused}", "concatenated")'
            self._warn(
                f"{where} in a layout the weight probe does not know: {whole}. Give the monitor its layout, "
                f"attention_families=AttentionFamilies().with_qkv_layout({layout}), or register it for "
                f"every monitor made afterwards: spectral_monitor.probes.register_qkv_layout({layout}) "
                '("interleaved" where each head\'s q, k, v rows follow each other)'
                + ("." if counted else f"; and {count}.")
            )

    # ----------------------------------------------------------------------------------------------------
    # Estimating
    # ----------------------------------------------------------------------------------------------------

    def _run(self, step: int) -> tuple[list[Measurement], list[Distribution]]:
        items = self._select().items
        targets_per_item = [self._targets(item) for item in items]
        estimates, self._warm_vectors = estimate_spectral_norms(
            [target for targets in targets_per_item for target in targets],
            self._warm_vectors,
            iterations_per_step=self.iterations_per_step,
            tol=self.tol,
            generator=self._generator,
        )

        measurements: list[Measurement] = []
        per_head: dict[tuple[str, str], list[float]] = {}
        for item, targets in zip(items, targets_per_item, strict=True):
            for target in targets:
                estimate = estimates[target.key]
                values = {
                    "spectral_norm": estimate.spectral_norm,
                    "frobenius_norm": estimate.frobenius_norm,
                    "stable_rank": estimate.stable_rank,
                    "spectral_norm_residual": estimate.residual,
                }
                for metric, value in values.items():
                    measurements.append(
                        Measurement(step, WEIGHT_FAMILY, metric, target.layer, value, head=target.head)
                    )
                    if target.head is not None and metric in _PER_HEAD_METRICS:
                        per_head.setdefault((metric, target.layer), []).append(value)
            if isinstance(item, _AttentionSite):
                norms = attention_query_key_norms(item.weights)
                if self.per_head:
                    measurements.extend(
                        Measurement(step, WEIGHT_FAMILY, "qk_spectral_norm", item.layer, value, head=h)
                        for h, value in enumerate(norms)
                    )
                    per_head[("qk_spectral_norm", item.layer)] = norms
                measurements.append(
                    Measurement(step, WEIGHT_FAMILY, "qk_spectral_norm_max", item.layer, float(np.max(norms)))
                )

        distributions = [
            Distribution(step, WEIGHT_FAMILY, f"{metric}_per_head", layer, np.asarray(values))
            for (metric, layer), values in per_head.items()
        ]
        return measurements, distributions

    def _targets(self, item: tuple[str, Tensor] | _AttentionSite) -> list[NormTarget]:
        if not isinstance(item, _AttentionSite):
            layer, matrix = item
            return [NormTarget(layer, None, matrix)]
        targets = []
        for layer, weight, heads in item.projections():
            targets.append(NormTarget(layer, None, weight))
            if self.per_head:
                targets.extend(NormTarget(layer, h, rows) for h, rows in enumerate(weight.chunk(heads)))
        return targets


# --------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------


def _runtime_warning(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _patterns(argument: str, patterns: Sequence[str] | None) -> tuple[str, ...] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str) or not all(isinstance(pattern, str) for pattern in patterns) or not patterns:
        raise ValueError(
            f"{argument} must be None or a non-empty list of fnmatch patterns over module names "
            f"(e.g. ['blocks.*.attn']), got {patterns!r}"
        )
    return tuple(patterns)


def _qualified(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _layer_name(module_name: str) -> str:
    return module_name or ROOT_LAYER_NAME
