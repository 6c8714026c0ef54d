"""Signal propagation through depth: spectral norms of the Jacobians of transformer blocks.

For block l with input x_{l-1} and output x_l, ‖∂x_l/∂x_{l-1}‖₂ for one sequence (one example, for a block
of (batch, features) input such as a residual MLP block), and the norm of the
residual branch ‖J − I‖₂ (what the block adds to the stream); ``end_to_end_norm``: the Jacobian from the
first block's input (the embedding output) to the last block's output.

A forward of the model records each block's input and its other arguments (masks); each block is then
re-run on its recorded input with the graph kept. Jacobian-vector products are one backward of a backward
through that graph (the double-vjp identity J v = ∂/∂w ⟨Jᵀ w, v⟩), vector-Jacobian products one backward,
both batched over a block of vectors, so the engine's Lanczos (:func:`spectral_monitor.linalg.top_singular`)
gets σ₁ in a few products per block and is warm-started from the last event's vectors. The perturbation
lives in one sequence of the batch: the other sequences do not mix with it in a transformer block (eval
mode, no batch statistics), so this is that sequence's Jacobian.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from spectral_monitor.linalg import FunctionOperator, top_singular
from spectral_monitor.linalg.lanczos_certificate import CERTAINTY
from spectral_monitor.probes._autodiff import ProbeMode, batched_grad, probing
from spectral_monitor.probes.residual import _batch_first, _first_tensor, find_transformer_blocks

__all__ = ["END_TO_END", "JacobianNorms", "block_jacobian_norms"]

END_TO_END = "model"
"""The layer name of the end-to-end Jacobian norm."""


@dataclass
class JacobianNorms:
    """Spectral norms per block (model order), the end-to-end norm, and warm vectors for the next event.

    Attributes:
        jacobian_norm: Block name → ‖∂x_l/∂x_{l−1}‖₂.
        residual_branch_norm: Block name → ‖J − I‖₂, what the block adds to the stream.
        end_to_end_norm: The norm of the composed map, or None where it was not measured.
        converged: Block name (or ``"model"``) → whether every norm of it met the tolerance (the test of
            :func:`~spectral_monitor.linalg.lanczos_eigsh`); a norm that did not is still reported.
        warm: Start vectors for the next call's ``warm``.
        skipped: Block name (or ``"model"``) → why it was not measured.

    Examples:
        What :func:`block_jacobian_norms` returns; made by hand, it is empty:

        >>> JacobianNorms().jacobian_norm, JacobianNorms().end_to_end_norm
        ({}, None)
    """

    jacobian_norm: dict[str, float] = field(default_factory=dict)
    residual_branch_norm: dict[str, float] = field(default_factory=dict)
    end_to_end_norm: float | None = None
    converged: dict[str, bool] = field(default_factory=dict)
    warm: dict[str, Tensor] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class _BlockCall:
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Tensor | None = None

    @property
    def input(self) -> Tensor:
        return self.args[0]

    def __call__(self, x: Tensor) -> Tensor:
        out = self.module(x, *self.args[1:], **self.kwargs)
        return out if isinstance(out, Tensor) else _first_tensor(out)


class _LinearMap:
    """J of ``f`` at ``x`` restricted to one sequence: products in both directions from one kept graph."""

    def __init__(self, f: Callable[[Tensor], Tensor], x: Tensor, sequence: int, batch_dim: int) -> None:
        self.x = x.detach().requires_grad_(True)
        self.out = f(self.x)
        if self.out is None or self.out.shape != x.shape:
            raise ValueError("the block's output does not have its input's shape")
        self.sequence, self.batch_dim = sequence, batch_dim
        self.size = x.select(batch_dim, sequence).numel()
        self._w = torch.zeros_like(self.out, requires_grad=True)
        (self._transposed,) = torch.autograd.grad(self.out, self.x, self._w, create_graph=True)

    def _embed(self, vectors: Tensor) -> Tensor:  # (k, size) -> (k, *x.shape), zero off the sequence
        full = vectors.new_zeros((vectors.shape[0], *self.x.shape))
        full.select(self.batch_dim + 1, self.sequence).copy_(
            vectors.reshape(vectors.shape[0], *self.x.select(self.batch_dim, self.sequence).shape)
        )
        return full

    def _restrict(self, full: Tensor) -> Tensor:
        return full.select(self.batch_dim + 1, self.sequence).reshape(full.shape[0], -1)

    def jvp(self, vectors: Tensor) -> Tensor:
        (full,) = batched_grad(self._transposed, [self._w], [self._embed(vectors).to(self.x.dtype)])
        return self._restrict(full)

    def vjp(self, vectors: Tensor) -> Tensor:
        (full,) = batched_grad(self.out, [self.x], [self._embed(vectors).to(self.x.dtype)])
        return self._restrict(full)


def block_jacobian_norms(
    module: nn.Module,
    forward: Callable[[], Any],
    *,
    block_patterns: Sequence[str] | None = None,
    sequence: int = 0,
    residual_branch: bool = True,
    end_to_end: bool = True,
    tol: float = 1e-3,
    max_iters: int = 40,
    warm: dict[str, Tensor] | None = None,
    mode: ProbeMode = "eval",
    generator: torch.Generator | None = None,
) -> JacobianNorms:
    """‖∂x_l/∂x_{l−1}‖₂ (and ‖J − I‖₂) of each transformer block, for sequence ``sequence`` of the batch.

    Runs in ``probing(module, mode)``.

    Args:
        module: The model.
        forward: Runs the model once (a loss closure will do: only the blocks' inputs are read).
        block_patterns: ``fnmatch`` patterns naming the blocks; by default they are found by
            :func:`~spectral_monitor.probes.find_transformer_blocks`.
        sequence: Which sequence of the batch (which example, for (batch, features) inputs).
        residual_branch: Also ‖J − I‖₂, the norm of what each block adds to the stream.
        end_to_end: Also the norm of the composed map from the first block's input to the last block's
            output, when each block's input is the previous block's output.
        tol: Relative tolerance of each norm (that of :func:`~spectral_monitor.linalg.lanczos_eigsh`).
        max_iters: Most block Lanczos iterations per norm.
        warm: The ``warm`` vectors of the previous result, to start from.
        mode: ``"eval"`` or ``"train"``, the module's mode while probed.
        generator: The random generator of the cold starts.

    Returns:
        The norms per block (model order), the end-to-end norm, convergence flags and warm vectors.

    Raises:
        ValueError: No transformer block is found or named.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(2 * torch.eye(4))
        ...     _ = model[1].weight.copy_(3 * torch.eye(4))
        >>> x = torch.randn(2, 4)
        >>> norms = block_jacobian_norms(model, lambda: model(x), block_patterns=["0", "1"])
        >>> {block: round(norm, 4) for block, norm in norms.jacobian_norm.items()}
        {'0': 2.0, '1': 3.0}
        >>> round(norms.end_to_end_norm, 4)
        6.0
    """
    names = find_transformer_blocks(module, block_patterns)
    if not names:
        raise ValueError("no transformer block found; name the blocks with block_patterns")
    warm = warm or {}
    result = JacobianNorms()
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    with probing(module, mode):
        calls = _record_block_calls(module, names, forward)
        maps: dict[str, _LinearMap] = {}
        for name in names:
            call = calls.get(name)
            if call is None:
                result.skipped[name] = "it did not run in the forward"
                continue
            if not isinstance(call.input, Tensor) or call.input.dim() not in (2, 3):
                given = call.input
                shape = tuple(given.shape) if isinstance(given, Tensor) else type(given).__name__
                result.skipped[name] = (
                    f"its input is not a (batch, features) or (batch, tokens, features) tensor, got {shape}"
                )
                continue
            two_dimensional = call.input.dim() == 2
            batch_dim = 0 if two_dimensional or _batch_first(call.input, call.module) is call.input else 1
            maps[name] = _LinearMap(call, call.input, sequence, batch_dim)
        for name, linear in maps.items():
            norm, converged, vectors = _spectral_norm(
                linear, False, tol, max_iters, warm.get(name), generator
            )
            result.jacobian_norm[name], result.warm[name] = norm, vectors
            result.converged[name] = converged
            if residual_branch:
                key = f"{name}/residual"
                norm, converged, vectors = _spectral_norm(
                    linear, True, tol, max_iters, warm.get(key), generator
                )
                result.residual_branch_norm[name], result.warm[key] = norm, vectors
                result.converged[name] &= converged
        if end_to_end and maps:
            chain = [calls[name] for name in names if name in maps]
            reason = _not_a_chain(chain) if len(chain) == len(names) else "a block was not measured"
            if reason:
                result.skipped[END_TO_END] = reason
            else:
                first = maps[names[0]]

                def composed(x: Tensor) -> Tensor:
                    for call in chain:
                        x = call(x)
                    return x

                linear = _LinearMap(composed, chain[0].input, first.sequence, first.batch_dim)
                norm, converged, vectors = _spectral_norm(
                    linear, False, tol, max_iters, warm.get(END_TO_END), generator
                )
                result.end_to_end_norm, result.warm[END_TO_END] = norm, vectors
                result.converged[END_TO_END] = converged
    return result


def _record_block_calls(module: nn.Module, names: Sequence[str], forward: Callable[[], Any]) -> dict:
    modules = dict(module.named_modules())
    calls: dict[str, _BlockCall] = {}
    handles = []

    def recorder(name: str) -> Callable[..., None]:
        def record(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if name not in calls:
                out = output if isinstance(output, Tensor) else _first_tensor(output)
                detached = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
                calls[name] = _BlockCall(block, detached, dict(kwargs), None if out is None else out.detach())

        return record

    for name in names:
        handles.append(modules[name].register_forward_hook(recorder(name), with_kwargs=True))
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _not_a_chain(chain: Sequence[_BlockCall]) -> str | None:
    for before, after in zip(chain, chain[1:], strict=False):
        if before.output is None or not torch.equal(before.output, after.input):
            return "the blocks do not form a chain (a block's input is not the previous block's output)"
    return None


def _spectral_norm(
    linear: _LinearMap,
    minus_identity: bool,
    tol: float,
    max_iters: int,
    warm: Tensor | None,
    generator: torch.Generator,
) -> tuple[float, bool, Tensor]:
    def matmat(x: Tensor) -> Tensor:
        y = linear.jvp(x[0].transpose(0, 1)).transpose(0, 1)
        return (y - x[0] if minus_identity else y)[None]

    def rmatmat(x: Tensor) -> Tensor:
        y = linear.vjp(x[0].transpose(0, 1)).transpose(0, 1)
        return (y - x[0] if minus_identity else y)[None]

    op = FunctionOperator(
        matmat,
        rmatmat=rmatmat,
        batch=1,
        rows=linear.size,
        cols=linear.size,
        dtype=linear.x.dtype,
        device=linear.x.device,
    )
    init = warm[None] if warm is not None and warm.shape[0] == linear.size else None
    result = top_singular(
        op,
        1,
        block_size=2,
        tol=tol,
        max_iters=max_iters,
        init=init,
        generator=generator,
        return_vectors="right",
        failure_probability=CERTAINTY,
    )
    return float(result.values[0, 0]), bool(result.info.converged.all()), result.right[0].detach().clone()
