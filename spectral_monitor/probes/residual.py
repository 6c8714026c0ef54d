"""Capture of the residual stream (the outputs of transformer blocks) on logging steps.

While armed, a forward hook on each block keeps a detached float32 copy of the block's output for the first
``max_sequences`` sequences of the batch, laid out (S, n, d) whatever the block's own layout, with the token
mask when it is known: from the block's own ``*_key_padding_mask``, else from the padding masks the forward's
modules received (:mod:`spectral_monitor.probes.token_masks`), else from the batch's token mask given to
``arm()``. Hooks exist only between arm and disarm; outputs are read, never modified.

Blocks are found automatically (``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``, Hugging Face
``GPT2Block`` and ``BertLayer``, and any ``*Block`` / ``*Layer`` module held in an ``nn.ModuleList`` named
``layers``, ``h``, ``blocks``, ``block`` (T5) or ``layer``) or named by ``fnmatch`` patterns.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from spectral_monitor.probes.attention_families import AttentionFamilies
from spectral_monitor.probes.attention_records import SkippedCapture
from spectral_monitor.probes.token_masks import ForwardTokenMasks, checked_token_mask
from spectral_monitor.probes.wrappers import unwrapped_named_modules, wrapped_module
from spectral_monitor.validation import check_instance

__all__ = ["ResidualCapture", "ResidualRecording", "ResidualSample", "find_transformer_blocks"]

_BLOCK_TYPES = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_BLOCK_CLASS_NAMES = frozenset({"GPT2Block", "BertLayer"})  # by name: transformers stays optional
_BLOCK_LIST_NAMES = frozenset({"layers", "h", "blocks", "block", "layer"})
_BLOCK_LIKE_CLASS_NAME = re.compile(r"(Block|Layer)$")
# Where a block's keyword arguments say which of its tokens are padding (True or -inf = padding).
_PADDING_MASK_ARGUMENTS = {
    nn.TransformerEncoderLayer: "src_key_padding_mask",
    nn.TransformerDecoderLayer: "tgt_key_padding_mask",
}


@dataclass
class ResidualSample:
    """The output of one block for the sampled sequences.

    Attributes:
        layer: The block's name.
        states: (S, n, d) float32, a detached copy.
        token_mask: (S, n) bool, True = real token, or ``None`` when unknown (or when every token is real).

    Examples:
        >>> import torch
        >>> ResidualSample("layers.0", torch.zeros(1, 5, 8), None).states.shape
        torch.Size([1, 5, 8])
    """

    layer: str
    states: Tensor
    token_mask: Tensor | None


@dataclass
class ResidualRecording:
    """The block outputs of one armed forward and the blocks not read; final on disarm.

    Attributes:
        states: One :class:`ResidualSample` per block that ran, in model order.
        skipped: The blocks not read, and why.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> with ResidualCapture(model, max_sequences=1).armed() as recording:
        ...     _ = model(torch.randn(3, 5, 8))
        >>> [(sample.layer, tuple(sample.states.shape)) for sample in recording.states], recording.skipped
        ([('layers.0', (1, 5, 8)), ('layers.1', (1, 5, 8))], [])
    """

    states: list[ResidualSample] = field(default_factory=list)
    skipped: list[SkippedCapture] = field(default_factory=list)


def find_transformer_blocks(model: nn.Module, patterns: Sequence[str] | None = None) -> list[str]:
    """The transformer blocks of a model.

    Args:
        model: The model, wrapped or not.
        patterns: ``fnmatch`` patterns over qualified module names; by default the blocks are found as the
            module docstring says. Blocks do not nest: a module inside a matching one is part of that block.

    Returns:
        The blocks' qualified names (the modules matching a pattern, with ``patterns``), in model
        (registration) order.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> find_transformer_blocks(model)
        ['layers.0', 'layers.1']
    """
    if patterns is not None:
        matched = [
            name
            for name, _ in unwrapped_named_modules(model)
            if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
        ]
        # Blocks do not nest: ``*`` crosses dots, and "blocks.*" names each block's parts too.
        return [name for name in matched if not any(name.startswith(f"{other}.") for other in matched)]
    in_block_list = set()
    for list_name, container in unwrapped_named_modules(model):
        if isinstance(container, nn.ModuleList) and list_name.rpartition(".")[2] in _BLOCK_LIST_NAMES:
            in_block_list.update(id(_innermost(child)) for child in container.children())
    blocks = []
    for name, module in unwrapped_named_modules(model):
        known = isinstance(module, _BLOCK_TYPES) or type(module).__name__ in _BLOCK_CLASS_NAMES
        block_like = (
            id(module) in in_block_list
            and _BLOCK_LIKE_CLASS_NAME.search(type(module).__name__) is not None
            and next(module.children(), None) is not None
        )
        if known or block_like:
            blocks.append(name)
    return blocks


class ResidualCapture:
    """Captures block outputs of ``model`` during armed forwards only; costs nothing otherwise.

    When a block runs several times in one armed forward only its first output is kept. A block that has
    left the model since is listed in ``recording.skipped``; so is, with ``strict=False``, a block whose
    output could not be read (an error while copying it), and the forward goes on.

    Args:
        model: The model.
        block_patterns: ``fnmatch`` patterns over qualified module names choosing the blocks (default: found
            by :func:`find_transformer_blocks`).
        max_sequences: The first sequences of the batch kept.
        strict: Raise an error met while reading a block's output into the forward.
        attention_families: The :class:`~spectral_monitor.probes.AttentionFamilies` whose mask keywords say
            which tokens are padding (None: ``AttentionFamilies()``).

    Attributes:
        blocks: The blocks' names, in model order.

    Raises:
        ValueError: ``model`` is not a module, ``max_sequences`` not a positive int, ``block_patterns``
            not a sequence of patterns, or no block is found.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> capture = ResidualCapture(model, block_patterns=["layers.1"])
        >>> recording = capture.arm()
        >>> _ = model(torch.randn(3, 5, 8))
        >>> [sample.layer for sample in capture.disarm().states], capture.is_armed
        (['layers.1'], False)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        block_patterns: Sequence[str] | None = None,
        max_sequences: int = 4,
        strict: bool = False,
        attention_families: AttentionFamilies | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(max_sequences, int) or isinstance(max_sequences, bool) or max_sequences < 1:
            raise ValueError(f"max_sequences must be a positive int, got {max_sequences!r}")
        if block_patterns is not None and (
            isinstance(block_patterns, str) or not all(isinstance(pattern, str) for pattern in block_patterns)
        ):
            raise ValueError(
                f"block_patterns must be a sequence of str patterns or None, got {block_patterns!r}"
            )
        self.model = model
        self.max_sequences = max_sequences
        self.strict = strict
        self.attention_families = check_instance("attention_families", attention_families, AttentionFamilies)
        self.blocks = tuple(find_transformer_blocks(model, block_patterns))
        if not self.blocks:
            if block_patterns is not None:
                raise ValueError(f"block_patterns {list(block_patterns)} match no module of the model")
            raise ValueError(
                "no transformer block found in the model; name its blocks with block_patterns "
                "(fnmatch patterns over qualified module names, e.g. ['encoder.layers.*']; the monitors' "
                "option of that name)"
            )
        self._handles: list[RemovableHandle] = []
        self._token_masks: ForwardTokenMasks | None = None
        self._recording: ResidualRecording | None = None

    @property
    def is_armed(self) -> bool:
        """Whether the hooks are installed."""
        return self._recording is not None

    def arm(self, token_mask: Tensor | None = None, *, every_module: bool = False) -> ResidualRecording:
        """Install the hooks for the next forward.

        Args:
            token_mask: (B, n) bool, True = real token, for blocks of n tokens of which neither their own
                arguments nor the modules around them say which tokens are padding.
            every_module: As :meth:`AttentionCapture.arm <spectral_monitor.probes.AttentionCapture.arm>`.

        Returns:
            The recording the hooks fill.

        Raises:
            RuntimeError: The capture is already armed.
            ValueError: ``token_mask`` is not a 2-D boolean tensor.
        """
        if self._recording is not None:
            raise RuntimeError("ResidualCapture is already armed; disarm() it first")
        token_masks = ForwardTokenMasks(checked_token_mask(token_mask), self.attention_families)
        recording = ResidualRecording()
        modules = dict(unwrapped_named_modules(self.model))
        seen: set[str] = set()
        for name in self.blocks:
            if name not in modules:
                recording.skipped.append(
                    SkippedCapture(name, "block no longer in the model; its series stop")
                )
                continue
            hook = self._output_hook(name, token_masks, recording, seen)
            self._handles.append(modules[name].register_forward_hook(hook, with_kwargs=True))
        token_masks.install(self.model, every_module=every_module)
        self._token_masks = token_masks
        self._recording = recording
        return recording

    def disarm(self) -> ResidualRecording:
        """Remove the hooks.

        Returns:
            The final recording, its states in model order.

        Raises:
            RuntimeError: The capture is not armed.
        """
        if self._recording is None:
            raise RuntimeError("ResidualCapture is not armed")
        recording, self._recording = self._recording, None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._token_masks is not None:
            self._token_masks.remove()
            self._token_masks = None
        order = {name: position for position, name in enumerate(self.blocks)}
        recording.states.sort(key=lambda sample: order[sample.layer])
        return recording

    @contextmanager
    def armed(self, token_mask: Tensor | None = None) -> Iterator[ResidualRecording]:
        """Context manager form of :meth:`arm` / :meth:`disarm`; disarms even if the forward raises.

        Args:
            token_mask: As :meth:`arm`'s.

        Yields:
            The recording the hooks fill.
        """
        recording = self.arm(token_mask)
        try:
            yield recording
        finally:
            self.disarm()

    def _output_hook(
        self, name: str, token_masks: ForwardTokenMasks, recording: ResidualRecording, seen: set[str]
    ) -> Callable[..., None]:
        def keep_output(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            if torch.compiler.is_compiling() or name in seen:
                return  # traced into a compiled graph (measured by a probe forward instead), or a later call
            seen.add(name)
            try:
                sample = self._sample(name, module, kwargs, output, token_masks)
            except Exception as error:
                if self.strict:
                    raise
                recording.skipped.append(SkippedCapture(name, f"capture failed: {error!r}"))
                return
            if isinstance(sample, str):
                recording.skipped.append(SkippedCapture(name, sample))
            else:
                recording.states.append(sample)

        return keep_output

    def _sample(
        self,
        name: str,
        module: nn.Module,
        kwargs: dict[str, Any],
        output: Any,
        token_masks: ForwardTokenMasks,
    ) -> ResidualSample | str:
        """A detached copy of the block's output for the sampled sequences, or why there is none."""
        states = output if isinstance(output, Tensor) else _first_tensor(output)
        if states is None or states.is_nested or states.dim() not in (2, 3):
            return f"output is not a (batch, tokens, features) tensor but {type(output).__name__}"
        with torch.no_grad():
            states = _batch_first(states, module)
            batch = states.shape[0]
            copy = states[: self.max_sequences].detach().to(torch.float32, copy=True).contiguous()
            mask = _token_mask(module, kwargs, token_masks, batch, copy.shape[0], copy.shape[1])
            mask = None if mask is None else mask.to(copy.device)
        return ResidualSample(name, copy, mask)


def _innermost(module: nn.Module) -> nn.Module:
    """What a stack of wrappers (FSDP, torch.compile, checkpoint_wrapper) around a block wraps."""
    inner = wrapped_module(module)
    while inner is not None:
        module, inner = inner, wrapped_module(inner)
    return module


def _first_tensor(output: Any) -> Tensor | None:
    if isinstance(output, (tuple, list)):
        return next((item for item in output if isinstance(item, Tensor)), None)
    return None


def _batch_first(states: Tensor, module: nn.Module) -> Tensor:
    """The block output as (B, n, d): unbatched (n, d) gains a batch of one, sequence-first is transposed."""
    if states.dim() == 2:
        return states.unsqueeze(0)
    attention = getattr(module, "self_attn", None)
    batch_first = getattr(attention, "batch_first", getattr(module, "batch_first", True))
    return states if batch_first else states.transpose(0, 1)


def _token_mask(
    module: nn.Module,
    kwargs: dict[str, Any],
    token_masks: ForwardTokenMasks,
    batch: int,
    sequences: int,
    tokens: int,
) -> Tensor | None:
    """True = real token, from the block's own padding-mask argument, else from the forward's padding masks
    or the batch's token mask."""
    mask = None
    for block_type, argument in _PADDING_MASK_ARGUMENTS.items():
        padding = kwargs.get(argument) if isinstance(module, block_type) else None
        if padding is not None and padding.dim() == 2:
            mask = ~padding if padding.dtype == torch.bool else ~torch.isneginf(padding)
    if mask is None:
        mask = token_masks.real_tokens(tokens, batch)
    if mask is None or mask.shape[1] != tokens:
        return None
    mask = mask[:sequences].to(torch.bool).clone()
    return None if bool(mask.all()) else mask
