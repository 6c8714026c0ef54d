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

How. σ₁ comes from the batched block Lanczos of :mod:`spectral_monitor.linalg`, warm-started like
``torch.nn.utils.parametrizations.spectral_norm``: each weight (and head) keeps its top singular vector on
its smaller side (right for a tall weight, left for a wide one) between calls, so a logging step costs
``iterations_per_step`` block iterations, and all weights whose smaller sides agree run as one batch (one
Lanczos run for the demo model's 25 weights of four shapes). A weight seen for the first time, or whose shape
changed, starts cold and is solved to ``tol``.
A matrix with a side of at most 32 (a head of width d_k ≤ 32, a small layer) gets its exact σ₁ instead, from
the top eigenvalue of its small Gram matrix (residual 0, no warm state): Krylov iteration buys nothing there.
The residual is ‖WᵀW v − σ₁² v‖ / σ₁² (or its WWᵀ form, whichever matrix is smaller): some singular value
lies within about half of it (relative) of the estimate. A cold start is certified to be σ₁ (the
Kaniel–Paige–Saad test of :func:`~spectral_monitor.linalg.lanczos_eigsh`, failure probability 1% over its
random start). A warm estimate runs a fixed ``iterations_per_step`` and is not certified
(``docs/curvature.md`` says what a certified solve costs); its error is bounded on one side: it never exceeds
σ₁ (a Ritz value of the Gram matrix is at most its top eigenvalue) and lies within its residual of some
singular value, so after two singular values cross it can follow the one that was on top, from below.
‖W_Q^hᵀ W_K^h‖₂ is exact: see :func:`query_key_spectral_norms`.

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
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.linalg import lanczos_eigsh
from spectral_monitor.linalg.lanczos_certificate import CERTAINTY
from spectral_monitor.linalg.operators import (
    DenseOperator,
    GramOperator,
    StackedOperator,
    default_generator,
    working_dtype,
)
from spectral_monitor.metrics._common import power_of_two_exponents, powers_of_two, stable_rank
from spectral_monitor.probes.attention_families import (
    AttentionFamilies,
    QKVLayout,
    register_qkv_layout,
)
from spectral_monitor.probes.attention_records import ROOT_LAYER_NAME
from spectral_monitor.probes.attention_weights import (
    AttentionWeights,
    AttentionWeightsReader,
    check_head_split,
    fused_projection_name,
    plain_weight,
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

_COLD_START_MAX_ITERATIONS = 60  # once per weight, so it may cost what converging to ``tol`` costs
# A matrix with a side this short (a head's rows, a small layer) gets its exact σ₁ (eigvalsh): there a few
# block Krylov iterations already span the whole space, so iterating buys nothing.
_EXACT_MAX_SIZE = 32
# Bounds the float32 copies held at once (a 7B model's q, k, v and o of all layers would be 8 GiB); a single
# weight larger than this is measured alone.
_MAX_BATCH_BYTES = 256 * 2**20
_PER_HEAD_METRICS = ("spectral_norm", "frobenius_norm", "stable_rank")


def query_key_spectral_norms(
    query: Tensor, key: Tensor, num_heads: int, num_key_value_heads: int | None = None
) -> Tensor:
    """‖W_Q^hᵀ W_K^g‖₂ for every query head h (g its key head), exactly, as a (H,) tensor.

    ``query`` (H·d_k, d_q) and ``key`` (H_k·d_k, d_kv) as ``nn.Linear`` stores them, so head h's logit between
    inputs x and y is (W_Q^h x)·(W_K^g y) = xᵀ (W_Q^hᵀ W_K^g) y, with g = h // (H / H_k). With reduced QR
    factors W_Q^hᵀ = U_Q R_Q and W_K^gᵀ = U_K R_K (orthonormal U), W_Q^hᵀ W_K^g = U_Q (R_Q R_Kᵀ) U_Kᵀ has the
    singular values of the d_k × d_k matrix R_Q R_Kᵀ: nothing of size d_q × d_kv is formed.
    """
    key_heads = num_heads if num_key_value_heads is None else num_key_value_heads
    check_head_split(query, key, None, num_heads, key_heads)
    head_dim = query.shape[0] // num_heads
    query_heads = query.reshape(num_heads, head_dim, -1).transpose(1, 2)
    key_heads_per_query = key.reshape(key_heads, head_dim, -1).transpose(1, 2)
    key_heads_per_query = key_heads_per_query.repeat_interleave(num_heads // key_heads, dim=0)
    norms = query.new_full((num_heads,), math.nan)
    finite = _finite_matrices(query_heads) & _finite_matrices(key_heads_per_query)  # QR raises on NaN
    if finite.any():
        r_query = torch.linalg.qr(query_heads[finite], mode="r").R
        r_key = torch.linalg.qr(key_heads_per_query[finite], mode="r").R
        norms[finite] = torch.linalg.svdvals(r_query @ r_key.transpose(1, 2))[:, 0]
    return norms


@dataclass
class _Target:
    """One matrix whose top singular value is estimated: a whole weight, or one head's rows of it."""

    layer: str
    head: int | None
    matrix: Tensor  # a detached (out, in) view of the stored weight

    @property
    def key(self) -> str:
        return self.layer if self.head is None else f"{self.layer}/head_{self.head}"


@dataclass
class _Estimate:
    spectral_norm: float
    frobenius_norm: float
    stable_rank: float
    residual: float


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

    ``include`` / ``exclude``: ``fnmatch`` patterns over qualified module names. A weight is measured when its
    module (for a split projection: the attention module or the packed submodule) matches some ``include``
    pattern (default: all) and none of ``exclude``; :attr:`unmatched_patterns` lists patterns that select
    nothing. ``iterations_per_step``: block Lanczos iterations per call for a warm weight. ``tol``: relative
    Ritz residual at which an estimate stops early. ``per_head``: also measure each attention head.
    ``attention_readers``: module types or name patterns mapped to a function returning the module's
    :class:`AttentionWeights`, tried before ``attention_families``, the
    :class:`~spectral_monitor.probes.AttentionFamilies` registry that reads every other module (None:
    ``AttentionFamilies()``, the default as of the probe's making). ``warn``:
    receives the one warning about a fused projection no layout splits (default: a ``RuntimeWarning``).

    :meth:`measure` returns :class:`~spectral_monitor.records.Measurement` records, :meth:`distributions`
    histograms; :meth:`state_dict` / :meth:`load_state_dict` carry the warm vectors through a checkpoint.
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
        # Each weight's top singular vector on its smaller side; saved as "right_vectors" (its old name).
        self._warm_vectors: dict[str, Tensor] = {}
        self._latest_histograms: tuple[int, list[Distribution]] | None = None

    @property
    def unmatched_patterns(self) -> list[str]:
        """The ``include`` and ``exclude`` patterns that match no module the probe could measure."""
        names = self._select(filtered=False).candidate_names
        patterns = [*(self.include or ()), *self.exclude]
        return [pattern for pattern in patterns if not any(fnmatch.fnmatchcase(n, pattern) for n in names)]

    def named_matrices(self) -> Iterator[tuple[str, Tensor]]:
        """``(layer, W)`` for every measured weight, W a detached (out, in) view.

        q, k and v come split out of packed weights and ``Conv1D`` weights transposed: the matrices and names
        :meth:`measure` uses, for metrics it does not compute (e.g. an exact spectrum). Views share storage
        with the parameters: copy before modifying.
        """
        for item in self._select().items:
            if isinstance(item, _AttentionSite):
                for layer, weight, _ in item.projections():
                    yield layer, weight
            else:
                yield item

    def attention_weights(self) -> list[tuple[str, AttentionWeights]]:
        """``(qualified module name, projections)`` of each selected attention module ("" = the root)."""
        items = self._select().items
        return [(item.module_name, item.weights) for item in items if isinstance(item, _AttentionSite)]

    @torch.no_grad()
    def measure(self, step: int) -> list[Measurement]:
        """Advance every estimate by ``iterations_per_step`` (cold ones to ``tol``) and return the records."""
        measurements, histograms = self._run(step)
        self._latest_histograms = (step, histograms)
        return measurements

    @torch.no_grad()
    def distributions(self, step: int, *, full_spectrum: bool = False) -> list[Distribution]:
        """Per-head histograms (``<metric>_per_head`` of q, k, v; ``qk_spectral_norm_per_head``) of ``step``.

        Reuses the estimates of :meth:`measure` at the same step, or runs them. ``full_spectrum`` adds every
        singular value of each whole weight (``singular_values``, ``torch.linalg.svdvals``: a full SVD, meant
        for occasional steps).
        """
        if self._latest_histograms is None or self._latest_histograms[0] != step:
            self.measure(step)
        assert self._latest_histograms is not None
        records = list(self._latest_histograms[1])
        if full_spectrum:
            records.extend(self._singular_values(step))
        return records

    def state_dict(self) -> dict[str, Any]:
        """The warm vectors, keyed by layer (``layer/head_h`` per head), and the private generator's state.

        ``right_vectors`` holds each weight's top singular vector on its smaller side: the left one of a
        wide weight (earlier checkpoints held its right one, which no longer fits: that weight starts
        cold)."""
        return {
            "right_vectors": {key: vector.detach().clone() for key, vector in self._warm_vectors.items()},
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any] | StateEntries) -> list[str]:
        """Restore :meth:`state_dict`'s output, entry by entry (:meth:`usable_state`).

        Weights without an entry start cold; entries for absent weights, and vectors whose length no longer
        fits their weight, are dropped at the next :meth:`measure`.

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
        """The entries of a checkpoint's state that :meth:`load_state_dict` can use: warm vectors that are
        2-D tensors of finite floats with unit columns, and a generator state a CPU generator takes. The
        others are dropped, named in ``entries.dropped``."""
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
            layout = f'{kind}, QKVLayout("{fused}", "concatenated")'
            self._warn(
                f'SpectralMonitor: {kind} ({_layer_name(name)}) fuses q, k and v in "{fused}" in a layout '
                f"the weight probe does not know: no per-head weight metrics (qk_spectral_norm) for it, and "
                f'"{fused}" is measured whole. Give the monitor its layout, '
                f"attention_families=AttentionFamilies().with_qkv_layout({layout}), or register it for "
                f"every monitor made afterwards: spectral_monitor.probes.register_qkv_layout({layout}) "
                '("interleaved" where each head\'s q, k, v rows follow each other).'
            )

    # ----------------------------------------------------------------------------------------------------
    # Estimating
    # ----------------------------------------------------------------------------------------------------

    def _run(self, step: int) -> tuple[list[Measurement], list[Distribution]]:
        items = self._select().items
        targets_per_item = [self._targets(item) for item in items]
        estimates = self._estimate([target for targets in targets_per_item for target in targets])

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
                weights = item.weights
                (query,), query_scale = _scaled_copy([weights.query])
                (key,), key_scale = _scaled_copy([weights.key])
                norms = query_key_spectral_norms(query, key, weights.num_heads, weights.key_value_heads)
                norms = (norms.double() * query_scale * key_scale).tolist()
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

    def _targets(self, item: tuple[str, Tensor] | _AttentionSite) -> list[_Target]:
        if not isinstance(item, _AttentionSite):
            layer, matrix = item
            return [_Target(layer, None, matrix)]
        targets = []
        for layer, weight, heads in item.projections():
            targets.append(_Target(layer, None, weight))
            if self.per_head:
                targets.extend(_Target(layer, h, rows) for h, rows in enumerate(weight.chunk(heads)))
        return targets

    def _estimate(self, targets: list[_Target]) -> dict[str, _Estimate]:
        """σ₁, ‖·‖_F, stable rank and the residual of every target; keeps the warm vectors.

        The Gram operator of a weight is WᵀW or WWᵀ, whichever is smaller, and all weights with Gram
        operators of one size go through one Lanczos run (``StackedOperator``): warm ones for
        ``iterations_per_step`` iterations, new ones to ``tol``. At most ``_MAX_BATCH_BYTES`` of copies
        wait for a run at once.
        """
        estimates: dict[str, _Estimate] = {}
        vectors: dict[str, Tensor] = {}
        # (targets, their scaled copies, ‖·‖_F of those, the scales)
        waiting: list[tuple[list[_Target], Tensor, Tensor, Tensor]] = []
        waiting_bytes = 0
        for group in _batches(targets):
            matrices, scale = _scaled_copy([target.matrix for target in group])
            frobenius = torch.linalg.matrix_norm(matrices)
            if min(matrices.shape[1:]) <= _EXACT_MAX_SIZE:
                sigma = _largest_singular_values(matrices)
                estimates.update(_estimates_of(group, sigma, frobenius, torch.zeros_like(sigma), scale))
                continue
            size = matrices.numel() * matrices.element_size()
            if waiting and waiting_bytes + size > _MAX_BATCH_BYTES:
                estimates.update(self._solve(waiting, vectors))
                waiting, waiting_bytes = [], 0
            waiting.append((group, matrices, frobenius, scale))
            waiting_bytes += size
        if waiting:
            estimates.update(self._solve(waiting, vectors))
        self._warm_vectors = vectors  # weights gone or reshaped lose their state here
        return estimates

    def _solve(
        self, waiting: list[tuple[list[_Target], Tensor, Tensor, Tensor]], vectors: dict[str, Tensor]
    ) -> dict[str, _Estimate]:
        """σ₁ of every finite matrix of ``waiting`` by one Lanczos run per Gram size and warmth; the new warm
        vectors go into ``vectors``. A weight holding NaN or inf has no σ₁ (the solvers would raise): NaN,
        and it restarts cold."""
        sigma = [torch.full_like(frobenius, math.nan) for _, _, frobenius, _ in waiting]
        residual = [torch.full_like(frobenius, math.nan) for _, _, frobenius, _ in waiting]
        runs: dict[tuple[int, bool], dict[int, list[int]]] = {}  # (size, warm) -> item -> its elements
        for item, (group, matrices, _, _) in enumerate(waiting):
            finite = _finite_matrices(matrices).tolist()
            size = min(matrices.shape[1:])
            for element, target in enumerate(group):
                if finite[element]:
                    warm = self._fits(target.key, size)
                    runs.setdefault((size, warm), {}).setdefault(item, []).append(element)
        # Warm runs first: an element whose warm start gave no finite σ₁ is retried cold, before anything is
        # reported (a NaN here would read as a non-finite weight).
        for warm_pass in (True, False):
            for (size, warm), members in list(runs.items()):
                if warm != warm_pass:
                    continue
                order = [(item, element) for item, elements in members.items() for element in elements]
                operator = StackedOperator(
                    [
                        GramOperator(DenseOperator(_rows(waiting[item][1], elements)))
                        for item, elements in members.items()
                    ]
                )
                init = None
                if warm:
                    init = torch.stack(
                        [self._warm_vectors[waiting[item][0][element].key] for item, element in order]
                    )
                    init = init.to(device=operator.device, dtype=operator.dtype)
                result = lanczos_eigsh(
                    operator,
                    1,
                    tol=self.tol,
                    max_iters=self.iterations_per_step if warm else _COLD_START_MAX_ITERATIONS,
                    init=init,
                    generator=self._generator,
                    # A cold start is certified to be σ₁; a warm one runs its fixed iterations, a lower bound
                    # on σ₁ within its residual of some singular value (the module docstring).
                    failure_probability=None if warm else CERTAINTY,
                )
                values = result.values[:, 0].clamp_min(0).sqrt()
                usable = (values.isfinite() & result.vectors.isfinite().flatten(1).all(dim=1)).tolist()
                for position, (item, element) in enumerate(order):
                    if warm and not usable[position]:
                        runs.setdefault((size, False), {}).setdefault(item, []).append(element)
                        continue
                    sigma[item][element] = values[position]
                    residual[item][element] = result.info.residual[position, 0]
                    vectors[waiting[item][0][element].key] = result.vectors[position].clone()
        estimates: dict[str, _Estimate] = {}
        for item, (group, _, frobenius, scale) in enumerate(waiting):
            estimates.update(_estimates_of(group, sigma[item], frobenius, residual[item], scale))
        return estimates

    def _fits(self, key: str, size: int) -> bool:
        vector = self._warm_vectors.get(key)
        return vector is not None and vector.shape[0] == size

    def _singular_values(self, step: int) -> list[Distribution]:
        targets = [_Target(layer, None, matrix) for layer, matrix in self.named_matrices()]
        spectra: dict[str, np.ndarray] = {}
        for group in _batches(targets):
            matrices = _stacked_copy([target.matrix for target in group])
            values = matrices.new_full((len(group), min(matrices.shape[1:])), math.nan)
            finite = _finite_matrices(matrices)  # a non-finite weight's spectrum stays NaN: svd would raise
            if finite.any():
                values[finite] = torch.linalg.svdvals(matrices[finite])
            values = values.cpu().numpy()
            spectra.update((target.layer, spectrum) for target, spectrum in zip(group, values, strict=True))
        return [
            Distribution(step, WEIGHT_FAMILY, "singular_values", target.layer, spectra[target.layer])
            for target in targets
        ]


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


def _rows(matrices: Tensor, elements: list[int]) -> Tensor:
    """``matrices[elements]``, without copying the batch when that is all of it (the common case)."""
    return matrices if len(elements) == matrices.shape[0] else matrices[elements]


def _estimates_of(
    targets: list[_Target], sigma: Tensor, frobenius: Tensor, residual: Tensor, scale: Tensor
) -> dict[str, _Estimate]:
    """The estimates of ``targets`` from σ₁ and ‖·‖_F of their copies scaled down by ``scale``: the norms
    are scaled back in float64, the stable rank is a ratio of the scaled ones."""
    ratio = stable_rank(frobenius.square(), sigma)
    columns = torch.stack(
        [sigma.double() * scale, frobenius.double() * scale, ratio.double(), residual.double()], dim=1
    )
    return {target.key: _Estimate(*values) for target, values in zip(targets, columns.tolist(), strict=True)}


def _scaled_copy(matrices: list[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`_stacked_copy` of ``matrices``, each divided by the power of two that brings its largest entry
    into [0.5, 1) (:func:`~spectral_monitor.metrics._common.power_of_two_exponents`: exact, and no sum of
    squares of a finite float32 weight overflows), and those powers as float64 (batch,). A non-finite matrix
    stays as it is."""
    stacked = _stacked_copy(matrices)
    exponents = power_of_two_exponents(stacked)
    stacked.mul_(powers_of_two(-exponents, stacked.dtype)[:, None, None])
    return stacked, powers_of_two(exponents, torch.float64)


def _stacked_copy(matrices: list[Tensor]) -> Tensor:
    """One float32 (float64 stays float64) batch, a copy: nothing measured can reach a parameter."""
    stacked = torch.stack([matrix.detach() for matrix in matrices])
    return stacked.to(working_dtype(stacked.dtype))


def _finite_matrices(matrices: Tensor) -> Tensor:
    """(batch,) bool: which matrices of a (batch, rows, cols) stack hold only finite values."""
    return matrices.isfinite().flatten(1).all(dim=1)


def _largest_singular_values(matrices: Tensor) -> Tensor:
    """σ₁ of each matrix of a (batch, rows, cols) stack, exactly; NaN for one holding NaN or inf.

    From the top eigenvalue of the smaller Gram matrix: squaring loses the small singular values, never σ₁
    (the rounding is relative to σ₁²), and on small head slices it is faster than ``svdvals``
    (benchmarks/README.md).
    """
    sigma = matrices.new_full(matrices.shape[:1], math.nan)
    finite = _finite_matrices(matrices)
    if finite.any():
        kept = matrices[finite]
        gram = kept.transpose(1, 2) @ kept if kept.shape[2] <= kept.shape[1] else kept @ kept.transpose(1, 2)
        sigma[finite] = torch.linalg.eigvalsh(gram)[:, -1].clamp_min(0).sqrt()
    return sigma


def _batches(targets: list[_Target]) -> Iterator[list[_Target]]:
    """Targets of one shape, dtype and device together, at most ``_MAX_BATCH_BYTES`` of copies per batch."""
    groups: dict[tuple[Any, ...], list[_Target]] = {}
    for target in targets:
        matrix = target.matrix
        groups.setdefault((tuple(matrix.shape), matrix.dtype, matrix.device), []).append(target)
    for group in groups.values():
        matrix = group[0].matrix
        copy_bytes = matrix.numel() * torch.finfo(working_dtype(matrix.dtype)).bits // 8
        size = max(1, _MAX_BATCH_BYTES // copy_bytes)
        for start in range(0, len(group), size):
            yield group[start : start + size]


def _qualified(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _layer_name(module_name: str) -> str:
    return module_name or ROOT_LAYER_NAME
