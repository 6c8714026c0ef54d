"""Capture of attention-kernel inputs on logging steps, and the attention probabilities they imply.

The training forward is never changed: no ``need_weights=True``, no patched ``nn.Module``. While a capture is
armed, and only then, these are installed:

- a :class:`torch.overrides.TorchFunctionMode` that sees the *outermost* attention-kernel call of every
  module, ``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` and everything built on it) or
  ``F.scaled_dot_product_attention`` (Hugging Face ``sdpa`` attention, nanoGPT-style code, also when the
  function was imported by name). It lets the kernel run untouched, then projects q and k for the first
  ``max_sequences`` sequences from the very arguments the kernel received (after ``batch_first``
  transposition and mask canonicalisation), so no layout or mask convention has to be re-derived from a
  module's public signature. One interception point serves both kernels, which a forward pre-hook on
  ``nn.MultiheadAttention`` could not: SDPA is a function, not a module.
- for Hugging Face ``eager`` attention, which runs through no kernel, a wrapper around the modeling file's
  attention function that reports its inputs in SDPA's terms (:mod:`spectral_monitor.probes.huggingface`);
- forward pre/post hooks on every submodule that keep a stack of qualified module names, so each kernel
  call is attributed to the innermost module that made it (``encoder.layers.0.self_attn``), and forward
  hooks that run the user's registered extractors for attention computed by hand.

What a capture records (:class:`CapturedAttention`, :class:`AttentionRecording`) and how a kernel call's
inputs become a record are in :mod:`spectral_monitor.probes.attention_records`; this module hooks the model.

Everything is removed on disarm. The kernel's arguments are read, never modified; the extra work runs under
``torch.no_grad``, consumes no random numbers and keeps detached copies of the sampled sequences only
(never views of the batch's activations). In train mode the forward is bit-identical with the capture armed.

Caveat: an active TorchFunctionMode disables the fused inference fast path of ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` (eval mode under ``no_grad``), which changes their outputs at rounding level.
Capture is meant for training-step forwards; when a forward could take that fast path the kernel capture is
not installed and the recording says why, so a user's evaluation is never altered.

When a module runs several times in one armed forward (a reused module, activation-checkpointing
recomputation) only its first call is kept. Layers are named without wrapper segments (DDP, FSDP,
torch.compile, checkpoint_wrapper: :mod:`spectral_monitor.probes.wrappers`), and no hook is placed on a
module inside a torch.compile graph (a new hook there forces a recompilation) unless
``arm(every_module=True)`` says the forward runs with compilation off. A hook or mode traced into a
compiled graph all the same (a model the monitor was given uncompiled, run through a compiled wrapper)
returns at once: Dynamo traces the check as a constant, so it adds nothing to the graph and breaks nothing.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from spectral_monitor.metrics.masks import additive_mask
from spectral_monitor.probes.attention_families import AttentionFamilies
from spectral_monitor.probes.attention_records import (
    BLOCKWISE_MIN_TOKENS,
    ROOT_LAYER_NAME,
    AttentionInputs,
    AttentionRecording,
    AttentionSample,
    CapturedAttention,
    LogitSoftcap,
    LogitTransform,
    SkippedCapture,
    dense_working_nbytes,
    fit_to_budget,
)
from spectral_monitor.probes.attention_sampling import captured_attention
from spectral_monitor.probes.huggingface import observe_eager_attention
from spectral_monitor.probes.token_masks import ForwardTokenMasks, checked_token_mask
from spectral_monitor.probes.wrappers import eager_named_modules, unwrapped_named_modules
from spectral_monitor.validation import check_instance

__all__ = [
    "BLOCKWISE_MIN_TOKENS",
    "ROOT_LAYER_NAME",
    "AttentionCapture",
    "AttentionExtractor",
    "AttentionInputs",
    "AttentionRecording",
    "AttentionSample",
    "CapturedAttention",
    "LogitSoftcap",
    "LogitTransform",
    "SkippedCapture",
    "dense_working_nbytes",
    "register_attention_extractor",
]

_MULTI_HEAD_ATTENTION_FORWARD = F.multi_head_attention_forward
_SCALED_DOT_PRODUCT_ATTENTION = F.scaled_dot_product_attention
_MULTI_HEAD_ATTENTION_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


AttentionExtractor = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], AttentionInputs | None]
"""``extractor(module, args, kwargs, output)`` -> the attention inputs of that call, or ``None`` to skip it.

Runs as a forward hook of the module on armed forwards only, under ``torch.no_grad``.
"""


# An OrderedDict, as torch's hook registries: RemovableHandle needs a weak reference to it.
_GLOBAL_EXTRACTORS: OrderedDict[int, tuple[type[nn.Module] | str, AttentionExtractor]] = OrderedDict()


def register_attention_extractor(
    target: type[nn.Module] | str, extractor: AttentionExtractor
) -> RemovableHandle:
    """Register how to read q, k, mask and scale from modules that compute attention by hand.

    ``target`` is a module type (matched with ``isinstance``) or an ``fnmatch`` pattern over qualified module
    names. Applies to every :class:`AttentionCapture` created afterwards; a capture's own ``extractors``
    take precedence, and a later registration over an earlier one.

    Args:
        target: A module type (matched with ``isinstance``) or an ``fnmatch`` pattern over qualified module
            names.
        extractor: Reads the call's :class:`AttentionInputs` (:data:`AttentionExtractor`).

    Returns:
        A handle whose ``remove()`` unregisters (also usable as a context manager).

    Raises:
        ValueError: ``target`` is neither, or ``extractor`` is not callable.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class HandWritten(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.qk = nn.Linear(8, 16)
        ...     def forward(self, x):
        ...         q, k = self.qk(x).chunk(2, dim=-1)
        ...         return torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ x
        >>> def read_q_and_k(module, args, kwargs, output):
        ...     q, k = module.qk(args[0]).chunk(2, dim=-1)
        ...     return AttentionInputs(q.unsqueeze(1), k.unsqueeze(1))  # one head
        >>> model = nn.Sequential(HandWritten())
        >>> with register_attention_extractor(HandWritten, read_q_and_k):
        ...     capture = AttentionCapture(model)
        ...     with capture.armed() as recording:
        ...         _ = model(torch.randn(2, 5, 8))
        >>> [captured.layer for captured in recording.captured]
        ['0']
    """
    _check_extractor_target("target", target, extractor)
    handle = RemovableHandle(_GLOBAL_EXTRACTORS)
    _GLOBAL_EXTRACTORS[handle.id] = (target, extractor)
    return handle


class AttentionCapture:
    """Captures the attention of ``model`` during armed forwards only; costs nothing otherwise.

    Use ``with capture.armed() as recording: model(batch)`` around a training-step forward, or ``arm()`` /
    ``disarm()`` from callback hooks that bracket it (arm before the forward, disarm before backward).
    The first ``max_sequences`` sequences of the batch are kept, so no random numbers are drawn.
    ``max_bytes`` bounds what a recording holds (q, k, masks and the float32 probabilities they expand to):
    over budget, fewer sequences, then fewer heads, then fewer layers (the last ones) are kept, each cut
    listed in ``recording.skipped``. ``extractors`` maps module types or name patterns to
    :data:`AttentionExtractor` functions for attention written by hand. ``attention_families``: the
    :class:`~spectral_monitor.probes.AttentionFamilies` whose mask keywords say which tokens are padding
    (None: ``AttentionFamilies()``). With ``strict=False`` an error while capturing one layer is recorded in
    ``skipped`` and the forward goes on; ``strict=True`` raises it.

    Args:
        model: The model.
        max_sequences: The first sequences of the batch kept.
        max_bytes: What a recording may hold, in bytes; None: no bound.
        extractors: Module types or name patterns → their :data:`AttentionExtractor`.
        attention_families: Whose mask keywords say which tokens are padding.
        strict: Raise an error met while capturing a layer into the forward.

    Raises:
        ValueError: ``model`` is not a module, ``max_sequences`` or ``max_bytes`` not a positive int, or
            an extractor's target or function is not valid.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> capture = AttentionCapture(model, max_sequences=1)
        >>> with capture.armed() as recording:
        ...     _ = model(torch.randn(3, 5, 8))
        >>> [(captured.layer, tuple(captured.q.shape)) for captured in recording.captured]
        [('layers.0.self_attn', (1, 2, 5, 4)), ('layers.1.self_attn', (1, 2, 5, 4))]
        >>> recording.samples()[0].probs.shape
        torch.Size([1, 2, 5, 5])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_sequences: int = 4,
        max_bytes: int | None = None,
        extractors: Mapping[type[nn.Module] | str, AttentionExtractor] | None = None,
        attention_families: AttentionFamilies | None = None,
        strict: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(max_sequences, int) or isinstance(max_sequences, bool) or max_sequences < 1:
            raise ValueError(f"max_sequences must be a positive int, got {max_sequences!r}")
        if max_bytes is not None and (
            not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1
        ):
            raise ValueError(f"max_bytes must be a positive int (bytes) or None, got {max_bytes!r}")
        for target, extractor in (extractors or {}).items():
            _check_extractor_target("extractors", target, extractor)
        self.model = model
        self.max_sequences = max_sequences
        self.max_bytes = max_bytes
        self.extractors = dict(extractors or {})
        self.attention_families = check_instance("attention_families", attention_families, AttentionFamilies)
        self.strict = strict
        self._armed: _ArmedForward | None = None

    @property
    def is_armed(self) -> bool:
        """Whether the capture is installed."""
        return self._armed is not None

    def arm(self, token_mask: Tensor | None = None, *, every_module: bool = False) -> AttentionRecording:
        """Install the capture for the next forward; returns the recording it fills.

        ``token_mask``: optional (B, n) bool, True = real token: the batch's real tokens, for attention calls
        with n queries where the forward's own padding masks say nothing
        (:mod:`spectral_monitor.probes.token_masks`). Padded queries are left out of every metric.
        ``every_module``: hook the modules inside torch.compile graphs too, for a forward that runs them
        eagerly (under ``torch.compiler.set_stance("force_eager")``).

        Args:
            token_mask: (B, n) bool, True = real token.
            every_module: Hook the modules inside compiled graphs too.

        Returns:
            The recording the capture fills.

        Raises:
            RuntimeError: The capture is already armed.
            ValueError: ``token_mask`` is not a 2-D boolean tensor.
        """
        if self._armed is not None:
            raise RuntimeError("AttentionCapture is already armed; disarm() it first")
        self._armed = _ArmedForward(self, checked_token_mask(token_mask), every_module)
        return self._armed.recording

    def disarm(self) -> AttentionRecording:
        """Remove everything ``arm()`` installed and apply the memory budget.

        Returns:
            The final recording.

        Raises:
            RuntimeError: The capture is not armed.
        """
        if self._armed is None:
            raise RuntimeError("AttentionCapture is not armed")
        armed, self._armed = self._armed, None
        return armed.close()

    @contextmanager
    def armed(self, token_mask: Tensor | None = None) -> Iterator[AttentionRecording]:
        """Context manager form of :meth:`arm` / :meth:`disarm`; disarms even if the forward raises.

        Args:
            token_mask: As :meth:`arm`'s.

        Yields:
            The recording the capture fills.
        """
        recording = self.arm(token_mask)
        try:
            yield recording
        finally:
            self.disarm()

    def _extractor_for(self, name: str, module: nn.Module) -> AttentionExtractor | None:
        for target, extractor in self.extractors.items():
            if _matches(target, name, module):
                return extractor
        for target, extractor in reversed(_GLOBAL_EXTRACTORS.values()):
            if _matches(target, name, module):
                return extractor
        return None


class _KernelCallMode(TorchFunctionMode):
    """Passes every torch function through unchanged, reporting attention-kernel calls after they ran.

    Torch pops the mode while its handler runs, so only outermost calls are seen and the capture's own
    tensor operations are not intercepted.
    """

    def __init__(self, on_kernel_call: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], None]):
        super().__init__()
        self._on_kernel_call = on_kernel_call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is _MULTI_HEAD_ATTENTION_FORWARD or func is _SCALED_DOT_PRODUCT_ATTENTION:
            self._on_kernel_call(func, args, kwargs)
        return result


class _ArmedForward:
    """The hooks and mode of one armed forward, and the recording they fill."""

    def __init__(self, capture: AttentionCapture, token_mask: Tensor | None, every_module: bool) -> None:
        self._capture = capture
        self._every_module = every_module
        self._token_masks = ForwardTokenMasks(token_mask, capture.attention_families)
        self.recording = AttentionRecording()
        self._names: list[str] = []
        self._seen: set[str] = set()
        self._extracted: set[str] = set()
        self._handles: list[RemovableHandle] = []
        self._mode: _KernelCallMode | None = None
        self._stop_observing_eager: Callable[[], None] | None = None
        try:
            self._install()
        except BaseException:
            self._remove()
            raise

    def _install(self) -> None:
        model = self._capture.model
        self._token_masks.install(model, every_module=self._every_module)
        walk = unwrapped_named_modules if self._every_module else eager_named_modules
        for name, module in walk(model):
            layer = name or ROOT_LAYER_NAME
            self._handles.append(module.register_forward_pre_hook(self._enter_hook(layer)))
            self._handles.append(module.register_forward_hook(self._exit_hook(layer), always_call=True))
            extractor = self._capture._extractor_for(name, module)
            if extractor is not None:
                self._extracted.add(layer)
                hook = self._extractor_hook(layer, extractor)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        fused = _module_with_fused_inference_path(self._capture.model)
        if fused is None:
            self._mode = _KernelCallMode(self._on_kernel_call)
            self._mode.__enter__()
        else:
            self.recording.skipped.append(
                SkippedCapture(
                    "*",
                    f"attention kernels not captured: {fused!r} is in eval mode under no_grad, where "
                    "capturing would disable its fused fast path and change its outputs "
                    "(capture training forwards)",
                )
            )

        # Hugging Face eager attention runs through no kernel; its attention function reports its inputs.
        self._stop_observing_eager = observe_eager_attention(
            self._capture.model,
            lambda args, kwargs: self._on_kernel_call(_SCALED_DOT_PRODUCT_ATTENTION, args, kwargs),
            self._on_uncapturable_call,
        )

    def close(self) -> AttentionRecording:
        self._remove()
        if self._capture.max_bytes is not None:
            fit_to_budget(self.recording, self._capture.max_bytes)
        return self.recording

    def _remove(self) -> None:
        self._token_masks.remove()
        if self._stop_observing_eager is not None:
            self._stop_observing_eager()
            self._stop_observing_eager = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._names.clear()

    def _enter_hook(self, layer: str) -> Callable[..., None]:
        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not torch.compiler.is_compiling():
                self._names.append(layer)

        return enter

    def _exit_hook(self, layer: str) -> Callable[..., None]:
        def exit_(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            if self._names and self._names[-1] == layer:
                self._names.pop()

        return exit_

    def _extractor_hook(self, layer: str, extractor: AttentionExtractor) -> Callable[..., None]:
        def extract(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if torch.compiler.is_compiling() or layer in self._seen:
                return
            self._seen.add(layer)
            self._record(
                layer,
                lambda: captured_attention(layer, extractor(module, args, kwargs, output), *self._sampling()),
            )

        return extract

    def _on_kernel_call(
        self, kernel: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if torch.compiler.is_compiling() or not self._names:
            return  # traced into a compiled graph, or not called from inside the captured model
        layer = self._names[-1]
        if layer in self._seen or layer in self._extracted:
            return
        self._seen.add(layer)
        if kernel is _MULTI_HEAD_ATTENTION_FORWARD:
            self._record(
                layer, lambda: _captured_multi_head_attention(layer, args, kwargs, *self._sampling())
            )
        else:
            self._record(
                layer,
                lambda: captured_attention(
                    layer, _scaled_dot_product_inputs(*args, **kwargs), *self._sampling()
                ),
            )

    def _on_uncapturable_call(self, reason: str, error: Exception | None) -> None:
        if torch.compiler.is_compiling():
            return
        if error is not None and self._capture.strict:
            raise error
        if not self._names or self._names[-1] in self._seen:
            return
        self._seen.add(self._names[-1])
        self.recording.skipped.append(SkippedCapture(self._names[-1], reason))

    def _sampling(self) -> tuple[int, ForwardTokenMasks]:
        return self._capture.max_sequences, self._token_masks

    def _record(self, layer: str, capture: Callable[[], CapturedAttention | None]) -> None:
        try:
            with torch.no_grad():
                captured = capture()
        except Exception as error:
            if self._capture.strict:
                raise
            self.recording.skipped.append(SkippedCapture(layer, f"capture failed: {error!r}"))
            return
        if captured is not None:
            self.recording.captured.append(captured)


def _scaled_dot_product_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    logit_softcap: float | None = None,
) -> AttentionInputs:
    """Binds the arguments of an ``F.scaled_dot_product_attention`` call (its builtin has no signature), and
    the softcap a Hugging Face eager attention call reports beside them."""
    transform = None if logit_softcap is None else LogitSoftcap(logit_softcap)
    return AttentionInputs(
        q=query, k=key, mask=attn_mask, causal=is_causal, scale=scale, logit_transform=transform
    )


def _captured_multi_head_attention(
    layer: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_sequences: int,
    token_masks: ForwardTokenMasks,
) -> CapturedAttention:
    """Projects q and k of the sampled sequences from an ``F.multi_head_attention_forward`` call's arguments.

    Mirrors the kernel: packed or separate projection weights, ``bias_k`` and ``add_zero_attn`` key columns,
    ``static_k``, bool (True = masked) or float masks, 2-D or 3-D ``attn_mask`` merged with
    ``key_padding_mask``; where the kernel runs causal SDPA and ignores ``attn_mask``, so does the capture.
    """
    call = _MULTI_HEAD_ATTENTION_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    arguments = call.arguments
    query, key = arguments["query"], arguments["key"]
    attn_mask, key_padding_mask = arguments["attn_mask"], arguments["key_padding_mask"]
    # nn.MultiheadAttention with batch_first transposes query and key apart when value differs (q = k ≠ v, as
    # DETR calls it): two views of one tensor, the same self-attention as one object.
    is_self_attention = _same_view(query, key)
    if query.dim() == 2:  # unbatched (n, E): the kernel adds a batch dimension of one
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    num_queries, batch, embed_dim = query.shape
    heads = arguments["num_heads"]
    head_dim = embed_dim // heads
    sequences = min(max_sequences, batch)

    projection_bias = arguments["in_proj_bias"]
    query_bias, key_bias = (None, None) if projection_bias is None else projection_bias.chunk(3)[:2]
    if arguments["use_separate_proj_weight"]:
        query_weight, key_weight = arguments["q_proj_weight"], arguments["k_proj_weight"]
    else:
        query_weight, key_weight, _ = arguments["in_proj_weight"].chunk(3)
    q = F.linear(query[:, :sequences], query_weight, query_bias)
    q = q.view(num_queries, sequences, heads, head_dim).permute(1, 2, 0, 3)

    extra_keys = 0
    if arguments["static_k"] is None:
        k = F.linear(key[:, :sequences], key_weight, key_bias)
        if arguments["bias_k"] is not None:
            k = torch.cat([k, arguments["bias_k"].expand(1, sequences, embed_dim)])
            extra_keys += 1
        k = k.view(k.shape[0], sequences, heads, head_dim).permute(1, 2, 0, 3)
    else:
        k = arguments["static_k"].view(batch, heads, -1, head_dim)[:sequences]
    if arguments["add_zero_attn"]:
        k = torch.cat([k, k.new_zeros(sequences, heads, 1, head_dim)], dim=2)
        extra_keys += 1

    # The kernel either runs causal SDPA and ignores attn_mask, or applies the merged masks; with a truthful
    # is_causal hint and no extra key columns both give the same attention, and ``causal`` stays informative.
    is_causal = bool(arguments["is_causal"])
    kernel_ignores_attn_mask = is_causal and key_padding_mask is None and not arguments["need_weights"]
    causal = is_causal and (kernel_ignores_attn_mask or extra_keys == 0)
    mask = None
    if attn_mask is not None and not kernel_ignores_attn_mask:
        mask = additive_mask(attn_mask, true_means_masked=True)
        if mask.dim() == 2:
            mask = mask.view(1, 1, *mask.shape)
        else:
            mask = mask.view(batch, heads, *mask.shape[-2:])[:sequences]
    padded_queries = None
    if key_padding_mask is not None:
        padding = additive_mask(key_padding_mask[:sequences], true_means_masked=True)
        if is_self_attention:
            padded_queries = torch.isneginf(padding)
        padding = padding.view(sequences, 1, 1, -1)
        mask = padding if mask is None else mask + padding
    if mask is not None and extra_keys:
        mask = F.pad(mask, (0, extra_keys))
    inputs = AttentionInputs(q=q, k=k, mask=mask, causal=causal, scale=1.0 / math.sqrt(head_dim))
    return captured_attention(layer, inputs, sequences, token_masks, padded_queries, batch)


def _same_view(first: Tensor, second: Tensor) -> bool:
    """Whether two tensors are the same elements: one object, or views of one storage with equal offset,
    shape and strides."""
    return first is second or (
        first.dtype == second.dtype
        and first.shape == second.shape
        and first.stride() == second.stride()
        and first.data_ptr() == second.data_ptr()
    )


def _module_with_fused_inference_path(model: nn.Module) -> str | None:
    """The name of a module whose fused inference fast path an active TorchFunctionMode would disable."""
    if not torch.backends.mha.get_fastpath_enabled():
        return None
    grad_enabled = torch.is_grad_enabled()
    for name, module in unwrapped_named_modules(model):
        if not isinstance(module, (nn.MultiheadAttention, nn.TransformerEncoderLayer)) or module.training:
            continue
        trainable = any(parameter.requires_grad for parameter in module.parameters())
        if not (grad_enabled and trainable):  # torch's own condition for leaving the fast path
            return name or ROOT_LAYER_NAME
    return None


def _check_extractor_target(argument: str, target: object, extractor: object) -> None:
    is_module_type = isinstance(target, type) and issubclass(target, nn.Module)
    if not (is_module_type or isinstance(target, str)):
        raise ValueError(
            f"{argument}: a target must be an nn.Module subclass or a module-name pattern (str), "
            f"got {target!r}"
        )
    if not callable(extractor):
        raise ValueError(f"{argument}: the extractor for {target!r} must be callable, got {extractor!r}")


def _matches(target: type[nn.Module] | str, name: str, module: nn.Module) -> bool:
    if isinstance(target, str):
        return fnmatch.fnmatchcase(name or ROOT_LAYER_NAME, target)
    return isinstance(module, target)
