"""Attention-matrix metrics: entropy, singular and eigen gaps, rank-one residual, ranks, Dobrushin.

One definition of each, batched over any leading dims. Two paths compute the spectral
members: "exact" (``svdvals``/``eigvals``, the reference and the small-n path) and "krylov" (block Lanczos for
σ₁, σ₂; stochastic Lanczos quadrature for effective and threshold rank; block Arnoldi for |λ₂|:
:mod:`spectral_monitor.metrics.attention_krylov`), which touches each matrix a few dozen times instead of
factorising it. The members that need no spectrum come from one pass over the matrices, shared by both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spectral_monitor.linalg import DenseOperator
from spectral_monitor.metrics._common import (
    all_singular_values,
    check_matrices,
    check_method,
    effective_rank_from_singular_values,
    flat_mask,
    has_eigen_gap,
    nonfinite_matrices,
    stable_rank,
    threshold_rank_from_singular_values,
    working_dtype_of,
)
from spectral_monitor.metrics.attention_krylov import KrylovState, krylov_spectral_metrics
from spectral_monitor.metrics.attention_passes import (
    Scratch,
    anchored_dobrushin,
    exact_dobrushin,
    one_pass_members,
)
from spectral_monitor.metrics.masks import is_causal_pattern

EXACT_MAX_SIZE = 128
"""``method="auto"`` factorises exactly when the smaller side of A is at most this, or at most
``EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP`` where the eigen gap is not measured. Above it the non-symmetric
``eigvals`` the exact eigen gap needs costs more than the whole Krylov path, whose rank sums are factorised
up to ``FACTORISE_FIRST_MAX_SIZE`` all the same: 13.7 against 6.7 ms a matrix at n = 256, 3.5 against 3.0
at 128, 0.9 against 1.7 at 64 (benchmarks/README.md)."""
EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP = 1024
"""Causal or rectangular attention (no eigen gap, so no non-symmetric ``eigvals``) is factorised exactly up to
this size: on the near-uniform causal attention of a freshly initialised model the rank-sum quadrature runs
every round it has and still reads the effective rank low, so there the exact path is both the faster and
the correct one (benchmarks/README.md). Above it the cost of factorising grows as n³ per head."""
DOBRUSHIN_EXACT_MAX_ROWS = 32
"""Above this many rows (and off the "exact" path) the Dobrushin coefficient is the anchored estimate
(:func:`~spectral_monitor.metrics.attention_passes.anchored_dobrushin`): a lower bound that is at least
half the true value. The exact value compares every pair of rows, O(n³) per matrix; the estimate is O(n²),
and the faster of the two from this size up (benchmarks/README.md)."""
ONE_PASS_CHUNK_BYTES = 2**20
"""Bytes of A in one block of the passes for the entropy, norms and Dobrushin distances: a block and its
temporary stay in a core's L2 cache (benchmarks/README.md)."""

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
    """Spectral and entropy metrics of attention matrices, rows summing to 1, batched over leading dims.

    Metrics are those of the submatrix of valid queries × valid keys. Every value has shape
    ``attn.shape[:-2]``:

    - ``entropy``: mean over queries of −Σⱼ Aᵢⱼ log Aᵢⱼ / log(keys of row i); rows with < 2 keys left out;
    - ``sigma1``, ``sigma2``, ``spectral_gap`` = 1 − σ₂/σ₁, ``stable_rank`` = ‖A‖_F²/σ₁²;
    - ``eigen_gap`` = 1 − |λ₂| (NaN when causal or non-square: a triangular A's eigenvalues are its
      diagonal);
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

    Args:
        attn: (..., n, m) floating attention probabilities, queries × keys; not modified.
        key_mask: (..., m) bool, True = attendable key (the opposite of PyTorch's ``key_padding_mask``);
            None = every key.
        query_mask: (..., n) bool, True = real query; None = every query.
        causal: Row i attends keys j ≤ i: normalised entropy uses i + 1 keys, and ``eigen_gap`` is NaN.
        attendable: Bool broadcastable to (..., n, m), True where query i may attend key j
            (:func:`spectral_monitor.metrics.masks.attendable_pattern` reads it from an attention mask): row
            i's keys are its attendable valid keys, and a pattern that is lower-triangular over the valid
            queries is causal whatever ``causal`` says. None = every valid key.
        method: "exact" (``svdvals``/``eigvals``), "krylov", or "auto" (:func:`uses_exact_path`).
        include_rank_sums: False skips the effective and threshold ranks (NaN), the only members that need
            the whole spectrum.
        state: Warm-starts the Krylov path from the previous call's top singular vectors, and is updated.
        generator: Draws the Krylov path's probes; None = a private fixed-seed one, so the global RNG is
            never touched.
        return_spectra: Also return ``singular_values`` where they were computed.

    Returns:
        The metrics above by name, in ``attn``'s dtype where floating point (float64 input is measured in
        float64, other dtypes in float32), and ``nonfinite`` bool. With ``return_spectra``, also
        ``singular_values`` (..., min(n, m)), the descending singular values the spectral members were
        computed from (NaN where ``nonfinite``), so that no caller factorises the same matrices again, where
        they were computed: on the exact path, and on the Krylov path where the rank sums factorised the
        matrices (up to 512 tokens); absent otherwise.

    Raises:
        ValueError: ``attn`` holds no matrix; also (from the checks it calls) ``attn`` is not a floating
            tensor of at least 2 dims, a mask or ``attendable`` has the wrong dtype or shape, or ``method`` is
            unknown.

    Examples:
        Uniform attention is rank one; the identity, where each query attends only itself, is full rank:

        >>> import torch
        >>> uniform = attention_metrics(torch.full((4, 4), 0.25))
        >>> [round(float(uniform[name]), 4) for name in ("entropy", "sigma1", "spectral_gap", "dobrushin")]
        [1.0, 1.0, 1.0, 0.0]
        >>> identity = attention_metrics(torch.eye(4))
        >>> [round(float(identity[name]), 4) for name in ("entropy", "effective_rank", "rank_one_residual")]
        [0.0, 4.0, 0.866]
        >>> batch = torch.stack([torch.eye(4), torch.full((4, 4), 0.25)])
        >>> both = attention_metrics(batch, return_spectra=True)
        >>> tuple(both["singular_values"].shape), both["eigen_gap"].round(decimals=4).tolist()
        ((2, 4), [0.0, 1.0])
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
    nonfinite = nonfinite_matrices(matrices, metrics["frobenius"])
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
        singular_values = metrics.pop("singular_values", None)
    finished = finished_metrics(metrics, valid_rows, valid_keys, nonfinite, batch_shape)
    if return_spectra and singular_values is not None:
        singular_values[nonfinite] = float("nan")
        finished["singular_values"] = singular_values.reshape(*batch_shape, -1)
    return finished


def uses_exact_path(n: int, m: int, method: str, causal: bool = False) -> bool:
    """Whether :func:`attention_metrics` factorises (n, m) matrices exactly under ``method``.

    There its batch elements are independent of each other and of any ``state``: batches may be
    concatenated freely. Under "auto" the limit is ``EXACT_MAX_SIZE`` on the smaller side, or
    ``EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP`` where no eigen gap is measured (causal or rectangular attention).

    Args:
        n: Queries (rows of A).
        m: Keys (columns of A).
        method: "exact", "krylov" or "auto".
        causal: The attention is causal, so no eigen gap is measured.

    Returns:
        True for the exact path, False for the Krylov one.

    Examples:
        >>> uses_exact_path(512, 512, "auto"), uses_exact_path(512, 512, "auto", causal=True)
        (False, True)
        >>> uses_exact_path(8, 8, "krylov")
        False
    """
    if method != "auto":
        return method == "exact"
    largest = EXACT_MAX_SIZE if has_eigen_gap(n, m, causal) else EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP
    return min(n, m) <= largest


def finished_metrics(
    metrics: dict[str, Tensor],
    valid_rows: Tensor,
    valid_keys: Tensor,
    nonfinite: Tensor,
    batch_shape: torch.Size,
) -> dict[str, Tensor]:
    """The one-pass and spectral members joined into the catalogue's set, shaped ``batch_shape``.

    Shared by every way of computing the members (dense probabilities, blocked products from q and k), so the
    derived metrics (``spectral_gap``, ``stable_rank``, ``effective_rank_ratio``) have one definition.

    Args:
        metrics: (B,) members by name, at least ``frobenius``, ``sigma1``, ``sigma2`` and
            ``effective_rank``. Consumed: ``frobenius`` is popped, and every tensor is made NaN in place
            where not measurable or non-finite.
        valid_rows: (B,) the number of valid queries, floating.
        valid_keys: (B,) the number of valid keys, floating.
        nonfinite: (B,) bool, True where the input held a NaN or inf.
        batch_shape: The leading dims B is the flattening of.

    Returns:
        The members but ``frobenius``, the derived metrics and ``nonfinite``, each of shape ``batch_shape``;
        NaN where ``nonfinite`` or where nothing is measurable (no valid row, no valid key, or A = 0).

    Examples:
        >>> import torch
        >>> members = {
        ...     "frobenius": torch.tensor([1.0, 0.0]),
        ...     "sigma1": torch.tensor([0.8, 0.0]),
        ...     "sigma2": torch.tensor([0.4, 0.0]),
        ...     "effective_rank": torch.tensor([1.5, 1.0]),
        ... }
        >>> two = torch.tensor([2.0, 2.0])
        >>> finished = finished_metrics(members, two, two, torch.tensor([False, False]), torch.Size([2]))
        >>> finished["spectral_gap"], finished["effective_rank_ratio"]  # the second one is zero: NaN
        (tensor([0.5000,    nan]), tensor([0.7500,    nan]))
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
    """An attendable pattern broadcast to ``batch_shape + (n, m)`` and flattened to (B, n, m).

    Args:
        attendable: Bool, True where query i may attend key j, broadcastable to ``batch_shape + (n, m)``.
        batch_shape: The leading dims of the attention.
        num_queries: n.
        num_keys: m.
        device: Where the pattern goes.

    Returns:
        (B, n, m) bool, a broadcast view where no copy is needed.

    Raises:
        ValueError: ``attendable`` is not a bool tensor, or does not broadcast.

    Examples:
        >>> import torch
        >>> causal = torch.ones(3, 3, dtype=torch.bool).tril()
        >>> tuple(flat_pattern(causal, torch.Size([2, 2]), 3, 3, torch.device("cpu")).shape)
        (4, 3, 3)
    """
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
    if not has_eigen_gap(n, m, causal):
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
