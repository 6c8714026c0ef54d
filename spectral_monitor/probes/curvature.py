"""Curvature of the loss: Hessian eigenvalues, trace and spectral density, and the edge of stability.

Everything here takes a module and a *loss closure* (no Lightning). The closure is evaluated once per event
inside :func:`~spectral_monitor.probes._autodiff.probing`; its gradient's graph is built once per event
and kept, so every Hessian-vector product of every Lanczos iteration (and of the trace and density) is
one backward through that cached graph, batched over a block of vectors when the block is wider than one.
The defaults are reverse-over-reverse products, single-vector Lanczos, and a stop on an eigenvalue error
bound whose gap is certified from the random start (``docs/curvature.md`` describes the certificate).

The Hessian is an operator of :mod:`spectral_monitor.linalg`, so the engine's block Lanczos (top-k largest
algebraic eigenvalues, per-event product budget),
Hutch++ and stochastic Lanczos quadrature all apply to it unchanged. The parameters it acts on are a
:class:`~spectral_monitor.probes.parameter_space.ParameterSpace`; the optimizer's threshold, to which the
sharpness is compared, comes from :mod:`spectral_monitor.probes.edge_of_stability`. Both are re-exported
here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from spectral_monitor.distributed import mean_over_ranks_, on_every_rank, rank_zero_seed, sharded_parameters
from spectral_monitor.linalg import (
    BatchedOperator,
    EigenResult,
    QuadratureNodes,
    TraceEstimate,
    hutchpp_trace,
    lanczos_eigsh,
    lanczos_quadrature,
)
from spectral_monitor.linalg.lanczos import fresh_generator
from spectral_monitor.probes._autodiff import ProbeMode, batched_grad, probing
from spectral_monitor.probes.edge_of_stability import PRECONDITIONED, EdgeOfStability, edge_of_stability
from spectral_monitor.probes.parameter_space import BLOCK_PRESETS, ParameterSpace

__all__ = [
    "BLOCK_PRESETS",
    "CurvatureEstimate",
    "DiagonallyScaled",
    "EdgeOfStability",
    "HessianOperator",
    "ParameterSpace",
    "check_unsharded",
    "edge_of_stability",
    "hessian_eigenvalues",
    "measure_curvature",
]

HessianMethod = Literal["autograd", "func"]
HESSIAN_METHODS = ("autograd", "func")


class HessianOperator(BatchedOperator):
    """The Hessian of ``loss_fn()`` over ``space``, as a symmetric operator with a batch of one.

    The forward and the gradient's graph are built once, here, and kept, so each product is one backward
    through the cached graph, batched over the block of vectors. ``method="autograd"`` (the default): the
    gradient with ``create_graph`` once, then each product one ``torch.autograd.grad`` of it (a block by
    ``is_grads_batched``); a single vector over whole parameters goes in and out by views, with nothing
    around the one backward. ``"func"``: ``torch.func.vjp`` of ``torch.func.grad``, products batched by
    ``vmap``; the autograd path is taken instead when ``torch.func`` cannot transform the forward
    (``method`` then says ``"autograd"``). Drop the operator to free the graph.

    Args:
        loss_fn: Takes no arguments and returns a scalar tensor computed with the parameters of ``space``;
            called once.
        space: The coordinates the Hessian acts on.
        method: ``"autograd"`` or ``"func"``.
        module: The module ``loss_fn`` uses, whose parameters ``"func"`` swaps; needed for ``"func"`` only.
        average_over_ranks: Under ``torch.distributed`` (DDP) average the gradient and every block of
            products over the ranks (:func:`~spectral_monitor.distributed.mean_over_ranks_`, one all-reduce
            per block), so with each rank's loss on its own shard this is the Hessian of the mean loss over
            the global batch; every rank must then apply it the same number of times, so the solvers' stop
            decisions are agreed across ranks (:meth:`agreed`). Without a process group it changes nothing.

    Attributes:
        gradient: The gradient over ``space``, (size,), detached.
        products: Hessian-vector products applied so far.

    Raises:
        ValueError: If ``method`` is unknown, ``"func"`` comes without ``module`` or with parameters that are
            not ``module``'s, or ``loss_fn`` returns something other than a scalar tensor.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(2, 1, bias=False)
        >>> hessian = HessianOperator(lambda: 3 * layer.weight.square().sum(), ParameterSpace.of(layer))
        >>> hessian.matmat(torch.ones(1, 2, 1)).flatten().tolist(), hessian.products
        ([6.0, 6.0], 1)
    """

    def __init__(
        self,
        loss_fn: Callable[[], Tensor],
        space: ParameterSpace,
        method: HessianMethod = "autograd",
        module: nn.Module | None = None,
        average_over_ranks: bool = False,
    ) -> None:
        if method not in HESSIAN_METHODS:
            raise ValueError(f"method must be one of {HESSIAN_METHODS}, got {method!r}")
        if method == "func" and module is None:
            raise ValueError("method='func' needs the module the loss closure uses")
        super().__init__(1, space.size, space.size, space.dtype, space.device, symmetric=True)
        self.space = space
        self.method = method
        self.products = 0
        self.average_over_ranks = average_over_ranks
        if method == "func":
            try:
                gradients, self._vjp = torch.func.vjp(
                    torch.func.grad(_functional_loss(module, loss_fn, space)),
                    tuple(p.detach() for p in space.parameters),
                )
                self.gradient = self._averaged(space.flatten([g.detach()[None] for g in gradients])[0])
                return
            except RuntimeError as error:
                if "transform" not in str(error):
                    raise
                # A forward torch.func cannot transform (it mutates a captured tensor in place, as a
                # train-mode BatchNorm does): the autograd path computes the same products.
                self.method = "autograd"
        loss = loss_fn()
        _check_scalar(loss)
        gradients = torch.autograd.grad(loss, space.parameters, create_graph=True, allow_unused=True)
        self._gradients = [
            torch.zeros_like(p) if g is None else g for g, p in zip(gradients, space.parameters, strict=True)
        ]
        self.gradient = self._averaged(space.flatten([g.detach()[None] for g in self._gradients])[0])
        self._live = [i for i, g in enumerate(self._gradients) if g.requires_grad]
        # Over a space of whole, distinct parameters the flat gradient is their gradients concatenated, in the
        # graph: a single product is then one backward from it with the flat vector as the cotangent (the
        # graph's concatenation splits it), and one concatenation of the parameters' gradients after.
        whole = len(space.parameters) == len(space.coordinates) and all(
            c.rows is None for c in space.coordinates
        )
        self._flat_gradient = torch.cat([g.reshape(-1) for g in self._gradients]) if whole else None

    def matmat(self, x: Tensor) -> Tensor:
        """H X for a block of k vectors: k products, added to ``products``.

        Args:
            x: (1, size, k).

        Returns:
            (1, size, k) in ``x``'s dtype, detached (averaged over the ranks with ``average_over_ranks``).
        """
        if self.method == "autograd" and self._live and self._flat_gradient is not None and x.shape[2] == 1:
            self.products += 1
            return self._averaged(self._single_product(x.reshape(-1))).view(1, -1, 1).to(x.dtype)
        vectors = x[0].transpose(0, 1)  # (k, n)
        if self.method == "func" and vectors.shape[0] == 1:  # vmap over one vector only adds overhead
            cotangents = self.space.unflatten(vectors)
            products = self.space.flatten([p[None] for p in self._vjp(tuple(c[0] for c in cotangents))[0]])
        elif self.method == "func":
            cotangents = self.space.unflatten(vectors)
            products = self.space.flatten(list(torch.func.vmap(self._vjp)(tuple(cotangents))[0]))
        elif not self._live:  # a loss linear in these parameters
            products = torch.zeros_like(vectors)
        else:
            cotangents = self.space.unflatten(vectors)
            pairs = [(g, v) for g, v in zip(self._gradients, cotangents, strict=True) if g.requires_grad]
            grads = batched_grad([g for g, _ in pairs], self.space.parameters, [v for _, v in pairs])
            products = self.space.flatten(grads)
        self.products += vectors.shape[0]
        return self._averaged(products.detach()).transpose(0, 1)[None].to(x.dtype)

    def agreed(self, flags: Tensor) -> Tensor:
        """The solvers' stop decisions, made the same on every rank when averaging over ranks.

        Args:
            flags: Boolean decisions of this rank.

        Returns:
            ``flags`` true on every rank (:func:`~spectral_monitor.distributed.on_every_rank`) with
            ``average_over_ranks``, else ``flags`` itself.
        """
        return on_every_rank(flags) if self.average_over_ranks else flags

    def _single_product(self, vector: Tensor) -> Tensor:
        """H v for one flat vector (size,) over whole parameters: one backward and one concatenation."""
        products = torch.autograd.grad(
            self._flat_gradient,
            self.space.parameters,
            grad_outputs=vector,
            retain_graph=True,
            allow_unused=True,
        )
        return torch.cat(
            [
                parameter.new_zeros(parameter.numel()) if g is None else g.reshape(-1)
                for g, parameter in zip(products, self.space.parameters, strict=True)
            ]
        )

    def _averaged(self, tensor: Tensor) -> Tensor:
        if self.average_over_ranks:
            mean_over_ranks_([tensor])
        return tensor


class _Closure(nn.Module):
    """A module whose forward is the loss closure, so ``functional_call`` can swap the inner parameters."""

    def __init__(self, inner: nn.Module, loss_fn: Callable[[], Tensor]) -> None:
        super().__init__()
        self.inner = inner
        self.loss_fn = loss_fn

    def forward(self) -> Tensor:
        return self.loss_fn()


def _functional_loss(
    module: nn.Module, loss_fn: Callable[[], Tensor], space: ParameterSpace
) -> Callable[[tuple[Tensor, ...]], Tensor]:
    names_by_id = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(parameter), []).append(f"inner.{name}")
    missing = [p for p in space.parameters if id(p) not in names_by_id]
    if missing:
        raise ValueError("the parameter space holds parameters that are not the module's")
    closure = _Closure(module, loss_fn)

    def loss_of(values: tuple[Tensor, ...]) -> Tensor:
        swapped = {
            name: value
            for parameter, value in zip(space.parameters, values, strict=True)
            for name in names_by_id[id(parameter)]
        }
        loss = torch.func.functional_call(closure, swapped, (), strict=False, tie_weights=False)
        _check_scalar(loss)
        return loss

    return loss_of


def _check_scalar(loss: object) -> None:
    if not isinstance(loss, Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"the loss closure must return a scalar tensor, got {shape}")


class DiagonallyScaled(BatchedOperator):
    """D M D for a symmetric M and a positive diagonal D = diag(``scaling``), e.g. P^-1/2 H P^-1/2.

    Args:
        op: M, symmetric.
        scaling: The diagonal of D, (size,).

    Attributes:
        base: M.
        scaling: D's diagonal as (1, size, 1), on M's device.

    Examples:
        >>> import torch
        >>> from spectral_monitor.linalg.operators import DenseOperator
        >>> identity = DenseOperator(torch.eye(2)[None], symmetric=True)
        >>> scaled = DiagonallyScaled(identity, torch.tensor([1.0, 2.0]))
        >>> scaled.matmat(torch.ones(1, 2, 1)).flatten().tolist()
        [1.0, 4.0]
    """

    def __init__(self, op: BatchedOperator, scaling: Tensor) -> None:
        super().__init__(op.batch, op.rows, op.cols, op.dtype, op.device, symmetric=True)
        self.base = op
        self.scaling = scaling.to(device=op.device)[None, :, None]

    def matmat(self, x: Tensor) -> Tensor:
        """D M D X.

        Args:
            x: (batch, size, k).

        Returns:
            (batch, size, k).
        """
        scaling = self.scaling.to(x.dtype)
        return scaling * self.base.matmat(scaling * x)

    def agreed(self, flags: Tensor) -> Tensor:
        """The stop decisions as M agrees them.

        Args:
            flags: Boolean decisions of this rank.

        Returns:
            ``M.agreed(flags)``.
        """
        return self.base.agreed(flags)


FAILURE_PROBABILITY = 0.05
"""The chance, over the random start, that a certified Hessian eigenvalue has an unseen one above it. Larger
than the linear-algebra default (``lanczos_certificate.CERTAINTY``, 1%): the top value's gap-free
certificate compares the start's component along anything above θ₁ + τ₁ with p/√(2n/π), and in float32 the
products' rounding alone can account for about 10·ε/tol of the start's weight near the top, which a smaller
threshold leaves less room for; on the demo transformer at initialisation (2 layers × 64, tol=1e-3) a top-1
solve took 18–20 products at 5%, 21–22 at 1% and 23–39 at 0.4% (six starts each, all certified)."""


def hessian_eigenvalues(
    op: BatchedOperator,
    k: int = 1,
    *,
    which: str = "largest",
    max_products: int = 128,
    tol: float = 1e-4,
    block_size: int = 1,
    init: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> EigenResult:
    """The ``k`` largest (or smallest) algebraic eigenpairs of a Hessian operator within a product budget.

    Lanczos of width ``block_size`` that stops when each eigenvalue's error bound is within ``tol`` of that
    eigenvalue and the space has resolved the Ritz value past the wanted ones (``criterion="eigenvalue"``,
    ``relative_to="each"`` of :func:`~spectral_monitor.linalg.lanczos_eigsh`, whose docstring says what the
    bound assumes), or when the next block would exceed ``max_products`` (``converged`` is then False).
    Width 1 by default, single-vector Lanczos; a wider block batches its products into one backward pass, and
    a width of at least the multiplicity is needed to resolve exactly repeated eigenvalues.

    Warm vectors ``init`` (n, r), such as an earlier solve's Ritz vectors, are mixed into the random start
    (``init_mode="mix"``): every start vector is a random direction plus a warm one, and the answer is
    accepted by the same test as a cold one, so a stale vector inside a cluster (an eigenvector of λ₂ after
    an eigenvalue crossing) cannot be returned as the top. They do not make the top value's certificate
    cheaper: it must rule out every eigenvalue above θ₁ + τ, which only the random part of the start can,
    and the more of the start lies along the top eigenvector, the more the products' rounding can hide
    there; in float32 a start close to it can leave the certificate out of reach. The probes start cold.

    A run that stops early because its certificate cannot be reached from its start (``info.out_of_budget``;
    in float32 a start with much weight along the top eigenvector can do that,
    :func:`~spectral_monitor.linalg.lanczos_certificate.hidden_component`) is followed by one more from a
    fresh random start, which spends what is left of ``max_products``; ``info`` then counts both runs. Each
    start misses an eigenvalue above the answer with probability at most p = :data:`FAILURE_PROBABILITY`, so
    a value certified by the second is wrong with probability at most p·(1 + q) ≤ 2p, q the chance that the
    first stops early.

    Args:
        op: A symmetric operator with a batch of one (a :class:`HessianOperator`, or a scaled one).
        k: How many eigenpairs.
        which: ``"largest"`` or ``"smallest"`` (algebraic).
        max_products: The products the run may spend, at least ``k``.
        tol: The eigenvalue error bound, relative to each eigenvalue, at which the run stops.
        block_size: The block width (capped at the operator's size).
        init: Warm vectors (n, r), or None: a cold start.
        generator: The random start's generator (advanced).

    Returns:
        ``values`` (1, k) and ``vectors`` (1, n, k), with the convergence information in ``info``.

    Raises:
        ValueError: If ``max_products`` is below ``k`` or ``block_size`` is not a positive int.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(3, 1, bias=False)
        >>> curvatures = torch.tensor([1.0, 2.0, 3.0])
        >>> loss_fn = lambda: (curvatures * layer.weight.square()).sum()  # H = diag(2, 4, 6)
        >>> hessian = HessianOperator(loss_fn, ParameterSpace.of(layer))
        >>> result = hessian_eigenvalues(hessian, 2, generator=torch.Generator().manual_seed(0))
        >>> [round(value, 4) for value in result.values[0].tolist()], bool(result.info.converged.all())
        ([6.0, 4.0], True)
    """
    if max_products < k:
        raise ValueError(f"max_products must be >= k={k}, got {max_products}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    width = min(block_size, op.cols)

    def solve(start: Tensor | None, products: int) -> EigenResult:
        return lanczos_eigsh(
            op,
            k,
            which=which,
            block_size=width,
            tol=tol,
            max_iters=max(products // width, -(-k // width)),
            init=None if start is None else start.reshape(1, op.cols, -1),
            generator=generator,
            criterion="eigenvalue",
            relative_to="each",
            init_mode="mix",
            failure_probability=FAILURE_PROBABILITY,
        )

    first = solve(init, max_products)
    left = max_products - first.info.products
    stopped_early = first.info.out_of_budget is not None and bool(first.info.out_of_budget.all())
    if bool(first.info.converged.all()) or not stopped_early or left <= k:
        return first
    second = solve(None, left)
    info = replace(
        second.info,
        iterations=first.info.iterations + second.info.iterations,
        products=first.info.products + second.info.products,
    )
    return EigenResult(second.values, second.vectors, info)


@dataclass
class CurvatureEstimate:
    """What one curvature event measured over one parameter space.

    Attributes:
        eigenvalues: (k,) descending, the top-k largest algebraic eigenvalues of H.
        sharpness: λ_max(H), or for Adam, AdamW and RMSprop λ_max(P^-1/2 H P^-1/2) (NaN before their first
            step: no v̂ yet).
        edge: The optimizer's threshold (None without an optimizer, or where it is not defined).
        min_eigenvalue: The most negative (smallest algebraic) eigenvalue, if asked for; else None.
        trace: The Hutch++ estimate of tr H, if asked for; else None.
        density: Quadrature nodes and weights of the spectral density, if asked for; else None.
        gradient_alignment: |cos| of the top eigenvector with the gradient, in [0, 1].
        products: Hessian-vector products spent.
        converged: Every Lanczos run passed its test within its budget (:func:`hessian_eigenvalues`); the
            values are returned either way.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(2, 1, bias=False)
        >>> estimate = measure_curvature(
        ...     layer, lambda: layer.weight.square().sum(), generator=torch.Generator().manual_seed(0)
        ... )
        >>> [round(value, 4) for value in estimate.eigenvalues.tolist()], estimate.edge, estimate.trace
        ([2.0], None, None)
    """

    eigenvalues: Tensor
    sharpness: float
    edge: EdgeOfStability | None
    min_eigenvalue: float | None
    trace: TraceEstimate | None
    density: QuadratureNodes | None
    gradient_alignment: float
    products: int
    converged: bool


def measure_curvature(
    module: nn.Module,
    loss_fn: Callable[[], Tensor],
    *,
    space: ParameterSpace | None = None,
    top_k: int = 1,
    min_eigenvalue: bool = False,
    trace_products: int = 0,
    density_probes: int = 0,
    density_steps: int = 30,
    optimizer: torch.optim.Optimizer | None = None,
    max_products: int = 128,
    tol: float = 1e-4,
    block_size: int = 1,
    mode: ProbeMode = "eval",
    method: HessianMethod = "autograd",
    generator: torch.Generator | None = None,
    average_over_ranks: bool = False,
) -> CurvatureEstimate:
    """Hessian curvature of ``loss_fn()`` over ``space`` (default: every trainable parameter of ``module``).

    ``loss_fn`` runs once, in ``probing(module, mode)``: nothing of the module, its ``.grad`` or the RNG
    streams changes. Each Lanczos run (top-k, most negative, preconditioned top-1) stops when each
    eigenvalue's error bound is within ``tol`` of itself, or at ``max_products``
    (:func:`hessian_eigenvalues`).

    Args:
        module: The module ``loss_fn`` computes with; a sharded (FSDP) one is refused
            (:func:`check_unsharded`).
        loss_fn: Takes no arguments and returns a scalar tensor computed with ``module``.
        space: The coordinates of the Hessian (None: every parameter of ``module`` that requires grad).
        top_k: How many of the largest algebraic eigenvalues, at least 1 (capped at the space's size).
        min_eigenvalue: Also the most negative (smallest algebraic) eigenvalue.
        trace_products: Products for the Hutch++ trace (at least 6); 0: no trace.
        density_probes: Probes of the stochastic Lanczos quadrature of the spectral density (at least 2);
            0: no density.
        density_steps: Lanczos steps per density probe.
        optimizer: Its edge of stability (:func:`edge_of_stability`) is measured, and for Adam, AdamW and
            RMSprop the preconditioned sharpness; only read. None: neither.
        max_products: The products each Lanczos run may spend.
        tol: The eigenvalue error bound, relative to each eigenvalue, at which a run stops.
        block_size: The Lanczos block width.
        mode: The module's mode during the probe: ``"eval"`` or ``"train"``.
        method: How Hessian-vector products are formed (:class:`HessianOperator`).
        generator: The random starts' generator (advanced); None: a fresh one.
        average_over_ranks: Under DDP, every rank calls this with the loss of its own batch and gets the
            curvature of the mean loss over all ranks' batches (:class:`HessianOperator`); a ``generator``
            given must be seeded alike on every rank (without one, rank 0's fresh seed is shared).

    Returns:
        What the event measured.

    Raises:
        ValueError: If ``top_k`` is not a positive int, the module is sharded, or the Hessian cannot be
            formed (:class:`HessianOperator`).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(3, 1, bias=False)
        >>> curvatures = torch.tensor([1.0, 2.0, 3.0])
        >>> estimate = measure_curvature(
        ...     layer,
        ...     lambda: (curvatures * layer.weight.square()).sum(),
        ...     min_eigenvalue=True,
        ...     generator=torch.Generator().manual_seed(0),
        ... )
        >>> round(estimate.sharpness, 4), round(estimate.min_eigenvalue, 4), estimate.converged
        (6.0, 2.0, True)
    """
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    check_unsharded(module, "the curvature probe")
    space = space if space is not None else ParameterSpace.of(module)
    if generator is None:
        # Averaged over ranks, every rank applies the mean Hessian to the same vectors: one seed for all.
        shared = average_over_ranks
        generator = torch.Generator().manual_seed(rank_zero_seed()) if shared else fresh_generator()
    with probing(module, mode):
        hessian = HessianOperator(loss_fn, space, method, module, average_over_ranks)
        top = hessian_eigenvalues(
            hessian,
            min(top_k, space.size),
            max_products=max_products,
            tol=tol,
            block_size=block_size,
            generator=generator,
        )
        runs = [top]
        vectors = top.vectors[0]
        eigenvalues = top.values[0].detach()
        gradient = hessian.gradient.to(vectors.dtype)
        alignment = float(
            (vectors[:, 0] @ gradient).abs() / gradient.norm().clamp_min(torch.finfo(gradient.dtype).tiny)
        )
        bottom_value = None
        if min_eigenvalue:
            bottom = hessian_eigenvalues(
                hessian,
                1,
                which="smallest",
                max_products=max_products,
                tol=tol,
                block_size=block_size,
                generator=generator,
            )
            runs.append(bottom)
            bottom_value = float(bottom.values[0, 0])
        edge = edge_of_stability(optimizer, space) if optimizer is not None else None
        sharpness = float(eigenvalues[0])
        if edge is None and isinstance(optimizer, PRECONDITIONED):
            # Adam's and RMSprop's sharpness is the preconditioned one; before the first step there is none.
            sharpness = math.nan
        if edge is not None and edge.preconditioner is not None:
            scaled = DiagonallyScaled(hessian, edge.preconditioner.rsqrt())
            preconditioned = hessian_eigenvalues(
                scaled,
                1,
                max_products=max_products,
                tol=tol,
                block_size=block_size,
                generator=generator,
            )
            runs.append(preconditioned)
            sharpness = float(preconditioned.values[0, 0])
        trace = None
        if trace_products:
            trace = hutchpp_trace(hessian, num_products=trace_products, generator=generator)
        density = None
        if density_probes:
            density = lanczos_quadrature(
                hessian, num_probes=density_probes, num_steps=density_steps, generator=generator
            )
        products = hessian.products
        del hessian
    return CurvatureEstimate(
        eigenvalues=eigenvalues,
        sharpness=sharpness,
        edge=edge,
        min_eigenvalue=bottom_value,
        trace=trace,
        density=density,
        gradient_alignment=alignment,
        products=products,
        converged=all(bool(run.info.converged.all()) for run in runs),
    )


def check_unsharded(module: nn.Module, probe: str) -> None:
    """Refuses a module with sharded (FSDP, FSDP2 or DTensor) parameters, naming DDP as the alternative.

    The curvature, Jacobian and NTK probes differentiate the loss twice or push a data-dependent number of
    products through the forward; FSDP would all-gather shards inside each, on each rank its own number of
    times, and the double backward through sharded parameters is not built.

    Args:
        module: The module the probe would run on.
        probe: The probe's name, for the message (``"the curvature probe"``).

    Raises:
        ValueError: If ``module`` has sharded parameters.

    Examples:
        >>> from torch import nn
        >>> check_unsharded(nn.Linear(2, 2), "the curvature probe")
    """
    sharded = sharded_parameters(module)
    if sharded:
        raise ValueError(
            f"{probe} does not support sharded models (FSDP, FSDP2 or DTensor parameters: "
            f"{', '.join(sharded[:3])}{' ...' if len(sharded) > 3 else ''}); train with DDP "
            "(Lightning strategy='ddp'), whose ranks each hold the whole model, to measure it, or leave "
            "the curvature, jacobian and ntk families off under FSDP"
        )
