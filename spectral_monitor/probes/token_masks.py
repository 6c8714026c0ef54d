"""Which tokens of a forward are real, read from the padding masks its modules receive.

While a capture is armed, a pre-hook on every module reads the padding mask the module was given, by
keyword (the names are the ``real_token_mask_keywords`` and ``padding_mask_keywords`` of the capture's
:class:`~spectral_monitor.probes.AttentionFamilies`; by default those below), and keeps it while that
module's forward runs:

- ``attention_mask`` of shape (batch, tokens), as Hugging Face models take it: nonzero = real token. A module
  given ``attention_mask=None`` says its tokens are all real (the decoder of an encoder-decoder model run
  without ``decoder_attention_mask``); a 4-D ``attention_mask`` (the expanded mask attention layers get) says
  nothing here: attendable keys come from the attention kernel's own mask;
- ``src_key_padding_mask`` or ``tgt_key_padding_mask`` of shape (batch, tokens), as ``nn.Transformer``,
  ``nn.TransformerEncoder`` / ``Decoder`` and their layers take them: True (or ``-inf``) = padding.

An attention call, or a block output, with n query tokens takes the mask of the innermost running module
that gave one of n tokens; where none did, the batch's token mask given to ``arm()`` (for example from
``SpectralMonitor(token_mask=...)``) if it has n tokens; else every token is real.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from spectral_monitor.probes.attention_families import AttentionFamilies
from spectral_monitor.probes.wrappers import eager_named_modules, unwrapped_named_modules
from spectral_monitor.validation import check_instance

__all__ = ["ForwardTokenMasks", "checked_token_mask"]

_SAYS_NOTHING = object()


def checked_token_mask(token_mask: object, argument: str = "token_mask") -> Tensor | None:
    """A token mask as a (batch, tokens) bool tensor, True = real token.

    Args:
        token_mask: A bool or 0/1 (batch, tokens) tensor, or None.
        argument: The argument's name in the error.

    Returns:
        The bool mask, or None where ``token_mask`` is None.

    Raises:
        ValueError: ``token_mask`` is not a 2-D real tensor.

    Examples:
        >>> import torch
        >>> checked_token_mask(torch.tensor([[1, 1, 0]]))
        tensor([[ True,  True, False]])
    """
    if token_mask is None:
        return None
    if not isinstance(token_mask, Tensor) or token_mask.dim() != 2 or token_mask.is_complex():
        raise ValueError(
            f"{argument} must be a (batch, tokens) tensor, True or nonzero = real token, or None; got "
            f"{tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__}"
        )
    return token_mask if token_mask.dtype == torch.bool else token_mask != 0


class ForwardTokenMasks:
    """The real tokens said by the modules running now, and the batch's token mask as the fallback.

    Args:
        fallback: The batch's token mask, (batch, tokens) bool, True = real token.
        attention_families: Whose mask keywords are read (None: ``AttentionFamilies()``).

    Raises:
        ValueError: ``fallback`` is not a 2-D tensor, or ``attention_families`` not an
            ``AttentionFamilies``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class Counted(nn.Module):
        ...     def forward(self, x, src_key_padding_mask=None):
        ...         print(masks.real_tokens(x.shape[1], x.shape[0]))
        ...         return x
        >>> masks = ForwardTokenMasks(fallback=torch.tensor([[True, False]]))
        >>> model = Counted()
        >>> masks.install(model)
        >>> _ = model(torch.zeros(1, 3), src_key_padding_mask=torch.tensor([[False, False, True]]))
        tensor([[ True,  True, False]])
        >>> _ = model(torch.zeros(1, 2))
        tensor([[ True, False]])
        >>> masks.remove()
    """

    def __init__(
        self, fallback: Tensor | None = None, attention_families: AttentionFamilies | None = None
    ) -> None:
        self.fallback = checked_token_mask(fallback)
        self.attention_families = check_instance("attention_families", attention_families, AttentionFamilies)
        self._said: list[object] = []  # one entry per running module: a mask, None (all real) or nothing said
        self._handles: list[RemovableHandle] = []

    def install(self, model: nn.Module, *, every_module: bool = False) -> None:
        """Hook every module of a model outside torch.compile graphs, until :meth:`remove`.

        Args:
            model: The model.
            every_module: Inside compiled graphs too, for a forward run with compilation off.
        """
        modules = unwrapped_named_modules(model) if every_module else eager_named_modules(model)
        for _, module in modules:
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def remove(self) -> None:
        """Remove the hooks and forget what the modules said."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._said.clear()

    def real_tokens(self, tokens: int, batch: int) -> Tensor | None:
        """The real tokens of a computation, as the innermost running module that says so gives them.

        Args:
            tokens: The computation's number of tokens.
            batch: Its number of sequences.

        Returns:
            (batch, tokens) bool, True = real; None: all real.

        Raises:
            ValueError: The batch's token mask (``fallback``) has the computation's tokens but not its
                sequences: a mask of another batch.
        """
        for said in reversed(self._said):
            if said is _SAYS_NOTHING:
                continue
            if said is None:
                return None
            assert isinstance(said, Tensor)
            if said.shape == (batch, tokens):
                return said
        if self.fallback is not None and self.fallback.shape[1] == tokens:
            if self.fallback.shape[0] != batch:
                raise ValueError(
                    f"the token mask has {self.fallback.shape[0]} sequences of {tokens} tokens for a forward "
                    f"of {batch} sequences: token_mask must give the (batch, tokens) mask of the step's batch"
                )
            return self.fallback
        return None

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return  # traced into a compiled graph: the run is measured by a probe forward instead
        self._said.append(_said_by(kwargs, self.attention_families))

    def _exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self._said:
            self._said.pop()


def _said_by(kwargs: dict[str, Any], families: AttentionFamilies) -> object:
    """What a call's keyword arguments say of its tokens: a (B, n) bool mask, None (all real) or nothing."""
    for name in families.real_token_mask_keywords:
        if name in kwargs:
            mask = kwargs[name]
            if mask is None:
                return None
            if isinstance(mask, Tensor) and mask.dim() == 2 and not mask.is_nested:
                return mask.detach() != 0
    padding = [kwargs[name] for name in families.padding_mask_keywords if kwargs.get(name) is not None]
    if len(padding) == 1 and isinstance(padding[0], Tensor) and padding[0].dim() == 2:
        mask = padding[0].detach()
        return ~mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    return _SAYS_NOTHING
