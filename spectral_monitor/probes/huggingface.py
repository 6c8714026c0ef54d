"""Hugging Face attention as users have it: ``eager`` attention seen, and what to do when attention is not.

A Hugging Face attention module computes its attention through a function it looks up at call time,
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``: for
``"sdpa"`` the registered ``sdpa_attention_forward``, which calls ``F.scaled_dot_product_attention`` (seen by
the attention capture's kernel mode); for ``"eager"`` the default, the ``eager_attention_forward`` global of
the module's modeling file, which computes softmax(scaling · q kᵀ + mask) with plain matrix products that no
kernel interception can tell apart from any other.

:func:`observe_eager_attention` makes that function visible for one armed forward: it replaces the
``eager_attention_forward`` global that each attention module's ``forward`` reads with a wrapper that runs
the original unchanged (same arguments, same result, no random numbers drawn) and then reports the call's
inputs in ``F.scaled_dot_product_attention``'s terms: q and k after projection and rotary embedding (keys of
grouped heads not yet repeated), the mask the model passed, the scale, ``is_causal=False`` (an eager function
applies no causal pattern of its own: causality is in its mask). Relative position biases that the eager
function adds to the logits (T5's ``position_bias``) are added to that mask, as ``sdpa_attention_forward``
merges them. Logit softcapping (Gemma 2's ``softcap``, ``cap · tanh(logits / cap)`` before the mask) is
reported as ``logit_softcap`` beside SDPA's arguments. Eager functions that change the softmax itself
(attention ``sinks``, an extra logit column per head) are reported as not capturable. Removing the
observation restores every global it replaced; nothing of transformers is imported here.

:func:`attention_not_seen_advice` names the fix when a forward made no attention call the capture could see:
the ``attn_implementation`` to switch a Hugging Face model to, or the extractor to register for attention
written by hand.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from spectral_monitor.probes.attention_families import AttentionFamilies
from spectral_monitor.probes.wrappers import unwrapped_named_modules
from spectral_monitor.validation import check_instance

__all__ = ["CAPTURED_IMPLEMENTATIONS", "attention_not_seen_advice", "observe_eager_attention"]

CAPTURED_IMPLEMENTATIONS = ("eager", "sdpa")
"""Hugging Face ``attn_implementation`` values whose attention the capture sees."""

_EAGER_FUNCTION_NAME = "eager_attention_forward"
_SOFTMAX_CHANGING_ARGUMENTS = ("sinks", "s_aux")

ScaledDotProductCall = Callable[[tuple[Any, ...], dict[str, Any]], None]
"""Receives one attention computation as the positional and keyword arguments of an equivalent
``F.scaled_dot_product_attention`` call, with ``logit_softcap`` (a float or None) among the keywords."""
UncapturableCall = Callable[[str, Exception | None], None]
"""Receives why one attention computation was not captured, and the error when reading it failed."""


def observe_eager_attention(
    model: nn.Module, on_call: ScaledDotProductCall, on_uncapturable: UncapturableCall
) -> Callable[[], None]:
    """Reports every eager attention call of ``model``'s Hugging Face attention modules until the returned
    function is called.

    ``on_call(args, kwargs)`` runs after the eager function returned, inside the attention module's forward;
    ``on_uncapturable(reason, None)`` instead, for an eager function whose logits are not q·k plus a mask,
    and ``on_uncapturable(reason, error)`` when reading the call failed (the receiver decides whether that
    error reaches the forward). Only calls whose module belongs to ``model`` are reported.

    Args:
        model: The model whose attention modules are observed.
        on_call: Receives each call's ``(args, kwargs)`` in ``F.scaled_dot_product_attention``'s terms.
        on_uncapturable: Receives ``(reason, error)`` for a call that cannot be reported.

    Returns:
        The function that ends the observation and restores every global replaced.

    Examples:
        A model without Hugging Face attention has nothing to observe:

        >>> from torch import nn
        >>> ignore = lambda *arguments: None
        >>> stop = observe_eager_attention(nn.Linear(2, 2), ignore, ignore)
        >>> stop()
    """
    own_modules = {id(module) for module in model.modules()}
    replaced: dict[int, tuple[dict[str, Any], Callable[..., Any], Callable[..., Any]]] = {}
    active = True

    def observed(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = _signature(original)

        def eager_attention_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            output = original(module, *args, **kwargs)
            if active and id(module) in own_modules and not torch.compiler.is_compiling():
                try:
                    call = signature.bind(module, *args, **kwargs)
                    call.apply_defaults()
                    _report(call.arguments, on_call, on_uncapturable)
                except Exception as error:
                    on_uncapturable(f"capture failed: {error!r}", error)
            return output

        eager_attention_forward.__wrapped__ = original  # type: ignore[attr-defined]
        return eager_attention_forward

    for _, module in unwrapped_named_modules(model):
        namespace = _eager_function_namespace(type(module))
        if namespace is None or id(namespace) in replaced:
            continue
        original = namespace[_EAGER_FUNCTION_NAME]
        wrapper = observed(original)
        replaced[id(namespace)] = (namespace, original, wrapper)
        namespace[_EAGER_FUNCTION_NAME] = wrapper

    def stop() -> None:
        nonlocal active
        active = False  # a wrapper that another observer wrapped in turn stays in place, inert
        for namespace, original, wrapper in replaced.values():
            if namespace.get(_EAGER_FUNCTION_NAME) is wrapper:
                namespace[_EAGER_FUNCTION_NAME] = original
        replaced.clear()

    return stop


def attention_not_seen_advice(model: nn.Module, attention_families: AttentionFamilies | None = None) -> str:
    """How to make a model's attention visible to the capture, as concretely as the model allows.

    Args:
        model: The model whose forward made no attention call the capture could see.
        attention_families: Which modules look like attention (None: ``AttentionFamilies()``).

    Returns:
        The advice: the ``attn_implementation`` to switch to, or the extractor to register.

    Raises:
        ValueError: ``attention_families`` is not an ``AttentionFamilies``.

    Examples:
        >>> from torch import nn
        >>> class Attention(nn.Module):
        ...     def forward(self, x):
        ...         return x
        >>> attention_not_seen_advice(nn.Sequential(Attention()))  # doctest: +ELLIPSIS
        'for attention written by hand, register an extractor ...register_attention_extractor(Attention, ...'
    """
    families = check_instance("attention_families", attention_families, AttentionFamilies)
    modules = [module for _, module in unwrapped_named_modules(model)]
    implementations = sorted(
        {
            implementation
            for module in modules
            if isinstance(
                implementation := getattr(getattr(module, "config", None), "_attn_implementation", None), str
            )
        }
    )
    uncaptured = [name for name in implementations if name not in CAPTURED_IMPLEMENTATIONS]
    if uncaptured:
        return (
            f"its Hugging Face attention runs attn_implementation={uncaptured[0]!r}, which the monitor "
            'cannot see; load the model with from_pretrained(..., attn_implementation="sdpa") or switch '
            'it with model.set_attn_implementation("sdpa") ("eager" is seen too)'
        )
    candidates = sorted(
        {type(module).__name__ for module in modules if families.looks_like_attention(module)}
    )
    target = candidates[0] if candidates else "MyAttention"
    extractor = (
        "register an extractor that returns its q, k, mask and scale: "
        f"spectral_monitor.probes.register_attention_extractor({target}, extractor)"
    )
    if implementations:
        return (
            f"its Hugging Face attention modules ({', '.join(candidates) or 'none found'}) did not call the "
            f"attention function of attn_implementation={implementations[0]!r} (GPT-2 with "
            'reorder_and_upcast_attn=True computes its own); try model.set_attn_implementation("sdpa"), or '
            + extractor
        )
    found = f" (modules that look like attention: {', '.join(candidates)})" if candidates else ""
    return f"for attention written by hand, {extractor}{found}"


def _report(
    arguments: dict[str, Any], on_call: ScaledDotProductCall, on_uncapturable: UncapturableCall
) -> None:
    extra = arguments.get("kwargs", {})
    changing = [
        name for name in _SOFTMAX_CHANGING_ARGUMENTS if arguments.get(name, extra.get(name)) is not None
    ]
    if changing:
        on_uncapturable(
            f"eager attention with {', '.join(changing)} adds logit columns to the softmax beyond the keys; "
            "not captured",
            None,
        )
        return
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    mask: Tensor | None = arguments.get("attention_mask")
    if mask is not None and mask.shape[-1] > key.shape[-2]:
        mask = mask[..., : key.shape[-2]]  # as the eager functions do with a mask longer than the keys
    position_bias = arguments.get("position_bias", extra.get("position_bias"))
    if position_bias is not None:
        mask = position_bias if mask is None else position_bias + mask
    softcap = arguments.get("softcap", extra.get("softcap"))
    on_call(
        (query, key, value),
        {
            "attn_mask": mask,
            "is_causal": False,
            "scale": arguments.get("scaling"),
            "logit_softcap": None if softcap is None else float(softcap),
        },
    )


@cache
def _eager_function_namespace(module_type: type) -> dict[str, Any] | None:
    """The globals in which ``module_type.forward`` looks up ``eager_attention_forward``, if it does."""
    forward = inspect.unwrap(getattr(module_type, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    if code is None or _EAGER_FUNCTION_NAME not in code.co_names:
        return None
    namespace = forward.__globals__
    return namespace if callable(namespace.get(_EAGER_FUNCTION_NAME)) else None


@cache
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)
