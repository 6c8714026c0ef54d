"""The edge of stability of an optimizer: the sharpness beyond which its steps cannot stay stable.

Cohen et al. 2021, 2022: gradient descent with step η cannot stay where λ_max(H) > 2/η; with heavy-ball
momentum β the edge is (2 + 2β)/η; Adam's is reached by the *preconditioned* sharpness
λ_max(P^-1/2 H P^-1/2), P = (1 − β₁ᵗ)·diag(√(v/(1 − β₂ᵗ)) + ε), at (2 + 2β₁)/((1 − β₁)η).
:func:`edge_of_stability` reads η, β, t and P from a ``torch.optim`` optimizer's own state (SGD, Adam,
AdamW, RMSprop); nothing of the optimizer changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from spectral_monitor.probes.parameter_space import ParameterSpace

__all__ = ["PRECONDITIONED", "EdgeOfStability", "edge_of_stability"]


@dataclass
class EdgeOfStability:
    """The threshold the sharpness is compared with, and the preconditioner that defines it.

    ``docs/curvature.md`` derives each threshold.

    Attributes:
        kind: ``"sgd"``, ``"momentum"``, ``"nesterov"``, ``"rmsprop"`` or ``"adam"``.
        learning_rate: η.
        threshold: 2/η, (2 + 2β)/((1 − d)η), (2 + 2β)/((1 + 2β)η), 2/η or (2 + 2β)/η for RMSprop with
            momentum β, and (2 + 2β₁)/((1 − β₁)η).
        preconditioner: For Adam and RMSprop the diagonal P over the space, (size,); else None (the
            sharpness is then λ_max(H) itself).

    Examples:
        >>> edge = EdgeOfStability("sgd", learning_rate=0.1, threshold=20.0)
        >>> edge.preconditioner is None
        True
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

    Args:
        optimizer: The optimizer stepping the parameters of ``space``; only read.
        space: The parameters the sharpness is measured over.

    Returns:
        The edge, or ``None`` where it is not defined: another optimizer; parameter groups with different
        hyper-parameters over the space; a learning rate of 0; a preconditioned method before its first step
        (no v yet).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
        >>> edge = edge_of_stability(optimizer, ParameterSpace.of(layer))
        >>> edge.kind, round(edge.threshold, 4)
        ('momentum', 38.0)
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
