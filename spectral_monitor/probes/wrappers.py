"""Module names as the user wrote them, through the wrappers that DDP, FSDP, torch.compile and activation
checkpointing put around a model or its parts; and where a model runs as torch.compile graphs.

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
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from torch import nn

__all__ = [
    "WRAPPED_MODULE_ATTRIBUTES",
    "compiled_attention_regions",
    "compiled_module_names",
    "eager_named_modules",
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
    """The module ``module`` wraps, or ``None`` when it is not a wrapper."""
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return module.module
    for attribute in WRAPPED_MODULE_ATTRIBUTES:
        inner = module._modules.get(attribute)
        if inner is not None:
            return inner
    return None


def unwrapped_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` as ``model.named_modules()``, without wrappers and without their name segments.

    The root is named ``""``; each module once, in the same (pre-)order as ``named_modules``.
    """
    for name, module, _, _ in _walk(model):
        yield name, module


def eager_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """:func:`unwrapped_named_modules` less those that run inside torch.compile graphs.

    A hook on a module inside a graph is traced into it, and a new hook (each armed step installs new ones)
    fails the graph's guards: it would recompile on every logging step.
    """
    for name, module, _, in_graph in _walk(model):
        if not in_graph:
            yield name, module


def compiled_module_names(model: nn.Module) -> list[str]:
    """Names (as :func:`unwrapped_named_modules` gives them) of the modules whose calls run compiled.

    Those wrapped by ``torch.compile`` (an ``OptimizedModule``), compiled in place (``module.compile()``),
    and a LightningModule Lightning compiled (``trainer.fit(torch.compile(model))`` sets its
    ``_compiler_ctx``). Everything below such a module runs inside its graphs.
    """
    return [name for name, _, compiled, _ in _walk(model) if compiled]


def compiled_attention_regions(model: nn.Module) -> list[str]:
    """The compiled modules (:func:`compiled_module_names`) that may run attention inside their graphs.

    The whole model, or a compiled module holding an ``nn.MultiheadAttention`` or a module whose class name
    says attention (``*Attention*``, ``*Attn*``): a transformer block compiled whole is one. A compiled
    module without attention (a block's MLP) is not.
    """
    names = compiled_module_names(model)
    modules = dict(unwrapped_named_modules(model))
    return [
        name
        for name in names
        if name == "" or any(_is_attention(module) for module in _subtree(modules[name]))
    ]


def _subtree(module: nn.Module) -> Iterator[nn.Module]:
    for _, inner in unwrapped_named_modules(module):
        yield inner


def _is_attention(module: nn.Module) -> bool:
    named_attention = _ATTENTION_CLASS_NAME.search(type(module).__name__) is not None
    return isinstance(module, nn.MultiheadAttention) or named_attention


_ATTENTION_CLASS_NAME = re.compile(r"(?i)attention|attn")


def _walk(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool, bool]]:
    """``(name, module, compiled, in_graph)`` of every non-wrapper module: ``compiled`` where a compiled call
    starts, ``in_graph`` for it and everything below it.

    Pre-order from an explicit stack: nested generators cost ~3 ms a walk on the demo model, and each
    logging step walks it for the capture and the weights.
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
