"""The block Lanczos engine against float64 eigendecompositions: largest- and smallest-algebraic eigenpairs
of indefinite batches, singular triplets of rectangular ones, invariant subspaces, and what each side of
the singular vectors costs."""

from __future__ import annotations

import pytest
import torch

from spectral_monitor.linalg import FunctionOperator, lanczos, lanczos_eigsh, top_singular
from spectral_monitor.linalg.krylov_basis import GrowingRows
from spectral_monitor.linalg.lanczos_certificate import start_certainty
from spectral_monitor.linalg.operators import gaussian


def indefinite_batch(batch: int, n: int, seed: int) -> torch.Tensor:
    """Symmetric float64 matrices whose largest-magnitude eigenvalue is negative (−9 against a top of 5)."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(batch, n, n, generator=generator, dtype=torch.float64)).Q
    spectrum = torch.linspace(-1.0, 1.0, n, dtype=torch.float64).repeat(batch, 1)
    spectrum[:, 0], spectrum[:, -3:] = -9.0, torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64)
    return basis @ torch.diag_embed(spectrum) @ basis.transpose(1, 2)


@pytest.mark.parametrize("which", ["largest", "smallest"])
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_extreme_algebraic_eigenpairs_of_indefinite_batches_match_eigvalsh(
    which: str, block_size: int
) -> None:
    matrices = indefinite_batch(3, 40, seed=0)
    result = lanczos_eigsh(
        matrices, 3, which=which, block_size=block_size, tol=1e-10, generator=torch.Generator().manual_seed(1)
    )
    reference = torch.linalg.eigvalsh(matrices)
    expected = reference[:, -3:].flip(1) if which == "largest" else reference[:, :3]
    torch.testing.assert_close(result.values, expected, rtol=1e-8, atol=1e-8)
    assert bool(result.info.converged.all())
    # Orthonormal eigenvectors with the eigenvalues returned.
    gram = result.vectors.transpose(1, 2) @ result.vectors
    torch.testing.assert_close(gram, torch.eye(3, dtype=torch.float64).expand(3, 3, 3), atol=1e-8, rtol=0)
    torch.testing.assert_close(
        matrices @ result.vectors, result.vectors * result.values[:, None, :], atol=1e-6, rtol=0
    )


def test_an_invariant_krylov_space_is_extended_by_filler_directions_not_a_breakdown() -> None:
    """Top 3 of rank-one matrices by single-vector Lanczos: the Krylov space is invariant after two vectors,
    so the third direction must be a random one orthogonal to both, and the third value is then exactly 0."""
    generator = torch.Generator().manual_seed(3)
    u = torch.nn.functional.normalize(torch.randn(2, 30, 1, generator=generator, dtype=torch.float64), dim=1)
    matrices = u @ u.mT * torch.tensor([7.0, 0.5], dtype=torch.float64)[:, None, None]
    result = lanczos_eigsh(matrices, 3, block_size=1, tol=1e-12, generator=generator)
    expected = torch.tensor([[7.0, 0.0, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(result.values, expected, atol=1e-12, rtol=0)
    gram = result.vectors.mT @ result.vectors
    torch.testing.assert_close(gram, torch.eye(3, dtype=torch.float64).expand(2, 3, 3), atol=1e-10, rtol=0)


def test_without_the_certificate_warm_vectors_that_span_the_answer_converge_in_one_block() -> None:
    matrices = indefinite_batch(2, 50, seed=4)
    cold = lanczos_eigsh(matrices, 2, tol=1e-10, generator=torch.Generator().manual_seed(5))
    warm = lanczos_eigsh(
        matrices,
        2,
        tol=1e-10,
        init=cold.vectors,
        generator=torch.Generator().manual_seed(6),
        failure_probability=None,
    )
    assert warm.info.iterations.tolist() == [1, 1]
    torch.testing.assert_close(warm.values, cold.values, atol=1e-9, rtol=0)


def counted(matrices: torch.Tensor) -> tuple[FunctionOperator, list[int]]:
    """A rectangular batch as a function operator that counts the columns of the blocks it multiplies by,
    either side (one block product for the whole batch)."""
    spent = [0]

    def matmat(x: torch.Tensor) -> torch.Tensor:
        spent[0] += x.shape[2]
        return matrices @ x

    def rmatmat(y: torch.Tensor) -> torch.Tensor:
        spent[0] += y.shape[2]
        return matrices.transpose(1, 2) @ y

    batch, rows, cols = matrices.shape
    op = FunctionOperator(matmat, rmatmat=rmatmat, batch=batch, rows=rows, cols=cols, dtype=matrices.dtype)
    return op, spent


@pytest.mark.parametrize("shape", [(30, 12), (12, 30)], ids=["tall", "wide"])
def test_singular_triplets_of_rectangular_batches_and_the_cost_of_each_side(shape: tuple[int, int]) -> None:
    matrices = torch.randn(3, *shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    expected = torch.linalg.svdvals(matrices)[:, :2]
    results, spent = {}, {}
    for wanted in (True, "left", "right", False):
        op, products = counted(matrices)
        results[wanted] = top_singular(
            op, 2, tol=1e-12, generator=torch.Generator().manual_seed(8), return_vectors=wanted
        )
        spent[wanted] = products[0]
        torch.testing.assert_close(results[wanted].values, expected, rtol=1e-9, atol=0)
    both = results[True]
    assert both.left is not None and both.right is not None
    torch.testing.assert_close(matrices @ both.right, both.left * both.values[:, None, :], atol=1e-8, rtol=0)
    assert results["left"].right is None and results["right"].left is None
    assert results[False].left is None and results[False].right is None
    # The Gram operator's own side (right for a tall matrix, left for a wide one) costs nothing more; the
    # other costs one batched product of width k = 2.
    free, paid = ("right", "left") if shape[0] >= shape[1] else ("left", "right")
    assert spent[free] == spent[False]
    assert spent[paid] == spent[True] == spent[False] + 2


def test_an_unknown_return_vectors_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="return_vectors"):
        top_singular(torch.randn(1, 4, 4), 1, return_vectors="both")  # type: ignore[arg-type]


def test_each_wanted_eigenvalue_can_be_judged_against_itself() -> None:
    """Eigenvalues 1000 and 1 over a bulk below 0.9: against the largest, the second stops a few 1e-4 short
    of 1 (its error is small next to 1000); against itself it is resolved to the tolerance."""
    generator = torch.Generator().manual_seed(0)
    n = 200
    basis = torch.linalg.qr(torch.randn(3, n, n, generator=generator, dtype=torch.float64)).Q
    spectrum = 0.9 * torch.rand(3, n, generator=generator, dtype=torch.float64)
    spectrum[:, -2:] = torch.tensor([1.0, 1000.0], dtype=torch.float64)
    matrices = basis @ torch.diag_embed(spectrum) @ basis.mT
    second = {
        relative_to: lanczos_eigsh(
            matrices,
            2,
            block_size=1,
            tol=1e-5,
            relative_to=relative_to,
            generator=torch.Generator().manual_seed(1),
        ).values[:, 1]
        for relative_to in ("largest", "each")
    }
    assert float((second["largest"] - 1).abs().max()) > 1e-4
    torch.testing.assert_close(second["each"], torch.ones(3, dtype=torch.float64), atol=1e-8, rtol=0)
    with pytest.raises(ValueError, match="relative_to"):
        lanczos_eigsh(matrices, 1, relative_to="smallest")  # type: ignore[arg-type]


def test_growing_rows_hold_what_concatenation_would_past_their_first_capacity() -> None:
    generator = torch.Generator().manual_seed(3)
    blocks = [torch.randn(5, 3, 7, generator=generator) for _ in range(6)]
    rows = GrowingRows(blocks[0], capacity=4)
    for block in blocks[1:]:
        rows.append(block)
    torch.testing.assert_close(rows.rows, torch.cat(blocks, dim=1), rtol=0, atol=0)
    assert rows.count == 18
    kept = torch.tensor([4, 1])
    rows.keep(kept)
    rows.append(blocks[0][kept])
    torch.testing.assert_close(rows.rows, torch.cat(blocks + [blocks[0]], dim=1)[kept], rtol=0, atol=0)


def spectrum_operator(top: list[float], n: int = 300, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A (1, n, n) float64 symmetric matrix with eigenvalues ``top`` over a bulk in [-0.3, 0.6]; its basis."""
    generator = torch.Generator().manual_seed(seed)
    bulk = torch.rand(n - len(top), generator=generator, dtype=torch.float64) * 0.9 - 0.3
    spectrum = torch.cat([torch.tensor(top, dtype=torch.float64), bulk])
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return ((basis * spectrum) @ basis.T)[None], basis


@pytest.mark.parametrize("seed", range(4))
def test_a_prepended_stale_warm_vector_is_never_returned_as_a_converged_top(seed: int) -> None:
    """The warm vector is λ₂'s exact eigenvector (the top one before two eigenvalues crossed): the Ritz pair
    it gives has residual 0, so only the certificate over the random start can tell that λ₁ is missing."""
    matrices, basis = spectrum_operator([1.0, 0.9])
    result = lanczos_eigsh(
        matrices, 1, tol=1e-4, init=basis[None, :, 1:2], generator=torch.Generator().manual_seed(seed)
    )
    assert bool(result.info.converged[0])
    assert float(result.values[0, 0]) == pytest.approx(1.0, rel=1e-4)


def test_a_non_finite_operator_in_a_batch_without_restrict_leaves_the_others_their_answer() -> None:
    matrices, _ = spectrum_operator([1.0, 0.5], n=60)
    batch = torch.cat([matrices, matrices.clone()])
    batch[1, 3, 4] = float("nan")
    op = FunctionOperator(lambda x: batch @ x, batch=2, rows=60, cols=60, dtype=batch.dtype, symmetric=True)
    result = lanczos_eigsh(op, 1, tol=1e-8, generator=torch.Generator().manual_seed(0))
    assert result.info.converged.tolist() == [True, False]
    assert float(result.values[0, 0]) == pytest.approx(1.0, rel=1e-8)
    assert bool(result.values[1].isnan().all())


def test_without_a_generator_every_call_draws_a_fresh_start() -> None:
    """An operator built so that the seed-0 Gaussian start is orthogonal to its top eigenvector: the Krylov
    space of that start never sees λ₁ = 1.05 (the rest lie in [-1, 1]), which a start drawn afresh sees
    with probability one."""
    n = 80
    start = torch.randn((1, n, 1), generator=torch.Generator().manual_seed(0), dtype=torch.float64)[0, :, 0]
    top = torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    top = top - (top @ start) / (start @ start) * start
    top = top / top.norm()
    rest = torch.linspace(-1, 1, n, dtype=torch.float64)
    complement = torch.eye(n, dtype=torch.float64) - torch.outer(top, top)
    basis = torch.linalg.qr(
        complement @ torch.randn(n, n, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    )[0]
    matrix = complement @ (basis * rest) @ basis.T @ complement + 1.05 * torch.outer(top, top)
    matrix = ((matrix + matrix.T) / 2)[None]
    values = [float(lanczos_eigsh(matrix, 1, block_size=1, tol=1e-6).values[0, 0]) for _ in range(3)]
    assert values == pytest.approx([1.05] * 3, rel=1e-6)
    # A generator the caller passes makes the start reproducible.
    seeded = [
        lanczos_eigsh(matrix, 1, block_size=1, tol=1e-6, generator=torch.Generator().manual_seed(9))
        for _ in range(2)
    ]
    assert seeded[0].info.products == seeded[1].info.products
    assert float(seeded[0].values[0, 0]) == float(seeded[1].values[0, 0])


@pytest.mark.parametrize(
    ("top", "k", "expected"),
    [
        ([1.0, 1.0 - 1e-6], 1, [1.0]),  # a near-degenerate top: the two are one cluster within tol
        ([3.0], 2, [3.0, 0.0]),  # rank one: the second is 0, as are all the others
    ],
    ids=["near-degenerate", "rank-one-top-2"],
)
def test_clusters_within_the_tolerance_certify_within_the_budget(
    top: list[float], k: int, expected: list[float]
) -> None:
    n = 200
    if top == [3.0]:
        u = torch.nn.functional.normalize(
            torch.randn(1, n, 1, generator=torch.Generator().manual_seed(2)), dim=1
        )
        matrices = 3.0 * u @ u.mT  # float32: the second value is 0 to float32 rounding only
    else:
        matrices, _ = spectrum_operator(top, n=n)
    result = lanczos_eigsh(
        matrices,
        k,
        block_size=1,
        tol=1e-4,
        max_iters=128,
        criterion="eigenvalue",
        relative_to="each",
        failure_probability=0.01,
        generator=torch.Generator().manual_seed(3),
    )
    assert bool(result.info.converged[0])
    assert result.info.products < 128
    torch.testing.assert_close(
        result.values[0].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-6
    )


def test_a_zero_operator_certifies_at_once() -> None:
    result = lanczos_eigsh(
        torch.zeros(1, 50, 50), 1, block_size=1, tol=1e-4, max_iters=128, failure_probability=0.01
    )
    assert bool(result.info.converged[0]) and result.info.products < 20
    assert float(result.values[0, 0]) == 0.0


@pytest.mark.parametrize(
    ("top", "dtype", "block_size", "tol", "max_iters"),
    [
        # Block Lanczos: a 0.5% gap certified to 1e-4 by the degree test takes far more than 20 steps.
        ([1.0, 0.995, 0.99], torch.float64, 2, 1e-4, 20),
        # Single vector in float32: within 1e-5 the echo of the products' rounding alone exceeds the
        # component threshold, so no degree certifies the top gap-free.
        ([1.0, 0.9], torch.float32, 1, 1e-5, 60),
    ],
)
def test_a_certificate_that_needs_more_than_the_budget_stops_early_and_says_so(
    top: list[float], dtype: torch.dtype, block_size: int, tol: float, max_iters: int
) -> None:
    """The solver sees from its test that the budget cannot certify, stops before spending it, says why."""
    matrices, _ = spectrum_operator(top, n=400)
    result = lanczos_eigsh(
        matrices.to(dtype),
        1,
        block_size=block_size,
        tol=tol,
        max_iters=max_iters,
        criterion="eigenvalue",
        failure_probability=0.01,
        generator=torch.Generator().manual_seed(0),
    )
    assert not bool(result.info.converged[0])
    assert bool(result.info.out_of_budget[0])
    assert result.info.products < block_size * max_iters


def starts_with_a_small_component(n: int, smallest: float, largest: float, count: int) -> list[int]:
    """Seeds whose Gaussian start (as ``lanczos_eigsh`` draws it) has a component along the first coordinate
    in [smallest, largest) of its norm."""
    seeds = []
    for seed in range(100_000):
        start = gaussian((1, n, 1), dtype=torch.float64, device=torch.device("cpu"), generator=seed_of(seed))
        if smallest <= float(start[0, 0, 0].abs() / start.norm()) < largest:
            seeds.append(seed)
            if len(seeds) == count:
                return seeds
    raise AssertionError("too few starts with so small a component")


def seed_of(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("hidden", "most_products"), [(0.63, 45), (1.0, 18)])
def test_the_top_eigenvalue_certifies_from_the_least_start_component_it_assumes(
    hidden: float, most_products: int
) -> None:
    """A diagonal operator keeps a start's component along the first coordinate exact in floating point, so
    each start here has exactly 1–2× the component 1/C the certificate assumes along the top eigenvector
    (λ₁ above a bulk in [−0.3, 0.6]). Every answer must be λ₁, certified gap-free from the Krylov space's
    Christoffel function in at most 45 and 18 products: the degree test with the true gap λ₁ − λ₂, which no
    solver knows, would need 27 and 8; gap-free, with the tolerance as its gap, 761 and 711."""
    n, p = 200, 0.01
    spectrum = torch.cat([torch.tensor([hidden]), torch.linspace(-0.3, 0.6, n - 1)]).double()
    least = 1 / start_certainty(n, p)
    for seed in starts_with_a_small_component(n, least, 2 * least, count=4):
        result = lanczos_eigsh(
            torch.diag(spectrum)[None],
            1,
            block_size=1,
            tol=1e-4,
            max_iters=300,
            criterion="eigenvalue",
            failure_probability=p,
            generator=seed_of(seed),
        )
        assert bool(result.info.converged[0])
        assert float(result.values[0, 0]) == pytest.approx(hidden, rel=1e-4)
        assert result.info.products <= most_products


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hidden_gap", [3e-4, 1e-3])
def test_an_eigenvalue_hidden_just_above_the_top_ritz_value_is_never_certified_away(
    dtype: torch.dtype, hidden_gap: float
) -> None:
    """λ₁ = 1 + g sits just above λ₂ = 1, well inside the gap from the top Ritz value to the next one, and
    each start has only 1–1.05× the component 1/C the certificate assumes along it: Lanczos meets a
    converged-looking pair at 1 long before it resolves λ₁. A top value is reported converged only within
    the tolerance of λ₁; in float64 every run gets there."""
    n, p, tol = 200, 0.01, 1e-4
    spectrum = torch.cat([torch.tensor([1 + hidden_gap, 1.0]), torch.linspace(-0.3, 0.6, n - 2)]).double()
    converged = 0
    least = 1 / start_certainty(n, p)
    for seed in starts_with_a_small_component(n, least, 1.05 * least, count=6):
        result = lanczos_eigsh(
            torch.diag(spectrum).to(dtype)[None],
            1,
            block_size=1,
            tol=tol,
            max_iters=150,
            criterion="eigenvalue",
            failure_probability=p,
            generator=seed_of(seed),
        )
        if bool(result.info.converged[0]):
            converged += 1
            assert float(result.values[0, 0]) == pytest.approx(1 + hidden_gap, rel=tol)
    if dtype == torch.float64:
        assert converged == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank_one", [False, True])
def test_single_vector_lanczos_takes_the_same_steps_on_torch_vectors_as_on_numpy_views(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rank_one: bool
) -> None:
    """On the CPU the single-vector loop works on numpy views of its basis; off it (CUDA) on the tensors
    themselves. Forcing the tensor route here must change no step: the same products, Ritz values,
    vectors and certificate (rank one: the filler directions of an invariant Krylov space too)."""
    if rank_one:
        u = torch.nn.functional.normalize(
            torch.randn(60, 1, generator=torch.Generator().manual_seed(2)), dim=0
        )
        matrix = (7.0 * u @ u.mT).to(dtype)[None]
    else:
        matrix = indefinite_batch(1, 60, seed=6).to(dtype)

    def solve() -> object:
        return lanczos_eigsh(matrix, 3, block_size=1, tol=1e-5, generator=torch.Generator().manual_seed(7))

    on_numpy = solve()
    monkeypatch.setattr(lanczos, "_host_view", lambda tensor: tensor)
    on_torch = solve()
    # float32 dot products round differently in numpy's BLAS and torch's: a stop decision on the edge may
    # move by one product; in float64 the steps are the same.
    assert abs(on_numpy.info.products - on_torch.info.products) <= (1 if dtype == torch.float32 else 0)
    assert bool(on_numpy.info.converged.all()) and bool(on_torch.info.converged.all())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(on_torch.values, on_numpy.values, atol=tolerance * 7, rtol=0)
    # The rank-one matrix's second and third eigenvalues are both 0: any basis of that null space is right.
    distinct = 1 if rank_one else 3
    torch.testing.assert_close(
        on_torch.vectors[..., :distinct].abs(),
        on_numpy.vectors[..., :distinct].abs(),
        atol=tolerance * 100,
        rtol=0,
    )
    expected = torch.linalg.eigvalsh(matrix.double())[0, -3:].flip(0)
    torch.testing.assert_close(on_numpy.values[0].double(), expected, atol=1e-4 * 7, rtol=0)


@pytest.mark.parametrize(
    ("top", "dtype", "tol", "max_iters"),
    [
        ([1.0, 0.9], torch.float64, 1e-3, 200),
        ([1.0, 1.0 - 1e-4, 0.9], torch.float64, 1e-5, 200),
        ([1.0, 1.0 - 3e-4], torch.float32, 1e-3, 200),
        # Rounding's echo alone exceeds the component threshold: the full test must see it to stop early.
        ([1.0, 0.9], torch.float32, 1e-5, 60),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_the_stop_tests_quick_refusals_decide_as_the_full_test(
    monkeypatch: pytest.MonkeyPatch,
    top: list[float],
    dtype: torch.dtype,
    tol: float,
    max_iters: int,
    seed: int,
) -> None:
    """The stop test skips its full form where a cheap bound shows it must fail; the same solve with the full
    form at every step must spend the same products and return the same values and flags."""
    matrices = spectrum_operator(top, n=400, seed=seed)[0].to(dtype)

    def solve() -> lanczos.EigenResult:
        return lanczos_eigsh(
            matrices,
            1,
            block_size=1,
            tol=tol,
            max_iters=max_iters,
            criterion="eigenvalue",
            relative_to="each",
            failure_probability=0.05,
            generator=torch.Generator().manual_seed(seed),
        )

    quick = solve()
    full_test = lanczos.stop_test
    monkeypatch.setattr(
        lanczos, "stop_test", lambda *args, **kwargs: full_test(*args, **{**kwargs, "last": True})
    )
    full = solve()
    assert quick.info.products == full.info.products
    assert torch.equal(quick.values, full.values)
    for flag in ("converged", "out_of_budget", "iterations"):
        assert torch.equal(getattr(quick.info, flag), getattr(full.info, flag)), flag


def test_a_mixed_start_stays_within_twice_a_cold_starts_norm_however_many_warm_vectors_share_it() -> None:
    """The certificate halves its threshold for a mixed start on the premise that its norm is at most 2:
    three orthonormal warm vectors dealt to one column, each normalised and summed, would reach 1 + √3."""
    generator = torch.Generator().manual_seed(0)
    warm = torch.linalg.qr(torch.randn(1, 50, 3, dtype=torch.float64, generator=generator)).Q
    fresh = torch.randn(1, 50, 1, dtype=torch.float64, generator=generator)
    for aligned in (warm.sum(dim=2, keepdim=True), -warm.sum(dim=2, keepdim=True), fresh):
        start = lanczos._mixed_start(warm, aligned)
        assert float(start.norm()) <= 2 + 1e-12
    assert float(lanczos._mixed_start(warm, warm.sum(dim=2, keepdim=True)).norm()) == pytest.approx(2)
