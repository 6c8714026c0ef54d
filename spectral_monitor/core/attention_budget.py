"""The attention cost budget: how many of a layer's heads a logging step measures.

Measuring a layer's attention costs far more per head than the training step spends on it, and the more so
the longer the context: the exact path factorises each (n, m) matrix in O(n·m·min(n, m)), where the training
step's attention is O(n·m·d) per head. ``attention_cost_ratio`` bounds the measurement of each layer by a
multiple of the layer's training work, by the cost model below; over it, a logging step measures a subset of
the heads, a different one each step, so that every head is measured within ⌈H/k⌉ logging steps.

The cost model counts in units of one head's training attention on one sequence (forward and backward of
softmax(q kᵀ/√d) v), whose cost grows as n·m·d: the measurement costs of one matrix, and the layer's training
work (its attention and the linear layers of a standard block), were measured in those units
(``benchmarks/README.md``, "The attention cost budget").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spectral_monitor.metrics.attention import has_eigen_gap, uses_exact_path
from spectral_monitor.metrics.attention_rank_sums import FACTORISE_FIRST_MAX_SIZE
from spectral_monitor.probes import CapturedAttention

__all__ = [
    "LEAST_MEASURED_RATIO",
    "LayerBudget",
    "layer_budget",
    "matrix_cost",
    "spectra_fit",
    "training_cost",
]

FACTORISATION_COST = 2.0
"""Cost of measuring one matrix on a path that factorises it, per min(n, m)/d: the exact path, and the dense
Krylov path's rank sums, which factorise the matrix outright up to ``FACTORISE_FIRST_MAX_SIZE`` and, above,
where their quadrature does not converge (near-uniform attention, the common case early in training)."""
KRYLOV_COST = 3.0
"""Cost of measuring one matrix on the dense Krylov path without the rank sums."""
KRYLOV_EIGEN_GAP_COST = 5.0
"""Cost of measuring one square bidirectional matrix on the dense Krylov path without the rank sums: the
Arnoldi iteration for the eigen gap comes on top."""
DEFLATED_QUADRATURE_COST = 8.0
"""Cost of the Krylov path's rank sums above ``FACTORISE_FIRST_MAX_SIZE`` beyond a factorisation: the Ritz
subspace they deflate and the quadrature's round, which on their own cost 6–12 units, or, on attention too
uniform for float32 products to resolve, a factorisation after the subspace."""
BLOCKWISE_COST = 6.0
"""Cost of measuring one matrix blockwise from q and k without the rank sums: each product recomputes its
softmax rows."""
BLOCKWISE_RANK_SUMS_COST = 400.0
"""Cost of measuring one matrix blockwise with the rank sums: 47 units measured on near-uniform causal
attention at 4096 tokens, whose quadrature resolves the tail left by the deflated Ritz pairs in one round;
attention too uniform for float32 products to resolve that tail runs every round, each a sweep of products
over the blocks."""
MIN_BUDGETED_TOKENS = 256
"""Layers with fewer queries or keys are measured whole: there per-call overheads, which the cost model does
not count, dominate the measurement and the training step alike."""
LEAST_MEASURED_RATIO = 1.0
"""The least a budgeted layer's logging step measures is one matrix, whatever the budget: with the rank sums
where that matrix alone costs at most this multiple of the layer's training work, so that a tight budget
samples heads before it gives up the effective and threshold ranks (on the exact path the rank sums come
with the factorisation, always)."""
LINEAR_WORK_PER_ATTENTION = 6.0
"""A standard block's linear layers (q, k, v and output projections, an MLP 4 times as wide: 12·w²
multiply-adds a token) cost this many times w/m the training attention of its heads (2·m·w a token)."""


@dataclass(frozen=True)
class LayerBudget:
    """What a logging step measures of one layer's captured attention.

    Attributes:
        heads: the heads measured, in order (all of them where the budget allows).
        sequences: how many of the captured sequences (the first ones).
        rank_sums: whether the effective and threshold ranks are measured.
        num_heads: the heads the layer has.

    Examples:
        >>> budget = LayerBudget(heads=(2, 3), sequences=2, rank_sums=True, num_heads=4)
        >>> budget.sampled, LayerBudget((0, 1, 2, 3), 2, True, 4).sampled
        (True, False)
    """

    heads: tuple[int, ...]
    sequences: int
    rank_sums: bool
    num_heads: int

    @property
    def sampled(self) -> bool:
        """Whether fewer than all heads are measured."""
        return len(self.heads) < self.num_heads


def matrix_cost(
    n: int, m: int, d: int, *, exact: bool, blockwise: bool, rank_sums: bool, eigen_gap: bool
) -> float:
    """Cost of measuring one (n, m) attention matrix of head dimension ``d`` on the path given, in units of
    one head's training attention on one sequence.

    Blockwise: :data:`BLOCKWISE_RANK_SUMS_COST` with the rank sums, else :data:`BLOCKWISE_COST`. Exact:
    :data:`FACTORISATION_COST` · min(n, m)/d. Dense Krylov: :data:`KRYLOV_EIGEN_GAP_COST` where the eigen
    gap is measured, :data:`KRYLOV_COST` where not, and with the rank sums the factorisation's cost more up
    to ``FACTORISE_FIRST_MAX_SIZE``, where they are factorised outright, and that and
    :data:`DEFLATED_QUADRATURE_COST` above.

    Args:
        n: the queries.
        m: the keys.
        d: the head width.
        exact: whether the exact path factorises the matrix.
        blockwise: whether it is measured blockwise from q and k.
        rank_sums: whether the effective and threshold ranks are measured.
        eigen_gap: whether the eigen gap is measured (square bidirectional attention).

    Returns:
        The cost, a positive float.

    Examples:
        >>> matrix_cost(512, 512, 64, exact=True, blockwise=False, rank_sums=True, eigen_gap=True)
        16.0
        >>> matrix_cost(768, 768, 64, exact=False, blockwise=False, rank_sums=True, eigen_gap=True)
        37.0
        >>> matrix_cost(8192, 8192, 64, exact=False, blockwise=False, rank_sums=False, eigen_gap=False)
        3.0
    """
    if blockwise:
        return BLOCKWISE_RANK_SUMS_COST if rank_sums else BLOCKWISE_COST
    factorising = FACTORISATION_COST * min(n, m) / d
    if exact:
        return factorising
    krylov = KRYLOV_EIGEN_GAP_COST if eigen_gap else KRYLOV_COST
    if not rank_sums:
        return krylov
    if min(n, m) <= FACTORISE_FIRST_MAX_SIZE:
        return krylov + factorising
    return krylov + factorising + DEFLATED_QUADRATURE_COST


def training_cost(sequences: int, heads: int, m: int, d: int) -> float:
    """The training work of a layer of ``heads`` heads of dimension ``d`` attending ``m`` keys, on
    ``sequences`` sequences, in the units of :func:`matrix_cost`: its attention and a standard block's linear
    layers, S · H · (1 + :data:`LINEAR_WORK_PER_ATTENTION` · H · d/m).

    Args:
        sequences: the sequences S.
        heads: the heads H.
        m: the keys.
        d: the head width (the model width is H · d).

    Returns:
        The work, a positive float.

    Examples:
        >>> training_cost(2, 8, 512, 64)
        112.0
    """
    return sequences * heads * (1 + LINEAR_WORK_PER_ATTENTION * heads * d / m)


def layer_budget(
    captured: CapturedAttention, ratio: float, logs_done: int, *, method: str, rank_sums: bool
) -> LayerBudget:
    """What to measure of ``captured`` at the logging step after ``logs_done`` others, within ``ratio`` times
    its training work (:func:`training_cost` of the captured sequences).

    Every sequence of as many heads as fit, at least one head; where not one head of every sequence fits, one
    head of as many sequences as fit, at least one; where not even one matrix fits with the rank sums off the
    exact path, without them, unless that one matrix with them costs at most :data:`LEAST_MEASURED_RATIO`
    times the training work. The heads measured rotate: step t measures heads t·k, t·k + 1, ...
    (mod H), so every head is measured within ⌈H/k⌉ logging steps. Layers with fewer than
    :data:`MIN_BUDGETED_TOKENS` queries or keys, and an infinite ``ratio``, measure everything.

    Args:
        captured: the layer's captured attention, (S, H, n, d) queries and (S, H, m, d) keys.
        ratio: the ``attention_cost_ratio``; ``math.inf`` for no budget.
        logs_done: the logging steps before this one, which pick the rotation's heads.
        method: the attention metrics' ``method`` (``"auto"``, ``"exact"``, ``"krylov"``).
        rank_sums: whether the rank sums are asked for.

    Returns:
        The heads, sequences and rank sums to measure.

    Examples:
        >>> import torch
        >>> q = torch.zeros(2, 8, 512, 64)  # 2 sequences, 8 heads, 512 tokens
        >>> captured = CapturedAttention("blocks.0.attn", q, q, None, causal=True, scale=0.125,
        ...                              key_mask=None, query_mask=None)
        >>> layer_budget(captured, 1.0, 1, method="exact", rank_sums=True)  # 112 // 16 = 7 matrices
        LayerBudget(heads=(3, 4, 5), sequences=2, rank_sums=True, num_heads=8)
    """
    sequences, heads = captured.num_sequences, captured.num_heads
    n, m, d = captured.q.shape[2], captured.k.shape[2], captured.q.shape[3]
    everything = LayerBudget(tuple(range(heads)), sequences, rank_sums, heads)
    if math.isinf(ratio) or min(n, m) < MIN_BUDGETED_TOKENS:
        return everything
    training = training_cost(sequences, heads, m, d)
    exact = uses_exact_path(n, m, method, captured.causal)
    blockwise = captured.measured_blockwise()
    eigen_gap = has_eigen_gap(n, m, captured.causal)

    def cost(with_rank_sums: bool) -> float:
        return matrix_cost(
            n, m, d, exact=exact, blockwise=blockwise, rank_sums=with_rank_sums, eigen_gap=eigen_gap
        )

    matrices = math.floor(ratio * training / cost(rank_sums))
    if matrices == 0 and rank_sums and not exact and cost(True) > LEAST_MEASURED_RATIO * training:
        rank_sums, matrices = False, math.floor(ratio * training / cost(False))
    if matrices >= sequences * heads:
        return LayerBudget(everything.heads, sequences, rank_sums, heads)
    measured_heads = max(1, min(heads, matrices // sequences))
    measured_sequences = sequences if matrices >= sequences else max(1, matrices)
    first = logs_done * measured_heads
    rotation = tuple((first + offset) % heads for offset in range(measured_heads))
    return LayerBudget(rotation, measured_sequences, rank_sums, heads)


def spectra_fit(captured: CapturedAttention, budget: LayerBudget, ratio: float) -> bool:
    """Whether factorising the matrices ``budget`` measures of ``captured`` fits ``ratio`` times its training
    work: head diversity needs every singular value, which a path that does not factorise as it measures
    must compute again.

    Args:
        captured: the layer's captured attention, all of it (its training work is that of every sequence).
        budget: what the logging step measures of it (:func:`layer_budget`).
        ratio: the ``attention_cost_ratio``; ``math.inf`` for no budget.

    Returns:
        True where their :data:`FACTORISATION_COST` · min(n, m)/d each is within the budget, and for the
        layers :func:`layer_budget` measures whole (an infinite ``ratio``, fewer than
        :data:`MIN_BUDGETED_TOKENS` tokens).

    Examples:
        >>> import torch
        >>> q = torch.zeros(2, 6, 2048, 64)  # GPT-2-like heads at 2048 tokens: 25.5 units of training work
        >>> captured = CapturedAttention("h.0.attn", q, q, None, causal=True, scale=0.125,
        ...                              key_mask=None, query_mask=None)
        >>> one = LayerBudget(heads=(0,), sequences=1, rank_sums=False, num_heads=6)
        >>> spectra_fit(captured, one, 1.0), spectra_fit(captured, one, 3.0)  # one factorisation: 64 units
        (False, True)
    """
    n, m, d = captured.q.shape[2], captured.k.shape[2], captured.q.shape[3]
    if math.isinf(ratio) or min(n, m) < MIN_BUDGETED_TOKENS:
        return True
    factorising = len(budget.heads) * budget.sequences * FACTORISATION_COST * min(n, m) / d
    return factorising <= ratio * training_cost(captured.num_sequences, captured.num_heads, m, d)
