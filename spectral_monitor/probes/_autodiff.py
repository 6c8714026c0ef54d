"""Autograd plumbing shared by the curvature, Jacobian and NTK probes.

- :func:`probing`: the context every probe computes in, so that a probe leaves no trace on the model or the
  run: the global RNG streams forked, the math SDPA kernel (the only CPU kernel with a double backward),
  train/eval flags and buffers (BatchNorm running statistics) restored afterwards.
- :func:`batched_grad`: vector-Jacobian products for a batch of cotangents from one retained graph, with
  ``is_grads_batched`` (a vmap over the backward), a plain backward for a single vector, and a per-vector
  loop where an operator has no batching rule.

Products use ``torch.autograd.grad`` only, never ``.backward``: ``.grad`` of every parameter is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ProbeMode = Literal["eval", "train"]
PROBE_MODES = ("eval", "train")


@contextmanager
def probing(module: nn.Module, mode: ProbeMode = "eval") -> Iterator[None]:
    """Run a probe on ``module`` in ``mode`` without side effects on the module or the RNG streams.

    ``"eval"`` (deterministic: no dropout, BatchNorm uses its running statistics) or ``"train"`` (the
    training forward; dropout then draws from a forked stream). Buffers are copied before and written back
    after, so BatchNorm statistics a train-mode forward updates are restored.
    """
    if mode not in PROBE_MODES:
        raise ValueError(f"mode must be one of {PROBE_MODES}, got {mode!r}")
    training = {submodule: submodule.training for submodule in module.modules()}
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    devices = sorted({b.device.index or 0 for b in module.parameters() if b.device.type == "cuda"})
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        stack.enter_context(torch.enable_grad())
        module.train(mode == "train")
        try:
            yield
        finally:
            for submodule, was_training in training.items():
                submodule.training = was_training
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def batched_grad(
    outputs: Sequence[Tensor] | Tensor,
    inputs: Sequence[Tensor],
    cotangents: Sequence[Tensor],
    *,
    create_graph: bool = False,
) -> list[Tensor]:
    """∂⟨outputs, c⟩/∂inputs for each of a batch of cotangents ``c`` (leading dim k) from one graph.

    The graph of ``outputs`` is retained, so later calls reuse it (the cached graph that makes each
    Hessian-vector product a single backward). Inputs the outputs do not depend on get zeros.
    """
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    k = cotangents[0].shape[0]
    grads = None
    if k > 1:  # for one vector a plain backward is cheaper than is_grads_batched's vmap
        try:
            grads = torch.autograd.grad(
                outputs,
                inputs,
                grad_outputs=list(cotangents),
                retain_graph=True,
                create_graph=create_graph,
                is_grads_batched=True,
                allow_unused=True,
            )
        except RuntimeError as error:
            if "batching rule" not in str(error) and "vmap" not in str(error):
                raise
            # An operator without a batching rule in the backward: one backward per vector, below.
    if grads is None:
        columns = [
            torch.autograd.grad(
                outputs,
                inputs,
                grad_outputs=[c[i] for c in cotangents],
                retain_graph=True,
                create_graph=create_graph,
                allow_unused=True,
            )
            for i in range(k)
        ]
        grads = tuple(
            None if column[0] is None else torch.stack(column) for column in zip(*columns, strict=True)
        )
    return [
        torch.zeros((k, *x.shape), dtype=x.dtype, device=x.device) if g is None else g
        for g, x in zip(grads, inputs, strict=True)
    ]
