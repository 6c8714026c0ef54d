"""Float64 numpy references for the metric catalogue, and the matrices whose answers the tests know.

Written straight from the catalogue and never from ``spectral_monitor``, so that each test compares two
independent implementations of one definition. A reference takes ONE matrix (a 2-D array) and returns plain
floats; :func:`attention_reference_batch` maps it over leading batch dimensions. At the end, one piece of
test support: :func:`one_intra_op_thread`.

Conventions the catalogue leaves to the reader, fixed here once:

- A metric is computed on the submatrix S = A[valid queries, valid keys]; whatever masked entries hold is
  ignored. Under ``causal`` the keys of row i are the valid keys j ≤ i (i indexes the full matrix); with an
  ``attendable`` pattern, the valid keys it allows row i.
- Entropy rows with fewer than two keys are left out of the mean; with none left the entropy is NaN.
- ``eigen_gap`` and ``self_attention`` are about tokens attending to tokens, so they need self-attention
  (n = m: one token set on both axes; ``eigen_gap`` also non-causal), else NaN. They are computed on the
  n×n matrix with masked rows and columns zeroed, which keeps each token's own diagonal entry. With equal
  query and key masks that matrix is S padded with zero rows and columns: S's eigenvalues plus zeros.
- A missing σ₂ or λ₂ counts as 0: σ₂ = 0 for a single valid row or column, λ₂ = 0 for a single token
  (whose eigen gap is therefore 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

ENERGY_FRACTION = 0.99

ATTENTION_METRICS = (
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
TOKEN_METRICS = ("cosine_similarity", "token_residual", "stable_rank", "effective_rank")
WEIGHT_METRICS = ("spectral_norm", "frobenius_norm", "stable_rank", "mp_edge", "mp_spikes")


# --------------------------------------------------------------------------------------------------------
# Spectral sums shared by the attention, token and weight references
# --------------------------------------------------------------------------------------------------------


def singular_values(matrix: np.ndarray) -> np.ndarray:
    """All min(n, m) singular values, descending, in float64."""
    return np.linalg.svd(np.asarray(matrix, dtype=np.float64), compute_uv=False)


def effective_rank(sigma: np.ndarray) -> float:
    """Roy & Vetterli (2007): exp of the Shannon entropy of p = σ / Σσ, with 0 log 0 = 0."""
    p = sigma / sigma.sum()
    p = p[p > 0]
    return float(np.exp(-np.sum(p * np.log(p))))


def threshold_rank(sigma: np.ndarray, fraction: float = ENERGY_FRACTION) -> int:
    """The smallest k with Σ_{i≤k} σᵢ² ≥ fraction · Σ σᵢ²."""
    energy = np.cumsum(sigma**2)
    return int(np.searchsorted(energy, fraction * energy[-1], side="left")) + 1


def threshold_rank_range(sigma: np.ndarray, slack: float) -> tuple[int, int]:
    """The threshold ranks reachable when every energy fraction may be off by ``slack``.

    Rounding a spectrum to float32 can move a cumulative fraction lying within rounding of 0.99 to its other
    side; the integer answer is then legitimately either neighbour.
    """
    lowest = threshold_rank(sigma, ENERGY_FRACTION - slack)
    highest = min(threshold_rank(sigma, min(ENERGY_FRACTION + slack, 1.0)), sigma.size)
    return lowest, highest


def stable_rank(matrix: np.ndarray, sigma: np.ndarray) -> float:
    return float(np.sum(matrix**2) / sigma[0] ** 2)


# --------------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------------


def _all_true(size: int, mask: np.ndarray | None) -> np.ndarray:
    return np.ones(size, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)


def valid_submatrix(
    attn: np.ndarray, key_mask: np.ndarray | None = None, query_mask: np.ndarray | None = None
) -> np.ndarray:
    """S = A[valid queries, valid keys] of one (n, m) matrix: what every attention metric is computed on."""
    rows = _all_true(attn.shape[0], query_mask)
    cols = _all_true(attn.shape[1], key_mask)
    return np.asarray(attn, dtype=np.float64)[np.ix_(rows, cols)]


def attention_reference(
    attn: np.ndarray,
    *,
    key_mask: np.ndarray | None = None,
    query_mask: np.ndarray | None = None,
    causal: bool = False,
    attendable: np.ndarray | None = None,
) -> dict[str, float]:
    """Every attention metric of the catalogue for one (n, m) matrix, in float64.

    ``attendable`` (n, m) bool: the keys each row may attend, for the entropy's normalisation.
    """
    attn = np.asarray(attn, dtype=np.float64)
    rows = np.flatnonzero(_all_true(attn.shape[0], query_mask))
    cols = np.flatnonzero(_all_true(attn.shape[1], key_mask))
    sub = valid_submatrix(attn, key_mask, query_mask)
    n, m = sub.shape

    normalised_entropies = []
    for i in rows:
        keys = cols[cols <= i] if causal else cols
        if attendable is not None:
            keys = keys[np.asarray(attendable, dtype=bool)[i, keys]]
        if keys.size < 2:
            continue
        p = attn[i, keys]
        p = p[p > 0]
        normalised_entropies.append(-np.sum(p * np.log(p)) / np.log(keys.size))
    entropy = float(np.mean(normalised_entropies)) if normalised_entropies else float("nan")

    sigma = singular_values(sub)
    sigma1 = float(sigma[0])
    sigma2 = float(sigma[1]) if sigma.size > 1 else 0.0

    one_token_set = attn.shape[0] == attn.shape[1]
    token_operator = np.zeros_like(attn)
    token_operator[np.ix_(rows, cols)] = sub
    if one_token_set and not causal:
        moduli = np.sort(np.abs(np.linalg.eigvals(token_operator)))[::-1]
        eigen_gap = 1.0 - (float(moduli[1]) if moduli.size > 1 else 0.0)
    else:
        eigen_gap = float("nan")

    mean_row = sub.mean(axis=0)
    rank_one_residual = float(np.linalg.norm(sub - mean_row[None, :]) / np.linalg.norm(sub))
    # Row-by-row keeps memory at O(n m) for the large matrices of the Krylov tests.
    dobrushin = max(0.5 * float(np.abs(sub - sub[i]).sum(axis=1).max()) for i in range(n))
    erank = effective_rank(sigma)

    return {
        "entropy": entropy,
        "sigma1": sigma1,
        "sigma2": sigma2,
        "spectral_gap": 1.0 - sigma2 / sigma1,
        "eigen_gap": eigen_gap,
        "rank_one_residual": rank_one_residual,
        "stable_rank": stable_rank(sub, sigma),
        "effective_rank": erank,
        "effective_rank_ratio": erank / min(n, m),
        "threshold_rank": float(threshold_rank(sigma)),
        "dobrushin": dobrushin,
        "self_attention": float(np.trace(token_operator) / n) if one_token_set else float("nan"),
        # The mean over valid queries of each valid key's column: the most-attended one, and the first.
        "sink_mass": float(mean_row.max()),
        "sink_mass_first": float(mean_row[0]),
    }


def max_logit_reference(
    q: np.ndarray,
    k: np.ndarray,
    *,
    scale: float,
    bias: np.ndarray | None = None,
    key_mask: np.ndarray | None = None,
    query_mask: np.ndarray | None = None,
    causal: bool = False,
) -> float:
    """The largest scale · qᵢ·kⱼ + biasᵢⱼ of one head, q (n, d) and k (m, d), over the real queries i and
    the keys j that row i may attend: valid keys, j ≤ i under ``causal``, bias not ``-inf``. NaN where no
    such pair exists. Computed entry by entry in float64."""
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    queries = _all_true(q.shape[0], query_mask)
    keys = _all_true(k.shape[0], key_mask)
    largest = -np.inf
    for i in np.flatnonzero(queries):
        for j in np.flatnonzero(keys):
            if causal and j > i:
                continue
            logit = scale * float(q[i] @ k[j]) + (0.0 if bias is None else float(bias[i, j]))
            if logit != -np.inf:
                largest = max(largest, logit)
    return float("nan") if largest == -np.inf else largest


def output_logit_reference(logits: np.ndarray, *, token_mask: np.ndarray | None = None) -> dict[str, float]:
    """The LM head's largest logit and mean log-partition over the real tokens of one sequence (n, V), in
    float64: max over real tokens t and words v of zₜᵥ, and the mean over t of log Σ_v exp(zₜᵥ)."""
    z = np.asarray(logits, dtype=np.float64)[_all_true(logits.shape[0], token_mask)]
    if z.shape[0] == 0:
        return {"max_logit": float("nan"), "log_partition": float("nan")}
    shift = z.max(axis=1, keepdims=True)
    log_partition = shift[:, 0] + np.log(np.exp(z - shift).sum(axis=1))
    return {"max_logit": float(z.max()), "log_partition": float(log_partition.mean())}


def token_reference(x: np.ndarray, *, token_mask: np.ndarray | None = None) -> dict[str, float]:
    """Residual-stream metrics of one sequence X (n, d), on its real tokens only."""
    x = np.asarray(x, dtype=np.float64)[_all_true(x.shape[0], token_mask)]
    n = x.shape[0]
    unit_rows = x / np.linalg.norm(x, axis=1, keepdims=True)
    summed = unit_rows.sum(axis=0)
    sigma = singular_values(x)
    return {
        "cosine_similarity": float((summed @ summed - n) / (n * (n - 1))),
        "token_residual": float(np.linalg.norm(x - x.mean(axis=0)) / np.linalg.norm(x)),
        "stable_rank": stable_rank(x, sigma),
        "effective_rank": effective_rank(sigma),
    }


def weight_reference(w: np.ndarray) -> dict[str, float]:
    """Weight metrics of one matrix W (N, M), including the Marchenko–Pastur bulk edge and its spikes."""
    w = np.asarray(w, dtype=np.float64)
    rows, cols = w.shape
    sigma = singular_values(w)
    frobenius = float(np.linalg.norm(w))
    noise_scale = frobenius / np.sqrt(rows * cols)
    edge = noise_scale * (np.sqrt(rows) + np.sqrt(cols))
    return {
        "spectral_norm": float(sigma[0]),
        "frobenius_norm": frobenius,
        "stable_rank": stable_rank(w, sigma),
        "mp_edge": float(edge),
        "mp_spikes": float(np.count_nonzero(sigma > edge)),
    }


def _broadcast_mask(mask: np.ndarray | None, batch_shape: tuple[int, ...], size: int) -> np.ndarray:
    if mask is None:
        return np.ones((*batch_shape, size), dtype=bool)
    return np.broadcast_to(np.asarray(mask, dtype=bool), (*batch_shape, size))


def attention_reference_batch(
    attn: np.ndarray,
    *,
    key_mask: np.ndarray | None = None,
    query_mask: np.ndarray | None = None,
    causal: bool = False,
) -> dict[str, np.ndarray]:
    """:func:`attention_reference` of every matrix of a (..., n, m) batch; masks broadcast like the API's."""
    batch_shape, (n, m) = attn.shape[:-2], attn.shape[-2:]
    keys = _broadcast_mask(key_mask, batch_shape, m)
    queries = _broadcast_mask(query_mask, batch_shape, n)
    return _map_over_batch(
        batch_shape,
        lambda index: attention_reference(
            attn[index], key_mask=keys[index], query_mask=queries[index], causal=causal
        ),
    )


def token_reference_batch(x: np.ndarray, *, token_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    tokens = _broadcast_mask(token_mask, x.shape[:-2], x.shape[-2])
    return _map_over_batch(x.shape[:-2], lambda index: token_reference(x[index], token_mask=tokens[index]))


def weight_reference_batch(w: np.ndarray) -> dict[str, np.ndarray]:
    return _map_over_batch(w.shape[:-2], lambda index: weight_reference(w[index]))


def _map_over_batch(
    batch_shape: tuple[int, ...], reference: Callable[[tuple[int, ...]], dict[str, float]]
) -> dict[str, np.ndarray]:
    per_element = {index: reference(index) for index in np.ndindex(batch_shape)}
    names = next(iter(per_element.values())).keys()
    return {
        name: np.array([per_element[index][name] for index in np.ndindex(batch_shape)]).reshape(batch_shape)
        for name in names
    }


# --------------------------------------------------------------------------------------------------------
# Attention matrices (row-stochastic over their valid keys), float64
# --------------------------------------------------------------------------------------------------------


def row_softmax(logits: np.ndarray, key_mask: np.ndarray | None = None, causal: bool = False) -> np.ndarray:
    """Softmax over the last axis; masked keys (and keys j > i under ``causal``) get exactly 0."""
    logits = np.array(logits, dtype=np.float64)
    n, m = logits.shape[-2:]
    allowed = np.ones(logits.shape, dtype=bool)
    if key_mask is not None:
        allowed &= np.asarray(key_mask, dtype=bool)[..., None, :]
    if causal:
        allowed &= np.tril(np.ones((n, m), dtype=bool))
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def query_key_logits(rng: np.random.Generator, shape: tuple[int, ...], d: int = 64) -> np.ndarray:
    """Logits qkᵀ/√d of Gaussian queries and keys: the spectrum real attention starts training with."""
    *batch, n, m = shape
    q = rng.standard_normal((*batch, n, d))
    k = rng.standard_normal((*batch, m, d))
    return q @ np.swapaxes(k, -1, -2) / np.sqrt(d)


def random_distribution(rng: np.random.Generator, size: int) -> np.ndarray:
    p = rng.random(size) + 0.05
    return p / p.sum()


def uniform_attention(n: int, m: int | None = None) -> np.ndarray:
    m = n if m is None else m
    return np.full((n, m), 1.0 / m)


def permutation_attention(permutation: list[int]) -> np.ndarray:
    return np.eye(len(permutation))[permutation]


def rank_one_attention(row: np.ndarray, n: int) -> np.ndarray:
    """Every query attends with the same distribution ``row``: A = 1 rowᵀ."""
    return np.tile(row, (n, 1))


def block_diagonal_attention(rng: np.random.Generator, sizes: list[int]) -> np.ndarray:
    n = sum(sizes)
    attn = np.zeros((n, n))
    start = 0
    for size in sizes:
        block = np.stack([random_distribution(rng, size) for _ in range(size)])
        attn[start : start + size, start : start + size] = block
        start += size
    return attn


def near_degenerate_attention(rng: np.random.Generator, sizes: list[int], leak: float) -> np.ndarray:
    """Uniform blocks leaking ``leak`` of their mass uniformly: σ₁ = 1 and σ₂ = λ₂ = 1 − leak.

    The block indicator difference is an eigenvector of (1−leak)·blockdiag + leak·uniform with eigenvalue
    1 − leak; a tiny generic perturbation keeps the matrix from being exactly symmetric-structured.
    """
    n = sum(sizes)
    blocks = np.zeros((n, n))
    start = 0
    for size in sizes:
        blocks[start : start + size, start : start + size] = 1.0 / size
        start += size
    generic = np.stack([random_distribution(rng, n) for _ in range(n)])
    return (1 - leak) * blocks + leak * (0.999 * uniform_attention(n) + 0.001 * generic)


def causal_uniform_attention(n: int) -> np.ndarray:
    """Row i spreads its mass evenly over keys 0..i: every causal row has normalised entropy 1."""
    return np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]


def with_garbage(
    attn: np.ndarray, key_mask: np.ndarray | None, query_mask: np.ndarray | None, rng: np.random.Generator
) -> np.ndarray:
    """``attn`` with arbitrary finite values in every masked entry, which a metric must never read."""
    garbage = attn.copy()
    n, m = attn.shape[-2:]
    keys = _broadcast_mask(key_mask, attn.shape[:-2], m)
    queries = _broadcast_mask(query_mask, attn.shape[:-2], n)
    hidden = ~(queries[..., :, None] & keys[..., None, :])
    garbage[hidden] = rng.uniform(0.0, 3.0, size=int(hidden.sum()))
    return garbage


@dataclass
class AttentionCase:
    """A named batch of attention matrices with the arguments ``attention_metrics`` should get."""

    name: str
    attn: np.ndarray
    key_mask: np.ndarray | None = None
    query_mask: np.ndarray | None = None
    causal: bool = False

    @property
    def kwargs(self) -> dict:
        return {"key_mask": self.key_mask, "query_mask": self.query_mask, "causal": self.causal}

    def reference(self) -> dict[str, np.ndarray]:
        return attention_reference_batch(self.attn, **self.kwargs)

    def element(self, index: tuple[int, ...]) -> AttentionCase:
        """The single matrix at batch ``index``, with its masks broadcast and selected to match."""
        batch_shape, (n, m) = self.attn.shape[:-2], self.attn.shape[-2:]
        return AttentionCase(
            f"{self.name}{list(index)}",
            self.attn[index],
            key_mask=_broadcast_mask(self.key_mask, batch_shape, m)[index],
            query_mask=_broadcast_mask(self.query_mask, batch_shape, n)[index],
            causal=self.causal,
        )

    def submatrix(self) -> np.ndarray:
        """The valid submatrix of a single-matrix case."""
        return valid_submatrix(self.attn, self.key_mask, self.query_mask)


def attention_cases() -> list[AttentionCase]:
    """Random, structured and adversarial batches: the catalogue's float64 reference cases."""
    rng = np.random.default_rng(20250101)
    cases = [
        AttentionCase(
            "softmax_heads",
            row_softmax(query_key_logits(rng, (2, 3, 12, 12)) * np.array([0.5, 1.0, 4.0])[:, None, None]),
        ),
        AttentionCase("cross_attention_wide", row_softmax(query_key_logits(rng, (3, 7, 13)))),
        AttentionCase("cross_attention_tall", row_softmax(query_key_logits(rng, (3, 13, 7)))),
        AttentionCase(
            "rank_one",
            np.stack([rank_one_attention(random_distribution(rng, 6), 6) for _ in range(2)]),
        ),
        AttentionCase("rank_one_rectangular", rank_one_attention(random_distribution(rng, 9), 5)[None]),
        AttentionCase("uniform", uniform_attention(8)[None]),
        AttentionCase("identity", np.eye(8)[None]),
        AttentionCase(
            "permutation",
            np.stack(
                [
                    permutation_attention([1, 2, 3, 4, 5, 6, 7, 0]),
                    permutation_attention([0, 2, 1, 4, 3, 5, 7, 6]),
                ]
            ),
        ),
        AttentionCase(
            "block_diagonal", np.stack([block_diagonal_attention(rng, [3, 5, 2]) for _ in range(2)])
        ),
        AttentionCase(
            "causal_softmax", row_softmax(query_key_logits(rng, (3, 10, 10)), causal=True), causal=True
        ),
        AttentionCase("causal_uniform", causal_uniform_attention(9)[None], causal=True),
        AttentionCase("near_degenerate", near_degenerate_attention(rng, [4, 6], leak=1e-7)[None]),
        AttentionCase("single_query_single_key", np.ones((2, 1, 1))),
        AttentionCase("single_query", row_softmax(query_key_logits(rng, (2, 1, 5)))),
        AttentionCase("single_key", np.ones((1, 4, 1))),
        AttentionCase("two_by_two", np.array([[[0.9, 0.1], [0.3, 0.7]], [[0.5, 0.5], [0.5, 0.5]]])),
        AttentionCase(
            # Logits so large that most probabilities underflow to exactly 0 and the rest round to 1.
            "saturated_softmax",
            row_softmax(query_key_logits(rng, (2, 9, 9)) * 200.0),
        ),
        AttentionCase(
            # Nearly all mass on key 0 (rank one by design) plus a little generic attention.
            "attention_sink",
            np.stack(
                [
                    (1 - eps) * rank_one_attention(np.eye(7)[0], 7)
                    + eps * np.stack([random_distribution(rng, 7) for _ in range(7)])
                    for eps in (1e-12, 1e-3)
                ]
            ),
        ),
    ]

    key_mask = rng.random((3, 11)) > 0.35
    key_mask[:, 0] = True
    keys_only = row_softmax(query_key_logits(rng, (3, 8, 11)), key_mask=key_mask)
    cases.append(
        AttentionCase("masked_keys", with_garbage(keys_only, key_mask, None, rng), key_mask=key_mask)
    )

    lengths = np.array([10, 7, 2, 1])
    padding = np.arange(10)[None, :] < lengths[:, None]
    padded = row_softmax(query_key_logits(rng, (4, 10, 10)), key_mask=padding)
    cases.append(
        AttentionCase(
            "padded_sequences",
            with_garbage(padded, padding, padding, rng),
            key_mask=padding,
            query_mask=padding,
        )
    )
    padded_causal = row_softmax(query_key_logits(rng, (4, 10, 10)), key_mask=padding, causal=True)
    cases.append(
        AttentionCase(
            "padded_causal",
            with_garbage(padded_causal, padding, padding, rng),
            key_mask=padding,
            query_mask=padding,
            causal=True,
        )
    )

    query_mask = np.array([True, False, True, True, False, True])
    cross_padded = row_softmax(query_key_logits(rng, (6, 9)))[None]
    cases.append(
        AttentionCase(
            "padded_queries_cross", with_garbage(cross_padded, None, query_mask, rng), query_mask=query_mask
        )
    )
    return cases


# --------------------------------------------------------------------------------------------------------
# Test support
# --------------------------------------------------------------------------------------------------------


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """One torch intra-op thread for the duration; results do not depend on it, wall time does.

    The Krylov path is many small batched operations; on a busy 2-core machine two intra-op threads wait
    for each other at every one of them, which made the Krylov tests 10-13× slower (382 s instead of 30 s).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


KRYLOV_ERANK_RTOL = 0.02
# The Krylov path against the float64 reference of its float32 input: (rtol, atol) per metric.
KRYLOV_TOLERANCE = {
    # One pass over A, nothing iterative: float32 accuracy.
    "entropy": (1e-5, 1e-5),
    "rank_one_residual": (1e-5, 1e-5),
    "self_attention": (1e-5, 1e-5),
    "sink_mass": (1e-5, 1e-5),
    "sink_mass_first": (1e-5, 1e-5),
    # σ₁, σ₂ by block Lanczos, and what follows from them.
    "sigma1": (1e-3, 0.0),
    "sigma2": (1e-3, 0.0),
    "stable_rank": (1e-3, 0.0),
    "spectral_gap": (0.0, 2e-3),
    # Stochastic Lanczos quadrature.
    "effective_rank": (KRYLOV_ERANK_RTOL, 0.0),
    "effective_rank_ratio": (KRYLOV_ERANK_RTOL, 0.0),
    # |λ₂| by block Arnoldi, to 0.01 in modulus.
    "eigen_gap": (0.0, 0.01),
}


def attention_probabilities(x_q, x_k, query, key, query_bias, key_bias, heads, causal=False):
    """softmax(q kᵀ/√d_k) per head from (out, in) projections: what the probe's split must reproduce."""
    q = (x_q @ query.T + query_bias).unflatten(-1, (heads, -1)).transpose(1, 2)
    k = (x_k @ key.T + key_bias).unflatten(-1, (heads, -1)).transpose(1, 2)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = logits.shape[-1]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1)
