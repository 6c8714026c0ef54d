"""Stochastic trace estimation: tr f(M) by stochastic Lanczos quadrature, tr M by Hutchinson and Hutch++.

Each estimator returns its per-probe samples as well as the mean, so callers can form ratios of traces (the
effective-rank entropy is one) and still report an honest standard error (jackknife over probes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from spectral_monitor.linalg.operators import (
    BatchedOperator,
    ProjectedOperator,
    default_generator,
    gaussian,
    rademacher,
    working_dtype,
)


@dataclass
class TraceEstimate:
    """A stochastic trace estimate per batch element.

    Attributes:
        mean: (B,) the estimate, the mean of ``samples`` over probes.
        stderr: (B,) its sampling standard error, std/√probes (NaN with a single probe).
        samples: (B, probes) the per-probe estimates, for ratios of traces and jackknife errors.
        bias_bound: (B,) a bound on the deterministic (quadrature) error, 0 where the estimator has none.

    Examples:
        >>> import torch
        >>> estimate = TraceEstimate.from_samples(torch.tensor([[1.0, 3.0]]))
        >>> estimate.mean, estimate.stderr, estimate.bias_bound
        (tensor([2.]), tensor([1.]), tensor([0.]))
    """

    mean: Tensor
    stderr: Tensor
    samples: Tensor
    bias_bound: Tensor

    @classmethod
    def from_samples(cls, samples: Tensor, bias_bound: Tensor | None = None) -> TraceEstimate:
        """The estimate of per-probe samples: their mean and the standard error of that mean.

        Args:
            samples: (B, probes) per-probe estimates of the trace.
            bias_bound: (B,) the deterministic error bound, or ``None`` for 0.

        Returns:
            The :class:`TraceEstimate`, ``stderr`` NaN where there is a single probe.
        """
        probes = samples.shape[-1]
        spread = samples.std(dim=-1) if probes > 1 else torch.full_like(samples[..., 0], float("nan"))
        mean = samples.mean(dim=-1)
        bound = torch.zeros_like(mean) if bias_bound is None else bias_bound
        return cls(mean=mean, stderr=spread / probes**0.5, samples=samples, bias_bound=bound)


@dataclass
class QuadratureNodes:
    """Gauss and Gauss–Radau quadrature of each probe's spectral measure.

    The weights already include the probe's squared norm, so ``(weights * f(nodes)).sum(-1)`` is that probe's
    estimate of tr f(M); averaged over probes they form a discrete approximation of the spectral density.
    Nodes with zero weight pad a rule that stopped early (they change no sum).

    Attributes:
        nodes: (B, probes, steps) the Gauss nodes, the Ritz values of each probe's Lanczos tridiagonal.
        weights: (B, probes, steps) the Gauss weights.
        radau_nodes: (B, probes, steps + 1) the Gauss–Radau nodes, one of them fixed at 0 (up to rounding).
        radau_weights: (B, probes, steps + 1) the Gauss–Radau weights.

    Examples:
        >>> import torch
        >>> rule = QuadratureNodes(*(torch.ones(1, 2, 3),) * 2, *(torch.ones(1, 2, 4),) * 2)
        >>> (rule.weights * rule.nodes.square()).sum(-1)
        tensor([[3., 3.]])
    """

    nodes: Tensor
    weights: Tensor
    radau_nodes: Tensor
    radau_weights: Tensor


def lanczos_quadrature(
    op: BatchedOperator,
    *,
    num_probes: int = 16,
    num_steps: int = 24,
    deflate: Tensor | None = None,
    probes: Tensor | None = None,
    until: Callable[[QuadratureNodes], Tensor] | None = None,
    check_every: int = 4,
    first_check: int | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> QuadratureNodes:
    """Gauss quadrature nodes and weights of ``zᵀ f(M) z`` for Rademacher probes ``z`` of a symmetric ``op``.

    One Lanczos process per probe, all probes and batch elements advancing together so that each step is a
    single wide product. ``deflate`` (B, n, r), orthonormal, removes a subspace known exactly (e.g. top
    singular vectors): the quadrature then describes ``P M P`` with ``P = I − UUᵀ`` and the caller adds the
    exact contribution of the removed eigenvalues. There is no reorthogonalisation: loss of orthogonality
    only duplicates converged Ritz values (ghosts), and the Gauss rule stays accurate (Knizhnerman 1996;
    Ubaru, Chen & Saad 2017), while storing and sweeping the basis would cost more than the products.

    ``probes`` (B, n, num_probes) replaces the Rademacher draw, e.g. to give each batch element the same
    probes whichever other elements it is batched with.

    Both the Gauss rule and the Gauss–Radau rule with a node at 0 are returned; for √x-like functions they
    bracket the truth, so their spread is an honest bias bound. ``until(quadrature) -> (B,) bool`` is checked
    every ``check_every`` steps from step ``first_check`` (default ``2 * check_every``) on; each check solves
    the small eigenproblems of every probe. An element for which it holds stops there: its rules stay those
    of that step, padded with zero-weight nodes to the others' length (which changes no sum Σ w f(θ)), and
    the operator is restricted to the elements still going, so a finished element costs no more products.
    ``num_steps`` is the cap.

    Args:
        op: A symmetric operator M.
        num_probes: Probes per batch element, at least 2 (a standard error needs two samples).
        num_steps: Lanczos steps per probe, at most; at most n are taken.
        deflate: (B, n, r) orthonormal columns U to project out, or ``None``.
        probes: (B, n, num_probes) probe vectors to use instead of a Rademacher draw, or ``None``.
        until: A test ``(quadrature) -> (B,) bool`` after which an element stops, or ``None`` to run
            ``num_steps``.
        check_every: Steps between two checks of ``until``, at least 1.
        first_check: The first step at which ``until`` is checked; ``None`` for ``2 * check_every``.
        generator: Draws the Rademacher probes; ``None`` for a private generator of seed 0, so the
            result is reproducible and the global RNG untouched.
        dtype: The dtype the recurrence runs in; ``None`` for the operator's (at least float32).

    Returns:
        The :class:`QuadratureNodes`, (B, num_probes, steps) with steps the number taken.

    Raises:
        ValueError: ``op`` is not symmetric, ``num_probes`` < 2, ``num_steps`` < 1, ``check_every`` < 1, or
            ``probes`` is not of shape (B, n, num_probes).

    Examples:
        On diag(1, 2, 3) three steps exhaust the space: each Rademacher probe's nodes are the eigenvalues,
        each of weight zᵢ² = 1.

        >>> import torch
        >>> from spectral_monitor.linalg import DenseOperator
        >>> op = DenseOperator(torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))[None], True)
        >>> rule = lanczos_quadrature(op, num_probes=2, num_steps=3)
        >>> rule.nodes.round(decimals=6), rule.weights.round(decimals=6)
        (tensor([[[1., 2., 3.],
                 [1., 2., 3.]]], dtype=torch.float64), tensor([[[1., 1., 1.],
                 [1., 1., 1.]]], dtype=torch.float64))
    """
    if not op.symmetric:
        raise ValueError("op must be symmetric")
    if num_probes < 2:
        raise ValueError(f"num_probes must be >= 2 (a standard error needs two samples), got {num_probes}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    first_check = 2 * check_every if first_check is None else first_check
    work = working_dtype(op.dtype, dtype)
    generator = generator if generator is not None else default_generator(op.device)
    batch, n = op.batch, op.cols
    steps = min(num_steps, n)
    if deflate is not None:
        op = ProjectedOperator(op, deflate.to(device=op.device, dtype=op.dtype))

    if probes is None:
        probes = rademacher((batch, n, num_probes), dtype=work, device=op.device, generator=generator)
    elif probes.shape != (batch, n, num_probes):
        raise ValueError(f"probes must have shape {(batch, n, num_probes)}, got {tuple(probes.shape)}")
    probes = probes.to(device=op.device, dtype=work)
    if deflate is not None:
        probes = probes - deflate.to(work) @ (deflate.to(work).transpose(1, 2) @ probes)
    probe_norm = probes.norm(dim=1)
    safe_norm = torch.where(probe_norm > 0, probe_norm, torch.ones_like(probe_norm))
    q = probes / safe_norm[:, None, :]

    alphas = torch.zeros((batch, num_probes, steps), dtype=work, device=op.device)
    betas = torch.zeros((batch, num_probes, steps), dtype=work, device=op.device)
    previous = torch.zeros_like(q)
    beta = torch.zeros((batch, num_probes), dtype=work, device=op.device)
    scale = torch.zeros((batch, num_probes), dtype=work, device=op.device)
    active = torch.arange(batch, device=op.device)  # the elements whose products are formed
    running = torch.ones(batch, dtype=torch.bool, device=op.device)  # of those, the ones not yet stopped
    stopped = _StoppedRules(batch)
    done = 0
    for step in range(steps):
        w = op.matmat(q.to(op.dtype)).to(work)
        scale = torch.maximum(scale, w.norm(dim=1))
        alpha = (q * w).sum(dim=1)
        alphas[active, :, step] = alpha
        w = w - alpha[:, None, :] * q - beta[:, None, :] * previous
        beta = w.norm(dim=1)
        # A vanishing beta means the probe's Krylov space is invariant: the quadrature is already exact, and
        # continuing with a zero vector adds only zero-weight nodes.
        invariant = beta <= n**0.5 * torch.finfo(work).eps * scale.clamp_min(torch.finfo(work).tiny)
        beta = torch.where(invariant, torch.zeros_like(beta), beta)
        betas[active, :, step] = beta
        previous = q
        q = torch.where(
            invariant[:, None, :], torch.zeros_like(w), w / torch.where(invariant, 1, beta)[:, None, :]
        )
        done = step + 1
        checkpoint = done >= first_check and (done - first_check) % check_every == 0
        if until is None or done >= steps or not checkpoint:
            continue
        elements = active[running]
        current = _quadrature(alphas[elements, :, :done], betas[elements, :, :done], probe_norm[elements])
        finished = until(stopped.merged(current, elements, done))[elements]
        if not bool(finished.any()):
            continue
        stopped.add(_select(current, finished), elements[finished])
        if bool(finished.all()):
            return stopped.merged(None, None, done)
        running[running.clone()] = ~finished
        restricted = op.restrict(running.nonzero().squeeze(1))
        if restricted is not None:  # else the products go on for all, the stopped elements' rules frozen
            op = restricted
            active, q, previous, beta, scale = (t[running] for t in (active, q, previous, beta, scale))
            running = running[running]
    elements = active[running]
    current = _quadrature(alphas[elements, :, :done], betas[elements, :, :done], probe_norm[elements])
    return stopped.merged(current, elements, done)


class _StoppedRules:
    """The quadrature rules of elements that stopped early, each as of its own last step."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.parts: list[tuple[Tensor, QuadratureNodes]] = []  # (elements, their rules)

    def add(self, rules: QuadratureNodes, elements: Tensor) -> None:
        self.parts.append((elements, rules))

    def merged(self, current: QuadratureNodes | None, elements: Tensor | None, steps: int) -> QuadratureNodes:
        """(B, probes, steps) rules: ``current`` for ``elements``, the stopped elements' own for the rest."""
        parts = self.parts if current is None else [*self.parts, (elements, current)]
        probes = parts[0][1].nodes.shape[1]

        def assembled(field: str, length: int) -> Tensor:
            out = parts[0][1].nodes.new_zeros((self.batch, probes, length))
            for where, rules in parts:
                values = getattr(rules, field)
                out[where, :, : values.shape[-1]] = values
            return out

        return QuadratureNodes(
            nodes=assembled("nodes", steps),
            weights=assembled("weights", steps),
            radau_nodes=assembled("radau_nodes", steps + 1),
            radau_weights=assembled("radau_weights", steps + 1),
        )


def _select(rules: QuadratureNodes, index: Tensor) -> QuadratureNodes:
    return QuadratureNodes(
        nodes=rules.nodes[index],
        weights=rules.weights[index],
        radau_nodes=rules.radau_nodes[index],
        radau_weights=rules.radau_weights[index],
    )


def _quadrature(alphas: Tensor, betas: Tensor, probe_norm: Tensor) -> QuadratureNodes:
    gauss = _nodes_and_weights(alphas, betas[..., :-1], probe_norm)
    radau = _nodes_and_weights(*_radau_extension(alphas, betas), probe_norm)
    return QuadratureNodes(nodes=gauss[0], weights=gauss[1], radau_nodes=radau[0], radau_weights=radau[1])


def _nodes_and_weights(alphas: Tensor, betas: Tensor, probe_norm: Tensor) -> tuple[Tensor, Tensor]:
    tridiagonal = torch.diag_embed(alphas) + torch.diag_embed(betas, 1) + torch.diag_embed(betas, -1)
    # float64: the small solve is cheap there, and LAPACK is slow on float32 tridiagonals with subnormal
    # entries.
    nodes, vectors = torch.linalg.eigh(tridiagonal.double())
    weights = vectors[..., 0, :] ** 2 * (probe_norm.double() ** 2)[..., None]
    return nodes.to(alphas.dtype), weights.to(alphas.dtype)


def _radau_extension(alphas: Tensor, betas: Tensor) -> tuple[Tensor, Tensor]:
    """The Gauss–Radau rule with a node fixed at 0 (Golub & Meurant): one more row, no more products.

    Solve T δ = β_m² e_m and append the diagonal entry δ_m, coupled by β_m. For a positive semi-definite
    operator and an f whose derivatives have constant signs on (0, ∞) (√x is one), Gauss and Gauss–Radau
    bracket the true quadratic form.
    """
    inner = betas[..., :-1]
    tridiagonal = torch.diag_embed(alphas) + torch.diag_embed(inner, 1) + torch.diag_embed(inner, -1)
    rhs = torch.zeros_like(alphas)
    rhs[..., -1] = betas[..., -1] ** 2
    delta = torch.linalg.lstsq(tridiagonal.double(), rhs[..., None].double()).solution[..., -1, 0]
    return torch.cat([alphas, delta.to(alphas.dtype)[..., None]], dim=-1), betas


def spectral_sums(
    quadrature: QuadratureNodes, functions: Mapping[str, Callable[[Tensor], Tensor]]
) -> dict[str, TraceEstimate]:
    """tr f(M) for each named ``f``, from one set of quadrature nodes (the probes are shared).

    Each probe's value is the mean of its Gauss and Gauss–Radau rules; half their spread (averaged over
    probes) is the ``bias_bound``.

    Args:
        quadrature: The rules of :func:`lanczos_quadrature`.
        functions: f by name, each elementwise on a tensor of nodes. Every f is evaluated at every node,
            zero-weight padding and the Radau node at 0 included, which can come out a rounding below 0:
            clamp where f is undefined there (``lambda x: x.clamp_min(0).sqrt()``).

    Returns:
        A :class:`TraceEstimate` of tr f(M) by name.

    Examples:
        >>> import torch
        >>> from spectral_monitor.linalg import DenseOperator
        >>> op = DenseOperator(torch.diag(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))[None], True)
        >>> sums = spectral_sums(lanczos_quadrature(op, num_probes=2, num_steps=3), {
        ...     "trace": lambda x: x, "nuclear": lambda x: x.clamp_min(0).sqrt()})
        >>> {name: round(estimate.mean.item(), 6) for name, estimate in sums.items()}
        {'trace': 14.0, 'nuclear': 6.0}
    """
    sums = {}
    for name, f in functions.items():
        gauss = (quadrature.weights * f(quadrature.nodes)).sum(dim=-1)
        radau = (quadrature.radau_weights * f(quadrature.radau_nodes)).sum(dim=-1)
        bound = (gauss - radau).mean(dim=-1).abs() / 2
        sums[name] = TraceEstimate.from_samples((gauss + radau) / 2, bias_bound=bound)
    return sums


def hutchinson_trace(
    op: BatchedOperator,
    *,
    num_probes: int = 32,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> TraceEstimate:
    """tr M from Rademacher probes, ``E[zᵀ M z]``; one wide product.

    Args:
        op: A square operator M.
        num_probes: Probes per batch element, at least 2.
        generator: Draws the probes; ``None`` for a private generator of seed 0.
        dtype: The dtype the estimate is formed in; ``None`` for the operator's (at least float32).

    Returns:
        The :class:`TraceEstimate`, ``bias_bound`` 0 (the estimator is unbiased).

    Raises:
        ValueError: ``num_probes`` < 2, or ``op`` is not square.

    Examples:
        A diagonal operator's trace comes out exact (zᵢ² = 1 for every probe):

        >>> import torch
        >>> from spectral_monitor.linalg import DenseOperator
        >>> op = DenseOperator(torch.diag(torch.tensor([1.0, 2.0, 3.0]))[None])
        >>> estimate = hutchinson_trace(op, num_probes=4)
        >>> estimate.mean, estimate.stderr
        (tensor([6.]), tensor([0.]))
    """
    if num_probes < 2:
        raise ValueError(f"num_probes must be >= 2, got {num_probes}")
    if op.rows != op.cols:
        raise ValueError(f"op must be square to have a trace, got rows={op.rows}, cols={op.cols}")
    work = working_dtype(op.dtype, dtype)
    generator = generator if generator is not None else default_generator(op.device)
    z = rademacher((op.batch, op.cols, num_probes), dtype=work, device=op.device, generator=generator)
    samples = (z * op.matmat(z.to(op.dtype)).to(work)).sum(dim=1)
    return TraceEstimate.from_samples(samples)


def hutchpp_trace(
    op: BatchedOperator,
    *,
    num_products: int = 48,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> TraceEstimate:
    """tr M by Hutch++ (Meyer, Musco, Musco & Woodruff 2021), with ``num_products`` products in all.

    A third of the products find the dominant range Q by a sketch, tr(QᵀMQ) is taken exactly, and the
    remaining third estimate the trace of the deflated rest by Hutchinson. The standard error is that of
    the Hutchinson part (the exact part has none); ``samples`` are the per-probe totals.

    Args:
        op: A symmetric operator M.
        num_products: Operator-vector products in all, at least 6; the sketch is at most n wide, and the
            products it leaves go to the Hutchinson probes.
        generator: Draws the sketch and the probes; ``None`` for a private generator of seed 0.
        dtype: The dtype the estimate is formed in; ``None`` for the operator's (at least float32).

    Returns:
        The :class:`TraceEstimate`, ``bias_bound`` 0.

    Raises:
        ValueError: ``num_products`` < 6, or ``op`` is not symmetric.

    Examples:
        A sketch as wide as the operator finds its whole range, so the trace is exact:

        >>> import torch
        >>> from spectral_monitor.linalg import DenseOperator
        >>> op = DenseOperator(torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))[None], True)
        >>> round(hutchpp_trace(op, num_products=9).mean.item(), 6)
        6.0
    """
    if num_products < 6:
        raise ValueError(f"num_products must be >= 6, got {num_products}")
    if not op.symmetric:
        raise ValueError("op must be symmetric")
    work = working_dtype(op.dtype, dtype)
    generator = generator if generator is not None else default_generator(op.device)
    sketch_width = min(num_products // 3, op.cols)
    probes = num_products - 2 * sketch_width
    sketch = gaussian((op.batch, op.cols, sketch_width), dtype=work, device=op.device, generator=generator)
    basis, _ = torch.linalg.qr(op.matmat(sketch.to(op.dtype)).to(work))
    exact = (basis * op.matmat(basis.to(op.dtype)).to(work)).sum(dim=(1, 2))
    z = rademacher((op.batch, op.cols, probes), dtype=work, device=op.device, generator=generator)
    z = z - basis @ (basis.transpose(1, 2) @ z)
    rest = (z * op.matmat(z.to(op.dtype)).to(work)).sum(dim=1)
    # Projecting the probe leaves an unbiased estimator of tr((I−QQᵀ) M (I−QQᵀ)).
    return TraceEstimate.from_samples(exact[:, None] + rest)


__all__ = [
    "QuadratureNodes",
    "TraceEstimate",
    "hutchinson_trace",
    "hutchpp_trace",
    "lanczos_quadrature",
    "spectral_sums",
]
