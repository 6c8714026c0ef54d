"""Spectral norms, Frobenius norms and stable ranks of a model's weights, warm-started between logging steps.

What is measured: every ``nn.Linear`` and Hugging Face ``Conv1D`` (recognised by class name, so transformers
stays optional; it stores its weight (in, out) and is read transposed), and the query, key and value
projections of every attention module the probe recognises, split out of packed weights:

- ``nn.MultiheadAttention``: ``in_proj_weight`` rows [W_Q; W_K; W_V], or ``q_proj_weight``, ``k_proj_weight``,
  ``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``. Its ``out_proj`` is an ``nn.Linear`` and
  is measured as one.
- GPT-2-style attention (Hugging Face): a ``Conv1D`` ``c_attn`` with columns [W_Q | W_K | W_V] and an int
  ``num_heads``; as cross-attention (``is_cross_attention``) ``c_attn`` holds [W_K | W_V] and ``q_attn`` W_Q.
- a packed ``nn.Linear`` ``c_attn`` or ``qkv`` with rows [W_Q; W_K; W_V], heads contiguous within each, and an
  int head count ``n_head``, ``n_heads`` or ``num_heads`` (nanoGPT, timm, the demo model).
- a fused projection in a :class:`QKVLayout`: built in for GPT-NeoX (``query_key_value``, per head
  interleaved) and Phi-3 (``qkv_proj``, concatenated with grouped key/value heads), registered for any other
  family with :func:`register_qkv_layout`. A module with a fused projection (a child named ``qkv...``,
  ``query_key_value``, ``Wqkv`` or ``W_pack``) that no layout splits gets one warning naming it and that
  registration; its fused weight is measured whole.
- separate ``nn.Linear`` query, key and value projections (the value one optional) named ``q_proj``,
  ``k_proj``, ``v_proj`` (Hugging Face Llama, Mistral, OPT, BART, ViT, ...), ``query``, ``key``, ``value``
  (BERT, RoBERTa, ViT before transformers 5), ``q``, ``k``, ``v`` (T5) or ``q_lin``, ``k_lin``, ``v_lin``
  (DistilBERT), with an int head width
  ``head_dim``, ``attention_head_size`` or ``key_value_proj_dim``, or else an int query-head count
  ``num_heads``, ``n_heads``, ``n_head`` or ``num_attention_heads``; the key-head count follows from the key
  projection's rows (grouped-query attention). The output projection (``o_proj``, ``o``, ``dense``) is an
  ``nn.Linear`` and measured as one.
- any other layout through ``attention_readers``.

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
with a private random generator; parameters, ``.grad`` and optimizer state are never touched. A parametrized
weight (``torch.nn.utils.parametrize``) is read as its stored ``original``, because evaluating the
parametrization can change its state (``spectral_norm`` runs a power iteration on every evaluation in
training mode).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from spectral_monitor.checkpoint_entries import StateEntries
from spectral_monitor.linalg import lanczos_eigsh
from spectral_monitor.linalg.lanczos import CERTAINTY
from spectral_monitor.linalg.operators import (
    DenseOperator,
    GramOperator,
    StackedOperator,
    default_generator,
    working_dtype,
)
from spectral_monitor.metrics._common import power_of_two_exponents, powers_of_two, stable_rank
from spectral_monitor.probes.attention_records import ROOT_LAYER_NAME
from spectral_monitor.probes.wrappers import unwrapped_named_modules
from spectral_monitor.records import Distribution, Measurement

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

_COLD_START_MAX_ITERATIONS = 60  # once per weight, so it may cost what converging to ``tol`` costs
# A matrix with a side this short (a head's rows, a small layer) gets its exact σ₁ (eigvalsh): there a few
# block Krylov iterations already span the whole space, so iterating buys nothing.
_EXACT_MAX_SIZE = 32
# Bounds the float32 copies held at once (a 7B model's q, k, v and o of all layers would be 8 GiB); a single
# weight larger than this is measured alone.
_MAX_BATCH_BYTES = 256 * 2**20
_CONV1D_CLASS_NAME = "Conv1D"  # transformers.pytorch_utils.Conv1D, by name: transformers stays optional
_PACKED_PROJECTION_NAMES = ("c_attn", "qkv")
_HEAD_COUNT_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_HEAD_WIDTH_NAMES = ("head_dim", "attention_head_size", "key_value_proj_dim")
_SEPARATE_PROJECTION_NAMES = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("q_lin", "k_lin", "v_lin"),
)
_PER_HEAD_METRICS = ("spectral_norm", "frobenius_norm", "stable_rank")
_KEY_VALUE_HEAD_COUNT_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
_FUSED_PROJECTION_NAMES = ("query_key_value", "Wqkv", "W_pack")
"""Names of fused q/k/v projections besides those containing "qkv": a module with one no layout splits is
named in the probe's warning."""


@dataclass(frozen=True, eq=False)
class AttentionWeights:
    """The query, key and value projections of one attention module, each (out, in) as ``nn.Linear`` has it.

    ``query``: (H·d_k, d_q); ``key``: (H_k·d_k, d_kv); ``value``: (H_k·d_v, d_v_in) or ``None``; head h owns
    rows h·d_k … (h+1)·d_k. ``num_key_value_heads`` H_k (default H) must divide H (grouped-query attention:
    query head h reads key head h // (H / H_k)). ``replaces``: names, relative to the attention module, of the
    submodules whose weights these are (e.g. ``("c_attn",)``), so they are not also measured whole.
    """

    query: Tensor
    key: Tensor
    value: Tensor | None
    num_heads: int
    num_key_value_heads: int | None = None
    replaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, weight in (("query", self.query), ("key", self.key), ("value", self.value)):
            if weight is not None and (not isinstance(weight, Tensor) or weight.ndim != 2):
                raise ValueError(f"{name} must be a 2-D (out, in) tensor, got {_describe(weight)}")
        _check_heads(self.query, self.key, self.value, self.num_heads, self.key_value_heads)

    @property
    def key_value_heads(self) -> int:
        return self.num_heads if self.num_key_value_heads is None else self.num_key_value_heads

    def projections(self) -> Iterator[tuple[str, Tensor, int]]:
        """``(role, weight, heads)`` for ``"q"``, ``"k"`` and ``"v"`` (when there is a value projection)."""
        yield "q", self.query, self.num_heads
        yield "k", self.key, self.key_value_heads
        if self.value is not None:
            yield "v", self.value, self.key_value_heads


AttentionWeightsReader = Callable[[nn.Module], AttentionWeights | None]
"""``reader(module)`` -> the module's projections (detached views of its weights), or ``None`` when the module
is not attention after all (its submodules are then measured as plain weights)."""

QKV_LAYOUTS = ("concatenated", "interleaved")
"""How a fused projection orders its rows: [W_Q; W_K; W_V], or per head h [W_Q^h; W_K^h; W_V^h]."""


@dataclass(frozen=True)
class QKVLayout:
    """How an attention module's fused ``nn.Linear`` (or ``Conv1D``) projection holds its q, k and v.

    ``projection``: the fused child's name (``"qkv_proj"``). ``layout``: ``"concatenated"``, rows
    [W_Q; W_K; W_V] with heads contiguous within each and possibly fewer key/value heads (Phi-3's
    ``qkv_proj``), or ``"interleaved"``, per head h the rows [W_Q^h; W_K^h; W_V^h] (GPT-NeoX's
    ``query_key_value``, which its forward views as (heads, 3 · d_k)). ``num_heads``,
    ``num_key_value_heads``, ``head_dim``: ``None`` = read from the module or its ``config``
    (``num_attention_heads``/``num_heads``/..., ``num_key_value_heads``, ``head_dim``/``head_size``);
    what is missing follows from the projection's rows.

    Raises:
        ValueError: if ``projection`` is not a non-empty str, ``layout`` not one of ``QKV_LAYOUTS``, or a
            count not a positive int or None.
    """

    projection: str
    layout: str
    num_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.projection, str) or not self.projection:
            raise ValueError(
                f"projection must be a child module's name (a non-empty str), got {self.projection!r}"
            )
        if self.layout not in QKV_LAYOUTS:
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, QKV_LAYOUTS))}, got {self.layout!r}"
            )
        for name in ("num_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    def read(self, module: nn.Module) -> AttentionWeights | None:
        """``module``'s q, k and v split out of its fused projection; ``None`` when it has no such child
        or its rows do not split into the heads the module declares."""
        fused = _plain_weight(module._modules.get(self.projection))
        if fused is None:
            return None
        heads, key_heads, width = self._head_shape(module, fused.shape[0])
        if heads is None:
            return None
        if self.layout == "interleaved":
            per_head = fused.view(heads, 3, width, fused.shape[1])
            query, key, value = (per_head[:, role].reshape(heads * width, -1) for role in range(3))
        else:
            query, key, value = fused.split([heads * width, key_heads * width, key_heads * width])
        return _layout_or_none(query, key, value, heads, key_heads, replaces=(self.projection,))

    def _head_shape(self, module: nn.Module, rows: int) -> tuple[int | None, int, int]:
        """(H, H_k, d_k) of a projection with ``rows`` rows, or (None, 0, 0) where they do not fit."""
        owners = (module, getattr(module, "config", None))
        heads = self.num_heads or _first_int(owners, _HEAD_COUNT_NAMES)
        width = self.head_dim or _first_int(owners, (*_HEAD_WIDTH_NAMES, "head_size"))
        key_heads = self.num_key_value_heads or _first_int(owners, _KEY_VALUE_HEAD_COUNT_NAMES)
        if heads is None:
            return None, 0, 0
        if self.layout == "interleaved":
            key_heads = key_heads or heads
            width = width or rows // (3 * heads)
            fits = key_heads == heads and rows == 3 * heads * width
        else:
            if key_heads is None:
                key_heads = (rows // width - heads) // 2 if width else heads
            width = width or rows // (heads + 2 * key_heads)
            fits = key_heads > 0 and rows == (heads + 2 * key_heads) * width
        return (heads, key_heads, width) if fits else (None, 0, 0)


_BUILT_IN_QKV_LAYOUTS = {
    "GPTNeoXAttention": QKVLayout("query_key_value", "interleaved"),
    "Phi3Attention": QKVLayout("qkv_proj", "concatenated"),
}
"""Fused layouts known by the attention module's class name (transformers stays optional)."""

# An OrderedDict, as torch's hook registries: RemovableHandle needs a weak reference to it.
_REGISTERED_QKV_LAYOUTS: OrderedDict[int, tuple[type[nn.Module] | str, QKVLayout]] = OrderedDict()


def register_qkv_layout(target: type[nn.Module] | str, layout: QKVLayout) -> RemovableHandle:
    """Tell every :class:`WeightProbe` how the attention modules ``target`` fuse q, k and v, so they get
    per-head weight metrics (``qk_spectral_norm``, per-head σ₁)::

        register_qkv_layout(MyAttention, QKVLayout("Wqkv", "interleaved"))

    Args:
        target: a module type (matched with ``isinstance``) or an ``fnmatch`` pattern over qualified module
            names (``"blocks.*.attn"``). A later registration wins over an earlier one and over the built-in
            layouts; a probe's own ``attention_readers`` win over all.
        layout: the :class:`QKVLayout` of their fused projection.

    Returns:
        A handle whose ``remove()`` unregisters.

    Raises:
        ValueError: if ``target`` or ``layout`` is of the wrong kind.
    """
    if not (isinstance(target, str) or (isinstance(target, type) and issubclass(target, nn.Module))):
        raise ValueError(
            f"target must be an nn.Module subclass or a module-name pattern (str), got {target!r}"
        )
    if not isinstance(layout, QKVLayout):
        raise ValueError(f"layout must be a QKVLayout, got {type(layout).__name__}")
    handle = RemovableHandle(_REGISTERED_QKV_LAYOUTS)
    _REGISTERED_QKV_LAYOUTS[handle.id] = (target, layout)
    return handle


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
    _check_heads(query, key, None, num_heads, key_heads)
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
    :class:`AttentionWeights`, tried before the built-in layouts (see the module docstring). ``warn``:
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
        warn: Callable[[str], None] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not _is_positive_int(iterations_per_step):
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
            matrix = _plain_weight(module)
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
        for target, layout in reversed(_REGISTERED_QKV_LAYOUTS.values()):
            matched = (
                fnmatch.fnmatchcase(_layer_name(name), target)
                if isinstance(target, str)
                else isinstance(module, target)
            )
            if matched:
                return layout.read(module)
        built_in = _BUILT_IN_QKV_LAYOUTS.get(type(module).__name__)
        if built_in is not None:
            return built_in.read(module)
        for reader in _BUILT_IN_READERS:
            weights = reader(module)
            if weights is not None:
                return weights
        return None

    def _warn_about_unsplit_projections(
        self, modules: Mapping[str, nn.Module], sites: Mapping[str, Any]
    ) -> None:
        """One warning per module type whose fused q/k/v projection no layout splits, naming the fix."""
        warned: set[str] = set()
        for name, module in modules.items():
            kind = type(module).__name__
            if name in sites or kind in warned:
                continue
            fused = next(
                (
                    child
                    for child, submodule in module._modules.items()
                    if ("qkv" in child.lower() or child in _FUSED_PROJECTION_NAMES)
                    and _plain_weight(submodule) is not None
                ),
                None,
            )
            if fused is None:
                continue
            warned.add(kind)
            fix = f'register_qkv_layout({kind}, QKVLayout("{fused}", "concatenated"))'
            self._warn(
                f'SpectralMonitor: {kind} ({_layer_name(name)}) fuses q, k and v in "{fused}" in a layout '
                f"the weight probe does not know: no per-head weight metrics (qk_spectral_norm) for it, and "
                f'"{fused}" is measured whole. Register the layout once, before training: '
                f'spectral_monitor.probes.{fix} ("interleaved" where each head\'s q, k, v rows follow each '
                "other)."
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
# Reading weights out of modules
# --------------------------------------------------------------------------------------------------------


def _stored_weight(module: nn.Module, name: str) -> Tensor | None:
    """The detached weight ``name`` as stored (a parametrized one's ``original``), or ``None`` if unusable."""
    if parametrize.is_parametrized(module, name):
        weight = getattr(getattr(module.parametrizations, name), "original", None)
    else:
        weight = getattr(module, name, None)
    if (
        not isinstance(weight, Tensor)
        or nn.parameter.is_lazy(weight)
        or weight.ndim != 2
        or weight.numel() == 0
        or weight.is_meta
        or not weight.is_floating_point()
        or _is_shard(weight)
    ):
        return None
    return weight.detach()


def _is_shard(weight: Tensor) -> bool:
    """A sharded parameter outside ``full_parameters``: FSDP2's DTensor, or FSDP's view of a freed flat
    parameter (no storage)."""
    return type(weight).__name__ == "DTensor" or weight.untyped_storage().size() == 0


def _plain_weight(module: nn.Module) -> Tensor | None:
    """The (out, in) weight of an ``nn.Linear`` or a Hugging Face ``Conv1D``, else ``None``."""
    if isinstance(module, nn.Linear):
        return _stored_weight(module, "weight")
    if type(module).__name__ == _CONV1D_CLASS_NAME:
        weight = _stored_weight(module, "weight")
        return None if weight is None else weight.t()
    return None


def _read_multihead_attention(module: nn.Module) -> AttentionWeights | None:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    if module.in_proj_weight is not None:
        packed = _stored_weight(module, "in_proj_weight")
        if packed is None:
            return None
        query, key, value = packed.chunk(3)
    else:
        query, key, value = (_stored_weight(module, f"{role}_proj_weight") for role in ("q", "k", "v"))
        if query is None or key is None:
            return None
    return _layout_or_none(query, key, value, module.num_heads)


# The readers look for submodules in ``_modules`` before asking for attributes: ``nn.Module.__getattr__``
# raising for a name a module lacks cost most of the 2.4 ms a selection took on the demo model's 54 modules.


def _read_gpt2_attention(module: nn.Module) -> AttentionWeights | None:
    packed = module._modules.get("c_attn")
    if type(packed).__name__ != _CONV1D_CLASS_NAME:
        return None
    heads = getattr(module, "num_heads", None)
    if not _is_positive_int(heads):
        return None
    packed_weight = _plain_weight(packed)
    if packed_weight is None:
        return None
    if getattr(module, "is_cross_attention", False):
        query = _plain_weight(getattr(module, "q_attn", None))
        if query is None:
            return None
        key, value = packed_weight.chunk(2)
        return _layout_or_none(query, key, value, heads, replaces=("c_attn", "q_attn"))
    query, key, value = packed_weight.chunk(3)
    return _layout_or_none(query, key, value, heads, replaces=("c_attn",))


def _read_packed_linear_attention(module: nn.Module) -> AttentionWeights | None:
    if not any(isinstance(module._modules.get(name), nn.Linear) for name in _PACKED_PROJECTION_NAMES):
        return None
    heads = next((getattr(module, name) for name in _HEAD_COUNT_NAMES if hasattr(module, name)), None)
    if not _is_positive_int(heads):
        return None
    for name in _PACKED_PROJECTION_NAMES:
        projection = module._modules.get(name)
        if isinstance(projection, nn.Linear):
            weight = _stored_weight(projection, "weight")
            if weight is None or weight.shape[0] % 3:
                return None
            query, key, value = weight.chunk(3)
            return _layout_or_none(query, key, value, heads, replaces=(name,))
    return None


def _read_separate_projection_attention(module: nn.Module) -> AttentionWeights | None:
    for names in _SEPARATE_PROJECTION_NAMES:
        projections = [module._modules.get(name) for name in names]
        if all(isinstance(projection, nn.Linear) for projection in projections[:2]):
            break
    else:
        return None
    query, key = (_stored_weight(projection, "weight") for projection in projections[:2])
    value = _stored_weight(projections[2], "weight") if isinstance(projections[2], nn.Linear) else None
    if query is None or key is None:
        return None
    head_dim = next((getattr(module, name) for name in _HEAD_WIDTH_NAMES if hasattr(module, name)), None)
    if not _is_positive_int(head_dim):
        heads = next((getattr(module, name) for name in _HEAD_COUNT_NAMES if hasattr(module, name)), None)
        if not _is_positive_int(heads) or query.shape[0] % heads:
            return None
        head_dim = query.shape[0] // heads
    if query.shape[0] % head_dim or key.shape[0] % head_dim:
        return None
    replaces = tuple(
        name for name, projection in zip(names, projections, strict=True) if isinstance(projection, nn.Linear)
    )
    return _layout_or_none(query, key, value, query.shape[0] // head_dim, key.shape[0] // head_dim, replaces)


def _layout_or_none(*args: Any, **kwargs: Any) -> AttentionWeights | None:
    """The built-in readers' result, or ``None`` when the weights do not split into the module's heads.

    Such a module is not that layout after all; its submodules are measured as plain weights.
    """
    try:
        return AttentionWeights(*args, **kwargs)
    except ValueError:
        return None


_BUILT_IN_READERS: tuple[AttentionWeightsReader, ...] = (
    _read_multihead_attention,
    _read_gpt2_attention,
    _read_packed_linear_attention,
    _read_separate_projection_attention,
)


# --------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------


def _first_int(owners: Sequence[object], names: Sequence[str]) -> int | None:
    """The first positive int attribute ``names`` holds on the first owner that has one."""
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if _is_positive_int(value):
                return value
    return None


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
    (the rounding is relative to σ₁²), and the demo model's 48 head slices of 16 × 64 took 0.5 ms this way
    against 1.7 ms by ``svdvals``.
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


def _check_heads(query: Tensor, key: Tensor, value: Tensor | None, heads: int, key_heads: int) -> None:
    """Raises ValueError unless the rows split into ``heads`` query and ``key_heads`` key/value heads."""
    if not (_is_positive_int(heads) and _is_positive_int(key_heads)):
        raise ValueError(
            f"num_heads and num_key_value_heads must be positive ints, got {heads!r}, {key_heads!r}"
        )
    if heads % key_heads:
        raise ValueError(f"num_key_value_heads={key_heads} must divide num_heads={heads}")
    for name, weight, count in (
        ("query", query, heads),
        ("key", key, key_heads),
        ("value", value, key_heads),
    ):
        if weight is not None and weight.shape[0] % count:
            raise ValueError(f"{name} has {weight.shape[0]} rows, not a multiple of its {count} heads")
    if query.shape[0] // heads != key.shape[0] // key_heads:
        raise ValueError(
            f"query and key heads must have one width d_k, got {query.shape[0] // heads} "
            f"and {key.shape[0] // key_heads}"
        )


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _describe(value: object) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
