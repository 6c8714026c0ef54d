"""The metric catalogue against float64 numpy references and closed forms.

Each attention, token and weight metric is compared, key by key, with an independent float64
reference (``reference_metrics``) on random, structured and adversarial batches; matrices with a known answer
pin the definitions down in closed form; the Krylov path is held to stated accuracies and to an honest
standard error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.reference_metrics import (
    ATTENTION_METRICS,
    KRYLOV_ERANK_RTOL,
    KRYLOV_TOLERANCE,
    TOKEN_METRICS,
    WEIGHT_METRICS,
    AttentionCase,
    attention_cases,
    attention_reference,
    attention_reference_batch,
    causal_uniform_attention,
    near_degenerate_attention,
    one_intra_op_thread,
    permutation_attention,
    query_key_logits,
    random_distribution,
    rank_one_attention,
    row_softmax,
    singular_values,
    threshold_rank_range,
    token_reference_batch,
    uniform_attention,
    weight_reference_batch,
    with_garbage,
)

from spectral_monitor.linalg.operators import DenseOperator, Passenger
from spectral_monitor.metrics import attention as attention_module
from spectral_monitor.metrics import (
    attention_krylov,
    attention_metrics,
    attention_metrics_from_qk,
    attention_passes,
    attention_rank_sums,
    token_metrics,
    weight_metrics,
)
from spectral_monitor.metrics._common import all_singular_values, nonfinite_matrices

CASES = attention_cases()
FLOAT64_TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}
FLOAT32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def as_tensor(array: np.ndarray | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    if array is None:
        return None
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if dtype is None else tensor.to(dtype)


def measure(case: AttentionCase, dtype: torch.dtype = torch.float64, **options) -> dict[str, np.ndarray]:
    """``attention_metrics`` of a case, as float64 arrays."""
    result = attention_metrics(
        as_tensor(case.attn, dtype),
        key_mask=as_tensor(case.key_mask),
        query_mask=as_tensor(case.query_mask),
        causal=case.causal,
        **options,
    )
    return {name: value.detach().to(torch.float64).numpy() for name, value in result.items()}


def assert_metrics_match(
    actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], label: str, rtol: float, atol: float
) -> None:
    missing = set(expected) - set(actual)
    assert not missing, f"{label}: metrics missing from the result: {sorted(missing)}"
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, f"{label}: {name} has shape {got.shape}, expected {want.shape}"
        np.testing.assert_allclose(
            got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{label}: {name}"
        )


def assert_float32_metrics_match(case: AttentionCase, dtype: torch.dtype) -> None:
    """``case`` (whose values ``dtype`` holds exactly) measured from ``dtype`` input, to float32 accuracy.

    The threshold rank is an integer: where a cumulative energy fraction lies within float32 rounding of
    0.99, either neighbour is right.
    """
    expected = case.reference()
    actual = measure(case, dtype, method="exact")
    got_ranks, want_ranks = actual.pop("threshold_rank"), expected.pop("threshold_rank")
    assert got_ranks.shape == want_ranks.shape
    for index in np.ndindex(want_ranks.shape):
        lowest, highest = threshold_rank_range(singular_values(case.element(index).submatrix()), slack=1e-5)
        assert lowest <= got_ranks[index] <= highest, f"{case.name}{list(index)}: threshold_rank"
    assert_metrics_match(actual, expected, f"{case.name} from {dtype}", **FLOAT32_TOLERANCE)


def rounded_to(case: AttentionCase, dtype: torch.dtype) -> AttentionCase:
    """The same case with its values rounded to ``dtype`` (and held in float64 for the reference)."""
    rounded = as_tensor(case.attn, dtype).to(torch.float64).numpy()
    return AttentionCase(case.name, rounded, case.key_mask, case.query_mask, case.causal)


# --------------------------------------------------------------------------------------------------------
# Every key against the float64 reference
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_exact_attention_metrics_match_the_float64_reference(case: AttentionCase) -> None:
    actual = measure(case, method="exact")
    assert set(ATTENTION_METRICS) | {"nonfinite"} <= set(actual)
    assert not actual["nonfinite"].any()
    assert_metrics_match(actual, case.reference(), case.name, **FLOAT64_TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_float32_attention_is_measured_to_float32_accuracy(case: AttentionCase) -> None:
    assert_float32_metrics_match(rounded_to(case, torch.float32), torch.float32)


@pytest.mark.parametrize(
    "shape", [(6, 40, 40), (6, 30, 50), (6, 50, 30), (2, 256, 256), (2, 200, 300), (2, 300, 200)]
)
def test_singular_values_of_float32_matrices_are_found_to_float32_rounding_of_sigma1(
    shape: tuple[int, int, int],
) -> None:
    # Singular values from 1 down to 1e-7: float32 svdvals misses them by 1.2e-7–2.4e-7 here, twice its
    # rounding of σ₁ = 1 (6e-8); the float64 Gram route stays within that rounding, by either LAPACK (from
    # 192 rows numpy's OpenBLAS where torch's MKL runs its generic path).
    generator = torch.Generator().manual_seed(sum(shape))
    batch, rows, cols = shape
    k = min(rows, cols)
    left, _ = torch.linalg.qr(torch.randn(batch, rows, k, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(batch, cols, k, generator=generator, dtype=torch.float64))
    matrices = ((left * torch.logspace(0, -7, k, dtype=torch.float64)) @ right.transpose(1, 2)).float()
    truth = torch.linalg.svdvals(matrices.double())
    found = all_singular_values(matrices)
    assert found.dtype == torch.float32
    assert (found.double() - truth).abs().max() <= 7e-8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_measured_in_at_least_float32(dtype: torch.dtype) -> None:
    case = next(case for case in CASES if case.name == "padded_sequences")
    assert_float32_metrics_match(rounded_to(case, dtype), dtype)


def test_auto_method_is_exact_for_small_matrices() -> None:
    case = next(case for case in CASES if case.name == "softmax_heads")
    assert_metrics_match(measure(case, method="auto"), case.reference(), "auto", **FLOAT64_TOLERANCE)


def test_key_mask_broadcasts_over_heads() -> None:
    rng = np.random.default_rng(7)
    key_mask = rng.random((2, 1, 9)) > 0.3
    key_mask[..., 0] = True
    attn = row_softmax(query_key_logits(rng, (2, 3, 9, 9)), key_mask=key_mask)
    attn = with_garbage(attn, key_mask, None, rng)
    case = AttentionCase("heads_share_a_key_mask", attn, key_mask=key_mask)
    assert_metrics_match(measure(case, method="exact"), case.reference(), case.name, **FLOAT64_TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_one_pass_members_summed_over_blocks_of_rows_match_the_reference(
    case: AttentionCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 3 rows of one matrix, as for matrices larger than a cache-sized block (n > 1024 in float32).
    monkeypatch.setattr(attention_module, "ONE_PASS_CHUNK_BYTES", 3 * 8 * case.attn.shape[-1])
    assert_metrics_match(measure(case, method="exact"), case.reference(), case.name, **FLOAT64_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax_heads", "padded_sequences", "padded_queries_cross"])
def test_the_dobrushin_estimate_over_blocks_of_rows_matches_the_estimate_over_whole_matrices(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = next(case for case in CASES if case.name == name)
    monkeypatch.setattr(attention_module, "DOBRUSHIN_EXACT_MAX_ROWS", 0)  # the estimate at every size
    whole = measure(case, method="krylov")["dobrushin"]
    monkeypatch.setattr(attention_module, "ONE_PASS_CHUNK_BYTES", 2 * 8 * case.attn.shape[-1])
    blocked = measure(case, method="krylov")["dobrushin"]
    np.testing.assert_allclose(blocked, whole, rtol=1e-12, atol=0)
    exact = case.reference()["dobrushin"]
    assert np.all(blocked <= exact + 1e-12) and np.all(blocked >= exact / 2 - 1e-12)


# --------------------------------------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------------------------------------


def closed_form(attn: np.ndarray, **options) -> dict[str, float]:
    """``attention_metrics`` of one float64 matrix, exactly, as Python floats."""
    return as_floats(attention_metrics(as_tensor(attn), method="exact", **options))


def as_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}


def test_the_dobrushin_estimate_may_miss_the_farthest_pair_but_never_by_more_than_half() -> None:
    # The farthest pair is c = e₀, d = e₁ (τ = 1), near the mean row, which the many rows a = (e₀ + e₁)/2
    # hold in place; the 8 rows oₖ = 0.6 eₖ + 0.2 (e₀ + e₁) are farther from it (1.2 against 1.0), so they
    # are the anchors, and the farthest row from any of them is 1.6 away: L = 0.8.
    keys = 2 + attention_passes.DOBRUSHIN_ANCHORS
    c, d, a = np.eye(keys)[0], np.eye(keys)[1], (np.eye(keys)[0] + np.eye(keys)[1]) / 2
    outliers = [0.6 * np.eye(keys)[k] + 0.4 * a for k in range(2, keys)]
    attn = as_tensor(np.array([c, d, *outliers] + [a] * attention_module.DOBRUSHIN_EXACT_MAX_ROWS))
    estimate = float(attention_metrics(attn, method="auto")["dobrushin"])
    exact = float(attention_metrics(attn, method="exact")["dobrushin"])
    assert exact == pytest.approx(1.0, abs=1e-12)
    assert estimate == pytest.approx(0.8, abs=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sharpness", [0.05, 1.0, 10.0])
def test_the_dobrushin_estimate_of_softmax_attention_lies_within_its_stated_bounds(
    sharpness: float, causal: bool
) -> None:
    n = 4 * attention_module.DOBRUSHIN_EXACT_MAX_ROWS
    logits = sharpness * np.random.default_rng(7).standard_normal((6, n, n))
    if causal:
        logits = np.where(np.tril(np.ones((n, n))) > 0, logits, -np.inf)
    attn = torch.from_numpy(row_softmax(logits))
    estimate = attention_metrics(attn, causal=causal, method="auto")["dobrushin"].numpy()
    exact = np.array([attention_reference(matrix, causal=causal)["dobrushin"] for matrix in attn.numpy()])
    assert np.all(estimate <= exact * (1 + 1e-12)) and np.all(estimate >= exact / 2)


@pytest.mark.slow
def test_near_uniform_causal_attention_of_a_fresh_model_gets_the_exact_effective_rank_at_512_tokens() -> None:
    # q and k of standard deviation 0.1, as a freshly initialised model gives: attention close to the causal
    # uniform matrix, whose tail of small singular values the rank-sum quadrature reads low.
    n = 512
    rng = np.random.default_rng(3)
    logits = query_key_logits(rng, (2, n, n)) * 0.01
    attn = torch.from_numpy(row_softmax(np.where(np.tril(np.ones((n, n))) > 0, logits, -np.inf)))
    metrics = attention_metrics(attn.float(), causal=True)
    expected = [attention_reference(matrix, causal=True)["effective_rank"] for matrix in attn.numpy()]
    np.testing.assert_allclose(metrics["effective_rank"].double().numpy(), expected, rtol=1e-5)
    assert (metrics["effective_rank_se"] == 0).all()


def test_bidirectional_attention_up_to_the_factorise_first_size_gets_exact_rank_sums_without_quadrature(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Past EXACT_MAX_SIZE bidirectional attention takes the Krylov path for σ₁, σ₂ and the eigen gap; up to
    # FACTORISE_FIRST_MAX_SIZE its rank sums are factorised at once: on near-uniform attention (a fresh
    # model's) two quadrature rounds had cost six factorisations before falling back to one.
    n = attention_module.EXACT_MAX_SIZE + 16
    assert n <= attention_rank_sums.FACTORISE_FIRST_MAX_SIZE
    assert not attention_module.uses_exact_path(n, n, "auto")

    def no_quadrature(*args: object, **kwargs: object) -> None:
        raise AssertionError("the rank sums ran the quadrature")

    monkeypatch.setattr(attention_rank_sums, "_quadrature_rank_sums", no_quadrature)
    rng = np.random.default_rng(7)
    near_uniform = row_softmax(query_key_logits(rng, (1, n, n)) * 0.01)
    sharp = row_softmax(query_key_logits(rng, (1, n, n)) * 9.0)
    attn = np.concatenate([near_uniform, sharp])
    metrics = attention_metrics(
        torch.from_numpy(attn).float(), return_spectra=True, generator=torch.Generator().manual_seed(0)
    )
    expected = [attention_reference(matrix) for matrix in attn]
    for name in ("effective_rank", "threshold_rank"):
        np.testing.assert_allclose(
            metrics[name].double().numpy(), [reference[name] for reference in expected], rtol=1e-5
        )
    assert (metrics["effective_rank_se"] == 0).all()
    # The singular values factorised for them are handed on, so head diversity need not factorise again.
    np.testing.assert_allclose(
        metrics["singular_values"].double().numpy(), np.linalg.svd(attn, compute_uv=False), atol=1e-7
    )


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_near_uniform_attention_past_the_exact_sizes_is_resolved_by_the_deflated_quadrature(
    causal: bool, deflated_pairs: list[list[int]]
) -> None:
    # Past the sizes that are factorised outright the Krylov path's quadrature runs. On near-uniform
    # attention (a fresh model's) the quadrature with only the top pair deflated missed its target (causal:
    # 12-21% low) and the matrix was factorised after two rounds; with the leading Ritz pairs deflated it
    # reaches its target in one round, within its standard error, while sharp attention, whose Ritz pairs
    # are not accurate enough to deflate, keeps the plain quadrature.
    if causal:
        n = attention_module.EXACT_MAX_SIZE_WITHOUT_EIGEN_GAP + 16
    else:
        n = attention_rank_sums.FACTORISE_FIRST_MAX_SIZE + 128
    rng = np.random.default_rng(5)
    mask = np.tril(np.ones((n, n))) > 0 if causal else np.ones((n, n)) > 0
    # logits of standard deviation 0.1, as a freshly initialised model's
    near_uniform = row_softmax(np.where(mask, query_key_logits(rng, (1, n, n)) * 0.1, -np.inf))
    sharp = row_softmax(np.where(mask, query_key_logits(rng, (1, n, n)) * 9.0, -np.inf))
    attn = torch.from_numpy(np.concatenate([near_uniform, sharp]))
    assert not attention_module.uses_exact_path(n, n, "auto", causal=causal)
    metrics = attention_metrics(attn.float(), causal=causal, generator=torch.Generator().manual_seed(0))
    expected = np.array(
        [attention_reference(matrix, causal=causal)["effective_rank"] for matrix in attn.numpy()]
    )
    assert deflated_pairs == [[attention_rank_sums.DEFLATION_WIDTH, 0]]
    estimate, se = metrics["effective_rank"].double().numpy(), metrics["effective_rank_se"].double().numpy()
    assert (se > 0).all() and (se <= attention_rank_sums.ERANK_TARGET_RSE * estimate).all()
    # The sharp head keeps the plain quadrature, which documents larger misses (4 se, as before).
    assert (np.abs(estimate - expected) <= np.array([3, 4]) * se).all(), (estimate, expected, se)


def test_an_operator_that_cannot_be_restricted_gets_every_elements_rank_sums_in_one_group() -> None:
    # Elements deflating different numbers of Ritz pairs run in separate groups on restricted operators;
    # an operator without `restrict` runs them together at the smallest number, and still within 3 se.
    class Unrestricted(DenseOperator):
        def restrict(self, index: torch.Tensor) -> None:
            return None

    n = 640
    rng = np.random.default_rng(5)
    near_uniform = row_softmax(query_key_logits(rng, (1, n, n)) * 0.1)
    sharp = row_softmax(query_key_logits(rng, (1, n, n)) * 9.0)
    attn = torch.from_numpy(np.concatenate([near_uniform, sharp])).float()
    top = torch.linalg.svd(attn.double())
    frobenius_squared = attn.square().sum(dim=(1, 2))
    estimates = [
        attention_rank_sums.rank_sums(
            operator(attn),
            top.Vh[:, :2].mT.float(),
            top.S[:, :2].float(),
            frobenius_squared,
            torch.Generator().manual_seed(0),
        )  # fmt: skip
        for operator in (DenseOperator, Unrestricted)
    ]
    expected = np.array([attention_reference(matrix)["effective_rank"] for matrix in attn.double().numpy()])
    for estimate in estimates:
        value, se = (
            estimate["effective_rank"].double().numpy(),
            estimate["effective_rank_se"].double().numpy(),
        )
        assert (se > 0).all() and (np.abs(value - expected) <= np.array([3, 4]) * se).all(), (value, se)
    # The near-uniform head deflated 64 pairs on its own, none in the shared group: another estimate.
    assert estimates[0]["effective_rank"][0] != estimates[1]["effective_rank"][0]


def test_a_tail_beneath_float32_rounding_is_factorised_not_estimated() -> None:
    # Logits of standard deviation 0.01: below σ₃ ≈ 2e-3 every singular value is under 1e-5, and float32
    # products of the deflated Gram operator round at about ε·σ₁σ₃, as large as their squares: the deflated
    # quadrature read the effective rank 0.85% low at a standard error of 0.1% (float64 products were
    # right), so such a dense element is factorised.
    n = attention_rank_sums.FACTORISE_FIRST_MAX_SIZE + 128
    attn = row_softmax(query_key_logits(np.random.default_rng(5), (1, n, n)) * 0.01)
    metrics = attention_metrics(torch.from_numpy(attn).float(), generator=torch.Generator().manual_seed(0))
    expected = attention_reference(attn[0])["effective_rank"]
    np.testing.assert_allclose(metrics["effective_rank"].double().item(), expected, rtol=1e-5)
    assert metrics["effective_rank_se"].item() == 0


@pytest.mark.parametrize("n", [2, 5, 16])
def test_uniform_attention_is_rank_one_with_full_entropy(n: int) -> None:
    metrics = closed_form(uniform_attention(n))
    expected = {
        "effective_rank": 1.0,
        "stable_rank": 1.0,
        "rank_one_residual": 0.0,
        "entropy": 1.0,
        "spectral_gap": 1.0,
        "dobrushin": 0.0,
        "sigma1": 1.0,
        "sigma2": 0.0,
        "eigen_gap": 1.0,
        "threshold_rank": 1.0,
        "effective_rank_ratio": 1.0 / n,
        "self_attention": 1.0 / n,
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name


@pytest.mark.parametrize("n", [2, 5, 16])
def test_identity_attention_has_full_rank_zero_entropy_and_no_mixing(n: int) -> None:
    metrics = closed_form(np.eye(n))
    expected = {
        "effective_rank": n,
        "stable_rank": n,
        "effective_rank_ratio": 1.0,
        "threshold_rank": n,
        "entropy": 0.0,
        "dobrushin": 1.0,
        "self_attention": 1.0,
        "sigma1": 1.0,
        "sigma2": 1.0,
        "spectral_gap": 0.0,
        "eigen_gap": 0.0,
        "rank_one_residual": math.sqrt((n - 1) / n),
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name


@pytest.mark.parametrize("permutation", [[1, 2, 3, 4, 0], [0, 2, 1, 4, 3, 5]])
def test_permutation_attention_has_the_spectra_of_the_identity(permutation: list[int]) -> None:
    n = len(permutation)
    metrics = closed_form(permutation_attention(permutation))
    identity = closed_form(np.eye(n))
    for name in (
        "sigma1",
        "sigma2",
        "spectral_gap",
        "stable_rank",
        "effective_rank",
        "threshold_rank",
        "entropy",
        "dobrushin",
        "rank_one_residual",
    ):
        assert metrics[name] == pytest.approx(identity[name], abs=1e-12), name
    # Its eigenvalues are roots of unity, all of modulus one; its diagonal holds its fixed points.
    assert metrics["eigen_gap"] == pytest.approx(0.0, abs=1e-12)
    fixed_points = sum(i == j for i, j in enumerate(permutation))
    assert metrics["self_attention"] == pytest.approx(fixed_points / n, abs=1e-15)


def test_rank_one_attention_has_one_singular_value_and_identical_rows() -> None:
    row = random_distribution(np.random.default_rng(3), 9)
    n = 6
    metrics = closed_form(rank_one_attention(row, n))
    entropy = -np.sum(row * np.log(row)) / np.log(row.size)
    expected = {
        "sigma1": math.sqrt(n) * np.linalg.norm(row),
        "sigma2": 0.0,
        "spectral_gap": 1.0,
        "stable_rank": 1.0,
        "effective_rank": 1.0,
        "threshold_rank": 1.0,
        "rank_one_residual": 0.0,
        "dobrushin": 0.0,
        "entropy": entropy,
        "effective_rank_ratio": 1.0 / n,
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name
    assert math.isnan(metrics["eigen_gap"]) and math.isnan(metrics["self_attention"])


@pytest.mark.parametrize("mass", [0.96, 0.97, 0.98, 0.99])
def test_square_rank_one_attention_on_one_key_has_eigen_gap_one(mass: float) -> None:
    # Every query sends `mass` to key 0 and spreads the rest: A = 1 rᵀ, eigenvalues 1 and n - 1 zeros.
    # LAPACK's QR iteration fails to converge on some of these matrices on some CPUs.
    n = 64
    row = np.full(n, (1 - mass) / (n - 1))
    row[0] = mass
    metrics = closed_form(rank_one_attention(row, n))
    assert metrics["eigen_gap"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["self_attention"] == pytest.approx((mass + (n - 1) * row[1]) / n, abs=1e-15)


def test_eigenvalues_that_lapack_cannot_find_are_found_after_a_similarity(monkeypatch) -> None:
    rng = np.random.default_rng(4)
    matrices = torch.from_numpy(row_softmax(query_key_logits(rng, (3, 12, 12), d=4)))
    expected = torch.linalg.eigvals(matrices).abs().sort(dim=1).values
    eigvals = torch.linalg.eigvals

    def fails_on_batches(matrix: torch.Tensor) -> torch.Tensor:
        if matrix.dim() > 2:
            raise torch.linalg.LinAlgError("failed to converge")
        return eigvals(matrix)

    monkeypatch.setattr(torch.linalg, "eigvals", fails_on_batches)
    found = attention_module._eigenvalues(matrices).abs().sort(dim=1).values
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-13)


@pytest.mark.parametrize(("a", "b"), [(0.9, 0.3), (0.2, 0.6), (0.5, 0.5), (1.0, 0.0)])
def test_two_by_two_eigen_gap_is_one_minus_the_dobrushin_coefficient(a: float, b: float) -> None:
    # [[a, 1-a], [b, 1-b]] has eigenvalues 1 and a - b, and its rows differ by |a - b| in each entry.
    metrics = closed_form(np.array([[a, 1 - a], [b, 1 - b]]))
    assert metrics["dobrushin"] == pytest.approx(abs(a - b), abs=1e-14)
    assert metrics["eigen_gap"] == pytest.approx(1 - abs(a - b), abs=1e-14)
    assert metrics["self_attention"] == pytest.approx((a + 1 - b) / 2, abs=1e-15)


def test_near_degenerate_top_singular_values_are_resolved() -> None:
    leak = 1e-7
    attn = near_degenerate_attention(np.random.default_rng(5), [4, 6], leak=leak)
    metrics = closed_form(attn)
    assert metrics["sigma1"] == pytest.approx(1.0, abs=1e-9)
    assert metrics["sigma2"] == pytest.approx(1.0 - leak, abs=1e-9)
    assert metrics["eigen_gap"] == pytest.approx(leak, rel=1e-3)
    assert metrics["spectral_gap"] == pytest.approx(
        1.0 - singular_values(attn)[1] / singular_values(attn)[0], abs=1e-12
    )


def test_causal_entropy_normalises_each_row_by_its_own_number_of_keys() -> None:
    n = 9
    attn = causal_uniform_attention(n)
    causal = closed_form(attn, causal=True)
    assert causal["entropy"] == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(causal["eigen_gap"])
    # Read without the causal flag, every row has n keys, and row i spreads over i + 1 of them.
    plain = closed_form(attn)
    assert plain["entropy"] == pytest.approx(np.mean(np.log(np.arange(1, n + 1))) / np.log(n), abs=1e-12)
    assert causal["self_attention"] == pytest.approx(np.mean(1.0 / np.arange(1, n + 1)), abs=1e-12)


def test_rows_with_fewer_than_two_keys_are_left_out_of_the_entropy() -> None:
    # A causal 2x2 matrix: row 0 sees one key and is left out, so the entropy is row 1's alone.
    two_rows = closed_form(np.array([[1.0, 0.0], [0.25, 0.75]]), causal=True)
    row_one = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)) / math.log(2)
    assert two_rows["entropy"] == pytest.approx(row_one, abs=1e-12)

    single_key = np.zeros((3, 4))
    single_key[:, 2] = 1.0
    only_key_two = torch.tensor([False, False, True, False])
    assert math.isnan(closed_form(single_key, key_mask=only_key_two)["entropy"])
    assert math.isnan(closed_form(np.ones((1, 1)))["entropy"])


def test_eigen_gap_and_self_attention_need_a_square_matrix() -> None:
    metrics = closed_form(row_softmax(query_key_logits(np.random.default_rng(1), (4, 7))))
    assert math.isnan(metrics["eigen_gap"]) and math.isnan(metrics["self_attention"])
    assert not math.isnan(metrics["sigma2"])


def test_single_matrix_gives_scalar_metrics() -> None:
    result = attention_metrics(torch.from_numpy(uniform_attention(4)), method="exact")
    assert all(value.shape == () for value in result.values())


# --------------------------------------------------------------------------------------------------------
# Token and weight metrics
# --------------------------------------------------------------------------------------------------------


def test_token_metrics_match_the_float64_reference() -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 10, 6)) + rng.standard_normal((2, 3, 1, 6))
    token_mask = np.arange(10)[None, None, :] < np.array([[10, 6, 3], [2, 9, 10]])[:, :, None]
    x[~token_mask] = 1e3  # padding must never be read
    expected = token_reference_batch(x, token_mask=token_mask)
    result = token_metrics(as_tensor(x), token_mask=as_tensor(token_mask))
    actual = {name: value.to(torch.float64).numpy() for name, value in result.items()}
    assert set(TOKEN_METRICS) <= set(actual)
    assert_metrics_match(actual, expected, "tokens", **FLOAT64_TOLERANCE)


def test_identical_tokens_are_fully_collapsed() -> None:
    token = np.random.default_rng(2).standard_normal(5)
    metrics = as_floats(token_metrics(as_tensor(np.tile(token, (7, 1)))))
    expected = {"cosine_similarity": 1.0, "token_residual": 0.0, "stable_rank": 1.0, "effective_rank": 1.0}
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-10), name


def test_orthonormal_tokens_are_uncorrelated_and_full_rank() -> None:
    n = 6
    orthonormal, _ = np.linalg.qr(np.random.default_rng(4).standard_normal((10, n)))
    metrics = as_floats(token_metrics(as_tensor(orthonormal.T)))
    expected = {
        "cosine_similarity": 0.0,
        "token_residual": math.sqrt((n - 1) / n),
        "stable_rank": n,
        "effective_rank": n,
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-10), name


def test_antipodal_tokens_have_cosine_similarity_minus_one() -> None:
    token = np.random.default_rng(6).standard_normal(4)
    metrics = token_metrics(as_tensor(np.stack([token, -3.0 * token])))
    assert float(metrics["cosine_similarity"]) == pytest.approx(-1.0, abs=1e-12)


def planted_spike_weights(rng: np.random.Generator) -> np.ndarray:
    """Gaussian noise (below the Marchenko–Pastur edge) with 0, 1 and 3 planted rank-one spikes."""
    rows, cols = 120, 60
    weights = rng.standard_normal((3, rows, cols)) / math.sqrt(cols)
    for element, spikes in enumerate([0, 1, 3]):
        for strength in (6.0, 8.0, 10.0)[:spikes]:
            u, v = rng.standard_normal(rows), rng.standard_normal(cols)
            weights[element] += strength * np.outer(u / np.linalg.norm(u), v / np.linalg.norm(v))
    return weights


def test_exact_weight_metrics_match_the_float64_reference() -> None:
    weights = planted_spike_weights(np.random.default_rng(8))
    expected = weight_reference_batch(weights)
    result = weight_metrics(as_tensor(weights), method="exact")
    actual = {name: value.to(torch.float64).numpy() for name, value in result.items()}
    assert set(WEIGHT_METRICS) <= set(actual)
    assert_metrics_match(actual, expected, "weights", **FLOAT64_TOLERANCE)
    # The MP edge separates the planted spikes from the bulk.
    np.testing.assert_array_equal(actual["mp_spikes"], [0, 1, 3])


@pytest.mark.parametrize("method", ["auto", "krylov"])
def test_weight_spectral_norm_is_found_without_a_full_svd(method: str) -> None:
    weights = planted_spike_weights(np.random.default_rng(9))[1:]  # σ₂/σ₁ ≈ 0.4 and 0.8
    expected = weight_reference_batch(weights)
    result = weight_metrics(as_tensor(weights), method=method)
    for name in ("spectral_norm", "frobenius_norm", "stable_rank"):
        np.testing.assert_allclose(
            result[name].to(torch.float64).numpy(), expected[name], rtol=1e-3, err_msg=name
        )


def test_orthogonal_weight_lies_below_its_bulk_edge() -> None:
    n = 16
    orthogonal, _ = np.linalg.qr(np.random.default_rng(10).standard_normal((n, n)))
    metrics = as_floats(weight_metrics(as_tensor(orthogonal), method="exact"))
    # σ̂ = 1/√n, so the edge is (1/√n)(√n + √n) = 2: every singular value (1) lies below it.
    expected = {
        "spectral_norm": 1.0,
        "frobenius_norm": math.sqrt(n),
        "stable_rank": n,
        "mp_edge": 2.0,
        "mp_spikes": 0.0,
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-12), name


def test_rank_one_weight_is_one_spike() -> None:
    rng = np.random.default_rng(12)
    u, v = rng.standard_normal(20), rng.standard_normal(12)
    weight = 2.5 * np.outer(u / np.linalg.norm(u), v / np.linalg.norm(v))
    metrics = as_floats(weight_metrics(as_tensor(weight), method="exact"))
    assert metrics["spectral_norm"] == pytest.approx(2.5, abs=1e-12)
    assert metrics["frobenius_norm"] == pytest.approx(2.5, abs=1e-12)
    assert metrics["stable_rank"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["mp_edge"] == pytest.approx(2.5 * (1 / math.sqrt(12) + 1 / math.sqrt(20)), abs=1e-12)
    assert metrics["mp_spikes"] == 1.0


# --------------------------------------------------------------------------------------------------------
# The Krylov path: accuracy and an honest standard error
# --------------------------------------------------------------------------------------------------------


def softmax_attention(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """float32-representable softmax(QKᵀ/√d) of Gaussian q, k with d = 64 (scaled logits sharpen it)."""
    attn = row_softmax(query_key_logits(np.random.default_rng(seed), shape) * scale)
    return attn.astype(np.float32).astype(np.float64)


def structured_attention(kind: str, n: int, seed: int) -> AttentionCase:
    rng = np.random.default_rng(seed)
    logits = query_key_logits(rng, (1, n, n))
    if kind == "attention_sink":
        logits[..., 0] += 6.0
        return AttentionCase(kind, row_softmax(logits))
    if kind == "causal":
        return AttentionCase(kind, row_softmax(logits, causal=True), causal=True)
    if kind == "local_band":
        distance = np.arange(n)[:, None] - np.arange(n)[None, :]
        return AttentionCase(kind, row_softmax(0.3 * logits - distance**2 / 8.0))
    if kind == "padded":
        padding = (np.arange(n) < int(0.8 * n))[None, :]
        attn = with_garbage(row_softmax(logits, key_mask=padding), padding, padding, rng)
        return AttentionCase(kind, attn, key_mask=padding, query_mask=padding)
    raise AssertionError(kind)


def float32_case(case: AttentionCase) -> AttentionCase:
    return AttentionCase(
        case.name,
        case.attn.astype(np.float32).astype(np.float64),
        case.key_mask,
        case.query_mask,
        case.causal,
    )


def assert_krylov_accuracy(case: AttentionCase, seed: int) -> None:
    """Every metric within ``KRYLOV_TOLERANCE``, and an effective-rank standard error that promises 2% at 95%.

    One seed landing within 2% could be luck; 2·se ≤ 2% says the estimator is within 2% 95% of the time.
    The Dobrushin coefficient may be the documented estimate above a row count: at most the true value and
    at least half of it. The threshold rank is exact or NaN (at the 99% level it sits in the dense low end of
    the spectrum, where a stochastic density cannot count), and exact whenever σ₁ and σ₂ carry 99% of
    ‖A‖_F² — the collapse regime it is there for.
    """
    expected = case.reference()
    with one_intra_op_thread():
        actual = measure(case, torch.float32, method="krylov", generator=torch.Generator().manual_seed(seed))
    assert not actual["nonfinite"].any()
    # Every miss is listed, so one broken metric does not hide another.
    misses = [
        f"{name}: {actual[name]} vs {expected[name]} (rtol {rtol}, atol {atol})"
        for name, (rtol, atol) in KRYLOV_TOLERANCE.items()
        if not np.allclose(actual[name], expected[name], rtol=rtol, atol=atol, equal_nan=True)
    ]
    threshold, true_threshold = actual["threshold_rank"], expected["threshold_rank"]
    if not ((threshold == true_threshold) | (np.isnan(threshold) & (true_threshold > 2))).all():
        misses.append(f"threshold_rank: {threshold} is neither {true_threshold} nor an unresolved NaN")
    dobrushin, true_dobrushin = actual["dobrushin"], expected["dobrushin"]
    if not ((true_dobrushin / 2 <= dobrushin) & (dobrushin <= true_dobrushin * (1 + 1e-5))).all():
        misses.append(f"dobrushin: {dobrushin} outside [τ/2, τ] for τ = {true_dobrushin}")
    standard_error, estimate = actual["effective_rank_se"], actual["effective_rank"]
    if not ((standard_error >= 0) & (2 * standard_error <= KRYLOV_ERANK_RTOL * estimate)).all():
        misses.append(f"effective_rank_se: 2·se = {2 * standard_error} is not within 2% of {estimate}")
    assert not misses, f"{case.name}:\n" + "\n".join(misses)


@pytest.mark.parametrize("n", [256, pytest.param(512, marks=pytest.mark.slow)])
@pytest.mark.usefixtures("rank_sums_by_quadrature")
def test_krylov_estimates_of_softmax_attention_are_accurate(n: int) -> None:
    case = AttentionCase(f"softmax_{n}", softmax_attention(seed=n, shape=(2, n, n)))
    assert_krylov_accuracy(case, seed=0)


@pytest.mark.slow
def test_the_krylov_eigen_gap_of_sharpened_softmax_attention_is_within_0_02() -> None:
    # Logits ×2 put |λ₂| (≈ 0.17) inside the edge of a non-symmetric bulk, where a Krylov space of too low
    # a degree falls short of it: 6 Arnoldi blocks of 16 were 0.028 off here, 12 blocks of 4 are 0.011 off.
    n = 1024
    case = AttentionCase("sharpened_softmax", softmax_attention(seed=7, shape=(1, n, n), scale=2.0))
    expected = case.reference()
    with one_intra_op_thread():
        actual = measure(case, torch.float32, method="krylov", generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(actual["eigen_gap"], expected["eigen_gap"], rtol=0, atol=0.02)
    np.testing.assert_allclose(actual["sigma2"], expected["sigma2"], rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mix", "by_difference"), [(0.02, [False, False]), (0.156, [True, False]), (0.3, [True, True])]
)
def test_the_rank_one_residual_is_float32_accurate_either_side_of_where_a_second_pass_takes_over(
    mix: float, by_difference: list[bool]
) -> None:
    """Softmax attention mixed into uniform attention: rank-one residuals of 0.026 (from a second pass over
    the centred rows), 0.201 and 0.197 (either side of the threshold, where the difference's rounding is
    worst) and 0.36 (from ‖A‖_F² − n‖ā‖²)."""
    n = 400
    case = AttentionCase(f"mixed_{mix}", (1 - mix) / n + mix * softmax_attention(seed=3, shape=(2, n, n)))
    expected = case.reference()["rank_one_residual"]
    actual = measure(case, torch.float32, method="krylov", include_rank_sums=False)["rank_one_residual"]
    assert (expected**2 >= attention_passes.CENTRED_BY_DIFFERENCE_MIN).tolist() == by_difference
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_the_sums_behind_the_rank_one_residual_stay_float32_accurate_on_long_rows() -> None:
    """At n = 2048 an attention sink puts most of ‖A‖_F² in one column: MKL's AVX2 path summed the flattened
    matrix's squares 1e-4 off, the residual (0.62, from ‖A‖_F² − n‖ā‖²) then 6e-5 off."""
    case = float32_case(structured_attention("attention_sink", 2048, seed=5))
    centred = case.attn - case.attn.mean(axis=1, keepdims=True)
    expected = np.linalg.norm(centred, axis=(1, 2)) / np.linalg.norm(case.attn, axis=(1, 2))
    actual = measure(case, torch.float32, method="krylov", include_rank_sums=False)["rank_one_residual"]
    assert (expected**2 >= attention_passes.CENTRED_BY_DIFFERENCE_MIN).all()
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mix", [0.02, 0.3])
def test_padded_queries_leave_the_rank_one_residual_exact_by_either_way(mix: float) -> None:
    """Padded queries are zero rows that the mean row must not be subtracted from, in the second pass
    (residual 0.026) as in the difference of sums (0.36)."""
    n = 400
    query_mask = np.ones((2, n), dtype=bool)
    query_mask[:, 300:] = False
    attn = (1 - mix) / n + mix * softmax_attention(seed=4, shape=(2, n, n))
    case = AttentionCase(f"padded_mixed_{mix}", attn, query_mask=query_mask)
    expected = case.reference()["rank_one_residual"]
    actual = measure(case, torch.float32, method="krylov", include_rank_sums=False)["rank_one_residual"]
    assert (expected**2 >= attention_passes.CENTRED_BY_DIFFERENCE_MIN).all() == (mix > 0.1)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=0)


def test_the_arnoldi_riding_in_the_lanczos_sweeps_finds_what_it_finds_alone() -> None:
    """The |λ₂| iteration takes its products from the σ Lanczos sweeps while both run, then its own; both
    stop elements at different blocks, so the products change hands mid-batch. Sharing must not change what
    it computes beyond float32 rounding."""
    attn = as_tensor(softmax_attention(seed=5, shape=(6, 400, 400)), torch.float32)
    attn[1] = torch.softmax(4 * torch.log(attn[1]), dim=-1)  # sharper: σ and |λ₂| converge at other blocks
    queries = torch.ones(6, 400, dtype=torch.bool)
    with one_intra_op_thread():
        riding = attention_metrics(
            attn, method="krylov", include_rank_sums=False, generator=torch.Generator().manual_seed(0)
        )["eigen_gap"]
        _, arnoldi_draws, _ = attention_krylov._independent_generators(torch.Generator().manual_seed(0), 3)
        alone = Passenger(
            attention_krylov._second_eigenvalue_modulus(DenseOperator(attn), queries, arnoldi_draws)
        ).finish()
    torch.testing.assert_close(riding, 1 - alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["attention_sink", "causal", "local_band", "padded"])
@pytest.mark.usefixtures("rank_sums_by_quadrature")
def test_krylov_estimates_of_structured_attention_are_accurate(kind: str) -> None:
    assert_krylov_accuracy(float32_case(structured_attention(kind, 256, seed=31)), seed=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigma2_next_to_an_attention_sink_is_resolved_to_its_own_accuracy(seed: int) -> None:
    """A sink makes σ₁ 22× σ₂ here: an error judged against σ₁² left σ₂ 9.2e-4 off for one of these seeds;
    judged against σ₂² it is at most 2.3e-4 off from a cold start at ``SINGULAR_TOL`` = 1e-3."""
    case = structured_attention("attention_sink", 256, seed=seed)
    expected = case.reference()
    with one_intra_op_thread():
        actual = measure(case, torch.float32, method="krylov", generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(actual["sigma2"], expected["sigma2"], rtol=4e-4)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_sigma2_a_thousand_times_below_a_sink_is_resolved_dense_and_blockwise(causal: bool) -> None:
    """σ₂/σ₁ of 1e-3 to 3e-3 (σ₂² far below EACH_FLOOR of σ₁², as a trained model's sink heads give):
    float32 rounding of a Gram product (ε·σ₁²) is as large as σ₂², and σ₂ read from the Gram operator came
    out 10 times too small, on the dense and the blockwise path alike; σ₁'s direction projected out, it is
    right to 1e-4."""
    generator = torch.Generator().manual_seed(0)
    n, d = 512, 32
    q, k = torch.randn(4, n, d, generator=generator), torch.randn(4, n, d, generator=generator)
    bias = torch.zeros(n, n)
    bias[:, 0] = 11.0  # every query's logit on key 0 raised: a sink
    if causal:
        bias = bias.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    attn = torch.softmax(q @ k.mT / d**0.5 + bias, dim=-1)
    expected = torch.linalg.svdvals(attn.double())[:, :2]
    assert float((expected[:, 1] / expected[:, 0]).max()) < 3e-3  # σ₂² under 1e-5 of σ₁²
    with one_intra_op_thread():
        dense = attention_metrics(
            attn, causal=causal, method="krylov", include_rank_sums=False,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        blockwise = attention_metrics_from_qk(
            q,
            k,
            bias=bias,
            include_rank_sums=False,
            max_bytes=2**20,
            generator=torch.Generator().manual_seed(0),
        )
    for metrics in (dense, blockwise):
        np.testing.assert_allclose(metrics["sigma1"].double(), expected[:, 0], rtol=1e-4)
        np.testing.assert_allclose(metrics["sigma2"].double(), expected[:, 1], rtol=1e-4)


@pytest.mark.slow
def test_a_warm_start_from_the_last_steps_vectors_keeps_sigma2_accurate() -> None:
    """σ₁, σ₂ of the next step's attention (q and k moved by 1%) warm-started from this step's vectors: the
    stopping rule's estimate must not take the warm block's wide-looking Ritz gap at its word (at 3e-4 it
    stopped after one block, 8e-4 off, on these matrices)."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(16, 512, 64, generator=generator) for _ in range(2))
    moved = [x + 0.01 * torch.randn(x.shape, generator=generator) for x in (q, k)]
    state = attention_krylov.KrylovState()
    with one_intra_op_thread():
        attention_metrics(
            torch.softmax(q @ k.mT / 8, dim=-1),
            method="krylov",
            state=state,
            generator=torch.Generator().manual_seed(0),
        )
        assert state.vectors is not None and state.vectors.shape == (16, 512, 2)  # the next call is warm
        attn = torch.softmax(moved[0] @ moved[1].mT / 8, dim=-1)
        warm = attention_metrics(
            attn,
            method="krylov",
            state=state,
            include_rank_sums=False,
            generator=torch.Generator().manual_seed(1),
        )
    expected = torch.linalg.svdvals(attn.double())[:, :2]
    np.testing.assert_allclose(warm["sigma1"].double(), expected[:, 0], rtol=2e-4)
    np.testing.assert_allclose(warm["sigma2"].double(), expected[:, 1], rtol=2e-4)


@pytest.mark.slow
@pytest.mark.usefixtures("rank_sums_by_quadrature")
def test_krylov_effective_rank_standard_error_covers_the_truth() -> None:
    """|estimate − truth| ≤ 2·se holds as often as a 95% interval should.

    40 seeded calls on a batch of 3 different matrices give 120 intervals. A calibrated 2σ interval misses
    with probability ≈ 4.6%, so a fixed bar of "at most 5% misses" would fail a perfect estimator about a
    third of the time; instead the misses must stay within what Binomial(120, 0.05) allows at the 1% level.
    A standard error above 10% of the estimate would cover trivially and is rejected. (The attention sink,
    whose low effective rank is the costliest to estimate, has its standard error checked above.)
    """
    n, trials = 256, 40
    attn = np.concatenate(
        [
            softmax_attention(seed=101, shape=(1, n, n)),
            softmax_attention(seed=102, shape=(1, n, n), scale=2.0),
            float32_case(structured_attention("local_band", n, seed=104)).attn,
        ]
    )
    truth = AttentionCase("coverage", attn).reference()["effective_rank"]
    misses = 0
    for seed in range(trials):
        with one_intra_op_thread():
            result = attention_metrics(
                as_tensor(attn, torch.float32), method="krylov", generator=torch.Generator().manual_seed(seed)
            )
        estimate = result["effective_rank"].to(torch.float64).numpy()
        standard_error = result["effective_rank_se"].to(torch.float64).numpy()
        assert (standard_error <= 0.1 * estimate).all(), f"seed {seed}: se {standard_error} is vacuous"
        misses += int(np.sum(np.abs(estimate - truth) > 2 * standard_error + 1e-6 * truth))
    allowed = _binomial_upper_quantile(trials * len(attn), 0.05, 0.99)
    assert misses <= allowed, f"{misses} of {trials * len(attn)} intervals miss the truth (allowed {allowed})"


def _binomial_upper_quantile(count: int, probability: float, level: float) -> int:
    """The smallest k with P(Binomial(count, probability) ≤ k) ≥ level."""
    cumulative, k = 0.0, 0
    while True:
        cumulative += math.comb(count, k) * probability**k * (1 - probability) ** (count - k)
        if cumulative >= level:
            return k
        k += 1


def test_on_the_exact_path_concatenated_layers_give_each_layers_own_metrics() -> None:
    # The callback measures same-shaped layers in one call and splits the results back.
    generator = torch.Generator().manual_seed(21)
    future = torch.ones(48, 48, dtype=torch.bool).triu(1)
    layers = [
        torch.softmax(
            scale * torch.randn(2, 3, 48, 48, generator=generator).masked_fill(future, -math.inf), -1
        )
        for scale in (0.5, 2.0, 6.0)
    ]
    key_masks = [torch.rand(2, 3, 48, generator=generator) > 0.1 for _ in layers]
    together = attention_metrics(torch.cat(layers), key_mask=torch.cat(key_masks), causal=True)
    for position, (layer, key_mask) in enumerate(zip(layers, key_masks, strict=True)):
        alone = attention_metrics(layer, key_mask=key_mask, causal=True)
        for name, values in alone.items():
            torch.testing.assert_close(
                together[name][2 * position : 2 * position + 2], values, rtol=1e-6, atol=1e-7, equal_nan=True
            )
    states = [torch.randn(2, 48, 32, generator=generator) for _ in range(3)]
    stacked = token_metrics(torch.stack(states))
    for position, state in enumerate(states):
        for name, values in token_metrics(state).items():
            torch.testing.assert_close(stacked[name][position], values, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("given_norms", [False, True])
def test_matrices_whose_squares_overflow_are_finite_and_those_holding_nan_or_inf_are_not(
    given_norms: bool,
) -> None:
    huge = torch.full((4, 3, 3), 1e200, dtype=torch.float64)  # ‖·‖_F overflows, every entry is finite
    huge[1, 0, 0], huge[2, 2, 2] = math.nan, -math.inf
    norms = torch.linalg.matrix_norm(huge) if given_norms else None
    assert nonfinite_matrices(huge, norms).tolist() == [False, True, True, False]


def test_a_hugging_face_gpt2_at_256_tokens_is_measured_as_float64_measures_it() -> None:
    """A freshly initialised GPT-2 written elsewhere (256 wide, eager attention), two sequences of 256 tokens,
    the second right-padded to 200: its layers' token states and causal attention, measured exactly, agree
    with the float64 reference on the same float32 inputs. Their Gram matrices have 256 and 200 rows, where
    the route to numpy's OpenBLAS opens on processors MKL serves generically."""
    from helpers.hf_models import tiny_gpt2

    model = tiny_gpt2(attention="eager", n_embd=256, n_positions=256).eval()
    ids = torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(3))
    real = torch.arange(256)[None, :] < torch.tensor([256, 200])[:, None]
    with torch.no_grad():
        out = model(ids, attention_mask=real.long(), output_hidden_states=True, output_attentions=True)
    for states in out.hidden_states[1:]:
        expected = token_reference_batch(states.double().numpy(), token_mask=real.numpy())
        result = token_metrics(states, token_mask=real)
        actual = {name: value.double().numpy() for name, value in result.items() if name in expected}
        assert_metrics_match(actual, expected, "tokens", **FLOAT32_TOLERANCE)
    # Both sequences, the padded one as its 200 real queries × 200 real keys (GPT-2's padded query rows still
    # attend the real keys; the metrics leave them out, as the reference does).
    probabilities = out.attentions[-1]
    masks = {"key_mask": real[:, None, :], "query_mask": real[:, None, :]}
    expected = attention_reference_batch(
        probabilities.double().numpy(), causal=True, **{name: mask.numpy() for name, mask in masks.items()}
    )
    result = attention_metrics(probabilities, causal=True, method="exact", **masks)
    actual = {name: value.double().numpy() for name, value in result.items() if name in expected}
    assert_metrics_match(actual, expected, "attention", **FLOAT32_TOLERANCE)
