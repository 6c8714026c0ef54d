"""Curvature, Jacobian and NTK probes on tiny float64 models, against explicitly formed matrices.

Hessians from ``torch.autograd.functional.hessian`` of the loss as a function of the flat parameter vector,
Jacobians from ``torch.autograd.functional.jacobian``, kernels from per-example gradients formed one by one;
eigenvalues and norms from ``eigvalsh`` / ``svdvals`` of those.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from spectral_monitor.linalg import lanczos_eigsh
from spectral_monitor.linalg.lanczos_certificate import CERTAINTY
from spectral_monitor.linalg.operators import DenseOperator
from spectral_monitor.probes._autodiff import probing
from spectral_monitor.probes.curvature import (
    HessianOperator,
    ParameterSpace,
    edge_of_stability,
    hessian_eigenvalues,
    measure_curvature,
)
from spectral_monitor.probes.jacobian import block_jacobian_norms
from spectral_monitor.probes.ntk import empirical_ntk

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_transformer() -> tuple[nn.Module, callable]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0, batch_first=True)
    model = nn.ModuleDict(
        {"encoder": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), "head": nn.Linear(4, 3)}
    ).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    y = torch.tensor([[0, 1, 2], [2, 2, 0]])

    def loss() -> Tensor:
        logits = model["head"](model["encoder"](x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    return model, loss, x


def explicit_hessian(model: nn.Module, loss_fn, space: ParameterSpace) -> Tensor:
    """The Hessian over ``space``'s coordinates, from the full Hessian over every parameter."""
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    full = torch.cat([p.detach().flatten() for p in model.parameters()])

    class Swap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self) -> Tensor:
            return loss_fn()

    def loss_of(theta: Tensor) -> Tensor:
        values, offset = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            values[f"inner.{name}"] = theta[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        return torch.func.functional_call(Swap(), values, ())

    with sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel has no double backward
        hessian = torch.autograd.functional.hessian(loss_of, full)
    starts, offset = {}, 0
    for name, shape in zip(names, shapes, strict=True):
        starts[name] = offset
        offset += shape.numel()
    index = []
    for coordinates in space.coordinates:
        parameter_index = torch.arange(coordinates.parameter.numel()).view(coordinates.parameter.shape)
        if coordinates.rows is not None:
            parameter_index = parameter_index[coordinates.rows]
        index.append(starts[coordinates.name] + parameter_index.flatten())
    index = torch.cat(index)
    return hessian[index][:, index]


@pytest.mark.parametrize("method", ["func", "autograd"])
@pytest.mark.parametrize(
    ("patterns", "width"), [(None, 3), (None, 1), (["*in_proj_weight[k]", "*norm1.*"], 3)]
)
def test_hessian_vector_products_equal_the_explicit_hessian(method: str, patterns, width: int) -> None:
    model, loss_fn, _ = tiny_transformer()
    space = ParameterSpace.of(model, patterns)
    hessian = explicit_hessian(model, loss_fn, space)
    vectors = torch.randn(1, space.size, width, dtype=torch.float64)
    with probing(model):
        products = HessianOperator(loss_fn, space, method, model).matmat(vectors)
    torch.testing.assert_close(products[0], hessian @ vectors[0], rtol=1e-10, atol=1e-12)


def test_packed_query_key_value_parts_split_the_rows_in_thirds() -> None:
    model, _, _ = tiny_transformer()
    space = ParameterSpace.of(model, ["encoder.layers.0.self_attn.in_proj_weight[v]"])
    assert space.size == 16 and space.names() == ["encoder.layers.0.self_attn.in_proj_weight[8:12]"]
    with pytest.raises(ValueError, match="match no parameter"):
        ParameterSpace.of(model, ["nothing.*"])


@pytest.mark.slow
def test_top_k_and_the_most_negative_eigenvalue_match_eigvalsh() -> None:
    model, loss_fn, _ = tiny_transformer()
    space = ParameterSpace.of(model)
    exact = torch.linalg.eigvalsh(explicit_hessian(model, loss_fn, space))
    estimate = measure_curvature(
        model, loss_fn, top_k=3, min_eigenvalue=True, tol=1e-8, max_products=space.size
    )
    assert estimate.converged
    torch.testing.assert_close(estimate.eigenvalues, exact[-3:].flip(0), rtol=1e-4, atol=0)
    assert estimate.min_eigenvalue == pytest.approx(float(exact[0]), rel=1e-4)


def test_single_vector_lanczos_stops_on_the_eigenvalue_error_with_fewer_products() -> None:
    generator = torch.Generator().manual_seed(0)
    n = 300
    spectrum = torch.cat([torch.tensor([10.0, 9.0, 7.5]), torch.rand(n - 3, generator=generator) * 2 - 1])
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    matrix = (basis * spectrum.double()) @ basis.T
    tol, top = 1e-6, spectrum.sort(descending=True).values[:3].double()
    runs = {
        criterion: lanczos_eigsh(
            matrix[None],
            3,
            block_size=1,
            tol=tol,
            max_iters=n,
            criterion=criterion,
            generator=generator,
            failure_probability=None,  # the stop tests alone: the certificate's degree would set both
        )
        for criterion in ("residual", "eigenvalue")
    }
    for run in runs.values():
        assert bool(run.info.converged.all())
        assert float((run.values[0] - top).abs().max()) <= tol * 10.0
    # The residual bounds the error but is about its square root: stopping on it over-solves.
    assert runs["eigenvalue"].info.products < runs["residual"].info.products
    with pytest.raises(ValueError, match="max_iters must be >= k=3"):
        lanczos_eigsh(matrix[None], 3, block_size=1, max_iters=2)


def test_an_indefinite_hessian_reports_the_largest_algebraic_not_the_largest_magnitude() -> None:
    weights = torch.tensor([-5.0, 0.5, 2.0], dtype=torch.float64)
    model = nn.Linear(3, 1, bias=False).double()

    def loss() -> Tensor:
        w = model.weight.flatten()
        return 0.5 * (weights * w * w).sum() + (w**3).sum() * 0  # H = diag(-5, 0.5, 2)

    estimate = measure_curvature(model, loss, top_k=2, min_eigenvalue=True, tol=1e-10)
    torch.testing.assert_close(estimate.eigenvalues, torch.tensor([2.0, 0.5], dtype=torch.float64))
    assert estimate.sharpness == pytest.approx(2.0)
    assert estimate.min_eigenvalue == pytest.approx(-5.0)


@pytest.mark.slow
def test_the_hutchpp_trace_lies_within_its_reported_error() -> None:
    model, loss_fn, _ = tiny_transformer()
    space = ParameterSpace.of(model)
    exact = float(explicit_hessian(model, loss_fn, space).trace())
    estimate = measure_curvature(model, loss_fn, trace_products=60)
    stderr = float(estimate.trace.stderr[0])
    assert 0 < stderr < abs(exact)
    assert abs(float(estimate.trace.mean[0]) - exact) <= 4 * stderr


def test_top_k_above_the_product_budget_is_refused() -> None:
    model, loss_fn, _ = tiny_transformer()
    with pytest.raises(ValueError, match="max_products must be >= k=3"):
        measure_curvature(model, loss_fn, top_k=3, max_products=2)


def clustered_operator(top: list[float], n: int = 400) -> tuple[DenseOperator, Tensor, Tensor]:
    """A symmetric operator with eigenvalues ``top`` over a bulk in [-0.3, 0.6]; its eigenvectors."""
    generator = torch.Generator().manual_seed(1)
    bulk = torch.rand(n - len(top), generator=generator, dtype=torch.float64) * 0.9 - 0.3
    spectrum = torch.cat([torch.tensor(top, dtype=torch.float64), bulk])
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return DenseOperator(((basis * spectrum) @ basis.T)[None], symmetric=True), basis, spectrum


def test_a_warm_vector_makes_the_top_certificate_no_cheaper_and_in_float32_out_of_reach() -> None:
    """Why the probes start every event cold: the certificate must rule out every eigenvalue above θ₁ + τ,
    which only the random part of the start can. In float64 a start half along the top eigenvector certifies
    in as many products as a cold one; in float32, the products' rounding could hide that much of the start
    within τ above θ₁: the run stops early, unconverged, saying the budget cannot certify, and
    ``hessian_eigenvalues`` starts over from a fresh random start, which certifies."""
    op, basis, _ = clustered_operator([1.0, 0.9])
    top = basis[:, :1]
    products = {}
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 1e-3)):
        operator = DenseOperator(op.matrices.to(dtype), symmetric=True)
        for name, init in (("cold", None), ("warm", top.to(dtype))):
            result = hessian_eigenvalues(
                operator, tol=tol, max_products=128, init=init, generator=torch.Generator().manual_seed(0)
            )
            assert bool(result.info.converged[0])
            assert float(result.values[0, 0]) == pytest.approx(1.0, rel=tol)
            products[dtype, name] = result.info.products
    assert products[torch.float64, "warm"] >= products[torch.float64, "cold"] - 2
    assert products[torch.float32, "warm"] > products[torch.float32, "cold"]
    warm_only = lanczos_eigsh(
        DenseOperator(op.matrices.float(), symmetric=True),
        1,
        block_size=1,
        tol=1e-3,
        max_iters=128,
        init=top.float()[None],
        init_mode="mix",
        criterion="eigenvalue",
        relative_to="each",
        failure_probability=CERTAINTY,
        generator=torch.Generator().manual_seed(0),
    )
    assert not bool(warm_only.info.converged[0]) and bool(warm_only.info.out_of_budget[0])
    assert warm_only.info.products < 32


def test_a_stale_warm_vector_inside_a_one_percent_cluster_is_not_accepted() -> None:
    # λ₁ = 1, λ₂ = 0.995, λ₃ = 0.99; the warm vector is λ₂'s eigenvector exactly (the top one of the
    # Hessian before an eigenvalue crossing), alone or with λ₃'s and λ₄'s.
    op, basis, _ = clustered_operator([1.0, 0.995, 0.99])
    for stale in (basis[:, 1:2], basis[:, 1:4]):
        for seed in range(5):
            result = hessian_eigenvalues(
                op, tol=1e-3, max_products=300, init=stale, generator=torch.Generator().manual_seed(seed)
            )
            assert bool(result.info.converged.all())
            assert float(result.values[0, 0]) == pytest.approx(1.0, rel=1e-3)


def test_each_of_the_top_k_is_within_the_tolerance_of_its_own_value() -> None:
    # A small third eigenvalue next to a large first: judged against λ₁, 1e-3 would allow it 2% off.
    op, _, _ = clustered_operator([20.0, 1.0, 0.95], n=300)
    for seed in range(3):
        result = hessian_eigenvalues(
            op, 3, tol=1e-3, max_products=300, generator=torch.Generator().manual_seed(seed)
        )
        assert bool(result.info.converged.all())
        relative = (result.values[0] - torch.tensor([20.0, 1.0, 0.95], dtype=torch.float64)).abs()
        assert float((relative / torch.tensor([20.0, 1.0, 0.95], dtype=torch.float64)).max()) <= 1e-3


def test_a_budget_too_small_to_certify_reports_not_converged() -> None:
    op, _, _ = clustered_operator([1.0, 0.995, 0.99])
    result = hessian_eigenvalues(op, tol=1e-3, max_products=12)
    assert not bool(result.info.converged.any())


class HeldBackOperator(DenseOperator):
    """A dense operator whose stop decisions another party vetoes ``vetoes`` times, as a rank whose Lanczos
    has not converged yet does through ``on_every_rank`` under DDP."""

    def __init__(self, matrices: Tensor, vetoes: int) -> None:
        super().__init__(matrices, symmetric=True)
        self.vetoes = vetoes
        self.asked = 0

    def agreed(self, flags: Tensor) -> Tensor:
        self.asked += 1
        return flags & (self.asked > self.vetoes)


def test_lanczos_stops_on_the_agreed_decision_not_its_own() -> None:
    rotation, _ = torch.linalg.qr(
        torch.randn(200, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    )
    matrix = rotation @ torch.diag(torch.linspace(-1, 10, 200, dtype=torch.float64)) @ rotation.T
    settings = dict(block_size=1, tol=1e-3, max_iters=100, failure_probability=None)
    alone = lanczos_eigsh(
        HeldBackOperator(matrix[None], vetoes=0), 1, generator=torch.Generator().manual_seed(0), **settings
    )
    held = HeldBackOperator(matrix[None], vetoes=int(alone.info.iterations[0]) + 3)
    together = lanczos_eigsh(held, 1, generator=torch.Generator().manual_seed(0), **settings)
    assert int(together.info.iterations[0]) == held.vetoes + 1 == held.asked  # asked once per iteration
    assert together.info.products > alone.info.products
    # Iterating on only sharpens the estimate.
    assert abs(float(together.values[0, 0]) - 10) < abs(float(alone.values[0, 0]) - 10)


def test_averaging_over_ranks_without_a_process_group_changes_nothing() -> None:
    model, loss_fn, _ = tiny_transformer()
    settings = dict(top_k=2, trace_products=6, tol=1e-6, max_products=400)
    plain = measure_curvature(model, loss_fn, generator=torch.Generator().manual_seed(0), **settings)
    averaged = measure_curvature(
        model, loss_fn, generator=torch.Generator().manual_seed(0), average_over_ranks=True, **settings
    )
    assert torch.equal(plain.eigenvalues, averaged.eigenvalues) and plain.products == averaged.products
    assert torch.equal(plain.trace.mean, averaged.trace.mean)


@pytest.mark.slow
def test_adam_preconditioned_sharpness_matches_the_explicit_scaled_hessian() -> None:
    model, loss_fn, _ = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    space = ParameterSpace.of(model)
    steps = 3
    v_hat = torch.cat([optimizer.state[p]["exp_avg_sq"].flatten() for p in model.parameters()]) / (
        1 - 0.99**steps
    )
    scaling = ((1 - 0.9**steps) * (v_hat.sqrt() + 1e-6)).rsqrt()
    exact = torch.linalg.eigvalsh(scaling[:, None] * explicit_hessian(model, loss_fn, space) * scaling)
    estimate = measure_curvature(model, loss_fn, optimizer=optimizer, tol=1e-8, max_products=space.size)
    assert estimate.edge.kind == "adam"
    assert estimate.edge.threshold == pytest.approx(38 / 1e-2)
    assert estimate.sharpness == pytest.approx(float(exact[-1]), rel=1e-4)


def known_state(optimizer: torch.optim.Optimizer, **state: float) -> nn.Parameter:
    """``optimizer``'s only parameter (two coordinates), its state set to the values given (one per key,
    the second coordinate's doubled)."""
    (parameter,) = optimizer.param_groups[0]["params"]
    optimizer.state[parameter] = {
        key: torch.tensor(value) if key == "step" else torch.tensor([value, 2 * value])
        for key, value in state.items()
    }
    return parameter


def test_adam_preconditioner_is_cohen_et_al_2022_with_both_bias_corrections() -> None:
    # P_t = (1 - β₁ᵗ)(√(v_t / (1 - β₂ᵗ)) + ε), at t = 9 from the step count in the optimizer's state.
    for kind in (torch.optim.Adam, torch.optim.AdamW):
        parameter = nn.Parameter(torch.zeros(2))
        optimizer = kind([parameter], lr=0.01, betas=(0.9, 0.99), eps=1e-3)
        known_state(optimizer, step=9.0, exp_avg=0.0, exp_avg_sq=0.04)
        edge = edge_of_stability(optimizer, space_of(parameter))
        by_hand = [(1 - 0.9**9) * (math.sqrt(v / (1 - 0.99**9)) + 1e-3) for v in (0.04, 0.08)]
        assert edge.kind == "adam"
        assert edge.preconditioner.tolist() == pytest.approx(by_hand, rel=1e-6)
        assert edge.preconditioner[0].item() == pytest.approx(0.41722, rel=1e-4)  # 0.61258 · 0.68109
        assert edge.threshold == pytest.approx((2 + 1.8) / (0.1 * 0.01))


def test_amsgrad_preconditions_with_the_running_maximum() -> None:
    parameter = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([parameter], lr=0.01, betas=(0.5, 0.75), eps=0.0, amsgrad=True)
    known_state(optimizer, step=2.0, exp_avg=0.0, exp_avg_sq=0.01, max_exp_avg_sq=0.25)
    edge = edge_of_stability(optimizer, space_of(parameter))
    # (1 - 0.5²) √(0.25 / (1 - 0.75²)) = 0.75 · √(4/7)
    assert edge.preconditioner[0].item() == pytest.approx(0.75 * math.sqrt(4 / 7), rel=1e-6)


def test_rmsprop_preconditioner_is_the_root_mean_square_plus_eps() -> None:
    parameter = nn.Parameter(torch.zeros(2))
    plain = torch.optim.RMSprop([parameter], lr=0.01, eps=0.1)
    known_state(plain, step=5.0, square_avg=0.09)
    edge = edge_of_stability(plain, space_of(parameter))
    assert (edge.kind, edge.threshold) == ("rmsprop", pytest.approx(200))
    assert edge.preconditioner.tolist() == pytest.approx([0.3 + 0.1, math.sqrt(0.18) + 0.1], rel=1e-6)
    centred = torch.optim.RMSprop([parameter], lr=0.01, eps=0.0, momentum=0.5, centered=True)
    known_state(centred, step=5.0, square_avg=0.25, grad_avg=0.3, momentum_buffer=0.0)
    edge = edge_of_stability(centred, space_of(parameter))
    assert edge.threshold == pytest.approx(3 / 0.01)  # (2 + 2β)/η
    assert edge.preconditioner.tolist() == pytest.approx([0.4, math.sqrt(0.5 - 0.36)], rel=1e-6)


@pytest.mark.slow
def test_preconditioned_sharpness_is_measured_for_rmsprop_and_nan_before_its_first_step() -> None:
    model, loss_fn, _ = tiny_transformer()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=1e-4)
    before = measure_curvature(model, loss_fn, optimizer=optimizer, tol=1e-6, max_products=200)
    assert math.isnan(before.sharpness) and before.edge is None
    optimizer.zero_grad()
    loss_fn().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    space = ParameterSpace.of(model)
    second = torch.cat([optimizer.state[p]["square_avg"].flatten() for p in model.parameters()])
    scaling = (second.sqrt() + 1e-4).rsqrt()
    exact = torch.linalg.eigvalsh(scaling[:, None] * explicit_hessian(model, loss_fn, space) * scaling)
    estimate = measure_curvature(model, loss_fn, optimizer=optimizer, tol=1e-8, max_products=space.size)
    assert estimate.sharpness == pytest.approx(float(exact[-1]), rel=1e-6)


def test_sgd_thresholds_follow_the_step_size_and_momentum() -> None:
    model = nn.Linear(2, 2)
    space = ParameterSpace.of(model)
    assert edge_of_stability(torch.optim.SGD(model.parameters(), lr=0.1), space).threshold == pytest.approx(
        20
    )
    heavy_ball = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert edge_of_stability(heavy_ball, space).threshold == pytest.approx(38)
    damped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    assert edge_of_stability(damped, space).threshold == pytest.approx(76)  # (2 + 2β)/((1 - d)η)
    nesterov = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    assert edge_of_stability(nesterov, space).threshold == pytest.approx(3.8 / 0.28)  # (2+2β)/((1+2β)η)
    mixed = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.2}])
    assert edge_of_stability(mixed, space) is None
    assert edge_of_stability(torch.optim.Adam(model.parameters()), space) is None  # no v̂ before a step


def test_block_jacobian_norms_match_the_svd_of_the_explicit_jacobian() -> None:
    model, loss_fn, x = tiny_transformer()
    layers = model["encoder"].layers
    norms = block_jacobian_norms(model, loss_fn, sequence=1, tol=1e-10, max_iters=40)
    assert all(norms.converged.values()) and not norms.skipped
    state = x[1]
    inputs = []
    for layer in layers:
        inputs.append(state)
        state = layer(state[None])[0].detach()

    def jacobian(f, at: Tensor) -> Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return torch.autograd.functional.jacobian(f, at).reshape(at.numel(), at.numel())

    for name, layer, at in zip(["encoder.layers.0", "encoder.layers.1"], layers, inputs, strict=True):
        explicit = jacobian(lambda s, layer=layer: layer(s[None])[0], at)
        identity = torch.eye(explicit.shape[0], dtype=torch.float64)
        assert norms.jacobian_norm[name] == pytest.approx(
            float(torch.linalg.matrix_norm(explicit, 2)), rel=1e-6
        )
        assert norms.residual_branch_norm[name] == pytest.approx(
            float(torch.linalg.matrix_norm(explicit - identity, 2)), rel=1e-6
        )
    composed = jacobian(lambda s: layers[1](layers[0](s[None]))[0], inputs[0])
    assert norms.end_to_end_norm == pytest.approx(float(torch.linalg.matrix_norm(composed, 2)), rel=1e-6)


class ResidualMLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(x)


class ResidualMLP(nn.Module):
    """Residual blocks on plain (batch, features) input."""

    def __init__(self, width: int = 6, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLPBlock(width) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_jacobian_sigma_1_stays_exact_over_warm_events_of_a_moving_residual_mlp() -> None:
    # Each event warm-starts from the last one's vectors while the weights move between events, as in
    # training: the norm of every event must be σ₁ of the explicit Jacobian, not a stale σ₂.
    torch.manual_seed(0)
    model = ResidualMLP().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    warm, generator = None, torch.Generator().manual_seed(0)
    for _ in range(8):
        norms = block_jacobian_norms(
            model, lambda: model(x), sequence=2, tol=1e-6, max_iters=60, warm=warm, generator=generator
        )
        warm = norms.warm
        assert not norms.skipped and all(norms.converged.values())
        state = x[2]
        for index, block in enumerate(model.blocks):
            explicit = torch.autograd.functional.jacobian(lambda s, block=block: block(s[None])[0], state)
            assert norms.jacobian_norm[f"blocks.{index}"] == pytest.approx(
                float(torch.linalg.matrix_norm(explicit, 2)), rel=1e-5
            )
            state = block(state[None])[0].detach()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=0.15)


@pytest.mark.parametrize("max_bytes", [2**30, 0])
def test_the_empirical_ntk_equals_the_kernel_of_per_example_gradients(max_bytes: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    rows = []
    for i in range(6):
        grads = torch.autograd.grad(model(x[i : i + 1]).sum(), list(model.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]))
    jacobian = torch.stack(rows)
    kernel = jacobian @ jacobian.T
    estimate = empirical_ntk(model, lambda: model(x)[:, 0], max_bytes=max_bytes)
    assert estimate.materialised == (max_bytes > 0)
    torch.testing.assert_close(estimate.kernel, kernel, rtol=1e-10, atol=1e-12)
    eigenvalues = torch.linalg.eigvalsh(kernel)
    assert estimate.trace == pytest.approx(float(kernel.trace()))
    assert estimate.max_eigenvalue == pytest.approx(float(eigenvalues[-1]))
    assert estimate.condition_number == pytest.approx(float(eigenvalues[-1] / eigenvalues[0]), rel=1e-6)
    p = eigenvalues / eigenvalues.sum()
    assert estimate.effective_rank == pytest.approx(float(torch.exp(-(p * p.log()).sum())), rel=1e-8)


def test_the_empirical_ntk_of_a_non_finite_gradient_is_nan_rather_than_an_eigh_failure() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan
    estimate = empirical_ntk(model, lambda: model(torch.ones(4, 3, dtype=torch.float64))[:, 0])
    summaries = (estimate.trace, estimate.max_eigenvalue, estimate.condition_number, estimate.effective_rank)
    assert all(math.isnan(value) for value in summaries)
    assert estimate.eigenvalues.isnan().all() and estimate.eigenvalues.shape == (4,)


def test_probes_leave_parameters_grads_modes_buffers_and_the_rng_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)).double()
    model[0].eval()  # a mixed-mode module: each flag must come back as it was
    x = torch.randn(8, 3, dtype=torch.float64)
    loss = lambda: model(x).square().mean()  # noqa: E731
    loss().backward()
    before = {
        "parameters": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "modes": [m.training for m in model.modules()],
        "rng": torch.random.get_rng_state(),
    }
    for mode in ("train", "eval"):
        measure_curvature(model, loss, top_k=2, min_eigenvalue=True, trace_products=6, mode=mode)
        empirical_ntk(model, lambda: model(x)[:, 0], mode=mode)
    assert all(torch.equal(a, p) for a, p in zip(before["parameters"], model.parameters(), strict=True))
    assert all(torch.equal(a, p.grad) for a, p in zip(before["grads"], model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before["buffers"], model.buffers(), strict=True))
    assert before["modes"] == [m.training for m in model.modules()]
    assert torch.equal(before["rng"], torch.random.get_rng_state())


def space_of(parameter: nn.Parameter) -> ParameterSpace:
    holder = nn.Module()
    holder.register_parameter("p", parameter)
    return ParameterSpace.of(holder)
