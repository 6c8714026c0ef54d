"""Attention metrics computed from q and k in blocks of rows, never holding an n × m matrix.

At long context the probabilities of one head are large (n = 16384: 1 GiB in float32, per head and sequence),
so :func:`attention_metrics_from_qk` computes the metric set of
:func:`~spectral_monitor.metrics.attention.attention_metrics` (same keys, same definitions) from the inputs
of the attention kernel, within a memory budget:

- softmax rows are recomputed from q and k a block of rows at a time; a first pass takes every row's
  log-sum-exp, after which each block of A is one matmul and one exp away;
- the one-pass members (entropy, ‖A‖_F, rank-one residual, self-attention, the Dobrushin estimate) are sums
  over those blocks;
- the spectral members come from the same Krylov code as the dense path
  (:func:`~spectral_monitor.metrics.attention_krylov.krylov_spectral_metrics`), run on an operator whose
  products A·X, Aᵀ·Y and AᵀA·X sweep the blocks (AᵀA·X in one sweep: each block is formed once per product);
- batch elements (sequences × heads) go through in chunks sized so their Krylov vectors fit the budget too.

Where the dense matrices are small enough to factorise (``method="auto"``:
:func:`~spectral_monitor.metrics.attention.uses_exact_path`) or ``method="exact"``, each chunk's probabilities
are formed and measured exactly by ``attention_metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from spectral_monitor.linalg import BatchedOperator
from spectral_monitor.metrics._common import check_method, flat_mask, working_dtype_of
from spectral_monitor.metrics.attention import (
    DOBRUSHIN_EXACT_MAX_ROWS,
    attention_metrics,
    finished_metrics,
    uses_exact_path,
)
from spectral_monitor.metrics.attention_krylov import KrylovState, krylov_spectral_metrics
from spectral_monitor.metrics.attention_passes import (
    Scratch,
    anchored_dobrushin,
    exact_dobrushin,
    one_pass_members,
)
from spectral_monitor.metrics.logits import max_over_real_queries

DEFAULT_MAX_BYTES = 256 * 2**20
"""Default budget of :func:`attention_metrics_from_qk`: memory it may use beyond its inputs and outputs."""
KRYLOV_COLUMNS = 320
"""Length-n vectors one batch element's Krylov work holds at most: the block Lanczos basis for σ₁, σ₂ (up to
60 iterations of width 4), or the Arnoldi basis and its images for |λ₂| (2 × 12 blocks of 4), or the
quadrature's probes and three-term vectors, with room for their temporaries."""
BLOCK_TEMPORARIES = 3
"""Blocks of rows alive at once: the block itself, and a temporary of its size in a pass (log, |Aᵢ − a|, the
logsumexp's shifted copy)."""
EXACT_TEMPORARIES = 6
"""Copies of a dense matrix the exact path holds at once (the probabilities, masked copy, one-pass
temporaries, ``svdvals`` and ``eigvals`` workspaces)."""


def attention_metrics_from_qk(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | None = None,
    bias: Tensor | None = None,
    key_mask: Tensor | None = None,
    query_mask: Tensor | None = None,
    causal: bool = False,
    logit_transform: Callable[[Tensor], Tensor] | None = None,
    method: str = "auto",
    include_rank_sums: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    block_rows: int | None = None,
    state: KrylovState | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """The metrics of ``attention_metrics`` for A = softmax(scale · q kᵀ + bias), without forming A whole.

    Metrics are those of ``attention_metrics(A, key_mask=..., query_mask=..., causal=...)``, and
    ``max_logit``, the largest logit transform(scale · q·k) + bias over real queries × attendable keys
    (:func:`~spectral_monitor.metrics.logits.max_attention_logit`), taken in the pass that forms the rows'
    log-sum-exp. A row with no attendable key is zero, as are padded queries' rows. The memory used beyond
    the inputs and outputs stays within ``max_bytes`` by construction: row blocks and batch chunks are sized
    from it, one batch element's Krylov vectors (about ``KRYLOV_COLUMNS`` · max(n, m) floats) being the floor.

    Args:
        q: (..., n, d) floating queries, one leading index per sequence × head.
        k: (..., m, d) keys with the same leading dims and d (repeat grouped keys per query head first).
        scale: Multiplies q·k; None = 1/√d.
        bias: An additive float logit bias broadcastable to (..., n, m), ``-inf`` where a key may not be
            attended; used a block of rows at a time, never expanded. None = no bias.
        key_mask: (..., m) bool, True = attendable key: masked keys take no part in the softmax, as a key
            padding mask. None = every key.
        query_mask: (..., n) bool, True = real query. None = every query.
        causal: Query i attends keys j ≤ i.
        logit_transform: An elementwise function applied to scale · q kᵀ before the bias is added (logit
            softcapping), in place or not; A is then softmax(transform(scale · q kᵀ) + bias).
        method: "exact" forms each matrix and factorises it (as ``attention_metrics``' exact path; the memory
            is then n·m per matrix whatever the budget), "krylov" the blocked products, "auto" exact where
            :func:`~spectral_monitor.metrics.attention.uses_exact_path` says.
        include_rank_sums: As in ``attention_metrics``.
        max_bytes: The memory budget in bytes, beyond the inputs and outputs.
        block_rows: Overrides the row-block size; None = sized from ``max_bytes``.
        state: As in ``attention_metrics``: warm-starts the Krylov path, and is updated.
        generator: As in ``attention_metrics``: draws the Krylov path's probes.

    Returns:
        The keys of ``attention_metrics`` (without ``singular_values``) and ``max_logit``, each of shape
        ``q.shape[:-2]``; NaN where q, k or the bias of an element hold a NaN or +inf (``nonfinite`` True).

    Raises:
        ValueError: ``causal`` is not a bool, ``max_bytes`` not a positive int, ``block_rows`` not a positive
            int or None, or ``scale`` not a finite number or None; also (from the checks it calls) q, k, the
            masks, the bias or ``method`` are not as described.

    Examples:
        The same numbers as the dense path on the probabilities:

        >>> import torch
        >>> from spectral_monitor.metrics import attention_metrics
        >>> generator = torch.Generator().manual_seed(0)
        >>> q, k = torch.randn(2, 6, 4, generator=generator), torch.randn(2, 6, 4, generator=generator)
        >>> blocked = attention_metrics_from_qk(q, k)
        >>> dense = attention_metrics(torch.softmax(q @ k.mT / 2, dim=-1))
        >>> all(torch.allclose(blocked[name], dense[name], equal_nan=True) for name in dense)
        True
        >>> tuple(blocked["max_logit"].shape)
        (2,)
    """
    q, k = _checked_qk(q, k)
    method = check_method(method)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int (bytes), got {max_bytes!r}")
    if block_rows is not None and (
        not isinstance(block_rows, int) or isinstance(block_rows, bool) or block_rows < 1
    ):
        raise ValueError(f"block_rows must be a positive int or None, got {block_rows!r}")
    batch_shape, (n, d), m = q.shape[:-2], q.shape[-2:], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    work = working_dtype_of(q)
    keys = flat_mask(key_mask, "key_mask", batch_shape, m, q.device)
    queries = flat_mask(query_mask, "query_mask", batch_shape, n, q.device)
    logit_bias = _LogitBias.of(bias, batch_shape, n, m, q.device)
    flat_q, flat_k = q.reshape(-1, n, d), k.reshape(-1, m, d)
    nonfinite = ~(flat_q.isfinite().all(dim=(1, 2)) & flat_k.isfinite().all(dim=(1, 2)))
    if logit_bias is not None:
        nonfinite |= logit_bias.nonfinite_elements()

    itemsize = torch.finfo(work).bits // 8
    exact = uses_exact_path(n, m, method, causal)
    per_element = n * m * EXACT_TEMPORARIES if exact else max(n, m) * KRYLOV_COLUMNS
    chunk = max(1, max_bytes // (2 * per_element * itemsize))
    rows = block_rows or max(1, max_bytes // (2 * chunk * m * itemsize * BLOCK_TEMPORARIES))
    warm = state if state is not None and _fits(state, flat_q.shape[0], m) else None
    pieces, next_vectors = [], []
    for part in _parts(flat_q.shape[0], chunk):
        operator = SoftmaxAttentionOperator(
            _sanitised(flat_q[part], nonfinite[part], work),
            _sanitised(flat_k[part], nonfinite[part], work),
            scale=float(scale),
            logit_transform=logit_transform,
            bias=None if logit_bias is None else logit_bias.restrict(part),
            key_mask=keys[part],
            query_mask=queries[part],
            causal=causal,
            block_rows=min(rows, n),
        )
        if exact:
            dense = operator.probabilities(0, n)
            pieces.append(
                attention_metrics(
                    dense,
                    key_mask=keys[part],
                    query_mask=queries[part],
                    causal=causal,
                    method="exact",
                    include_rank_sums=include_rank_sums,
                )
            )
        else:
            part_state = KrylovState(None if warm is None else warm.vectors[part])
            pieces.append(
                _blocked_members(
                    operator, keys[part], queries[part], causal, include_rank_sums, part_state, generator
                )
            )
            next_vectors.append(part_state.vectors)
        pieces[-1]["max_logit"] = operator.max_logit()
    if state is not None and next_vectors and all(vectors is not None for vectors in next_vectors):
        state.vectors = torch.cat(next_vectors)
    metrics = {name: torch.cat([piece[name].reshape(-1) for piece in pieces]) for name in pieces[0]}
    if exact:
        for value in metrics.values():
            if value.is_floating_point():
                value[nonfinite] = float("nan")
        metrics["nonfinite"] = metrics["nonfinite"] | nonfinite
        return {name: value.reshape(batch_shape) for name, value in metrics.items()}
    valid_rows, valid_keys = queries.sum(dim=1).to(work), keys.sum(dim=1).to(work)
    return finished_metrics(metrics, valid_rows, valid_keys, nonfinite, batch_shape)


def _blocked_members(
    operator: SoftmaxAttentionOperator,
    keys: Tensor,
    queries: Tensor,
    causal: bool,
    include_rank_sums: bool,
    state: KrylovState,
    generator: torch.Generator | None,
) -> dict[str, Tensor]:
    members = _blocked_one_pass(operator, keys, queries, causal)
    members.update(
        krylov_spectral_metrics(
            operator,
            queries,
            causal,
            include_rank_sums,
            members["frobenius"].square(),
            state,
            generator,
        )
    )
    return members


def _blocked_one_pass(
    operator: SoftmaxAttentionOperator, keys: Tensor, queries: Tensor, causal: bool
) -> dict[str, Tensor]:
    """Entropy, ‖A‖_F, rank-one residual, self-attention and Dobrushin in passes over blocks of rows."""
    every_element = slice(None)
    members = one_pass_members(
        lambda: ((every_element, *rows, operator.probabilities(*rows)) for rows in operator.blocks()),
        keys,
        queries,
        causal,
        operator.dtype,
        Scratch(),
    )
    n = operator.rows
    mean_row = members.pop("mean_row")
    if n <= DOBRUSHIN_EXACT_MAX_ROWS:  # the dense path's rule: exact below this many rows
        dobrushin = exact_dobrushin(operator.probabilities(0, n), queries)
    else:

        def rows_at(index: Tensor) -> Tensor:
            return torch.stack([operator.rows_at(column) for column in index.unbind(1)], dim=1)

        dobrushin = anchored_dobrushin(operator.distances_to, rows_at, queries, mean_row)
    members["dobrushin"] = dobrushin.to(operator.dtype)
    return members


class SoftmaxAttentionOperator(BatchedOperator):
    """A batch of attention matrices A = softmax(scale · q kᵀ + bias) (B, n, m), masked, known by products.

    Never holds A: every product recomputes A ``block_rows`` rows at a time from q and k, using the rows'
    log-sum-exp taken once at construction (with each row's largest logit, in the same pass). Rows of
    padded queries and rows with no attendable key are zero, as in the dense probabilities that
    ``attention_metrics`` measures.

    Args:
        q: (B, n, d) queries, in the dtype of the products.
        k: (B, m, d) keys.
        scale: Multiplies q·k.
        logit_transform: An elementwise function of scale · q kᵀ applied before the bias; None = none.
        bias: The additive logit bias as :func:`attention_metrics_from_qk` keeps it, or None.
        key_mask: (B, m) bool, True = attendable key.
        query_mask: (B, n) bool, True = real query.
        causal: Query i attends keys j ≤ i.
        block_rows: Rows of A formed at once.
        row_statistics: The rows' log-sum-exp and largest logit (B, n) each, where already known (a
            restriction of a larger operator); None = computed here.

    Examples:
        Equal logits under a causal mask: row i is uniform over its i + 1 keys.

        >>> import torch
        >>> every = torch.ones(1, 4, dtype=torch.bool)
        >>> operator = SoftmaxAttentionOperator(
        ...     torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), scale=1.0, bias=None, key_mask=every,
        ...     query_mask=every, causal=True, block_rows=2,
        ... )
        >>> list(operator.blocks())
        [(0, 2), (2, 4)]
        >>> operator.probabilities(2, 4)
        tensor([[[0.3333, 0.3333, 0.3333, 0.0000],
                 [0.2500, 0.2500, 0.2500, 0.2500]]])
        >>> operator.matmat(torch.ones(1, 4, 1)).flatten().round(decimals=4).tolist()  # rows sum to 1
        [1.0, 1.0, 1.0, 1.0]
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        *,
        scale: float,
        logit_transform: Callable[[Tensor], Tensor] | None = None,
        bias: _LogitBias | None,
        key_mask: Tensor,
        query_mask: Tensor,
        causal: bool,
        block_rows: int,
        row_statistics: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        super().__init__(q.shape[0], q.shape[1], k.shape[1], q.dtype, q.device)
        self.q, self.k = q, k
        self.scale = scale
        self.logit_transform = logit_transform
        self.bias = bias
        self.key_mask = key_mask
        self.all_keys = bool(key_mask.all())
        self.query_mask = query_mask
        self.causal = causal
        self.block_rows = block_rows
        # (B, n) each: the rows' log-sum-exp, +inf where the row is zero so exp(logit − it) = 0 there; and
        # the rows' largest logit, taken in the same pass.
        self.log_normaliser, self.row_max_logit = (
            self._row_statistics() if row_statistics is None else row_statistics
        )

    def blocks(self) -> Iterator[tuple[int, int]]:
        """The blocks of rows every pass goes through.

        Yields:
            ``(start, stop)`` of consecutive blocks of at most ``block_rows`` rows, covering every row.
        """
        for start in range(0, self.rows, self.block_rows):
            yield start, min(start + self.block_rows, self.rows)

    def logits(self, start: int, stop: int, width: int | None = None) -> Tensor:
        """The masked logits of rows ``start:stop`` and the first ``width`` keys.

        Args:
            start: The first row.
            stop: One past the last row.
            width: The keys to cover, from the first; None = all.

        Returns:
            (B, stop − start, width) transform(scale · q kᵀ) + bias, ``-inf`` where not attendable; a fresh
            tensor.
        """
        width = self.cols if width is None else width
        logits = self._transformed(
            torch.bmm(self.q[:, start:stop], self.k[:, :width].transpose(1, 2)).mul_(self.scale)
        )
        if self.bias is not None:
            logits.add_(self.bias.rows(start, stop, self.dtype)[:, :, :width])
        if not self.all_keys:
            logits.masked_fill_(~self.key_mask[:, None, :width], -math.inf)
        if self.causal:
            future = (
                torch.arange(width, device=self.device)[None, :]
                > torch.arange(start, stop, device=self.device)[:, None]
            )
            logits.masked_fill_(future, -math.inf)
        return logits

    def _transformed(self, scaled_logits: Tensor) -> Tensor:
        return scaled_logits if self.logit_transform is None else self.logit_transform(scaled_logits)

    def probabilities(self, start: int, stop: int, width: int | None = None) -> Tensor:
        """Rows ``start:stop`` of A.

        Args:
            start: The first row.
            stop: One past the last row.
            width: The columns to cover, from the first; None = all.

        Returns:
            (B, stop − start, width) probabilities, a fresh tensor the caller may overwrite.
        """
        return self.logits(start, stop, width).sub_(self.log_normaliser[:, start:stop, None]).exp_()

    def _attended_width(self, stop: int) -> int:
        """Columns that rows before ``stop`` can attend: causal rows i < stop see keys j ≤ i only, which
        halves the work of a causal product."""
        return min(stop, self.cols) if self.causal else self.cols

    def _row_statistics(self) -> tuple[Tensor, Tensor]:
        normaliser = torch.empty((self.batch, self.rows), dtype=self.dtype, device=self.device)
        row_max = torch.empty_like(normaliser)
        for start, stop in self.blocks():
            logits = self.logits(start, stop, self._attended_width(stop))
            normaliser[:, start:stop] = torch.logsumexp(logits, dim=2)
            row_max[:, start:stop] = logits.amax(dim=2)
        zero_rows = ~self.query_mask | torch.isneginf(normaliser)
        return normaliser.masked_fill_(zero_rows, math.inf), row_max

    def max_logit(self) -> Tensor:
        """:func:`~spectral_monitor.metrics.logits.max_attention_logit` of each element.

        Returns:
            (B,) the largest logit over real queries × attendable keys; NaN where there is none.
        """
        return max_over_real_queries(self.row_max_logit, self.query_mask)

    def matmat(self, x: Tensor) -> Tensor:
        """A x, a block of rows at a time (causal blocks reading only the columns they can attend).

        Args:
            x: (B, m, k) vectors, converted to the operator's dtype.

        Returns:
            (B, n, k).
        """
        x = x.to(self.dtype)
        out = x.new_empty((self.batch, self.rows, x.shape[2]))
        for start, stop in self.blocks():
            width = self._attended_width(stop)
            torch.bmm(self.probabilities(start, stop, width), x[:, :width], out=out[:, start:stop])
        return out

    def rmatmat(self, y: Tensor) -> Tensor:
        """Aᵀ y, accumulated over blocks of rows.

        Args:
            y: (B, n, k) vectors, converted to the operator's dtype.

        Returns:
            (B, m, k).
        """
        # Accumulated as (yᵀA)ᵀ, reading each block row by row as it was made (DenseOperator says why).
        y = y.to(self.dtype)
        transposed = y.new_zeros((self.batch, y.shape[2], self.cols))
        for start, stop in self.blocks():
            width = self._attended_width(stop)
            transposed[:, :, :width].baddbmm_(
                y[:, start:stop].transpose(1, 2), self.probabilities(start, stop, width)
            )
        return transposed.transpose(1, 2)

    def gram_matmat(self, x: Tensor) -> Tensor:
        """AᵀA x in one sweep: Σ over blocks of A_bᵀ (A_b x), each block formed once.

        Args:
            x: (B, m, k) vectors, converted to the operator's dtype.

        Returns:
            (B, m, k).
        """
        x = x.to(self.dtype)
        transposed = x.new_zeros((self.batch, x.shape[2], self.cols))
        for start, stop in self.blocks():
            width = self._attended_width(stop)
            block = self.probabilities(start, stop, width)
            transposed[:, :, :width].baddbmm_(torch.bmm(block, x[:, :width]).transpose(1, 2), block)
        return transposed.transpose(1, 2)

    def rows_at(self, index: Tensor) -> Tensor:
        """One row of each element's A.

        Args:
            index: (B,) the row of each element.

        Returns:
            (B, m) row ``index[b]`` of element b's A.
        """
        elements = torch.arange(self.batch, device=self.device)
        logits = torch.bmm(self.q[elements, index][:, None, :], self.k.transpose(1, 2))[:, 0].mul_(self.scale)
        logits = self._transformed(logits)
        if self.bias is not None:
            logits.add_(self.bias.rows_at(index, self.dtype))
        if not self.all_keys:
            logits.masked_fill_(~self.key_mask, -math.inf)
        if self.causal:
            logits.masked_fill_(
                torch.arange(self.cols, device=self.device)[None, :] > index[:, None], -math.inf
            )
        return logits.sub_(self.log_normaliser[elements, index][:, None]).exp_()

    def distances_to(self, rows: Tensor) -> Tensor:
        """‖Aᵢ − rₖ‖₁ for every row i of each element and each of its given rows rₖ.

        Args:
            rows: (B, K, m) the rows rₖ of each element.

        Returns:
            (B, n, K) L1 distances.
        """
        distances = torch.empty((self.batch, self.rows, rows.shape[1]), dtype=self.dtype, device=self.device)
        for start, stop in self.blocks():
            distances[:, start:stop] = torch.cdist(self.probabilities(start, stop), rows.to(self.dtype), p=1)
        return distances

    def restrict(self, index: Tensor) -> SoftmaxAttentionOperator:
        """The operator of the batch elements ``index`` only, reusing their row statistics.

        Args:
            index: The batch elements to keep (indices or a bool mask over B).

        Returns:
            A :class:`SoftmaxAttentionOperator` over those elements.
        """
        return SoftmaxAttentionOperator(
            self.q[index],
            self.k[index],
            scale=self.scale,
            logit_transform=self.logit_transform,
            bias=None if self.bias is None else self.bias.restrict(index),
            key_mask=self.key_mask[index],
            query_mask=self.query_mask[index],
            causal=self.causal,
            block_rows=self.block_rows,
            row_statistics=(self.log_normaliser[index], self.row_max_logit[index]),
        )


class _LogitBias:
    """An additive logit bias kept at its own (broadcast) size: element b's rows are ``table[index[b]]``.

    ``table`` (E, 1 or n, m) in the caller's dtype; blocks of rows are gathered and converted one at a time.
    """

    def __init__(self, table: Tensor, index: Tensor) -> None:
        self.table = table
        self.index = index

    @classmethod
    def of(
        cls, bias: Tensor | None, batch_shape: torch.Size, n: int, m: int, device: torch.device
    ) -> _LogitBias | None:
        if bias is None:
            return None
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise ValueError(
                "bias must be a floating tensor (an additive logit bias, -inf = not attendable) or None, got "
                f"{bias.dtype if isinstance(bias, Tensor) else type(bias).__name__}"
            )
        full = (*batch_shape, n, m)
        if bias.dim() > len(full):
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to {full}")
        bias = bias.reshape((1,) * (2 - bias.dim()) + tuple(bias.shape))  # a key bias (m,) is one row
        try:
            torch.broadcast_shapes(bias.shape, full)
        except RuntimeError as error:
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to {full}") from error
        bias = bias.to(device)[(None,) * (len(full) - bias.dim())]
        table = bias.expand(*bias.shape[:-1], m).reshape(-1, bias.shape[-2], m)
        index = torch.arange(table.shape[0], device=device).reshape(bias.shape[:-2]).expand(batch_shape)
        return cls(table, index.reshape(-1))

    def nonfinite_elements(self) -> Tensor:
        """(B,) True where an element's bias holds a NaN or +inf (``-inf`` is a mask, not a fault)."""
        bad = (self.table.isnan() | torch.isposinf(self.table)).any(dim=(1, 2))
        return bad[self.index]

    def restrict(self, index: Tensor | slice) -> _LogitBias:
        return _LogitBias(self.table, self.index[index])

    def rows(self, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        """Rows ``start:stop`` of each element's bias: (B, stop − start or 1, m), non-finite values zeroed."""
        rows = self.table[:, start:stop] if self.table.shape[1] > 1 else self.table
        return _finite(rows[self.index].to(dtype))

    def rows_at(self, row: Tensor, dtype: torch.dtype) -> Tensor:
        """Row ``row[b]`` of each element's bias: (B, m)."""
        row = row if self.table.shape[1] > 1 else torch.zeros_like(row)
        return _finite(self.table[self.index, row].to(dtype))


def _finite(bias: Tensor) -> Tensor:
    # NaN or +inf in a bias make that element's metrics NaN (flagged before); zeroing them here keeps the
    # batched Krylov iterations of the other elements finite. -inf stays: it masks.
    return bias.nan_to_num_(nan=0.0, posinf=0.0, neginf=-math.inf)


def _checked_qk(q: object, k: object) -> tuple[Tensor, Tensor]:
    for name, value in (("q", q), ("k", k)):
        if not isinstance(value, Tensor) or value.dim() < 2 or not value.is_floating_point():
            raise ValueError(
                f"{name} must be a floating tensor of shape (..., tokens, head_dim), got "
                f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}"
                f"{' ' + str(value.dtype) if isinstance(value, Tensor) else ''}"
            )
        if value.shape[-1] == 0 or value.shape[-2] == 0:
            raise ValueError(f"{name} must have tokens and a head dimension, got shape {tuple(value.shape)}")
        if value.numel() == 0:
            raise ValueError(f"{name} must hold at least one sequence, got shape {tuple(value.shape)}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor)
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q (..., n, d) and k (..., m, d) must share their leading dims and d, got {tuple(q.shape)} and "
            f"{tuple(k.shape)} (repeat grouped key heads per query head first)"
        )
    return q, k


def _sanitised(tensor: Tensor, nonfinite: Tensor, work: torch.dtype) -> Tensor:
    """``tensor`` in the working dtype (a copy), zeroed for non-finite elements: their attention becomes
    uniform over the attendable keys, harmless to the batched iterations, and their metrics NaN."""
    converted = tensor.to(work, copy=True)
    if bool(nonfinite.any()):
        converted[nonfinite] = 0.0
    return converted


def _fits(state: KrylovState, batch: int, m: int) -> bool:
    return state.vectors is not None and state.vectors.shape[:2] == (batch, m)


def _parts(batch: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, batch)) for start in range(0, batch, chunk)]
