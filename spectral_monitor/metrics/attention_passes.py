"""The members of the attention metrics that need no spectrum, as passes over blocks of rows of A.

Entropy, ‖A‖_F, the rank-one residual, self-attention, the sink masses and the Dobrushin coefficient are sums
or maxima over rows, so they come from passes over A a block of rows at a time: over the dense probabilities
(:func:`~spectral_monitor.metrics.attention_metrics`) and over blocks recomputed from q and k
(:func:`~spectral_monitor.metrics.attention_metrics_from_qk`) alike, with one definition for both. Every
function here takes a flat batch: B matrices of n valid-or-padded queries × m keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

CENTRED_BY_DIFFERENCE_MIN = 0.04
"""The rank-one residual comes from ‖A‖_F² − n‖ā‖² where that is at least this fraction of ‖A‖_F² (the
residual at least 0.2): the float32 rounding of the two sums, ~1e-7 of ‖A‖_F² each, then moves the residual
by a few parts in a million of itself, and more the smaller it is. Below, a second pass forms the centred
rows (softmax attention of Gaussian queries and keys has a residual near 0.8; collapsing attention goes
below)."""
DOBRUSHIN_ANCHORS = 8
"""Rows the Dobrushin estimate measures every row's distance from: those farthest from the mean row. More
anchors bring the estimate closer to the true value at one pass over A each; docs/numerics.md gives the
accuracy of this choice on softmax attention."""


class Scratch:
    """One buffer for the temporaries of successive blocks, grown to the largest block.

    Temporaries made afresh for each block would be fresh allocations, whose page faults cost more than the
    arithmetic on them; reused, the buffer and its block stay in cache. Each :meth:`like` overwrites what
    the previous one handed out.

    Examples:
        >>> import torch
        >>> scratch = Scratch()
        >>> first = scratch.like(torch.zeros(2, 3))
        >>> second = scratch.like(torch.zeros(3))  # smaller: the same memory
        >>> second.data_ptr() == first.data_ptr(), tuple(second.shape)
        (True, (3,))
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def like(self, block: Tensor) -> Tensor:
        """A contiguous tensor of ``block``'s shape, dtype and device, overwriting earlier ones.

        Args:
            block: The tensor whose shape, dtype and device the temporary takes (its values are not read).

        Returns:
            A view of the buffer, uninitialised; the buffer is reallocated where it is smaller than ``block``
            or of another dtype or device.
        """
        size = block.numel()
        buffer = self._buffer
        if (
            buffer is None
            or buffer.numel() < size
            or (buffer.dtype, buffer.device) != (block.dtype, block.device)
        ):
            buffer = self._buffer = torch.empty(size, dtype=block.dtype, device=block.device)
        return buffer[:size].view(block.shape)


def one_pass_members(
    blocks: Callable[[], Iterator[tuple[slice, int, int, Tensor]]],
    keys: Tensor,
    queries: Tensor,
    causal: bool,
    work: torch.dtype,
    scratch: Scratch,
    keys_per_row: Tensor | None = None,
) -> dict[str, Tensor]:
    """Entropy, ‖A‖_F, rank-one residual, self-attention and sink masses of a batch of attention matrices
    (B, n, m) seen in blocks of rows.

    Sums across blocks accumulate in float64, so the many partial sums of a long matrix add no more rounding
    than one pass over the whole matrix would. The centred norm ‖A − 1āᵀ‖_F comes from ‖A‖_F² − n‖ā‖², or,
    where that difference is below ``CENTRED_BY_DIFFERENCE_MIN`` of ‖A‖_F², from a second pass that forms
    the centred rows.

    Args:
        blocks: Called with no argument, yields ``(elements, start, stop, A[elements, start:stop])`` covering
            every row of every element once, in dtype ``work``, with padded queries' rows and masked keys'
            columns zero. Called a second time only where the centred rows are needed.
        keys: (B, m) bool, True = valid key.
        queries: (B, n) bool, True = valid query.
        causal: Row i attends keys j ≤ i, for the entropy's normalisation.
        work: The dtype of the blocks and of the members returned.
        scratch: The buffer every temporary is taken from.
        keys_per_row: (B, n) the keys each row may attend, for the entropy's normalisation
            (:func:`normalised_entropy`); None = from ``keys`` and ``causal``.

    Returns:
        (B,) tensors of dtype ``work`` by name: ``entropy``, ``rank_one_residual``, ``self_attention`` (NaN
        where n ≠ m), ``sink_mass``, ``sink_mass_first``, ``frobenius`` (‖A‖_F); and ``mean_row`` (B, m),
        the mean of the valid rows, which the Dobrushin estimate starts from.

    Examples:
        Uniform attention: entropy 1, every row the mean row, ‖A‖_F = 1 for n = m = 4.

        >>> import torch
        >>> attention = torch.full((1, 4, 4), 0.25)
        >>> every = torch.ones(1, 4, dtype=torch.bool)
        >>> members = one_pass_members(
        ...     lambda: iter([(slice(None), 0, 4, attention)]), every, every, False, torch.float32, Scratch()
        ... )
        >>> [round(float(members[name]), 4) for name in ("entropy", "rank_one_residual", "frobenius")]
        [1.0, 0.0, 1.0]
        >>> round(float(members["self_attention"]), 4), round(float(members["sink_mass"]), 4)
        (0.25, 0.25)
    """
    (batch, n), m = queries.shape, keys.shape[1]
    device = queries.device
    row_entropy = torch.empty((batch, n), dtype=work, device=device)
    squared_norm = torch.zeros(batch, dtype=torch.float64, device=device)
    column_sums = torch.zeros((batch, m), dtype=torch.float64, device=device)
    trace = torch.zeros(batch, dtype=torch.float64, device=device)
    for elements, start, stop, block in blocks():
        # −Σ a log a with 0 log 0 = 0: log(a + tiny) is finite at a = 0 and equals log a wherever a is not
        # denormal; faster than ``xlogy`` on CPU.
        logs = torch.add(block, torch.finfo(block.dtype).tiny, out=scratch.like(block)).log_()
        row_entropy[elements, start:stop] = -logs.mul_(block).sum(dim=2)
        squared_norm[elements] += _squared_norms(block).double()
        # Not as a product with ones: the rounding of that product depends on the CPU's kernels, and
        # ‖A‖_F² − n‖ā‖² passes it on to the residual; ``sum`` rounds less.
        column_sums[elements] += block.sum(dim=1).double()
        if n == m:
            trace[elements] += block.diagonal(offset=start, dim1=1, dim2=2).sum(dim=1).double()

    valid_rows = queries.sum(dim=1)
    mean_row = column_sums / valid_rows.clamp_min(1)[:, None]
    # ‖A − 1āᵀ‖_F² = ‖A‖_F² − n‖ā‖² over the n valid rows (padded rows are zero), which needs no second
    # pass; where the difference is small against ‖A‖_F² it is mostly rounding, and a second pass over the
    # elements concerned forms the centred rows themselves.
    centred_squared_norm = squared_norm - valid_rows * mean_row.square().sum(dim=1)
    cancelled = centred_squared_norm < CENTRED_BY_DIFFERENCE_MIN * squared_norm
    if bool(cancelled.any()):
        exact = torch.zeros_like(squared_norm)
        mean_row = mean_row.to(work)
        every_query = bool(queries.all())
        for elements, start, stop, block in blocks():
            if not bool(cancelled[elements].any()):
                continue
            centred = scratch.like(block)
            if every_query:
                torch.sub(block, mean_row[elements, None, :], out=centred)
            else:  # padded queries' rows are zero and stay so
                torch.addcmul(
                    block,
                    queries[elements, start:stop, None].to(work),
                    mean_row[elements, None, :],
                    value=-1,
                    out=centred,
                )
            exact[elements] += _squared_norms(centred).double()
        centred_squared_norm = torch.where(cancelled, exact, centred_squared_norm)

    frobenius = squared_norm.sqrt().to(work)
    return (
        {"mean_row": mean_row.to(work)}
        | sink_masses(column_sums, keys, valid_rows, work)
        | {
            "entropy": normalised_entropy(row_entropy, keys, queries, causal, keys_per_row),
            "rank_one_residual": rank_one_residual(centred_squared_norm.sqrt().to(work), frobenius),
            "self_attention": (trace / valid_rows.clamp_min(1)).to(work)
            if n == m
            else torch.full((batch,), float("nan"), dtype=work, device=device),
            "frobenius": frobenius,
        }
    )


def sink_masses(
    column_sums: Tensor, keys: Tensor, valid_rows: Tensor, work: torch.dtype
) -> dict[str, Tensor]:
    """``sink_mass`` and ``sink_mass_first`` from the column sums of A over the valid queries.

    Args:
        column_sums: (B, m) Σᵢ Aᵢⱼ over the valid queries i.
        keys: (B, m) bool, True = valid key.
        valid_rows: (B,) the number of valid queries.
        work: The dtype of the results.

    Returns:
        (B,) tensors by name: ``sink_mass``, the largest column mean among the valid keys;
        ``sink_mass_first``, the column mean of the first valid key. Elements with no valid key or query
        are left to :func:`~spectral_monitor.metrics.attention.finished_metrics` to make NaN.

    Examples:
        Three queries putting mass 2 on the first key in all, 1 on the second:

        >>> import torch
        >>> sums = torch.tensor([[2.0, 1.0, 0.0]])
        >>> masses = sink_masses(sums, torch.tensor([[True, True, True]]), torch.tensor([3]), torch.float32)
        >>> round(float(masses["sink_mass"]), 4), round(float(masses["sink_mass_first"]), 4)
        (0.6667, 0.6667)
        >>> masses = sink_masses(sums, torch.tensor([[False, True, True]]), torch.tensor([3]), torch.float32)
        >>> round(float(masses["sink_mass"]), 4), round(float(masses["sink_mass_first"]), 4)
        (0.3333, 0.3333)
    """
    column_means = column_sums / valid_rows.clamp_min(1)[:, None]
    largest = torch.where(keys, column_means, torch.full_like(column_means, -math.inf)).amax(dim=1)
    first_key = keys.to(torch.int8).argmax(dim=1)  # 0 where no key is valid; then nothing is measured
    first = column_means.gather(1, first_key[:, None])[:, 0]
    return {"sink_mass": largest.to(work), "sink_mass_first": first.to(work)}


def _squared_norms(block: Tensor) -> Tensor:
    """‖Xₑ‖_F² of each matrix of ``block`` (E, r, m), as a dot product per row summed over the rows.

    Not as one dot product of the flattened matrix, nor as ``vector_norm``: long single accumulations can
    lose float32 accuracy where short row dots do not, at no extra cost (benchmarks/README.md).
    """
    return torch.linalg.vecdot(block, block).sum(dim=1)


def normalised_entropy(
    row_entropy: Tensor, keys: Tensor, queries: Tensor, causal: bool, keys_per_row: Tensor | None = None
) -> Tensor:
    """Mean over counted queries of Hᵢ / log(keys of row i), Hᵢ = −Σⱼ Aᵢⱼ log Aᵢⱼ.

    A row counts when its query is valid and it has at least two keys.

    Args:
        row_entropy: (B, n) each row's entropy Hᵢ in nats.
        keys: (B, m) bool, True = valid key.
        queries: (B, n) bool, True = valid query.
        causal: Row i has the valid keys j ≤ i (rows past m have them all).
        keys_per_row: (B, n) the keys of each row where given; it overrides ``keys`` and ``causal``.

    Returns:
        (B,) in the dtype of ``row_entropy``; NaN where no row counts.

    Examples:
        Row entropies 0 and ½ log 2 over two keys: both rows count, or only the second one when causal.

        >>> import math, torch
        >>> entropy = torch.tensor([[0.0, 0.5 * math.log(2)]])
        >>> every = torch.ones(1, 2, dtype=torch.bool)
        >>> float(normalised_entropy(entropy, every, every, False))
        0.25
        >>> float(normalised_entropy(entropy, every, every, True))
        0.5
    """
    work = row_entropy.dtype
    n = row_entropy.shape[1]
    valid_keys = keys.to(work)
    if keys_per_row is not None:
        keys_per_row = keys_per_row.to(work)
    elif causal:
        # Row i sees keys 0..i: the running count, clamped at the last key (rows past m see all of them).
        running = valid_keys.cumsum(dim=1)
        rows = torch.arange(n, device=keys.device).clamp_max(keys.shape[1] - 1)
        keys_per_row = running[:, rows]
    else:
        keys_per_row = valid_keys.sum(dim=1, keepdim=True).expand(-1, n)
    counted = queries & (keys_per_row >= 2)
    normalised = row_entropy / torch.where(counted, keys_per_row, torch.full_like(keys_per_row, math.e)).log()
    rows_counted = counted.sum(dim=1)
    return torch.where(
        rows_counted > 0,
        (normalised * counted).sum(dim=1) / rows_counted.clamp_min(1),
        torch.full_like(row_entropy[:, 0], float("nan")),
    )


def rank_one_residual(centred_norm: Tensor, frobenius: Tensor) -> Tensor:
    """‖A − 1āᵀ‖_F / ‖A‖_F from its two norms.

    Args:
        centred_norm: (B,) ‖A − 1āᵀ‖_F, ā the mean of the valid rows.
        frobenius: (B,) ‖A‖_F.

    Returns:
        (B,) the ratio; NaN for the zero matrix.

    Examples:
        >>> import torch
        >>> rank_one_residual(torch.tensor([0.5, 0.0]), torch.tensor([1.0, 0.0]))
        tensor([0.5000,    nan])
    """
    tiny = torch.finfo(frobenius.dtype).tiny
    return torch.where(
        frobenius > 0, centred_norm / frobenius.clamp_min(tiny), torch.full_like(frobenius, float("nan"))
    )


def exact_dobrushin(matrices: Tensor, queries: Tensor) -> Tensor:
    """½ max over all valid row pairs of ‖Aᵢ − Aⱼ‖₁, from every pairwise distance: one batched ``cdist``.

    Args:
        matrices: (B, n, m) attention matrices.
        queries: (B, n) bool, True = valid row.

    Returns:
        (B,) Dobrushin's coefficient; 0 without valid rows.

    Examples:
        One-hot rows on distinct keys are as far apart as rows can be; identical rows not at all:

        >>> import torch
        >>> matrices = torch.stack([torch.eye(3), torch.full((3, 3), 1 / 3)])
        >>> exact_dobrushin(matrices, torch.ones(2, 3, dtype=torch.bool))
        tensor([1., 0.])
    """
    distances = torch.cdist(matrices, matrices, p=1)
    valid_pairs = queries[:, :, None] & queries[:, None, :]
    return torch.where(valid_pairs, distances, torch.zeros_like(distances)).amax(dim=(1, 2)) / 2


def anchored_dobrushin(
    distances_to: Callable[[Tensor], Tensor],
    rows_at: Callable[[Tensor], Tensor],
    queries: Tensor,
    mean_row: Tensor,
) -> Tensor:
    """The anchored estimate L of τ = ½ maxᵢⱼ ‖Aᵢ − Aⱼ‖₁, with τ/2 ≤ L ≤ τ, in two passes over A.

    L is half the largest distance from an anchor to a valid row, the anchors being the
    ``DOBRUSHIN_ANCHORS`` valid rows farthest from the mean row ā: rows far from the centre of the point
    set are where its diameter ends. L ≤ τ because it is a distance between two rows; L ≥ τ/2 because for
    any row r and the pair (i, j) that gives τ, 2τ = ‖Aᵢ − Aⱼ‖₁ ≤ ‖Aᵢ − r‖₁ + ‖r − Aⱼ‖₁ ≤ 2 maxₖ ‖Aₖ − r‖₁.

    Args:
        distances_to: Maps rows (B, K, m) to every row's L1 distance from each of them (B, n, K).
        rows_at: Maps row indices (B, K) to those rows (B, K, m).
        queries: (B, n) bool, True = valid row.
        mean_row: (B, m) the mean of the valid rows.

    Returns:
        (B,) the estimate L; 0 without valid rows.

    Examples:
        On dense matrices the two maps are a ``cdist`` and a ``gather``:

        >>> import torch
        >>> matrices = torch.eye(3)[None]
        >>> queries = torch.ones(1, 3, dtype=torch.bool)
        >>> estimate = anchored_dobrushin(
        ...     lambda rows: torch.cdist(matrices, rows, p=1),
        ...     lambda index: matrices.gather(1, index[:, :, None].expand(-1, -1, 3)),
        ...     queries,
        ...     matrices.mean(dim=1),
        ... )
        >>> estimate, exact_dobrushin(matrices, queries)
        (tensor([1.]), tensor([1.]))
    """
    from_mean = distances_to(mean_row[:, None, :])[:, :, 0]
    from_mean = torch.where(queries, from_mean, torch.full_like(from_mean, -math.inf))
    anchors = from_mean.topk(min(DOBRUSHIN_ANCHORS, queries.shape[1]), dim=1).indices
    pairs = queries[:, :, None] & queries.gather(1, anchors)[:, None, :]
    distances = distances_to(rows_at(anchors))
    return torch.where(pairs, distances, torch.zeros_like(distances)).amax(dim=(1, 2)) / 2
