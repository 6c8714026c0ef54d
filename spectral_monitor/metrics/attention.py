"""Attention-matrix metrics: entropy, singular and eigen gaps, rank-one residual, ranks, Dobrushin.

One definition of each, batched over any leading dims. Two paths compute the spectral
members: "exact" (``svdvals``/``eigvals``, the reference and the small-n path) and "krylov" (block Lanczos for
σ₁, σ₂; stochastic Lanczos quadrature for effective and threshold rank; block Arnoldi for |λ₂|:
:mod:`spectral_monitor.metrics.attention_krylov`), which touches each matrix a few dozen times instead of
factorising it. The members that need no spectrum come from one pass over the matrices, shared by both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from spectral_monitor.linalg import DenseOperator
from spectral_monitor.metrics._common import (
    all_singular_values,
    check_matrices,
    check_method,
    effective_rank_from_singular_values,
    flat_mask,
    stable_rank,
    threshold_rank_from_singular_values,
    working_dtype_of,
)
from spectral_monitor.metrics.attention_krylov import KrylovState, krylov_spectral_metrics
from spectral_monitor.metrics.masks import is_causal_pattern

EXACT_MAX_SIZE = 384
"""``method="auto"`` factorises exactly when the smaller side of A is at most this, or at most
``EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP`` where the eigen gap is not measured."""
EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP = 1024
"""Causal or rectangular attention (no eigen gap, so no non-symmetric ``eigvals``) is factorised exactly up to
this size: on the near-uniform causal attention of a freshly initialised model the rank-sum quadrature runs
every round it has and still reads the effective rank low, so there the exact path is both the faster and
the correct one (benchmarks/README.md). Above it the cost of factorising grows as n³ per head."""
DOBRUSHIN_EXACT_MAX_ROWS = 32
"""Above this many rows (and off the "exact" path) the Dobrushin coefficient is the anchored estimate
(:func:`anchored_dobrushin`): a lower bound that is at least half the true value. The exact value compares
every pair of rows, O(n³) per matrix; the estimate is O(n²), and the faster of the two from this size up
(benchmarks/README.md)."""
DOBRUSHIN_ANCHORS = 8
"""Rows the Dobrushin estimate measures every row's distance from: those farthest from the mean row. More
anchors bring the estimate closer to the true value at one pass over A each; docs/numerics.md gives the
accuracy of this choice on softmax attention."""
ONE_PASS_CHUNK_BYTES = 2**20
"""Bytes of A in one block of the passes for the entropy, norms and Dobrushin distances: a block and its
temporary stay in a core's L2 cache (benchmarks/README.md)."""
CENTRED_BY_DIFFERENCE_MIN = 0.04
"""The rank-one residual comes from ‖A‖_F² − n‖ā‖² where that is at least this fraction of ‖A‖_F² (the
residual at least 0.2): the float32 rounding of the two sums, ~1e-7 of ‖A‖_F² each, then moves the residual
by a few parts in a million of itself, and more the smaller it is. Below, a second pass forms the centred
rows (softmax attention of Gaussian queries and keys has a residual near 0.8; collapsing attention goes
below)."""

METRIC_NAMES = (
    "entropy",
    "sigma1",
    "sigma2",
    "spectral_gap",
    "eigen_gap",
    "rank_one_residual",
    "stable_rank",
    "effective_rank",
    "effective_rank_ratio",
    "threshold_rank",
    "dobrushin",
    "self_attention",
    "sink_mass",
    "sink_mass_first",
)


def attention_metrics(
    attn: Tensor,
    *,
    key_mask: Tensor | None = None,
    query_mask: Tensor | None = None,
    causal: bool = False,
    attendable: Tensor | None = None,
    method: str = "auto",
    include_rank_sums: bool = True,
    state: KrylovState | None = None,
    generator: torch.Generator | None = None,
    return_spectra: bool = False,
) -> dict[str, Tensor]:
    """Spectral and entropy metrics of attention matrices ``attn`` (..., n, m), rows summing to 1.

    ``key_mask`` (..., m) and ``query_mask`` (..., n) are bool, True = attendable key / real query (the
    opposite of PyTorch's ``key_padding_mask``); metrics are those of the submatrix of valid queries × valid
    keys. ``causal``: row i attends keys j ≤ i (normalised entropy uses i + 1 keys; ``eigen_gap`` is NaN
    because a triangular A's eigenvalues are its diagonal). ``attendable``: bool broadcastable to
    (..., n, m), True where query i may attend key j
    (:func:`spectral_monitor.metrics.masks.attendable_pattern` reads it from an attention mask): row i's
    keys are its attendable valid keys, and a pattern that is lower-triangular over the valid queries is
    causal whatever ``causal`` says. Every value has shape
    ``attn.shape[:-2]``:

    - ``entropy``: mean over queries of −Σⱼ Aᵢⱼ log Aᵢⱼ / log(keys of row i); rows with < 2 keys left out;
    - ``sigma1``, ``sigma2``, ``spectral_gap`` = 1 − σ₂/σ₁, ``stable_rank`` = ‖A‖_F²/σ₁²;
    - ``eigen_gap`` = 1 − |λ₂| (NaN when causal or non-square);
    - ``rank_one_residual`` = ‖A − 1āᵀ‖_F/‖A‖_F with ā the mean row;
    - ``effective_rank`` (Roy & Vetterli), ``effective_rank_ratio`` = it / min(valid rows, valid keys),
      ``threshold_rank`` (smallest k keeping 99% of ‖A‖_F²; on the Krylov path only where the top two
      singular values already reach it, else NaN);
    - ``dobrushin`` = ½ maxᵢⱼ ‖Aᵢ − Aⱼ‖₁ (estimated above ``DOBRUSHIN_EXACT_MAX_ROWS`` rows unless exact);
    - ``self_attention`` = tr(A)/n (NaN when non-square);
    - ``sink_mass``: the largest column mean of A over the valid queries, the mass the average query puts on
      the most-attended key (1/m for uniform attention over m keys, 1 when every query attends one key);
      ``sink_mass_first``: the column mean of the first valid key (the first real token of a padded sequence);
    - ``nonfinite``: True where the input had a NaN/Inf; that element's metrics are NaN, the others exact;
    - ``effective_rank_se``: standard error of the Krylov estimate (sampling and quadrature), 0 when exact.

    Where no valid query has attention on a valid key (a fully padded sequence) there is nothing to measure:
    every metric is NaN and ``nonfinite`` False ("not measurable", not broken).

    ``method``: "exact", "krylov", or "auto" (:func:`uses_exact_path`). ``include_rank_sums=False``
    skips the effective and threshold ranks (NaN), the only members that need the whole spectrum.
    ``state`` warm-starts the Krylov path; ``generator`` draws its probes (a private fixed-seed one by
    default, so the global RNG is never touched). ``return_spectra``: on the exact path, also
    ``singular_values`` (..., min(n, m)), the descending singular values the spectral members were computed
    from (NaN where ``nonfinite``), so that no caller factorises the same matrices again; absent on the Krylov
    path.
    """
    attn = check_matrices(attn, "attn")
    if attn.numel() == 0:
        raise ValueError(f"attn must hold at least one (n, m) matrix, got shape {tuple(attn.shape)}")
    method = check_method(method)
    batch_shape, (n, m) = attn.shape[:-2], attn.shape[-2:]
    work = working_dtype_of(attn)
    keys = flat_mask(key_mask, "key_mask", batch_shape, m, attn.device)
    queries = flat_mask(query_mask, "query_mask", batch_shape, n, attn.device)
    keys_per_row = None
    if attendable is not None:
        pattern = flat_pattern(attendable, batch_shape, n, m, attn.device)
        causal = causal or is_causal_pattern(pattern, queries)
        keys_per_row = (pattern & keys[:, None, :]).sum(dim=2)
    matrices = attn.reshape(-1, n, m).to(work)
    # Each rewrite below copies the whole batch, so it is made only when needed.
    if not (bool(queries.all()) and bool(keys.all())):
        matrices = matrices * queries[:, :, None] * keys[:, None, :]
    valid_rows = queries.sum(dim=1).to(work)
    valid_keys = keys.sum(dim=1).to(work)

    scratch = Scratch()
    blocks = _cache_sized_blocks(matrices)
    metrics = one_pass_members(
        lambda: ((elements, start, stop, matrices[elements, start:stop]) for elements, start, stop in blocks),
        keys,
        queries,
        causal,
        work,
        scratch,
        keys_per_row=keys_per_row,
    )
    mean_row = metrics.pop("mean_row")
    # A masked NaN or inf stays one (× 0 is NaN), so the norm of what was measured screens the input.
    nonfinite = _nonfinite_elements(matrices, metrics["frobenius"])
    # Non-finite elements are replaced by a harmless matrix so batched factorisations cannot fail; their
    # metrics become NaN at the end.
    frobenius_squared = metrics["frobenius"].square()
    if bool(nonfinite.any()):
        matrices = torch.where(nonfinite[:, None, None], torch.full_like(matrices, 1.0 / m), matrices)
        frobenius_squared = torch.where(nonfinite, n / m, frobenius_squared)  # the stand-in's
    metrics["dobrushin"] = _dobrushin(
        matrices, queries, blocks, mean_row, exact=method == "exact" or n <= DOBRUSHIN_EXACT_MAX_ROWS
    )
    singular_values = None
    if uses_exact_path(n, m, method, causal):
        exact_members = _exact_spectral_metrics(matrices, causal, include_rank_sums)
        singular_values = exact_members.pop("singular_values")
        metrics.update(exact_members)
    else:
        metrics.update(
            krylov_spectral_metrics(
                DenseOperator(matrices),
                queries,
                causal,
                include_rank_sums,
                frobenius_squared,
                state,
                generator,
                matrices=matrices,
            )
        )
    finished = finished_metrics(metrics, valid_rows, valid_keys, nonfinite, batch_shape)
    if return_spectra and singular_values is not None:
        singular_values[nonfinite] = float("nan")
        finished["singular_values"] = singular_values.reshape(*batch_shape, -1)
    return finished


def uses_exact_path(n: int, m: int, method: str, causal: bool = False) -> bool:
    """Whether :func:`attention_metrics` factorises (n, m) matrices exactly under ``method`` (``causal``:
    the attention is causal, so no eigen gap is measured). There its batch elements are independent of each
    other and of any ``state``: batches may be concatenated freely."""
    if method != "auto":
        return method == "exact"
    largest = EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP if causal or n != m else EXACT_MAX_SIZE
    return min(n, m) <= largest


def finished_metrics(
    metrics: dict[str, Tensor],
    valid_rows: Tensor,
    valid_keys: Tensor,
    nonfinite: Tensor,
    batch_shape: torch.Size,
) -> dict[str, Tensor]:
    """The one-pass and spectral members (B,) joined into the catalogue's set, shaped ``batch_shape``.

    Shared by every way of computing the members (dense probabilities, blocked products from q and k), so the
    derived metrics have one definition.
    """
    frobenius = metrics.pop("frobenius")
    # No valid query with attention on a valid key: nothing to measure (NaN), which is not a failure.
    measurable = (valid_rows > 0) & (valid_keys > 0) & (frobenius != 0)
    metrics["spectral_gap"] = 1 - metrics["sigma2"] / metrics["sigma1"]
    metrics["stable_rank"] = stable_rank(frobenius.square(), metrics["sigma1"])
    metrics["effective_rank_ratio"] = metrics["effective_rank"] / torch.minimum(
        valid_rows, valid_keys
    ).clamp_min(1)

    for value in metrics.values():
        value[nonfinite | ~measurable] = float("nan")
    metrics["nonfinite"] = nonfinite
    return {name: value.reshape(batch_shape) for name, value in metrics.items()}


def flat_pattern(
    attendable: Tensor, batch_shape: torch.Size, num_queries: int, num_keys: int, device: torch.device
) -> Tensor:
    """An attendable pattern broadcast to ``batch_shape + (n, m)`` and flattened to (B, n, m)."""
    if not isinstance(attendable, Tensor) or attendable.dtype != torch.bool:
        raise ValueError(
            "attendable must be a bool tensor (True = the query may attend the key), got "
            f"{attendable.dtype if isinstance(attendable, Tensor) else type(attendable).__name__}"
        )
    try:
        full = torch.broadcast_to(attendable.to(device), (*batch_shape, num_queries, num_keys))
    except RuntimeError as error:
        raise ValueError(
            f"attendable of shape {tuple(attendable.shape)} does not broadcast to "
            f"{(*batch_shape, num_queries, num_keys)}"
        ) from error
    return full.reshape(-1, num_queries, num_keys)


def _nonfinite_elements(matrices: Tensor, norms: Tensor) -> Tensor:
    """(B,) True where a matrix holds a NaN or inf, from its Frobenius norm ``norms`` (B,).

    A norm is finite whenever the entries are unless it overflows; only the elements the screen flags are
    checked entry by entry (a batched ``isfinite`` costs several passes, a screen of its own one).
    """
    flagged = ~torch.isfinite(norms)
    for index in flagged.nonzero().flatten().tolist():
        flagged[index] = not bool(torch.isfinite(matrices[index]).all())
    return flagged


def _cache_sized_blocks(matrices: Tensor) -> list[tuple[slice, int, int]]:
    """(elements, start, stop) of consecutive blocks ``matrices[elements, start:stop]`` of about
    ``ONE_PASS_CHUNK_BYTES`` each: several whole matrices, or rows of one matrix larger than that."""
    batch, n, m = matrices.shape
    matrix_bytes = n * m * matrices.element_size()
    if matrix_bytes <= ONE_PASS_CHUNK_BYTES:
        per_block = ONE_PASS_CHUNK_BYTES // matrix_bytes
        return [(slice(first, first + per_block), 0, n) for first in range(0, batch, per_block)]
    rows = max(1, ONE_PASS_CHUNK_BYTES // (m * matrices.element_size()))
    return [
        (slice(element, element + 1), start, min(start + rows, n))
        for element in range(batch)
        for start in range(0, n, rows)
    ]


class Scratch:
    """One buffer for the temporaries of successive blocks, grown to the largest block.

    Temporaries made afresh for each block are fresh allocations whose page faults cost more than the
    arithmetic (benchmarks/README.md); reused, the buffer and its block stay in cache.
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def like(self, block: Tensor) -> Tensor:
        """A contiguous tensor of ``block``'s shape, dtype and device, overwriting earlier ones."""
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
    """Entropy, ‖A‖_F, rank-one residual and self-attention of a batch of attention matrices (B, n, m) seen
    in blocks, for the dense path and for blocks recomputed from q and k alike; also ``"mean_row"`` (B, m),
    the mean of the valid rows, which the Dobrushin estimate starts from.

    ``blocks()`` yields ``(elements, start, stop, A[elements, start:stop])`` covering every row of every
    element once, in dtype ``work``; it is called a second time only where the centred norm ‖A − 1āᵀ‖_F
    needs the centred rows themselves (``CENTRED_BY_DIFFERENCE_MIN``). Sums across blocks accumulate in
    float64, so the hundreds of partial sums of a long matrix add no more rounding than one pass over the
    whole matrix would; every temporary is ``scratch``'s. ``keys_per_row`` (B, n): the keys each row may
    attend, for the entropy's normalisation (:func:`normalised_entropy`).
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
        # Not as a product with ones: on some CPUs its rounding moves a residual of 0.2 by 1e-5 of itself
        # through ‖A‖_F² − n‖ā‖², where ``sum`` stays ten times closer (benchmarks/README.md).
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
    """``sink_mass`` and ``sink_mass_first`` (B,) from the column sums of A over the valid queries (B, m),
    the valid keys (B, m) and the number of valid queries (B,): the largest column mean among the valid keys,
    and the column mean of the first valid key. Elements with no valid key or query are made NaN by
    :func:`finished_metrics`."""
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
    """Mean over counted queries of Hᵢ / log(keys of row i): (B,) from the rows' entropies (B, n).

    A row counts when its query is valid and it has at least two keys: ``keys_per_row`` (B, n) where given,
    else the valid keys (j ≤ i among them when ``causal``); NaN where no row counts.
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
    """‖A − 1āᵀ‖_F / ‖A‖_F from its two norms; NaN for the zero matrix."""
    tiny = torch.finfo(frobenius.dtype).tiny
    return torch.where(
        frobenius > 0, centred_norm / frobenius.clamp_min(tiny), torch.full_like(frobenius, float("nan"))
    )


def _dobrushin(
    matrices: Tensor, queries: Tensor, blocks: list[tuple[slice, int, int]], mean_row: Tensor, *, exact: bool
) -> Tensor:
    """½ max over valid row pairs of ‖Aᵢ − Aⱼ‖₁: exactly, or by the anchored estimate over ``blocks``
    starting from each element's ``mean_row`` (B, m)."""
    batch, n, _ = matrices.shape
    if exact:
        # Whole matrices a cache-sized part at a time: the (part, n, n) distances stay small.
        per_part = max(1, ONE_PASS_CHUNK_BYTES // (n * n * matrices.element_size()))
        return torch.cat(
            [
                exact_dobrushin(matrices[first : first + per_part], queries[first : first + per_part])
                for first in range(0, batch, per_part)
            ]
        )

    def distances_to(rows: Tensor) -> Tensor:
        distances = matrices.new_empty((batch, n, rows.shape[1]))
        for elements, start, stop in blocks:
            distances[elements, start:stop] = torch.cdist(matrices[elements, start:stop], rows[elements], p=1)
        return distances

    def rows_at(index: Tensor) -> Tensor:
        return matrices.gather(1, index[:, :, None].expand(-1, -1, matrices.shape[2]))

    return anchored_dobrushin(distances_to, rows_at, queries, mean_row)


def exact_dobrushin(matrices: Tensor, queries: Tensor) -> Tensor:
    """½ max over all valid row pairs of ‖Aᵢ − Aⱼ‖₁ (B,), from every pairwise distance (0 without valid
    rows): one batched ``cdist`` of (B, n, n) distances."""
    distances = torch.cdist(matrices, matrices, p=1)
    valid_pairs = queries[:, :, None] & queries[:, None, :]
    return torch.where(valid_pairs, distances, torch.zeros_like(distances)).amax(dim=(1, 2)) / 2


def anchored_dobrushin(
    distances_to: Callable[[Tensor], Tensor],
    rows_at: Callable[[Tensor], Tensor],
    queries: Tensor,
    mean_row: Tensor,
) -> Tensor:
    """The anchored estimate L of τ = ½ maxᵢⱼ ‖Aᵢ − Aⱼ‖₁: (B,), with τ/2 ≤ L ≤ τ.

    L is half the largest distance from an anchor to a valid row, the anchors being the
    ``DOBRUSHIN_ANCHORS`` valid rows farthest from the mean row ā: rows far from the centre of the point
    set are where its diameter ends. L ≤ τ because it is a distance between two rows; L ≥ τ/2 because for
    any row r and the pair (i, j) that gives τ, 2τ = ‖Aᵢ − Aⱼ‖₁ ≤ ‖Aᵢ − r‖₁ + ‖r − Aⱼ‖₁ ≤ 2 maxₖ ‖Aₖ − r‖₁.
    ``distances_to(rows)`` maps rows (B, K, m) to every row's L1 distance from each of them (B, n, K);
    ``rows_at(index)`` maps row indices (B, K) to those rows (B, K, m). Two passes over A in all.
    """
    from_mean = distances_to(mean_row[:, None, :])[:, :, 0]
    from_mean = torch.where(queries, from_mean, torch.full_like(from_mean, -math.inf))
    anchors = from_mean.topk(min(DOBRUSHIN_ANCHORS, queries.shape[1]), dim=1).indices
    pairs = queries[:, :, None] & queries.gather(1, anchors)[:, None, :]
    distances = distances_to(rows_at(anchors))
    return torch.where(pairs, distances, torch.zeros_like(distances)).amax(dim=(1, 2)) / 2


def _exact_spectral_metrics(matrices: Tensor, causal: bool, include_rank_sums: bool) -> dict[str, Tensor]:
    singular_values = all_singular_values(matrices)
    sigma2 = (
        singular_values[:, 1] if singular_values.shape[1] > 1 else torch.zeros_like(singular_values[:, 0])
    )
    metrics = {
        "sigma1": singular_values[:, 0],
        "sigma2": sigma2,
        "eigen_gap": _exact_eigen_gap(matrices, causal),
        "singular_values": singular_values,
    }
    if include_rank_sums:
        metrics["effective_rank"] = effective_rank_from_singular_values(singular_values)
        metrics["threshold_rank"] = threshold_rank_from_singular_values(singular_values)
    else:
        metrics["effective_rank"] = torch.full_like(sigma2, float("nan"))
        metrics["threshold_rank"] = torch.full_like(sigma2, float("nan"))
    metrics["effective_rank_se"] = torch.zeros_like(sigma2)
    return metrics


def _exact_eigen_gap(matrices: Tensor, causal: bool) -> Tensor:
    batch, n, m = matrices.shape
    if causal or n != m:
        return torch.full((batch,), float("nan"), dtype=matrices.dtype, device=matrices.device)
    if n == 1:
        return torch.ones(batch, dtype=matrices.dtype, device=matrices.device)
    moduli = _eigenvalues(matrices).abs().sort(dim=1, descending=True).values
    return 1 - moduli[:, 1].to(matrices.dtype)


def _eigenvalues(matrices: Tensor) -> Tensor:
    """The eigenvalues of each square matrix (B, n, n); NaN for one whose eigenvalues cannot be found.

    LAPACK's shifted QR iteration can stop without converging on matrices of exact structure (every row the
    same, as in attention that sends all of its mass to one key). Then each matrix is solved after a random
    orthogonal similarity, which keeps its eigenvalues, moves them by a few units of roundoff of its norm,
    and breaks the structure the iteration stalled on. The rotation comes from a
    generator of its own, so no RNG stream of the caller moves.
    """
    try:
        return torch.linalg.eigvals(matrices)
    except torch.linalg.LinAlgError:
        pass
    generator = torch.Generator(device=matrices.device).manual_seed(0)
    eigenvalues = []
    for matrix in matrices:
        rotation = torch.linalg.qr(
            torch.randn(matrix.shape, generator=generator, dtype=matrix.dtype, device=matrix.device)
        ).Q
        try:
            eigenvalues.append(torch.linalg.eigvals(rotation @ matrix @ rotation.mT))
        except torch.linalg.LinAlgError:
            complex_dtype = torch.complex128 if matrix.dtype == torch.float64 else torch.complex64
            eigenvalues.append(torch.full(matrix.shape[:1], complex("nan"), dtype=complex_dtype))
    return torch.stack(eigenvalues)
