"""Curvature of the loss: Hessian eigenvalues, trace and spectral density, and the edge of stability.

Everything here takes a module and a *loss closure* (no Lightning). The closure is evaluated once per event
inside :func:`~spectral_monitor.probes._autodiff.probing`; its gradient's graph is built once per event
and kept, so every Hessian-vector product of every Lanczos iteration (and of the trace and density) is
one backward through that cached graph, batched over a block of vectors when the block is wider than one.
``docs/curvature.md`` has the measurements behind the defaults: ``torch.func`` reverse-over-reverse,
single-vector Lanczos (on the CPU a batched pass over b vectors costs about b single products), and a stop
on an eigenvalue error bound whose gap is certified from the random start.

The Hessian is an operator of :mod:`spectral_monitor.linalg`, so the engine's block Lanczos (top-k largest
algebraic eigenvalues, per-event product budget, warm start from the last event's Ritz vectors),
Hutch++ and stochastic Lanczos quadrature all apply to it unchanged.

Edge of stability (Cohen et al. 2021, 2022): gradient descent with step η cannot stay where λ_max(H) >
2/η; with heavy-ball momentum β the edge is (2 + 2β)/η; Adam's is reached by the *preconditioned*
sharpness λ_max(P^-1/2 H P^-1/2), P = (1 − β₁ᵗ)·diag(√(v/(1 − β₂ᵗ)) + ε), at (2 + 2β₁)/((1 − β₁)η).
:func:`edge_of_stability` reads η, β, t and P from a ``torch.optim`` optimizer's own state (SGD, Adam,
AdamW, RMSprop).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
from spectral_monitor.linalg.lanczos_certificate import CERTAINTY
from spectral_monitor.probes._autodiff import ProbeMode, batched_grad, probing

__all__ = [
    "BLOCK_PRESETS",
    "CurvatureEstimate",
    "CurvatureWarmStart",
    "DiagonallyScaled",
    "EdgeOfStability",
    "HessianOperator",
    "ParameterSpace",
    "check_unsharded",
    "edge_of_stability",
    "hessian_eigenvalues",
    "measure_curvature",
]

_PACKED_PART = re.compile(r"^(?P<pattern>.*)\[(?P<part>[qkv])\]$")
_PACKED_INDEX = {"q": 0, "k": 1, "v": 2}

BLOCK_PRESETS: dict[str, tuple[str, ...]] = {
    "query": (
        "*in_proj_weight[q]",
        "*in_proj_bias[q]",
        "*qkv.weight[q]",
        "*qkv.bias[q]",
        "*q_proj.*",
        "*attention.self.query.*",
    ),
    "key": (
        "*in_proj_weight[k]",
        "*in_proj_bias[k]",
        "*qkv.weight[k]",
        "*qkv.bias[k]",
        "*k_proj.*",
        "*attention.self.key.*",
    ),
    "value": (
        "*in_proj_weight[v]",
        "*in_proj_bias[v]",
        "*qkv.weight[v]",
        "*qkv.bias[v]",
        "*v_proj.*",
        "*attention.self.value.*",
    ),
    "attention_output": (
        "*self_attn.out_proj.*",
        "*attention.output.weight",
        "*attention.output.bias",
        "*o_proj.*",
        "*attn.c_proj.*",
        "*attention.output.dense.*",
    ),
    "mlp": ("*linear1.*", "*linear2.*", "*mlp.*", "*mlp.c_fc.*", "*intermediate.dense.*", "*output.dense.*"),
    "embeddings": ("*embedding*", "*embed*", "*wte.*", "*wpe.*"),
    "norms": ("*norm*", "*ln_*", "*LayerNorm*"),
}
"""Parameter-name patterns of the blocks a Hessian can be restricted to (``fnmatch``; ``[q]``, ``[k]``,
``[v]`` select the first, second or third of the rows of a packed projection such as
``nn.MultiheadAttention.in_proj_weight``): PyTorch's own transformer layers, the demo model, and Hugging Face
BERT/GPT-2/Llama naming. A preset that matches nothing in a model is an error when asked for."""


@dataclass(frozen=True)
class _Coordinates:
    name: str
    parameter: nn.Parameter
    rows: slice | None  # a packed part (a third of the rows), or the whole parameter

    @property
    def shape(self) -> torch.Size:
        return self.parameter[self.rows].shape if self.rows is not None else self.parameter.shape


class ParameterSpace:
    """The flat coordinate vector of chosen parameters (or packed parts of them) a Hessian acts on.

    ``ParameterSpace.of(module)``: every parameter that requires grad. ``ParameterSpace.of(module,
    patterns)``: those whose qualified names match one of the ``fnmatch`` patterns; a pattern ending in
    ``[q]``, ``[k]`` or ``[v]`` takes that third of the rows of a packed query/key/value projection.
    """

    def __init__(self, coordinates: Sequence[_Coordinates]) -> None:
        if not coordinates:
            raise ValueError("a ParameterSpace needs at least one parameter")
        self.coordinates = tuple(coordinates)
        self.parameters = list({id(c.parameter): c.parameter for c in coordinates}.values())
        self.sizes = [c.shape.numel() for c in self.coordinates]
        self.size = sum(self.sizes)
        first = self.parameters[0]
        self.dtype, self.device = first.dtype, first.device

    @classmethod
    def of(cls, module: nn.Module, patterns: Sequence[str] | None = None) -> ParameterSpace:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if patterns is None:
            return cls([_Coordinates(name, p, None) for name, p in named])
        chosen: dict[tuple[str, int | None], _Coordinates] = {}
        for pattern in patterns:
            packed = _PACKED_PART.match(pattern)
            glob = packed["pattern"] if packed else pattern
            for name, parameter in named:
                if not fnmatch.fnmatchcase(name, glob):
                    continue
                if packed is None:
                    chosen.setdefault((name, None), _Coordinates(name, parameter, None))
                    continue
                third, remainder = divmod(parameter.shape[0], 3)
                if remainder:
                    raise ValueError(
                        f"pattern {pattern!r}: {name} has {parameter.shape[0]} rows, not 3 parts"
                    )
                index = _PACKED_INDEX[packed["part"]]
                chosen.setdefault(
                    (name, index), _Coordinates(name, parameter, slice(index * third, (index + 1) * third))
                )
        whole = {name for name, index in chosen if index is None}
        kept = [c for (name, index), c in chosen.items() if index is None or name not in whole]
        if not kept:
            raise ValueError(f"patterns {list(patterns)} match no parameter that requires grad")
        return cls(kept)

    def names(self) -> list[str]:
        return [
            c.name if c.rows is None else f"{c.name}[{c.rows.start}:{c.rows.stop}]" for c in self.coordinates
        ]

    def flatten(self, per_parameter: Sequence[Tensor]) -> Tensor:
        """(k, size) from tensors shaped (k, *parameter.shape), one per entry of ``self.parameters``."""
        by_id = {id(p): t for p, t in zip(self.parameters, per_parameter, strict=True)}
        parts = []
        for c in self.coordinates:
            tensor = by_id[id(c.parameter)]
            if c.rows is not None:
                tensor = tensor[:, c.rows]
            parts.append(tensor.reshape(tensor.shape[0], -1))
        return torch.cat(parts, dim=1)

    def unflatten(self, flat: Tensor) -> list[Tensor]:
        """Tensors shaped (k, *parameter.shape) from (k, size), zero outside the chosen coordinates."""
        k = flat.shape[0]
        full = {id(p): None for p in self.parameters}
        pieces = flat.split(self.sizes, dim=1)
        for c, piece in zip(self.coordinates, pieces, strict=True):
            piece = piece.reshape(k, *c.shape).to(c.parameter.dtype)
            if c.rows is None:
                full[id(c.parameter)] = piece
                continue
            if full[id(c.parameter)] is None:
                full[id(c.parameter)] = piece.new_zeros((k, *c.parameter.shape))
            full[id(c.parameter)][:, c.rows] = piece
        return [full[id(p)] for p in self.parameters]

    def values(self) -> Tensor:
        """The current parameter values as a (size,) vector (detached)."""
        return self.flatten([p.detach()[None] for p in self.parameters])[0]


HessianMethod = Literal["autograd", "func"]
HESSIAN_METHODS = ("autograd", "func")


class HessianOperator(BatchedOperator):
    """The Hessian of ``loss_fn()`` over ``space``, as a symmetric operator with a batch of one.

    The forward and the gradient's graph are built once and kept, so each product is one backward through
    the cached graph, batched over the block of vectors. ``method="autograd"`` (the default): the gradient
    with ``create_graph`` once, then each product one ``torch.autograd.grad`` of it (a block by
    ``is_grads_batched``); a single vector over whole parameters goes in and out by views, so a product
    costs what the hand-written double backward does (``benchmarks/bench_hessian.py`` measures both).
    ``"func"``: ``torch.func.vjp`` of ``torch.func.grad``, products batched by ``vmap``; the autograd path
    is taken instead when ``torch.func`` cannot transform the forward (``method`` then says
    ``"autograd"``). ``gradient`` holds the gradient over ``space``, detached. Drop the operator to
    free the graph.

    ``average_over_ranks``: under ``torch.distributed`` (DDP) the gradient and every block of products are
    averaged over the ranks (:func:`~spectral_monitor.distributed.mean_over_ranks_`, one all-reduce per
    block), so with each rank's loss on its own shard this is the Hessian of the mean loss over the global
    batch; every rank must then apply it the same number of times, so the solvers' stop decisions are
    agreed across ranks (:meth:`agreed`). Without a process group it changes nothing.
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
        # A space of whole, distinct parameters maps a flat vector to them by views (split, no copies), and
        # a single product is then one backward with nothing around it, as a hand-written one is.
        self._whole = len(space.parameters) == len(space.coordinates) and all(
            c.rows is None for c in space.coordinates
        )
        self._live = [i for i, g in enumerate(self._gradients) if g.requires_grad]

    def matmat(self, x: Tensor) -> Tensor:
        vectors = x[0].transpose(0, 1)  # (k, n)
        if self.method == "func" and vectors.shape[0] == 1:  # vmap over one vector only adds overhead
            cotangents = self.space.unflatten(vectors)
            products = self.space.flatten([p[None] for p in self._vjp(tuple(c[0] for c in cotangents))[0]])
        elif self.method == "func":
            cotangents = self.space.unflatten(vectors)
            products = self.space.flatten(list(torch.func.vmap(self._vjp)(tuple(cotangents))[0]))
        elif not self._live:  # a loss linear in these parameters
            products = torch.zeros_like(vectors)
        elif self._whole and vectors.shape[0] == 1:
            products = self._single_product(vectors[0])[None]
        else:
            cotangents = self.space.unflatten(vectors)
            pairs = [(g, v) for g, v in zip(self._gradients, cotangents, strict=True) if g.requires_grad]
            grads = batched_grad([g for g, _ in pairs], self.space.parameters, [v for _, v in pairs])
            products = self.space.flatten(grads)
        self.products += vectors.shape[0]
        return self._averaged(products.detach()).transpose(0, 1)[None].to(x.dtype)

    def agreed(self, flags: Tensor) -> Tensor:
        return on_every_rank(flags) if self.average_over_ranks else flags

    def _single_product(self, vector: Tensor) -> Tensor:
        """H v for one flat vector (size,) over a space of whole parameters: views in, one backward."""
        pieces = vector.split(self.space.sizes)
        products = torch.autograd.grad(
            [self._gradients[i] for i in self._live],
            self.space.parameters,
            grad_outputs=[pieces[i].view_as(self._gradients[i]) for i in self._live],
            retain_graph=True,
            allow_unused=True,
        )
        return torch.cat(
            [
                piece.new_zeros(piece.shape) if g is None else g.reshape(-1)
                for g, piece in zip(products, pieces, strict=True)
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
    """D M D for a symmetric M and a positive diagonal D = diag(``scaling``), e.g. P^-1/2 H P^-1/2."""

    def __init__(self, op: BatchedOperator, scaling: Tensor) -> None:
        super().__init__(op.batch, op.rows, op.cols, op.dtype, op.device, symmetric=True)
        self.base = op
        self.scaling = scaling.to(device=op.device)[None, :, None]

    def matmat(self, x: Tensor) -> Tensor:
        scaling = self.scaling.to(x.dtype)
        return scaling * self.base.matmat(scaling * x)

    def agreed(self, flags: Tensor) -> Tensor:
        return self.base.agreed(flags)


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
    Width 1 by default: on the CPU a batched pass over b vectors costs about b single products and
    single-vector Lanczos reaches 1e-3 in the fewest products; a width of at least the multiplicity is
    needed to resolve exactly repeated eigenvalues.

    Warm vectors ``init`` (n, r), the last event's Ritz vectors, are mixed into the random start
    (``init_mode="mix"``): every start vector is a random direction plus a warm one, so the Krylov space
    holds the warm directions from the first product and keeps a cold start's chance at every eigenvector,
    one the warm vectors have turned away from included. The warm answer is accepted by the same test as a
    cold one, so a stale vector inside a cluster (an eigenvector of λ₂ after an eigenvalue crossing) costs
    products, not accuracy.
    """
    if max_products < k:
        raise ValueError(f"max_products must be >= k={k}, got {max_products}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    width = min(block_size, op.cols)
    return lanczos_eigsh(
        op,
        k,
        which=which,
        block_size=width,
        tol=tol,
        max_iters=max(max_products // width, -(-k // width)),
        init=None if init is None else init.reshape(1, op.cols, -1),
        generator=generator,
        criterion="eigenvalue",
        relative_to="each",
        init_mode="mix",
        failure_probability=CERTAINTY,
    )


@dataclass
class EdgeOfStability:
    """The threshold the sharpness is compared with, and the preconditioner that defines it.

    ``kind``: ``"sgd"``, ``"momentum"``, ``"nesterov"``, ``"rmsprop"`` or ``"adam"``; ``threshold``: 2/η,
    (2 + 2β)/((1 − d)η), (2 + 2β)/((1 + 2β)η), 2/η or (2 + 2β)/η for RMSprop with momentum β, and
    (2 + 2β₁)/((1 − β₁)η); ``preconditioner``: for Adam and RMSprop the diagonal P over the space (size,),
    else None (the sharpness is then λ_max(H) itself). ``docs/curvature.md`` derives each one.
    """

    kind: str
    learning_rate: float
    threshold: float
    preconditioner: Tensor | None = None


PRECONDITIONED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)
"""Optimizers whose sharpness is the preconditioned one, λ_max(P^-1/2 H P^-1/2)."""


def edge_of_stability(optimizer: torch.optim.Optimizer, space: ParameterSpace) -> EdgeOfStability | None:
    """The edge of stability of ``optimizer`` over ``space``, from its hyper-parameters and state.

    Gradient descent on a quadratic with curvature λ is stable while λ < threshold; for a preconditioned
    method the threshold applies to the preconditioned Hessian P^-1/2 H P^-1/2 (Cohen et al. 2022,
    "Adaptive gradient methods at the edge of stability", arXiv:2207.14484):

    - SGD: 2/η. With heavy-ball momentum β and dampening d (``torch.optim.SGD``: b ← βb + (1 − d)g,
      θ ← θ − ηb): (2 + 2β)/((1 − d)η). Nesterov (θ ← θ − η(g + βb), d = 0): (2 + 2β)/((1 + 2β)η).
    - Adam/AdamW: P_t = (1 − β₁ᵗ)·(diag(√(v_t/(1 − β₂ᵗ))) + ε), threshold (2 + 2β₁)/((1 − β₁)η), with t each
      parameter's own ``step`` and v_t its ``exp_avg_sq`` (``max_exp_avg_sq`` with AMSGrad).
    - RMSprop: P = diag(√v) + ε (√(v − ḡ²) + ε centred), threshold 2/η, (2 + 2β)/η with momentum β.

    ``None`` when it is not defined: another optimizer; parameter groups with different hyper-parameters
    over the space; a preconditioned method before its first step (no v yet).
    """
    groups = [g for g in optimizer.param_groups if any(id(p) in _ids(space) for p in g["params"])]
    if not groups or not all(_same_hyperparameters(groups[0], g) for g in groups[1:]):
        return None
    group = groups[0]
    lr = float(group["lr"])
    if lr <= 0:
        return None
    if isinstance(optimizer, torch.optim.SGD):
        beta = float(group.get("momentum", 0.0))
        if beta == 0:
            return EdgeOfStability("sgd", lr, 2 / lr)
        if group.get("nesterov", False):
            return EdgeOfStability("nesterov", lr, (2 + 2 * beta) / ((1 + 2 * beta) * lr))
        dampening = float(group.get("dampening", 0.0))
        return EdgeOfStability("momentum", lr, (2 + 2 * beta) / ((1 - dampening) * lr))
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        beta1, beta2 = (float(b) for b in group["betas"])
        eps = float(group["eps"])
        key = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
        diagonals = []
        for p in space.parameters:
            state = optimizer.state.get(p, {})
            if key not in state or "step" not in state or float(state["step"]) < 1:
                return None
            steps = float(state["step"])
            v_hat = state[key].detach() / (1 - beta2**steps)
            diagonals.append(((1 - beta1**steps) * (v_hat.sqrt() + eps))[None])
        preconditioner = space.flatten(diagonals)[0]
        return EdgeOfStability("adam", lr, (2 + 2 * beta1) / ((1 - beta1) * lr), preconditioner)
    if isinstance(optimizer, torch.optim.RMSprop):
        eps, beta = float(group["eps"]), float(group.get("momentum", 0.0))
        diagonals = []
        for p in space.parameters:
            state = optimizer.state.get(p, {})
            if "square_avg" not in state:
                return None
            second_moment = state["square_avg"].detach()
            if group.get("centered", False):
                second_moment = second_moment - state["grad_avg"].detach().square()
            diagonals.append((second_moment.clamp_min(0).sqrt() + eps)[None])
        preconditioner = space.flatten(diagonals)[0]
        return EdgeOfStability("rmsprop", lr, (2 + 2 * beta) / lr, preconditioner)
    return None


def _ids(space: ParameterSpace) -> set[int]:
    return {id(p) for p in space.parameters}


def _same_hyperparameters(first: Mapping, other: Mapping) -> bool:
    keys = ("lr", "momentum", "dampening", "nesterov", "betas", "eps", "alpha", "centered", "amsgrad")
    return all(first.get(key) == other.get(key) for key in keys)


@dataclass
class CurvatureWarmStart:
    """Ritz vectors of the last event, per quantity, to warm-start the next one (the engine guards them)."""

    top: Tensor | None = None
    bottom: Tensor | None = None
    preconditioned: Tensor | None = None


@dataclass
class CurvatureEstimate:
    """What one curvature event measured over one parameter space.

    ``eigenvalues`` (k,) descending, the top-k largest algebraic of H; ``sharpness``: λ_max(H), or for
    Adam λ_max(P^-1/2 H P^-1/2) (NaN before Adam's first step: no v̂ yet);
    ``edge``: the optimizer's threshold (None without an optimizer);
    ``min_eigenvalue``: the most negative (smallest algebraic) eigenvalue if asked; ``trace``: Hutch++;
    ``density``: quadrature nodes and weights of the spectral density; ``gradient_alignment``: |cos| of the
    top eigenvector with the gradient; ``products``: Hessian-vector products spent; ``converged``: every
    Lanczos run passed its test within its budget (:func:`hessian_eigenvalues`); the values are returned
    either way; ``warm``: vectors for the next event.
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
    warm: CurvatureWarmStart


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
    warm: CurvatureWarmStart | None = None,
    mode: ProbeMode = "eval",
    method: HessianMethod = "autograd",
    generator: torch.Generator | None = None,
    average_over_ranks: bool = False,
) -> CurvatureEstimate:
    """Hessian curvature of ``loss_fn()`` over ``space`` (default: every trainable parameter of ``module``).

    ``loss_fn`` takes no arguments and returns a scalar computed with ``module``; it runs once, in
    ``probing(module, mode)``: nothing of the module, its ``.grad`` or the RNG streams changes.
    ``method``: how Hessian-vector products are formed (:class:`HessianOperator`).
    ``max_products`` bounds each Lanczos run (top-k, most negative, preconditioned top-1), which stops
    when each eigenvalue's error bound is within ``tol`` of itself (:func:`hessian_eigenvalues`, block width
    ``block_size``);
    ``trace_products`` > 0 (at least 6) adds the Hutch++ trace, ``density_probes`` > 1 the quadrature of
    the spectral density (``density_steps`` Lanczos steps per probe). ``optimizer``: its edge of stability
    (:func:`edge_of_stability`) is measured, and for Adam the preconditioned sharpness.
    ``average_over_ranks``: under DDP, every rank calls this with the loss of its own batch and gets the
    curvature of the mean loss over all ranks' batches (:class:`HessianOperator`); a ``generator`` given
    must be seeded alike on every rank (without one, rank 0's fresh seed is shared).
    A sharded (FSDP) module is refused (:func:`check_unsharded`).
    """
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    check_unsharded(module, "the curvature probe")
    space = space if space is not None else ParameterSpace.of(module)
    warm = warm if warm is not None else CurvatureWarmStart()
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
            init=_usable(warm.top, space),
            generator=generator,
        )
        runs = [top]
        vectors = top.vectors[0]
        eigenvalues = top.values[0].detach()
        gradient = hessian.gradient.to(vectors.dtype)
        alignment = float(
            (vectors[:, 0] @ gradient).abs() / gradient.norm().clamp_min(torch.finfo(gradient.dtype).tiny)
        )
        new_warm = CurvatureWarmStart(top=vectors.detach().clone())
        bottom_value = None
        if min_eigenvalue:
            bottom = hessian_eigenvalues(
                hessian,
                1,
                which="smallest",
                max_products=max_products,
                tol=tol,
                block_size=block_size,
                init=_usable(warm.bottom, space),
                generator=generator,
            )
            runs.append(bottom)
            bottom_value = float(bottom.values[0, 0])
            new_warm.bottom = bottom.vectors[0].detach().clone()
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
                init=_usable(warm.preconditioned, space),
                generator=generator,
            )
            runs.append(preconditioned)
            sharpness = float(preconditioned.values[0, 0])
            new_warm.preconditioned = preconditioned.vectors[0].detach().clone()
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
        warm=new_warm,
    )


def check_unsharded(module: nn.Module, probe: str) -> None:
    """A ValueError naming DDP as the alternative if ``module`` has sharded (FSDP) parameters.

    The curvature, Jacobian and NTK probes differentiate the loss twice or push a data-dependent number of
    products through the forward; FSDP would all-gather shards inside each, on each rank its own number of
    times, and the double backward through sharded parameters is not built.
    """
    sharded = sharded_parameters(module)
    if sharded:
        raise ValueError(
            f"{probe} does not support sharded models (FSDP, FSDP2 or DTensor parameters: "
            f"{', '.join(sharded[:3])}{' ...' if len(sharded) > 3 else ''}); train with DDP "
            "(Lightning strategy='ddp'), whose ranks each hold the whole model, to measure it, or leave "
            "the curvature, jacobian and ntk families off under FSDP"
        )


def _usable(vectors: Tensor | None, space: ParameterSpace) -> Tensor | None:
    """Warm vectors of the same space only (a changed selection or model starts cold)."""
    return vectors if vectors is not None and vectors.shape[0] == space.size else None
