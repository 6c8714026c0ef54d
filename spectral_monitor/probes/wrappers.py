"""Module names as the user wrote them, through the wrappers that DDP, FSDP, torch.compile and activation
checkpointing put around a model or its parts; where a model runs as torch.compile graphs; and the probe
forward that measures such a model without touching its graphs.

``DistributedDataParallel`` keeps the model as ``module``, Lightning's strategies and Fabric wrap the
LightningModule as ``_forward_module``, FSDP (``FullyShardedDataParallel``) each wrapped unit as
``_fsdp_wrapped_module``, ``torch.compile`` as ``_orig_mod`` and ``checkpoint_wrapper`` as
``_checkpoint_wrapped_module``. ``named_modules`` spells those into every qualified name
(``_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attention``). The probes walk a model with
:func:`unwrapped_named_modules` instead, so a layer has one name however it is trained
(``blocks.0.attention``) and ``include``/``exclude`` patterns written for the plain model keep matching.
The wrappers themselves are not listed: they compute nothing of their own, and some (FSDP, torch.compile,
checkpoint_wrapper) forward attribute lookups to the wrapped module, so they would pass for a second copy.

A ``"module"`` segment is dropped only under ``DataParallel``/``DistributedDataParallel``, where it is the
wrapper's; a user's own submodule named ``module`` keeps its name.

A compiled model is measured by a probe forward (:func:`probe_forward`, :func:`forward_on_batch`): Dynamo
traces hooks and torch-function modes into its graphs and guards on them, so capturing inside a compiled
forward would recompile it and could change its arithmetic. The probe forward runs the same modules eagerly
on the same batch, after the training forward, and leaves no trace on the run: no gradient, every module's
training flag and every random stream as they were, no compilation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "WRAPPED_MODULE_ATTRIBUTES",
    "compiled_module_names",
    "data_parallel_unwrapped",
    "eager_named_modules",
    "forward_on_batch",
    "probe_forward",
    "unwrapped_named_modules",
    "wrapped_module",
]

WRAPPED_MODULE_ATTRIBUTES = (
    "_forward_module",
    "_fsdp_wrapped_module",
    "_orig_mod",
    "_checkpoint_wrapped_module",
)
"""Where a wrapper keeps the module it wraps (Lightning/Fabric, FSDP, torch.compile, checkpoint_wrapper)."""


def wrapped_module(module: nn.Module) -> nn.Module | None:
    """What a wrapper wraps.

    Args:
        module: A module, wrapper or not.

    Returns:
        The module ``module`` wraps, or ``None`` when it is not a wrapper.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.Linear(2, 2)
        >>> wrapped_module(torch.compile(layer)) is layer, wrapped_module(layer)
        (True, None)
    """
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return module.module
    for attribute in WRAPPED_MODULE_ATTRIBUTES:
        inner = module._modules.get(attribute)
        if inner is not None:
            return inner
    return None


def data_parallel_unwrapped(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` or ``FullyShardedDataParallel`` wrapper at the root of
    ``model`` holds, whose names are the model's own; else ``model``.

    Only these two: a compiled or Lightning-wrapped model stays as given, since how it is called decides how
    it is measured.

    Args:
        model: the model as training calls it.

    Returns:
        The wrapped module, or ``model`` itself.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> compiled = torch.compile(nn.Linear(2, 2))
        >>> data_parallel_unwrapped(compiled) is compiled
        True
    """
    wrappers: list[type[nn.Module]] = [nn.parallel.DistributedDataParallel]
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers.append(FullyShardedDataParallel)
    inner = wrapped_module(model) if isinstance(model, tuple(wrappers)) else None
    return model if inner is None else inner


def unwrapped_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` as ``model.named_modules()``, without wrappers and without their name segments.

    The root is named ``""``; each module once, in the same (pre-)order as ``named_modules``.

    Args:
        model: The model, wrapped or not.

    Yields:
        ``(name, module)`` of each module that is not a wrapper.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> compiled = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> [name for name, _ in compiled.named_modules()]
        ['', '_orig_mod', '_orig_mod.0', '_orig_mod.1']
        >>> [name for name, _ in unwrapped_named_modules(compiled)]
        ['', '0', '1']
    """
    for name, module, _, _ in _walk(model):
        yield name, module


def eager_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """:func:`unwrapped_named_modules` less those that run inside torch.compile graphs.

    A hook on a module inside a graph is traced into it, and a new hook (each armed step installs new ones)
    fails the graph's guards: it would recompile on every logging step.

    Args:
        model: The model, wrapped or not.

    Yields:
        ``(name, module)`` of each module that is neither a wrapper nor inside a compiled graph.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(torch.compile(nn.Linear(2, 2)), nn.ReLU())
        >>> [name for name, _ in eager_named_modules(model)]
        ['', '1']
    """
    for name, module, _, in_graph in _walk(model):
        if not in_graph:
            yield name, module


def compiled_module_names(model: nn.Module) -> list[str]:
    """Names (as :func:`unwrapped_named_modules` gives them) of the modules whose calls run compiled.

    Those wrapped by ``torch.compile`` (an ``OptimizedModule``), compiled in place (``module.compile()``),
    and a LightningModule Lightning compiled (``trainer.fit(torch.compile(model))`` sets its
    ``_compiler_ctx``). Everything below such a module runs inside its graphs.

    Args:
        model: The model, wrapped or not.

    Returns:
        The names, in module order.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> compiled_module_names(nn.Sequential(torch.compile(nn.Linear(2, 2)), nn.ReLU()))
        ['0']
    """
    return [name for name, _, compiled, _ in _walk(model) if compiled]


@contextmanager
def probe_forward(model: nn.Module) -> Iterator[None]:
    """The context of a forward of ``model`` that the training run does not see: compilation off
    (``torch.compiler.set_stance("force_eager")``: compiled modules run their plain code, nothing compiles),
    ``no_grad``, eval mode (no dropout), and the fused inference path of ``nn.MultiheadAttention`` off (the
    path a training forward takes, whose kernel inputs the attention capture reads). On exit, also on an
    error, every module's training flag and the CPU and CUDA random streams are as they were.

    Args:
        model: the module the forward runs (wrapped or compiled: its wrapper's call runs eagerly).

    Yields:
        Nothing: the forward runs inside the context.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> dropout = nn.Dropout(0.5)
        >>> with probe_forward(dropout):
        ...     dropout.training, torch.is_grad_enabled()
        (False, False)
        >>> dropout.training
        True
    """
    training = [(module, module.training) for module in model.modules()]
    fastpath = torch.backends.mha.get_fastpath_enabled()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), torch.compiler.set_stance("force_eager"):
            torch.backends.mha.set_fastpath_enabled(False)
            model.eval()
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for module, flag in training:
            module.training = flag


def forward_on_batch(model: nn.Module, batch: Any) -> Any:
    """``model``'s forward on ``batch`` as a training loop feeds it: ``model(**batch)`` for a mapping (a
    Hugging Face batch), ``model(batch[0])`` for a tuple or list (inputs, then targets), ``model(batch)``
    otherwise.

    Args:
        model: the module to call.
        batch: the step's batch, as given to the monitor.

    Returns:
        What ``model`` returns.

    Raises:
        ValueError: if ``batch`` is None or an empty tuple or list (no inputs to run the model on).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> forward_on_batch(nn.Identity(), (torch.ones(2), torch.zeros(2)))  # inputs, then targets
        tensor([1., 1.])
    """
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError("batch is an empty tuple or list: there are no inputs to run the model on")
        return model(batch[0])
    if batch is None:
        raise ValueError(
            "batch is None: a compiled model is measured by running it on the step's batch, so give the "
            "batch the model takes"
        )
    return model(batch)


def _walk(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool, bool]]:
    """``(name, module, compiled, in_graph)`` of every non-wrapper module: ``compiled`` where a compiled call
    starts, ``in_graph`` for it and everything below it.

    Pre-order from an explicit stack, not nested generators, which cost more than the walk itself: each
    logging step walks the model for the capture and the weights.
    """
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module, bool, bool]] = [("", model, False, False)]
    while stack:
        prefix, module, compiled, in_graph = stack.pop()
        inner = wrapped_module(module)
        if inner is not None:  # the wrapper takes no name of its own: its wrapped module takes its place
            stack.append((prefix, inner, compiled or _is_compiled_wrapper(module), in_graph))
            continue
        if id(module) in seen:
            continue
        seen.add(id(module))
        compiled = compiled or _is_compiled_in_place(module)
        in_graph = in_graph or compiled
        yield prefix, module, compiled, in_graph
        children = [
            (f"{prefix}.{name}" if prefix else name, child, False, in_graph)
            for name, child in module._modules.items()
            if child is not None
        ]
        stack.extend(reversed(children))


def _is_compiled_wrapper(module: nn.Module) -> bool:
    return "_orig_mod" in module._modules and type(module).__name__ == "OptimizedModule"


def _is_compiled_in_place(module: nn.Module) -> bool:
    return (
        getattr(module, "_compiled_call_impl", None) is not None
        or getattr(module, "_compiler_ctx", None) is not None
    )
